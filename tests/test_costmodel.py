"""The EOS-polling cost model: its step/poll accounting against real decodes, its fit, its predictions."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gdtool.measure import costmodel, workloads
from gdtool.measure.costmodel import CostParams, steps_and_polls
from gdtool.frontends.sweep import RunConfig, run_config

POLLS = ["1", "2", "4", "never", "async"]


@pytest.mark.parametrize("mode", ["eager", "step-graph"])
def test_step_and_poll_accounting_matches_real_decodes(load, mode):
    """The model's S and P are what gdtool.decode actually runs and counts, for every policy."""
    model = load("tiny-llama")
    for lengths, max_new in [("list:2,5,9", 12), ("list:1,1,1", 6), ("list:3,12,7", 12), ("list:4,4,4", 4)]:
        for poll in POLLS:
            cfg = RunConfig("tiny-llama", mode, 3, poll, lengths, max_new, prompt_len=4)
            (row,) = run_config(model, cfg, repeats=1, warmup=0)
            steps, polls = steps_and_polls([row["target_max"]], poll, max_new)
            assert (row["steps"], row["polls"]) == (int(steps[0]), int(polls[0])), (lengths, poll, row)
            assert row["wasted_steps"] == int(steps[0]) - max(row["target_max"] - 1, 0), (lengths, poll)


def _synthetic(params: dict, dist, batches, polls, max_new, repeats=5, seed=0, noise=0.0):
    """Sweep-shaped rows whose decode times follow the model exactly (plus optional noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in batches:
        p = params[batch]
        for poll in polls:
            for repeat in range(repeats):
                targets = dist.draw(batch, seed=repeat).clamp(max=max_new)
                s, n = steps_and_polls([int(targets.max())], poll, max_new)
                t = float(costmodel._time(s, n, poll, p)[0]) * (1 + noise * rng.standard_normal())
                rows.append(dict(model="m", mode="step-graph", batch=batch, poll=poll, lengths=dist.name,
                                 max_new_tokens=max_new, prompt_len=8, repeat=repeat, steps=int(s[0]), polls=int(n[0]),
                                 decode_s=t, tokens=int(targets.sum()), tokens_per_s=int(targets.sum()) / t,
                                 target_max=int(targets.max()), target_sum=int(targets.sum()), error=""))
    return pd.DataFrame(rows)


def test_fit_recovers_the_costs_and_predicts_out_of_sample():
    dist = workloads.geometric(16, 64)
    truth = {1: CostParams(t_step=2.0e-3, t_sync=60e-6), 8: CostParams(t_step=3.0e-3, t_sync=40e-6)}
    df = _synthetic(truth, dist, [1, 8], ["1", "4", "16", "never", "async"], 64)
    params = costmodel.fit(df)
    for batch, p in truth.items():
        row = params[params["batch"] == batch].iloc[0]
        assert row["t_step_us"] == pytest.approx(p.t_step * 1e6, rel=1e-9)
        assert row["t_sync_us"] == pytest.approx(p.t_sync * 1e6, rel=1e-9)
        assert row["source"] == "never+poll1"
    runs = costmodel.predict_runs(df, params)
    assert len(runs) == len(df)
    assert np.allclose(runs["ratio"], 1.0)
    assert set(runs.loc[~runs["calibration"], "poll"]) == {"4", "16", "async"}


def test_fit_without_never_runs_uses_least_squares():
    dist = workloads.uniform(5, 40)
    truth = {4: CostParams(t_step=1.0e-3, t_sync=100e-6)}
    df = _synthetic(truth, dist, [4], ["1", "2", "8"], 40)
    row = costmodel.fit(df).iloc[0]
    assert row["source"] == "lstsq"
    assert row["t_step_us"] == pytest.approx(1000, rel=1e-6) and row["t_sync_us"] == pytest.approx(100, rel=1e-6)


def test_fit_is_robust_to_noise():
    dist = workloads.geometric(32, 128)
    truth = {16: CostParams(t_step=4e-3, t_sync=200e-6)}
    df = _synthetic(truth, dist, [16], ["1", "8", "never"], 128, repeats=40, noise=0.01)
    row = costmodel.fit(df).iloc[0]
    assert row["t_step_us"] == pytest.approx(4000, rel=0.02)
    assert row["t_sync_us"] == pytest.approx(200, rel=0.5)


def test_predict_matches_simulation_over_the_distribution():
    """E[tokens]/E[time] from the exact max distribution equals a long simulation of batches."""
    dist, batch, max_new = workloads.geometric(20, 80), 4, 80
    p = CostParams(t_step=1e-3, t_sync=0.3e-3, t_async=0.05e-3)
    table = costmodel.predict(p, dist, polls=["1", "8", "never", "async"], batches=[batch], max_new_tokens=max_new)
    for _, row in table.iterrows():
        tokens = time = 0.0
        for seed in range(3000):
            targets = dist.draw(batch, seed=seed)
            s, n = steps_and_polls([int(targets.max())], row["poll"], max_new)
            tokens += int(targets.sum())
            time += float(costmodel._time(s, n, row["poll"], p)[0])
        assert row["tokens_per_s"] == pytest.approx(tokens / time, rel=0.03), row["poll"]


def test_best_interval_follows_the_costs():
    dist = workloads.geometric(64, 256)
    free_sync = costmodel.best_interval(CostParams(t_step=1e-3, t_sync=0.0), dist, batch=4)
    assert free_sync["best_poll"].iloc[0] == "1"  # syncs cost nothing: never run a wasted step
    costly = costmodel.best_interval(CostParams(t_step=1e-3, t_sync=0.2e-3), dist, batch=4,
                                     polls=["1", "2", "4", "8", "16", "32", "64", "never"])
    k = int(costly["best_poll"].iloc[0])
    assert 2 <= k <= 32 and costly["k_star"].iloc[0] == pytest.approx(
        np.sqrt(2 * costly["expected_max"].iloc[0] * 0.2), rel=1e-9)
    hidden = costmodel.best_interval(CostParams(t_step=1e-3, t_sync=0.2e-3, t_async=0.0), dist, batch=4)
    assert hidden["best_poll"].iloc[0] == "async"  # a free read one step late beats every blocking poll


def test_fixed_lengths_predict_exact_steps():
    p = CostParams(t_step=1e-3, t_sync=1e-4)
    table = costmodel.predict(p, workloads.fixed(10), polls=["1", "4", "never", "async"], batches=[2],
                              max_new_tokens=32).set_index("poll")
    assert table.loc["1", "steps"] == 9 and table.loc["4", "steps"] == 12 and table.loc["never", "steps"] == 31
    assert table.loc["async", "steps"] == 10
    assert table.loc["4", "wasted_steps"] == 3 and table.loc["1", "polls"] == 10
    assert table.loc["4", "decode_s"] == pytest.approx(12 * 1e-3 + 3 * 1e-4)


def test_measured_best_pools_repetitions_and_lists_ties():
    rows = []
    # two repetitions with different lengths: "4" wins the pooled rate, "1" the median of single runs
    for poll, times in {"1": (1.0, 10.0), "4": (1.2, 9.0), "16": (1.3, 9.3)}.items():
        for repeat, (tokens, t) in enumerate(zip((100, 1000), times)):
            rows.append(dict(model="m", mode="step-graph", batch=2, lengths="geom", poll=poll, repeat=repeat,
                             tokens=tokens, decode_s=t, tokens_per_s=tokens / t, error=""))
    df = pd.DataFrame(rows)
    table = costmodel.pooled(df).set_index("poll")
    assert table.loc["4", "tokens_per_s"] == pytest.approx(1100 / 10.2)
    strict = costmodel.measured_best(df, tolerance=0.0).iloc[0]
    assert strict["best_poll"] == "4" and strict["tied"] == ["4"]
    loose = costmodel.measured_best(df, tolerance=0.05).iloc[0]   # "16" is 3.3 % behind, "1" 7.3 %
    assert loose["tied"] == ["4", "16"]


def test_repeat_noise_is_the_spread_of_identical_work():
    base = dict(model="m", mode="step-graph", batch=1, lengths="eos-off", poll="never", max_new_tokens=8,
                target_sum=8, target_max=8, error="")
    df = pd.DataFrame([base | dict(tokens_per_s=100.0), base | dict(tokens_per_s=101.0),
                       base | dict(batch=4, tokens_per_s=50.0), base | dict(batch=4, tokens_per_s=50.2),
                       base | dict(lengths="geom", target_sum=5, tokens_per_s=80.0)])   # not repeated
    noise = costmodel.repeat_noise(df)
    assert noise["noise"].iloc[0] == pytest.approx(0.01)


def test_check_passes_an_exact_model_and_fails_a_wrong_one():
    dist = workloads.geometric(16, 64)
    truth = {1: CostParams(t_step=2.0e-3, t_sync=60e-6), 8: CostParams(t_step=3.0e-3, t_sync=40e-6)}
    df = _synthetic(truth, dist, [1, 8], ["1", "4", "16", "never", "async"], 64, repeats=6)
    params = costmodel.fit(df)
    table = costmodel.check(df, params, dist, polls=["1", "4", "16", "never", "async"])
    assert list(table["batch"]) == [1, 8]
    assert (table["on_runs_poll"] == table["measured_poll"]).all()
    assert table["max_error"].max() < 1e-9 and table["within_15pct"].all() and table["within_2x"].all()
    # a model that believes a poll costs 50 steps and an async read 5 recommends rare polls: refused
    wrong = params.assign(t_sync_us=params["t_step_us"] * 50, t_async_us=params["t_step_us"] * 5)
    table = costmodel.check(df, wrong, dist, polls=["1", "4", "16", "never", "async"])
    assert not table["within_2x"].any() and not table["within_15pct"].any()
    assert set(table["recommended_poll"]) <= {"16", "never"}


def test_interval_factor():
    assert costmodel.interval_factor("4", 16) == 4
    assert costmodel.interval_factor("async", "1") == 1
    assert costmodel.interval_factor("never", "64") == float("inf")


def test_fit_refuses_empty_input():
    with pytest.raises(ValueError, match="sweep"):
        costmodel.fit(pd.DataFrame())
