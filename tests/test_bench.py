"""`python -m gdtool bench` on CPU with a tiny model: it runs, prints the table (and with --json one JSON
document), writes CSV + JSON, resumes, and its peers compute the same tokens as generate(). No speed is
asserted."""
import json

import pandas as pd
import pytest
import torch

import gdtool
from gdtool.frontends import bench
from gdtool.measure import roofline

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


TINY = ["--model", "tiny-llama", "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "8", "--repeats", "2"]


def run_main(argv, capsys):
    rc = bench.main(argv + ["--json", "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.err, json.loads(captured.out)


def refused(argv, capsys) -> str:
    """The one line a bad argument ends bench with (exit 2, as argparse)."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("python -m gdtool bench: error:"), err
    return err.splitlines()[-1]


def test_cli_prints_table_and_json(tmp_path, capsys):
    rc, out, doc = run_main(TINY + ["--device", "cpu", "--out", str(tmp_path)], capsys)
    assert rc == 0
    for heading in ("runner", "tok/s", "ms/step", "GB/s", "%floor", "x generate", "x gpt-fast"):
        assert heading in out
    assert "gdtool step-graph" in out and "n/a (cpu)" in out
    assert "ran their step uncaptured" in out  # on a CPU the table says nothing was captured
    assert doc["captured"] is False

    rows = {r["runner"]: r for r in doc["results"]}
    assert set(rows) == {*gdtool.MODES, "generate", "generate-static", "gpt-fast"}
    for runner in (*gdtool.MODES, "generate"):
        assert rows[runner]["status"] == "ok"
        assert rows[runner]["tok_s"] > 0 and 0 < rows[runner]["floor_pct"]
        assert rows[runner]["dynamo_graphs"] == 0  # nothing compiled with HF's kernels
    for runner in ("generate-static", "gpt-fast"):
        assert rows[runner]["status"] == "n/a (cpu)" and rows[runner]["tok_s"] is None
    # ratio = gdtool tok/s over the peer's, for gdtool rows only
    step = rows["step-graph"]
    # the document keeps six decimals (the resumed run reads them back from the CSV): a ratio is within one in the sixth
    assert step["x_generate"] == pytest.approx(step["tok_s"] / rows["generate"]["tok_s"], rel=0, abs=1e-6)
    assert rows["generate"]["x_generate"] is None

    name = "tiny-llama_b2_p8_n8"
    assert doc["files"] == [str(tmp_path / f"{name}.csv"), str(tmp_path / f"{name}.json")]
    df = pd.read_csv(tmp_path / f"{name}.csv")
    timed = df[df.status == "ok"]
    assert len(timed) == (len(gdtool.MODES) + 1) * 2  # gdtool's modes and generate eager x 2 repeats
    assert (timed.steps == 7).all() and (timed.batch == 2).all() and (timed.max_new_tokens == 8).all()
    # gdtool keeps generate()'s tokens bit for bit with HF's kernels
    assert (timed.token_agreement == 1.0).all()
    meta = json.loads((tmp_path / f"{name}.json").read_text())
    from gdtool.measure import record
    assert set(record.ENV_KEYS) <= set(meta["environment"]) and "copy_gb_s" in meta["environment"]
    assert meta["config"]["batch"] == 2 and meta["name"] == name

    # the same command again resumes: the config is already there, nothing is measured
    rc, out, again = run_main(TINY + ["--device", "cpu", "--out", str(tmp_path)], capsys)
    assert rc == 0 and "skipped" in out
    assert [r["tok_s"] for r in again["results"]] == [r["tok_s"] for r in doc["results"]]
    rc, out, redone = run_main(TINY + ["--device", "cpu", "--out", str(tmp_path), "--redo"], capsys)
    assert rc == 0 and "skipped" not in out


def test_batch_list_and_subsets(tmp_path, capsys):
    argv = ["--model", "tiny-llama", "--batch", "1,3", "--prompt-len", "4", "--max-new-tokens", "3", "--repeats", "1",
            "--device", "cpu", "--modes", "step-graph", "--peers", "generate", "--out", str(tmp_path)]
    rc, out, doc = run_main(argv, capsys)
    assert rc == 0
    assert [(r["batch"], r["runner"]) for r in doc["results"]] == [(1, "step-graph"), (1, "generate"),
                                                                  (3, "step-graph"), (3, "generate")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama_b1_p4_n3.csv", "tiny-llama_b1_p4_n3.json",
                                                         "tiny-llama_b3_p4_n3.csv", "tiny-llama_b3_p4_n3.json"]


def test_bad_arguments_say_what_to_do(capsys):
    assert "unknown peer 'vllm'; choose from generate, generate-static, gpt-fast" in refused(
        TINY + ["--peers", "vllm"], capsys)
    assert "unknown mode 'fast'" in refused(TINY + ["--modes", "fast"], capsys)
    assert "nothing to measure" in refused(TINY + ["--modes", "none", "--peers", "none"], capsys)
    assert "max-new-tokens 1 must be at least 2" in refused(["--model", "tiny-llama", "--max-new-tokens", "1"], capsys)
    assert "batch 0 must be at least 1" in refused(["--batch", "1,0"], capsys)


def test_a_failing_runner_is_reported_and_the_rest_still_run(tmp_path, capsys, monkeypatch):
    def broken(model, prompt, static):
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(bench, "_generate_runner", broken)
    argv = TINY + ["--device", "cpu", "--modes", "eager", "--peers", "generate", "--out", str(tmp_path)]
    rc, out, doc = run_main(argv, capsys)
    assert rc == 1
    rows = {r["runner"]: r for r in doc["results"]}
    assert rows["generate"]["status"].startswith("error: RuntimeError: CUDA out of memory")
    assert rows["eager"]["status"] == "ok"


def test_config_name():
    assert bench.BenchConfig(model="llama-1b", batch=1).name == "llama-1b_b1_p128_n256"
    cfg = bench.BenchConfig(model="/ckpt/Qwen2.5-0.5B", batch=64, kernels=("hf", "compiled"))
    assert cfg.name == "Qwen2.5-0.5B_b64_p128_n256_khf+compiled"
    assert cfg.config_hash != bench.BenchConfig(model="/ckpt/Qwen2.5-0.5B", batch=32).config_hash


def test_modes_pinned_to_kernels_run_once_with_those_kernels():
    pairs = bench.runners(("eager", "step-graph", "step-graph+compiled", "device-loop+compiled"), ("hf",))
    assert pairs == [("eager", "hf"), ("step-graph", "hf"), ("step-graph", "compiled"), ("device-loop", "compiled")]
    # a pinned entry that a plain mode already yields runs once
    assert bench.runners(("step-graph", "step-graph+compiled"), ("hf", "compiled")) == [
        ("step-graph", "hf"), ("step-graph", "compiled")]
    cfg = bench.BenchConfig(model="llama-1b", batch=1, modes=("eager", "step-graph+compiled"))
    assert cfg.name == "llama-1b_b1_p128_n256_khf+compiled"
    assert bench.BenchConfig(model="llama-1b", batch=1, modes=("step-graph",), kernels=("compiled",)).name == \
        "llama-1b_b1_p128_n256_kcompiled"


def test_unknown_mode_is_refused_with_the_choices(capsys):
    import re
    assert re.search("unknown mode.*step-grph.*mode\\+kernels", refused(["--modes", "step-grph+compiled", "--peers",
                                                                       "none"], capsys))


def test_unknown_kernels_are_refused_before_anything_runs(capsys):
    assert "unknown kernels 'compild'" in refused(["--modes", "step-graph+compild", "--peers", "none"], capsys)
    assert "choose from hf, compiled" in refused(["--modes", "step-graph", "--kernels", "hf,fused", "--peers", "none"],
                                                 capsys)


def test_fuse_projections_with_nothing_to_fuse_is_refused(monkeypatch, capsys, tmp_path):
    import gdtool.kernels.fuse
    monkeypatch.setattr(gdtool.kernels.fuse, "fuse_projections", lambda model: 0)
    # --out is made and checked before any work, so it must be a folder the test may write
    err = refused(["--model", "tiny-llama", "--device", "cpu", "--fuse-projections", "--peers", "none",
                   "--no-progress", "--out", str(tmp_path / "unused")], capsys)
    assert "found no q/k/v or gate/up" in err and "drop the flag" in err


def test_step_bytes_counts_weights_once_and_the_mean_live_cache(load):
    model = load("tiny-llama")  # tied embeddings: the head reads the table, counted once
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    b = roofline.step_bytes(model, batch=3, prompt_len=10, max_new_tokens=6)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert b["weight_bytes"] == params * 4
    assert b["kv_bytes"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (10 + 3) * 3 * 4
    assert b["bytes_per_step"] == b["weight_bytes"] + b["kv_bytes"]

    from transformers import LlamaConfig, LlamaForCausalLM
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    all_params = sum(p.numel() for p in untied.parameters())
    # an untied input embedding is looked up, not read: one row per sequence
    expected = (all_params - 500 * 32 + 3 * 32) * 4
    assert roofline.step_bytes(untied, batch=3, prompt_len=10, max_new_tokens=6)["weight_bytes"] == expected


def _cfg(**kw):
    return bench.BenchConfig(model="tiny-llama", batch=3, prompt_len=6, max_new_tokens=7, repeats=2, **kw)


def test_peers_compute_generates_tokens_and_flag_an_eager_fallback(load):
    model = load("tiny-llama")
    cfg = _cfg()
    prompt = gdtool.random_prompts(model, batch=3, lengths=(6, 6), seed=0)
    reference = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask, max_new_tokens=7,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[:, 6:]

    # on CPU generate(cache_implementation="static") does not compile: the bench must say so
    static = bench._measure(bench.RunnerResult("generate-static", "peer", "static"),
                            bench._generate_runner(model, prompt, static=True), cfg, 7, compiled=True)
    assert static.status == "eager-fallback" and "ran eager" in static.note
    # the gpt-fast-style loop, uncompiled: same static cache logic, same tokens
    loop = bench._measure(bench.RunnerResult("gpt-fast", "peer", "gpt-fast"),
                          bench._gptfast_runner(model, prompt, 7, compile_kwargs=None), cfg, 4, compiled=False)
    for result in (static, loop):
        assert len(result.samples) == 2
        for sample in result.samples:
            assert sample.steps == 6 and sample.decode_s > 0
            assert torch.equal(sample.tokens, reference)


def test_gptfast_step_compiles_once_and_counts_graphs(load):
    model = load("tiny-llama")
    prompt = gdtool.random_prompts(model, batch=3, lengths=(6, 6), seed=0)
    once = bench._gptfast_runner(model, prompt, 7, compile_kwargs=dict(backend="eager", fullgraph=True))
    result = bench._measure(bench.RunnerResult("gpt-fast", "peer", "gpt-fast"), once, _cfg(), 4, compiled=True)
    assert result.status == "ok", result.note
    assert result.compile["graphs"] == 1 and result.compile["recompiles"] == 0
    assert result.compile["graphs_in_timed_runs"] == 0


def test_dynamo_stats_count_recompiles():
    bench._dynamo_fresh()
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    double(torch.ones(2))
    double(torch.ones(3))  # a new shape: a recompile
    double(torch.ones(3))
    stats = bench._dynamo_stats()
    assert stats["graphs"] == 2 and stats["recompiles"] == 1
    bench._dynamo_fresh()
    assert bench._dynamo_stats()["graphs"] == 0


def test_token_count_is_asserted(load):
    model = load("tiny-llama")

    def short_once(new_tokens):  # a runner that stops early (EOS left on, say)
        return bench.Sample(decode_s=1.0, prefill_s=0.1, steps=new_tokens - 1,
                            tokens=torch.zeros(3, new_tokens - 2, dtype=torch.long))
    with pytest.raises(AssertionError, match="expected \\(3, 7\\): EOS must be off"):
        bench._measure(bench.RunnerResult("x", "peer", "x"), short_once, _cfg(), 4, compiled=False)


@pytest.mark.cuda
def test_compiled_peers_really_compile_on_cuda(tmp_path, capsys):
    argv = ["--model", "tiny-llama", "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "16", "--repeats", "2",
            "--modes", "step-graph", "--out", str(tmp_path)]
    rc, out, doc = run_main(argv, capsys)
    assert rc == 0, out
    rows = {r["runner"]: r for r in doc["results"]}
    for runner in ("generate-static", "gpt-fast"):
        assert rows[runner]["status"] == "ok", rows[runner]
        assert rows[runner]["dynamo_graphs"] >= 1
    df = pd.read_csv(tmp_path / "tiny-llama_b2_p8_n16.csv")
    assert (df.groupby("runner").dynamo_graphs_in_timed_runs.max() == 0).all()


def test_step_bytes_of_a_mixture_of_experts_count_the_experts_hit():
    import gdtool
    from gdtool.measure import roofline
    model = gdtool.load_model("tiny-qwen3-moe")   # 8 experts, 2 per token
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    one = roofline.step_bytes(model, 1, 8, 8)["weight_bytes"]
    many = roofline.step_bytes(model, 512, 8, 8)["weight_bytes"]
    assert one < many <= total and many > 0.99 * total   # batch 1 reads 2 of 8 experts; a big batch all of them
