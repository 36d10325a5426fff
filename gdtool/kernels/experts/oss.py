"""gpt-oss's experts at small batch: transposed, interleaved, biased weights and the clamped SwiGLU, in gate/up
and down kernels of their own along the [E, K, N] weights' rows, then the fixed-order combine over each row's k
pairs (which the grouped path shares). Four launches per block."""
from __future__ import annotations

import torch

from ..triton import HAVE_TRITON, next_pow2, tl, triton
from .router import _logits
from .. import tuning
from .tiles import COMBINE_COLS, OssConfig, experts_config, oss_config

if HAVE_TRITON:
    from .router import _pair_route

if HAVE_TRITON:
    # gpt-oss's experts are stored the other way round: [E, K, N], each weight row a row of the reduction, its
    # N outputs contiguous. A program of the small kernels (small.py) reads rows of the N dimension, which here would be
    # columns 2 or 2I elements apart: one useful bf16 pair per 32-byte sector fetched. These read tiles
    # [BLOCK_K, N columns] along the rows instead, keep a 2-D float32 accumulator and reduce it once.

    @triton.jit
    def _oss_gate_up_kernel(x_ptr, logits_ptr, gu_ptr, gub_ptr, act_ptr, ids_ptr, wts_ptr, H, E, I, stride_x,
                            stride_l, ALPHA, LIMIT, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Grid (tiles of BLOCK_N intermediate columns, M * TOPK pairs): gpt-oss's clamped SwiGLU of one pair's
        tile, from gate_up [E, H, 2I] (column 2n gate n, 2n + 1 up n: the tile's 2 * BLOCK_N columns are
        contiguous in every weight row). HF's rounding points: product, += bias, clamps, gate * alpha,
        sigmoid, glu, up + 1, times, each rounded."""
        t = tl.program_id(0)
        p = tl.program_id(1)
        out_ty = x_ptr.dtype.element_ty
        m = p // TOPK
        expert = _pair_route(logits_ptr, ids_ptr, wts_ptr, p, t, m, stride_l, E, out_ty, TOPK, BLOCK_TOPK,
                             BLOCK_E, False, False, True)
        c = t * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)    # gate 0, up 0, gate 1, up 1, ... of the tile
        cmask = c < 2 * I
        base = gu_ptr + expert.to(tl.int64) * H * (2 * I)
        acc = tl.zeros([BLOCK_K, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < H
            w = tl.load(base + k[:, None].to(tl.int64) * (2 * I) + c[None, :], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            x = tl.load(x_ptr + m * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
            acc += x[:, None] * w.to(tl.float32)
        bias = tl.load(gub_ptr + expert.to(tl.int64) * (2 * I) + c, mask=cmask, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(tl.sum(acc, axis=0), [BLOCK_N, 2]))
        gb, ub = tl.split(tl.reshape(bias, [BLOCK_N, 2]))
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(act_ptr + p.to(tl.int64) * I + n, _oss_swiglu(g, u, gb, ub, ALPHA, LIMIT, out_ty), mask=n < I)

    @triton.jit
    def _oss_swiglu(g, u, gate_bias, up_bias, ALPHA, LIMIT, out_ty: tl.constexpr):
        """gpt-oss's activation of float32 products g, u (gate and up; any shape) with their biases, at HF's
        rounding points: product, += bias, clamps, gate * alpha, sigmoid, glu, up + 1, times, each rounded."""
        g = tl.minimum((g.to(out_ty).to(tl.float32) + gate_bias).to(out_ty).to(tl.float32), LIMIT)
        u = (u.to(out_ty).to(tl.float32) + up_bias).to(out_ty).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        s = (g * ALPHA).to(out_ty).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-s))).to(out_ty).to(tl.float32)
        a = (g * s).to(out_ty).to(tl.float32)
        u = (u + 1.0).to(out_ty).to(tl.float32)
        return (a * u).to(out_ty)

    @triton.jit
    def _oss_down_kernel(act_ptr, ids_ptr, wts_ptr, d_ptr, db_ptr, y_ptr, H, I, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """Grid (tiles of BLOCK_N hidden columns, M * TOPK pairs): y[pair] = round(round(round(act[pair] @
        Wd[e]) + bias) * weight) from down [E, I, H] read along its rows, float32; `_combine_kernel` sums each
        row's k pairs in routing order and rounds once, as HF's sum over the top-k."""
        t = tl.program_id(0)
        p = tl.program_id(1)
        out_ty = act_ptr.dtype.element_ty
        expert = tl.load(ids_ptr + p)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        base = d_ptr + expert.to(tl.int64) * I * H
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < I
            w = tl.load(base + k[:, None].to(tl.int64) * H + n[None, :], mask=kmask[:, None] & nmask[None, :],
                        other=0.0)
            a = tl.load(act_ptr + p.to(tl.int64) * I + k, mask=kmask, other=0.0).to(tl.float32)
            acc += a[:, None] * w.to(tl.float32)
        y = tl.sum(acc, axis=0).to(out_ty).to(tl.float32)
        y = (y + tl.load(db_ptr + expert.to(tl.int64) * H + n, mask=nmask, other=0.0).to(tl.float32)).to(out_ty)
        y = (y.to(tl.float32) * tl.load(wts_ptr + p)).to(out_ty).to(tl.float32)
        tl.store(y_ptr + p.to(tl.int64) * H + n, y, mask=nmask)

    @triton.jit
    def _combine_kernel(y_ptr, out_ptr, H, stride_out, TOPK: tl.constexpr, BLOCK_N: tl.constexpr):
        """Grid (N tiles of H, M): out[m] = sum over j in routing order of y[m * TOPK + j], float32, rounded once."""
        t = tl.program_id(0)
        m = tl.program_id(1)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(y_ptr + (m * TOPK + j).to(tl.int64) * H + n, mask=nmask, other=0.0)
        tl.store(out_ptr + m * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def block_oss(x, router_weight, gate_up, down, top_k, router_bias, gate_up_bias, down_bias, alpha, limit,
              config: OssConfig | None = None, intermediates: dict | None = None):
    """gpt-oss's block in four kernels: the router (its bias), gate/up and down along the [E, K, N] weights'
    rows, per (row, expert) pair, then the fixed-order combine over each row's k pairs. x [M, H] -> [M, H]."""
    m, h = x.shape
    e, _, two_i = gate_up.shape
    i = two_i // 2
    tune = tuning.current(x.device)
    cfg = config or oss_config(tune)
    dev = x.device
    ids = torch.empty(m, top_k, device=dev, dtype=torch.int32)
    weights = torch.empty(m, top_k, device=dev, dtype=torch.float32)
    act = torch.empty(m * top_k, i, device=dev, dtype=x.dtype)
    y = torch.empty(m * top_k, h, device=dev, dtype=torch.float32)
    out = torch.empty(m, h, device=dev, dtype=x.dtype)
    logits = _logits(x, router_weight, None, router_bias, e, experts_config(h, i, tune=tune))
    _oss_gate_up_kernel[(triton.cdiv(i, cfg.gate_up_cols), m * top_k)](
        x, logits, gate_up, gate_up_bias, act, ids, weights, h, e, i, x.stride(0), logits.stride(0), float(alpha),
        float(limit), TOPK=top_k, BLOCK_TOPK=next_pow2(top_k), BLOCK_E=next_pow2(e), BLOCK_N=cfg.gate_up_cols,
        BLOCK_K=cfg.block_k, num_warps=cfg.warps)
    _oss_down_kernel[(triton.cdiv(h, cfg.down_cols), m * top_k)](
        act, ids, weights, down, down_bias, y, h, i, BLOCK_N=cfg.down_cols, BLOCK_K=cfg.block_k, num_warps=cfg.warps)
    _combine_kernel[(triton.cdiv(h, COMBINE_COLS), m)](y, out, h, out.stride(0), TOPK=top_k, BLOCK_N=COMBINE_COLS)
    if intermediates is not None:
        intermediates.update(logits=logits, ids=ids, weights=weights, act=act, shared_act=None)
    return out
