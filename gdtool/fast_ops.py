"""The decode kernels as torch operators, so that torch.compile traces the step around them.

Each operator runs the Triton kernel where it can (`fast_triton.usable`: CUDA tensors with Triton,
or Triton's CPU interpreter) and its torch reference otherwise (a CPU build of torch), with the same
arguments and result. Inductor keeps them as opaque calls inside the compiled step (each has a fake
implementation for shapes), and gdtool captures the step with them inside as it captures any step.

    gdtool::rms_gemv(x, norm_weight?, eps, weight, weight2?, residual?, out_f32)  -> [M, N]
    gdtool::qkv_rope(x, norm_weight, eps, wq, wk, wv, cos, sin, k_cache!, v_cache!, slot) -> q [M, Hq, D]
    gdtool::decode_attention(q, k_cache, v_cache, mask, slot, scale)               -> [M, Hq * D]
    gdtool::argmax(x)                                                               -> [M] int64
(`!`: written in place: the cache slot.)
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fast_gemv, fast_splitkv
from .fast_triton import usable

_NS = "gdtool"


@torch.library.custom_op(f"{_NS}::rms_gemv", mutates_args=())
def rms_gemv(x: torch.Tensor, norm_weight: Optional[torch.Tensor], eps: float, weight: torch.Tensor,
             weight2: Optional[torch.Tensor], residual: Optional[torch.Tensor], out_f32: bool) -> torch.Tensor:
    if usable(x, weight):
        return fast_gemv.rms_gemv(x, norm_weight, eps, weight, weight2, residual, out_f32)
    if weight2 is not None:
        return fast_gemv.gate_up_reference(x, norm_weight, eps, weight, weight2)
    return fast_gemv.rms_gemv_reference(x, norm_weight, eps, weight, residual, out_f32)


@rms_gemv.register_fake
def _(x, norm_weight, eps, weight, weight2, residual, out_f32):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32 if out_f32 else x.dtype)


@torch.library.custom_op(f"{_NS}::qkv_rope", mutates_args=("k_cache", "v_cache"))
def qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, wq: torch.Tensor, wk: torch.Tensor,
             wv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot: torch.Tensor) -> torch.Tensor:
    if usable(x, wq, k_cache):
        return fast_gemv.qkv_rope(x, norm_weight, eps, wq, wk, wv, cos, sin, k_cache, v_cache, slot)
    return fast_gemv.qkv_rope_reference(x, norm_weight, eps, wq, wk, wv, cos, sin, k_cache, v_cache, slot)


@qkv_rope.register_fake
def _(x, norm_weight, eps, wq, wk, wv, cos, sin, k_cache, v_cache, slot):
    d = k_cache.shape[-1]
    return x.new_empty((x.shape[0], wq.shape[0] // d, d))


@torch.library.custom_op(f"{_NS}::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     slot: torch.Tensor, scale: float) -> torch.Tensor:
    if usable(q, k_cache):
        return fast_splitkv.decode_attention(q, k_cache, v_cache, mask, slot, scale)
    return fast_splitkv.decode_attention_reference(q, k_cache, v_cache, mask, slot, scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, mask, slot, scale):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


@torch.library.custom_op(f"{_NS}::argmax", mutates_args=())
def argmax(x: torch.Tensor) -> torch.Tensor:
    if usable(x):
        return fast_splitkv.argmax(x)
    return fast_splitkv.argmax_reference(x)


@argmax.register_fake
def _(x):
    return x.new_empty((x.shape[0],), dtype=torch.long)
