"""gdtool.measure.rollouts: the schedule computed from the lengths alone is what gdtool.rollout counts (decode
steps, row-steps, prefills, the slot each sequence ran in) at forced lengths, for every refill policy. Seeded
draws of prompt count, slots and length shapes: all equal, all 1, EOS at the first step, every row at the cap,
long tails. Plus a case worked by hand and the bad input."""
import random

import numpy as np
import pytest
import torch

import gdtool
from gdtool.measure import rollouts

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread
N = 9
SHAPES = ("equal", "ones", "cap", "tail", "uniform")
_model: list = []


def _tiny():
    if not _model:
        _model.append(gdtool.load_model("tiny-llama", seed=0, dtype=torch.float32))
    return _model[0]


def _lengths(rng: random.Random, shape: str, count: int) -> list[int]:
    if shape == "equal":
        return [rng.randint(1, N)] * count
    if shape == "ones":
        return [1] * count
    if shape == "cap":
        return [N] * count
    if shape == "tail":
        return [N if rng.random() < 0.15 else rng.randint(1, 2) for _ in range(count)]
    return [rng.randint(1, N) for _ in range(count)]


def test_worked_by_hand():
    # 3 sequences of lengths 3, 1, 2 through 2 slots
    off = rollouts.schedule([3, 1, 2], slots=2, refill="off", occupancy=True)
    # batch 1 (3, 1): 2 steps, 2 rows x 3; batch 2 (2): 1 step, 1 row x 2
    assert (off.steps, off.row_steps, off.prefills, off.useful) == (3, 8, 2, 6)
    assert off.occupancy.tolist() == [[0, -1], [0, -1], [2, -1]]
    one = rollouts.schedule([3, 1, 2], slots=2, refill="device", occupancy=True, refill_rows=1)
    # fill: seq 0 -> slot 0, seq 1 -> slot 1 ends at its refill, seq 2 -> slot 1; step 1: both; step 2: slot 0
    assert (one.steps, one.row_steps, one.prefills, one.refill_sizes) == (2, 2 * 2 + 3, 3, ((1, 3),))
    assert one.occupancy.tolist() == [[0, 2], [0, -1]]
    assert one.share == pytest.approx(6 / 7)
    # two rows a refill: seqs 0 and 1 in one prefill (slots 0, 1), seq 1 ends there, seq 2 -> slot 1 alone
    dev = rollouts.schedule([3, 1, 2], slots=2, refill="device", occupancy=True)
    assert (dev.steps, dev.row_steps, dev.prefills, dev.refill_sizes) == (2, 7, 2, ((2, 1), (1, 1)))
    assert dev.occupancy.tolist() == one.occupancy.tolist()
    # lengths 3, 1, 2, 2. At once: seqs 0 and 1 in one prefill (1 ends there), 2 alone in slot 1; step 1: 0 and 2,
    # 2 ends and 3 takes slot 1; step 2: 0 and 3
    now = rollouts.schedule([3, 1, 2, 2], slots=2, refill="device", occupancy=True)
    assert now.occupancy.tolist() == [[0, 2], [0, 3]] and now.refill_sizes == ((2, 1), (1, 2))
    # refill_after=2: slot 1, freed by seq 1, waits for a second free slot (2 sequences are left); it comes when
    # seq 0 ends after step 2, and one prefill starts seqs 2 and 3
    late = rollouts.schedule([3, 1, 2, 2], slots=2, refill="device", occupancy=True, refill_after=2)
    assert late.occupancy.tolist() == [[0, -1], [0, -1], [2, 3]] and late.refill_sizes == ((2, 2),)


@pytest.mark.parametrize("seed", range(6))
def test_schedule_is_what_the_rollout_counts(seed):
    rng = random.Random(seed)
    model = _tiny()
    count = rng.randint(1, 13)
    slots = rng.choice([1, 2, 3, 5, 8, 16])
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randint(1, 6))] for _ in range(count)]
    targets = _lengths(rng, SHAPES[seed % len(SHAPES)], count)
    shape = dict(refill_rows=rng.choice([1, 2, 3, 8]), refill_after=rng.choice([1, 1, 2, 4]))
    for refill in rollouts.REFILLS:
        given = shape if refill != "off" else {}
        out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill=refill, eos_token_id=1,
                             pad_token_id=0, target_lengths=targets, **given)
        assert [s.length for s in out.sequences] == targets   # forced lengths: the schedule's premise
        plan = rollouts.schedule(targets, slots, refill, occupancy=True, **given)
        assert (out.decode_steps, out.row_steps, out.prefills, out.useful_tokens) == \
            (plan.steps, plan.row_steps, plan.prefills, plan.useful), (refill, slots, shape)
        if refill != "off":
            assert out.prefilled_rows == count and out.refill_sizes == dict(plan.refill_sizes), (slots, shape)
            assert sum(g * n for g, n in plan.refill_sizes) == count
        assert out.row_step_share == pytest.approx(plan.share)
        grid = plan.occupancy
        assert grid.shape == (plan.steps, min(slots, count)) and plan.slots == min(slots, count)
        kept = grid[grid >= 0]
        # each sequence holds one slot for its length - 1 steps (its first token is the prefill's)
        assert np.bincount(kept, minlength=count).tolist() == [t - 1 for t in targets]
        if refill != "off":
            slot_of = {int(q): int(s) for s in range(grid.shape[1]) for q in np.unique(grid[:, s]) if q >= 0}
            for q, seq in enumerate(out.sequences):
                if q in slot_of:
                    assert seq.slot == slot_of[q], (refill, q)


def test_refill_never_worse_and_static_batches_wait():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.geometric(1 / 16, size=int(rng.integers(1, 200))).clip(max=64)
        slots = int(rng.integers(1, 40))
        off, dev = (rollouts.schedule(lengths, slots, r, refill_after=1) for r in ("off", "device"))
        assert dev.steps <= off.steps and dev.share >= off.share - 1e-12
        # refilling together starts the same sequences at the same steps as one at a time (only slots differ)
        one = rollouts.schedule(lengths, slots, "device", refill_rows=1, refill_after=1)
        assert (one.steps, one.row_steps) == (dev.steps, dev.row_steps) and one.prefills >= dev.prefills
        # the default waits for an eighth of the (used) slots
        rows = min(slots, lengths.size)
        assert rollouts.schedule(lengths, slots, "device") == \
            rollouts.schedule(lengths, slots, "device", refill_after=max(1, rows // 8))
        assert off.steps == sum(int(lengths[i:i + slots].max()) - 1 for i in range(0, lengths.size, slots))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=[], slots=2), "one length >= 1"), (dict(lengths=[2, 0], slots=2), "one length >= 1"),
    (dict(lengths=[2], slots=0), "slots=0"), (dict(lengths=[2], slots=True), "slots=True"),
    (dict(lengths=[2], slots=2, refill="sometimes"), "refill='sometimes'"),
    (dict(lengths=[2], slots=2, refill_rows=0), "refill_rows=0"),
    (dict(lengths=[2], slots=2, refill_after=True), "refill_after=True")])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollouts.schedule(**kwargs)


def test_predict_prices_the_schedule():
    plan = rollouts.schedule([3, 1, 2], slots=2, refill="host", refill_rows=1)
    assert rollouts.predict_s(plan, step_s=0.01, prefill_s=0.002) == pytest.approx(2 * 0.01 + 3 * 0.002)
    plan = rollouts.schedule([3, 1, 2], slots=2, refill="host")   # one refill of 2, one of 1
    assert rollouts.predict_s(plan, 0.01, {2: 0.003, 1: 0.002}) == pytest.approx(2 * 0.01 + 0.003 + 0.002)
    with pytest.raises(ValueError, match="no time for refills of 2 sequences"):
        rollouts.predict_s(plan, 0.01, {1: 0.002})
