"""Modules' forwards replaced for the length of a `with`: how kernels="fast" puts gdtool's operators into the
compiled HF forward (the MoE blocks, `experts.scope`; the linear layers, `linear.scope`). The instance attribute
is set on entry and removed (or the one before it restored) on exit, whatever happens inside, so HF's kernels,
generate() and other compiles of the model never see the swap."""
from __future__ import annotations

from contextlib import contextmanager

_MISSING = object()


@contextmanager
def forwards(pairs):
    """pairs: (module, forward) to install for the duration."""
    saved = []
    try:
        for module, forward in pairs:
            saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = forward
        yield
    finally:
        for module, before in reversed(saved):
            if before is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before
