"""The compiled steps kept on a model: one compiled function per shape key, and what became of each.

`kernels/step.py` compiles its step bodies (`_compiled_for`, with its `INDUCTOR_OPTIONS`) and keeps each in a
table on the model (`_ATTR`): one `_Compiled` entry per shape key (`_key`: batch, prompt width, cache length,
settings, which buffers exist), each with its own copy of the body's code (`_fresh`), so dynamo's recompile limit
never sends a long sweep back to eager; a second `decode()` with the same shapes compiles nothing. This module is
that table: its entries, their keys and names, what a compiled call runs under (`_no_function_modes`), how a
compile or a graph break is told (`_graphs_compiled`, `_is_graph_break`), and the table read back or dropped.
The `step` these functions take is step.py's `CompiledStep`, named in annotations only: step.py imports this
module, not the other way round. It imports the three public names too, so `gdtool.kernels.step.compiles` is
the same function:

    compiles(model)            # DataFrame, one row per key, with its compile count (more than 1: a recompile)
    compiled_nothing(model)    # whether every step kept ran without torch.compile by design
    forget(model)              # drop them
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import fuse
from . import sampling as fast_sampling  # beside the core sampling it speeds up

_ATTR = "_gdtool_compiled_steps"


@dataclass
class _Compiled:
    """One compiled function for one shape key."""
    fn: object
    name: str
    compiles: int = 0
    compile_s: float = 0.0
    fullgraph: bool = True
    calls: int = 0
    note: str = ""                # why it was split, or why it was compiled again
    kernels: str = "compiled"     # which kernels the step runs: for "fast", the decode forward's or why not


def _fresh(fn):
    # dynamo caches compiled graphs on the code object, up to a recompile limit (8) shared by every
    # shape; a copy of the code per shape key keeps each key's cache to itself.
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _key(step: CompiledStep) -> tuple:
    """What the compiled graph is specialized on: the buffers' shapes and dtypes, and for the whole
    step also the settings and the prompt width (python constants in select and update)."""
    buffers = tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in sorted(vars(step.state).items())
                    if isinstance(t, torch.Tensor))
    param = next(step.model.parameters())
    base = (step.part, param.dtype, str(param.device), fuse.is_fused(step.model), step.kernels,
            step.fast_forward, step.moe_plan.key() if step.moe_plan is not None else (), step.sinks_kernel,
            step.split_kernel,
            step.linear_plan.key() if step.linear_plan is not None else ())
    if step.part == "forward":
        return base + tuple(b for b in buffers if b[0] in ("tokens", "positions", "mask"))
    return base + buffers + (step.settings, step.prompt_width, fast_sampling.TIE_SLACK)


def _name(step: CompiledStep) -> str:
    batch, cache_len = step.state.mask.shape
    name = f"{step.part}_b{batch}_w{step.prompt_width}_c{cache_len}"
    if step.part == "step":
        s = step.settings
        name += f"_n{s.max_new_tokens}_" + ("sample" if s.do_sample else "greedy")
    if step.kernels != "compiled":
        name += f"_{step.kernels}"
    return name


@contextmanager
def _no_function_modes():
    # A caller's TorchFunctionMode (gdtool's host-read counter on a CPU) would be traced into the graph
    # and make every call under a different mode stack a recompile; the compiled step reads nothing on
    # the host, so there is nothing for such a mode to see. Set them aside for the call.
    modes = []
    while getattr(torch._C, "_len_torch_function_stack", lambda: 0)() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _is_graph_break(error: Exception) -> bool:
    import torch._dynamo.exc as exc
    kinds = tuple(getattr(exc, name) for name in ("Unsupported", "UserError") if hasattr(exc, name))
    return isinstance(error, kinds)


def compiles(model) -> "pandas.DataFrame":
    """One row per compiled step kept on `model`: shape key name, compiles, compile seconds (first
    calls, warm-up included), whether it is one graph, calls, and a note on any break or recompile.
    (Warnings say the same, but decode() records warnings raised during its warm-up on CUDA.)"""
    import pandas as pd
    columns = ["step", "kernels", "compiles", "compile_s", "fullgraph", "calls", "note"]
    return pd.DataFrame([{c: getattr(e, "name" if c == "step" else c) for c in columns}
                         for e in getattr(model, _ATTR, {}).values()], columns=columns)


def compiled_nothing(model) -> bool:
    """Whether every step kept on `model` ran without torch.compile by design (kernels="fast": gdtool's forward and,
    greedy, its one-kernel tail; the fast forward alone in forward-graph): no dynamo graph is then expected of it."""
    entries = list(getattr(model, _ATTR, {}).values())
    return bool(entries) and all(entry.fn is None for entry in entries)


def forget(model) -> None:
    """Drop the compiled steps kept on `model` (they hold inductor's code, not device memory)."""
    model.__dict__.pop(_ATTR, None)
