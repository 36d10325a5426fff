"""gdtool's decode kernels (kernels="fast"): each against float64, and the fast decode step.

On a CPU: the torch references (what runs without Triton) against float64, always; the Triton
kernels themselves under Triton's CPU interpreter where Triton is installed (float32 and float16:
the interpreter of Triton 3.6 rounds to bf16 by truncation and mishandles bf16 dots); the fast step
of tiny Llama, Qwen2, Qwen3 and Mistral models against HF's kernels, and a seeded sweep of every family the fast
forward takes (`fastcases.py`: batch against the line, padding, sampling, EOS, every mode) against generate();
one forward of the Triton kernels under the interpreter against the torch references. On CUDA: the kernels in
bf16 and fp16 at small and real Llama / Qwen shapes, PDL on and off, and the fast step of each family (Llama,
Qwen2, Qwen3, Mistral) captured against itself uncaptured, at one pass of rows and at two; the seeded sweep in
bf16, every mode bit for bit its uncaptured twin's.
Tolerances: gdtool/kernels/testing.py (relative L2 error against float64, by dtype).
"""
import os
import sys
import warnings

import pytest
import torch

import gdtool
import gdtool.loops.devloop
import fastcases
from gdtool.kernels import step as fast, testing, forward as fast_decoder, gemv, triton as fast_triton, tuning
from gdtool.kernels import attention as fast_attention
from gdtool.measure import accuracy
from interpreter import run_interpreted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_references_against_float64(dtype):
    results = testing.check_all("cpu", dtype, impl="reference")
    bad = [r for r in results if not r.ok or not r.reference_error <= r.tolerance]
    assert not bad, testing.table(bad)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~60 s on 2 cores (Triton's interpreter)
def test_triton_kernels_under_the_interpreter():
    code = ("import torch\nfrom gdtool.kernels import testing\n"
            "for dt in (torch.float32, torch.float16):\n"
            "    bad = [r for r in testing.check_all('cpu', dt) if not r.ok]\n"
            "    assert not bad, testing.table(bad)\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_norm_weights_before_the_wait_under_the_interpreter_equal_the_late_loads():
    """`gemv.early_norm`: the norms' weights (and the q/k norm kernel's positions and inverse frequencies, the MoE
    router's first chunk of norm weights) loaded before the PDL wait give the bits of the loads after it: over a
    seeded sweep of rows (one pass and several), sizes, Gemma's (1 + w) norms and folded add, q/k norms (two
    kernels) and the MoE router, every output and cache bit for bit the same."""
    code = ("import random, torch\nfrom gdtool.kernels import experts, gemv\n"
            "gen = torch.Generator().manual_seed(4)\n"
            "rng = random.Random(4)\n"
            "def rand(*shape):\n"
            "    return torch.randn(*shape, generator=gen).half()\n"
            "for i in range(6):\n"
            "    m, k, n, d, hkv = rng.choice((1, 3, 6)), rng.choice((64, 96)), rng.choice((40, 64)), rng.choice((16, 32)), 2\n"
            "    plus_one = i % 2 == 1\n"
            "    x, a, g, ga = rand(m, k), rand(m, k), 1 + 0.1 * rand(k), 0.1 * rand(k)\n"
            "    w, w2, gq, gk = rand(n, k) / 8, rand(n, k) / 8, 1 + 0.1 * rand(d), 1 + 0.1 * rand(d)\n"
            "    ws = [rand(h * d, k) / 8 for h in (4, hkv, hkv)]\n"
            "    rope = (torch.randint(0, 5000, (m, 1), generator=gen), 1.0 / (1e4 ** (torch.arange(0, d, 2) / d)), 1.0)\n"
            "    caches = [rand(m, hkv, 9, d) for _ in range(2)]\n"
            "    e = 8\n"
            "    rw, gu, dn = rand(e, k) / 8, rand(e, 2 * 16, k) / 8, rand(e, k, 16) / 4\n"
            "    outs = []\n"
            "    for early in (True, False):\n"
            "        gemv.early_norm = experts.router.early_norm = (lambda device, on=early: on)\n"
            "        mine = [c.clone() for c in caches]\n"
            "        add = (a, ga, 1e-6) if plus_one else None\n"
            "        y = gemv.rms_gemv(x, g, 1e-5, w, w2, None, False, config=(4, 4, 2), plus_one=plus_one, add=add)\n"
            "        q = gemv.qkv_rope(x, g, 1e-5, *ws, *rope, *mine, torch.tensor(3), None, (gq, gk, 1e-6), plus_one,\n"
            "                          config=(2, 4, 2), add=add)\n"
            "        moe = experts.block_triton(x, rw, gu, dn, 2, True, False, residual=x, norm=(g, 1e-6))\n"
            "        outs.append([*(y if add else (y,)), *(q if add else (q,)), *mine, moe])\n"
            "    assert all(torch.equal(u, v) for u, v in zip(*outs)), i\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~60 s on 2 cores (Triton's interpreter)
def test_folded_embedding_under_the_interpreter_decodes_the_lookups_tokens_and_scores():
    """`gemv.fold_embedding`: the embedding lookup folded into the first layer's qkv_rope (Gemma's scaled one too)
    decodes the tokens and scores of HF's embedding module run first, bit for bit, at one pass of rows and several
    (the kernels' checks against the lookup alone: `testing.check_folded_embedding`). On Llama the interpreter's
    larger GEMV tiles (`tuning.interpreter()`, which every interpreter test reads) decode the defaults' bits too."""
    code = ("import torch, gdtool\nfrom gdtool.kernels import step, triton, tuning\n"
            "for name, batch in (('tiny-llama', 2), ('tiny-gemma3', 6)):\n"
            "    model = gdtool.load_model(name, seed=0)\n"
            "    prompt = gdtool.random_prompts(model, batch=batch, lengths=(3, 7), seed=1)\n"
            "    kw = dict(max_new_tokens=4, eos_token_id=None, pad_token_id=0, do_sample=False, kernels='fast',\n"
            "              return_scores=True)\n"
            "    outs = []\n"
            "    for fold in (True, False):\n"
            "        with triton.switches(fold_embedding=fold):\n"
            "            outs.append(gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw))\n"
            "    if name == 'tiny-llama':\n"
            "        assert tuning.current().multiprocessors == 1\n"
            "        with tuning.use(tuning.defaults()):   # 8-row GEMV tiles, 10x the interpreter's time\n"
            "            outs.append(gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw))\n"
            "        assert torch.equal(outs[0].tokens, outs[2].tokens), name\n"
            "        assert torch.equal(torch.stack(outs[0].scores), torch.stack(outs[2].scores)), name\n"
            "    assert 'Triton kernels' in step.compiles(model).kernels.iloc[-1]\n"
            "    assert torch.equal(outs[0].tokens, outs[1].tokens), name\n"
            "    assert torch.equal(torch.stack(outs[0].scores), torch.stack(outs[1].scores)), name\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


def test_folded_embedding_runs_on_cuda_only_where_tested(monkeypatch):
    """GDTOOL_FOLD_EMBEDDING (on by default): on a CPU taken; on CUDA only once its cuda tests passed there (or
    GDTOOL_UNTESTED_KERNELS=1); off, HF's embedding module runs first everywhere."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")   # device types only: nothing is allocated on them
    monkeypatch.delenv("GDTOOL_UNTESTED_KERNELS", raising=False)
    monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((9, 0), "3.6"))
    assert fast_triton.SWITCHES["fold_embedding"] == ("GDTOOL_FOLD_EMBEDDING", True)   # on by default
    with fast_triton.switches(fold_embedding=True):
        assert gemv.fold_embedding(cpu)
        assert gemv.fold_embedding(cuda) == (gemv.FOLD_EMBEDDING_PATH in fast_triton.CUDA_TESTED[(9, 0), "3.6"])
        monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((8, 0), "3.6"))   # no cuda test ran there
        assert not gemv.fold_embedding(cuda)
        monkeypatch.setenv("GDTOOL_UNTESTED_KERNELS", "1")
        assert gemv.fold_embedding(cuda)
    with fast_triton.switches(fold_embedding=False):
        assert not gemv.fold_embedding(cpu) and not gemv.fold_embedding(cuda)


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_fast_step_on_cpu_decodes_hf_tokens_and_says_what_ran():
    """float32 on a CPU: the fast forward and greedy tail (torch references) give HF's tokens; compiles() names
    them; a batch over the GEMV's rows falls back to the compiled HF forward."""
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(4, 9), seed=0)   # tiny-llama's line: 2 rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf = _decode(model, prompt)
        mine = _decode(model, prompt, kernels="fast")
        again = _decode(model, prompt, kernels="fast")
    assert not [w for w in caught if str(w.message).startswith("gdtool:")]
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    table = fast.compiles(model)
    row = table[table.step.str.endswith("_fast")]
    # greedy: the forward and the step's tail in gdtool's kernels (their torch references here), nothing compiled
    assert len(row) == 1 and row.compiles.iloc[0] == 0 and row.calls.iloc[0] > 0
    assert row.kernels.iloc[0].startswith("fast: fast decode forward, 2 layers")
    assert "argmax, update and counters in one kernel" in row.kernels.iloc[0]
    wide = gdtool.random_prompts(model, batch=9, lengths=(4, 9), seed=1)
    assert torch.equal(_decode(model, wide, kernels="fast").tokens, _decode(model, wide).tokens)
    note = fast.compiles(model).kernels.iloc[-1]
    assert "HF forward compiled" in note and "(batch 9: matrix products" in note


def test_matrix_vector_line_moved_to_16_rows_decodes_hf_tokens_at_12(monkeypatch):
    """`forward.gemv_line` (`profiles/plan_bench.py --gemv-rows N`, in gpu_run.sh's bench-batches: the GPU sweep
    that places the line between the matrix-vector kernels and the compiled matmuls): with the line at 16 the fast
    forward takes batch 12 in passes of 4 rows and gives HF's tokens; a line outside 0-16 rows is refused with the
    range; at 0 every batch takes the compiled matmuls, at 2 one pass takes 1-2 rows."""
    for rows in (-1, 17):
        with pytest.raises(ValueError, match=f"--gemv-rows {rows}: .* 0 to 16 rows"):
            fast_decoder.gemv_line(rows)
    for hidden in (64, 4096):   # a sweep's line holds for every shape
        monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(0)])
        paths = fast_decoder.line_paths(hidden)
        assert fast_decoder.gemv_rows(paths) == 0 and fast_decoder.batch_path(1, paths)[0] == "compiled"
        monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(3)])
        paths = fast_decoder.line_paths(hidden)
        assert fast_decoder.gemv_rows(paths) == 3 and [fast_decoder.batch_path(b, paths)[0] for b in (1, 3, 4)] == \
            ["gemv", "gemv", "compiled"]
    monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(16)])
    assert fast_decoder.gemv_rows(fast_decoder.line_paths(2048)) == 16
    model = gdtool.load_model("tiny-llama", seed=0)
    assert fast_decoder.plan(model, 16, 40).applies and not fast_decoder.plan(model, 17, 40).applies
    prompt = gdtool.random_prompts(model, batch=12, lengths=(4, 9), seed=2)
    assert torch.equal(_decode(model, prompt, kernels="fast").tokens, _decode(model, prompt).tokens)
    note = fast.compiles(model).kernels.iloc[-1]
    assert note.startswith("fast: fast decode forward, 2 layers") and "batch 12" in note and "passes of 4 rows" in note


def test_fast_forward_plan_reads_the_family_and_the_batch():
    """Llama, Mistral, Qwen2 (biases), Qwen3 (q/k norm) by their modules; other families, a window shorter
    than the cache, batches past the matrix-vector rows (the measured line: 2 rows to hidden size 2048, 1 row
    wider), and non-SiLU MLPs are refused with the reason."""
    for name, feature in (("tiny-llama", "Llama, batch"), ("tiny-qwen2", "Qwen2 (q/k/v biases)"),
                          ("tiny-qwen3", "Qwen3 (q/k norm)")):
        model = gdtool.load_model(name, seed=0)
        for batch in (1, 2):
            p = fast_decoder.plan(model, batch, 40)
            assert p.applies and feature in p.reason and not p.matmuls, (name, batch, p.reason)
        for batch in (3, 4, 5, 8, 9):
            p = fast_decoder.plan(model, batch, 40)
            assert not p.applies and p.matmuls, (name, batch, p.reason)
            assert "matrix products: past 2 rows at hidden size 64" in p.reason, (name, batch, p.reason)
        model.config.hidden_size = 4096   # the line reads the shape off the config: one row past hidden 2048
        assert fast_decoder.plan(model, 1, 40).applies and fast_decoder.plan(model, 2, 40).matmuls
    moe = gdtool.load_model("tiny-qwen3-moe", seed=0)
    assert "Qwen3Moe (experts, q/k norm), batch 1" in fast_decoder.plan(moe, 1, 40).reason
    gemma = gdtool.load_model("tiny-gemma3", seed=0)
    for unmeasured in (moe, gemma):  # their line stays at two passes of 4 rows until a curve measures it
        assert "passes of 4 rows" in fast_decoder.plan(unmeasured, 8, 8).reason, fast_decoder.plan(unmeasured, 8, 8)
        assert not fast_decoder.plan(unmeasured, 9, 8).applies
    assert "is not one of LlamaForCausalLM" in fast_decoder.plan(gdtool.load_model("tiny-gpt-oss", seed=0), 1).reason
    mistral = fastcases.tiny_mistral(64)
    assert fast_decoder.plan(mistral, 2, 64).applies and "window 64 >= cache" in fast_decoder.plan(mistral, 2, 64).reason
    refused = fast_decoder.plan(mistral, 2, 65)
    assert not refused.applies and "sliding window 64 shorter than the cache (65 slots)" in refused.reason
    assert not tuning._override   # no sweep's line: the defaults' batch lines per shape
    for hidden, line in ((64, 2), (2048, 2), (2049, 1), (4096, 1), (8192, 1)):
        paths = fast_decoder.line_paths(hidden)
        assert paths[-1][1] == "compiled" and fast_decoder.gemv_rows(paths) == line, (hidden, paths)
        assert [fast_decoder.batch_path(b, paths)[0] for b in (1, line, line + 1, 64)] == ["gemv"] * 2 + ["compiled"] * 2
    unmeasured = fast_decoder.line_paths(None)
    assert [fast_decoder.batch_path(b, unmeasured)[0] for b in (1, 4, 5, 8, 9)] == ["gemv"] * 4 + ["compiled"]
    llama = gdtool.load_model("tiny-llama", seed=0)
    llama.model.layers[0].mlp.act_fn = torch.nn.GELU()
    llama.config.hidden_act = "gelu"
    assert "SiLU" in fast_decoder.plan(llama, 1).reason


def test_the_line_per_shape_over_a_seeded_sweep_of_hidden_sizes_and_batches():
    """forward.plan over seeded draws of hidden size (64-8192, the kernels' widest norm row: the powers of two and between) and batch (1-64),
    for each measured family: the fast forward exactly at the batches MEASURED_LINES gives that hidden size
    (1-2 rows to 2048, one row wider), the matmuls (Plan.matmuls, no swap) at every other; Gemma 3 and an MoE
    model keep their unmeasured passes to 8 rows whatever the width."""
    import random
    rng = random.Random(41)
    models = {name: gdtool.load_model(name, seed=0) for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")}
    models["tiny-mistral"] = fastcases.tiny_mistral(4096)
    unmeasured = [gdtool.load_model(name, seed=0) for name in ("tiny-gemma3", "tiny-qwen3-moe")]
    for _ in range(60):
        hidden = rng.choice((rng.randint(64, 8192), 2 ** rng.randint(6, 13), 2048, 2049))
        batch = rng.choice((rng.randint(1, 64), rng.randint(1, 5)))
        line = 2 if hidden <= 2048 else 1
        for name, model in models.items():
            model.config.hidden_size = hidden   # the line reads the width off the config; nothing else does
            p = fast_decoder.plan(model, batch, 40)
            assert p.applies == (batch <= line) and p.matmuls == (batch > line), (name, hidden, batch, p.reason)
        for model in unmeasured:
            model.config.hidden_size = hidden
            p = fast_decoder.plan(model, batch, 8)
            assert p.matmuls == (batch > 8), (type(model).__name__, hidden, batch, p.reason)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_fast_step_on_cpu_llama_family_decodes_hf_tokens(name, monkeypatch):
    """float32 on a CPU (torch references inside the compiled step): Qwen2's biases, Qwen3's q/k norm and
    Mistral's window (wider than the cache) give HF's tokens, at a batch of one pass and of two (the line moved
    to 8 rows: the passes that Gemma 3 and the MoE models take by default)."""
    monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(8)])
    model = fastcases.tiny_mistral(4096) if name == "tiny-mistral" else gdtool.load_model(name, seed=0)
    for batch in (3, 6):
        prompt = gdtool.random_prompts(model, batch=batch, lengths=(4, 9), seed=batch)
        assert torch.equal(_decode(model, prompt, kernels="fast").tokens, _decode(model, prompt).tokens), batch
        note = fast.compiles(model).kernels.iloc[-1]
        assert note.startswith("fast: fast decode forward, 2 layers"), note


# The seeded sweep (`fastcases.py`; profiles/fast_sweep.py runs more seeds): two cases of each model, drawn in
# batch against the line, padding, length, sampling and EOS; every mode against generate().
FAST_SWEEP = fastcases.cases(2, seed=0)


def test_the_fast_sweep_covers_every_model_path_and_setting():
    got = fastcases.coverage(FAST_SWEEP)
    assert all(got.values()), got


def _ids(cases):
    return [f"{c.model}-b{c.batch}-line{c.line}-s{c.seed}" for c in cases]


@pytest.mark.parametrize("case", FAST_SWEEP, ids=_ids(FAST_SWEEP))
def test_fast_sweep_decodes_generate_tokens_in_every_mode(case):
    failures = fastcases.run(case)
    assert not failures, "\n".join(failures)


def test_fast_forward_agrees_with_hf_teacher_forced_on_cpu():
    """compare_kernels: the fast forward (torch references, float32) against HF's kernels, fed the same
    tokens: every position's top-1 agrees, logits within float32 rounding."""
    model = gdtool.load_model("tiny-qwen3", seed=0)
    df = accuracy.compare_kernels(model, batch=2, prompt_len=6, steps=6, kernels="fast")
    assert (df.top1_agreement == 1.0).all() and (df.max_abs_logit_diff < 1e-3 * df.max_abs_logit + 1e-4).all(), df


# One decode forward at `batch` rows with the Triton kernels (under the interpreter) and again with their torch
# references (HAVE_TRITON off), float32: the same top-1 token per row, logits close.
_KERNELS_AGAINST_REFERENCES = (
    "import torch, gdtool\n"
    "from gdtool.kernels import forward, triton as ft\n"
    "from gdtool.core import compat\n"
    "def once(model, batch):\n"
    "    torch.manual_seed(batch)\n"
    "    c = compat.static_cache(model, 12)\n"
    "    ids = torch.randint(3, 4096, (batch, 5))\n"
    "    model(input_ids=ids, past_key_values=c, use_cache=True)\n"
    "    return forward.forward(model, c, ids[:, -1:], torch.full((batch, 1), 5), torch.ones(batch, 12).long())\n"
    "def compare(model, name, batch):\n"
    "    assert ft.usable(next(model.parameters()))\n"
    "    mine = once(model, batch)\n"
    "    ft.HAVE_TRITON = False\n"
    "    ref = once(model, batch)\n"
    "    ft.HAVE_TRITON = True\n"
    "    assert torch.equal(mine.argmax(-1), ref.argmax(-1)), (name, batch)\n"
    "    assert torch.allclose(mine, ref, atol=1e-4, rtol=1e-4), (name, batch, (mine - ref).abs().max())\n")


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~100 s on 2 cores (Triton's interpreter)
def test_fast_forward_triton_kernels_under_the_interpreter_match_the_references():
    """One decode forward of each family with the Triton kernels themselves (Triton's CPU interpreter)
    against the same forward in the torch references, float32: same top-1 token per row, logits close. The
    MoE families' layers: the norm kernel, the experts kernels and the residual add in their down kernel."""
    code = _KERNELS_AGAINST_REFERENCES + (
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import moe\n"
        "from gdtool.kernels import gemv\n"
        "whole = gemv.qkv_rope_config\n"
        "# tiny-qwen3 again with tiles of 2 dims per head half, as at real sizes: the q/k norm's second kernel\n"
        "for name in ('tiny-llama', 'tiny-qwen2', 'tiny-qwen3', 'tiny-qwen3 split', 'qwen3_moe', 'mixtral', 'qwen2_moe'):\n"
        "    gemv.qkv_rope_config = whole if 'split' not in name else (lambda k, d, m=1, qk_norm=False, tune=None: (2, 4, 2, ft.next_pow2(k)))\n"
        "    model = gdtool.load_model(name.split()[0], seed=0) if name.startswith('tiny') else moe.build(name)\n"
        "    with torch.no_grad():  # norm weights other than HF's ones: the MoE kernels fold the norm in\n"
        "        for n, p in model.named_parameters():\n"
        "            if 'norm' in n and not name.startswith('tiny'):\n"
        "                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(7))\n"
        "    assert forward.plan(model, 2, 12).applies, forward.plan(model, 2, 12).reason\n"
        "    for batch in (2, 6):\n"
        "        compare(model, name, batch)\n"
        "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~50 s on 2 cores (Triton's interpreter)
def test_fast_forward_triton_kernels_past_the_line_under_the_interpreter():
    """The kernels at 12 and 16 rows (three and four passes of 4: the line moved to 16, as the curve at 5a2de9b ran
    it) under Triton's interpreter against the torch references, float32: same top-1 per row, logits close."""
    code = _KERNELS_AGAINST_REFERENCES + (
        "from gdtool.kernels import tuning\n"
        "tuning._override.append(forward.batch_line(16))\n"
        "for name, batch in (('tiny-llama', 12), ('tiny-qwen3', 16)):\n"
        "    model = gdtool.load_model(name, seed=0)\n"
        "    assert forward.plan(model, batch, 12).applies\n"
        "    compare(model, name, batch)\n"
        "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.parametrize("model, sweep", [("gemma-3-1b", "sweep-6e765ba"), ("llama-1b", "sweep-14cc799"),
                                          ("llama-8b", "sweep-fa2489e")])
def test_gemv_default_tiles_are_the_fastest_measured(model, sweep):
    """gemv_config picks with the H200 file, for each projection of Gemma-3-1B, Llama-1B and Llama-8B at one row, a tile config within 3% of
    the fastest of the H200 sweep (profiles/h200/decode-kernels/<sweep>/gemv.csv: every config, PDL off), and
    qkv_rope_config one within 5% (its head-block rule is the two models': HB 1 is 4% faster on Llama-1B's
    q/k/v and 12% slower on Gemma-3-1B's)."""
    import ast
    import csv
    from gdtool.kernels import gemv
    path = os.path.join(ROOT, "profiles", "h200", "decode-kernels", sweep, "gemv.csv")
    timed = {}  # (proj, n, k) -> {config: us}
    for row in csv.DictReader(open(path)):
        if row["model"] != model or row["pdl"] != "False" or not row["kernel"].startswith("triton"):
            continue
        if "whole-head" in row["kernel"]:  # the one-kernel q/k norm form, not a tile of qkv_rope_config's
            continue
        label = row["kernel"].split("(", 1)[1] if "(" in row["kernel"] else None  # "triton [default ](2, 8, 2)"
        timed.setdefault((row["proj"], int(row["n"]), int(row["k"])), {})[
            ast.literal_eval("(" + label) if label else "default"] = float(row["us"])
    assert len(timed) == 5, timed
    heads = {"gemma-3-1b": 256, "llama-1b": 64, "llama-8b": 128}[model]
    h200 = tuning.read(os.path.join(os.path.dirname(tuning.__file__), "configs", "nvidia-h200_sm90_triton-3.6.0.json"))
    assert path.removeprefix(ROOT + os.sep) in h200.provenance("gemv")["files"]
    for (proj, n, k), times in timed.items():
        if proj == "qkv":
            config, bound = gemv.qkv_rope_config(k, heads, tune=h200)[:3], 1.05
        else:
            config, bound = gemv.gemv_config(1, n, k, 2 if proj == "gate_up" else 1, h200), 1.03
        assert config in times and times[config] <= bound * min(times.values()), (proj, config, times)


def test_pdl_setting_off_on_or_auto_by_the_weights_a_kernel_reads(monkeypatch):
    """GDTOOL_PDL / pdl(): 0, 1 or auto (PDL on the kernels reading at most PDL_AUTO_MAX_BYTES of weights);
    anything else is refused with the values it takes. No PDL where the device has none (a CPU)."""
    limit = fast_triton.PDL_AUTO_MAX_BYTES
    with fast_triton.pdl("auto"):
        assert fast_triton.uses_pdl(0) and fast_triton.uses_pdl(limit) and not fast_triton.uses_pdl(limit + 1)
        assert "64 MB" in fast_triton.pdl_label()
        assert fast_triton.launch_options(torch.device("cpu"), 1) == {"PDL": False}
    with fast_triton.pdl(True):
        assert fast_triton.uses_pdl(10 * limit) and fast_triton.pdl_label() == "on"
    with fast_triton.pdl("0"):
        assert not fast_triton.uses_pdl(0) and fast_triton.pdl_label() == "off"
    with pytest.raises(ValueError, match="0 \\(off\\), 1 \\(every kernel\\) or auto"):
        fast_triton.set_pdl("sometimes")
    monkeypatch.setenv("GDTOOL_PDL", "auto")
    assert fast_triton._pdl_mode(os.environ["GDTOOL_PDL"]) == "auto"
    # the on/off switches: a value that is neither is refused with the variable's name, not read as on
    for value, on in (("0", False), ("false", False), ("", False), ("1", True), ("On", True)):
        monkeypatch.setenv("GDTOOL_FUSED_COMBINE", value)
        assert fast_triton.env_flag("GDTOOL_FUSED_COMBINE") is on
    monkeypatch.setenv("GDTOOL_FUSED_COMBINE", "maybe")
    with pytest.raises(ValueError, match="GDTOOL_FUSED_COMBINE='maybe': give 1 \\(on\\) or 0 \\(off\\)"):
        fast_triton.env_flag("GDTOOL_FUSED_COMBINE")


def test_switches_set_for_a_block_over_the_environment(monkeypatch):
    """`triton.switches(...)`: inside the block each named switch is what it says whatever its environment variable,
    nested blocks innermost first, the others keep theirs; a switch that does not exist is refused with the list,
    not ignored; and what each module reads is `asked` (attention's fused combine, the folded embedding)."""
    monkeypatch.delenv("GDTOOL_UNTESTED_KERNELS", raising=False)
    before = {name: fast_triton.asked(name) for name in fast_triton.SWITCHES}
    cpu = torch.device("cpu")
    with fast_triton.switches(fused_combine=False, fold_embedding=False):
        assert not fast_triton.asked("fused_combine") and not fast_triton.asked("fold_embedding")
        assert not fast_attention.fused_combine(cpu) and not gemv.fold_embedding(cpu)
        assert fast_triton.asked("early_norm") == before["early_norm"]
        with fast_triton.switches(fused_combine=True):
            assert fast_triton.asked("fused_combine") and fast_attention.fused_combine(cpu)
            assert not fast_triton.asked("fold_embedding")
        assert not fast_triton.asked("fused_combine")
    assert {name: fast_triton.asked(name) for name in fast_triton.SWITCHES} == before
    with pytest.raises(ValueError, match=r"unknown switch\(es\) of gdtool's kernels \['fused_combin'\]: they are "
                                         "fused_combine, early_norm"):
        with fast_triton.switches(fused_combin=False):
            pass
    with pytest.raises(ValueError, match="'tail' is not a switch of gdtool's kernels"):
        fast_triton.asked("tail")
    assert {name: fast_triton.asked(name) for name in fast_triton.SWITCHES} == before   # nothing left set


def test_late_pdl_trigger_runs_only_where_tested_and_says_so(monkeypatch):
    """GDTOOL_LATE_TRIGGER=1 (`gemv.late_trigger`: the products let the next kernel launch in their last tile round):
    off by default; asked for on CUDA before its cuda tests passed there, refused with the reason and the override
    (an A/B must not time the default twice, silently); off CUDA, or with GDTOOL_UNTESTED_KERNELS=1, taken. Its bits
    against the early trigger: the captured cuda test below."""
    cuda = torch.device("cuda")   # a device type only: nothing is allocated on it
    monkeypatch.delenv("GDTOOL_UNTESTED_KERNELS", raising=False)
    assert fast_triton.SWITCHES["late_trigger"] == ("GDTOOL_LATE_TRIGGER", False)   # off by default
    with fast_triton.switches(late_trigger=False):
        assert not gemv.late_trigger(cuda) and not gemv.late_trigger(torch.device("cpu"))
    with fast_triton.switches(late_trigger=True):
        assert gemv.late_trigger(torch.device("cpu"))
        monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((9, 0), "3.6"))   # an H100's or an H200's
        if gemv.LATE_TRIGGER_PATH in fast_triton.CUDA_TESTED[(9, 0), "3.6"]:
            assert gemv.late_trigger(cuda)
        else:
            with pytest.raises(RuntimeError, match="GDTOOL_LATE_TRIGGER=1: gdtool's kernels for PDL trigger in the "
                                                   "last tile round have not passed .* GDTOOL_UNTESTED_KERNELS=1 runs"):
                gemv.late_trigger(cuda)
        monkeypatch.setenv("GDTOOL_UNTESTED_KERNELS", "1")
        assert gemv.late_trigger(cuda)
        monkeypatch.setattr(fast_triton, "pdl_supported", lambda device: True)  # the note as it reads on a Hopper GPU
        model = gdtool.load_model("tiny-llama", seed=0)
        with fast_triton.pdl("auto"):
            _decode(model, gdtool.random_prompts(model, batch=2, lengths=(4, 9), seed=0), kernels="fast")
    note = fast.compiles(model).kernels.iloc[-1]
    assert "; PDL on kernels reading <= 64 MB of weights, the products triggering the next kernel in their last tile " \
           "round at first use" in note, note


def test_the_kernels_note_says_whether_the_embedding_lookup_is_folded(monkeypatch):
    """The compiles table's note (what a bench records as `note`) names the embedding lookup folded into the first
    qkv_rope where it is, and not where GDTOOL_FOLD_EMBEDDING=0 keeps HF's module: an A/B of the fold (gpu_run.sh's
    bench-fold) is then told apart by its files, not only by their names."""
    notes = {}
    for fold in (True, False):
        model = gdtool.load_model("tiny-llama", seed=0)
        with fast_triton.switches(fold_embedding=fold):
            _decode(model, gdtool.random_prompts(model, batch=2, lengths=(4, 9), seed=0), kernels="fast")
        notes[fold] = fast.compiles(model).kernels.iloc[-1]
    assert f"; {gemv.FOLD_EMBEDDING_PATH}; PDL" in notes[True], notes[True]
    assert gemv.FOLD_EMBEDDING_PATH not in notes[False], notes[False]


def test_tensor_core_products_follow_torchs_float32_matmul_precision():
    """`dot_precision`: float32 operands at float32 ("ieee") under torch's default "highest", TF32 where the user
    chose "high" or "medium" (as torch's own float32 matmuls then do); 16-bit operands at Triton's default."""
    before = torch.get_float32_matmul_precision()
    try:
        seen = {}
        for setting in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(setting)
            seen[setting] = [fast_triton.dot_precision(d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == {"highest": ["ieee", "tf32", "tf32"], "high": ["tf32"] * 3, "medium": ["tf32"] * 3}


@pytest.mark.parametrize("late", [False, True], ids=["early-trigger", "late-trigger"])
def test_matrix_vector_kernel_compiles_for_hopper_with_pdl(late, monkeypatch):
    """The kernel's PDL branches never run under the interpreter (no PDL on a CPU): a gate/up launch of
    `gemv.rms_gemv`, caught as it would launch on an H200 (PDL on), compiles here for sm_90 down to the device code
    as that launch compiles there (`profiles/kernel_registers.py`, `cuda_compile.py`), with its launch trigger where the setting puts it: after the wait, or in
    the tile loop's last round (a branch inside the loop)."""
    if not fast_triton.HAVE_TRITON:
        pytest.skip("no Triton")
    sys.path.insert(0, os.path.join(ROOT, "profiles"))
    import kernel_registers
    monkeypatch.setattr(fast_triton, "pdl_supported", lambda device: True)
    monkeypatch.setattr(gemv, "late_trigger", lambda device: late)
    x, g, w = torch.randn(1, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16), \
        torch.randn(256, 256, dtype=torch.bfloat16)
    (fn, args, kwargs), = kernel_registers.launches(lambda: gemv.rms_gemv(x, g, 1e-5, w, w, config=(8, 4, 2)))
    assert kwargs["PDL"] and kwargs["LATE_TRIGGER"] is late and kwargs["ITERS"] > 1
    import cuda_compile
    with cuda_compile.targeting(90):
        ptx = cuda_compile.compile_launch(fn, list(args), kwargs).asm["ptx"]
    wait, trigger = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == 1 and wait < trigger
    assert (trigger > ptx.index("Loop Header")) is late, "the trigger is inside the tile loop exactly where it is late"


# -- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [True, False, "auto"], ids=["pdl", "no-pdl", "pdl-auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_kernels_on_cuda(dtype, pdl):
    with fast_triton.pdl(pdl):
        results = testing.check_all("cuda", dtype, large=dtype == torch.bfloat16)
    bad = [r for r in results if not r.ok]
    assert not bad, testing.table(bad)


@pytest.mark.cuda
def test_tensor_core_kernels_keep_float32_products_float32_on_cuda():
    """The kernels built on tl.dot (the split-KV attention, the grouped experts) take float32 operands at float32
    (`dot_precision`: "ieee"): Triton's default rounds them to TF32 (10 mantissa bits, ~1e-3 relative), which fails
    the float32 tolerance (1e-5, within twice torch's own error) that these checks hold the kernels to."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for m, live, cache, pad in ((1, 1, 40, 0), (2, 37, 40, 0), (3, 70, 90, 5), (4, 17, 17, 3)):
        for sinks in (False, True):
            results.append(testing.check_attention(m, 8, 2, 32, cache, live, torch.float32, "cuda", gen, pad,
                                                   sinks=sinks))
    for shape in testing.EXPERTS_GROUPED_SMALL:
        results += testing.check_experts(*shape, torch.float32, "cuda", gen, grouped=True)
    for shape in testing.EXPERTS_OSS_GROUPED_SMALL:
        results += testing.check_experts_oss(*shape, torch.float32, "cuda", gen, grouped=True)
    bad = [r for r in results if not r.ok]
    assert not bad, testing.table(bad)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [2, 8, 16], ids=["one-pass", "two-passes", "four-passes-line-at-16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"])
def test_fast_step_on_cuda_captured_equals_uncaptured(name, batch, monkeypatch):
    if batch > 4:  # past the default line: the passes (Gemma 3's and MoE's to 8; the line at 16 as the curve ran it)
        monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(max(8, batch), _cuda_tuning())])
    model = (fastcases.tiny_mistral(4096).to("cuda", torch.bfloat16) if name == "tiny-mistral"
             else gdtool.load_model(name, seed=0, device="cuda"))  # bf16
    prompt = gdtool.random_prompts(model, batch=batch, lengths=(5, 12), seed=0)
    captured = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    direct = _decode(model, prompt, kernels="fast", max_new_tokens=24, capture=False)
    with fast_triton.pdl(False):
        plain = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    with fast_triton.pdl("auto"):
        auto = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    with fast_triton.pdl(True), fast_triton.switches(late_trigger=True), monkeypatch.context() as late_trigger:
        late_trigger.setenv("GDTOOL_UNTESTED_KERNELS", "1")   # every product, triggering in its last round
        late = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    # greedy: the forward and the tail (argmax, update, counters) in gdtool's kernels, nothing compiled
    table = fast.compiles(model)
    assert len(table) == 1 and table.compiles.sum() == 0, table
    assert table.kernels.iloc[0].startswith("fast: fast decode forward"), table
    assert "argmax, update and counters in one kernel" in table.kernels.iloc[0], table
    with fast_triton.switches(fold_embedding=False):   # HF's embedding module first, not the lookup in qkv_rope
        apart = _decode(model, prompt, kernels="fast", max_new_tokens=24, return_scores=True)
    folded = _decode(model, prompt, kernels="fast", max_new_tokens=24, return_scores=True)
    assert captured.replays == captured.steps > 0
    assert torch.equal(captured.tokens, direct.tokens) and torch.equal(captured.tokens, plain.tokens)
    assert torch.equal(auto.tokens, plain.tokens) and torch.equal(late.tokens, plain.tokens)
    assert torch.equal(folded.tokens, apart.tokens)
    assert torch.equal(torch.stack(folded.scores), torch.stack(apart.scores))
    # scores recorded: the tail is HF's over the whole vocabulary, compiled once for both runs (no recompile)
    scored = fast.compiles(model).iloc[1:]
    assert len(scored) == 1 and scored.compiles.iloc[0] == 1, scored
    assert "argmax, update and counters in one kernel" not in scored.kernels.iloc[0], scored
    if gdtool.loops.devloop.device_loop_support() is None:
        loop = _decode(model, prompt, kernels="fast", max_new_tokens=24, mode="device-loop")
        assert torch.equal(loop.tokens, captured.tokens)
    agreement = accuracy.compare_kernels(model, batch=batch, prompt_len=8, steps=8, kernels="fast")
    assert (agreement.top1_agreement > 0.4).all()


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_fast_step_on_cuda_qwen3_8b_rounds_no_more_than_hf(batch, monkeypatch):
    """Qwen3-8B's shapes (random weights, bf16): the fast forward runs (q/k norm fused) and its teacher-forced
    logits are as close to float32's as HF's own bf16 kernels are. Top-1 against HF is no test here: random
    weights give logits so flat that any two bf16 forwards flip a few ties (0.8 at batch 1 at cb883e2). At 4 rows
    the line moved to 4 (Qwen3-8B's own is 1 row; one pass of 4 is what Gemma 3's and the MoE models' lines take)."""
    if batch > 1:
        monkeypatch.setattr(tuning, "_override", [fast_decoder.batch_line(batch, _cuda_tuning())])
    model = gdtool.load_model("qwen3-8b", seed=0, device="cuda")
    assert fast_decoder.plan(model, batch, 64).applies
    df = accuracy.accuracy(model, batch=batch, prompt_len=32, steps=16, kernels="fast")
    print(df.to_string())
    assert df.fast_mean_error.mean() <= 1.25 * df.hf_mean_error.mean(), df
    assert "q/k norm" in fast.compiles(model).kernels.iloc[-1]


FAST_SWEEP_CUDA = fastcases.cases(3, seed=1)


@pytest.mark.cuda
@pytest.mark.parametrize("case", FAST_SWEEP_CUDA, ids=_ids(FAST_SWEEP_CUDA))
def test_fast_sweep_captured_equals_uncaptured_on_cuda(case):
    """The seeded sweep (seed 1, three cases a model) in bf16 on CUDA: every mode, the graph modes captured, bit for
    bit its uncaptured twin's tokens and scores (eager's, or the step-graph's run uncaptured where the whole step is
    compiled), and the step's account naming the plan's path. Its own gpu_run.sh part (`tests-fast-sweep`), as
    tests-kernels is near its call's time."""
    failures = fastcases.run(case, "cuda", torch.bfloat16)
    assert not failures, "\n".join(failures)


def test_node_trace_breakdown_classifies_the_fast_kernels():
    """profiles/kernel_breakdown.py puts gdtool's kernels in the classes the docs' account uses."""
    sys.path.insert(0, os.path.join(ROOT, "profiles"))
    import kernel_breakdown
    for name, cls in (("_rms_gemv_kernel", "matmul"), ("_qkv_rope_gemv_kernel", "matmul"),
                      ("_attention_split_kernel", "attention"), ("_attention_combine_kernel", "attention")):
        assert kernel_breakdown.kernel_class(name) == cls


def test_untested_kernel_paths_are_refused_on_cuda(monkeypatch):
    """A kernel path whose cuda tests have not passed on a GPU is refused there, with the reason and the
    switch; on a CPU it runs (the interpreter and the torch references are what the CPU tests check)."""
    from gdtool.kernels import triton as fast_triton
    monkeypatch.delenv("GDTOOL_UNTESTED_KERNELS", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((9, 0), "3.6"))   # an H100's or an H200's
    why = fast_triton.untested_on_cuda("NoSuchFamily, <= 4 rows", cuda)
    assert "have not passed their cuda tests" in why and "GDTOOL_UNTESTED_KERNELS=1" in why
    assert fast_triton.untested_on_cuda("NoSuchFamily, <= 4 rows", cpu) == ""
    for path in fast_triton.CUDA_TESTED[(9, 0), "3.6"]:
        assert fast_triton.untested_on_cuda(path, cuda) == ""
    monkeypatch.setenv("GDTOOL_UNTESTED_KERNELS", "1")
    assert fast_triton.untested_on_cuda("NoSuchFamily, <= 4 rows", cuda) == ""


def _cuda_tuning():
    """The GPU's own tuning (a sweep's batch line replaces only its lines)."""
    return tuning.current(torch.device("cuda"))


def test_fast_path_declined_at_first_use_runs_the_compiled_step(monkeypatch):
    """The cache check runs at the first step (the cache's tensors exist only after the prefill); when it
    declines, the step runs the compiled HF forward and its own select/update, not a compiled function
    made for the other path (one table entry per body and path)."""
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=1)
    monkeypatch.setattr(fast_decoder, "cache_ready", lambda *a, **k: "a test's reason")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in ("eager", "step-graph"):
            mine = _decode(model, prompt, kernels="fast", mode=mode)
            assert torch.equal(mine.tokens, _decode(model, prompt, mode=mode).tokens), mode
    assert any("a test's reason" in str(note) for note in fast.compiles(model).to_numpy().ravel())
    fast.forget(model)
