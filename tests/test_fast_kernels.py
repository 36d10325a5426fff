"""gdtool's decode kernels (kernels="fast"): each against float64, and the fast decode step.

On a CPU: the torch references (what runs without Triton) against float64, always; the Triton
kernels themselves under Triton's CPU interpreter where Triton is installed (float32 and float16:
the interpreter of Triton 3.6 rounds to bf16 by truncation and mishandles bf16 dots); the fast step
of tiny-llama against HF's kernels. On CUDA: the kernels in bf16 and fp16 at small and real Llama
shapes, PDL on and off, and the fast step captured against itself uncaptured.
Tolerances: gdtool/kernels/check.py (relative L2 error against float64, by dtype).
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import gdtool
import gdtool.loops.devloop
from gdtool.kernels import step as fast, check as fast_check, forward as fast_decoder, triton as fast_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_references_against_float64(dtype):
    results = fast_check.check_all("cpu", dtype, impl="reference")
    bad = [r for r in results if not r.ok or not r.reference_error <= r.tolerance]
    assert not bad, fast_check.table(bad)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_triton_kernels_under_the_interpreter():
    code = ("import torch\nfrom gdtool.kernels import check as fast_check\n"
            "for dt in (torch.float32, torch.float16):\n"
            "    bad = [r for r in fast_check.check_all('cpu', dt) if not r.ok]\n"
            "    assert not bad, fast_check.table(bad)\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_fast_step_on_cpu_decodes_hf_tokens_and_says_what_ran():
    """float32 on a CPU: the fast forward (torch references inside the compiled step) gives HF's tokens;
    compiles() names the fast forward; a batch over the GEMV's rows falls back to the compiled HF forward."""
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=3, lengths=(4, 9), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf = _decode(model, prompt)
        mine = _decode(model, prompt, kernels="fast")
        again = _decode(model, prompt, kernels="fast")
    assert not [w for w in caught if str(w.message).startswith("gdtool:")]
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    table = fast.compiles(model)
    row = table[table.step.str.endswith("_fast")]
    assert len(row) == 1 and row.compiles.iloc[0] == 1
    assert row.kernels.iloc[0].startswith("fast: fast decode forward, 2 layers")
    wide = gdtool.random_prompts(model, batch=5, lengths=(4, 9), seed=1)
    assert torch.equal(_decode(model, wide, kernels="fast").tokens, _decode(model, wide).tokens)
    note = fast.compiles(model).kernels.iloc[-1]
    assert "HF forward compiled" in note and "(batch 5 > 4 rows" in note


def test_fast_forward_applies_only_to_llama_layers():
    qwen = gdtool.load_model("tiny-qwen2", seed=0)
    assert not fast_decoder.plan(qwen, 1).applies and "not LlamaForCausalLM" in fast_decoder.plan(qwen, 1).reason
    llama = gdtool.load_model("tiny-llama", seed=0)
    assert fast_decoder.plan(llama, 4).applies and not fast_decoder.plan(llama, 5).applies
    llama.model.layers[0].mlp.act_fn = torch.nn.GELU()
    llama.config.hidden_act = "gelu"
    assert "SiLU" in fast_decoder.plan(llama, 1).reason


@pytest.mark.slow
def test_fast_step_on_cpu_qwen2_falls_back_and_decodes():
    model = gdtool.load_model("tiny-qwen2", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(4, 9), seed=0)
    assert torch.equal(_decode(model, prompt, kernels="fast").tokens, _decode(model, prompt).tokens)
    assert "not LlamaForCausalLM" in fast.compiles(model).kernels.iloc[-1]


# -- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_kernels_on_cuda(dtype, pdl):
    with fast_triton.pdl(pdl):
        results = fast_check.check_all("cuda", dtype, large=dtype == torch.bfloat16)
    bad = [r for r in results if not r.ok]
    assert not bad, fast_check.table(bad)


@pytest.mark.cuda
def test_fast_step_on_cuda_captured_equals_uncaptured():
    model = gdtool.load_model("tiny-llama", seed=0, device="cuda")  # bf16
    prompt = gdtool.random_prompts(model, batch=2, lengths=(5, 12), seed=0)
    captured = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    direct = _decode(model, prompt, kernels="fast", max_new_tokens=24, capture=False)
    with fast_triton.pdl(False):
        plain = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    assert captured.replays == captured.steps > 0
    assert torch.equal(captured.tokens, direct.tokens) and torch.equal(captured.tokens, plain.tokens)
    table = fast.compiles(model)
    assert table.compiles.sum() == 1 and table.kernels.iloc[0].startswith("fast: fast decode forward")
    if gdtool.loops.devloop.device_loop_support() is None:
        loop = _decode(model, prompt, kernels="fast", max_new_tokens=24, mode="device-loop")
        assert torch.equal(loop.tokens, captured.tokens)
    agreement = fast.compare_kernels(model, batch=2, prompt_len=8, steps=8, kernels="fast")
    assert (agreement.top1_agreement > 0.4).all()


def test_node_trace_breakdown_classifies_the_fast_kernels():
    """profiles/kernel_breakdown.py puts gdtool's kernels in the classes the docs' account uses."""
    sys.path.insert(0, os.path.join(ROOT, "profiles"))
    import kernel_breakdown
    for name, cls in (("_rms_gemv_kernel", "matmul"), ("_qkv_rope_gemv_kernel", "matmul"),
                      ("_attention_split_kernel", "attention"), ("_attention_combine_kernel", "attention")):
        assert kernel_breakdown.kernel_class(name) == cls
