"""The grouped path: `grouped_from` (the device's tuning: 2 on the H200) to 64 tokens per step, families without a
shared expert.

With several tokens the same expert serves several rows, and a matrix-vector product per (row, expert)
would read it once per row. The grouped kernels read each routed expert once per tile of its rows:

   route    per row: ids and routing weights, as the small path's gate/up programs compute them  (1)
   align    per expert (and one more for the tail): the M*k (row, k) pairs sorted by expert (stable:
            by pair index within an expert), each expert's run padded to BLOCK_M slots, padding -1;
            which expert each tile of BLOCK_M slots belongs to (-1 past the last). Fixed sizes, worst
            case: M*k pairs plus BLOCK_M - 1 padding per expert that can appear (min(E, M*k)); no
            host read                                                                            (1)
   gate_up  per (tile, N tile): the tile's pairs' x rows @ [Wg; Wu][e].T with tl.dot, rounded, SiLU,
            rounded, times up, rounded; written to the pair's own row of act [M*k, I]              (1)
   down     per (tile, N tile): act rows @ Wd[e].T, rounded, times the pair's weight (rounded, or
            float32 for Mixtral), written to the pair's own row of y [M*k, H]                      (1)
   combine  per (row, H tile): sum over its k pairs in routing order in float32, rounded once      (1)

Same rounding points as the small path and HF's batched_mm / grouped_mm; no atomics, a fixed order
of every sum: deterministic. Tile sizes: `grouped_config` (the device's tuning file)."""
from __future__ import annotations

import torch

from ..triton import HAVE_TRITON, dot_precision, next_pow2, tl, triton
from .router import _logits
from .. import tuning
from .tiles import ALIGN_ELEMENTS, ALIGN_TAIL, experts_config, grouped_config, grouped_slots

if HAVE_TRITON:
    from .oss import _combine_kernel, _oss_swiglu
    from .router import _route_kernel

if HAVE_TRITON:
    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, tile_expert_ptr, P, E, SLOTS, BLOCK_P: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
                      TAIL: tl.constexpr):
        """Grid (E + 1,): sorted_ptr [SLOTS] = pair indices grouped by expert (ascending expert, then pair),
        each group padded to a multiple of BLOCK_M with -1; tile_expert_ptr [SLOTS // BLOCK_M] = the expert of
        each tile, -1 for tiles past the last group. Program g < E writes expert g's slots and tiles (its run
        starts after the padded counts of experts < g, which every program counts alike, CHUNK pairs at a
        time); program E fills the slots and tiles past the last run. No [E, P] tensor in registers: the first
        version, one program holding [128 experts x 512 pairs], is the likely reason every tile config took
        ~580 us a block at 64 tokens in the H200 sweep against ~282 at 32 (not measured per kernel)."""
        g = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, P, CHUNK):
            c = p0 + tl.arange(0, CHUNK)
            chunk = tl.load(ids_ptr + c, mask=c < P, other=-1)
            counts += tl.sum((chunk[None, :] == e[:, None]).to(tl.int32), axis=1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if g < E:
            start = tl.sum(tl.where(e < g, padded, 0))
            count = tl.sum(tl.where(e == g, counts, 0))
            size = tl.sum(tl.where(e == g, padded, 0))
            p = tl.arange(0, BLOCK_P)
            live = p < P
            hit = (tl.load(ids_ptr + p, mask=live, other=-1) == g) & live
            before = tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(sorted_ptr + start + before, p, mask=hit)
            pad = tl.arange(0, BLOCK_M)
            tl.store(sorted_ptr + start + count + pad, tl.full([BLOCK_M], -1, tl.int32), mask=count + pad < size)
            tiles = tl.arange(0, BLOCK_T)
            tl.store(tile_expert_ptr + start // BLOCK_M + tiles, tl.full([BLOCK_T], 0, tl.int32) + g,
                     mask=tiles * BLOCK_M < size)
        else:   # the tail, TAIL slots at a time (CHUNK shrinks with E: 4 at 1024 experts)
            end = tl.sum(padded)
            for s0 in range(end, SLOTS, TAIL):
                s = s0 + tl.arange(0, TAIL)
                tl.store(sorted_ptr + s, tl.full([TAIL], -1, tl.int32), mask=s < SLOTS)
            for t0 in range(end // BLOCK_M, SLOTS // BLOCK_M, TAIL):
                t = t0 + tl.arange(0, TAIL)
                tl.store(tile_expert_ptr + t, tl.full([TAIL], -1, tl.int32), mask=t < SLOTS // BLOCK_M)

    @triton.jit
    def _grouped_gate_up_kernel(x_ptr, gu_ptr, gub_ptr, sorted_ptr, tile_expert_ptr, act_ptr, H, I, stride_x,
                                ALPHA, LIMIT, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, OSS: tl.constexpr, DOT: tl.constexpr):
        """Grid (tiles, N tiles of I): act[pair, n] = silu(x @ Wg[e].T) * (x @ Wu[e].T), rounded as HF; OSS:
        gpt-oss's [E, H, 2I] weights, the tile's 2 * BLOCK_N interleaved gate/up columns contiguous in each
        weight row, one tl.dot, its biases and clamped SwiGLU (`_oss_swiglu`)."""
        t = tl.program_id(0)
        nt = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + t)
        if expert >= 0:
            out_ty = x_ptr.dtype.element_ty
            pairs = tl.load(sorted_ptr + t * BLOCK_M + tl.arange(0, BLOCK_M))
            real = pairs >= 0
            rows = tl.where(real, pairs // TOPK, 0)
            n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < I
            base = gu_ptr + expert.to(tl.int64) * (2 * I * H)
            if OSS:
                c = nt * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)   # gate 0, up 0, gate 1, up 1, ...
                cmask = c < 2 * I
                acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    kmask = k < H
                    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                                mask=real[:, None] & kmask[None, :], other=0.0)
                    w = tl.load(base + k[:, None].to(tl.int64) * (2 * I) + c[None, :],
                                mask=kmask[:, None] & cmask[None, :], other=0.0)                    # [K, 2N]
                    acc = tl.dot(x, w, acc, input_precision=DOT)
                bias = tl.load(gub_ptr + expert.to(tl.int64) * (2 * I) + c, mask=cmask, other=0.0).to(tl.float32)
                g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
                gb, ub = tl.split(tl.reshape(bias, [BLOCK_N, 2]))
                act = _oss_swiglu(g, u, gb[None, :], ub[None, :], ALPHA, LIMIT, out_ty)
            else:
                g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    kmask = k < H
                    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                                mask=real[:, None] & kmask[None, :], other=0.0)
                    wmask = kmask[:, None] & nmask[None, :]
                    wg = tl.load(base + n[None, :].to(tl.int64) * H + k[:, None], mask=wmask, other=0.0)   # [K, N]
                    wu = tl.load(base + (I + n[None, :]).to(tl.int64) * H + k[:, None], mask=wmask, other=0.0)
                    g = tl.dot(x, wg, g, input_precision=DOT)
                    u = tl.dot(x, wu, u, input_precision=DOT)
                g = g.to(out_ty).to(tl.float32)
                u = u.to(out_ty).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
                act = (a * u).to(out_ty)
            tl.store(act_ptr + pairs[:, None].to(tl.int64) * I + n[None, :], act, mask=real[:, None] & nmask[None, :])

    @triton.jit
    def _grouped_down_kernel(act_ptr, d_ptr, db_ptr, wts_ptr, sorted_ptr, tile_expert_ptr, y_ptr, H, I,
                             W_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, OSS: tl.constexpr, DOT: tl.constexpr):
        """Grid (tiles, N tiles of H): y[pair, n] = round(act[pair] @ Wd[e].T) * weight[pair] (rounded
        unless W_F32, whose y is float32); OSS: gpt-oss's [E, I, H] weights and its bias, added to the rounded
        product and rounded."""
        t = tl.program_id(0)
        nt = tl.program_id(1)
        expert = tl.load(tile_expert_ptr + t)
        if expert >= 0:
            out_ty = act_ptr.dtype.element_ty
            pairs = tl.load(sorted_ptr + t * BLOCK_M + tl.arange(0, BLOCK_M))
            real = pairs >= 0
            safe = tl.where(real, pairs, 0)
            n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < H
            base = d_ptr + expert.to(tl.int64) * (H * I)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < I
                a = tl.load(act_ptr + safe[:, None].to(tl.int64) * I + k[None, :], mask=real[:, None] & kmask[None, :],
                            other=0.0)
                if OSS:
                    w = tl.load(base + k[:, None].to(tl.int64) * H + n[None, :], mask=kmask[:, None] & nmask[None, :],
                                other=0.0)
                else:
                    w = tl.load(base + n[None, :].to(tl.int64) * I + k[:, None], mask=kmask[:, None] & nmask[None, :],
                                other=0.0)
                acc = tl.dot(a, w, acc, input_precision=DOT)
            y = acc.to(out_ty).to(tl.float32)
            if OSS:
                bias = tl.load(db_ptr + expert.to(tl.int64) * H + n, mask=nmask, other=0.0).to(tl.float32)
                y = (y + bias[None, :]).to(out_ty).to(tl.float32)
            weight = tl.load(wts_ptr + safe, mask=real, other=0.0)
            y = y * weight[:, None]
            if not W_F32:
                y = y.to(out_ty).to(tl.float32)
            tl.store(y_ptr + safe[:, None].to(tl.int64) * H + n[None, :], y, mask=real[:, None] & nmask[None, :])


def align(ids, order, tile_expert, experts: int, block_m: int) -> None:
    """The align kernel: ids [M, k] -> order [slots] (pair indices by expert, runs padded to block_m with -1)
    and tile_expert [slots // block_m] (each tile's expert, -1 past the last run)."""
    m, top_k = ids.shape
    _align_kernel[(experts + 1,)](ids, order, tile_expert, m * top_k, experts, order.shape[0],
                                  BLOCK_P=next_pow2(m * top_k), BLOCK_E=next_pow2(experts), BLOCK_M=block_m,
                                  BLOCK_T=next_pow2(triton.cdiv(m, block_m)),
                                  CHUNK=max(2, min(128, ALIGN_ELEMENTS // next_pow2(experts))), TAIL=ALIGN_TAIL)


def block_grouped(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32, config=None,
                  intermediates: dict | None = None, oss=None):
    """The grouped kernels (`grouped_from` to 64 tokens; families without a shared expert): x [M, H] -> [M, H]. `oss`, for
    gpt-oss: (router_bias, gate_up_bias, down_bias, alpha, limit), the weights in its layout."""
    m, h = x.shape
    e = gate_up.shape[0]
    i = (gate_up.shape[2] if oss else gate_up.shape[1]) // 2
    router_bias, gate_up_bias, down_bias, alpha, limit = oss or (None, gate_up, down, 0.0, 0.0)
    tune = tuning.current(x.device)
    cfg = config or grouped_config(m, tune, x.element_size())
    dev = x.device
    pairs = m * top_k
    slots = grouped_slots(pairs, e, cfg.block_m)
    ids = torch.empty(m, top_k, device=dev, dtype=torch.int32)
    weights = torch.empty(m, top_k, device=dev, dtype=torch.float32)
    order = torch.empty(slots, device=dev, dtype=torch.int32)
    tile_expert = torch.empty(slots // cfg.block_m, device=dev, dtype=torch.int32)
    act = torch.empty(pairs, i, device=dev, dtype=x.dtype)
    y = torch.empty(pairs, h, device=dev, dtype=torch.float32)
    out = torch.empty(m, h, device=dev, dtype=x.dtype)
    logits = _logits(x, router_weight, None, router_bias, e, experts_config(h, i, tune=tune))
    _route_kernel[(m,)](logits, ids, weights, e, logits.stride(0), TOPK=top_k, BLOCK_TOPK=next_pow2(top_k),
                        BLOCK_E=next_pow2(e), NORM=norm_topk, W_F32=weights_f32, OSS=oss is not None)
    align(ids, order, tile_expert, e, cfg.block_m)
    tiles = slots // cfg.block_m
    _grouped_gate_up_kernel[(tiles, triton.cdiv(i, cfg.block_n))](
        x, gate_up, gate_up_bias, order, tile_expert, act, h, i, x.stride(0), float(alpha), float(limit), TOPK=top_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OSS=oss is not None, DOT=dot_precision(x.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages)
    _grouped_down_kernel[(tiles, triton.cdiv(h, cfg.block_n))](
        act, down, down_bias, weights, order, tile_expert, y, h, i, W_F32=weights_f32, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OSS=oss is not None, DOT=dot_precision(x.dtype), num_warps=cfg.warps,
        num_stages=cfg.stages)
    _combine_kernel[(triton.cdiv(h, cfg.block_n), m)](y, out, h, out.stride(0), TOPK=top_k, BLOCK_N=cfg.block_n)
    if intermediates is not None:
        intermediates.update(logits=logits, ids=ids, weights=weights, act=act, order=order, tile_expert=tile_expert)
    return out
