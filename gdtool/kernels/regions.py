"""A prefill program's decoder layers compiled once and stamped out for the others.

A rollout's refill prefills g prompts w columns wide, one inductor program per (g, w) (`rows.py`), and each
program traces and lowers the whole model: cold, about 22 s a program for llama-1b's 16 layers and 50 s for
qwen3-8b's 36 on an H100, so a 64-slot rollout's five programs took qwen3-8b 250 s before its first token.
Inside `scope()` each decoder layer's forward is one nested compile region
(`torch.compiler.nested_compile_region`): dynamo and inductor compile a layer once and reuse its code for every
layer alike in shapes, strides and constants, and compile again for one that differs (Gemma 3's sliding and
full layers). What runs is the same arithmetic, in the same kernels for every layer; a program is still its own
twin, captured or not.

The decode step keeps its whole-model program: there the kernels that span a layer's boundary (its residual
add and the next layer's norm) are a share of a memory-bound step, while a prefill is matrix products.

The route is put on the layers only for the length of a prefill program's call (`swap.forwards`, as the experts
kernels are): HF's kernels, generate() and the decode program never see it.

    routes = plan(model)       # [(layer, its forward through the region)], or [] where none applies
    with scope(routes):        # a prefill program called (and compiled) inside
        ...
"""
from __future__ import annotations

import types
from contextlib import contextmanager

import torch

from . import swap

ENABLED = True   # refills' prefill programs compile by layer (rows.py); False: each traces the whole model


def _call_forward(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


_region = getattr(torch.compiler, "nested_compile_region", None)   # torch 2.8 and later
_layer = _region(_call_forward) if _region is not None else None


def _forward(self, *args, **kwargs):
    return _layer(self, *args, **kwargs)


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


def plan(model) -> list:
    """(layer, its forward through the region) for each decoder layer, or [] where regions do not apply: turned
    off, a torch without them, no decoder layers found, or a layer whose forward an instance attribute already
    replaces (a dispatch hook: the model is then left as it is)."""
    layers = decoder_layers(model)
    if not ENABLED or _layer is None or not layers or any("forward" in vars(layer) for layer in layers):
        return []
    return [(layer, types.MethodType(_forward, layer)) for layer in layers]


@contextmanager
def scope(routes: list):
    """Inside, the planned layers run as nested compile regions (outside torch.compile: as they are); each
    layer's own forward is back on exit."""
    with swap.forwards(routes):
        yield
