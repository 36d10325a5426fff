"""The small-batch kernels, up to MAX_TOKENS tokens a step: the router kernel, then gate/up over the routed
experts' rows only (silu(gate) * up per (row, k-th expert, tile)), then down summed over the k experts in
routing order (Qwen2-MoE's shared expert added last; the layer's residual where the fast forward asks).
Three launches per block, no host sync, no float atomics."""
from __future__ import annotations

import torch

from ..triton import HAVE_TRITON, launch_options, next_pow2, tl, triton
from .oss import block_oss
from .router import Routing, _logits, _nbytes, _routed_bytes
from .. import tuning
from .tiles import _chunks, experts_config

if HAVE_TRITON:
    from .router import _pair_route, _row_rstd, _x_chunk

if HAVE_TRITON:
    # sizes that both branches of the routed/shared `if` hold must stay runtime integers (Triton would make
    # a 1, e.g. M at batch 1, a constant, and the branches' types would differ)
    @triton.jit(do_not_specialize=["M", "I", "IS"])
    def _gate_up_kernel(x_ptr, g_ptr, logits_ptr, gu_ptr, sg_ptr, su_ptr, act_ptr, sact_ptr, ids_ptr, wts_ptr,
                        rstd_ptr, M, H, E, I, IS, stride_x, stride_l, eps,
                        TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                        W_F32: tl.constexpr, SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, X_NORM: tl.constexpr, PDL: tl.constexpr,
                        ROUTED: tl.constexpr):
        """Grid (tiles of the intermediate dim, M * TOPK routed pairs [+ M shared]): silu(gate) * up for
        one pair's tile. Pair p < M * TOPK is (row p // TOPK, its (p % TOPK)-th expert). NORM: the router's
        renormalization; X_NORM: x RMSNorm'd first, as the router kernel reads it. ROUTED: the router kernel
        routed the rows and stored their rstd (`Config.routed`): a program loads its expert id and the row's
        rstd instead of computing them. The norm's weights load after the wait, beside the expert's weights that
        depend on it (loaded before it, they cost registers: 80 -> 106 at one token, sm_90, ptxas)."""
        t = tl.program_id(0)
        p = tl.program_id(1)
        if PDL:   # which weights to read depends on the router's logits: nothing to load before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        out_ty = x_ptr.dtype.element_ty
        k = tl.arange(0, BLOCK_K)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if p < M * TOPK:
            m = p // TOPK
            if ROUTED:
                expert = tl.load(ids_ptr + p)
            else:
                expert = _pair_route(logits_ptr, ids_ptr, wts_ptr, p, t, m, stride_l, E, out_ty, TOPK, BLOCK_TOPK,
                                     BLOCK_E, NORM, W_F32, False)
            rows = I
            gate = gu_ptr + expert.to(tl.int64) * (2 * I * H) + n[:, None].to(tl.int64) * H + k[None, :]  # [gate; up]
            up = gate + I * H
            out = act_ptr + p.to(tl.int64) * I + n
        else:
            m = p - M * TOPK
            rows = IS
            gate = sg_ptr + n[:, None].to(tl.int64) * H + k[None, :]
            up = su_ptr + n[:, None].to(tl.int64) * H + k[None, :]
            out = sact_ptr + m.to(tl.int64) * IS + n
        nmask = n < rows
        g = tl.zeros([BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_N], dtype=tl.float32)
        if ROUTED and X_NORM:
            rstd = tl.load(rstd_ptr + m)
        else:
            rstd = _row_rstd(x_ptr + m * stride_x, H, eps, BLOCK_K, CHUNKS, X_NORM)
        for c in tl.static_range(CHUNKS):
            k = c * BLOCK_K + tl.arange(0, BLOCK_K)
            kmask = nmask[:, None] & (k[None, :] < H)
            wg = tl.load(gate + c * BLOCK_K, mask=kmask, other=0.0)
            wu = tl.load(up + c * BLOCK_K, mask=kmask, other=0.0)
            x = _x_chunk(x_ptr + m * stride_x, g_ptr, k, H, rstd, X_NORM, 0.0, False).to(tl.float32)[None, :]
            g += tl.sum(x * wg.to(tl.float32), axis=1)
            u += tl.sum(x * wu.to(tl.float32), axis=1)
        g = g.to(out_ty).to(tl.float32)
        u = u.to(out_ty).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)   # F.silu, rounded
        tl.store(out, (a * u).to(out_ty), mask=nmask)

    @triton.jit
    def _rows_dot(w_ptr, a_ptr, n, nmask, K, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr):
        """float32 [BLOCK_N]: rows n of a [*, K] weight at w_ptr against the vector at a_ptr, in chunks."""
        acc = tl.zeros(n.shape, dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            i = c * BLOCK_K + tl.arange(0, BLOCK_K)
            imask = i < K
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + i[None, :], mask=nmask[:, None] & imask[None, :],
                        other=0.0)
            a = tl.load(a_ptr + i, mask=imask, other=0.0).to(tl.float32)
            acc += tl.sum(a[None, :] * w.to(tl.float32), axis=1)
        return acc

    @triton.jit
    def _down_kernel(act_ptr, sact_ptr, ids_ptr, wts_ptr, logits_ptr, d_ptr, sd_ptr, res_ptr, out_ptr,
                     H, I, IS, E, stride_l, stride_res, stride_out,
                     TOPK: tl.constexpr, W_F32: tl.constexpr, SHARED: tl.constexpr, RESIDUAL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_IS: tl.constexpr,
                     CHUNKS_S: tl.constexpr, PDL: tl.constexpr, STACKED: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                     EARLY: tl.constexpr = False):
        """Grid (tiles of the hidden dim, M rows): the routed experts' down products, weighted and summed in
        routing order (float32, rounded once), plus the gated shared expert; RESIDUAL (the fast forward): the
        decoder layer's residual added to that, rounded once, as HF's `residual + hidden_states`. STACKED
        (`Config.stacked`): the k experts' tiles as one [k, rows, chunk] load and one sum per chunk, instead
        of one expert after the other (`_stacked_down`); EARLY (`Config.down_early`, stacked and routed): its
        routing and first weight tiles loaded before the PDL wait."""
        t = tl.program_id(0)
        m = tl.program_id(1)
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < H
        if PDL and not (STACKED and EARLY):
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        out_ty = out_ptr.dtype.element_ty
        if STACKED:
            acc = _stacked_down(act_ptr, ids_ptr, wts_ptr, d_ptr, m, n, nmask, H, I, out_ty, TOPK, BLOCK_TOPK, W_F32,
                                BLOCK_N, BLOCK_I, CHUNKS, EARLY, PDL)
        else:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(TOPK):
                expert = tl.load(ids_ptr + m * TOPK + j)
                weight = tl.load(wts_ptr + m * TOPK + j)
                y = _rows_dot(d_ptr + expert.to(tl.int64) * H * I, act_ptr + (m * TOPK + j).to(tl.int64) * I, n, nmask,
                              I, BLOCK_I, CHUNKS)
                y = y.to(out_ty).to(tl.float32)
                if W_F32:   # bf16 product times float32 weights: float32, unrounded (Mixtral)
                    acc += y * weight
                else:
                    acc += (y * weight).to(out_ty).to(tl.float32)
        out = acc.to(out_ty)
        if SHARED:
            ys = _rows_dot(sd_ptr, sact_ptr + m.to(tl.int64) * IS, n, nmask, IS, BLOCK_IS, CHUNKS_S)
            ys = ys.to(out_ty).to(tl.float32)
            g = tl.load(logits_ptr + m * stride_l + E).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
            shared = (gate * ys).to(out_ty).to(tl.float32)
            out = (out.to(tl.float32) + shared).to(out_ty)
        if RESIDUAL:
            out = (tl.load(res_ptr + m * stride_res + n, mask=nmask, other=0.0).to(tl.float32)
                   + out.to(tl.float32)).to(out_ty)
        tl.store(out_ptr + m * stride_out + n, out, mask=nmask)

    @triton.jit
    def _stacked_down(act_ptr, ids_ptr, wts_ptr, d_ptr, m, n, nmask, H, I, out_ty: tl.constexpr, TOPK: tl.constexpr,
                      BLOCK_TOPK: tl.constexpr, W_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                      CHUNKS: tl.constexpr, EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
        """float32 [BLOCK_N]: row m's k down products over rows n, each rounded and weighted as the loop of
        `_down_kernel` rounds it, summed in routing order. The k experts' weight tiles are one [k, rows, chunk]
        load and one sum per chunk, so every expert's loads are in flight at once; the sum over the k is then
        taken one expert at a time (each column of `part` picked whole: adding zeros is exact).
        EARLY: the routing and the first 4 chunks of weight tiles are loaded before the PDL wait (PDL),
        the activations after it. The router kernel wrote the routing two kernels back; under PDL this kernel
        starts only once every block of gate/up has passed its own wait, so once the router has ended (its
        stores read past L1, .cg, as the fused combine reads its partials)."""
        j = tl.arange(0, BLOCK_TOPK)
        jmask = j < TOPK
        if EARLY:
            experts = tl.load(ids_ptr + m * TOPK + j, mask=jmask, other=0, cache_modifier=".cg")
            weights = tl.load(wts_ptr + m * TOPK + j, mask=jmask, other=0.0, cache_modifier=".cg")
        else:
            experts = tl.load(ids_ptr + m * TOPK + j, mask=jmask, other=0)
            weights = tl.load(wts_ptr + m * TOPK + j, mask=jmask, other=0.0)
        w_rows = (experts.to(tl.int64) * H * I)[:, None, None] + n[None, :, None].to(tl.int64) * I   # [k, rows, 1]
        a_rows = ((m * TOPK + j).to(tl.int64) * I)[:, None, None]                                  # [k, 1, 1]
        live = jmask[:, None, None] & nmask[None, :, None]
        if EARLY:   # up to 4 chunks held before the wait (each an unrolled name: Triton holds no lists)
            w0 = _down_tile(d_ptr, w_rows, live, I, 0, BLOCK_I)
            w1 = w0
            w2 = w0
            w3 = w0
            if CHUNKS > 1:
                w1 = _down_tile(d_ptr, w_rows, live, I, 1, BLOCK_I)
            if CHUNKS > 2:
                w2 = _down_tile(d_ptr, w_rows, live, I, 2, BLOCK_I)
            if CHUNKS > 3:
                w3 = _down_tile(d_ptr, w_rows, live, I, 3, BLOCK_I)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
        y = tl.zeros([BLOCK_TOPK, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(CHUNKS):
            i = (c * BLOCK_I + tl.arange(0, BLOCK_I))[None, None, :]
            if EARLY and c == 0:
                w = w0
            elif EARLY and c == 1:
                w = w1
            elif EARLY and c == 2:
                w = w2
            elif EARLY and c == 3:
                w = w3
            else:
                w = _down_tile(d_ptr, w_rows, live, I, c, BLOCK_I)
            a = tl.load(act_ptr + a_rows + i, mask=jmask[:, None, None] & (i < I), other=0.0)
            y += tl.sum(a.to(tl.float32) * w.to(tl.float32), axis=2)
        y = y.to(out_ty).to(tl.float32)
        if W_F32:   # bf16 product times float32 weights: float32, unrounded (Mixtral)
            part = y * weights[:, None]
        else:
            part = (y * weights[:, None]).to(out_ty).to(tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for jj in tl.static_range(TOPK):
            acc += tl.sum(tl.where(j[:, None] == jj, part, 0.0), axis=0)
        return acc

    @triton.jit
    def _down_tile(d_ptr, w_rows, live, I, c: tl.constexpr, BLOCK_I: tl.constexpr):
        """Chunk c of the k experts' down weight rows: [k, rows, BLOCK_I]."""
        i = (c * BLOCK_I + tl.arange(0, BLOCK_I))[None, None, :]
        return tl.load(d_ptr + w_rows + i, mask=live & (i < I), other=0.0)


def block_triton(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32,
                 shared_gate=None, shared_up=None, shared_down=None, shared_router=None, oss=None, config=None,
                 intermediates: dict | None = None, residual=None, norm=None):
    """The three kernels: x [M, H] -> [M, H] (residual [M, H]: residual + that, the add in the down kernel;
    norm=(weight, eps): the block of RMSNorm(x), the norm in the router and gate/up kernels).
    `oss`, for gpt-oss: (router_bias, gate_up_bias, down_bias, alpha, limit), the weights in gpt-oss's layout
    (its own gate/up and down kernels, `block_oss`; `config` an OssConfig there; no residual). `intermediates`,
    when given, receives the logits, expert ids, routing weights and activations (what the tests compare)."""
    if oss is not None:
        if residual is not None or norm is not None:
            raise ValueError("block_oss takes no residual or norm (gpt-oss's layers are not in the fast forward)")
        return block_oss(x, router_weight, gate_up, down, top_k, *oss, config=config, intermediates=intermediates)
    m, h = x.shape
    e = gate_up.shape[0]
    i = gate_up.shape[1] // 2
    shared = shared_gate is not None
    i_shared = shared_gate.shape[0] if shared else 1
    cfg = config or experts_config(h, i, m, tuning.current(x.device))
    dev = x.device
    ids = torch.empty(m, top_k, device=dev, dtype=torch.int32)
    weights = torch.empty(m, top_k, device=dev, dtype=torch.float32)
    act = torch.empty(m * top_k, i, device=dev, dtype=x.dtype)
    shared_act = torch.empty(m, i_shared, device=dev, dtype=x.dtype) if shared else act
    out = torch.empty(m, h, device=dev, dtype=x.dtype)
    rstd = torch.empty(m, device=dev, dtype=torch.float32) if cfg.routed else weights
    route = Routing(ids, weights, rstd, top_k, norm_topk, weights_f32) if cfg.routed else None
    logits = _logits(x, router_weight, shared_router if shared else None, None, e, cfg, norm, route)
    block_h, chunks_h = _chunks(h, cfg.chunk)
    tiles = triton.cdiv(max(i, i_shared if shared else 1), cfg.gate_up_rows)
    norm_weight, eps = norm or (x, 0.0)
    _gate_up_kernel[(tiles, m * top_k + (m if shared else 0))](
        x, norm_weight, logits, gate_up, shared_gate if shared else gate_up, shared_up if shared else gate_up, act,
        shared_act, ids, weights, rstd, m, h, e, i, i_shared, x.stride(0), logits.stride(0), float(eps),
        TOPK=top_k, BLOCK_TOPK=next_pow2(top_k), BLOCK_E=next_pow2(e), NORM=norm_topk, W_F32=weights_f32,
        SHARED=shared, BLOCK_N=cfg.gate_up_rows, BLOCK_K=block_h, CHUNKS=chunks_h, X_NORM=norm is not None,
        ROUTED=cfg.routed, num_warps=cfg.warps,
        **launch_options(dev, _routed_bytes(m, top_k, gate_up) + (_nbytes(shared_gate, shared_up) if shared else 0)))
    block_i, chunks_i = _chunks(i, cfg.chunk)
    block_s, chunks_s = _chunks(i_shared, cfg.chunk)
    res = residual if residual is not None else out
    _down_kernel[(triton.cdiv(h, cfg.down_rows), m)](
        act, shared_act, ids, weights, logits, down, shared_down if shared else down, res, out,
        h, i, i_shared, e, logits.stride(0), res.stride(0), out.stride(0),
        TOPK=top_k, W_F32=weights_f32, SHARED=shared, RESIDUAL=residual is not None, BLOCK_N=cfg.down_rows,
        BLOCK_I=block_i, CHUNKS=chunks_i, BLOCK_IS=block_s, CHUNKS_S=chunks_s, STACKED=cfg.stacked,
        BLOCK_TOPK=next_pow2(top_k), EARLY=cfg.down_early, num_warps=cfg.down_warps or cfg.warps,
        **launch_options(dev, _routed_bytes(m, top_k, down) + (_nbytes(shared_down) if shared else 0)))
    if intermediates is not None:
        intermediates.update(logits=logits, ids=ids, weights=weights, act=act,
                             shared_act=shared_act if shared else None)
    return out
