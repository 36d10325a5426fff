"""The line a long command prints before it starts (gdtool.frontends.estimate): expected steps as the decode loop
runs them, seconds from measured rates, and the counts of the line against what the sweep then ran."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gdtool.frontends import estimate
from gdtool.frontends.sweep import sweep
from gdtool.measure import costmodel, workloads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


@pytest.mark.parametrize("lengths, batch, poll, new, steps", [
    ("fixed:4", 2, "1", 8, 3),          # the rows end at token 4: steps 1-3
    ("fixed:4", 2, "never", 8, 7),      # never polled: every step
    ("fixed:6", 1, "4", 8, 7),          # needs 5 steps, rounded up to 8 by the interval, capped at 7
    ("fixed:6", 1, "async", 16, 6),     # one step late
    ("fixed:6", 1, "default", 16, 5),   # a device loop stops right after the last row
    ("eos-off", 3, "1", 9, 8),
])
def test_expected_steps_of_fixed_lengths_are_the_steps_run(lengths, batch, poll, new, steps):
    assert estimate.expected_steps(lengths, batch, poll, new) == steps


def test_expected_steps_of_a_distribution_is_the_mean_over_its_draws():
    dist = workloads.parse("geom:16:64")
    draws = np.array([int(dist.draw(4, seed=seed).clamp(max=64).max()) for seed in range(4000)])
    for poll in ("1", "8", "async"):
        sampled = costmodel.steps_and_polls(draws, poll, 64)[0].mean()
        assert estimate.expected_steps("geom:16:64", 4, poll, 64) == pytest.approx(sampled, rel=0.03), poll


def test_clock_interpolates_in_batch_and_counts_prefills_and_steps():
    clock = estimate.Clock({"eager": {1: (0.010, 0.001), 9: (0.050, 0.005)}})
    work = [estimate.Work("eager", 5, decodes=2, steps=10)]     # halfway: 30 ms prefill, 3 ms/step
    assert clock.seconds(work) == pytest.approx(2 * (0.030 + 10 * 0.003))
    assert clock.seconds([estimate.Work("eager", 64, 1, 0)]) == pytest.approx(0.050)  # past the largest: held
    assert clock.seconds([estimate.Work("step-graph", 1, 1, 1)]) == pytest.approx(0.011)  # a mode not timed
    assert clock.basis() == "1-5 ms/step and 10-50 ms/prefill timed here (short eager decodes at batch 1 and 9)"


@pytest.mark.parametrize("seconds, text", [(0.2, "~1 s"), (41.4, "~41 s"), (100, "~1.7 min"), (1800, "~30 min"),
                                           (7560, "~2.1 h"), (float("nan"), "unknown")])
def test_durations_keep_two_figures(seconds, text):
    assert estimate.duration(seconds) == text


def test_the_sweep_line_counts_the_decodes_and_steps_it_then_runs(load, tmp_path):
    """Batch 1 and 2 x poll 1 and never, fixed lengths: one warm-up per batch (the polls replay one engine), two timed
    repetitions per config. The line counts 10 decodes and 46 steps; the CSV holds the 8 timed ones, 40 steps."""
    lines = []
    out = tmp_path / "s.csv"
    sweep([load("tiny-llama")], modes=["step-graph"], batches=[1, 2], polls=[1, "never"], lengths=["fixed:4"],
          max_new_tokens=8, prompt_len=4, repeats=2, warmup=1, out=out, progress=False, echo=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"sweep: 4 configs to run (none in {out} yet); estimate ~")
    assert ": 10 decodes, ~46 steps expected, at " in lines[0]
    rows = pd.read_csv(out)
    assert len(rows) == 8 and rows["steps"].sum() == 46 - 2 * 3  # the warm-ups (3 steps each) are not rows

    lines.clear()
    sweep([load("tiny-llama")], modes=["step-graph"], batches=[1, 2, 4], polls=[1, "never"], lengths=["fixed:4"],
          max_new_tokens=8, prompt_len=4, repeats=2, warmup=1, out=out, progress=False, echo=lines.append)
    assert lines[0].startswith(f"sweep: 2 configs to run (4 of 6 already in {out}, same config hash: skipped) "
                               "(--redo measures them again); estimate ~")


def test_a_failed_probe_leaves_the_line_without_an_estimate_and_the_sweep_runs(load, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory for the probe")
    monkeypatch.setattr(estimate, "probe", broken)
    lines = []
    df = sweep([load("tiny-llama")], modes=["eager"], batches=[1], polls=[1], lengths=["fixed:3"], max_new_tokens=4,
               prompt_len=4, repeats=1, warmup=0, progress=False, echo=lines.append)
    assert lines == ["sweep: 1 config to run; no estimate (the timed probe decode failed: RuntimeError: no memory for "
                     "the probe)"]
    assert len(df) == 1 and (df["error"] == "").all()
