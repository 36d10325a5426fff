"""The packed grouped-query attention of the compiled step, against HF's sdpa attention (and gpt-oss's eager
attention with its sinks)."""
import contextlib
import random

import pytest
import torch

import gdtool
from gdtool.core import compat
from gdtool.kernels import attention as fast_attention, triton as fast_triton
from interpreter import run_interpreted


@pytest.fixture(scope="module")
def model():
    return gdtool.load_model("tiny-llama", seed=0)


def _inputs(batch=3, hq=8, hkv=2, length=1, slots=11, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, length, dim, generator=g)
    k = torch.randn(batch, hkv, slots, dim, generator=g)
    v = torch.randn(batch, hkv, slots, dim, generator=g)
    mask = torch.rand(batch, 1, length, slots, generator=g) > 0.3
    mask[..., 0] = True  # every row attends somewhere
    return q, k, v, mask


class _Attn(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def test_packed_attention_computes_what_hf_sdpa_computes():
    fast_attention.install()
    q, k, v, mask = _inputs()
    hf, _ = fast_attention._original(_Attn(), q, k, v, mask, scaling=0.25)
    packed = fast_attention.decode_attention(q, k, v, mask, 0.25)
    assert packed.shape == hf.shape == (3, 1, 8, 16)
    torch.testing.assert_close(packed, hf, rtol=1e-5, atol=1e-6)
    # and a mask that does change the answer is honoured
    assert not torch.allclose(packed, fast_attention.decode_attention(q, k, v, None, 0.25))


def test_dispatch_keeps_hf_outside_the_scope_and_for_what_it_does_not_cover():
    fast_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert sdpa is fast_attention._dispatch
    q, k, v, mask = _inputs()
    hf, _ = fast_attention._original(_Attn(), q, k, v, mask, scaling=0.25)
    assert torch.equal(sdpa(_Attn(), q, k, v, mask, scaling=0.25)[0], hf)  # outside: HF's own call, same bits
    with fast_attention.scope():
        assert fast_attention.active()
        assert torch.equal(sdpa(_Attn(), q, k, v, mask, scaling=0.25)[0],
                           fast_attention.decode_attention(q, k, v, mask, 0.25))
        q2, k2, v2, mask2 = _inputs(length=3)  # a prompt, not a decode step: HF's attention
        assert torch.equal(sdpa(_Attn(), q2, k2, v2, mask2, scaling=0.25)[0],
                           fast_attention._original(_Attn(), q2, k2, v2, mask2, scaling=0.25)[0])
        assert not fast_attention.applies(q, k, mask, 0.0, {"softcap": 30.0})
        assert not fast_attention.applies(q, k, mask, 0.1, {})
    assert not fast_attention.active()


def test_sliding_layers_take_the_packed_form_as_hf_sdpa_ignores_their_window():
    """A sliding layer's call carries its window (`sliding_window`) beside a mask that already holds it: HF's sdpa
    gives the same bits with and without the argument (were that to change, the packed form would miss it), and
    inside the scope the dispatcher computes such a call as it computes a full layer's; with the switch off
    (GDTOOL_SLIDING_SPLIT=0, read as the scope is entered) it leaves it to HF's sdpa."""
    fast_attention.install()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    q, k, v, mask = _inputs()
    mask[..., :4] = False   # the window: the first slots masked
    mask[..., 4] = True
    hf, _ = fast_attention._original(_Attn(), q, k, v, mask, scaling=0.25)
    assert torch.equal(fast_attention._original(_Attn(), q, k, v, mask, scaling=0.25, sliding_window=2)[0], hf)
    assert fast_attention.applies(q, k, mask, 0.0, {"sliding_window": 7})
    with fast_attention.scope():
        out = ALL_ATTENTION_FUNCTIONS["sdpa"](_Attn(), q, k, v, mask, scaling=0.25, sliding_window=7)[0]
    assert torch.equal(out, fast_attention.decode_attention(q, k, v, mask, 0.25))
    torch.testing.assert_close(out, hf, rtol=1e-5, atol=1e-6)
    # GDTOOL_SLIDING_SPLIT=0 (read as the scope is entered): HF's sdpa for a sliding layer's call, a full layer's packed
    with fast_triton.switches(sliding_split=False), fast_attention.scope():
        assert not fast_attention.applies(q, k, mask, 0.0, {"sliding_window": 7})
        assert torch.equal(ALL_ATTENTION_FUNCTIONS["sdpa"](_Attn(), q, k, v, mask, scaling=0.25, sliding_window=7)[0],
                           hf)
        assert fast_attention.applies(q, k, mask, 0.0, {})
    with fast_attention.scope():
        assert fast_attention.applies(q, k, mask, 0.0, {"sliding_window": 7})


def _against_hf_sdpa():
    """gdtool's split-KV operator for the compiled HF forward (`mask_attention`: the kernels under Triton's
    interpreter, else its torch reference) against HF's sdpa attention, and the dispatcher's choice in the scope:
    a boolean mask goes to it, a float one (which may add a bias) to the packed sdpa."""
    fast_attention.install()
    q, k, v, mask = _inputs()
    hf, _ = fast_attention._original(_Attn(), q, k, v, mask, scaling=0.25)
    mine = fast_attention.mask_attention(q, k, v, mask, 0.25)
    assert mine.shape == hf.shape == (3, 1, 8, 16)
    torch.testing.assert_close(mine, hf, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(mine, fast_attention.mask_attention(q, k, v, torch.ones_like(mask), 0.25))
    with fast_attention.scope(split_kernel=True):
        assert torch.equal(fast_attention._dispatch(_Attn(), q, k, v, mask, scaling=0.25)[0], mine)
        assert torch.equal(fast_attention._dispatch(_Attn(), q, k, v, _additive(mask), scaling=0.25)[0],
                           fast_attention.decode_attention(q, k, v, _additive(mask), 0.25))
        # heads of 8 (the kernel's dot products take 16 and up): the packed sdpa
        q8, k8, v8 = q[..., :8], k[..., :8], v[..., :8]
        assert torch.equal(fast_attention._dispatch(_Attn(), q8, k8, v8, mask, scaling=0.25)[0],
                           fast_attention.decode_attention(q8, k8, v8, mask, 0.25))
    assert torch.equal(fast_attention._dispatch(_Attn(), q, k, v, mask, scaling=0.25)[0], hf)  # outside: HF's


def test_mask_attention_operator_computes_what_hf_sdpa_computes():
    _against_hf_sdpa()


def test_split_kv_plan_says_which_attention_the_compiled_forward_runs(model):
    assert fast_attention.split_kv_plan(model, "compiled") == (False, "")
    assert fast_attention.split_kv_plan(gdtool.load_model("tiny-gpt-oss", seed=0), "fast") == (False, "")  # sinks
    applies, note = fast_attention.split_kv_plan(model, "fast")
    expected = (True, "attention: gdtool's split-KV kernels") if fast_triton.interpreting() else \
        (False, "attention: the packed sdpa (no Triton on this device)")
    assert (applies, note) == expected
    eager = gdtool.load_model("tiny-llama", seed=0)
    eager.config._attn_implementation = "eager"
    applies, note = fast_attention.split_kv_plan(eager, "fast")
    assert not applies and note.startswith("attention: HF's eager attention"), note
    eager.config._attn_implementation, eager.config.head_dim = "sdpa", 24   # heads the split kernel does not take
    assert fast_attention.split_kv_plan(eager, "fast") == (
        False, "attention: the packed sdpa (head_dim 24: the split kernel takes a power of two >= 16)")
    assert [d for d in (8, 16, 24, 64, 80, 128, 256) if fast_attention.split_kv_fits(d)] == [16, 64, 128, 256]


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~30 s on 2 cores (Triton's interpreter)
def test_split_kernel_reads_no_masked_slot_and_decodes_in_the_compiled_forward_under_the_interpreter():
    """`mask_attention` (every slot counted live, the mask alone says which attend) loads no key or value of a
    masked slot: with NaN in every masked slot, over a seeded sweep of rows, grouped heads, cache and live lengths
    and padding, it gives bit for bit what it gives with clean caches, several blocks of chunks and output slices
    included; close to the fast step's call with the live length known (another kernel variant: on the H200 not
    bitwise), and the float64 check passes. Then tiny-llama, tiny-qwen3-moe and tiny-gemma3 at 12 rows (past gdtool's
    own forward): `kernels="fast"`'s compiled HF forward runs their sdpa calls in the kernels, says so, and decodes
    HF's tokens, the sliding layers' calls of tiny-gemma3 among those in the kernels."""
    code = ("import random, sys, torch, gdtool\nsys.path.insert(0, 'tests')\nimport test_fast_attention as t\n"
            "from gdtool.kernels import attention, step, testing\n"
            "from gdtool.kernels import tuning\n"
            "def plan(**values):  # the attention's tuning, passed as a probe passes it\n"
            "    tuning._override[:] = [tuning.current().with_values('attention', **values)]\n"
            "t._against_hf_sdpa()\n"
            "gen = torch.Generator().manual_seed(2)\n"
            "rng = random.Random(2)\n"
            "for i in range(8):\n"
            "    hkv, c = rng.choice((1, 2)), rng.randint(8, 120)\n"
            "    m, hq, d, live, pad = rng.randint(1, 4), hkv * rng.choice((1, 2, 4)), rng.choice((16, 32)), \\\n"
            "        rng.randint(1, c), rng.randint(0, 4)\n"
            "    plan(combine_elements=4096 if i % 2 else 2 * d)  # odd: one block; even: blocks of 2 chunks\n"
            "    q, kc, vc, mask, slot, scale, _ = t.split_kv_args(gen, m, hq, hkv, d, c, live, pad, False)\n"
            "    mask[:, live:] = 0\n"
            "    known = attention.split_kv(q, kc, vc, mask, slot, scale)\n"
            "    hidden = (mask == 0)[:, None, :, None].expand_as(kc)\n"
            "    nan_k, nan_v = kc.masked_fill(hidden, float('nan')), vc.masked_fill(hidden, float('nan'))\n"
            "    mask4, q4 = mask.bool()[:, None, None, :], q.view(m, hq, 1, d)\n"
            "    clean = attention.mask_attention(q4, kc, vc, mask4, scale)\n"
            "    out = attention.mask_attention(q4, nan_k, nan_v, mask4, scale)\n"
            "    assert torch.equal(out, clean), (m, hq, hkv, d, c, live, pad)\n"
            "    torch.testing.assert_close(clean.reshape(m, hq * d), known)\n"
            "    r = testing.check_attention(m, hq, hkv, d, c, live, torch.float16, 'cpu', gen, pad=pad)\n"
            "    assert r.ok, r\n"
            "plan(combine_elements=4096)\n"
            "calls, kernel = [], attention.split_kv\n"
            "attention.split_kv = lambda *a, **k: calls.append((k.get('mask_only'), a[1].shape[2])) \\\n"
            "    or kernel(*a, **k)\n"
            "for name in ('tiny-llama', 'tiny-qwen3-moe', 'tiny-gemma3'):  # dense, MoE, sliding + full layers\n"
            "    model = gdtool.load_model(name, seed=0)\n"
            "    prompt = gdtool.random_prompts(model, batch=12, lengths=(3, 9), seed=3)\n"
            "    kw = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=0, do_sample=False)\n"
            "    hf = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)\n"
            "    calls.clear()\n"
            "    mine = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, kernels='fast', **kw)\n"
            "    assert torch.equal(hf.tokens, mine.tokens), (name, hf.tokens, mine.tokens)\n"
            "    assert calls and all(only for only, _ in calls), (name, calls)  # the sdpa calls: mask_attention\n"
            "    window = getattr(model.config.get_text_config(), 'sliding_window', None)\n"
            "    if name == 'tiny-gemma3':  # its sliding layers' calls too (their cache is the window)\n"
            "        assert {slots for _, slots in calls} > {window}, (window, calls)\n"
            "    note = step.compiles(model).kernels.iloc[-1]\n"
            "    assert \"attention: gdtool's split-KV kernels\" in note, (name, note)\n"
            "print('ok')\n")
    run_interpreted(code, timeout=900)


def _next_token_logits(model, prompt):
    """The logits of one decode token after `prompt` (its greedy next token), HF's attention and then the packed
    one (gdtool's scope entered), each over a cache of its own."""
    cache_kw, _ = compat.forward_kwargs(model)
    logits = []
    with torch.inference_mode():
        for scope in (contextlib.nullcontext, fast_attention.scope):
            out = model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([prompt.attention_mask, torch.ones_like(nxt)], 1)
            with scope():
                logits.append(model(input_ids=nxt, attention_mask=mask, **{cache_kw: out.past_key_values}).logits)
    return logits


def test_model_logits_with_packed_attention_match_hf(model, monkeypatch):
    """The whole model, one decode token after a left-padded prompt: same logits (fp32)."""
    fast_attention.install()
    calls = []
    original = fast_attention.decode_attention
    monkeypatch.setattr(fast_attention, "decode_attention", lambda *a: calls.append(a[3]) or original(*a))
    hf, packed = _next_token_logits(model, gdtool.random_prompts(model, batch=3, lengths=(3, 7), seed=0))
    assert len(calls) == model.config.num_hidden_layers
    assert calls[0] is not None and not calls[0].all()  # the pads were masked by the packed path
    torch.testing.assert_close(packed, hf, rtol=1e-5, atol=1e-5)


class _SinkAttn(torch.nn.Module):  # what gpt-oss's eager attention reads off its module
    num_key_value_groups = 4

    def __init__(self, hq=8, seed=1):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(hq, generator=torch.Generator().manual_seed(seed)))


def _additive(mask):  # HF's eager masks add the dtype's minimum where a key is hidden
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def test_packed_sink_attention_computes_what_gpt_oss_eager_attention_computes():
    fast_attention.install()
    q, k, v, mask = _inputs()
    module = _SinkAttn().eval()
    hf, _ = fast_attention._original_sinks(module, q, k, v, _additive(mask), scaling=0.25)
    packed = fast_attention.sinks_decode_attention(q, k, v, _additive(mask), 0.25, module.sinks)
    assert packed.shape == hf.shape == (3, 1, 8, 16)
    torch.testing.assert_close(packed, hf, rtol=1e-5, atol=1e-6)
    # the sinks and the mask both change the answer, and are honoured
    assert not torch.allclose(packed, fast_attention.sinks_decode_attention(q, k, v, _additive(mask), 0.25,
                                                                             torch.zeros(8)))
    assert not torch.allclose(packed, fast_attention.sinks_decode_attention(q, k, v, None, 0.25, module.sinks))


def test_sinks_dispatch_keeps_gpt_oss_eager_outside_the_scope_and_for_prompts():
    fast_attention.install()
    from transformers.models.gpt_oss import modeling_gpt_oss
    dispatch = modeling_gpt_oss.eager_attention_forward
    assert dispatch is fast_attention._dispatch_sinks
    q, k, v, mask = _inputs()
    module, mask = _SinkAttn().eval(), _additive(mask)
    # the keywords gpt-oss's attention passes
    kw = dict(dropout=0.0, scaling=0.25, sliding_window=4, s_aux=module.sinks)
    hf, _ = fast_attention._original_sinks(module, q, k, v, mask, **kw)
    assert torch.equal(dispatch(module, q, k, v, mask, **kw)[0], hf)  # outside: HF's own call, same bits
    with fast_attention.scope():
        assert torch.equal(dispatch(module, q, k, v, mask, **kw)[0],
                           fast_attention.sinks_decode_attention(q, k, v, mask, 0.25, module.sinks))
        q2, k2, v2, mask2 = _inputs(length=3)  # a prompt, not a decode step: HF's attention
        assert torch.equal(dispatch(module, q2, k2, v2, _additive(mask2), **kw)[0],
                           fast_attention._original_sinks(module, q2, k2, v2, _additive(mask2), **kw)[0])


def test_gpt_oss_logits_with_packed_sink_attention_match_hf(monkeypatch):
    """tiny-gpt-oss (sliding layers of 8 tokens beside full ones), one decode token after left-padded prompts
    longer than the window: same logits (fp32), every layer through the packed path."""
    fast_attention.install()
    model = gdtool.load_model("tiny-gpt-oss", seed=0)
    calls = []
    original = fast_attention.sinks_decode_attention
    monkeypatch.setattr(fast_attention, "sinks_decode_attention", lambda *a: calls.append(a[1:4]) or original(*a))
    prompt = gdtool.random_prompts(model, batch=3, lengths=(6, 13), seed=0)
    assert prompt.input_ids.shape[1] > model.config.sliding_window
    hf, packed = _next_token_logits(model, prompt)
    assert len(calls) == model.config.num_hidden_layers
    # the sliding layer attends over its window of keys, the full layer over all 14, its pads masked
    assert sorted(key.shape[2] for key, _, _ in calls) == [model.config.sliding_window, 14]
    assert any((mask < 0).any() for _, _, mask in calls)
    torch.testing.assert_close(packed, hf, rtol=1e-5, atol=1e-5)


def _against_gpt_oss_eager():
    """gdtool's split-KV operator with sinks (the kernels under Triton's interpreter, else its torch reference)
    against gpt-oss's own eager attention: additive and boolean masks, the sinks honoured."""
    fast_attention.install()
    q, k, v, mask = _inputs()
    module = _SinkAttn().eval()
    hf, _ = fast_attention._original_sinks(module, q, k, v, _additive(mask), scaling=0.25)
    for given in (_additive(mask), mask, None):
        expected = hf if given is not None else fast_attention._original_sinks(module, q, k, v, None, scaling=0.25)[0]
        mine = fast_attention.sinks_attention(q, k, v, given, module.sinks, 0.25)
        assert mine.shape == (3, 1, 8, 16)
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(fast_attention.sinks_attention(q, k, v, mask, torch.zeros(8), 0.25), hf)


def test_sinks_attention_operator_computes_what_gpt_oss_eager_attention_computes():
    _against_gpt_oss_eager()


def test_sinks_plan_says_which_form_gpt_oss_attention_runs():
    model = gdtool.load_model("tiny-gpt-oss", seed=0)
    assert fast_attention.sinks_plan(model, "compiled") == (False, "")
    assert fast_attention.sinks_plan(gdtool.load_model("tiny-llama", seed=0), "fast") == (False, "")
    applies, note = fast_attention.sinks_plan(model, "fast")
    assert not applies and note == "attention with sinks: the packed torch form (no Triton on this device)"
    # another implementation than eager: gpt-oss calls it, not the dispatcher, and the note says so
    model.config._attn_implementation = "sdpa"
    applies, note = fast_attention.sinks_plan(model, "fast")
    assert not applies and note.startswith("attention with sinks: HF's sdpa attention"), note


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~25 s on 2 cores (Triton's interpreter)
def test_sinks_attention_kernels_under_the_interpreter_decode_hf_tokens():
    """The split-KV kernels with sinks themselves: against gpt-oss's eager attention, and inside a tiny gpt-oss's
    fast step (prompts past its window of 8, decodes that cross it): HF's tokens, and the step says so."""
    code = ("import sys, torch, gdtool\nsys.path.insert(0, 'tests')\nimport test_fast_attention as t\n"
            "t._against_gpt_oss_eager()\n"
            "from gdtool.kernels import step\n"
            "model = gdtool.load_model('tiny-gpt-oss', seed=0)\n"
            "prompt = gdtool.random_prompts(model, batch=2, lengths=(5, 11), seed=1)\n"
            "kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, do_sample=False)\n"
            "hf = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)\n"
            "mine = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, kernels='fast', **kw)\n"
            "assert torch.equal(hf.tokens, mine.tokens), (hf.tokens, mine.tokens)\n"
            "note = step.compiles(model).kernels.iloc[-1]\n"
            "assert \"attention with sinks: gdtool's split-KV kernels\" in note, note\n"
            "print('ok')\n")
    run_interpreted(code, timeout=900)


def split_kv_args(gen, m, hq, hkv, d, c, live, pad, sinks):
    """`split_kv`'s arguments in float16: m rows of hq query heads over hkv key/value heads of d, a c-slot cache
    with `live` slots written, row r left-padded by r * pad slots, and one sink a query head if `sinks`."""
    q = torch.randn(m, hq, d, generator=gen).half()
    kc, vc = (torch.randn(m, hkv, c, d, generator=gen).half() for _ in range(2))
    mask = torch.ones(m, c, dtype=torch.long)
    for r in range(m):
        mask[r, : min(r * pad, live - 1)] = 0
    sink = torch.randn(hq, generator=gen).half() if sinks else None
    return q, kc, vc, mask, torch.tensor(live - 1), d ** -0.5, sink


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_fused_combine_under_the_interpreter_equals_the_combine_kernel():
    """GDTOOL_FUSED_COMBINE: the split kernel's last program per (row, key/value head) combines (`fused_plan`, short
    caches). Under the interpreter, over a seeded sweep of rows, grouped heads, cache and live lengths, left padding
    and sinks: the output equals the two-kernel form's bit for bit (the same plan: every case here keeps
    split_plan's chunks), again on a second call (the counts back at zero), and the float64 check passes."""
    code = ("import random, torch\nfrom gdtool.kernels import attention, testing, triton as fast_triton\n"
            "import test_fast_attention as t\n"
            "gen = torch.Generator().manual_seed(0)\n"
            "rng = random.Random(0)  # a seeded sweep, and the edges: one live slot, every slot live\n"
            "cases = [(1, 4, 1, 16, 40, 1, 0, False), (2, 8, 2, 32, 64, 64, 5, True)]\n"
            "for _ in range(8):\n"
            "    hkv, c = rng.choice((1, 2, 4)), rng.randint(8, 96)\n"
            "    cases.append((rng.randint(1, 4), hkv * rng.choice((1, 2, 4, 8)), hkv, rng.choice((16, 32)), c,\n"
            "                  rng.randint(1, c), rng.randint(0, 3), rng.random() < 0.5))\n"
            "for m, hq, hkv, d, c, live, pad, sinks in cases:\n"
            "    args = t.split_kv_args(gen, m, hq, hkv, d, c, live, pad, sinks)\n"
            "    assert attention.fused_plan(m, hkv, hq // hkv, c, d) == attention.split_plan(m, hkv, c)\n"
            "    with fast_triton.switches(fused_combine=False):\n"
            "        two = attention.split_kv(*args)\n"
            "    with fast_triton.switches(fused_combine=True):\n"
            "        one, again = attention.split_kv(*args), attention.split_kv(*args)\n"
            "    assert torch.equal(one, two) and torch.equal(again, two), (m, hq, hkv, live, (one - two).abs().max())\n"
            "    assert not fast_triton._COUNTS[('attention', 'cpu')].any()  # every count set back to 0\n"
            "    r = testing.check_attention(m, hq, hkv, d, c, live, torch.float16, 'cpu', gen, pad=pad, sinks=sinks)\n"
            "    assert r.ok, r\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_split_kernel_over_chunks_of_several_blocks_under_the_interpreter():
    """The split kernel loads its chunk's first keys before the PDL wait (`early_keys`: the whole chunk where it
    is short) and the rest in its loop a block at a time; at the default plan a short cache's chunks are one block
    each. With split_plan's target programs lowered so that chunks span 1 to 8 blocks (this step's slot in the first
    block or a later one), two thirds of the cases with early_elements lowered to one block's keys (the loop runs)
    and a third at the default (chunks loaded whole, one chunk a head finished in the split kernel, or combined in
    its last program), the loop 16 or 64 keys an iteration (`loop_keys`), over a seeded sweep of rows, grouped heads, cache and live lengths, padding and sinks: the float64
    check passes; and `mask_attention` (the mask alone says which slots attend) reads no masked slot's key or
    value, NaN there giving the clean caches' bits."""
    code = ("import random, torch\nfrom gdtool.kernels import attention, testing\nimport test_fast_attention as t\n"
            "from gdtool.kernels import tuning\n"
            "def plan(**values):  # the attention's tuning, passed as a probe passes it\n"
            "    tuning._override[:] = [tuning.current().with_values('attention', **values)]\n"
            "gen = torch.Generator().manual_seed(5)\n"
            "rng = random.Random(5)\n"
            "blocks, kinds, loops, default = set(), set(), set(), tuning.defaults()['attention']['early_elements']\n"
            "block_s = tuning.defaults()['attention']['block_s']\n"
            "for i in range(12):\n"
            "    hkv, c = rng.choice((1, 2)), rng.randint(17, 130)\n"
            "    m, hq, d, live = rng.randint(1, 3), hkv * rng.choice((1, 4)), rng.choice((16, 32)), rng.randint(1, c)\n"
            "    plan(programs_per_sm=m * hkv * (1, 2, 3, 8)[i % 4] / tuning.current().multiprocessors,  # 1-8 chunks a head\n"
            "         early_elements=(16 * 16, default)[i // 4 % 2],\n"
            "         loop_elements=(16 * d, 64 * d)[i % 3 == 1])  # the loop a block of 16 keys, or of 64\n"
            "    loops.add(attention.loop_keys(d))\n"
            "    assert attention.target_programs() == m * hkv * (1, 2, 3, 8)[i % 4]\n"
            "    pad, sinks = rng.randint(0, 3), rng.random() < 0.3\n"
            "    chunk, splits, fused = attention.attention_plan(m, hkv, hq // hkv, c, d, torch.device('cpu'))\n"
            "    kinds.add('one chunk' if splits == 1 else 'fused' if fused else 'loop' if chunk > attention.early_keys(chunk, d)\n"
            "              else 'two kernels')\n"
            "    blocks.add((chunk // block_s, (live - 1) % chunk // block_s))\n"
            "    r = testing.check_attention(m, hq, hkv, d, c, live, torch.float16, 'cpu', gen, pad=pad, sinks=sinks)\n"
            "    assert r.ok, (attention.target_programs(), r)\n"
            "    q, kc, vc, mask, slot, scale, _ = t.split_kv_args(gen, m, hq, hkv, d, c, live, pad, False)\n"
            "    mask[:, live:] = 0\n"
            "    hidden = (mask == 0)[:, None, :, None].expand_as(kc)\n"
            "    mask4, q4 = mask.bool()[:, None, None, :], q.view(m, hq, 1, d)\n"
            "    clean = attention.mask_attention(q4, kc, vc, mask4, scale)\n"
            "    nan = attention.mask_attention(q4, kc.masked_fill(hidden, float('nan')), vc.masked_fill(hidden, float('nan')),\n"
            "                                   mask4, scale)\n"
            "    assert torch.equal(clean, nan), (attention.target_programs(), m, hq, hkv, c, live, pad)\n"
            "assert max(b for b, _ in blocks) >= 4 and any(at > 0 for _, at in blocks), blocks  # long chunks, the slot past block 0\n"
            "assert {'one chunk', 'fused', 'loop'} <= kinds, kinds\n"
            "assert loops == {16, 64}, loops\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


def test_loop_keys_follow_the_head_size_and_the_tuning():
    """The split loop's block: loop_elements over the head size, a power of two, at least block_s; the shipped
    1024 keeps the 16 keys of block_s for heads of 64 to 256."""
    from gdtool.kernels import tuning
    tune = tuning.defaults()
    assert [fast_attention.loop_keys(d, tune) for d in (64, 128, 256)] == [16, 16, 16]
    wide = tune.with_values("attention", loop_elements=4096)
    assert [fast_attention.loop_keys(d, wide) for d in (64, 80, 128, 256)] == [64, 32, 32, 16]
    assert fast_attention.loop_keys(256, tune.with_values("attention", loop_elements=8192)) == 32


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_combine_in_blocks_of_chunks_and_outputs_under_the_interpreter():
    """The combine reads a head's partials a block of chunks at a time, and each of its programs takes a slice
    of the head's outputs (`combine_plan`). With the tiles shrunk so that every case takes several blocks and
    slices (2 or 4 chunks, a half or a quarter of a head's outputs), over a seeded sweep of rows, grouped heads, cache and live lengths,
    padding and sinks: the float64 check passes, the fused combine equals the two-kernel form bit for bit, and
    the result differs from the one-block plan (one read of the partials) by rounding only, by nothing where
    the live chunks fit one block."""
    code = ("import random, torch\nfrom gdtool.kernels import attention, testing\nimport test_fast_attention as t\n"
            "from gdtool.kernels import triton as fast_triton, tuning\n"
            "def plan(**values):  # the attention's tuning, passed as a probe passes it\n"
            "    tuning._override[:] = [tuning.current().with_values('attention', **values)]\n"
            "gen = torch.Generator().manual_seed(1)\n"
            "rng = random.Random(1)\n"
            "assert attention.combine_plan(259, 256) == (64, 64) and attention.combine_plan(24, 64) == (64, 32)\n"
            "def two_kernels(*args):  # the combine kernel's blocks; the fused form is compared below\n"
            "    with fast_triton.switches(fused_combine=False):\n"
            "        return attention.split_kv(*args)\n"
            "one_block = 0\n"
            "cases = [(1, 4, 1, 32, 96, 96, 0, False), (2, 8, 2, 16, 80, 3, 1, True)]\n"
            "for _ in range(6):\n"
            "    hkv, c = rng.choice((1, 2)), rng.randint(40, 120)\n"
            "    cases.append((rng.randint(1, 3), hkv * rng.choice((1, 2, 4)), hkv, rng.choice((16, 32)), c,\n"
            "                  rng.randint(1, c), rng.randint(0, 3), rng.random() < 0.5))\n"
            "for i, (m, hq, hkv, d, c, live, pad, sinks) in enumerate(cases):\n"
            "    args = t.split_kv_args(gen, m, hq, hkv, d, c, live, pad, sinks)\n"
            "    plan(combine_d=64, combine_elements=4096)\n"
            "    whole = two_kernels(*args)\n"
            "    chunk, splits = attention.split_plan(m, hkv, c)\n"
            "    combine_d = d // (2, 4)[i % 2]\n"
            "    plan(combine_d=combine_d, combine_elements=combine_d * (4 if splits > 4 and i % 3 == 0 else 2))\n"
            "    block_d, block_splits = attention.combine_plan(splits, d)\n"
            "    assert block_d < d and block_splits < splits, (d, splits, block_d, block_splits)\n"
            "    two = two_kernels(*args)\n"
            "    torch.testing.assert_close(two, whole, rtol=2e-3, atol=2e-3)\n"
            "    if -(-live // chunk) <= block_splits:  # the live chunks in one block: the same sums as one pass\n"
            "        assert torch.equal(two, whole), (m, hq, hkv, live, (two - whole).abs().max())\n"
            "        one_block += 1\n"
            "    with fast_triton.switches(fused_combine=True):\n"
            "        one = attention.split_kv(*args)\n"
            "    assert torch.equal(one, two), (m, hq, hkv, live, (one - two).abs().max())\n"
            "    with fast_triton.switches(fused_combine=False):\n"
            "        r = testing.check_attention(m, hq, hkv, d, c, live, torch.float16, 'cpu', gen, pad=pad,\n"
            "                                    sinks=sinks)\n"
            "    assert r.ok, r\n"
            "assert one_block, 'no case had its live chunks in one block'\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True], ids=["no-pdl", "pdl"])
def test_fused_combine_on_cuda(pdl):
    """GDTOOL_FUSED_COMBINE on the GPU, where the programs of one launch run at once: the float64 checks at
    real shapes (Gemma-3-1B's 4/1 x 256 heads, Llama's 32/8 x 64 and Qwen3-30B-A3B's 32/4 x 128 at 384 slots, the
    fused plan; 8 rows, sinks) and a seeded sweep, each twice (the counts reset), and tiny-llama's fast step
    captured equal to itself uncaptured, with the fused combine and without it."""
    from gdtool.kernels import testing
    gen = torch.Generator(device="cuda").manual_seed(0)
    testing._impl.triton = True
    shapes = [(1, 4, 1, 256, 512, 200, 0, False), (1, 32, 8, 64, 384, 384, 0, False), (1, 32, 4, 128, 384, 300, 0, False),
              (8, 32, 8, 64, 384, 150, 7, False), (4, 64, 8, 64, 256, 100, 3, True), (1, 4, 1, 256, 512, 1, 0, False),
              (1, 4, 1, 256, 4200, 4150, 0, True)]  # ~260 chunks: the combine reads them a block at a time
    rng = random.Random(pdl)  # and a seeded sweep over rows, groups, head sizes, cache and live lengths, padding
    for _ in range(12):
        hkv, c = rng.choice((1, 2, 8)), rng.randint(16, 1024)
        shapes.append((rng.randint(1, 16), hkv * rng.choice((1, 4, 8)), hkv, rng.choice((64, 128, 256)), c,
                       rng.randint(1, c), rng.randint(0, 5), rng.random() < 0.3))
    with fast_triton.pdl(pdl):
        for m, hq, hkv, d, c, live, pad, sinks in shapes:
            for _ in range(2):
                with fast_triton.switches(fused_combine=True):
                    r = testing.check_attention(m, hq, hkv, d, c, live, torch.bfloat16, "cuda", gen, pad=pad,
                                                sinks=sinks)
                assert r.ok, r
        model = gdtool.load_model("tiny-llama", seed=0, device="cuda")
        prompt = gdtool.random_prompts(model, batch=2, lengths=(5, 12), seed=0)   # tiny-llama's line: 2 rows
        kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0, do_sample=False, kernels="fast",
                  mode="step-graph", return_scores=True)
        runs = []
        for fused in (True, False):
            with fast_triton.switches(fused_combine=fused):
                runs.append((gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw),
                             gdtool.decode(model, prompt.input_ids, prompt.attention_mask, capture=False, **kw)))
    for captured, direct in runs:
        assert torch.equal(captured.tokens, direct.tokens) and torch.equal(torch.stack(captured.scores), torch.stack(direct.scores))


@pytest.mark.cuda
def test_mask_attention_in_the_compiled_forward_on_cuda():
    """`mask_attention` on the GPU (the split kernel with every slot counted live, HF's boolean mask read in place):
    at real shapes in bf16 (Llama's 32/8 x 64 at 64 rows, Qwen3's 32/8 x 128, a seeded sweep), NaN in every masked
    slot gives the bits clean caches give (no masked slot read), its float64 error within twice that of the fast
    step's call with the live length known (`testing.judge`), and the float64 check passes there; then tiny-llama and
    tiny-gemma3 (sliding layers) at 12 rows (the compiled HF forward), captured equal to itself uncaptured, the step's
    note naming the kernels."""
    from gdtool.kernels import step as fast_step, testing
    gen, cpu_gen = torch.Generator(device="cuda").manual_seed(0), torch.Generator().manual_seed(0)
    shapes = [(64, 32, 8, 64, 384, 256, 3), (16, 32, 8, 128, 512, 300, 5), (1, 32, 8, 128, 4200, 4100, 0),
              (1, 4, 1, 256, 4200, 4100, 0)]  # the last: 259 chunks, combined a block of 64 at a time
    rng = random.Random(0)
    for _ in range(8):
        hkv, c = rng.choice((1, 2, 8)), rng.randint(16, 1024)
        shapes.append((rng.randint(1, 64), hkv * rng.choice((1, 4, 8)), hkv, rng.choice((64, 128, 256)), c,
                       rng.randint(1, c), rng.randint(0, 5)))
    for m, hq, hkv, d, c, live, pad in shapes:
        q, kc, vc, mask, slot, scale, _ = split_kv_args(cpu_gen, m, hq, hkv, d, c, live, pad, False)
        q, kc, vc, mask, slot = (t.to("cuda") for t in (q, kc, vc, mask, slot))
        q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
        mask[:, live:] = 0
        known = fast_attention.split_kv(q, kc, vc, mask, slot, scale)
        hidden = (mask == 0)[:, None, :, None].expand_as(kc)
        nan_k, nan_v = kc.masked_fill(hidden, float("nan")), vc.masked_fill(hidden, float("nan"))
        mask4, q4 = mask.bool()[:, None, None, :], q.view(m, hq, 1, d)
        clean = fast_attention.mask_attention(q4, kc, vc, mask4, scale)
        out = fast_attention.mask_attention(q4, nan_k, nan_v, mask4, scale)
        assert torch.equal(out, clean), (m, hq, hkv, d, c, live, pad)
        # another kernel variant (its loads masked otherwise), not bitwise (H200: 4 bf16 ulps apart at 2 of 131072
        # outputs, 5260519): against float64, mask_attention's error within 2x the fast step's call's (+ one unit)
        exact = testing.exact_attention(q, kc, vc, mask, scale)
        r = testing.judge("mask_attention", f"{(m, hq, hkv, d, c, live, pad)}", torch.bfloat16,
                          clean.reshape(m, hq * d), known, exact)
        assert r.ok, r
        r = testing.check_attention(m, hq, hkv, d, c, live, torch.bfloat16, "cuda", gen, pad=pad)
        assert r.ok, r
    for name in ("tiny-llama", "tiny-gemma3"):   # tiny-gemma3: its sliding layers' calls too, the window rolling
        model = gdtool.load_model(name, seed=0, device="cuda")
        prompt = gdtool.random_prompts(model, batch=12, lengths=(5, 12), seed=0)
        kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0, do_sample=False, kernels="fast",
                  mode="step-graph")
        captured = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)
        direct = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, capture=False, **kw)
        assert torch.equal(captured.tokens, direct.tokens), name
        assert "attention: gdtool's split-KV kernels" in fast_step.compiles(model).kernels.iloc[-1], name
