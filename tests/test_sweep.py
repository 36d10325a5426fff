"""Workloads (length distributions) and sweeps: grid, tidy CSV + sidecar, resume, failures, CLI."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from gdtool.measure import workloads
from gdtool.frontends.sweep import RunConfig, grid, main, poll_label, poll_value, summarize, sweep
from gdtool.frontends.sweep import load as load_csv

# ---------------------------------------------------------------------------------------------
# workloads


def test_distributions_draw_seeded_lengths_in_range():
    geom = workloads.geometric(mean=8, cap=20)
    a, b = geom.draw(64, seed=3), geom.draw(64, seed=3)
    assert a.dtype == torch.long and a.shape == (64,)
    assert torch.equal(a, b) and not torch.equal(a, geom.draw(64, seed=4))
    assert int(a.min()) >= 1 and int(a.max()) <= 20
    u = workloads.uniform(3, 5).draw(200, seed=0)
    assert set(u.tolist()) == {3, 4, 5}
    assert workloads.fixed(7).draw(3).tolist() == [7, 7, 7]
    assert workloads.listed([2, 9, 4]).draw(3).tolist() == [2, 9, 4]
    assert set(workloads.empirical([2, 9]).draw(50, seed=1).tolist()) == {2, 9}
    assert workloads.eos_off().draw(4) is None and not workloads.eos_off().eos


def test_geometric_matches_its_definition():
    # mean before the cap: a large sample of an uncapped-in-practice distribution has that mean
    draws = workloads.geometric(mean=16, cap=10_000).draw(200_000, seed=0).double()
    assert abs(float(draws.mean()) - 16) < 0.2
    # the pmf (with the cap lumped) sums to 1 and gives the capped mean
    values, probs = workloads.geometric(16, 32).pmf()
    assert probs.sum() == pytest.approx(1.0)
    assert workloads.geometric(16, 32).mean() == pytest.approx(float((values * probs).sum()))
    sample = workloads.geometric(16, 32).draw(200_000, seed=1).double().mean()
    assert float(sample) == pytest.approx(workloads.geometric(16, 32).mean(), rel=0.01)


def test_names_and_specs_round_trip():
    for d in [workloads.fixed(128), workloads.uniform(16, 256), workloads.geometric(128, 512),
              workloads.geometric(2.5, 9), workloads.listed([5, 9, 12]), workloads.empirical([3, 4]),
              workloads.eos_off()]:
        assert workloads.parse(d.name) == d
        assert workloads.parse(d.spec) == d
    assert workloads.geometric(128, 512).name == "geom128cap512"
    assert workloads.parse([4, 5]) == workloads.listed([4, 5])


@pytest.mark.parametrize("bad, message", [
    ("geom:0.5:10", "must be >= 1"), ("uniform:9:3", "swap them"), ("fixed:0", ">= 1"),
    ("zipf:3", "unknown length distribution"),
])
def test_bad_distributions_say_what_to_do(bad, message):
    with pytest.raises(ValueError, match=message):
        workloads.parse(bad)


def test_listed_needs_one_length_per_row():
    with pytest.raises(ValueError, match="empirical"):
        workloads.listed([1, 2, 3]).draw(4)


def test_expected_max_exact_matches_monte_carlo():
    for dist, batch in [(workloads.geometric(32, 128), 8), (workloads.uniform(1, 50), 4), (workloads.fixed(9), 3),
                        (workloads.empirical([3, 30, 300]), 2)]:
        exact = workloads.expected_max(dist, batch)
        values, probs = workloads.max_pmf(dist, batch)
        assert probs.sum() == pytest.approx(1.0) and float((values * probs).sum()) == pytest.approx(exact)
        std = float(np.sqrt((probs * (values - exact) ** 2).sum()))
        mc = workloads.expected_max(dist, batch, samples=4000, seed=0)
        assert abs(mc - exact) <= 4 * std / np.sqrt(4000) + 1e-9, dist.name
    # capping at max_new_tokens
    assert workloads.expected_max(workloads.fixed(50), 4, max_new_tokens=20) == 20


# ---------------------------------------------------------------------------------------------
# configs


def test_poll_labels():
    assert [poll_label(p) for p in (1, "16", 0, "never", "async", None, 4.0)] == \
        ["1", "16", "never", "never", "async", "default", "4"]
    assert [poll_value(p) for p in ("1", "never", "async", "default")] == [1, 0, "async", None]
    with pytest.raises(ValueError, match="interval"):
        poll_label(-2)
    with pytest.raises(ValueError, match="interval"):
        poll_label("sometimes")


def test_run_config_name_and_hash():
    cfg = RunConfig("llama-1b", "step-graph", 16, 16, "geom:128:512", 512)
    assert cfg.name == "llama-1b_b16_poll16_step-graph_geom128cap512"
    assert cfg.poll == "16" and cfg.lengths == "geom128cap512"
    same = RunConfig("llama-1b", "step-graph", 16, "16", "geom128cap512", 512)
    assert same.hash == cfg.hash
    other = RunConfig("llama-1b", "step-graph", 16, 16, "geom:128:512", 256)
    assert other.hash != cfg.hash and other.name.endswith("_new256")
    # lengths: the same draw for every mode and poll of one repetition (paired comparison)
    a = RunConfig("m", "eager", 8, 1, "geom:8:30", 30).lengths_for(2)
    b = RunConfig("m", "step-graph", 8, "async", "geom:8:30", 30).lengths_for(2)
    assert torch.equal(a, b)
    assert int(RunConfig("m", "eager", 8, 1, "fixed:50", 30).lengths_for(0).max()) == 30


def test_grid_is_the_cross_product():
    configs = grid(["tiny-llama"], ["eager", "step-graph"], [1, 4], [1, "never", "async"], ["fixed:5", "eos-off"],
                   max_new_tokens=None)
    assert len(configs) == 2 * 2 * 3 * 2
    assert len({c.hash for c in configs}) == len(configs)
    assert {c.max_new_tokens for c in configs if c.lengths == "fixed5"} == {5}
    assert {c.max_new_tokens for c in configs if c.lengths == "eos-off"} == {256}


# ---------------------------------------------------------------------------------------------
# sweeps on a tiny model (CPU)

SMALL = dict(modes=["step-graph"], batches=[2], polls=[1, "never"], lengths=["list:3,5"], max_new_tokens=6,
             prompt_len=4, repeats=2, warmup=0, progress=False)


def test_sweep_writes_tidy_csv_and_sidecar(load, tmp_path):
    model = load("tiny-llama")
    out = tmp_path / "s.csv"
    df = sweep([model], out=out, **SMALL)
    assert len(df) == 2 * 2  # two configs x two repetitions
    assert df.attrs["complete"] and df.attrs["ran"] == 2
    for col in ("model", "mode", "batch", "poll", "lengths", "max_new_tokens", "prompt_len", "repeat", "name",
                "config_hash", "tokens", "tokens_per_s", "steps", "steps_per_s", "wasted_steps", "host_syncs", "polls",
                "decode_s", "prefill_s", "us_per_token", "error"):
        assert col in df.columns, col
    assert (df["tokens"] == 8).all() and (df["error"] == "").all()
    never = df[df["poll"] == "never"]
    assert (never["steps"] == 5).all() and (never["polls"] == 0).all() and (never["wasted_steps"] == 1).all()
    every = df[df["poll"] == "1"]
    assert (every["steps"] == 4).all() and (every["wasted_steps"] == 0).all()
    back = load_csv(out)
    assert len(back) == len(df) and list(back["poll"]) == list(df["poll"])
    env = json.loads(out.with_suffix(".json").read_text())["environment"]
    for key in ("gpu", "driver", "torch", "transformers", "git_commit", "date", "python"):
        assert key in env
    assert env["torch"] == torch.__version__
    assert df.attrs["environment"] == env and back.attrs["environment"] == env   # what the plots name
    stats = summarize(df)
    assert len(stats) == 2 and {"tokens_per_s", "tokens_per_s_p20", "tokens_per_s_p80", "n"} <= set(stats.columns)
    assert (stats["n"] == 2).all()
    assert (stats["tokens_per_s_p20"] <= stats["tokens_per_s"]).all()


def test_sweep_resumes_and_extends(load, tmp_path):
    model = load("tiny-llama")
    out = tmp_path / "r.csv"
    first = sweep([model], out=out, max_seconds=0, **SMALL)
    assert first.attrs["ran"] == 0 and not first.attrs["complete"]
    sweep([model], out=out, **SMALL)
    before = pd.read_csv(out)
    again = sweep([model], out=out, **SMALL)
    assert again.attrs["ran"] == 0 and again.attrs["complete"]
    assert len(pd.read_csv(out)) == len(before)
    more = sweep([model], out=out, **dict(SMALL, repeats=3))  # one more repetition per config
    assert more.attrs["ran"] == 2 and len(more) == 6
    assert sorted(more["repeat"]) == [0, 0, 1, 1, 2, 2]


def test_a_failed_config_is_recorded_not_fatal(load, tmp_path):
    model = load("tiny-llama")
    good = RunConfig("tiny-llama", "step-graph", 1, 1, "fixed:3", 4, prompt_len=4)
    bad = RunConfig("tiny-llama", "step-graph", 1, 1, "fixed:3", 4, prompt_len=5000)  # past max positions
    out = tmp_path / "f.csv"
    df = sweep([model], configs=[bad, good], repeats=1, warmup=0, out=out, progress=False)
    errors = df[df["error"] != ""]
    assert list(errors["name"]) == [bad.name] and "positions" in errors["error"].iloc[0]
    assert (df[df["name"] == good.name]["tokens"] == 3).all()
    # a rerun skips the failed config unless asked to retry it
    assert sweep([model], configs=[bad, good], repeats=1, warmup=0, out=out, progress=False).attrs["ran"] == 0
    retried = sweep([model], configs=[bad, good], repeats=1, warmup=0, out=out, progress=False, retry_failed=True)
    assert retried.attrs["ran"] == 1 and (retried["error"] != "").sum() == 1


def test_eos_off_runs_every_row_to_the_end(load, tmp_path):
    model = load("tiny-llama")
    df = sweep([model], modes=["eager", "step-graph"], batches=[2], polls=["never", 1], lengths=["eos-off"],
               max_new_tokens=4, prompt_len=4, repeats=1, warmup=0, progress=False)
    assert (df["tokens"] == 8).all() and (df["steps"] == 3).all()
    assert (df[df["poll"] == "never"]["polls"] == 0).all()
    assert (df[df["poll"] == "1"]["polls"] == 4).all()  # a flag that never flips is still read when asked


def test_cli_prints_one_json_document_with_json(tmp_path, capsys):
    out = tmp_path / "cli.csv"
    code = main(["--models", "tiny-llama", "--modes", "eager,step-graph", "--batches", "1", "--polls", "1", "async",
                 "--lengths", "fixed:3", "--prompt-len", "4", "--repeats", "1", "--warmup", "0", "--out", str(out),
                 "--no-progress", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"] == 4 and doc["complete"] and doc["failed_rows"] == 0
    assert len(load_csv(out)) == 4


def test_targets_past_max_new_tokens_are_capped(load):
    model = load("tiny-llama")
    df = sweep([model], modes=["step-graph"], batches=[3], polls=["async"], lengths=["list:2,9,30"],
               max_new_tokens=5, prompt_len=4, repeats=1, warmup=0, progress=False)
    assert int(df["tokens"].iloc[0]) == 2 + 5 + 5
    assert np.isfinite(df["tokens_per_s"]).all()


@pytest.mark.cuda
def test_sweep_on_cuda_replays_one_capture_per_engine(tmp_path):
    """On a GPU: every step is a replay, the graph is captured once (during the warm-up) and replayed by
    every policy and repetition after it, and the sidecar names the GPU."""
    import gdtool
    model = gdtool.load_model("tiny-llama", seed=0, device="cuda")
    out = tmp_path / "cuda.csv"
    df = sweep([model], modes=["step-graph"], batches=[4], polls=[1, 4, "never", "async"], lengths=["geom:8:32"],
               prompt_len=16, repeats=2, warmup=1, out=out, progress=False)
    assert (df["error"] == "").all(), df["error"].tolist()
    assert (df["replays"] == df["steps"]).all()
    assert (df["capture_s"] == 0).all()
    assert (df["tokens"] <= df["target_sum"]).all() and (df["tokens_per_s"] > 0).all()
    never = df[df["poll"] == "never"]
    assert (never["steps"] == 31).all() and (never["polls"] == 0).all()
    env = json.loads(out.with_suffix(".json").read_text())["environment"]
    assert env["gpu"] and env["gpu_count"] >= 1 and env["cuda"]


def test_profile_columns_pool_one_profiled_run_per_repetition(load, tmp_path, monkeypatch):
    """host_us_per_token is the host time of every repetition's profiled run over their step-tokens,
    each run with its repetition's lengths, not one draw's figure copied to every row."""
    from gdtool.measure import timing
    model = load("tiny-llama")
    seen, real = [], timing.profile

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append((kwargs["target_lengths"].tolist(), float(result.summary.loc["host_us", "total"]),
                     result.output.steps * result.output.batch))
        return result

    monkeypatch.setattr(timing, "profile", recording)
    df = sweep([model], modes=["device-loop"], batches=[2], polls=["never"], lengths=["geom:4:12"],
               max_new_tokens=12, prompt_len=4, repeats=3, warmup=0, progress=False, profile=True,
               out=tmp_path / "p.csv")
    cfg = RunConfig("tiny-llama", "device-loop", 2, "never", "geom:4:12", 12, prompt_len=4)
    assert [lengths for lengths, _, _ in seen] == [cfg.lengths_for(r).tolist() for r in range(3)]
    assert len({tuple(lengths) for lengths, _, _ in seen}) > 1  # the draws differ, so pooling matters
    pooled = sum(host for _, host, _ in seen) / sum(tokens for _, _, tokens in seen)
    assert (df["profile_runs"] == 3).all()
    assert df["host_us_per_token"].to_numpy() == pytest.approx([pooled] * 3)


def test_kernel_passes_come_after_every_config_is_timed(load, tmp_path, monkeypatch):
    """torch.profiler leaves CUPTI attached and taxes later launches: a profiled sweep times every config
    (throughput rows and host columns) before the first kernel pass, then fills the busy columns."""
    import importlib
    sweep_module = importlib.import_module("gdtool.frontends.sweep")  # gdtool.sweep is the function
    model = load("tiny-llama")
    calls = []
    real = sweep_module._profile_columns
    monkeypatch.setattr(sweep_module, "_profile_columns",
                        lambda m, cfg, prompt, runs: calls.append(("timed", cfg.batch)) or real(m, cfg, prompt, runs))
    monkeypatch.setattr(sweep_module, "_busy_columns",
                        lambda m, cfg, runs: calls.append(("kernels", cfg.batch)) or {"device_us_per_token": 1.5})
    df = sweep([model], modes=["step-graph"], batches=[1, 2], polls=[1], lengths=["fixed:3"], max_new_tokens=4,
               prompt_len=4, repeats=2, warmup=0, progress=False, profile=True, out=tmp_path / "k.csv")
    assert calls == [("timed", 1), ("timed", 2), ("kernels", 1), ("kernels", 2)]
    assert (df["device_us_per_token"] == 1.5).all() and df["host_us_per_token"].notna().all()
    assert (load_csv(tmp_path / "k.csv")["device_us_per_token"] == 1.5).all()


def test_a_failed_kernel_pass_leaves_busy_empty_and_warns(load, tmp_path, monkeypatch):
    import importlib
    sweep_module = importlib.import_module("gdtool.frontends.sweep")

    def broken(model, cfg, runs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sweep_module, "_busy_columns", broken)
    model = load("tiny-llama")
    with pytest.warns(UserWarning, match="kernel pass of .* failed .*illegal memory access"):
        df = sweep([model], modes=["step-graph"], batches=[1], polls=[1], lengths=["fixed:3"],
                   max_new_tokens=4, prompt_len=4, repeats=2, warmup=0, progress=False, profile=True,
                   out=tmp_path / "b.csv")
    assert len(df) == 2 and (df["error"] == "").all()
    assert df["host_us_per_token"].notna().all() and "device_us_per_token" not in df.columns
