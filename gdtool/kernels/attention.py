"""Decode attention for the compiled step: grouped-query attention without copying the cache.

HF's `sdpa` attention, traced by torch.compile, expands each key/value head of a grouped-query model
to every query head it serves (`repeat_kv`) before calling scaled_dot_product_attention: for
Llama 3 (32 query heads over 8 key/value heads) each step writes and reads the whole static cache
four times over, and at large batch that copy is most of the step. At decode there is one query
token per row, so the query heads of one group can be stacked as that group's rows instead
(HF's own `pack_gqa`, which it skips under torch.compile):

    query [B, Hq, 1, D] -> [B, Hkv, Hq/Hkv, D]     one "row" per query head of the group
    sdpa(query, key, value, mask [B, 1, 1, S])     key/value [B, Hkv, S, D], read once, no copy
    -> [B, Hkv, Hq/Hkv, D] -> [B, 1, Hq, D]

Same kernel family, same mask, same scale; only which heads share a launch changes (so logits move
by rounding, as everything else inductor fuses).

Scope: the swap applies only inside gdtool's compiled step (`scope()`, entered by
`fast.CompiledStep` around each call of its compiled function; the captured replays run no Python).
`install()` puts a dispatcher in front of HF's registered `sdpa` function: outside the scope, or for
anything but a one-token query with a plain mask, it calls HF's function with the same arguments, so
HF's kernels, generate() and any other torch.compile of the model (the bench's peers) are unchanged.
Models set to another attention implementation (eager, flash) keep it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

_active = False
_original = None
# keyword arguments that change the math: left to HF's function
_DECLINE = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def active() -> bool:
    """True while gdtool's compiled step runs (dynamo guards on it: read, it becomes part of the graph key)."""
    return _active


@contextmanager
def scope():
    global _active
    before, _active = _active, True
    try:
        yield
    finally:
        _active = before


def install() -> None:
    """Put the dispatcher in front of HF's `sdpa` attention, once per process."""
    global _original
    if _original is not None:
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", _dispatch)


def applies(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether the packed form computes this call: one query token, grouped heads, a [B, 1, 1, S]
    mask or none, no dropout, nothing else that changes the math."""
    b, hq, length, _ = query.shape
    hkv = key.shape[1]
    if length != 1 or hq % hkv or dropout or any(kwargs.get(name) for name in _DECLINE):
        return False
    if kwargs.get("sliding_window") is not None:
        return False
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling):
    """[B, Hq, 1, D] query over [B, Hkv, S, D] key/value -> [B, 1, Hq, D], as HF's attention returns it."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if _active and applies(query, key, attention_mask, dropout, kwargs):
        return decode_attention(query, key, value, attention_mask, scaling), None
    return _original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
