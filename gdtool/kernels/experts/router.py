"""The router kernel (logits, and at one token the rows' routing: `Config.routed`) and the top-k routing every
path shares: in the router kernel, per (row, expert) pair of the small gate/up kernels (`_pair_route`), and per
row in the grouped path's route kernel. Softmax in float32, top-k (ties to the lower expert id), renormalized
where the router does; gpt-oss's top-k of the logits, then a softmax over the k (`OSS`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemv import early_norm
from ..triton import HAVE_TRITON, launch_options, next_pow2, tl, triton, zero_counts
from .tiles import Config, _chunks

if HAVE_TRITON:
    from ..gemv import _scale_norm   # RMSNorm's roundings, one definition for every kernel that folds it in

if HAVE_TRITON:
    @triton.jit
    def _router_kernel(x_ptr, g_ptr, w_ptr, ws_ptr, b_ptr, logits_ptr, ids_ptr, wts_ptr, rstd_ptr, count_ptr,
                       H, E, stride_x, stride_l, eps,
                       SHARED: tl.constexpr, BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       CHUNKS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, ROUTE: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr,
                       W_F32: tl.constexpr, PACKED: tl.constexpr = False, EARLY: tl.constexpr = False,
                       EARLY_NORM: tl.constexpr = False):
        """logits[m, n] for a tile of n: rows of the router weight, and (SHARED) the shared-expert gate
        as row E; one x row per program (grid: tiles, rows). BIAS (gpt-oss): the bias added before the one
        rounding, as cuBLAS's bias epilogue of F.linear does. NORM (the fast forward): x is RMSNorm'd first
        (`_x_chunk`). PDL (as the small gate/up and down kernels): launched early, it waits for the kernel
        before it first (`triton.py`). ROUTE (`Config.routed`): the last of a row's programs to finish routes
        the row from the stored logits (`_store_route`: ids and weights, as `_route_kernel`) and stores the
        row's rstd (NORM), so that the programs of gate/up read them instead of each routing the row. PACKED
        (`Config.packed`): that routing's top-k one reduction a round (`_top_packed`). EARLY
        (`Config.router_early`): the first chunk of the program's weight rows loaded before the PDL wait, as the
        dense products load theirs (weights are never written during a step). EARLY_NORM (`gemv.early_norm`): the
        norm's weights of the first chunk too."""
        t = tl.program_id(0)
        m = tl.program_id(1)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if EARLY:
            first = _router_rows(w_ptr, ws_ptr, n, tl.arange(0, BLOCK_K), H, E, SHARED)
        g0 = _first_norm_weights(g_ptr, H, BLOCK_K, NORM and EARLY_NORM)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        rstd = _row_rstd(x_ptr + m * stride_x, H, eps, BLOCK_K, CHUNKS, NORM)
        for c in tl.static_range(CHUNKS):
            k = c * BLOCK_K + tl.arange(0, BLOCK_K)
            if EARLY and c == 0:
                w = first
            else:
                w = _router_rows(w_ptr, ws_ptr, n, k, H, E, SHARED)
            x = _x_chunk(x_ptr + m * stride_x, g_ptr, k, H, rstd, NORM, g0, EARLY_NORM and c == 0)
            acc += tl.sum(x[None, :].to(tl.float32) * w.to(tl.float32), axis=1)
        if BIAS:
            acc += tl.load(b_ptr + n, mask=n < E, other=0.0).to(tl.float32)
        tl.store(logits_ptr + m * stride_l + n, acc.to(x_ptr.dtype.element_ty), mask=n < E + SHARED)
        if ROUTE:
            # as the fused attention combine: every thread's stores done (the barrier), then one acq_rel count;
            # the last program sees the others' logits (read from L2) and sets the count back to 0
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + m, 1, sem="acq_rel")
            if done == tl.num_programs(0) - 1:
                tl.store(count_ptr + m, 0)
                _store_route(logits_ptr, ids_ptr, wts_ptr, m, stride_l, E, TOPK, BLOCK_TOPK, BLOCK_E, RENORM, W_F32,
                             False, True, PACKED)
                if NORM:
                    tl.store(rstd_ptr + m, rstd)

    @triton.jit
    def _router_rows(w_ptr, ws_ptr, n, k, H, E, SHARED: tl.constexpr):
        """[BLOCK_N, BLOCK_K] of the router's weight: rows n, elements k; row E the shared expert's gate (SHARED)."""
        kmask = k[None, :] < H
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * H + k[None, :], mask=(n[:, None] < E) & kmask, other=0.0)
        if SHARED:
            ws = tl.load(ws_ptr + k[None, :] + 0 * n[:, None], mask=(n[:, None] == E) & kmask, other=0.0)
            w = tl.where(n[:, None] == E, ws, w)
        return w

    @triton.jit
    def _row_rstd(x_ptr, H, eps, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, NORM: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of the row at x_ptr in float32, as RMSNorm computes it (NORM; else 1)."""
        total = 0.0
        if NORM:
            for c in tl.static_range(CHUNKS):
                k = c * BLOCK_K + tl.arange(0, BLOCK_K)
                xf = tl.load(x_ptr + k, mask=k < H, other=0.0).to(tl.float32)
                total += tl.sum(xf * xf, axis=0)
        return tl.rsqrt(total / H + eps) if NORM else 1.0

    @triton.jit
    def _x_chunk(x_ptr, g_ptr, k, H, rstd, NORM: tl.constexpr, g_pre, PRE: tl.constexpr):
        """The row's elements k as the block reads them: RMSNorm'd with weight g and Llama's roundings
        (`gemv._scale_norm`) where NORM (the norm before the block, folded in), else as they are. PRE: the
        norm's weights at k are g_pre (`_first_norm_weights`, loaded before the wait), not loaded here."""
        x = tl.load(x_ptr + k, mask=k < H, other=0.0)
        if NORM:
            if PRE:
                g = g_pre
            else:
                g = tl.load(g_ptr + k, mask=k < H, other=0.0)
            x = _scale_norm(x.to(tl.float32), rstd, g, x.dtype, False)
        return x

    @triton.jit
    def _first_norm_weights(g_ptr, H, BLOCK_K: tl.constexpr, ON: tl.constexpr):
        """The norm's weights of the first chunk of H (ON: for `_x_chunk`'s PRE, loaded before the PDL wait), else 0."""
        g = 0.0
        if ON:
            k = tl.arange(0, BLOCK_K)
            g = tl.load(g_ptr + k, mask=k < H, other=0.0)
        return g

    @triton.jit
    def _route(logits_ptr, m, stride_l, E, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
               BLOCK_E: tl.constexpr, NORM: tl.constexpr, OSS: tl.constexpr, FROM_L2: tl.constexpr = False,
               PACKED: tl.constexpr = False):
        """Row m's routing from its logits, as HF's router: softmax in float32, the k largest (ties: lower
        id first), renormalized (NORM); or (OSS, gpt-oss) the k largest logits, then a float32 softmax over
        those k. Returns (ids [BLOCK_TOPK] int32, weights [BLOCK_TOPK] float32). FROM_L2: the logits read past
        L1 (.cg), where other programs of the same kernel stored them. PACKED (softmax first only): the k
        largest by one reduction a round over packed keys (`_top_packed`), the same ids and values."""
        e = tl.arange(0, BLOCK_E)
        live = e < E
        if FROM_L2:
            logits = tl.load(logits_ptr + m * stride_l + e, mask=live, other=float("-inf"),
                             cache_modifier=".cg").to(tl.float32)
        else:
            logits = tl.load(logits_ptr + m * stride_l + e, mask=live, other=float("-inf")).to(tl.float32)
        if OSS:
            ids, values = _route_topk_first(logits, live, e, TOPK, BLOCK_TOPK, BLOCK_E)
        else:
            ids, values = _route_softmax_first(logits, live, e, TOPK, BLOCK_TOPK, BLOCK_E, NORM, PACKED)
        return ids, values

    @triton.jit
    def _route_softmax_first(logits, live, e, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr,
                             NORM: tl.constexpr, PACKED: tl.constexpr = False):
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = p / tl.sum(p, axis=0)
        if PACKED:
            ids, values = _top_packed(p, live, e, TOPK, BLOCK_TOPK, BLOCK_E)
        else:
            p = tl.where(live, p, -1.0)
            slots = tl.arange(0, BLOCK_TOPK)
            ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
            values = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                best = tl.max(p, axis=0)
                pick = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
                ids = tl.where(slots == j, pick, ids)
                values = tl.where(slots == j, best, values)
                p = tl.where(e == pick, -2.0, p)
        if NORM:
            values = values / tl.sum(values, axis=0)
        return ids, values

    @triton.jit
    def _top_packed(p, live, e, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
        """(ids, values) [BLOCK_TOPK] of the TOPK largest of the live probabilities p (>= 0, not -0.0: a softmax's),
        largest first, ties to the lower id: what k rounds of a max and a lowest-id min pick, by one max a round.
        A non-negative float32's bits order as its value does, so each live p is the key (bits << 32) | (BLOCK_E -
        1 - id) (the lower id the larger key among equal p) and the round's max holds both the value and the id;
        a dead or picked slot's key is -1, below every live one."""
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(live, (bits << 32) | (BLOCK_E - 1 - e).to(tl.int64), -1)
        slots = tl.arange(0, BLOCK_TOPK)
        ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
        values = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            best = tl.max(key, axis=0)
            pick = BLOCK_E - 1 - (best.to(tl.int32) & (BLOCK_E - 1))   # the low word: BLOCK_E - 1 - id
            ids = tl.where(slots == j, pick, ids)
            values = tl.where(slots == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), values)
            key = tl.where(e == pick, -1, key)
        return ids, values

    @triton.jit
    def _route_topk_first(logits, free, e, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
        slots = tl.arange(0, BLOCK_TOPK)
        ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
        values = tl.full([BLOCK_TOPK], float("-inf"), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            best = tl.max(tl.where(free, logits, float("-inf")), axis=0)
            pick = tl.min(tl.where(free & (logits == best), e, BLOCK_E), axis=0)
            ids = tl.where(slots == j, pick, ids)
            values = tl.where(slots == j, best, values)
            free = free & (e != pick)
        p = tl.exp(values - tl.max(values, axis=0))   # slots >= TOPK hold -inf: weight 0
        return ids, p / tl.sum(p, axis=0)

    @triton.jit
    def _route_kernel(logits_ptr, ids_ptr, wts_ptr, E, stride_l,
                      TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                      W_F32: tl.constexpr, OSS: tl.constexpr):
        """Grid (M,): row m's expert ids and routing weights (`_store_route`)."""
        _store_route(logits_ptr, ids_ptr, wts_ptr, tl.program_id(0), stride_l, E, TOPK, BLOCK_TOPK, BLOCK_E, NORM,
                     W_F32, OSS, False)

    @triton.jit
    def _store_route(logits_ptr, ids_ptr, wts_ptr, m, stride_l, E, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                     BLOCK_E: tl.constexpr, NORM: tl.constexpr, W_F32: tl.constexpr, OSS: tl.constexpr,
                     FROM_L2: tl.constexpr, PACKED: tl.constexpr = False):
        """Row m's expert ids and routing weights (rounded to the model dtype unless W_F32; OSS: gpt-oss's
        routing; PACKED: `_top_packed`'s top-k), stored at ids[m, :TOPK], wts[m, :TOPK]."""
        ids, values = _route(logits_ptr, m, stride_l, E, TOPK, BLOCK_TOPK, BLOCK_E, NORM, OSS, FROM_L2, PACKED)
        if not W_F32:   # rounded to the model dtype, the logits'
            values = values.to(logits_ptr.dtype.element_ty).to(tl.float32)
        slots = tl.arange(0, BLOCK_TOPK)
        tl.store(ids_ptr + m * TOPK + slots, ids, mask=slots < TOPK)
        tl.store(wts_ptr + m * TOPK + slots, values, mask=slots < TOPK)

    @triton.jit
    def _pair_route(logits_ptr, ids_ptr, wts_ptr, p, t, m, stride_l, E, out_ty: tl.constexpr, TOPK: tl.constexpr,
                    BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr, W_F32: tl.constexpr,
                    OSS: tl.constexpr):
        """Pair p's expert (row m, its (p % TOPK)-th), from the row's routing; the programs of tile t == 0 also
        write the pair's expert id and routing weight (rounded to the model dtype unless W_F32) for the down
        kernel."""
        ids, values = _route(logits_ptr, m, stride_l, E, TOPK, BLOCK_TOPK, BLOCK_E, NORM, OSS)
        mine = tl.arange(0, BLOCK_TOPK) == p % TOPK
        expert = tl.sum(tl.where(mine, ids, 0), axis=0)
        if t == 0:
            weight = tl.sum(tl.where(mine, values, 0.0), axis=0)
            if not W_F32:
                weight = weight.to(out_ty).to(tl.float32)
            tl.store(ids_ptr + p, expert)
            tl.store(wts_ptr + p, weight)
        return expert


@dataclass(frozen=True)
class Routing:
    """Where the router kernel stores the rows' routing (`Config.routed`): ids [M, k] int32, weights [M, k] float32
    (rounded to the model dtype unless weights_f32), rstd [M] float32 (the norm's, where the router folds it)."""
    ids: torch.Tensor
    weights: torch.Tensor
    rstd: torch.Tensor
    top_k: int
    norm_topk: bool
    weights_f32: bool


def _logits(x, router_weight, shared_router, router_bias, e: int, cfg: Config, norm=None,
            route: Routing | None = None) -> torch.Tensor:
    """The router kernel: logits [M, E (+ 1: the shared expert's gate)], rounded as F.linear rounds them (of
    RMSNorm(x) where norm=(weight, eps)); route given, the rows' routing too, stored where it says."""
    m, h = x.shape
    shared = shared_router is not None
    logits = torch.empty(m, e + shared, device=x.device, dtype=x.dtype)
    block_h, chunks_h = _chunks(h)
    norm_weight, eps = norm or (x, 0.0)
    r = route or Routing(logits, logits, logits, 1, False, False)
    _router_kernel[(triton.cdiv(e + shared, cfg.router_rows), m)](
        x, norm_weight, router_weight, shared_router if shared else router_weight,
        router_bias if router_bias is not None else router_weight, logits, r.ids, r.weights, r.rstd,
        zero_counts("router", m, x.device) if route else logits, h, e, x.stride(0), logits.stride(0),
        float(eps), SHARED=shared, BIAS=router_bias is not None, BLOCK_N=cfg.router_rows, BLOCK_K=block_h,
        CHUNKS=chunks_h, NORM=norm is not None, ROUTE=route is not None, TOPK=r.top_k,
        BLOCK_TOPK=next_pow2(r.top_k), BLOCK_E=next_pow2(e), RENORM=r.norm_topk, W_F32=r.weights_f32,
        PACKED=cfg.packed and route is not None, EARLY=cfg.router_early,
        EARLY_NORM=norm is not None and early_norm(x.device), num_warps=cfg.router_warps or cfg.warps,
        **launch_options(x.device, _nbytes(router_weight)))
    return logits


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _routed_bytes(m: int, top_k: int, weight) -> int:
    """The bytes of `weight` [E, ...] a step's routed experts read at most: min(M * k, E) experts' slices (what
    `launch_options`' PDL setting weighs)."""
    return min(m * top_k, weight.shape[0]) * _nbytes(weight) // weight.shape[0]
