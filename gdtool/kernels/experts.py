"""Mixture-of-experts blocks at small batch in gdtool's own kernels (`kernels="fast"`).

The physics. A decode step of Qwen3-30B-A3B at batch 1 must read, per layer, its attention weights
and the 8 experts (of 128) its one token is routed to: 8 x (gate/up 1536 x 2048 + down 2048 x 768)
bf16, 75 MB of a layer's 1.2 GB of experts. The step's floor is reading those bytes once (~1.4 ms
on an H200). HF's experts implementations miss it two ways: `grouped_mm` sorts, histograms and
runs a grouped GEMM sized for many tokens per expert (and the whole [E, 2I, H] weight is its
operand), `batched_mm` gathers a copy of every routed expert's weights (`gate_up_proj[ids]`)
before its batched products: each routed byte is read, written and read again. At a few tokens
the work is a handful of matrix-vector products whose rows are chosen on the device; that is what
the kernels here run, reading only the routed experts' rows, straight from HF's parameters:

    router   logits [M, E] = x @ W_router.T (+ Qwen2-MoE's shared-expert gate as row E), rounded
             to the model dtype as F.linear rounds them; at one token (`Config.routed`) the last of a
             row's programs to finish also routes the row (softmax in float32, top-k, renormalized
             where the router does) and stores its expert ids and routing weights    (1 kernel)
    gate_up  for its (row, k-th expert, tile of the intermediate dim): silu(x @ Wg[e].T) * (x @ Wu[e].T),
             each product and the activation rounded as HF's experts round them; the expert id loaded
             (routed), or (above one token) each program recomputes its row's routing from the logits
             and the (row, k) pairs of tile 0 write the expert id and routing weight   (1 kernel)
    down     per (row, tile of the hidden dim): sum over the k routed experts, in routing order,
             of round(round(a_k @ Wd[e_k].T) * w_k), accumulated in float32 and rounded once, as
             HF's `.sum(dim=1)` over the top-k does; Qwen2-MoE's shared expert (its down product
             times sigmoid(gate), rounded) added last                                   (1 kernel)

Three launches per layer; no host sync (the expert ids never leave the device, so a CUDA graph
captures the block whatever the routing); no float atomics (each output element is summed by one
program in a fixed order), so the block is a deterministic function of its inputs and the captured
step equals the uncaptured one bit for bit. The arithmetic is HF's `batched_mm` / `grouped_mm`
(what `generate()` decodes with): the same rounding points, only the order of the multiply-adds
inside each product differs (and the float32 softmax's exp and sums round differently, by an ulp,
which moves a routing weight only where it is within an ulp of a rounding boundary). Ties in the
top-k pick the lower expert id first (torch.topk leaves the order of ties unspecified).

Where the family is known (`FAMILIES`: Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral,
OLMoE; transformers 5.x's fused experts `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`,
concatenated [gate; up], not transposed, no biases, SiLU; and gpt-oss, whose transposed, interleaved,
biased experts and clamped SwiGLU have gate/up and down kernels of their own (`block_oss`: tiles along the
[E, K, N] weights' rows, one program per (row, expert) pair and column tile, then a fixed-order combine:
four launches), and whose top-k-then-softmax router the shared routing reads under its `OSS` switch, at
HF's rounding points: each product rounded, its bias added and rounded, then each step of
`GptOssExperts._apply_gate` rounded; the router's bias added before its one rounding, as F.linear's
bias epilogue on CUDA) and the step has at most `MAX_TOKENS`
tokens (`MAX_GROUPED_TOKENS` without a shared expert), `plan()` lists the blocks, and `scope()` (entered
by `step.CompiledStep` around each call of its compiled function, like attention's) gives each listed block a forward that calls
`torch.ops.gdtool.moe_block`: a custom operator, opaque to dynamo and inductor, so the compiled HF
forward keeps everything else and calls the kernels in place of the block. Outside the scope the
blocks are HF's: the instance attribute is removed when the compiled call returns, so a step that
is dropped leaves nothing behind, and HF's kernels, generate() and other compiles of the model never
see the swap (a captured graph replays no Python, so the scope costs nothing after capture). The
operator reads HF's parameters where they are (no copy): an in-place update of the weights
(`param.data.copy_`) is what the next step reads, captured or not.

From GROUPED_FROM (2) to MAX_GROUPED_TOKENS tokens (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) the grouped kernels
below run instead: pairs sorted by expert on the device, tl.dot on tiles, a fixed-order combine (faster
than the small kernels from 2 tokens in the H200 sweeps: `GROUPED_FROM`). Qwen2-MoE, with its shared
expert, keeps the small kernels up to MAX_TOKENS.

The fast decode forward (`forward.py`: Qwen3-MoE, Mixtral, Qwen2-MoE at 1-8 rows) calls `block_triton`
itself, outside any compiled HF forward, with the layer's RMSNorm folded into the router and gate/up
kernels (`norm`) and its residual added in the down kernel (`residual`). The small kernels take the PDL
setting (`triton.launch_options`) as the forward's kernels do.

Two candidates for the small kernels were measured on the H200 and removed: gate/up streamed by a persistent
grid after a routing kernel (no faster, profiles/h200/moe-sweep-9e35b5d/) and the down kernel's routing and
weight loads before its PDL wait (slower, profiles/h200/moe-sweep-41fab16/, when down still routed its row from
the logits). Since the router kernel routes the row (`Config.routed`), down's early loads read the stored routing
(`Config.down_early`), and the router loads its weight rows early too (`router_early`).

Where Triton does not run (a CPU build of torch) the operator runs `block_reference`, HF's
batched_mm arithmetic in torch; under TRITON_INTERPRET=1 the Triton kernels run on a CPU (tests).

    plan(model, batch).table()                # one row per MoE layer: which path runs it, and why
    moe_block(x, router, gate_up, down, top_k, norm_topk, weights_f32)   # [M, H] -> [M, H]
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from . import swap
from .gemv import early_norm
from .triton import HAVE_TRITON, launch_options, next_pow2, tl, triton, untested_on_cuda, usable, zero_counts

if HAVE_TRITON:
    from .gemv import _scale_norm   # RMSNorm's roundings, one definition for every kernel that folds it in

MAX_TOKENS = 16      # tokens per step the small-batch kernels take (the grouped ones run from GROUPED_FROM)
MAX_EXPERTS = 1024   # the router's logits of one row are held in registers for the top-k
# (block class, experts class, router class) per family, by module name in transformers.models
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeExperts", "Qwen3MoeTopKRouter"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeExperts", "Qwen2MoeTopKRouter"),
    "mixtral": ("MixtralSparseMoeBlock", "MixtralExperts", "MixtralTopKRouter"),
    "olmoe": ("OlmoeSparseMoeBlock", "OlmoeExperts", "OlmoeTopKRouter"),
    "gpt_oss": ("GptOssMLP", "GptOssExperts", "GptOssTopKRouter"),
}
# gpt-oss's experts differ from the others in every place the kernels see (`block_oss`, `OSS` in the routing): transposed
# weights (gate_up_proj [E, H, 2I] with gate and up interleaved by column, down_proj [E, I, H]), biases on
# both products and on the router, the clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`
# with g = clamp(gate, max=limit), and the router's top-k taken over the logits before a softmax over the k.


# -- torch reference: HF's router and batched_mm experts, rounding point for rounding point --------

def route_reference(x, router_weight, top_k: int, norm_topk: bool, weights_f32: bool):
    """HF's TopKRouter.forward: (logits [M, E] model dtype, weights [M, k], expert ids [M, k] int64);
    the weights in float32 where the router keeps them so (Mixtral), else rounded to the model dtype."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, (values if weights_f32 else values.to(logits.dtype)), ids


def experts_reference(x, ids, weights, gate_up, down):
    """HF's batched_mm experts forward (generate()'s decode path): [M, H] -> [M, H]."""
    m, k = ids.shape
    e = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    gate, up = torch.bmm(gate_up[e], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    act = F.silu(gate) * up
    y = torch.bmm(down[e], act.unsqueeze(-1)).squeeze(-1)
    y = y * weights.reshape(-1, 1)
    return y.view(m, k, -1).sum(dim=1).to(x.dtype)


def shared_reference(x, gate_w, up_w, down_w, gate_router):
    """Qwen2-MoE's shared expert, times the sigmoid of its gate."""
    shared = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    return torch.sigmoid(F.linear(x, gate_router)) * shared


def route_reference_oss(x, router_weight, router_bias, top_k: int):
    """GptOssTopKRouter.forward: the k largest logits (bias added), then a softmax over those k in float32,
    rounded to the model dtype (`softmax(dtype=logits.dtype)`); (logits, weights [M, k], ids [M, k])."""
    logits = F.linear(x, router_weight, router_bias)
    values, ids = torch.topk(logits, top_k, dim=-1)
    return logits, torch.softmax(values, dim=1, dtype=values.dtype), ids


def experts_reference_oss(x, ids, weights, gate_up, gate_up_bias, down, down_bias, alpha: float, limit: float):
    """HF's batched_mm experts forward for GptOssExperts (is_transposed, has_bias, interleaved [gate, up]
    columns, GptOssExperts._apply_gate): [M, H] -> [M, H]. grouped_mm rounds at the same points."""
    m, k = ids.shape
    e = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    gate_up_out = torch.bmm(xs.unsqueeze(1), gate_up[e]).squeeze(1)
    gate_up_out.add_(gate_up_bias[e])
    gate, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    y = torch.bmm(act.unsqueeze(1), down[e]).squeeze(1)
    y.add_(down_bias[e])
    y = y * weights.reshape(-1, 1)
    return y.view(m, k, -1).sum(dim=1).to(x.dtype)


def block_reference(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32,
                    shared_gate=None, shared_up=None, shared_down=None, shared_router=None, oss=None):
    """One block in torch. `oss`, for gpt-oss: (router_bias, gate_up_bias, down_bias, alpha, limit)."""
    if oss is not None:
        router_bias, gate_up_bias, down_bias, alpha, limit = oss
        _, weights, ids = route_reference_oss(x, router_weight, router_bias, top_k)
        return experts_reference_oss(x, ids, weights, gate_up, gate_up_bias, down, down_bias, alpha, limit)
    _, weights, ids = route_reference(x, router_weight, top_k, norm_topk, weights_f32)
    out = experts_reference(x, ids, weights, gate_up, down)
    if shared_gate is not None:
        out = out + shared_reference(x, shared_gate, shared_up, shared_down, shared_router)
    return out


# -- Triton kernels -------------------------------------------------------------------------------

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

    # gpt-oss's experts are stored the other way round: [E, K, N], each weight row a row of the reduction, its
    # N outputs contiguous. A program of the kernels above reads rows of the N dimension, which here would be
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


# -- launch ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """Rows per program tile and warps of each kernel (tuned per shape on the H200, `experts_config`)."""
    router_rows: int
    gate_up_rows: int
    down_rows: int
    warps: int = 4
    chunk: int | None = None   # elements of a weight row one load of gate/up and down covers (None: MAX_CHUNK)
    routed: bool = False       # the router kernel routes (its last program per row); gate/up reads the ids
    stacked: bool = False      # down: the k experts' tiles of a program as one load, one sum per chunk
    packed: bool = False       # routed: the top-k one reduction a round over packed keys, not a max and a min
    router_warps: int | None = None   # the router kernel's warps (None: warps)
    down_warps: int | None = None     # the down kernel's warps (None: warps)
    router_early: bool = False   # the router's weight rows (first chunk) loaded before its PDL wait
    down_early: bool = False     # stacked: down's routing and weight tiles loaded before its PDL wait

    def __post_init__(self):
        if self.chunk is not None and (self.chunk < 1 or self.chunk & (self.chunk - 1)):
            raise ValueError(f"Config(chunk={self.chunk}): a load covers a power of two of a row's elements "
                             "(e.g. 512, 1024, 4096), or None for MAX_CHUNK")
        for name in ("warps", "router_warps", "down_warps"):
            value = getattr(self, name)
            if value is not None and value not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"Config({name}={value}): a kernel runs a power of two of warps, 1 to 32"
                                 + ("" if name == "warps" else ", or None for `warps`"))
        if self.down_early and not (self.routed and self.stacked):
            raise ValueError("Config(down_early=True): down reads the routing before its PDL wait only where the "
                             "router kernel wrote it, two kernels back (routed=True), into its stacked tiles "
                             "(stacked=True); set both")
        if self.packed and not self.routed:
            raise ValueError("Config(packed=True): the packed top-k runs in the router kernel's routing; "
                             "set routed=True too")


MAX_CHUNK = 4096   # elements of a weight row one load covers; longer rows are read in static chunks


def _chunks(k: int, limit: int | None = None) -> tuple[int, int]:
    block = min(next_pow2(k), limit or MAX_CHUNK)
    return block, -(-k // block)


def experts_config(hidden: int, intermediate: int, tokens: int = 1) -> Config:
    """Gate/up: 16K weight elements per program at one token (8 rows of 2048, 8 warps), 8K above it (4 rows,
    4 warps); down: 4K (4 rows of 1024); the router's whole rows, 4K per program. Above one token both read
    their rows 1024 elements a load (34.7 us a block against 36.6 with whole 2048-element rows). At one token
    the rows are routed once in the router kernel (`routed`), down reads its k experts as one load
    (`stacked`), and both read 256 elements a load (a warp's 32 x 8: each chunk's sum stays in a warp): 30.5 us
    a block against 35.0 for the same tiles unrouted at 1024 (profiles/h200/moe-sweep-39ace1a/); the top-k there
    one reduction a round over packed keys (`packed`): 30.42 us against 30.86 (moe-sweep-5260519/); and the router
    one row a program in one warp (its routing's reductions in shuffles), down half the rows in 4 warps (more
    programs an SM): 28.68 us against 30.44 (moe-sweep-79cb9d0/, SMALL_TUNED_FROM; rows longer than 4096 elements keep
    1024-element loads, their static chunks few). The fastest small-kernel
    configs of the H200 sweeps at Qwen3-30B-A3B's shapes (profiles/moe_sweep.py; tests/test_experts.py holds
    this to them); other shapes keep the elements per program of gate/up and down (the router's one row in one
    warp, and down's 4 warps, at one token everywhere). At one token the router's weight rows, and down's routing
    and weight tiles, load before their PDL wait (`router_early`, `down_early`: moe_sweep.py's "early" grid, a
    chain of blocks, times them)."""
    kh, ki = _chunks(hidden)[0], _chunks(intermediate)[0]
    one = tokens == 1
    base = Config(router_rows=max(1, min(16, 4096 // kh)),
                  gate_up_rows=max(1, min(16, (16384 if one else 8192) // kh)),
                  down_rows=max(1, min(16, 4096 // ki)), warps=8 if one and kh >= 2048 else 4, chunk=1024)
    if one:
        return replace(base, chunk=256 if max(kh, ki) <= 4096 else 1024, routed=True, stacked=True, packed=True,
                       router_rows=1, router_warps=1, down_rows=max(1, base.down_rows // 2), down_warps=4,
                       router_early=True, down_early=True)
    return base


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
    cfg = config or experts_config(h, i, m)
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


@dataclass(frozen=True)
class OssConfig:
    """gpt-oss's gate/up and down kernels: output columns per program (gate/up: intermediate columns, each
    a gate and an up column), the reduction rows each step of the loop reads, warps. gpt-oss-20b at one token
    has ~360 programs of each (2.7 per H200 multiprocessor), each reading 64 or 128 contiguous bytes per
    weight row and 8K-element tiles: the fastest of the H200 sweep at one token (TUNED_FROM; from
    GROUPED_FROM tokens the grouped kernels run). Routing the rows in the router kernel (as `Config.routed`) was
    no faster here: 64.50 against 62.96 us a block at these tiles, the fastest of 108 configs
    (profiles/h200/moe-sweep-a7748ba/, one block captured at one token), and was removed."""
    gate_up_cols: int = 32
    down_cols: int = 32
    block_k: int = 128
    warps: int = 4


def block_oss(x, router_weight, gate_up, down, top_k, router_bias, gate_up_bias, down_bias, alpha, limit,
              config: OssConfig | None = None, intermediates: dict | None = None):
    """gpt-oss's block in four kernels: the router (its bias), gate/up and down along the [E, K, N] weights'
    rows, per (row, expert) pair, then the fixed-order combine over each row's k pairs. x [M, H] -> [M, H]."""
    m, h = x.shape
    e, _, two_i = gate_up.shape
    i = two_i // 2
    cfg = config or OssConfig()
    dev = x.device
    ids = torch.empty(m, top_k, device=dev, dtype=torch.int32)
    weights = torch.empty(m, top_k, device=dev, dtype=torch.float32)
    act = torch.empty(m * top_k, i, device=dev, dtype=x.dtype)
    y = torch.empty(m * top_k, h, device=dev, dtype=torch.float32)
    out = torch.empty(m, h, device=dev, dtype=x.dtype)
    logits = _logits(x, router_weight, None, router_bias, e, experts_config(h, i))
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


COMBINE_COLS = 256   # output columns per program of gpt-oss's combine (its sums read 4 float32 rows)


# -- the grouped path: 2-64 tokens per step (GROUPED_FROM) -----------------------------------------
# With several tokens the same expert serves several rows, and a matrix-vector product per (row, expert)
# would read it once per row. The grouped kernels read each routed expert once per tile of its rows:
#
#    route    per row: ids and routing weights, as the small path's gate/up programs compute them  (1)
#    align    per expert (and one more for the tail): the M*k (row, k) pairs sorted by expert (stable:
#             by pair index within an expert), each expert's run padded to BLOCK_M slots, padding -1;
#             which expert each tile of BLOCK_M slots belongs to (-1 past the last). Fixed sizes, worst
#             case: M*k pairs plus BLOCK_M - 1 padding per expert that can appear (min(E, M*k)); no
#             host read                                                                            (1)
#    gate_up  per (tile, N tile): the tile's pairs' x rows @ [Wg; Wu][e].T with tl.dot, rounded, SiLU,
#             rounded, times up, rounded; written to the pair's own row of act [M*k, I]              (1)
#    down     per (tile, N tile): act rows @ Wd[e].T, rounded, times the pair's weight (rounded, or
#             float32 for Mixtral), written to the pair's own row of y [M*k, H]                      (1)
#    combine  per (row, H tile): sum over its k pairs in routing order in float32, rounded once      (1)
#
# Same rounding points as the small path and HF's batched_mm / grouped_mm; no atomics, a fixed order
# of every sum: deterministic. Tile sizes: GROUPED_CONFIGS (tuned on the H200).

MAX_GROUPED_TOKENS = 64
ALIGN_ELEMENTS = 4096   # (expert, pair) comparisons an align program holds at a time: [BLOCK_E, 4096 // BLOCK_E]
ALIGN_TAIL = 1024        # slots the align kernel's tail program fills with -1 at a time
GROUPED_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")   # no shared expert (gpt-oss: its own layout)


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int      # sorted (token, expert) slots per tile: rows of each tl.dot
    block_n: int      # output columns per program
    block_k: int      # reduction step
    warps: int = 4
    stages: int = 2


# one table, by the largest token count each row covers: per batch of the H200 sweeps (qwen3-30b-a3b at 1, 2, 4,
# ..., 64 tokens, gpt-oss-20b at 1, 4, 16, 32, 64), the config whose worst time over the models swept there is
# nearest their fastest (profiles/moe_sweep.py `steadiest`; tests/test_experts.py holds the table to the sweeps
# named in TUNED_FROM). qwen3-30b-a3b's sweep at c6bba88 (the align kernel one program per expert) took 307.8 us
# a block at 64 tokens, 580 before it; gpt-oss-20b's is the one at 0f91d78.
_A = GroupedConfig(block_m=16, block_n=64, block_k=128, warps=4, stages=3)
GROUPED_CONFIGS = ((2, _A), (4, GroupedConfig(block_m=16, block_n=64, block_k=64, warps=4, stages=3)), (32, _A),
                   (MAX_GROUPED_TOKENS, GroupedConfig(block_m=16, block_n=128, block_k=128, warps=8, stages=3)))
# the sweeps the tiles above and experts_config / OssConfig were read from (profiles/moe_sweep.py wrote them):
# one CSV per preset; every config in them was checked against the torch reference on the H200 (column `ok`)
TUNED_FROM = ("profiles/h200/moe-sweep-c6bba88/qwen3-30b-a3b.csv", "profiles/h200/moe-sweep-0f91d78/gpt-oss-20b.csv")
# the small kernels at one token since their routing moved into the router kernel (`Config.routed`, `stacked`):
# that sweep's batch-1 pick is experts_config's at one token (the batches above keep TUNED_FROM's picks)
SMALL_TUNED_FROM = "profiles/h200/moe-sweep-79cb9d0/qwen3-30b-a3b.csv"
# tokens per step from which the grouped kernels run (families without a shared expert; the others keep the
# small kernels up to MAX_TOKENS): one past the largest swept batch where the small kernels won in either model
# (`moe_sweep.grouped_from`). The grouped kernels won at every batch from 2 (qwen3-30b-a3b: 50 against 57 us a
# block at 2 tokens, 207 against 328 at 16; gpt-oss-20b: 142 against 190 at 4); at 1 gpt-oss-20b's small kernels
# won by 0.3% (62.7 against 62.9 us; qwen3-30b-a3b's grouped ones by 6%, 34.5 against 36.7). The fast forward's
# MoE layers (<= 4 rows) keep the small kernels, which take the layer's norm and residual.
GROUPED_FROM = 2
# (the grouped path's routing in the router kernel, no route kernel, was no faster: 36.6 against 35.9 us a block
# at 1 token, 51.4 against 51.1 at 2, profiles/h200/moe-sweep-39ace1a/ variant "grouped-routed"; removed)


def runs_grouped(family: str, tokens: int) -> bool:
    """Whether a block of `family` at `tokens` rows runs the grouped kernels (else the small ones)."""
    return family in GROUPED_FAMILIES and tokens >= GROUPED_FROM


def grouped_config(tokens: int) -> GroupedConfig:
    for limit, config in GROUPED_CONFIGS:
        if tokens <= limit:
            return config
    return GROUPED_CONFIGS[-1][1]


def grouped_slots(pairs: int, experts: int, block_m: int) -> int:
    """Slots of the sorted buffer in the worst case: every pair, plus a partly filled tile per expert that
    can appear; a multiple of block_m."""
    worst = pairs + min(experts, pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m


if HAVE_TRITON:
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
                                BLOCK_K: tl.constexpr, OSS: tl.constexpr):
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
                    acc = tl.dot(x, w, acc)
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
                    g = tl.dot(x, wg, g)
                    u = tl.dot(x, wu, u)
                g = g.to(out_ty).to(tl.float32)
                u = u.to(out_ty).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
                act = (a * u).to(out_ty)
            tl.store(act_ptr + pairs[:, None].to(tl.int64) * I + n[None, :], act, mask=real[:, None] & nmask[None, :])

    @triton.jit
    def _grouped_down_kernel(act_ptr, d_ptr, db_ptr, wts_ptr, sorted_ptr, tile_expert_ptr, y_ptr, H, I,
                             W_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, OSS: tl.constexpr):
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
                acc = tl.dot(a, w, acc)
            y = acc.to(out_ty).to(tl.float32)
            if OSS:
                bias = tl.load(db_ptr + expert.to(tl.int64) * H + n, mask=nmask, other=0.0).to(tl.float32)
                y = (y + bias[None, :]).to(out_ty).to(tl.float32)
            weight = tl.load(wts_ptr + safe, mask=real, other=0.0)
            y = y * weight[:, None]
            if not W_F32:
                y = y.to(out_ty).to(tl.float32)
            tl.store(y_ptr + safe[:, None].to(tl.int64) * H + n[None, :], y, mask=real[:, None] & nmask[None, :])

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
    """The grouped kernels (GROUPED_FROM-64 tokens; families without a shared expert): x [M, H] -> [M, H]. `oss`, for
    gpt-oss: (router_bias, gate_up_bias, down_bias, alpha, limit), the weights in its layout."""
    m, h = x.shape
    e = gate_up.shape[0]
    i = (gate_up.shape[2] if oss else gate_up.shape[1]) // 2
    router_bias, gate_up_bias, down_bias, alpha, limit = oss or (None, gate_up, down, 0.0, 0.0)
    cfg = config or grouped_config(m)
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
    logits = _logits(x, router_weight, None, router_bias, e, experts_config(h, i))
    _route_kernel[(m,)](logits, ids, weights, e, logits.stride(0), TOPK=top_k, BLOCK_TOPK=next_pow2(top_k),
                        BLOCK_E=next_pow2(e), NORM=norm_topk, W_F32=weights_f32, OSS=oss is not None)
    align(ids, order, tile_expert, e, cfg.block_m)
    tiles = slots // cfg.block_m
    _grouped_gate_up_kernel[(tiles, triton.cdiv(i, cfg.block_n))](
        x, gate_up, gate_up_bias, order, tile_expert, act, h, i, x.stride(0), float(alpha), float(limit), TOPK=top_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OSS=oss is not None, num_warps=cfg.warps,
        num_stages=cfg.stages)
    _grouped_down_kernel[(tiles, triton.cdiv(h, cfg.block_n))](
        act, down, down_bias, weights, order, tile_expert, y, h, i, W_F32=weights_f32, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, OSS=oss is not None, num_warps=cfg.warps, num_stages=cfg.stages)
    _combine_kernel[(triton.cdiv(h, cfg.block_n), m)](y, out, h, out.stride(0), TOPK=top_k, BLOCK_N=cfg.block_n)
    if intermediates is not None:
        intermediates.update(logits=logits, ids=ids, weights=weights, act=act, order=order, tile_expert=tile_expert)
    return out


# -- the operator the compiled HF forward calls ----------------------------------------------------

@torch.library.custom_op("gdtool::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, norm_topk: bool, weights_f32: bool, shared_gate: torch.Tensor | None = None,
              shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
              shared_router: torch.Tensor | None = None, router_bias: torch.Tensor | None = None,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """One MoE block, x [M, H] -> [M, H]: the Triton kernels where they run (CUDA, or Triton's interpreter;
    the grouped ones from GROUPED_FROM to MAX_GROUPED_TOKENS rows where there is no shared expert, else the
    small-batch kernels up to MAX_TOKENS rows), HF's
    batched_mm arithmetic in torch elsewhere. The biases (all three) and alpha, limit are gpt-oss's:
    given, the weights are in its layout and routing."""
    oss = None if gate_up_bias is None else (router_bias, gate_up_bias, down_bias, alpha, limit)
    args = (x, router_weight, gate_up, down, top_k, norm_topk, weights_f32,
            shared_gate, shared_up, shared_down, shared_router, oss)
    if usable(x, gate_up, down):
        if shared_gate is None and x.shape[0] >= GROUPED_FROM:   # GROUPED_FAMILIES: those without a shared expert
            return block_grouped(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32, oss=oss)
        return block_triton(*args)
    return block_reference(*args)


@moe_block.register_fake
def _(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32, shared_gate=None, shared_up=None,
      shared_down=None, shared_router=None, router_bias=None, gate_up_bias=None, down_bias=None, alpha=0.0, limit=0.0):
    return torch.empty_like(x)


# -- which blocks run it: the plan, and the swap for the duration of a compiled call -------------

@dataclass
class Layer:
    index: int            # decoder layer (order of the blocks in the model)
    name: str             # module path
    block: object
    family: str           # transformers model type, or "" where unknown
    applies: bool
    reason: str
    forward: object = None  # the block's forward while the scope is entered

    @property
    def path(self) -> str:
        return "gdtool experts kernels" if self.applies else "HF block"


@dataclass
class Plan:
    """The MoE blocks of a model at one batch size: which run gdtool's kernels, and why not."""
    layers: list = field(default_factory=list)
    backend: str = ""

    @property
    def applies(self) -> bool:
        return any(layer.applies for layer in self.layers)

    def key(self) -> tuple:
        return tuple(layer.index for layer in self.layers if layer.applies)

    def note(self) -> str:
        """One line for the kernels note: layer ranges per path, with the reason where HF's block stays."""
        if not self.layers:
            return ""
        groups: dict = {}
        for layer in self.layers:
            groups.setdefault((layer.applies, layer.reason), []).append(layer.index)
        parts = []
        for (applies, reason), indices in groups.items():
            where = f"layers {_ranges(indices)}"
            parts.append(f"{where} in gdtool's kernels ({reason})" if applies else f"{where} HF's ({reason})")
        return f"MoE blocks {len([x for x in self.layers if x.applies])}/{len(self.layers)}: " + "; ".join(parts)

    def table(self) -> "pandas.DataFrame":
        import pandas as pd
        return pd.DataFrame([dict(layer=x.index, module=x.name, block=type(x.block).__name__, family=x.family,
                                  path=x.path, reason=x.reason) for x in self.layers],
                            columns=["layer", "module", "block", "family", "path", "reason"])


def _ranges(indices: list) -> str:
    out, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def _family(block) -> str:
    for family, (block_name, _, _) in FAMILIES.items():
        if type(block).__name__ == block_name and type(block).__module__.endswith(f"modeling_{family}"):
            return family
    return ""


def is_moe_block(module) -> bool:
    """A sparse-MoE block: a known family's, or any module holding transformers' experts (with its router)."""
    if _family(module):
        return True
    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.Module) and hasattr(experts, "is_concatenated")


def refusal(block, tokens: int, small: bool = False) -> str:
    """'' when gdtool's kernels run this MoE block at `tokens` rows exactly as its HF forward (up to rounding
    order), else why not. small=True: the small kernels at any token count (the fast forward's MoE layers)."""
    return _why_not(block, _family(block), tokens, small)


def _why_not(block, family: str, tokens: int, small: bool = False) -> str:
    """'' when the kernels compute this block exactly as its HF forward does (up to rounding order)."""
    if not family:
        return f"{type(block).__name__} is not a known family ({', '.join(FAMILIES)})"
    _, experts_name, router_name = FAMILIES[family]
    experts, router = block.experts, _router(block)
    if type(experts).__name__ != experts_name or type(router).__name__ != router_name:
        return f"experts or router other than transformers' {experts_name} / {router_name}"
    if tokens > MAX_GROUPED_TOKENS:
        return f"{tokens} tokens per step > {MAX_GROUPED_TOKENS}: many tokens per expert, HF's grouped_mm"
    if tokens > MAX_TOKENS and family not in GROUPED_FAMILIES:
        return (f"{tokens} tokens per step > {MAX_TOKENS} and the grouped kernels (up to {MAX_GROUPED_TOKENS}) "
                f"take {', '.join(GROUPED_FAMILIES)} only")
    oss = family == "gpt_oss"
    flags = dict(has_gate=True, is_concatenated=not oss, is_transposed=oss, has_bias=oss,
                 has_post_expert_norm=False, _is_expert_parallel=False)
    off = [name for name, want in flags.items() if getattr(experts, name, want) != want]
    if off:
        return (f"experts with {off[0]}={getattr(experts, off[0])!r} (the kernels read "
                + ("gpt-oss's transposed, interleaved, biased layout)" if oss else "[gate; up] rows, no bias)"))
    gate_up, down, router_weight = experts.gate_up_proj, experts.down_proj, router.weight
    if oss:
        # GptOssExperts._apply_gate, the clamped SwiGLU, is what the kernels compute; a subclass's other one is not
        if type(experts)._apply_gate is not _oss_apply_gate() or not all(
                isinstance(getattr(experts, name, None), (int, float)) for name in ("alpha", "limit")):
            return "gpt-oss experts with a gate other than GptOssExperts._apply_gate (alpha, limit)"
        e, h, two_i = gate_up.shape
        layout = down.shape == (e, two_i // 2, h) and experts.gate_up_proj_bias.shape == (e, two_i) and \
            experts.down_proj_bias.shape == (e, h) and router.bias is not None and router.bias.shape == (e,)
        if not layout or router_weight.shape != (e, h):
            return "expert weights not in gpt-oss's [E, H, 2I] / [E, I, H] layout with biases"
    else:
        if type(experts.act_fn).__name__ not in ("SiLU", "SiLUActivation") or \
                getattr(experts.config, "hidden_act", "silu") != "silu":
            return f"experts activation {type(experts.act_fn).__name__}, not SiLU"
        e, two_i, h = gate_up.shape
        if down.shape != (e, h, two_i // 2) or router_weight.shape != (e, h):
            return "expert weights not in [E, 2I, H] / [E, H, I] layout"
    if e > MAX_EXPERTS or router.top_k > e:
        return f"{e} experts (at most {MAX_EXPERTS}) or top-k {router.top_k} over them"
    tensors = [gate_up, down, router_weight]
    if oss:
        tensors += [experts.gate_up_proj_bias, experts.down_proj_bias, router.bias]
    if family == "qwen2_moe":
        mlp, gate = block.shared_expert, block.shared_expert_gate
        if getattr(mlp.config, "hidden_act", "silu") != "silu" or any(
                getattr(lin, "bias", None) is not None for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, gate)):
            return "a shared expert with biases or an activation other than SiLU"
        tensors += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.weight]
    if any(not t.is_contiguous() for t in tensors):
        return "expert weights that are not contiguous"
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return "expert weights of mixed dtypes or devices"
    if gate_up.device.type == "cuda":
        if not HAVE_TRITON:
            return "no Triton"
        if gate_up.dtype not in (torch.bfloat16, torch.float16):
            return f"{gate_up.dtype} weights on CUDA (bf16 or fp16 only)"
    grouped = runs_grouped(family, tokens) and not small
    return untested_on_cuda(f"{family} experts" + (", grouped" if grouped else ""), gate_up.device)


def _router(block):
    """The block's router module (gpt-oss calls it `router`, the others `gate`)."""
    return block.router if _family(block) == "gpt_oss" else block.gate


def _oss_apply_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    return GptOssExperts._apply_gate


def _router_args(block, family: str) -> tuple:
    router = _router(block)
    if family == "gpt_oss":   # top-k of the logits, softmax over the k (no renormalization), rounded
        return int(router.top_k), False, False
    # Mixtral's router always renormalizes and keeps its weights in float32; the others round them
    norm = True if family == "mixtral" else bool(router.norm_topk_prob)
    return int(router.top_k), norm, family == "mixtral"


def block_args(block) -> tuple:
    """What `block_reference` and `block_triton` take after x, read off a known family's block: router weight,
    gate_up, down, top_k, norm_topk, weights_f32, the shared expert's four weights (Qwen2-MoE; else None) and
    gpt-oss's (router_bias, gate_up_bias, down_bias, alpha, limit) (else None)."""
    family = _family(block)
    top_k, norm, weights_f32 = _router_args(block, family)
    experts, router = block.experts, _router(block)
    shared = (None,) * 4
    if family == "qwen2_moe":
        mlp = block.shared_expert
        shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, block.shared_expert_gate.weight)
    oss = None
    if family == "gpt_oss":
        oss = (router.bias, experts.gate_up_proj_bias, experts.down_proj_bias, float(experts.alpha),
               float(experts.limit))
    return (router.weight, experts.gate_up_proj, experts.down_proj, top_k, norm, weights_f32, *shared, oss)


def make_forward(block, family: str):
    """The block's forward through `moe_block`: HF's arguments, HF's result ([B, S, H])."""
    original = type(block).forward
    oss = family == "gpt_oss"
    limit = MAX_GROUPED_TOKENS if family in GROUPED_FAMILIES else MAX_TOKENS

    def forward(hidden_states):
        b, s, h = hidden_states.shape
        if b * s > limit:  # a shape the step never has (decode is one token per row); HF's block
            return original(block, hidden_states)
        (router_weight, gate_up, down, top_k, norm, weights_f32, shared_gate, shared_up, shared_down, shared_router,
         oss_args) = block_args(block)
        extra = {}
        if shared_gate is not None:
            extra = dict(shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down,
                         shared_router=shared_router)
        if oss_args is not None:
            extra = dict(zip(("router_bias", "gate_up_bias", "down_bias", "alpha", "limit"), oss_args))
        out = torch.ops.gdtool.moe_block(hidden_states.reshape(b * s, h), router_weight, gate_up, down, top_k, norm,
                                         weights_f32, **extra).reshape(b, s, h)
        # GptOssMLP returns (hidden states, router scores); its decoder layer drops the scores
        return (out, None) if oss else out
    return forward


def plan(model, batch: int) -> Plan:
    """The model's MoE blocks at `batch` rows of one decode token each: which run gdtool's kernels."""
    result = Plan()
    blocks = [(name, module) for name, module in model.named_modules() if is_moe_block(module)]
    param = next(model.parameters())
    result.backend = "Triton" if usable(param) else "torch reference (no Triton on this device)"
    for index, (name, block) in enumerate(blocks):
        family = _family(block)
        why = _why_not(block, family, batch)
        layer = Layer(_layer_index(name, index), name, block, family, not why,
                      why or f"{family}, top-{_router(block).top_k} of {block.experts.gate_up_proj.shape[0]}, "
                             + ("grouped, " if runs_grouped(family, batch) else "") + result.backend)
        if layer.applies:
            layer.forward = make_forward(block, family)
        result.layers.append(layer)
    return result


def _layer_index(name: str, default: int) -> int:
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    return default


@contextmanager
def scope(moe_plan: Plan | None):
    """The planned blocks run gdtool's kernels inside this scope; each block's own forward is back on exit
    (whatever happens inside: `swap.forwards`)."""
    layers = moe_plan.layers if moe_plan is not None else []
    with swap.forwards((layer.block, layer.forward) for layer in layers if layer.applies):
        yield
