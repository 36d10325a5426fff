"""How long a command will take, said in one line before it starts.

`sweep`, `bench` and `profile` know their configs before they run any: how many decodes each config runs, at
which batch, and how many decode steps each decode takes (all of them with EOS off; with a length distribution,
the expected number, `expected_steps`). What they cannot know in advance is how long a step takes on this
machine under its current load: a busy shared CPU ran the default sweep 15 times slower than an idle one. `probe`
times it here, once per model: per mode, short decodes at the smallest and at the largest batch, with the configs'
prompt and cache length (the first warms up and captures, the median of the next three counts). `Clock` turns
that into seconds per decode (prefill + steps x step time, interpolated in batch), and `announce` into the line:

    sweep: 24 configs to run (none in results/sweep.csv yet); estimate ~63 s: 76 decodes, ~27,000 steps expected,
    at 1.2-3.8 ms/step and 3-36 ms/prefill timed here (short step-graph decodes at batch 1 and 64, standing for
    every mode: none is captured without CUDA); model loads and captures not counted

(the default sweep on a shared 2-core CPU, whose configs then took 85 s as its load rose from 0.4 to 2).

It leaves out what a short decode cannot show: model loads, graph captures, torch.compile (compiled kernels and
peers are timed as HF's kernels), the profiler's own overhead, and a machine whose load changes mid-run.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["Clock", "Work", "announce", "duration", "expected_steps", "probe"]

# Decode steps of a probe decode, and the decodes timed after its warm-up (the median counts: a shared machine
# stalls one now and then): enough to average a step, few enough to cost about a second on a loaded 2-core CPU.
PROBE_STEPS = 8
PROBE_TIMED = 3


@dataclass(frozen=True)
class Work:
    """Decodes one config runs: `decodes` of them at `batch`, each a prefill and `steps` decode steps (expected),
    in `mode` (the mode timed in place of a runner that is no gdtool mode)."""
    mode: str
    batch: int
    decodes: int
    steps: float


@dataclass
class Clock:
    """Seconds per prefill and per decode step measured by `probe`: {mode: {batch: (prefill_s, step_s)}}."""
    points: dict = field(default_factory=dict)
    uncaptured: bool = False  # no CUDA device: one mode timed for all (`probe`)

    def _at(self, mode: str, batch: int) -> tuple[float, float]:
        table = self.points.get(mode) or next(iter(self.points.values()))
        batches = sorted(table)
        if batch <= batches[0] or len(batches) == 1:
            return table[batches[0]]
        if batch >= batches[-1]:
            return table[batches[-1]]
        low = max(b for b in batches if b <= batch)
        high = min(b for b in batches if b >= batch)
        if low == high:
            return table[low]
        share = (batch - low) / (high - low)
        return tuple(a + share * (b - a) for a, b in zip(table[low], table[high]))

    def seconds(self, works) -> float:
        """Seconds the decodes of `works` take at the measured rates."""
        total = 0.0
        for work in works:
            prefill_s, step_s = self._at(work.mode, work.batch)
            total += work.decodes * (prefill_s + work.steps * step_s)
        return total

    def basis(self) -> str:
        """What the rates are: ``0.8-2.1 ms/step and 4-60 ms/prefill timed here (short step-graph decodes at batch
        1 and 64)``."""
        rates = [rate for table in self.points.values() for rate in table.values()]
        steps = _span(r[1] * 1e3 for r in rates)
        prefills = _span(r[0] * 1e3 for r in rates)
        batches = sorted({b for table in self.points.values() for b in table})
        modes = ", ".join(self.points)
        alone = ", standing for every mode: none is captured without CUDA" if self.uncaptured else ""
        return (f"{steps} ms/step and {prefills} ms/prefill timed here (short {modes} decodes at batch "
                f"{' and '.join(map(str, batches))}{alone})")


def _span(values) -> str:
    values = sorted(values)
    low, high = _figure(values[0]), _figure(values[-1])
    return low if low == high else f"{low}-{high}"


def _figure(value: float) -> str:
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def expected_steps(lengths, batch: int, poll: str, max_new_tokens: int) -> float:
    """Decode steps one decode is expected to run: all ``max_new_tokens - 1`` with EOS off or polling ``never``;
    else until the batch's longest row ends (its expectation over the length distribution, rounded up to the
    polling interval), as `gdtool.measure.costmodel.steps_and_polls` counts them. ``default`` polls as interval 1
    (a device loop stops right after the last row)."""
    import numpy as np
    from ..measure import costmodel, workloads
    dist = workloads.parse(lengths)
    if not dist.eos:
        return float(max(max_new_tokens - 1, 0))
    values, probs = workloads.max_pmf(dist, batch, max_new_tokens)
    steps, _ = costmodel.steps_and_polls(values, "1" if poll == "default" else poll, max_new_tokens)
    return float(np.dot(steps, probs))


def probe(model, modes, batches, prompt_len: int, max_new_tokens: int, steps: int = PROBE_STEPS) -> Clock:
    """Time a prefill and a decode step of `model` per mode at the smallest and largest of `batches`: decodes of
    ``steps + 1`` tokens (rows end there, forced EOS) in a cache sized for ``max_new_tokens``, one to warm up
    (and capture), then `PROBE_TIMED`, whose medians count. HF's kernels, this process's threads. Without CUDA
    only the first mode is timed: every mode runs the same step uncaptured there."""
    import torch
    from ..core.models import eos_ids, random_prompts
    from ..core.modes import SPECS
    from ..loops.decoder import Decoder
    tokens = max(2, min(steps + 1, max_new_tokens))
    modes = list(dict.fromkeys(modes))
    clock = Clock()
    if next(model.parameters()).device.type != "cuda":
        modes, clock.uncaptured = modes[:1], True  # every mode runs the same step uncaptured: one stands for all
    for mode in modes:
        settings = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_ids(model))
        if SPECS[mode].host_steps:
            settings["eos_poll_interval"] = 1  # stop right after the forced EOS, whatever the mode's default
        for batch in sorted({min(batches), max(batches)}):
            prompt = random_prompts(model, batch=batch, lengths=prompt_len, seed=0)
            targets = torch.full((batch,), tokens, dtype=torch.long)
            decoder = Decoder(model, mode, max_graphs=1, **settings)
            prefills, steps_s = [], []
            try:
                for run in range(1 + PROBE_TIMED):
                    out = decoder.generate(prompt.input_ids, prompt.attention_mask, seed=0, target_lengths=targets)
                    if run:  # the first warmed up (and captured)
                        prefills.append(float(out.timings["prefill_s"]))
                        steps_s.append(float(out.timings["decode_s"]) / max(int(out.steps), 1))
            finally:
                decoder.close()
            clock.points.setdefault(mode, {})[batch] = (statistics.median(prefills), statistics.median(steps_s))
    return clock


def duration(seconds: float) -> str:
    """``~40 s``, ``~3.5 min``, ``~2.1 h``: two figures at most, as an estimate deserves."""
    if not math.isfinite(seconds):
        return "unknown"
    if seconds < 90:
        return f"~{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        minutes = seconds / 60
        return f"~{minutes:.1f} min" if minutes < 10 else f"~{minutes:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def announce(command: str, to_run: int, total: int, where: str, clock: Clock | None = None, works=(),
             left_out: str = "model loads and captures not counted", model: str | None = None) -> str:
    """The line a command prints before it starts: configs to run, those already in `where` (None: no results
    file to resume from), and the estimate with what it rests on; with nothing to run, it says so."""
    whose = f"{model}: " if model else ""
    done = total - to_run
    held = f"{done} of {total} already in {where}, same config hash: skipped" if done else f"none in {where} yet"
    head = f"{command}: {whose}{to_run} config{'s' if to_run != 1 else ''} to run" + (f" ({held})" if where else "")
    if not to_run:
        return f"{head}; nothing to measure (--redo measures them again)"
    if done:
        head += " (--redo measures them again)"
    if clock is None:
        return head
    works = list(works)
    decodes = sum(w.decodes for w in works)
    steps = sum(w.decodes * w.steps for w in works)
    return (f"{head}; estimate {duration(clock.seconds(works))}: {decodes:,} decodes, ~{_round(steps):,} steps "
            f"expected, at {clock.basis()}; {left_out}")


def _round(value: float) -> int:
    """Two significant figures: an expectation, not a count."""
    if value < 100:
        return int(round(value))
    scale = 10 ** (int(math.log10(value)) - 1)
    return int(round(value / scale) * scale)
