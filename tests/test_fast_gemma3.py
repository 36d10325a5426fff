"""Gemma 3 in kernels="fast": the (1 + w) norms, the post norms, GELU-tanh, per-layer-type RoPE, the scaled
embedding, and sliding layers whose window rolls (tiny-gemma3: a window of 8, so short decodes cross it).

On a CPU (float32): the torch references inside the step decode HF's tokens with prompts shorter and longer
than the window and decodes that cross it, in every mode; teacher-forced, their logits equal HF's; under
Triton's interpreter the kernels themselves decode the same tokens. The kernels alone against float64:
tests/test_fast_kernels.py (gdtool/kernels/testing.py's Gemma rows); the full window's roll against HF's own
update, bit for bit (reference, interpreter, CUDA). On CUDA (bf16): captured equals uncaptured across the
window's edge, and gemma-3-1b's teacher-forced agreement with HF's kernels.
"""

import pytest
import torch

import gdtool
import gdtool.loops.devloop
from gdtool.kernels import step as fast, forward as fast_decoder, triton as fast_triton
from gdtool.measure import accuracy
from interpreter import run_interpreted

pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py

WINDOW = 8  # tiny-gemma3's sliding window


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_plan_reads_gemma3_from_its_modules():
    model = gdtool.load_model("tiny-gemma3", seed=0)
    p = fast_decoder.plan(model, 3, 40)
    assert p.applies, p.reason
    for feature in ("Gemma3", "(1 + w) norms", "gelu_tanh", "post norms", "q/k norm", f"sliding window {WINDOW}"):
        assert feature in p.reason, (feature, p.reason)
    model.config.final_logit_softcapping = 30.0
    refused = fast_decoder.plan(model, 3, 40)
    assert not refused.applies and "final_logit_softcapping=30.0" in refused.reason
    model.config.final_logit_softcapping = None
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert "activation GELU" in fast_decoder.plan(model, 3, 40).reason


@pytest.mark.parametrize("lengths,new", [((3, 5), 3), ((2, 6), 14), ((10, 13), 6)],
                         ids=["inside-window", "crosses-window", "prompt-past-window"])
def test_fast_step_on_cpu_decodes_hf_tokens_across_the_window(lengths, new):
    """float32, batch 3 (left padding): HF's tokens in every mode; the forward is the fast one."""
    model = gdtool.load_model("tiny-gemma3", seed=0)
    prompt = gdtool.random_prompts(model, batch=3, lengths=lengths, seed=sum(lengths))
    hf = _decode(model, prompt, max_new_tokens=new)
    assert torch.equal(_decode(model, prompt, max_new_tokens=new, kernels="fast").tokens, hf.tokens)
    note = fast.compiles(model).kernels.iloc[-1]
    assert note.startswith("fast: fast decode forward, 2 layers, Gemma3"), note
    modes = ["eager", "forward-graph"] + (["device-loop"] if gdtool.loops.devloop.device_loop_support() is None else [])
    for mode in modes:
        assert torch.equal(_decode(model, prompt, max_new_tokens=new, kernels="fast", mode=mode).tokens, hf.tokens), mode
    assert torch.equal(_decode(model, prompt, max_new_tokens=new, kernels="fast", capture=False).tokens, hf.tokens)


def test_fast_forward_teacher_forced_equals_hf_across_the_window():
    """compare_kernels, uncaptured (one step per window phase, as a graph would hold it): prompts inside and past
    the window, continuations across its edge: top-1 always agrees, logits within float32 rounding."""
    model = gdtool.load_model("tiny-gemma3", seed=0)
    for prompt_len, steps in ((4, 3), (5, 10), (12, 6)):
        df = accuracy.compare_kernels(model, batch=2, prompt_len=prompt_len, steps=steps, kernels="fast", capture=False)
        assert (df.top1_agreement == 1.0).all() and (df.max_abs_logit_diff < 1e-4 * df.max_abs_logit + 1e-5).all(), df


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~70 s on 2 cores (Triton's interpreter)
def test_fast_step_triton_kernels_under_the_interpreter_decode_hf_tokens():
    code = ("import torch, gdtool\n"
            "model = gdtool.load_model('tiny-gemma3', seed=0)\n"
            "for lengths, new in (((2, 6), 10), ((10, 12), 4)):\n"
            "    prompt = gdtool.random_prompts(model, batch=2, lengths=lengths, seed=3)\n"
            "    kw = dict(max_new_tokens=new, eos_token_id=None, pad_token_id=0, do_sample=False)\n"
            "    hf = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)\n"
            "    mine = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, kernels='fast', **kw)\n"
            "    assert torch.equal(hf.tokens, mine.tokens), (lengths, hf.tokens, mine.tokens)\n"
            "from gdtool.kernels import step\n"
            "assert 'Triton kernels' in step.compiles(model).kernels.iloc[-1]\n"
            "print('ok')\n")
    run_interpreted(code, timeout=900)


WINDOW_ROLLS = ((2, 2, 8, 16, None), (3, 1, 9, 32, (4, 2)), (1, 2, 1, 16, None), (1, 1, 512, 256, None))


def test_window_roll_reference_is_hfs_update_bit_for_bit():
    from gdtool.kernels import testing
    gen = torch.Generator().manual_seed(0)
    testing._impl.triton = False
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for b, hkv, w, d, config in WINDOW_ROLLS:
            r = testing.check_window_roll(b, hkv, w, d, dtype, "cpu", gen, config)
            assert r.ok, r


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_window_roll_kernel_under_the_interpreter_is_hfs_update_bit_for_bit():
    """The one-kernel roll, then the last slot written, against HF's StaticSlidingWindowLayer.update: every dtype
    (a copy: float64 too), one chunk of slots and several, windows of 1 and 512."""
    code = ("import torch\nfrom gdtool.kernels import testing\nfrom test_fast_gemma3 import WINDOW_ROLLS\n"
            "gen = torch.Generator().manual_seed(0)\ntesting._impl.triton = True\n"
            "for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):\n"
            "    for b, hkv, w, d, config in WINDOW_ROLLS:\n"
            "        r = testing.check_window_roll(b, hkv, w, d, dtype, 'cpu', gen, config)\n"
            "        assert r.ok, r\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


# -- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 6], ids=["one-pass", "two-passes"])
def test_fast_step_on_cuda_gemma3_captured_equals_uncaptured(batch):
    """bf16, prompts shorter and longer than the window, decodes across its edge: one graph per window
    phase, captured = uncaptured = PDL off = device loop."""
    model = gdtool.load_model("tiny-gemma3", seed=0, device="cuda")
    for lengths in ((3, 6), (10, 14)):
        prompt = gdtool.random_prompts(model, batch=batch, lengths=lengths, seed=batch)
        captured = _decode(model, prompt, kernels="fast", max_new_tokens=24)
        direct = _decode(model, prompt, kernels="fast", max_new_tokens=24, capture=False)
        with fast_triton.pdl(False):
            plain = _decode(model, prompt, kernels="fast", max_new_tokens=24)
        assert captured.replays == captured.steps > 0
        assert torch.equal(captured.tokens, direct.tokens) and torch.equal(captured.tokens, plain.tokens), lengths
        assert fast.compiles(model).kernels.iloc[-1].startswith("fast: fast decode forward, 2 layers, Gemma3")
        if gdtool.loops.devloop.device_loop_support() is None:
            loop = _decode(model, prompt, kernels="fast", max_new_tokens=24, mode="device-loop")
            assert torch.equal(loop.tokens, captured.tokens)
    # captured teacher forcing, one graph per window phase: across the window's edge (it fills at step 6)
    agreement = accuracy.compare_kernels(model, batch=batch, prompt_len=3, steps=10, kernels="fast")
    assert (agreement.top1_agreement > 0.4).all(), agreement


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_window_roll_kernel_on_cuda_is_hfs_update_bit_for_bit(dtype):
    """In place on the GPU, where the programs and threads of one launch run at once: no slot read after it is
    overwritten (gemma-3-1b's and gemma-3-4b's windows, 1 to 8 rows)."""
    from gdtool.kernels import testing
    gen = torch.Generator(device="cuda").manual_seed(0)
    testing._impl.triton = True
    shapes = WINDOW_ROLLS + tuple((m, hkv, w, 256, None) for m in (1, 4, 8) for hkv, w in ((1, 512), (2, 1024)))
    for b, hkv, w, d, config in shapes:
        r = testing.check_window_roll(b, hkv, w, d, dtype, "cuda", gen, config)
        assert r.ok, r


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 4])
def test_fast_step_on_cuda_gemma3_1b_rounds_no_more_than_hf(batch):
    """gemma-3-1b's shapes (random weights, bf16; 512-token windows, 262k tied lm_head): the fast forward runs
    and its teacher-forced logits (inside the window) are as close to float32's as HF's own bf16 kernels are."""
    model = gdtool.load_model("gemma-3-1b", seed=0, device="cuda")
    assert fast_decoder.plan(model, batch, 64).applies, fast_decoder.plan(model, batch, 64).reason
    df = accuracy.accuracy(model, batch=batch, prompt_len=32, steps=16, kernels="fast")
    print(df.to_string())
    assert df.fast_mean_error.mean() <= 1.25 * df.hf_mean_error.mean(), df
    assert "Gemma3" in fast.compiles(model).kernels.iloc[-1]
