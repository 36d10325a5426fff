"""Counting the blocking waits that hide inside library code.

gdtool counts its own waits (EOS polls, the final read-back) where it makes them. The model's
forward can wait too: transformers' SDPA mask code checks `padding_mask.all()` on the host in every
uncaptured decode step. `hidden_waits()` counts those around a call:
- on CUDA, through PyTorch's sync debug mode, which flags every synchronizing CUDA call;
- on a CPU, where nothing waits, it counts the reads of tensor values on the host (`item`, `bool`,
  `int`, `float`, `tolist`) that would block on a GPU.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from . import ranges

_HOST_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
               torch.Tensor.tolist, torch.Tensor.__index__}


class _HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Counter:
    def __init__(self):
        self.count = 0


@contextmanager
def hidden_waits(device: torch.device, counter: Counter):
    """Add to `counter.count` the blocking host waits made inside the block."""
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        found = sum("synchroniz" in str(w.message) for w in caught)
    else:
        mode = _HostReads()
        with mode:
            yield
        found = mode.count
    counter.count += found
    if found:
        ranges.count_syncs(found)
