"""The decode kernels behind one call each: Triton where it runs, the torch reference elsewhere.

`fast_triton.usable` decides per call: CUDA tensors with Triton present, or Triton's CPU
interpreter (TRITON_INTERPRET=1, the CPU tests); otherwise (a CPU build of torch) the torch
reference runs, with the same arguments and result. The fast decode forward calls these eagerly
(no torch.compile around them): captured in gdtool's graph, a call costs its kernel alone.

    rms_gemv(x, norm_weight?, eps, weight, weight2?, residual?, out_f32, plus_one, act)  -> [M, N]
                                                                          (weight2: gate/up, act its activation)
    qkv_rope(x, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache!, v_cache!, slot,
             biases?, qk_norm?, plus_one)                                 -> q  (biases: Qwen2; qk_norm: Qwen3, Gemma 3)
    rms_add(y, norm_weight, eps, residual, plus_one)                       -> residual + RMSNorm(y)  (Gemma 3)
    moe(x, block, norm_weight, eps)                                         -> x + the MoE block of RMSNorm(x)
                                                                            (`experts.block_args`: its weights)
    roll_window(k_cache!, v_cache!)                                         a full sliding window shifted left by
                                                                            one slot, for qkv_rope to write the last
    decode_attention(q, k_cache, v_cache, mask, slot, scale)               -> [M, Hq * D]
    argmax(x)                                                               -> [M] int64
    greedy_tail(scores, step!, counters!)                                   the argmax as the next token, step's
                                                                            state updated, counters + 1 (`tail`)
(`!`: written in place. plus_one: Gemma's RMSNorm, times 1 + weight: `gemv`.) rms_gemv and qkv_rope also take
add=(a, weight, eps): their input becomes x + RMSNorm(a), rms_add folded into them (Gemma 3's post norms), and
they return it beside their result. qkv_rope takes embed=(tokens, scale?) instead: x is the embedding table and
its input the table's rows at the tokens (the first layer's lookup folded in), returned beside q.
"""
from __future__ import annotations

from . import attention, experts, gemv, sampling, tail, window
from .triton import usable


def rms_gemv(x, norm_weight, eps, weight, weight2, residual, out_f32, plus_one=False, act="silu", add=None,
             keep=True):
    """add=(a, weight, eps): the input is x + RMSNorm(a) (Gemma's post norm and residual add, folded into the
    kernel); returns (y, that input) where keep, else y."""
    if usable(x, weight):
        return gemv.rms_gemv(x, norm_weight, eps, weight, weight2, residual, out_f32, plus_one=plus_one, act=act,
                             add=add, keep=keep)
    h = x if add is None else gemv.rms_add_reference(add[0], add[1], add[2], x, plus_one)
    if weight2 is not None:
        y = gemv.gate_up_reference(h, norm_weight, eps, weight, weight2, plus_one, act)
    else:
        y = gemv.rms_gemv_reference(h, norm_weight, eps, weight, residual, out_f32, plus_one)
    return (y, h) if add is not None and keep else y


def rms_add(y, norm_weight, eps, residual, plus_one=False):
    if usable(y, residual):
        return gemv.rms_add(y, norm_weight, eps, residual, plus_one)
    return gemv.rms_add_reference(y, norm_weight, eps, residual, plus_one)


def moe(x, block, norm_weight, eps):
    """x + the MoE block (`block`, a family `experts.block_args` reads) of RMSNorm(x) (Llama's), the add rounded
    once as HF's residual add. Where Triton runs: the norm inside the router and gate/up kernels, the add in
    the down kernel."""
    args = experts.block_args(block)
    if usable(x, args[2]):
        return experts.block_triton(x, *args, residual=x, norm=(norm_weight, eps))
    return x + experts.reference.block_reference(gemv.rms_norm_reference(x, norm_weight, eps), *args)


def qkv_rope(x, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache, v_cache, slot, biases=None,
             qk_norm=None, plus_one=False, add=None, embed=None):
    """add: as rms_gemv's (returns (q, the input) then). embed=(tokens, scale or None): x is the embedding table
    and the input its rows at the tokens (`gemv.embedding_reference`), also returned."""
    if usable(x, wq, k_cache):
        return gemv.qkv_rope(x, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache, v_cache,
                             slot, biases, qk_norm, plus_one, add=add, embed=embed)
    h = x
    if add is not None:
        h = gemv.rms_add_reference(add[0], add[1], add[2], x, plus_one)
    elif embed is not None:
        h = gemv.embedding_reference(x, *embed)
    q = gemv.qkv_rope_reference(h, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache,
                                v_cache, slot, biases, qk_norm, plus_one)
    return (q, h) if add is not None or embed is not None else q


def roll_window(k_cache, v_cache):
    if usable(k_cache, v_cache):
        return window.roll_left(k_cache, v_cache)
    return window.roll_left_reference(k_cache, v_cache)


def decode_attention(q, k_cache, v_cache, mask, slot, scale):
    if usable(q, k_cache):
        return attention.split_kv(q, k_cache, v_cache, mask, slot, scale)
    return attention.split_kv_reference(q, k_cache, v_cache, mask, slot, scale)


def argmax(x):
    if usable(x):
        return sampling.argmax(x)
    return sampling.argmax_reference(x)


def greedy_tail(scores, step, counters):
    if usable(scores):
        return tail.update(scores, step, counters)
    return tail.update_reference(scores, step, counters)
