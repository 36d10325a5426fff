"""The decode forward of a Llama model in gdtool's own kernels (`kernels="fast"`, small batch).

HF's forward at one token per row runs, per layer, ~13 kernels around 7 matrix products. This one
runs six, over HF's own weights and HF's own static cache:

    qkv_rope          RMSNorm + q/k/v products + RoPE + k/v written at the cache slot
    decode_attention  split-KV attention over the live slots, then its combine (2 kernels)
    rms_gemv          o projection + residual add
    rms_gemv          RMSNorm + gate/up products + SiLU * up
    rms_gemv          down projection + residual add

then RMSNorm + lm_head (float32 logits, as the step reads them), the embedding lookup and one
update of the layers' cache counters: 99 kernels for a 16-layer model. The RoPE angles are computed
inside `qkv_rope` from HF's own `inv_freq` buffer and scaling (Llama 3's scaled RoPE included), as
HF's rotary embedding computes them. The forward runs eagerly, outside torch.compile (its calls
are kernels already); select and update around it stay compiled, and gdtool captures the whole
step as usual.

`plan(model, batch)` says whether it applies and why not: a Llama decoder layer stack exactly as
transformers writes it (RMSNorm, SiLU MLP, no biases, no sliding window, a static RoPE), bf16 or
fp16 weights on CUDA (any float dtype on a CPU, where the operators run their torch references),
at most `gemv.MAX_ROWS` rows. Anything else keeps the compiled HF forward (`kernels="compiled"`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import compat
from . import gemv, ops
from . import triton as fast_triton  # not the triton package itself


@dataclass
class Plan:
    applies: bool
    reason: str           # what runs, or why the fast forward does not apply
    layers: int = 0


def plan(model, batch: int) -> Plan:
    """Whether `forward` can run this model's decode step at this batch size, and why not."""
    try:
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                                              LlamaRMSNorm)
    except ImportError:  # pragma: no cover
        return Plan(False, "transformers has no Llama modules")
    if type(model) is not LlamaForCausalLM:
        return Plan(False, f"{type(model).__name__} is not LlamaForCausalLM (the fast forward is Llama's)")
    config = model.config
    inner = model.model
    param = next(model.parameters())
    if batch > gemv.MAX_ROWS:
        return Plan(False, f"batch {batch} > {gemv.MAX_ROWS} rows: matrix products, not matrix-vector")
    if param.device.type == "cuda":
        if not fast_triton.HAVE_TRITON:
            return Plan(False, "no Triton")
        if param.dtype not in (torch.bfloat16, torch.float16):
            return Plan(False, f"{param.dtype} weights on CUDA (bf16 or fp16 only)")
    elif not fast_triton.interpreting() and param.device.type != "cpu":
        return Plan(False, f"device {param.device.type}")
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False) \
            or getattr(config, "attention_bias", False) or getattr(config, "pretraining_tp", 1) != 1:
        return Plan(False, "activation other than SiLU, biases, or tensor-parallel slicing")
    rotary = inner.rotary_emb
    rope = getattr(rotary, "rope_type", "default")
    if "dynamic" in rope or "longrope" in rope:
        return Plan(False, f"RoPE type {rope!r} changes with the sequence length")
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor) or \
            not isinstance(getattr(rotary, "attention_scaling", None), (int, float)):
        return Plan(False, "a rotary embedding without inv_freq and attention_scaling")
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers:
        return Plan(False, "the model runs a subset of its layers")
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP \
                or type(layer.input_layernorm) is not LlamaRMSNorm \
                or type(layer.post_attention_layernorm) is not LlamaRMSNorm:
            return Plan(False, "decoder layers other than transformers' Llama layers")
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear or m.bias is not None or not m.weight.is_contiguous()
               for m in linears):
            return Plan(False, "projections that are not plain, contiguous, bias-free nn.Linear")
    d = layers[0].self_attn.head_dim
    hidden = config.hidden_size
    if d & (d - 1) or d < 16 or config.num_attention_heads % config.num_key_value_heads:
        return Plan(False, f"head_dim {d} (a power of two >= 16 needed) or uneven head groups")
    if hidden > 8192 or model.lm_head.bias is not None or type(inner.norm) is not LlamaRMSNorm:
        return Plan(False, "hidden size over 8192 (the norm reads whole rows in one tile) or an lm_head bias")
    backend = "Triton kernels" if fast_triton.usable(param) else "their torch references (no Triton here)"
    return Plan(True, f"fast decode forward, {len(layers)} layers, {backend}", len(layers))


def cache_ready(cache) -> str:
    """'' when the static cache has the layout the kernels write, else why not (checked at trace time:
    the cache's tensors exist once the prefill has run)."""
    for layer in compat.cache_layers(cache):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        counter = getattr(layer, "cumulative_length", None)
        if keys is None or values is None or keys.dim() != 4 or not keys.is_contiguous() \
                or not values.is_contiguous():
            return "a cache layer without contiguous [B, Hkv, C, D] keys and values"
        if not isinstance(counter, torch.Tensor) or counter.device != keys.device:
            return "a cache layer without a device counter (cumulative_length)"
    return ""


def forward(model, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, V] of one decode step (tokens, positions [B, 1]; mask [B, C] over the cache slots),
    writing each layer's key and value at its counter's slot and advancing the counters, as HF's does.
    Runs eagerly: every line below is one kernel (the embedding, the counters' update) or a call of
    gdtool's kernels."""
    inner = model.model
    rotary = inner.rotary_emb
    h = F.embedding(tokens[:, 0], inner.embed_tokens.weight)          # [B, H]
    layers = compat.cache_layers(cache)
    for block, layer in zip(inner.layers, layers):
        attn, mlp = block.self_attn, block.mlp
        norm1, norm2 = block.input_layernorm, block.post_attention_layernorm
        counter = layer.cumulative_length                   # this step's slot, before HF's update adds 1
        q = ops.qkv_rope(h, norm1.weight, norm1.variance_epsilon, attn.q_proj.weight, attn.k_proj.weight,
                         attn.v_proj.weight, positions, rotary.inv_freq, rotary.attention_scaling,
                         layer.keys, layer.values, counter)
        o = ops.decode_attention(q, layer.keys, layer.values, mask, counter, attn.scaling)
        h = ops.rms_gemv(o, None, 0.0, attn.o_proj.weight, None, h, False)
        a = ops.rms_gemv(h, norm2.weight, norm2.variance_epsilon, mlp.gate_proj.weight, mlp.up_proj.weight,
                         None, False)
        h = ops.rms_gemv(a, None, 0.0, mlp.down_proj.weight, None, h, False)
    torch._foreach_add_([layer.cumulative_length for layer in layers], 1)
    norm = inner.norm
    return ops.rms_gemv(h, norm.weight, norm.variance_epsilon, model.lm_head.weight, None, None, True)
