"""Matrix-vector products for the decode step at small batch (1-16 rows), at the copy bandwidth.

At batch 1 a decode step is a chain of matrix-vector products: every weight byte is read once and
used for one multiply-add, so the step takes as long as reading the weights does. cuBLAS and
inductor's matmuls run the layers' small products (2048 x 2048 ... 16384 x 2048) at ~3 TB/s on an
H200, against ~4.3 TB/s for a plain copy. The kernels here read each program's weight rows in one
or a few wide tiles (16-byte loads, issued before anything waits), with enough programs to keep
every multiprocessor's loads in flight, and fold in the small operations around the product:

    rms_gemv    y = [RMSNorm](x) @ W.T  [+ bias] [+ residual]  (o, down and lm_head: one kernel each; with a
                                                           bias and neither norm nor residual, any nn.Linear:
                                                           `linear.py`)
    gate_up     a = act(n @ Wg.T) * (n @ Wu.T), n = RMSNorm(x)   (the whole MLP input side; act: SiLU,
                or GELU's tanh form for Gemma)
    qkv_rope    q, k, v = n @ Wq.T, Wk.T, Wv.T [+ biases, Qwen2]; [per-head RMSNorm of q and k, Qwen3,
                Gemma 3: a second kernel, `_qk_norm_rope_kernel`]; RoPE on q and k (angles computed in the
                kernel from the positions, as HF's rotary embedding computes them); k and v written to the
                cache slot
    rms_add     h = residual + RMSNorm(y)                 (Gemma's norms after attention and the MLP: a
                                                           norm over a whole output row. In the forward it is
                                                           folded into the next kernel that reads h, `add=`:
                                                           gate/up, the next qkv_rope, the lm_head's norm; each
                                                           of their programs reads whole input rows anyway, and
                                                           one of them stores h. Its own kernel where K is read
                                                           in chunks)

Two RMSNorms (`plus_one`): Llama's rounds x * rstd to the model dtype, then multiplies by the weight
(rounded again); Gemma's multiplies x * rstd by (1 + weight) in float32 and rounds once. Every norm
above takes either, a flag of the kernel, not a kernel of its own.

Rows: a weight tile, once loaded, serves every batch row; the rows are multiplied in passes of
`ROWS_PER_PASS` (the x rows of a pass re-read from L1/L2, the weights not), so that 8 or 16 rows
cost registers of 4 and extra multiply-adds, not extra weight traffic. How far that pays before a
tensor-core matmul wins is `forward.line_paths`'s question: on the H200 the passes past the first ran
2.7-4x slower than the compiled matmuls, and one pass of 3-4 rows (x's rows in registers) slower than
cuBLAS (profiles/h200/bench/batches/curves.md), so the measured families stop at 1-2 rows.

Each kernel keeps the rounding points of HF's eager module sequence (the product rounded to the
model dtype, then the norm, SiLU, residual add, RoPE each rounded as eager PyTorch rounds them), so
it differs from HF's kernels only in the order of the multiply-adds. `*_reference` are those eager
sequences in torch: what runs where Triton does not (a CPU), and what the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import tuning
from .triton import HAVE_TRITON, asked, launch_options, next_pow2, tl, triton, untested_on_cuda

MAX_ROWS = 16        # batch rows the kernels handle (forward.line_paths says which batches use them)
ROWS_PER_PASS = 4    # rows multiplied against a weight tile at once (the register budget of 4 rows)


# -- torch references: HF's eager arithmetic, rounding point for rounding point ---------------------

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # gate/up's activation -> the kernel's ACT flag


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """LlamaRMSNorm.forward; plus_one: Gemma3RMSNorm.forward (times 1 + weight in float32, one rounding)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def activation_reference(x: torch.Tensor, act: str) -> torch.Tensor:
    """ACT2FN["silu"] or ACT2FN["gelu_pytorch_tanh"] (F.gelu's tanh approximation)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r}: one of {', '.join(ACTIVATIONS)}")
    return F.silu(x) if act == "silu" else F.gelu(x, approximate="tanh")


def rms_gemv_reference(x, norm_weight, eps, weight, residual=None, out_f32=False, plus_one=False, bias=None):
    n = rms_norm_reference(x, norm_weight, eps, plus_one) if norm_weight is not None else x
    y = F.linear(n, weight, bias)
    if residual is not None:
        y = residual + y
    return y.float() if out_f32 else y


def gate_up_reference(x, norm_weight, eps, gate_weight, up_weight, plus_one=False, act="silu"):
    n = rms_norm_reference(x, norm_weight, eps, plus_one)
    return activation_reference(F.linear(n, gate_weight), act) * F.linear(n, up_weight)


def embedding_reference(table, tokens, scale=None):
    """The rows of embedding table [V, K] at tokens [M], times scale (a tensor, Gemma's embed_scale) in the table's
    dtype where given: HF's embedding modules (nn.Embedding's lookup; Gemma 3's scaled one)."""
    rows = F.embedding(tokens, table)
    return rows if scale is None else rows * scale.to(table.dtype)


def rms_add_reference(y, norm_weight, eps, residual, plus_one=False):
    """residual + RMSNorm(y): Gemma's post-attention and post-feedforward norms and the residual add."""
    return residual + rms_norm_reference(y, norm_weight, eps, plus_one)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_angles_reference(positions, inv_freq, scaling, dtype):
    """cos, sin [B, D] as HF's rotary embedding computes them for positions [B, 1]."""
    freqs = positions.float() * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def qkv_rope_reference(x, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache, v_cache, slot,
                       biases=None, qk_norm=None, plus_one=False):
    """Returns q [B, Hq, D] after RoPE; writes k (after RoPE) and v at `slot` of the [B, Hkv, C, D] caches.
    positions [B, 1] int, inv_freq [D / 2] and scaling: HF's rotary embedding's buffer and factor.
    biases: (bq, bk, bv) of the projections (Qwen2), or None. qk_norm: (q weight, k weight, eps) of
    the per-head RMSNorm before RoPE (Qwen3, Gemma 3), or None. plus_one: both norms are Gemma's."""
    b = x.shape[0]
    d = k_cache.shape[-1]
    cos, sin = rope_angles_reference(positions, inv_freq, scaling, x.dtype)
    n = rms_norm_reference(x, norm_weight, eps, plus_one)
    bq, bk, bv = biases if biases is not None else (None, None, None)
    q = F.linear(n, wq, bq).view(b, -1, d)
    k = F.linear(n, wk, bk).view(b, -1, d)
    v = F.linear(n, wv, bv).view(b, -1, d)
    if qk_norm is not None:
        q_weight, k_weight, qk_eps = qk_norm
        q = rms_norm_reference(q, q_weight, qk_eps, plus_one)
        k = rms_norm_reference(k, k_weight, qk_eps, plus_one)
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    index = slot.reshape(1)
    k_cache.index_copy_(2, index, k[:, :, None])
    v_cache.index_copy_(2, index, v[:, :, None])
    return q


# -- Triton kernels -------------------------------------------------------------------------------

if HAVE_TRITON:
    @triton.jit
    def _scale_norm(xf, rstd, g, out_ty, PLUS_ONE: tl.constexpr):
        """The normalized value in the model dtype from float32 x, rstd and the weight g, with HF's
        roundings: Llama's (x * rstd -> model dtype, times the weight -> model dtype) or, PLUS_ONE,
        Gemma's (x * rstd * (1 + weight) in float32 -> model dtype)."""
        if PLUS_ONE:
            return (xf * rstd * (1.0 + g.to(tl.float32))).to(out_ty)
        return (g.to(tl.float32) * (xf * rstd).to(out_ty).to(tl.float32)).to(out_ty)

    @triton.jit
    def _norm_weights(g_ptr, ga_ptr, k3, K: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr):
        """The weights of `_input_rows`' norms, [1, 1, BLOCK_K] each (0.0 for a norm it does not apply): loaded
        before the PDL wait where EARLY_NORM (weights are never written during a step)."""
        g = 0.0
        ga = 0.0
        if NORM:
            g = tl.load(g_ptr + k3, mask=k3 < K, other=0.0)
        if ADD:
            ga = tl.load(ga_ptr + k3, mask=k3 < K, other=0.0)
        return g, ga

    @triton.jit
    def _input_rows(x_ptr, g_ptr, stride_x, M, eps, rm3, k3, K: tl.constexpr, NORM: tl.constexpr,
                    PLUS_ONE: tl.constexpr, a_ptr, ga_ptr, stride_a, eps_a, h_ptr, stride_h, write_h,
                    ADD: tl.constexpr, WRITE_H: tl.constexpr, g_pre, ga_pre, PRE: tl.constexpr,
                    tok_ptr, stride_tok, scale_ptr, EMBED: tl.constexpr, SCALE: tl.constexpr):
        """x [ROWS, 1, BLOCK_K] (whole rows) as the product reads it, in the model dtype: RMSNorm'd
        with HF's roundings where NORM (`_scale_norm`). ADD (Gemma's norm after attention or the MLP,
        folded in): x is first residual x + RMSNorm(a) with ga's weights, as `_rms_add_kernel` computes it.
        EMBED (the embedding lookup, folded into the first layer's kernel): x is an embedding table and the
        rows are its rows at the tokens (tok_ptr), times the scale at scale_ptr in the table's dtype where
        SCALE (Gemma's), as HF's embedding module computes them. Either way the rows are stored at h (WRITE_H)
        by the program where write_h (one: every program computes the same rows). PRE: the norms' weights are
        g_pre and ga_pre (`_norm_weights`, loaded before the wait), not loaded here."""
        if EMBED:
            tok = tl.load(tok_ptr + rm3 * stride_tok, mask=rm3 < M, other=0).to(tl.int64)
            x = tl.load(x_ptr + tok * stride_x + k3, mask=(rm3 < M) & (k3 < K), other=0.0)
            if SCALE:  # HF: rows * embed_scale.to(weight.dtype), the product rounded once
                s = tl.load(scale_ptr).to(x.dtype).to(tl.float32)
                x = (x.to(tl.float32) * s).to(x.dtype)
        else:
            x = tl.load(x_ptr + rm3 * stride_x + k3, mask=(rm3 < M) & (k3 < K), other=0.0)
        if ADD:
            a = tl.load(a_ptr + rm3 * stride_a + k3, mask=(rm3 < M) & (k3 < K), other=0.0)
            af = a.to(tl.float32)
            rstd_a = tl.rsqrt(tl.sum(af * af, axis=2, keep_dims=True) / K + eps_a)
            if PRE:
                ga = ga_pre
            else:
                ga = tl.load(ga_ptr + k3, mask=k3 < K, other=0.0)
            normed = _scale_norm(af, rstd_a, ga, a.dtype, PLUS_ONE)
            x = (x.to(tl.float32) + normed.to(tl.float32)).to(a.dtype)
        if WRITE_H:  # a scalar condition folded into the bound (the interpreter refuses tensor_mask & scalar_bool)
            tl.store(h_ptr + rm3 * stride_h + k3, x, mask=(rm3 < tl.where(write_h, M, 0)) & (k3 < K))
        if NORM:
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=2, keep_dims=True) / K + eps)
            if PRE:
                g = g_pre
            else:
                g = tl.load(g_ptr + k3, mask=k3 < K, other=0.0)
            x = _scale_norm(xf, rstd, g, x.dtype, PLUS_ONE)
        return x

    @triton.jit
    def _activation(gate, ACT: tl.constexpr):
        """float32 SiLU (ACT 0) or GELU's tanh form (ACT 1, as F.gelu(approximate="tanh")) of float32 gate."""
        if ACT == 0:
            return gate / (1.0 + tl.exp(-gate))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        t = tl.exp(-2.0 * tl.abs(inner))           # tanh from exp, stable for either sign
        th = (1.0 - t) / (1.0 + t)
        th = tl.where(inner >= 0, th, -th)
        return 0.5 * gate * (1.0 + th)

    @triton.jit
    def _rms_add_kernel(y_ptr, g_ptr, res_ptr, out_ptr, stride_y, stride_res, stride_out, eps,
                        N: tl.constexpr, BLOCK_N: tl.constexpr, PLUS_ONE: tl.constexpr, PDL: tl.constexpr):
        # one program per row: the norm needs the whole row, which the product before it spread over programs
        row = tl.program_id(0)
        n = tl.arange(0, BLOCK_N)
        g = tl.load(g_ptr + n, mask=n < N, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        y = tl.load(y_ptr + row * stride_y + n, mask=n < N, other=0.0)
        yf = y.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(yf * yf, axis=0) / N + eps)
        normed = _scale_norm(yf, rstd, g, y.dtype, PLUS_ONE)
        r = tl.load(res_ptr + row * stride_res + n, mask=n < N, other=0.0)
        tl.store(out_ptr + row * stride_out + n, (r.to(tl.float32) + normed.to(tl.float32)).to(y.dtype), mask=n < N)

    @triton.jit
    def _gemv_tile_out(x, w, w2, t, r0, x_ptr, b_ptr, res_ptr, y_ptr, M, N, stride_res, stride_y,
                       GATE_UP: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, OUT_F32: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
        """Rows r0 .. r0 + ROWS of tile t: the product (gate/up: silu(gate) * up; BIAS: the bias added to the
        float32 sum, rounded once, as F.linear's bias epilogue), the residual, the store."""
        out_ty = x_ptr.dtype.element_ty
        rm2 = r0 + tl.arange(0, ROWS)[:, None]
        rn2 = (t * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
        omask = (rm2 < M) & (rn2 < N)
        y = tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=2)      # [ROWS, BLOCK_N]
        if BIAS:
            y += tl.load(b_ptr + rn2, mask=rn2 < N, other=0.0).to(tl.float32)
        y = y.to(out_ty)
        if GATE_UP:  # act(gate) * up, each rounded as eager rounds it
            up = tl.sum(x.to(tl.float32) * w2.to(tl.float32), axis=2).to(out_ty)
            a = _activation(y.to(tl.float32), ACT).to(out_ty)
            y = (a.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        if RESIDUAL:
            r = tl.load(res_ptr + rm2 * stride_res + rn2, mask=omask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ty)
        if OUT_F32:
            tl.store(y_ptr + rm2 * stride_y + rn2, y.to(tl.float32), mask=omask)
        else:
            tl.store(y_ptr + rm2 * stride_y + rn2, y, mask=omask)

    @triton.jit
    def _rms_gemv_kernel(x_ptr, g_ptr, w_ptr, w2_ptr, b_ptr, res_ptr, y_ptr, a_ptr, ga_ptr, h_ptr,
                         M, N, stride_x, stride_res, stride_y, stride_a, stride_h, eps, eps_a, nprog,
                         ITERS: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, GATE_UP: tl.constexpr,
                         BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                         OUT_F32: tl.constexpr, ROWS: tl.constexpr, PASSES: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PLUS_ONE: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr,
                         WRITE_H: tl.constexpr, EARLY_NORM: tl.constexpr, LATE_TRIGGER: tl.constexpr,
                         PDL: tl.constexpr):
        # A persistent grid: each program streams row tiles pid, pid + nprog, ... with the next tile's
        # loads issued before the current one is summed. One pass (up to ROWS rows): x is read (and
        # normalized) once per program; more passes: each pass's rows are read again per tile (from
        # L1/L2), the weight tile in registers serving them all.
        pid = tl.program_id(0)
        rm3 = tl.arange(0, ROWS)[:, None, None]
        k3 = tl.arange(0, BLOCK_K)[None, None, :]
        kmask = k3 < K
        n3 = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None].to(tl.int64)
        # The weights are never written during a step: load the first tile before waiting on the
        # previous kernel, so these loads overlap its tail (PDL).
        w = tl.load(w_ptr + n3 * K + k3, mask=(n3 < N) & kmask, other=0.0)
        w2 = w
        if GATE_UP:
            w2 = tl.load(w2_ptr + n3 * K + k3, mask=(n3 < N) & kmask, other=0.0)
        g, ga = 0.0, 0.0
        if EARLY_NORM:   # the norms' weights too (`_norm_weights`)
            g, ga = _norm_weights(g_ptr, ga_ptr, k3, K, NORM, ADD)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if not LATE_TRIGGER:
                tl.extra.cuda.gdc_launch_dependents()
        if PASSES == 1:
            x = _input_rows(x_ptr, g_ptr, stride_x, M, eps, rm3, k3, K, NORM, PLUS_ONE, a_ptr, ga_ptr, stride_a, eps_a,
                            h_ptr, stride_h, pid == 0, ADD, WRITE_H, g, ga, EARLY_NORM, x_ptr, 0, x_ptr, False, False)
        for i in range(ITERS):  # constant trip count (tiles past N are masked): one loop shape for every program
            t = pid + i * nprog
            if PDL and LATE_TRIGGER:  # the next kernel launches as this one's last tile round starts (`late_trigger`)
                if i == ITERS - 1:
                    tl.extra.cuda.gdc_launch_dependents()
            n3_next = ((t + nprog) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :, None].to(tl.int64)
            w_next = tl.load(w_ptr + n3_next * K + k3, mask=(n3_next < N) & kmask, other=0.0)
            w2_next = w_next
            if GATE_UP:
                w2_next = tl.load(w2_ptr + n3_next * K + k3, mask=(n3_next < N) & kmask, other=0.0)
            if PASSES == 1:
                _gemv_tile_out(x, w, w2, t, 0, x_ptr, b_ptr, res_ptr, y_ptr, M, N, stride_res, stride_y,
                               GATE_UP, BIAS, RESIDUAL, OUT_F32, ROWS, BLOCK_N, ACT)
            else:
                for p in tl.static_range(PASSES):
                    xp = _input_rows(x_ptr + p * ROWS * stride_x, g_ptr, stride_x, M - p * ROWS, eps, rm3, k3, K, NORM,
                                     PLUS_ONE, a_ptr + p * ROWS * stride_a, ga_ptr, stride_a, eps_a,
                                     h_ptr + p * ROWS * stride_h, stride_h, (pid == 0) & (i == 0), ADD, WRITE_H, g, ga,
                                     EARLY_NORM, x_ptr, 0, x_ptr, False, False)
                    _gemv_tile_out(xp, w, w2, t, p * ROWS, x_ptr, b_ptr, res_ptr, y_ptr, M, N, stride_res,
                                   stride_y, GATE_UP, BIAS, RESIDUAL, OUT_F32, ROWS, BLOCK_N, ACT)
            w = w_next
            w2 = w2_next

    @triton.jit
    def _qkv_tile(t, wq_ptr, wk_ptr, wv_ptr, k3, K: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, HB: tl.constexpr):
        """Tile t: HB dims of one head's first half and the same HB dims of its second half (the pairs
        RoPE mixes, so the rotation happens in registers): (head, dims of the first half, weight pointers)."""
        per_head: tl.constexpr = (D // 2) // HB
        h = t // per_head
        d1 = (t % per_head) * HB + tl.arange(0, HB)
        if h < HQ:
            base = wq_ptr + (h * D).to(tl.int64) * K
        elif h < HQ + HKV:
            base = wk_ptr + ((h - HQ) * D).to(tl.int64) * K
        else:
            base = wv_ptr + ((h - HQ - HKV) * D).to(tl.int64) * K
        rows = base + d1[None, :, None] * K + k3
        return h, d1, rows, rows + (D // 2) * K

    @triton.jit
    def _qkv_finish(y1, y2, h, d1, live, r0, x_ptr, bq_ptr, bk_ptr, bv_ptr, gq_ptr, gk_ptr, pos_ptr, inv_ptr,
                    q_ptr, kr_ptr, kc_ptr, vc_ptr, slot, M, C, stride_pos, scaling, qk_eps,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                    BIAS: tl.constexpr, QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr, RAW: tl.constexpr,
                    pre_g1, pre_g2, pre_pos, pre_inv, PRE: tl.constexpr):
        """Rows r0 .. r0 + ROWS of one tile's float32 sums y1, y2 [ROWS, HB] (dims d1 and d1 + D/2 of head
        h; live: whether the tile exists): bias, per-head norm, RoPE, each rounded as eager rounds it;
        q stored, k and v written at the cache slot. RAW (the first of the two q/k-norm kernels): q and k
        stored as the products leave them (bias added, rounded), q in q's buffer, k in kr's [M, HKV, D]; v
        written to the cache as always. PRE: the head's norm weights (its two halves), the rows' positions and the
        tile's inverse frequencies are given (loaded before the PDL wait), not loaded here."""
        out_ty = x_ptr.dtype.element_ty
        rm = r0 + tl.arange(0, ROWS)[:, None]
        rmask = rm < tl.where(live, M, 0)
        d2 = d1 + D // 2
        if BIAS:  # F.linear with a bias: added to the float32 sum, rounded once
            if h < HQ:
                b_base = bq_ptr + h * D
            elif h < HQ + HKV:
                b_base = bk_ptr + (h - HQ) * D
            else:
                b_base = bv_ptr + (h - HQ - HKV) * D
            y1 = y1 + tl.load(b_base + d1).to(tl.float32)[None, :]
            y2 = y2 + tl.load(b_base + d2).to(tl.float32)[None, :]
        y1 = y1.to(out_ty).to(tl.float32)
        y2 = y2.to(out_ty).to(tl.float32)
        r1 = y1.to(out_ty)
        r2 = y2.to(out_ty)
        if not RAW:
            if h < HQ + HKV:
                if QK_NORM:  # the tile is the whole head (HB = D / 2): HF's RMSNorm over its D values
                    rstd = tl.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / D + qk_eps)[:, None]
                    if PRE:
                        g1, g2 = pre_g1, pre_g2
                    else:
                        g1, g2 = _head_weights(gq_ptr, gk_ptr, h, d1, HQ, D)
                    y1 = _scale_norm(y1, rstd, g1, out_ty, PLUS_ONE).to(tl.float32)
                    y2 = _scale_norm(y2, rstd, g2, out_ty, PLUS_ONE).to(tl.float32)
                # HF's angles: position (float32) * inv_freq, cos and sin times the scaling, rounded to the
                # model dtype (the two halves share them: emb = cat(freqs, freqs)); then
                # q * cos + rotate_half(q) * sin, each product and the sum rounded (eager)
                if PRE:
                    freq = pre_pos * pre_inv
                else:
                    pos = tl.load(pos_ptr + rm * stride_pos, mask=rmask, other=0).to(tl.float32)
                    freq = pos * tl.load(inv_ptr + d1).to(tl.float32)[None, :]
                c = (tl.cos(freq) * scaling).to(out_ty).to(tl.float32)
                s = (tl.sin(freq) * scaling).to(out_ty).to(tl.float32)
                r1 = ((y1 * c).to(out_ty).to(tl.float32) + (-y2 * s).to(out_ty).to(tl.float32)).to(out_ty)
                r2 = ((y2 * c).to(out_ty).to(tl.float32) + (y1 * s).to(out_ty).to(tl.float32)).to(out_ty)
        if h < HQ:  # q: its buffer, whether finished or (RAW) waiting for its norm and RoPE there
            base = q_ptr + (rm * HQ + h) * D
            tl.store(base + d1[None, :], r1, mask=rmask)
            tl.store(base + d2[None, :], r2, mask=rmask)
        else:
            # a slot past the cache is never written (HF's index_copy_ would fail)
            keep = rm < tl.where(live & (slot < C), M, 0)
            if h < HQ + HKV:
                if RAW:  # k waits in kr for its norm and RoPE
                    base = kr_ptr + (rm * HKV + (h - HQ)) * D
                    keep = rmask
                else:
                    base = kc_ptr + ((rm * HKV + (h - HQ)).to(tl.int64) * C + slot) * D
            else:
                base = vc_ptr + ((rm * HKV + (h - HQ - HKV)).to(tl.int64) * C + slot) * D
            tl.store(base + d1[None, :], r1, mask=keep)
            tl.store(base + d2[None, :], r2, mask=keep)

    @triton.jit
    def _head_weights(gq_ptr, gk_ptr, h, d1, HQ: tl.constexpr, D: tl.constexpr):
        """The per-head norm's weights of head h (q's below HQ, else k's) at dims d1 and d1 + D / 2, [1, len(d1)]."""
        if h < HQ:
            g_base = gq_ptr
        else:
            g_base = gk_ptr
        return tl.load(g_base + d1)[None, :], tl.load(g_base + D // 2 + d1)[None, :]

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, kr_ptr, gq_ptr, gk_ptr, pos_ptr, inv_ptr, kc_ptr, vc_ptr, slot_ptr,
                             M, C, stride_pos, scaling, qk_eps, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, ROWS: tl.constexpr, PLUS_ONE: tl.constexpr, EARLY_NORM: tl.constexpr,
                             PDL: tl.constexpr):
        """The second of the two q/k-norm kernels: program (rows, head h of q's and k's): the head's D values
        as the first kernel left them, HF's per-head RMSNorm and RoPE (`_qkv_finish`, the same arithmetic
        as in one kernel); q rewritten in place, k written at the cache slot. EARLY_NORM: the norm's weights,
        the rows' positions (written before the kernel before this one) and the inverse frequencies loaded
        before the PDL wait."""
        r0 = tl.program_id(0) * ROWS
        h = tl.program_id(1)
        d1 = tl.arange(0, D // 2)
        rm = r0 + tl.arange(0, ROWS)[:, None]
        g1, g2, pos, inv = 0.0, 0.0, 0.0, 0.0
        if EARLY_NORM:
            g1, g2 = _head_weights(gq_ptr, gk_ptr, h, d1, HQ, D)
            pos = tl.load(pos_ptr + rm * stride_pos, mask=rm < M, other=0).to(tl.float32)
            inv = tl.load(inv_ptr + d1).to(tl.float32)[None, :]
        if PDL:  # everything else read here is the first kernel's
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if h < HQ:
            base = q_ptr + (rm * HQ + h) * D
        else:
            base = kr_ptr + (rm * HKV + (h - HQ)) * D
        y1 = tl.load(base + d1[None, :], mask=rm < M, other=0.0).to(tl.float32)
        y2 = tl.load(base + D // 2 + d1[None, :], mask=rm < M, other=0.0).to(tl.float32)
        _qkv_finish(y1, y2, h, d1, r0 < M, r0, q_ptr, q_ptr, q_ptr, q_ptr, gq_ptr, gk_ptr, pos_ptr, inv_ptr,
                    q_ptr, kr_ptr, kc_ptr, vc_ptr, tl.load(slot_ptr), M, C, stride_pos, scaling, qk_eps,
                    HQ, HKV, D, ROWS, False, True, PLUS_ONE, False, g1, g2, pos, inv, EARLY_NORM)

    @triton.jit
    def _qkv_rope_gemv_kernel(x_ptr, g_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, gq_ptr, gk_ptr,
                              pos_ptr, inv_ptr, q_ptr, kr_ptr, kc_ptr, vc_ptr, slot_ptr, a_ptr, ga_ptr, h_ptr,
                              tok_ptr, scale_ptr,
                              M, C, stride_x, stride_pos, stride_a, stride_h, stride_tok, scaling, eps, qk_eps, eps_a,
                              nprog,
                              ITERS: tl.constexpr, K: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                              D: tl.constexpr, HB: tl.constexpr, ROWS: tl.constexpr, PASSES: tl.constexpr,
                              BLOCK_K: tl.constexpr, KSPLIT: tl.constexpr, BIAS: tl.constexpr,
                              QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr, RAW: tl.constexpr,
                              ADD: tl.constexpr, WRITE_H: tl.constexpr, EARLY_NORM: tl.constexpr,
                              EMBED: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        tiles: tl.constexpr = (HQ + 2 * HKV) * ((D // 2) // HB)
        k3 = tl.arange(0, BLOCK_K)[None, None, :]
        rm3 = tl.arange(0, ROWS)[:, None, None]
        if KSPLIT == 1:
            # Whole rows of K per tile, the next tile's weights loaded before this one is summed.
            kmask = k3 < K
            h, d1, p1, p2 = _qkv_tile(pid, wq_ptr, wk_ptr, wv_ptr, k3, K, HQ, HKV, D, HB)
            w1 = tl.load(p1, mask=kmask, other=0.0)   # weights first, then wait (PDL)
            w2 = tl.load(p2, mask=kmask, other=0.0)
            g, ga = 0.0, 0.0
            if EARLY_NORM:
                g, ga = _norm_weights(g_ptr, ga_ptr, k3, K, True, ADD)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            if PASSES == 1:
                x = _input_rows(x_ptr, g_ptr, stride_x, M, eps, rm3, k3, K, True, PLUS_ONE, a_ptr, ga_ptr, stride_a,
                                eps_a, h_ptr, stride_h, pid == 0, ADD, WRITE_H, g, ga, EARLY_NORM,
                                tok_ptr, stride_tok, scale_ptr, EMBED, SCALE).to(tl.float32)
            slot = tl.load(slot_ptr)
            for i in range(ITERS):
                t = pid + i * nprog
                h_next, d1_next, p1_next, p2_next = _qkv_tile(t + nprog, wq_ptr, wk_ptr, wv_ptr, k3, K, HQ, HKV, D, HB)
                # A scalar condition is folded into the bound a tensor is compared with, not and-ed with a
                # tensor mask: Triton 3.9's interpreter makes `tensor_mask & scalar_bool` an int32 mask and
                # refuses it ("mask has unsupported dtype"); the compiled kernel is the same either way.
                kmask_next = k3 < tl.where(t + nprog < tiles, K, 0)   # the next tile past the end reads nothing
                w1_next = tl.load(p1_next, mask=kmask_next, other=0.0)
                w2_next = tl.load(p2_next, mask=kmask_next, other=0.0)
                for p in tl.static_range(PASSES):
                    if PASSES == 1:
                        xp = x
                    else:
                        x_pass = x_ptr + p * ROWS * stride_x
                        if EMBED:  # the pass's rows are the tokens', anywhere in the table
                            x_pass = x_ptr
                        xp = _input_rows(x_pass, g_ptr, stride_x, M - p * ROWS, eps, rm3, k3, K,
                                         True, PLUS_ONE, a_ptr + p * ROWS * stride_a, ga_ptr, stride_a, eps_a,
                                         h_ptr + p * ROWS * stride_h, stride_h, (pid == 0) & (i == 0), ADD,
                                         WRITE_H, g, ga, EARLY_NORM, tok_ptr + p * ROWS * stride_tok, stride_tok,
                                         scale_ptr, EMBED, SCALE).to(tl.float32)
                    y1 = tl.sum(xp * w1.to(tl.float32), axis=2)   # [ROWS, HB]
                    y2 = tl.sum(xp * w2.to(tl.float32), axis=2)
                    _qkv_finish(y1, y2, h, d1, t < tiles, p * ROWS, x_ptr, bq_ptr, bk_ptr, bv_ptr, gq_ptr, gk_ptr,
                                pos_ptr, inv_ptr, q_ptr, kr_ptr, kc_ptr, vc_ptr, slot, M, C, stride_pos, scaling,
                                qk_eps, HQ, HKV, D, ROWS, BIAS, QK_NORM, PLUS_ONE, RAW, 0.0, 0.0, 0.0, 0.0, False)
                h, d1, w1, w2 = h_next, d1_next, w1_next, w2_next
        else:
            # K in KSPLIT chunks of BLOCK_K (a whole head per tile, HB = D / 2, for the per-head norm: too
            # many weights for one load); all rows in one pass (ROWS = every row), x's norm computed first.
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            slot = tl.load(slot_ptr)
            rows_ok = rm3 < M
            sq = tl.zeros([ROWS, 1, 1], dtype=tl.float32)
            for j in range(KSPLIT):
                kj = j * BLOCK_K + k3
                xf = tl.load(x_ptr + rm3 * stride_x + kj, mask=rows_ok & (kj < K), other=0.0).to(tl.float32)
                sq += tl.sum(xf * xf, axis=2, keep_dims=True)
            rstd = tl.rsqrt(sq / K + eps)
            for i in range(ITERS):
                t = pid + i * nprog
                h, d1, p1, p2 = _qkv_tile(t, wq_ptr, wk_ptr, wv_ptr, k3, K, HQ, HKV, D, HB)
                bound = tl.where(t < tiles, K, 0)
                y1 = tl.zeros([ROWS, HB], dtype=tl.float32)
                y2 = tl.zeros([ROWS, HB], dtype=tl.float32)
                for j in range(KSPLIT):
                    kj = j * BLOCK_K + k3
                    w1 = tl.load(p1 + j * BLOCK_K, mask=kj < bound, other=0.0).to(tl.float32)
                    w2 = tl.load(p2 + j * BLOCK_K, mask=kj < bound, other=0.0).to(tl.float32)
                    xr = tl.load(x_ptr + rm3 * stride_x + kj, mask=rows_ok & (kj < K), other=0.0)
                    g = tl.load(g_ptr + kj, mask=kj < K, other=0.0)
                    xn = _scale_norm(xr.to(tl.float32), rstd, g, xr.dtype, PLUS_ONE)
                    y1 += tl.sum(xn.to(tl.float32) * w1, axis=2)
                    y2 += tl.sum(xn.to(tl.float32) * w2, axis=2)
                _qkv_finish(y1, y2, h, d1, t < tiles, 0, x_ptr, bq_ptr, bk_ptr, bv_ptr, gq_ptr, gk_ptr,
                            pos_ptr, inv_ptr, q_ptr, kr_ptr, kc_ptr, vc_ptr, slot, M, C, stride_pos, scaling, qk_eps,
                            HQ, HKV, D, ROWS, BIAS, QK_NORM, PLUS_ONE, RAW, 0.0, 0.0, 0.0, 0.0, False)


# -- launch configurations ------------------------------------------------------------------------
# (BLOCK_N rows per tile, num_warps, programs per multiprocessor), from the device's tuning file (`tuning.py`). Each
# tile is ~16 KB of weights, the x rows are read once per program, and the grid is a few programs per
# multiprocessor, each streaming its tiles with one tile's loads always in flight.

def _programs(tiles: int, device, per_sm: int) -> int:
    if device.type == "cuda":
        sms = tuning.current(device).multiprocessors
    else:
        sms = 2  # Triton's interpreter: a few programs, each looping over several tiles
    return max(1, min(tiles, sms * per_sm))


def gemv_config(m: int, n: int, k: int, tiles: int = 1, tune: tuning.Tuning | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, programs per SM) for an [m, k] x [k, n] product (`tiles` weights per call: 2 for gate/up),
    from the device's tuning (`tune`; None: the defaults, `tuning.current`), its section "gemv": a sweep's row for
    this exact shape where there is one ("shapes"), else the rule: tiles of `tile_elements` weights (both weights
    together, K padded to a power of two), at most `max_block_n` rows, halved until there are `tiles_per_sm` tiles
    per multiprocessor (the device's count); warps and programs per SM from the first "launch" row whose conditions
    hold at K, its padding and the tile's rows.

    The H200 file's rule, measured there (at one row, every config timed alone: profiles/h200/decode-kernels/
    sweep-6e765ba/gemv.csv for Gemma-3-1B, sweep-14cc799/gemv.csv for Llama-1B): 8 warps from K = 2048, else 4;
    4 programs per SM up to 4096-wide tiles, 2 past them. Gemma's K = 1152 pads to a 2048-wide tile: with 8 warps, 2
    per SM, gate/up took 15.3 us and the lm_head 182; with 4 warps, 4 per SM (the warps by K itself, not its padding)
    12.2 and 154. Its o projection (n = 1152) in 8-row tiles left 144 tiles for 132 multiprocessors: 3.7 us, against
    3.0 in 4-row tiles. Llama-1B's K = 2048 with 8 warps, 4 per SM against 2: o 4.33 against 4.45 us, gate/up 19.75
    against 20.42, the lm_head 123.2 against 127.8 (its earlier 8-row tiles at 2 per SM; 4-row tiles at 2 took 140).
    Llama-8B's K = 4096 (sweep-fa2489e) also runs 4 per SM, and one-row tiles there 4 warps: o 10.51 against 10.84
    us, the lm_head 241.9 against 249.9, gate/up (one row each of gate and up) 59.11 against 59.86; its down (K =
    14336) keeps 8 warps, 2 per SM (30.4 us; 31.9 at 4 warps, 4 per SM)."""
    tune = tune or tuning.current()
    exact = tune.pick("gemv", "shapes", n=n, k=k, tiles=tiles)
    if exact:
        return exact["block_n"], exact["warps"], exact["per_sm"]
    rule = tune["gemv"]
    block_k = next_pow2(k)
    block_n = max(1, min(rule["max_block_n"], (rule["tile_elements"] // block_k) // tiles))
    launch = tune.pick("gemv", "launch", k=k, block_k=block_k, block_n=block_n)
    while block_n > 1 and -(-n // block_n) < rule["tiles_per_sm"] * tune.multiprocessors:
        block_n //= 2
    return block_n, launch["warps"], launch["per_sm"]


# The norms' weights (and the q/k norm kernel's positions and inverse frequencies) loaded before the PDL wait, as the
# weight tiles are: after it they came from HBM on the critical path (a step streams far more than L2 holds, so a
# layer's norm weights are evicted between steps). The same values, the same bits. On CUDA only while the path is in
# CUDA_TESTED (else the loads stay after the wait). GDTOOL_EARLY_NORM=0: after the wait everywhere.
EARLY_NORM_PATH = "norm weights before the PDL wait"


def early_norm(device) -> bool:
    """Whether the kernels load their norms' weights before the PDL wait on `device`: asked for (GDTOOL_EARLY_NORM,
    on by default) and, on CUDA, tested there."""
    return asked("early_norm") and not untested_on_cuda(EARLY_NORM_PATH, device)


# The embedding lookup folded into the first layer's qkv_rope (its `embed=`): the rows gathered from the table where
# the kernel would read h, and stored as h by one program, as the folded residual add stores its h. One kernel fewer a
# step, and the first of the step's PDL chain (HF's lookup is a torch kernel, which launches no dependents early).
# The same rows, the same bits. On CUDA only while the path is in CUDA_TESTED; GDTOOL_FOLD_EMBEDDING=0: HF's module
# everywhere (the before of an A/B).
FOLD_EMBEDDING_PATH = "embedding lookup in the first qkv_rope"


def fold_embedding(device) -> bool:
    """Whether the fast forward folds the embedding lookup into the first layer's qkv_rope on `device`: asked for
    (GDTOOL_FOLD_EMBEDDING, on by default) and, on CUDA, tested there."""
    return asked("fold_embedding") and not untested_on_cuda(FOLD_EMBEDDING_PATH, device)


# Where the matrix-vector products (`_rms_gemv_kernel`: o, gate/up, down, the lm_head) let the next kernel launch
# under PDL: right after their wait (the default), or as their last round of tiles starts (GDTOOL_LATE_TRIGGER=1).
# With PDL on every kernel the 8B presets' gate/up went from 59 to 68 µs and down from 30 to 38 (decode-kernels/run2),
# which is why `auto` leaves PDL off on products over 64 MB. The suspect is the early trigger: the next kernel's
# programs take SM slots and stream their first tiles through the whole product instead of its tail. The same bits
# either way (the next kernel still waits for this one to finish).
LATE_TRIGGER_PATH = "PDL trigger in the last tile round"


def late_trigger(device) -> bool:
    """Whether the matrix-vector products trigger the next kernel's launch in their last tile round on `device`:
    asked for (GDTOOL_LATE_TRIGGER, off by default) and, on CUDA, tested there or GDTOOL_UNTESTED_KERNELS=1. Asked
    for and untested is refused with the reason, not ignored: an A/B must not time the default twice."""
    if not asked("late_trigger"):
        return False
    refused = untested_on_cuda(LATE_TRIGGER_PATH, device)
    if refused:
        raise RuntimeError(f"GDTOOL_LATE_TRIGGER=1: {refused}")
    return True


def _bytes(*weights) -> int:
    """The weight bytes a kernel streams (the PDL setting "auto" decides by them)."""
    return sum(w.numel() * w.element_size() for w in weights if w is not None)


def _row_passes(m: int) -> tuple[int, int]:
    """(ROWS, PASSES): rows multiplied at once against a weight tile, and how many such passes cover m."""
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the matrix-vector kernels take at most {MAX_ROWS} (forward.line_paths "
                         "sends larger batches to the compiled matmuls)")
    block_m = next_pow2(m)
    rows = min(block_m, ROWS_PER_PASS)
    return rows, block_m // rows


def _added(x, add, keep: bool):
    """The folded `rms_add` of a kernel's input: (a, its norm's weight and eps, h or None, ADD, WRITE_H). add:
    (a, weight, eps) makes the input x + RMSNorm(a) (x the residual), written to a new h where kept."""
    if add is None:
        return x, x, 0.0, None, False, False
    a, weight, eps = add
    if a.shape != x.shape:
        raise ValueError(f"the folded residual add needs a of x's shape {tuple(x.shape)}; got {tuple(a.shape)}")
    return a, weight, float(eps), torch.empty_like(x) if keep else None, True, keep


def rms_gemv(x, norm_weight, eps, weight, weight2=None, residual=None, out_f32=False, config=None, plus_one=False,
             act="silu", add=None, keep=True, bias=None):
    """Triton `rms_gemv` / `gate_up` (weight2 given): x [M, K] (M <= MAX_ROWS) -> [M, N]. add=(a, weight, eps):
    the input is x + RMSNorm(a) (`rms_add`, folded in: Gemma's post norms), returned as well, (y, h), where
    keep (the residual stream's next value). bias [N]: added to the float32 product, rounded once (not with
    gate/up)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight2 is not None and norm_weight is None:
        raise ValueError("gate/up is fused with the RMSNorm that precedes it; give norm_weight")
    if weight2 is not None and bias is not None:
        raise ValueError("gate/up takes no bias (no family this kernel serves has one there)")
    block_n, warps, per_sm = config or gemv_config(m, n, k, 2 if weight2 is not None else 1,
                                                   tuning.current(x.device))
    rows, passes = _row_passes(m)
    y = torch.empty(m, n, device=x.device, dtype=torch.float32 if out_f32 else x.dtype)
    res = residual if residual is not None else y
    a, ga, eps_a, h, fold, write = _added(x, add, keep)
    tiles = triton.cdiv(n, block_n)
    grid = (_programs(tiles, x.device, per_sm),)
    _rms_gemv_kernel[grid](
        x, norm_weight if norm_weight is not None else x, weight, weight2 if weight2 is not None else weight,
        bias if bias is not None else weight, res, y,
        a, ga, h if h is not None else x,
        m, n, x.stride(0), res.stride(0), y.stride(0), a.stride(0), (h if h is not None else x).stride(0), float(eps),
        eps_a, grid[0],
        ITERS=triton.cdiv(tiles, grid[0]), K=k, NORM=norm_weight is not None, GATE_UP=weight2 is not None,
        BIAS=bias is not None, RESIDUAL=residual is not None,
        OUT_F32=out_f32, ROWS=rows, PASSES=passes, BLOCK_N=block_n, BLOCK_K=next_pow2(k), PLUS_ONE=bool(plus_one),
        ACT=ACTIVATIONS[act], ADD=fold, WRITE_H=write, EARLY_NORM=early_norm(x.device),
        LATE_TRIGGER=late_trigger(x.device), num_warps=warps, **launch_options(x.device, _bytes(weight, weight2)))
    return (y, h) if fold and keep else y


def rms_add(y, norm_weight, eps, residual, plus_one=False):
    """Triton `rms_add`: same arguments and result as `rms_add_reference` (y, residual [M, N])."""
    m, n = y.shape
    out = torch.empty_like(residual)
    block_n = next_pow2(n)
    _rms_add_kernel[(m,)](y, norm_weight, residual, out, y.stride(0), residual.stride(0), out.stride(0), float(eps),
                          N=n, BLOCK_N=block_n, PLUS_ONE=bool(plus_one), num_warps=8 if block_n >= 2048 else 4,
                          **launch_options(y.device))
    return out


def qkv_rope_config(k: int, d: int, m: int = 1, qk_norm: bool = False,
                    tune: tuning.Tuning | None = None) -> tuple[int, int, int, int]:
    """(HB, num_warps, programs per SM, BLOCK_K): 2 * HB weight rows per tile, K in one tile, from the device's
    tuning (`tune`; None: the defaults), its section "qkv_rope": a sweep's row for this exact (K, D) where there is
    one ("shapes"), else HB from `tile_elements` weights per tile row pair and the first "launch" row that holds at
    K's padding.

    With a per-head norm (Qwen3, Gemma 3) the tiles are the same, and the norm and RoPE of q and k are a
    second kernel's (`qkv_rope`). One kernel can do it only with whole-head tiles (HB = D / 2, K read in
    chunks of BLOCK_K: `whole_head_config`), one tile per head: 6 programs for Gemma-3-1B's 4 + 1 + 1
    heads, 48 for Qwen3-8B's, each streaming 0.6-1 MB of weights alone on a GPU of 132 multiprocessors.

    The H200 file's rule: 2048-wide tiles (K from 1025 to 2048) run 4 warps, 4 programs an SM, measured on the H200
    alone at one row: Llama-1B's q/k/v (HB 2) 6.53 us against 7.03 with 8 warps, 2 an SM (HB 1: 6.27, sweep-14cc799),
    Gemma-3-1B's 5.51 against 5.99 (HB 1: 6.17, sweep-6e765ba); 4096-wide tiles too: Llama-8B's (HB 1) 15.98 us
    against 18.02 with 8 warps, 2 an SM (8 warps, 4 an SM: 15.84; sweep-fa2489e); wider K keeps 8 warps, 2 an SM."""
    tune = tune or tuning.current()
    block_k = next_pow2(k)
    exact = tune.pick("qkv_rope", "shapes", k=k, d=d)
    if exact:
        return exact["hb"], exact["warps"], exact["per_sm"], block_k
    launch = tune.pick("qkv_rope", "launch", block_k=block_k)
    return max(1, min(d // 2, tune["qkv_rope"]["tile_elements"] // block_k)), launch["warps"], launch["per_sm"], block_k


def whole_head_config(k: int, d: int, m: int = 1) -> tuple[int, int, int, int]:
    """The one-kernel q/k-norm configuration: a tile per head, K in chunks sized so that the [rows, D,
    BLOCK_K] product stays ~16 K elements (the single-kernel path's default until the two kernels)."""
    warps = 8 if next_pow2(k) >= 2048 else 4
    block_k = min(next_pow2(k), max(16, next_pow2(16384 // (next_pow2(m) * d))))
    return d // 2, warps, 2, block_k


def qkv_rope(x, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache, v_cache, slot,
             biases=None, qk_norm=None, plus_one=False, config=None, add=None, embed=None):
    """Triton `qkv_rope`: same arguments and result as `qkv_rope_reference`. With a per-head norm and tiles
    smaller than a head (the default), two kernels: the products, RoPE-free for q and k (q in its buffer, k
    in a scratch row, v in the cache), then each head's norm and RoPE (`_qk_norm_rope_kernel`).
    add=(a, weight, eps): the input is x + RMSNorm(a), folded in (`rms_gemv`'s add); returns (q, h) then.
    embed=(tokens [M], scale or None): x is an embedding table [V, K] and the input is its rows at the tokens
    (`embedding_reference`), the lookup folded in; returns (q, h) then."""
    if add is not None and embed is not None:
        raise ValueError("qkv_rope folds in a residual add or an embedding lookup, not both")
    m, k = (embed[0].shape[0], x.shape[1]) if embed is not None else x.shape
    _, hkv, c, d = k_cache.shape
    hq = wq.shape[0] // d
    config = config or qkv_rope_config(k, d, m, qk_norm is not None, tuning.current(x.device))
    hb, warps, per_sm, block_k = config if len(config) == 4 else (*config, next_pow2(k))  # 3: K in one tile
    ksplit = triton.cdiv(k, block_k)
    if (add is not None or embed is not None) and ksplit > 1:
        # K in chunks never holds a whole row: the add or the lookup runs as its own kernel first
        h = rms_add(add[0], add[1], add[2], x, plus_one) if add is not None else embedding_reference(x, *embed)
        return qkv_rope(h, norm_weight, eps, wq, wk, wv, positions, inv_freq, scaling, k_cache, v_cache, slot,
                        biases, qk_norm, plus_one, config), h
    if embed is not None:
        tokens, scale = embed
        a, ga, eps_a, h, fold, write = x, x, 0.0, torch.empty(m, k, device=x.device, dtype=x.dtype), True, True
    else:
        tokens, scale = None, None
        a, ga, eps_a, h, fold, write = _added(x, add, True)
    two = qk_norm is not None and hb != d // 2   # the per-head norm needs the whole head: a second kernel
    rows, passes = _row_passes(m)
    if ksplit > 1:  # the chunked loop multiplies every row at once
        rows, passes = next_pow2(m), 1
    bq, bk, bv = biases if biases is not None else (x, x, x)
    gq, gk, qk_eps = qk_norm if qk_norm is not None else (x, x, 0.0)
    q = torch.empty(m, hq, d, device=x.device, dtype=x.dtype)
    k_raw = torch.empty(m, hkv, d, device=x.device, dtype=x.dtype) if two else q
    tiles = (hq + 2 * hkv) * ((d // 2) // hb)
    grid = (_programs(tiles, x.device, per_sm),)
    _qkv_rope_gemv_kernel[grid](
        x, norm_weight, wq, wk, wv, bq, bk, bv, gq, gk, positions, inv_freq, q, k_raw, k_cache, v_cache, slot,
        a, ga, h if h is not None else x, tokens if tokens is not None else positions,
        scale if scale is not None else x,
        m, c, x.stride(0), positions.stride(0), a.stride(0), (h if h is not None else x).stride(0),
        tokens.stride(0) if tokens is not None else 0, float(scaling), float(eps), float(qk_eps), eps_a, grid[0],
        ITERS=triton.cdiv(tiles, grid[0]), K=k, HQ=hq, HKV=hkv, D=d, HB=hb, ROWS=rows, PASSES=passes,
        BLOCK_K=block_k, KSPLIT=ksplit, BIAS=biases is not None, QK_NORM=qk_norm is not None and not two,
        PLUS_ONE=bool(plus_one), RAW=two, ADD=fold and embed is None, WRITE_H=write, EARLY_NORM=early_norm(x.device),
        EMBED=embed is not None, SCALE=scale is not None, num_warps=warps,
        **launch_options(x.device, _bytes(wq, wk, wv)))
    if two:
        norm_rows = next_pow2(m)
        _qk_norm_rope_kernel[(1, hq + hkv)](
            q, k_raw, gq, gk, positions, inv_freq, k_cache, v_cache, slot, m, c, positions.stride(0), float(scaling),
            float(qk_eps), HQ=hq, HKV=hkv, D=d, ROWS=norm_rows, PLUS_ONE=bool(plus_one),
            EARLY_NORM=early_norm(x.device), num_warps=4 if norm_rows * d <= 4096 else 8, **launch_options(x.device))
    return (q, h) if fold else q
