"""`python -m gdtool bench --workload rollout` on CPU with tiny-llama: it runs end to end through the command line,
writes CSV + JSON, makes exactly the drawn tokens, prints ratios of its own figures and an ideal computed from
them; bad input ends it with one line (exit 2) before any model loads. No speed is asserted."""
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from gdtool import __main__ as cli
from gdtool.frontends import rollout_bench
from gdtool.measure import record, workloads


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


BASE = ["bench", "--workload", "rollout", "--model", "tiny-llama", "--device", "cpu", "--no-progress"]
TINY = BASE + ["--prompts", "6", "--prompt-len", "4", "--slots", "2,3", "--lengths", "uniform:1:6", "--repeats", "1"]
ROLLOUTS = ("static", "host", "device")


def run_cli(argv, capsys):
    rc = cli.main(argv + ["--json"])
    captured = capsys.readouterr()
    return rc, captured.err, json.loads(captured.out.strip().splitlines()[-1])


def test_rollout_workload_end_to_end(tmp_path, capsys):
    rc, table, doc = run_cli(TINY + ["--out", str(tmp_path)], capsys)
    assert rc == 0, table
    drawn = int(workloads.parse("uniform:1:6").draw(batch=6, seed=0).sum())
    assert doc["bench"] == "rollout" and doc["captured"] is False
    assert "ran their step uncaptured" in table

    names = [f"tiny-llama_rollout_s{s}_n6_p4_uniform1-6" for s in (2, 3)]
    assert doc["files"] == [str(tmp_path / f"{n}.{ext}") for n in names for ext in ("csv", "json")]
    ratio_lines = re.findall(r"^ratios \(useful tok/s\): (.*)$", table, flags=re.M)
    assert len(ratio_lines) == 2
    for slots, name, line in zip((2, 3), names, ratio_lines):
        rows = {r["runner"]: r for r in doc["results"] if r["slots"] == slots}
        assert set(rows) == set(rollout_bench.RUNNERS)
        off = rows["eos-off"]
        assert off["status"] == "ok" and off["useful_tokens"] == slots * 6 and off["decode_steps"] == 5
        assert off["step_s"] > 0
        for runner in ROLLOUTS:
            r = rows[runner]
            assert r["status"] == "ok", r
            assert r["useful_tokens"] == r["drawn_tokens"] == drawn and r["early"] == 0
            assert r["tok_s"] == pytest.approx(r["useful_tokens"] / r["wall_s"])
            assert 0 < r["row_step_share"] <= 1 and r["decode_steps"] >= 5 and r["host_syncs"] > 0
            assert r["ideal_s"] == pytest.approx(r["prefill_s"] + r["decode_steps"] * off["step_s"])
            assert r["of_ideal"] == pytest.approx(r["ideal_s"] / r["wall_s"])
        cb = rows["hf-cb"]
        if cb["status"] == "ok":
            assert cb["useful_tokens"] == drawn and cb["early"] == 0
            assert "transformers" in cb["note"] and "max_requests_per_batch=" + str(slots) in cb["note"]
        else:
            assert cb["status"] == "n/a" and cb["note"] and cb["tok_s"] is None

        # the ratios are those of the runners' useful tokens/s, in the JSON and on the printed line
        ratios = next(x for x in doc["ratios"] if x["config"] == name)
        for a, b in rollout_bench.RATIOS:
            if rows[a]["tok_s"] is None or rows[b]["tok_s"] is None:
                assert ratios[f"{a}/{b}"] is None
                assert f"{a}/{b} -" in line
            else:
                assert ratios[f"{a}/{b}"] == pytest.approx(rows[a]["tok_s"] / rows[b]["tok_s"])
                assert f"{a}/{b} {ratios[f'{a}/{b}']:.2f}" in line

        df = pd.read_csv(tmp_path / f"{name}.csv")
        timed = df[df.status == "ok"]
        assert set(timed.runner) >= {*ROLLOUTS, "eos-off"} and (timed.repeat == 0).all()
        assert (timed[timed.runner.isin(ROLLOUTS)].useful_tokens == drawn).all() and (df.slots == slots).all()
        meta = json.loads((tmp_path / f"{name}.json").read_text())
        assert set(record.ENV_KEYS) <= set(meta["environment"]) and meta["config"]["slots"] == slots
        assert meta["ratios"] == {k: v for k, v in ratios.items() if "/" in k}

    for label in rollout_bench.LABELS.values():
        assert label in table
    for heading in ("tok_s", "wall_s", "share", "steps", "syncs", "prefill_s", "ideal_s", "of_ideal"):
        assert heading in table

    # the same command again resumes: both configs are in --out already, nothing is measured or loaded
    rc, again_table, again = run_cli(TINY + ["--out", str(tmp_path)], capsys)
    assert rc == 0 and again_table.count("skipped") == 2 and "loaded" not in again_table
    assert [r["tok_s"] for r in again["results"]] == pytest.approx([r["tok_s"] for r in doc["results"]],
                                                                   nan_ok=True)
    assert again["ratios"] == doc["ratios"]


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the bad input was refused")


@pytest.mark.parametrize("extra, words", [
    (["--slots", "0"], "argument --slots: slots 0 must be at least 1"),
    (["--prompts", "0"], "argument --prompts: prompts 0 must be at least 1"),
    (["--lengths", "zipf:3"], "unknown length distribution 'zipf:3'"),
    (["--lengths", "eos-off"], "a rollout needs lengths that end"),
    (["--prompts", "4", "--lengths", "list:3,4"], "one length per prompt: --prompts 4"),
    (["--batch", "4"], "--batch is an option of --workload decode; the rollout workload takes --slots"),
    (["--max-new-tokens", "8"], "max_new_tokens is the distribution's cap"),
    (["--prompt-len", "9,8"], "--prompt-len '9,8': LO > HI; swap them (8,9)"),
    (["--refill-widths", "0"], "refill-widths 0 must be at least 1"),
])
def test_bad_input_is_one_line_before_any_model(extra, words, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rollout_bench, "load_model", _no_model)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(BASE + extra + ["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("python -m gdtool bench --workload rollout: error: ") and words in err[0], err[0]


@pytest.mark.parametrize("argv, words", [
    (["--slots", "4"], "--slots is an option of --workload rollout; add --workload rollout"),
    (["--lengths", "geom:8:32"], "--lengths is an option of --workload rollout"),
    (["--workload", "serve"], "argument --workload: invalid choice: 'serve'"),
])
def test_decode_workload_refuses_rollout_options(argv, words, tmp_path, monkeypatch, capsys):
    from gdtool.frontends import bench
    monkeypatch.setattr(bench, "load_model", _no_model)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--model", "tiny-llama", "--device", "cpu", *argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m gdtool bench: error: ") and words in err[0], err


def test_help_names_the_workload(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    decode_help = capsys.readouterr().out
    assert "--workload {decode,rollout}" in decode_help and "bench --workload rollout" in decode_help
    with pytest.raises(SystemExit):
        cli.main(["bench", "--workload", "rollout", "--help"])
    rollout_help = capsys.readouterr().out
    for option in ("--slots", "--prompts", "--lengths", "--cb-cuda-graphs", "--repeats", "--out"):
        assert option in rollout_help
    assert "--batch" not in rollout_help


class _NoContinuousBatching:
    """A stand-in model: transformers gives it no continuous batching."""


class _ContinuousBatchingThatFails:
    """A stand-in model whose continuous batching exists but cannot start here."""
    continuous_batching_context_manager = None


def test_runners_subset_and_a_short_warm_up(tmp_path, capsys, monkeypatch):
    """--runners measures only those named (its name says so); the warm-up call decodes 2 x slots prompts and
    the timed call all of them."""
    calls = []
    real = rollout_bench.rollout

    def counted(model, prompts, **kwargs):
        calls.append(len(prompts))
        return real(model, prompts, **kwargs)
    monkeypatch.setattr(rollout_bench, "rollout", counted)
    argv = BASE + ["--prompts", "10", "--prompt-len", "4", "--slots", "2", "--lengths", "uniform:1:6", "--repeats",
                   "1", "--runners", "device,static", "--out", str(tmp_path)]
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0, table
    assert {r["runner"] for r in doc["results"]} == {"static", "device"}
    assert doc["files"][0].endswith("tiny-llama_rollout_s2_n10_p4_uniform1-6_static-device.csv")
    assert calls == [4, 10, 4, 10]
    assert "device/static" in table and re.search(r"device/host -", table)


def test_the_static_runner_pads_every_batch_to_the_widest_prompt(tmp_path, capsys, monkeypatch):
    """Ragged prompts: the static runner's batches are all left-padded to the workload's widest prompt (rollout's
    `buckets`), in the warm-up call and the timed one, so its Decoder builds one graph, not one per batch width."""
    import gdtool.loops.decoder as decoder
    seen, built = [], []
    real, engine = rollout_bench.rollout, decoder.Engine

    def recorded(model, prompts, **kwargs):
        seen.append((kwargs.get("buckets"), max(map(len, prompts))))
        return real(model, prompts, **kwargs)
    monkeypatch.setattr(rollout_bench, "rollout", recorded)
    monkeypatch.setattr(decoder, "Engine", lambda *a, **k: built.append(tuple(a[3].shape)) or engine(*a, **k))
    argv = BASE + ["--prompts", "10", "--prompt-len", "2,24", "--slots", "2", "--lengths", "uniform:1:6",
                   "--repeats", "1", "--runners", "static", "--out", str(tmp_path)]
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0, table
    widest = max(w for _, w in seen)
    assert len(seen) == 2 and all(b == (widest,) for b, _ in seen), seen
    assert set(built) == {(2, widest)} and len(built) == 2, built   # one graph a call (the warm-up's, the timed one's)


def test_setup_in_parts_is_printed_and_kept(tmp_path, capsys, monkeypatch):
    """A captured rollout's setup_s in parts (warm-up, capture, ...) is printed under the table and kept in the
    files; a CPU rollout captures nothing, so its parts are given here."""
    real = rollout_bench.rollout

    def with_parts(model, prompts, **kwargs):
        out = real(model, prompts, **kwargs)
        if kwargs["refill"] == "device":
            out.setup_parts = {"warmup_s": 0.25, "capture_s": 0.125}
        return out
    monkeypatch.setattr(rollout_bench, "rollout", with_parts)
    argv = BASE + ["--prompts", "6", "--prompt-len", "4", "--slots", "2", "--lengths", "uniform:1:6", "--repeats",
                   "1", "--runners", "host,device", "--out", str(tmp_path)]
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0, table
    assert re.search(r"device \(.*\): setup_s in parts: warmup_s 0.250, capture_s 0.125", table)
    assert "host (gdtool refill=host, step-graph, hf): setup_s in parts" not in table
    saved = json.loads(Path(next(f for f in doc["files"] if f.endswith(".json"))).read_text())
    kept = {r["runner"]: r["setup_parts"] for r in saved["summary"]}
    assert json.loads(kept["device"]) == {"warmup_s": 0.25, "capture_s": 0.125} and kept["host"] == ""


def test_refill_widths_are_printed_and_kept(tmp_path, capsys):
    """Ragged prompts with --refill-widths 2: each refill runner's prefills per width are kept in the files (they
    add up to its prefills) and printed where there is more than one; one width is kept, not printed."""
    argv = BASE + ["--prompts", "12", "--prompt-len", "1,32", "--slots", "2", "--lengths", "uniform:1:6",
                   "--repeats", "1", "--runners", "host,device", "--refill-widths", "1", "2", "--out", str(tmp_path)]
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0, table
    kept = {}
    for path in sorted(f for f in doc["files"] if f.endswith(".json")):
        saved = json.loads(Path(path).read_text())
        for r in saved["summary"]:
            widths = json.loads(r["refill_widths"])
            assert sum(widths.values()) == r["prefills"]
            kept[saved["config"]["refill_widths"], r["runner"]] = widths
    assert kept[1, "host"] == kept[1, "device"] and len(kept[1, "host"]) == 1
    assert kept[2, "host"] == kept[2, "device"] and len(kept[2, "host"]) == 2, kept
    printed = re.findall(r"refills by prefill width: (.*)", table)
    assert len(printed) == 2 and all(p == ", ".join(f"{w} columns {n}" for w, n in kept[2, "host"].items())
                                     for p in printed)


def test_a_cut_run_keeps_the_runners_it_measured(tmp_path, capsys, monkeypatch):
    """A run stopped during a runner (a time limit, an interrupt) leaves NAME.partial.csv/.json with the runners
    measured before it; resuming measures the config again (a partial file is never skipped), and the whole
    config's files replace the partial ones."""
    argv = BASE + ["--prompts", "6", "--prompt-len", "4", "--slots", "2", "--lengths", "uniform:1:6", "--repeats",
                   "1", "--runners", "static,device,eos-off", "--out", str(tmp_path)]
    real = rollout_bench.measure

    def cut(model, runner, work, cfg):
        if runner == "eos-off":
            raise KeyboardInterrupt
        return real(model, runner, work, cfg)
    monkeypatch.setattr(rollout_bench, "measure", cut)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv + ["--json"])
    capsys.readouterr()
    name = "tiny-llama_rollout_s2_n6_p4_uniform1-6_static-device-eos-off"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.partial.csv", f"{name}.partial.json"]
    kept = record.read_sidecar(tmp_path / f"{name}.partial.json")
    assert [r["runner"] for r in kept["summary"]] == ["static", "device"]
    assert all(r["status"] == "ok" and r["tok_s"] > 0 for r in kept["summary"])
    assert set(pd.read_csv(tmp_path / f"{name}.partial.csv").runner) == {"static", "device"}
    monkeypatch.setattr(rollout_bench, "measure", real)
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0 and "skipped" not in table, table
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.csv", f"{name}.json"]
    assert [r["runner"] for r in doc["results"]] == ["static", "device", "eos-off"]


def test_ragged_prompts_and_width_buckets(tmp_path, capsys, monkeypatch):
    """--prompt-len LO,HI draws ragged prompts (seeded, in [LO, HI]); --refill-widths gives one config per
    value, named by it, and the refill runners get it: with three buckets the refills ran at more than one width,
    and every runner kept the same useful tokens."""
    widths = []
    real = rollout_bench.rollout

    def seen(model, prompts, **kwargs):
        out = real(model, prompts, **kwargs)
        if kwargs.get("refill") != "off":
            widths.append((kwargs["refill_widths"], dict(out.refill_widths), sorted({len(p) for p in prompts})))
        return out
    monkeypatch.setattr(rollout_bench, "rollout", seen)
    argv = BASE + ["--prompts", "12", "--prompt-len", "2,40", "--slots", "3", "--lengths",
                   "uniform:1:6", "--repeats", "1", "--runners", "static,device", "--refill-widths", "1,3",
                   "--out", str(tmp_path)]
    rc, table, doc = run_cli(argv, capsys)
    assert rc == 0, table
    names = sorted(Path(f).name for f in doc["files"] if f.endswith(".json"))
    assert names == ["tiny-llama_rollout_s3_n12_p2-40_uniform1-6_static-device.json",
                     "tiny-llama_rollout_s3_n12_p2-40_uniform1-6_static-device_widths3.json"]
    lengths = widths[-1][2]
    assert len(lengths) > 3 and min(lengths) >= 2 and max(lengths) <= 40
    assert {len(w) for n, w, _ in widths if n == 1} == {1} and max(len(w) for n, w, _ in widths if n == 3) > 1
    useful = [r["useful_tokens"] for r in doc["results"]]
    assert len(useful) == 4 and len(set(useful)) == 1, useful


@pytest.mark.parametrize("seed", range(6))
def test_the_warm_up_builds_what_the_timed_call_builds(seed):
    """The warm-up call runs the first WARMUP_BATCHES x slots prompts only where they ask for the whole queue's
    shapes (the refill plan: W, width buckets, refill graphs; the static batches' rows, all at the whole workload's
    widest prompt); otherwise the
    timed call would compile and capture its own (at ragged prompts, on a GPU, most of its wall time). Seeded
    draws of equal and ragged prompts."""
    import random
    from gdtool.core.rollout_step import refill_plan
    rng = random.Random(seed)
    slots = rng.choice([2, 4, 8])
    n = slots * rng.randint(1, 8) if seed % 2 else rng.randint(1, 60)   # odd seeds: equal prompts, full batches
    lo = rng.choice([16, 40, 128])
    lengths = [lo if seed % 2 else rng.randint(4, lo) for _ in range(n)]
    work = rollout_bench.Workload([[1] * k for k in lengths], [1] * n, slots, 8, [2], 0, None)
    for rows, widths in ((8, 1), (4, 3)):
        part = rollout_bench.warmup_part(work, rows, widths)
        plan = refill_plan(lengths, slots, rows, widths)
        assert refill_plan([len(p) for p in part.prompts], slots, rows, widths) == plan
        batches = [len(part.prompts[i:i + slots]) for i in range(0, len(part.prompts), slots)]
        assert set(batches) == {len(lengths[i:i + slots]) for i in range(0, n, slots)}
        assert part.prompts == work.prompts[:len(part.prompts)] and part.targets == work.targets[:len(part.prompts)]
        if seed % 2:   # equal prompts in full batches: the short warm-up
            assert len(part.prompts) == min(n, rollout_bench.WARMUP_BATCHES * slots)


def test_hf_cb_is_na_with_the_reason_where_it_cannot_run(monkeypatch):
    cfg = rollout_bench.RolloutConfig("tiny-llama", slots=2, prompts=6, prompt_len=4, lengths="uniform:1:6",
                                      repeats=1)
    result = rollout_bench.measure(_NoContinuousBatching(), "hf-cb", None, cfg)
    assert result.status == "n/a" and "no continuous batching" in result.note and not result.samples

    class Fails:
        def __init__(self, *args):
            pass

        def __call__(self, part=None):
            raise RuntimeError("the paged cache needs a CUDA device")
    monkeypatch.setattr(rollout_bench, "ContinuousBatchingRunner", Fails)
    work = rollout_bench.Workload([[5, 6]] * 6, [1] * 6, 2, 6, [2], 2, None)
    result = rollout_bench.measure(_ContinuousBatchingThatFails(), "hf-cb", work, cfg)
    assert result.status == "n/a" and not result.samples
    assert result.note == ("continuous batching does not run here: RuntimeError: the paged cache needs a CUDA "
                           "device")
