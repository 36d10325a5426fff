"""A prefill program's decoder layers compiled once and stamped out for the others.

A rollout's refill prefills g prompts w columns wide, one inductor program per (g, w) (`rows.py`), and each
program traces and lowers the whole model: cold, about 22 s a program for llama-1b's 16 layers and 50 s for
qwen3-8b's 36 on an H100, so a 64-slot rollout's five programs took qwen3-8b 250 s before its first token.
Under `regional()` each decoder layer's forward is one nested compile region
(`torch.compiler.nested_compile_region`): dynamo and inductor compile a layer once and reuse its code for every
layer alike in shapes, strides and constants, and compile again for one that differs (Gemma 3's sliding and
full layers). What runs is the same arithmetic, in the same kernels for every layer; a program is still its own
twin, captured or not.

The decode step keeps its whole-model program: there the kernels that span a layer's boundary (its residual
add and the next layer's norm) are a share of a memory-bound step, while a prefill is matrix products.

    install(model)       # route each decoder layer's forward through `_forward` (a no-op outside regional())
    with regional():     # calls compiled inside trace each layer as a region
        ...
"""
from __future__ import annotations

import types
from contextlib import contextmanager

import torch

ENABLED = True   # refills' prefill programs compile by layer (rows.py); False: each traces the whole model
_ATTR = "_gdtool_region"
_active = [False]   # read while dynamo traces (a guard on its value): True inside regional()


def _call_forward(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


_region = getattr(torch.compiler, "nested_compile_region", None)   # torch 2.8 and later
_layer = _region(_call_forward) if _region is not None else None


def _forward(self, *args, **kwargs):
    if _active[0]:
        return _layer(self, *args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def decoder_layers(model) -> list:
    """The model's decoder layers: the ModuleList as long as its text config's num_hidden_layers whose members
    share one class (none found: [])."""
    config = model.config.get_text_config()
    depth = getattr(config, "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and depth and len(module) == depth \
                and len({type(m) for m in module}) == 1:
            return list(module)
    return []


def install(model) -> bool:
    """Route each decoder layer's forward through a region while `regional()` is on; returns whether the model
    has them. A layer whose forward an instance attribute already replaces (a dispatch hook) is left as it is,
    and then so is the whole model."""
    layers = decoder_layers(model)
    if not ENABLED or _layer is None or not layers:
        return False
    if all(getattr(layer, _ATTR, False) for layer in layers):
        return True
    if any("forward" in vars(layer) for layer in layers):
        return False
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
        setattr(layer, _ATTR, True)
    return True


@contextmanager
def regional(on: bool = True):
    """Inside, the installed layers run as nested compile regions (outside torch.compile: as they are)."""
    before = _active[0]
    _active[0] = on
    try:
        yield
    finally:
        _active[0] = before
