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

From `grouped_from` (2 on the H200; on the H100 5, and 2 for gpt-oss) to MAX_GROUPED_TOKENS tokens (Qwen3-MoE,
Mixtral, OLMoE, gpt-oss) the grouped kernels (`grouped.py`) run instead: pairs sorted by expert on the device, tl.dot
on tiles, a fixed-order combine (where the device's sweeps found them faster than the small kernels: the tuning's
experts_grouped.from_tokens, and experts_oss.grouped_from against gpt-oss's own). Qwen2-MoE, with its shared expert,
keeps the small kernels up to MAX_TOKENS.

The fast decode forward (`forward.py`: Qwen3-MoE, Mixtral, Qwen2-MoE at 1-8 rows) calls `block_triton`
itself, outside any compiled HF forward, with the layer's RMSNorm folded into the router and gate/up
kernels (`norm`) and its residual added in the down kernel (`residual`). The small kernels take the PDL
setting (`triton.launch_options`) as the forward's kernels do.

Two candidates for the small kernels were measured on the H200 and removed: gate/up streamed by a persistent
grid after a routing kernel (no faster, profiles/h200/moe-sweep-9e35b5d/) and a down kernel that routes its row
from the logits itself, with that routing and its weight loads before its PDL wait (slower,
profiles/h200/moe-sweep-41fab16/). The router kernel routes the row (`Config.routed`); down loads the stored
routing and its weight tiles before the wait (`Config.down_early`), and the router its weight rows
(`router_early`).

Where Triton does not run (a CPU build of torch) the operator runs `block_reference`, HF's
batched_mm arithmetic in torch; under TRITON_INTERPRET=1 the Triton kernels run on a CPU (tests).

    plan(model, batch).table()                # one row per MoE layer: which path runs it, and why
    moe_block(x, router, gate_up, down, top_k, norm_topk, weights_f32)   # [M, H] -> [M, H]

The modules, each importing only those listed before it:

    tiles.py      what runs where and with which tiles: token limits, Config / OssConfig / GroupedConfig, the
                  configs read from the H200 sweeps (plain Python)
    reference.py  HF's router and batched_mm experts in torch, rounding point for rounding point
    router.py     the router kernel and the top-k routing every path shares
    oss.py        gpt-oss's gate/up and down kernels, and the fixed-order combine
    small.py      the small-batch kernels up to MAX_TOKENS (`block_triton`; gpt-oss's through `block_oss`)
    grouped.py    the grouped kernels from `grouped_from` to MAX_GROUPED_TOKENS (`block_grouped`)
    blocks.py     HF's blocks: `plan`, `refusal`, the `gdtool::moe_block` operator, `scope`

A setting a test or probe changes is changed where it is read: `tiles.MAX_CHUNK`, `router.early_norm`,
`reference.block_reference` (the names below are copies: assigning one of them here changes nothing).
"""
from __future__ import annotations

from .blocks import (FAMILIES, Layer, Plan, block_args, is_moe_block, make_forward, moe_block, plan, refusal,
                     scope)
from .grouped import align, block_grouped
from .oss import block_oss
from .reference import (block_reference, experts_reference, experts_reference_oss, route_reference,
                        route_reference_oss, shared_reference)
from .router import Routing
from .small import block_triton
from .tiles import (ALIGN_ELEMENTS, ALIGN_TAIL, COMBINE_COLS, GROUPED_FAMILIES, MAX_CHUNK, MAX_EXPERTS,
                    MAX_GROUPED_TOKENS, MAX_TOKENS, Config, GroupedConfig, OssConfig, experts_config, grouped_config,
                    grouped_from, grouped_slots, oss_config, runs_grouped)

__all__ = ["FAMILIES", "Layer", "Plan", "block_args", "is_moe_block", "make_forward", "moe_block", "plan",
           "refusal", "scope", "align", "block_grouped", "block_oss", "block_reference", "experts_reference",
           "experts_reference_oss", "route_reference", "route_reference_oss", "shared_reference", "Routing",
           "block_triton", "ALIGN_ELEMENTS", "ALIGN_TAIL", "COMBINE_COLS", "GROUPED_FAMILIES", "MAX_CHUNK",
           "MAX_EXPERTS", "MAX_GROUPED_TOKENS", "MAX_TOKENS", "Config", "GroupedConfig", "OssConfig", "experts_config",
           "grouped_config", "grouped_from", "grouped_slots", "oss_config", "runs_grouped"]

from ...core.reexports import guard as _guard

_guard(__name__, ("tiles", "reference", "router", "oss", "small", "grouped", "blocks"))
