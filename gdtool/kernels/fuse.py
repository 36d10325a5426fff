"""Fewer, larger matmuls for the compiled step: q/k/v and gate/up as one weight each.

At batch 1 a decode step is a chain of matrix-vector products, and a small one (the k and v
projections of a Llama 3 layer are 512 x 2048) reaches a fraction of the bandwidth a large one
does. Projections that read the same input can be one product over their concatenated weights:

    fuse_projections(model)     # in place: one buffer per group, the Linear weights become views of it

Each group's weights are copied once into one buffer and each `nn.Linear` keeps a view of its rows,
so the model holds no extra memory, its state_dict is unchanged in names and values, and the
weights have new addresses (capture after fusing, not before). While torch.compile traces (the
`kernels="compiled"` step), the first projection of a group computes the whole group's product and
hands the others their slices; everywhere else (HF's kernels, generate(), any other torch.compile
of the model) each Linear computes its own product as before, with its exact kernels and bits.

Groups are found by name, in the order HF's Llama-family forwards call them: (q_proj, k_proj,
v_proj) in attention, (gate_proj, up_proj) in the MLP, when they are `nn.Linear`s over the same
input size with the same dtype, device and bias presence.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import attention

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class _Group:
    weight: torch.Tensor          # [sum(out), in]
    bias: torch.Tensor | None     # [sum(out)]
    sizes: list[int]
    linears: list[nn.Linear]


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of `model` (see the module docstring); returns how many.
    Calling it again fuses nothing new."""
    fused = 0
    for module in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if _fusable(linears):
                _fuse(linears)
                fused += 1
    return fused


def is_fused(model: nn.Module) -> bool:
    return any(getattr(m, "_gdtool_group", None) is not None for m in model.modules())


def _fusable(linears) -> bool:
    if not all(type(linear) is nn.Linear for linear in linears):
        return False
    first = linears[0]
    if getattr(first, "_gdtool_group", None) is not None:
        return False
    return all(linear.in_features == first.in_features and linear.weight.dtype == first.weight.dtype
               and linear.weight.device == first.weight.device and (linear.bias is None) == (first.bias is None)
               for linear in linears)


def _fuse(linears: list[nn.Linear]) -> None:
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        bias = torch.cat([linear.bias for linear in linears]) if linears[0].bias is not None else None
    sizes = [linear.out_features for linear in linears]
    offset = 0
    for linear, size in zip(linears, sizes):
        # views of the one buffer; the old weights are freed as they are replaced
        linear.weight = nn.Parameter(weight[offset:offset + size], requires_grad=linear.weight.requires_grad)
        if bias is not None:
            linear.bias = nn.Parameter(bias[offset:offset + size], requires_grad=linear.bias.requires_grad)
        offset += size
    group = _Group(weight, bias, sizes, linears)
    linears[0]._gdtool_group = group
    linears[0].forward = types.MethodType(_first_forward, linears[0])
    for linear in linears[1:]:
        linear._gdtool_pending = None
        linear.forward = types.MethodType(_rest_forward, linear)


def _first_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() and attention.active():
        group = self._gdtool_group
        parts = F.linear(x, group.weight, group.bias).split(group.sizes, dim=-1)
        for linear, part in zip(group.linears[1:], parts[1:]):
            linear._gdtool_pending = (x, part)
        return parts[0]
    return F.linear(x, self.weight, self.bias)


def _rest_forward(self, x: torch.Tensor) -> torch.Tensor:
    pending = self._gdtool_pending
    if torch.compiler.is_compiling() and attention.active() and pending is not None and pending[0] is x:
        self._gdtool_pending = None
        return pending[1]
    return F.linear(x, self.weight, self.bias)
