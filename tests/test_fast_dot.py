"""The split-K tensor-core kernel for products of up to 64 rows (`gdtool/kernels/dot.py`) and its swap into the
compiled HF forward (`linear.py`, switch `dot_linear`, GDTOOL_DOT_LINEAR=1): its tiles from the tuning, its refusals,
a seeded sweep of shapes, dtypes, biases and splits against the float32-sum reference, the same bits on every call
(the slices added in slice order by whichever program finishes last), the counters back at 0; then whole decodes
with the swap, against generate()'s tokens and the uncaptured step."""
from __future__ import annotations

import random
import re

import pytest
import torch

import gdtool
from gdtool.kernels import dot, linear, tuning
from gdtool.kernels import step as fast_step
from gdtool.kernels import triton as fast_triton
from interpreter import run_interpreted

pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CONFIGS = ((64, 128, 1, 4, 2), (32, 64, 2, 4, 2), (64, 32, 4, 4, 3), (16, 16, 8, 4, 2))


def case(seed: int, device: str = "cpu", m: int | None = None, n: int | None = None, k: int | None = None):
    """(x [m, k], w [n, k], bias [n] or None, a config or None): seeded rows 1-64, columns and K off the tiles."""
    rng = random.Random(seed)
    m = m or rng.choice((1, 3, 5, 16, 17, 33, 64, rng.randint(1, 64)))
    n = n or rng.choice((7, 48, 96, 200, rng.randint(1, 300)))
    k = k or rng.choice((24, 100, 512, 1024, rng.randint(1, 700)))
    dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if rng.random() < 0.5 else None
    return x, w, bias, rng.choice(CONFIGS + (None,))


def check(seeds, device: str = "cpu", **shape) -> int:
    """Each seed's case through the kernel: within its dtype's rounding of the reference, twice the same bits, the
    counters back at 0."""
    for seed in seeds:
        x, w, bias, config = case(seed, device, **shape)
        out = dot.dot_linear(x, w, bias, config)
        ref = dot.reference(x, w, bias)
        tol = TOLERANCE[x.dtype]
        assert out.shape == ref.shape and out.dtype == x.dtype, (seed, out.shape, out.dtype)
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), \
            (seed, tuple(x.shape), tuple(w.shape), x.dtype, config, (out.float() - ref.float()).abs().max())
        assert torch.equal(out, dot.dot_linear(x, w, bias, config)), (seed, config)
    counts = fast_triton._COUNTS.get(("dot", str(x.device)))
    assert counts is None or not counts.any()
    return len(seeds)


def test_tiles_come_from_the_tuning():
    """The defaults' rule at 132 multiprocessors, on Llama-1B's and Gemma-3-1B's 64-row products: K split while the
    programs stay under two a multiprocessor and each slice keeps four 128-wide chunks; a chunk halved until it
    divides K; a probe's values passed as a tuning."""
    tune = tuning.defaults()
    assert tune.multiprocessors == 132
    assert dot.config_for(64, 2048, 2048, tune) == dot.Config(64, 128, 4, 4, 4)    # o: 32 tiles x 4
    assert dot.config_for(64, 2048, 8192, tune) == dot.Config(64, 128, 8, 4, 4)    # down: 32 x 8
    assert dot.config_for(64, 3072, 2048, tune) == dot.Config(64, 128, 4, 4, 4)    # q/k/v fused: 48 x 4
    assert dot.config_for(64, 16384, 2048, tune).split == 1                         # gate/up fused: 256 tiles
    assert dot.config_for(64, 1152, 6912, tune) == dot.Config(64, 128, 8, 4, 4)    # Gemma's down: 18 x 8
    assert dot.config_for(8, 64, 96, tune).block_k == 32
    wide = tune.with_values("dot", block_n=128, programs_per_sm=1, min_chunks=2)
    assert dot.config_for(64, 2048, 8192, wide) == dot.Config(128, 128, 8, 4, 4)
    assert [dot.block_m(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_operands_the_kernel_does_not_take_are_refused_with_the_reason():
    half = torch.float16
    strided = torch.zeros(2, 96, dtype=half)[:, ::2]
    for x, w, bias, why in ((torch.zeros(65, 64, dtype=half), torch.zeros(32, 64, dtype=half), None, "at most 64"),
                            (strided, torch.zeros(32, 48, dtype=half), None, "contiguous"),
                            (torch.zeros(2, 64, dtype=half), torch.zeros(32, 63, dtype=half), None, "x [M, K] and w"),
                            (torch.zeros(2, 64), torch.zeros(32, 64, dtype=half), None, "one dtype"),
                            (torch.zeros(2, 64, dtype=half), torch.zeros(32, 64, dtype=half),
                             torch.zeros(31, dtype=half), "a bias [N]")):
        with pytest.raises(ValueError, match=re.escape(why)):
            dot.check(x, w, bias)


def test_which_kernel_takes_the_linear_layers():
    """The matrix-vector kernel at up to four rows (not where the batch line gave the batch to the matmuls); past
    that, or there, the dot kernel up to 64 rows with the switch on; else HF's. The plan names the kernel in its note
    and its key."""
    assert linear.kernel_for(4) == "matrix-vector" and linear.kernel_for(5) is None
    assert linear.kernel_for(3, matmuls=True) is None
    with fast_triton.switches(dot_linear=True):
        assert [linear.kernel_for(b) for b in (1, 4, 5, 64, 65)] == ["matrix-vector"] * 2 + ["split-K dot"] * 2 + [None]
        assert linear.kernel_for(3, matmuls=True) == "split-K dot"
        model = gdtool.load_model("tiny-llama", seed=0)
        plan = linear.plan(model, 64, matmuls=True)
        assert plan.note() == "linear layers 14/14 in gdtool's split-K dot kernel", plan.note()
        assert plan.key()[0] == "split-K dot" and model.lm_head not in [layer.module for layer in plan.layers]
        assert linear.plan(model, 4).key()[0] == "matrix-vector"
        assert not linear.plan(model, 65).applies and linear.plan(model, 65).note() == ""
    assert not linear.plan(model, 64, matmuls=True).applies


def test_the_dot_operator_is_f_linear_where_triton_does_not_run():
    """The custom operator (what the swap calls): the kernel under Triton, F.linear itself elsewhere."""
    x, w, bias, _ = case(3)
    out = torch.ops.gdtool.dot_linear(x, w, bias)
    if fast_triton.usable(x, w):
        assert torch.allclose(out.float(), dot.reference(x, w, bias).float(), atol=TOLERANCE[x.dtype], rtol=1e-2)
    else:
        assert torch.equal(out, torch.nn.functional.linear(x, w, bias))


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


@pytest.mark.slow  # ~30 s on 2 cores (inductor compiles)
def test_fast_step_on_cpu_with_the_dot_swap_decodes_hf_tokens(monkeypatch):
    """tiny-llama at 6 rows (past its batch line: the matmuls' batch): with the switch the compiled HF forward calls
    the dot operator for every linear layer at every step (on a CPU the operator is F.linear), generate()'s tokens,
    captured equal to uncaptured, the note says so; without it, no swap."""
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=6, lengths=(4, 9), seed=3)
    hf = _decode(model, prompt)
    calls = []
    usable = dot.usable
    monkeypatch.setattr(dot, "usable", lambda *t: calls.append(tuple(t[1].shape)) or usable(*t))
    with fast_triton.switches(dot_linear=True):
        mine = _decode(model, prompt, kernels="fast")
        again = _decode(model, prompt, kernels="fast", capture=False)
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    assert "linear layers 14/14 in gdtool's split-K dot kernel" in fast_step.compiles(model).kernels.iloc[-1]
    weights = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert set(calls) == weights - {tuple(model.lm_head.weight.shape)}, (set(calls), weights)
    calls.clear()
    off = _decode(model, prompt, kernels="fast")
    assert torch.equal(off.tokens, hf.tokens) and "linear layers" not in fast_step.compiles(model).kernels.iloc[-1]
    assert not calls


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~55 s on 2 cores (Triton's interpreter)
def test_dot_kernel_under_the_interpreter_and_in_compiled_decodes():
    """The kernel (Triton's interpreter) over 40 seeded cases; then tiny-llama, tiny-gemma3 (sliding layers) and
    tiny-llama with fused projections at 12 rows, step-graph, the swap on and K split (a tuning of 64 programs a
    multiprocessor, one chunk a slice): generate()'s tokens, captured (on a CPU: called) equal to uncaptured, every
    linear layer through the kernel."""
    code = (
        "import torch, gdtool, test_fast_dot as t\n"
        "from gdtool.kernels import dot, fuse, tuning, triton as fast_triton\n"
        "print('cases', t.check(range(40)))\n"
        "calls, kernel = [], dot.dot_linear\n"
        "dot.dot_linear = lambda *a, **k: calls.append(dot.config_for(a[0].shape[0], *a[1].shape)) or kernel(*a, **k)\n"
        "split = tuning.interpreter().with_values('dot', programs_per_sm=64, min_chunks=1, block_k=32)\n"
        "for name, fused in (('tiny-llama', False), ('tiny-gemma3', False), ('tiny-llama', True)):\n"
        "    model = gdtool.load_model(name, seed=0)\n"
        "    if fused:\n"
        "        fuse.fuse_projections(model)\n"
        "    prompt = gdtool.random_prompts(model, batch=12, lengths=(3, 9), seed=3)\n"
        "    hf = t._decode(model, prompt, max_new_tokens=5)\n"
        "    calls.clear()\n"
        "    with fast_triton.switches(dot_linear=True), tuning.use(split):\n"
        "        mine = t._decode(model, prompt, kernels='fast', max_new_tokens=5)\n"
        "        again = t._decode(model, prompt, kernels='fast', capture=False, max_new_tokens=5)\n"
        "    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens), (name, fused)\n"
        "    assert calls and all(c.split > 1 for c in calls), (name, calls[:4])\n"
        "print('ok')\n")
    run_interpreted(code, timeout=900)


@pytest.mark.cuda
def test_dot_linear_on_cuda():
    """200 seeded cases on the GPU; the 64-row products of Llama-1B and Gemma-3-1B in bf16 at their tuning's tiles,
    the same bits on every call and in a captured graph's replays; then tiny-llama, tiny-gemma3 and gpt-oss (biases)
    at 8 and 64 rows in bf16 with the swap: captured equal to uncaptured, teacher-forced within rounding of
    kernels="compiled"."""
    from gdtool.measure import accuracy
    import moe
    assert check(range(200), "cuda") == 200
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1536, 1152), (1152, 1024), (13824, 1152),
                 (1152, 6912)):
        x = torch.randn(64, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        out = dot.dot_linear(x, w)
        assert torch.allclose(out.float(), dot.reference(x, w).float(), atol=TOLERANCE[x.dtype], rtol=1e-2), (n, k)
        static = torch.empty_like(out)
        graph = torch.cuda.CUDAGraph()
        dot.dot_linear(x, w)   # the counters made before the capture
        with torch.cuda.graph(graph):
            static.copy_(dot.dot_linear(x, w))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static, out), (n, k)
    with fast_triton.switches(dot_linear=True):
        for name in ("tiny-llama", "tiny-gemma3", "gpt_oss"):
            model = moe.build("gpt_oss", dtype=torch.bfloat16, device="cuda") if name == "gpt_oss" else \
                gdtool.load_model(name, seed=0, device="cuda", dtype=torch.bfloat16)
            for batch in (8, 64):
                prompt = gdtool.random_prompts(model, batch=batch, lengths=(5, 12), seed=batch)
                captured = _decode(model, prompt, kernels="fast", max_new_tokens=16)
                assert "split-K dot kernel" in fast_step.compiles(model).kernels.iloc[-1], name
                direct = _decode(model, prompt, kernels="fast", capture=False, max_new_tokens=16)
                assert torch.equal(captured.tokens, direct.tokens), (name, batch)
            agreement = accuracy.compare_kernels(model, batch=8, prompt_len=8, steps=8, kernels="fast")
            assert (agreement.top1_agreement > 0.4).all(), agreement
