"""Warm-up and capture of a step, one graph per phase of its sliding-window layers.

A sliding layer takes another branch once its window is full, and a graph holds one branch: so a step
is captured once per phase (`Feed.phases`), each phase entered as the loops enter it. Warm-up runs the
step for real, so the state, the feed's counters, the cache and the generator are put back as the
prefill left them after each phase. The decode engine (`gdtool/loops/decode.py`) and the teacher-forced
comparison of kernels (`gdtool/measure/accuracy.py`) both capture through `capture_phases`.

Without capture (a CPU, or `capture=False`) the same warm-up steps run and are undone, and each phase
gets an `Uncaptured` stand-in that replays with the Python counters a graph would have frozen.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from . import compat, graphs, ranges
from .syncs import hidden_waits


@dataclass
class Phases:
    """The graphs of one step, by phase, and what capturing them took."""
    graphs: dict = field(default_factory=dict)   # phase -> graphs.Captured or graphs.Uncaptured
    warmup_s: float = 0.0
    capture_s: float = 0.0                        # recording the graphs (0 uncaptured)
    syncs: int = 0                                # host waits: one per warm-up, one per capture
    captures: int = 0                             # CUDA graphs captured (0 uncaptured)
    pool_bytes: int = 0                           # device memory the captures reserved (their private pools)
    rng_increment: int | None = None              # one step's draws from the generator (captured only)


def capture_phases(fn, step, phases, *, capture: bool, width: int, warmup_steps: int, model=None, watch=None,
                   keep_graph: bool = False, generator: torch.Generator | None = None, waits=None) -> Phases:
    """Warm up and capture `fn` (the step, or its forward) once per phase in `phases`; leave `step`'s state,
    feed and cache, and `generator`, as they were.

    watch: the model the first warm-up step watches for what a graph cannot hold, or None
    (`gdtool.kernels.step.watched`). model: named in a failed capture's error. keep_graph: keep each raw
    cudaGraph_t (a device loop's WHILE node embeds it). waits: a `syncs.Counter` for the host waits HF's
    kernels hide in the warm-up."""
    state, feed, cache = step.state, step.feed, step.cache
    device = state.mask.device
    snapshot, layers = state.snapshot(), feed.snapshot()
    rng = generator.get_state() if generator is not None else None
    out = Phases()
    for phase in dict.fromkeys(phases):
        def enter(phase=phase):  # every warm-up step and the capture start in this phase
            feed.enter_phase(phase, layers)
        t0 = time.perf_counter()
        with ranges.span(ranges.WARMUP):
            constants = _warm_up(fn, enter, out, capture, warmup_steps, watch, generator, device, waits)
        out.warmup_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with ranges.span(ranges.CAPTURE):
            enter()
            if capture:
                # torch.cuda.graph empties the cache on entry: do it first, or that release hides the pool's growth
                reserved = _reserved(device, empty_first=True)
                out.graphs[phase] = graphs.capture(fn, device, keep_graph=keep_graph, model=model, constants=constants)
                # a private pool shares no segment, so its growth is the pool's size
                out.pool_bytes += _reserved(device) - reserved
                out.captures += 1
                out.syncs += 1  # torch.cuda.graph synchronizes before capturing
            else:
                # uncaptured, each replay runs with the Python counters the capture saw, as a graph would
                out.graphs[phase] = graphs.Uncaptured(fn, feed.frozen_counters())
        if capture:  # building a stand-in records nothing: capture_s is the time spent recording graphs
            out.capture_s += time.perf_counter() - t0
        state.restore(snapshot)
        feed.restore(layers)
        compat.rewind(cache, width)
        if rng is not None:
            generator.set_state(rng)
    return out


def _warm_up(fn, enter, out: Phases, capture: bool, steps: int, watch, generator, device, waits):
    """`steps` warm-up steps of one phase; returns the host constants the first one recorded (captured only)."""
    if not capture:
        # the same warm-up steps, run for real and undone after, so a CPU tests the undoing too
        for _ in range(steps):
            enter()
            fn()
        return None
    offset = generator.get_offset() if generator is not None else None
    with hidden_waits(device, waits) if waits is not None else contextlib.nullcontext():
        # the first step watched for what a graph cannot hold
        constants = graphs.warm_up(fn, 1, watch, before=enter)
        if offset is not None and out.rng_increment is None:
            out.rng_increment = generator.get_offset() - offset  # one step's draws (the device loop reads it)
        graphs.warm_up(fn, steps - 1, before=enter)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.syncs += 1
    return constants


def _reserved(device, empty_first: bool = False) -> int:
    """Bytes the caching allocator holds on `device` (0 off CUDA: a test stands a CPU in for a capture)."""
    if device.type != "cuda":
        return 0
    if empty_first:
        torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
