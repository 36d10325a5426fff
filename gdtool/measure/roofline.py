"""The roofline of a decode step: the bytes it must read, and how fast this device copies bytes.

A decode step reads every weight once (of a mixture of experts, the experts its tokens hit) and the live key/value
cache; at the device's copy bandwidth that read is the step's floor, which no step beats (`frontends/bench.py`
reports each runner's GB/s against it). The bench and the profile scripts share these helpers:

    copy_bandwidth(device)                 device-to-device copy, bytes/s (read + written)
    step_bytes(model, batch, prompt_len, max_new_tokens)   {"weight_bytes", "kv_bytes", "bytes_per_step"}
    expert_hit_share(module, batch)        the share of an experts module's experts a step reads on average

Until the next release `gdtool.frontends.bench` imports them too, under the same names.
"""
from __future__ import annotations

import time

import torch


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (32 << 20)
    # random bytes: zeros can move faster than real data
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    if not torch.equal(dst[:4096], src[:4096]):
        raise RuntimeError("the bandwidth copy did not copy; the device is in a bad state")
    del src, dst
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def step_bytes(model, batch: int, prompt_len: int, max_new_tokens: int) -> dict:
    """Bytes one decode step must read: weights once (of a mixture of experts, the experts its tokens hit on
    average) plus the live KV cache at its mean length."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb_in is not None and (emb_out is None or emb_in.weight is not emb_out.weight):
        # an untied input embedding is only looked up: one row per sequence
        w = emb_in.weight
        weights += batch * w.shape[1] * w.element_size() - w.numel() * w.element_size()
    weights -= _idle_expert_bytes(model, batch)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    # step j (1..max_new_tokens-1) attends over prompt + j positions: mean prompt + max_new_tokens / 2
    mean_live = prompt_len + max_new_tokens / 2
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * mean_live * batch * itemsize
    return {"weight_bytes": int(weights), "kv_bytes": int(kv), "bytes_per_step": int(weights + kv)}


def expert_hit_share(module, batch: int) -> float | None:
    """The share of an experts module's experts a step of `batch` tokens reads on average: with k of E experts
    per token chosen uniformly, B tokens hit E * (1 - (1 - k/E)^B) of them (random weights route close to
    uniformly). None where the module does not say E and k."""
    config = getattr(module, "config", None)
    experts = getattr(module, "num_experts", None) or getattr(config, "num_experts", None) \
        or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return 1 - (1 - top_k / experts) ** batch


def _idle_expert_bytes(model, batch: int) -> float:
    """Expert weights a step does not read (`expert_hit_share`)."""
    from ..core.feed import experts_modules
    idle = 0.0
    for module in experts_modules(model):
        hit = expert_hit_share(module, batch)
        if hit is not None:
            idle += (1 - hit) * sum(p.numel() * p.element_size() for p in module.parameters())
    return idle
