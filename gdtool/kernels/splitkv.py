"""Decode attention over the live part of the static cache (split-KV), and a two-stage argmax.

Attention. At decode each row has one query token per head; the static cache holds `C` slots of
which only the first `slot + 1` have been written (`slot` is the cache layer's own device counter,
`cumulative_length`, read in the kernel: the captured graph needs no host value). SDPA attends over
all `C` slots with a mask; here the slots are split into chunks, one program per (row, key/value
head, chunk), and a program whose chunk starts past the live length returns at once:

    split    per chunk: the group's query heads (grouped-query: one key/value head serves G query
             heads, read once for all G) against the chunk's keys, masked by the 2-D mask and the
             live length; online softmax; unnormalized output, running max and sum (float32)
    combine  per (row, query head): the live chunks' partial results, rescaled to the common max

The arithmetic is flash-decoding's: scores and softmax in float32, probabilities rounded to the
model dtype for the product with V (as SDPA's kernels do), output rounded once.

Argmax. `torch.argmax` over a [B, 128256] row is one reduction kernel of ~30 us at batch 1 (a
handful of programs walk the whole row); two stages (the best of each 2048-entry block, then the best
of the blocks) spread the read over the whole GPU. Ties go to the smallest index and NaN wins, as
torch.argmax's do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton import HAVE_TRITON, launch_options, next_pow2, tl, triton

BLOCK_S = 16          # keys per inner iteration of the split kernel
TARGET_PROGRAMS = 264  # two per H200 multiprocessor: enough chunks to fill the GPU at batch 1
ARGMAX_BLOCK = 2048


def decode_attention_reference(q, k_cache, v_cache, mask, slot, scale):
    """q [B, Hq, D], caches [B, Hkv, C, D], mask [B, C] (nonzero = attend), slot [] -> [B, Hq * D].
    SDPA over the packed query heads of each group (attention's form), slots <= slot only."""
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    live = torch.arange(c, device=q.device) <= slot
    keep = (mask != 0) & live[None, :]
    qp = q.reshape(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(qp, k_cache, v_cache, attn_mask=keep[:, None, None, :], scale=scale)
    return out.reshape(b, hq * d)


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


def split_plan(batch: int, hkv: int, cache_len: int) -> tuple[int, int]:
    """(chunk, splits): chunks a multiple of BLOCK_S, enough of them for TARGET_PROGRAMS programs."""
    want = max(1, TARGET_PROGRAMS // max(1, batch * hkv))
    chunk = max(BLOCK_S, triton_cdiv(triton_cdiv(cache_len, want), BLOCK_S) * BLOCK_S)
    return chunk, triton_cdiv(cache_len, chunk)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if HAVE_TRITON:
    @triton.jit
    def _attention_split_kernel(q_ptr, kc_ptr, vc_ptr, mask_ptr, slot_ptr, m_ptr, l_ptr, acc_ptr,
                      C, stride_mask, qk_scale,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      BLOCK_G: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                      PDL: tl.constexpr):
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // HKV
        hk = bh % HKV
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        live = tl.load(slot_ptr) + 1
        start = s * CHUNK
        if start < live:
            g = tl.arange(0, BLOCK_G)
            d = tl.arange(0, D)
            q = tl.load(q_ptr + ((b * HQ + hk * G + g) * D)[:, None] + d[None, :], mask=(g < G)[:, None], other=0.0)
            m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
            kv = kc_ptr + (bh.to(tl.int64) * C) * D
            vv = vc_ptr + (bh.to(tl.int64) * C) * D
            end = tl.minimum(start + CHUNK, live)
            for j0 in range(0, CHUNK, BLOCK_S):  # static bounds; keys past `end` are masked (not read)
                j = start + j0 + tl.arange(0, BLOCK_S)
                inside = j < end
                keep = inside & (tl.load(mask_ptr + b * stride_mask + j, mask=inside, other=0) != 0)
                k = tl.load(kv + j[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
                v = tl.load(vv + j[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k)) * qk_scale          # [BLOCK_G, BLOCK_S], log2 units
                scores = tl.where(keep[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row so far
                p = tl.exp2(scores - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            row = (b * HQ + hk * G + g) * SPLITS + s
            tl.store(m_ptr + row, m_i, mask=g < G)
            tl.store(l_ptr + row, l_i, mask=g < G)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])

    @triton.jit
    def _attention_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, slot_ptr,
                        D: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                        PDL: tl.constexpr):
        bh = tl.program_id(0)  # row * Hq + query head
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        live = tl.load(slot_ptr) + 1
        n_live = (live + CHUNK - 1) // CHUNK
        s = tl.arange(0, BLOCK_SPLITS)
        valid = s < n_live
        m = tl.load(m_ptr + bh * SPLITS + s, mask=valid, other=float("-inf"))
        l = tl.load(l_ptr + bh * SPLITS + s, mask=valid, other=0.0)
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        top = tl.max(m, axis=0)
        w = tl.where(valid, tl.exp2(m - top), 0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(o_ptr + bh * D + d, out.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _argmax_blocks(x_ptr, v_ptr, i_ptr, V, stride_x, BLOCKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * stride_x + offs, mask=offs < V, other=float("-inf"))
        big = 2147483647
        isnan = x != x
        nan_at = tl.min(tl.where(isnan, offs, big), axis=0)
        top = tl.max(tl.where(isnan, float("-inf"), x), axis=0)
        at = tl.min(tl.where((x == top) & (offs < V), offs, big), axis=0)
        found_nan = nan_at < big
        tl.store(v_ptr + b * BLOCKS + c, tl.where(found_nan, float("nan"), top))
        tl.store(i_ptr + b * BLOCKS + c, tl.where(found_nan, nan_at, at))

    @triton.jit
    def _argmax_final(v_ptr, i_ptr, out_ptr, BLOCKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        c = tl.arange(0, BLOCK)
        inside = c < BLOCKS
        x = tl.load(v_ptr + b * BLOCKS + c, mask=inside, other=float("-inf"))
        idx = tl.load(i_ptr + b * BLOCKS + c, mask=inside, other=2147483647)
        big = 2147483647
        isnan = (x != x) & inside
        nan_at = tl.min(tl.where(isnan, idx, big), axis=0)
        top = tl.max(tl.where(isnan, float("-inf"), x), axis=0)
        at = tl.min(tl.where((x == top) & inside, idx, big), axis=0)
        tl.store(out_ptr + b, tl.where(nan_at < big, nan_at, at).to(tl.int64))


def decode_attention(q, k_cache, v_cache, mask, slot, scale):
    """Triton split-KV attention: same arguments and result as `decode_attention_reference`."""
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    chunk, splits = split_plan(b, hkv, c)
    m = torch.empty(b * hq * splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(b * hq * splits, d, device=q.device, dtype=torch.float32)
    out = torch.empty(b, hq * d, device=q.device, dtype=q.dtype)
    opts = launch_options(q.device)
    _attention_split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, mask, slot, m, l, acc, c, mask.stride(0), float(scale) * 1.4426950408889634,
        HQ=hq, HKV=hkv, D=d, G=g, BLOCK_G=max(16, next_pow2(g)), CHUNK=chunk, SPLITS=splits, BLOCK_S=BLOCK_S,
        num_warps=4, **opts)
    _attention_combine_kernel[(b * hq,)](m, l, acc, out, slot, D=d, CHUNK=chunk, SPLITS=splits,
                               BLOCK_SPLITS=max(2, next_pow2(splits)), num_warps=4 if d >= 128 else 2, **opts)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Triton two-stage argmax over the last dim of a [B, V] float tensor -> [B] int64."""
    b, v = x.shape
    blocks = triton_cdiv(v, ARGMAX_BLOCK)
    values = torch.empty(b, blocks, device=x.device, dtype=torch.float32)
    index = torch.empty(b, blocks, device=x.device, dtype=torch.int32)
    out = torch.empty(b, device=x.device, dtype=torch.int64)
    opts = launch_options(x.device)
    _argmax_blocks[(b, blocks)](x, values, index, v, x.stride(0), blocks, BLOCK=ARGMAX_BLOCK, num_warps=8, **opts)
    _argmax_final[(b,)](values, index, out, blocks, BLOCK=max(2, next_pow2(blocks)), num_warps=4, **opts)
    return out
