"""The schedule of a rollout from its response lengths alone: decode steps, row-steps and prefills per refill
policy, and which sequence each slot decodes at each step.

`gdtool.rollout` counts these figures on the device (`RolloutOutput.decode_steps`, `row_steps`, `prefills`). With
every length known in advance (forced EOS, `target_lengths`) they follow from the lengths, the slot count and
the admission rule, and this module computes them without a model:

    off     batches of `slots` consecutive sequences; a batch's prefill makes each row's first token, then
            it runs max(L) - 1 steps (the device loop stops right after its last row ends). Row-steps:
            rows x (steps + 1) per batch.
    host,   after each step, while the queue is not empty and at least min(refill_after, queue left, slots)
    device  slots are free, the next g sequences take the first g free slots, g the largest refill size
            (`refill_rows` and the powers of two below it) no larger than the free slots and the queue left; one
            prefill makes their first tokens (a sequence of length 1 ends there and frees its slot again). The
            rollout ends when no slot is decoding and the queue is empty. Row-steps: slots x steps + one per
            sequence (the device counts every slot at every step, finished or not).

Fewer sequences than `slots` run in as many rows as there are sequences, as gdtool.rollout runs them.

The share of row-steps that made a kept token is useful / row_steps. With a time per step and per prefill the
schedule prices a rollout (`predict`); `schedule(..., occupancy=True)` also returns the slot map that
notebook 04 draws.

    from gdtool.measure import rollouts, workloads
    lengths = workloads.parse("geom:128:512").draw(batch=1024, seed=0)
    rollouts.schedule(lengths, slots=64, refill="off").share       # 0.26
    rollouts.schedule(lengths, slots=64, refill="device").share    # 0.85
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.rollout_step import REFILL_ROWS, default_refill_after, refill_sizes

__all__ = ["REFILLS", "Schedule", "schedule", "predict_s"]

REFILLS = ("off", "host", "device")
IDLE = -1   # an occupancy cell where the slot made no kept token


@dataclass(frozen=True)
class Schedule:
    refill: str
    slots: int
    useful: int          # tokens kept: the sum of the lengths
    steps: int           # decode steps (all batches, for "off")
    row_steps: int       # what the device counts: see the module doc
    prefills: int        # "off": batch prefills; refill: prefill forwards (one per refill of g sequences)
    occupancy: np.ndarray | None = None   # [steps, slots]: the sequence each slot decoded at each step, or IDLE
    refill_sizes: tuple = ()   # refill: (g, refills of g sequences) per size that ran, largest first

    @property
    def share(self) -> float:
        return self.useful / self.row_steps if self.row_steps else 0.0


def _lengths(lengths) -> np.ndarray:
    values = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if values.size == 0 or (values < 1).any():
        raise ValueError("lengths: one length >= 1 per sequence (tokens up to and including EOS)")
    return values


def schedule(lengths, slots: int, refill: str = "device", occupancy: bool = False, refill_rows: int = REFILL_ROWS,
             refill_after: int | None = None) -> Schedule:
    """The schedule of sequences of `lengths` (in queue order) through `slots` rows under `refill` (with
    gdtool.rollout's `refill_rows` and `refill_after`, its defaults where not given)."""
    if refill not in REFILLS:
        raise ValueError(f"refill={refill!r}: use one of {', '.join(REFILLS)}")
    for name, value in (("slots", slots), ("refill_rows", refill_rows), ("refill_after", refill_after)):
        if value is None and name == "refill_after":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: use an int >= 1")
    values = _lengths(lengths)
    rows = min(int(slots), values.size)   # gdtool.rollout allocates no row that would never hold a sequence
    if refill == "off":
        return _static(values, rows, occupancy)
    after = default_refill_after(rows) if refill_after is None else int(refill_after)
    return _refilled(values, rows, refill, occupancy, int(refill_rows), after)


def _static(lengths: np.ndarray, slots: int, occupancy: bool) -> Schedule:
    steps = row_steps = 0
    columns = []
    for first in range(0, lengths.size, slots):
        batch = lengths[first:first + slots]
        n = int(batch.max()) - 1
        steps += n
        row_steps += batch.size * (n + 1)
        if occupancy:
            step = np.arange(1, n + 1)[:, None]                     # token step + 1 comes from step `step`
            ids = np.full((n, slots), IDLE, dtype=np.int64)
            live = step <= (batch[None, :] - 1)
            ids[:, :batch.size] = np.where(live, np.arange(first, first + batch.size)[None, :], IDLE)
            columns.append(ids)
    grid = np.concatenate(columns) if occupancy and columns else (np.zeros((0, slots), np.int64) if occupancy else None)
    return Schedule("off", slots, int(lengths.sum()), steps, row_steps, -(-lengths.size // slots), grid)


def _refilled(lengths: np.ndarray, slots: int, refill: str, occupancy: bool, refill_rows: int,
              refill_after: int) -> Schedule:
    remaining = np.zeros(slots, dtype=np.int64)     # tokens a slot still has to make (0: free)
    sequence = np.full(slots, IDLE, dtype=np.int64)
    sizes = refill_sizes(refill_rows, slots, lengths.size)
    counts = dict.fromkeys(sizes, 0)
    queue, steps = 0, 0
    rows = []

    def settle():
        nonlocal queue
        while queue < lengths.size:
            left = lengths.size - queue
            free = np.flatnonzero(remaining == 0)
            if free.size < min(refill_after, left, slots):
                return
            g = next(size for size in sizes if size <= min(free.size, left))
            for slot in free[:g]:
                sequence[slot] = queue
                remaining[slot] = lengths[queue] - 1     # the refill makes the first token
                queue += 1
            counts[g] += 1

    settle()
    while (remaining > 0).any():
        live = remaining > 0
        if occupancy:
            rows.append(np.where(live, sequence, IDLE))
        remaining[live] -= 1
        steps += 1
        settle()
    grid = (np.stack(rows) if rows else np.zeros((0, slots), np.int64)) if occupancy else None
    return Schedule(refill, slots, int(lengths.sum()), steps, slots * steps + int(lengths.size),
                    sum(counts.values()), grid, tuple((g, n) for g, n in counts.items() if n))


def predict_s(plan: Schedule, step_s: float, prefill_s) -> float:
    """Seconds of a rollout by its schedule: steps x `step_s` + its prefills, each `prefill_s` (a batch's prefill
    for "off", one refill otherwise), or `prefill_s[g]` for a refill of g sequences where it is a mapping.
    Setup, capture and read-back are left out."""
    if isinstance(prefill_s, dict):
        missing = [g for g, _ in plan.refill_sizes if g not in prefill_s]
        if missing:
            raise ValueError(f"prefill_s has no time for refills of {missing[0]} sequences (the schedule ran "
                             f"{dict(plan.refill_sizes)})")
        return plan.steps * step_s + sum(n * prefill_s[g] for g, n in plan.refill_sizes)
    return plan.steps * step_s + plan.prefills * prefill_s
