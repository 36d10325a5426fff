"""The whole rollout in one launch: a decode loop that runs on the device (CUDA graph WHILE node).

Step-graph mode still returns to the host once per token (one `replay()`), and polls the "all rows
finished" flag every k steps, running up to k-1 wasted steps. A CUDA 12.4+ conditional WHILE node
moves the loop itself onto the GPU: its body is the captured decode step followed by a one-thread
kernel that sets the loop condition from device memory,

    run again  =  not all(done)  and  step < stop_at,      stop_at = min(step_at_launch + max_steps, limit)

so one launch runs every step of a rollout and stops exactly after the step that finished the last
row: no polls, no wasted steps, and the host waits once. With `max_steps` a launch runs at most that
many steps (streaming: read tokens between launches, launch again until done).

    loop = DeviceLoop(graph, done=state.done, step=state.index, limit=max_new_tokens - 1)
    loop.start_rollout(); loop.launch(); ...; loop.finish_rollout()     # one launch, whole rollout
    while not finished: loop.launch(max_steps=16); read tokens          # chunked, for streaming

`graph` is a `torch.cuda.CUDAGraph(keep_graph=True)` captured around the step; the step itself must
advance `step` (or pass `count_steps=True` and the loop advances it after each body run) and set
`done`. On a CPU, or with any callable as the body, the same condition runs in Python
(`run_uncaptured`), so the mode's logic is tested without a GPU.

Random sampling. A captured torch RNG kernel does not hold its Philox offset: it reads it at run
time from a one-element device tensor (plus a fixed intra-graph offset), and `replay()` refills that
tensor from the generator before each launch, then advances the generator by the graph's whole
increment. A device loop never calls `replay()`, so every iteration would draw the same numbers.
With `advance_rng=True` the loop finds that tensor in the captured graph (the `PhiloxCudaState`
argument of its RNG kernels), `start_rollout()` writes the generator's seed and offset there, the
condition kernel adds the per-step increment after each body run, and `finish_rollout()` moves the
generator to where as many `replay()` calls would have left it. Iteration i then draws what the
i-th replay would. The increment is what one eager step advances the generator by (measure it in
the warm-up: `generator.get_offset()` before and after one step).

Rules of use: keep the captured `CUDAGraph` alive (and un-reset) while the loop exists, since the
loop runs a copy of its nodes over the graph's memory; call `start_rollout`, `launch` and
`finish_rollout` on one stream; between `start_rollout` and `finish_rollout` nothing else draws from
the generator. `limit` is read at every launch, so a caller may also chunk by writing `limit` itself.

Needs: a CUDA driver and NVRTC of CUDA 12.4 or newer, cuda-python (`cuda.bindings`), and torch 2.8
or newer (`CUDAGraph(keep_graph=True)`); `device_loop_support()` says which one is missing. The
condition kernel is compiled at run time by NVRTC for the device's architecture (no nvcc, no CUDA
headers) and cached per process.

The package, by job, each module importing only those listed before it:

    support.py   versions: what the loop needs and `device_loop_support()`, the probe of this machine;
                 cuda-python's modules (`_bindings`) and `_check`, which unpacks a driver call's result
    nvrtc.py     the condition and RNG-writer kernels: their source, NVRTC's compile, the per-context cache
    nodes.py     the captured graph: its nodes (what a WHILE body may hold), torch's Philox RNG arguments
    loop.py      `DeviceLoop`, `run_uncaptured`, and the generator's seed and offset (`_generator_state`)

A test or probe changes a name in the module that reads it, not here: the names below are copies, so
assigning one of them here would change nothing the loop reads, and is refused, naming the modules that
hold it. cuda-python's modules are read through `support._bindings` everywhere, so a stand-in for them
goes there.
"""
from __future__ import annotations

from .support import MIN_CUDA, MIN_TORCH, _bindings, _explain, check_device_loop_support, device_loop_support
from .nvrtc import compile_kernels, release_kernels
from .nodes import PhiloxArgument, decode_philox, find_philox_arguments, kernel_param_bytes, references
from .loop import DeviceLoop, _generator_state, _set_generator_offset, run_uncaptured

__all__ = ["DeviceLoop", "run_uncaptured", "device_loop_support", "check_device_loop_support", "compile_kernels",
           "release_kernels", "MIN_CUDA", "MIN_TORCH"]

from ...core.reexports import guard as _guard

_guard(__name__, ("support", "nvrtc", "nodes", "loop"))
