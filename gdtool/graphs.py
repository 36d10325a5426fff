"""CUDA-graph capture of a step function, and its CPU stand-in.

On CUDA a function is warmed up on a side stream (cuBLAS handles, lazy buffers) and captured once;
`replay()` then launches every kernel it ran with one call. Without CUDA the same function is kept
uncaptured and `replay()` calls it, so the graph modes run their whole logic on a CPU.

Warm-up runs the function for real: the caller snapshots its buffers first and restores them
after capture (`decode.py`), as it restores the random generator.
"""
from __future__ import annotations

import torch


class Uncaptured:
    """Stand-in used where there is no CUDA: replay() runs the function."""
    captured = False

    def __init__(self, fn):
        self.fn = fn
        self.output = None

    def replay(self) -> None:
        self.output = self.fn()

    def close(self) -> None:
        self.fn = None


class Captured:
    """A CUDA graph of `fn`; `output` holds what `fn` returned during capture (static buffers)."""
    captured = True

    def __init__(self, fn, pool=None, keep_graph: bool = False):
        # keep_graph: keep the cudaGraph_t after instantiation, for a device loop to embed it
        self.graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
        # captured on the warm-up stream: the cuBLAS workspace it made there is reused, not made during capture
        with torch.cuda.graph(self.graph, pool=pool, stream=side_stream()):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()

    def close(self) -> None:
        self.graph.reset()
        self.output = None


def can_capture(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream() -> torch.cuda.Stream:
    """One warm-up and capture stream per device. cuBLAS keeps a workspace for every stream it has run on,
    and a fresh `torch.cuda.Stream()` per capture cycles through torch's pool of streams: memory would then
    depend on how many captures came before (a Decoder captures many times)."""
    device = torch.cuda.current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream()
    return _SIDE_STREAMS[device]


def warm_up(fn, steps: int) -> None:
    """Run `fn` on a side stream, as torch asks before capturing."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def capture(fn, device: torch.device, pool=None, keep_graph: bool = False):
    return Captured(fn, pool, keep_graph) if can_capture(device) else Uncaptured(fn)
