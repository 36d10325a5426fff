"""The loop: `DeviceLoop` (the WHILE node around the captured step) and `run_uncaptured` (its condition on the host).

Also the loop's checks of its arguments and the generator helpers that `start_rollout()` and
`finish_rollout()` use (the device-loop mode in decode.py reads them too): seed and offset out of a CUDA
generator's state, and a new offset into it.
"""
from __future__ import annotations

import ctypes
import struct

import torch

from .nodes import _check_body_nodes, find_philox_arguments, references
from .nvrtc import _current_context, _kernels
from . import support
from .support import _check, check_device_loop_support


# -- the loop condition, uncaptured ----------------------------------------------------------------

def _stop_at(step: int, limit: int, max_steps: int | None) -> int:
    """The step count at which this launch stops (the condition kernel computes the same at entry)."""
    if max_steps is not None and max_steps < limit - step:
        return step + max_steps
    return limit


def _check_max_steps(max_steps) -> None:
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps={max_steps!r} must be an int >= 1 (steps per launch), or None for no cap")


def run_uncaptured(step_fn, done: torch.Tensor, step: torch.Tensor, limit, *, max_steps: int | None = None,
                   count_steps: bool = False) -> int:
    """Run `step_fn()` while not all(done) and step < min(step at entry + max_steps, limit).

    The device loop's condition, run on the host: what one `DeviceLoop.launch()` does, reading the
    same tensors (each read of a CUDA tensor is a host sync). With `count_steps` the loop adds 1 to
    `step` after each call, as the device loop does with the same flag. Returns the calls made.
    """
    _check_max_steps(max_steps)
    stop_at = _stop_at(int(step), int(limit), max_steps)
    calls = 0
    while int(step) < stop_at and not bool(done.all()):
        step_fn()
        calls += 1
        if count_steps:
            step.add_(1)
    return calls


# -- the loop ---------------------------------------------------------------------------------------

_DONE_WIDTHS = {torch.bool: 1, torch.uint8: 1, torch.int8: 1, torch.int32: 4, torch.int64: 8}


def _check_tensors(done: torch.Tensor, step: torch.Tensor, limit: torch.Tensor) -> None:
    if not isinstance(done, torch.Tensor) or done.dtype not in _DONE_WIDTHS:
        raise ValueError(f"done must be a bool or integer tensor (all rows finished when every element is non-zero); "
                         f"got {getattr(done, 'dtype', type(done).__name__)}")
    if not done.is_contiguous():
        raise ValueError("done must be contiguous: the condition kernel reads it as a flat array")
    for name, tensor in (("step", step), ("limit", limit)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.numel() != 1:
            raise ValueError(f"{name} must be a one-element int64 tensor (a device scalar the loop reads); got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)} with "
                             f"{getattr(tensor, 'numel', lambda: '?')()} element(s)")
    devices = {done.device, step.device, limit.device}
    if len(devices) > 1:
        raise ValueError(f"done, step and limit must be on one device; got {sorted(map(str, devices))}")


def _chain_shape(inner) -> bool:
    """Whether `inner` is a non-empty list of (graph, settled) pairs, a graph possibly such a list again."""
    if not isinstance(inner, (list, tuple)) or not inner:
        return False
    return all(isinstance(p, (list, tuple)) and len(p) == 2
               and (not isinstance(p[0], (list, tuple)) or _chain_shape(p[0])) for p in inner)


def _generator_state(generator: torch.Generator) -> tuple[int, int]:
    seed, offset = struct.unpack("<Qq", bytes(generator.get_state().tolist()))
    return seed, offset


def _set_generator_offset(generator: torch.Generator, offset: int) -> None:
    seed, _ = _generator_state(generator)
    generator.set_state(torch.tensor(list(struct.pack("<Qq", seed, offset)), dtype=torch.uint8))


class DeviceLoop:
    """Run `body` while not all(done) and step < limit, on the device, in one graph launch.

    body: a `torch.cuda.CUDAGraph(keep_graph=True)` captured around one step (device loop), or any
        callable / object with `replay()` (runs uncaptured: the same condition on the host).
    done: bool or integer tensor, written by the step; the loop stops once every element is non-zero.
    step: one-element int64 tensor, steps run so far; the step advances it (or `count_steps=True`).
    limit: one-element int64 tensor or int: no launch runs the step once step >= limit.
    advance_rng: make captured torch RNG kernels draw fresh numbers each iteration, as replay() does;
        needs `rng_increment`, the offset one eager step advances `generator` by (a multiple of 4).
    generator: the CUDA generator the step samples from (default: the device's default generator).

    inner: [(graph, settled), ...]: for each pair in order, run `graph` (a `CUDAGraph(keep_graph=True)`) while the
        one-element int64 tensor `settled` is 0: WHILE nodes one after the other, after each body run (nested in
        the loop's body, before its condition) and once at the start of each launch, before the loop's entry (a
        rollout's refills, one graph per group size: its first fill, then the refills after each step). `graph`
        may itself be such a list: its WHILE node's body is then that chain of WHILE nodes (a rollout's refills
        of one size at several widths).
        Uncaptured, the body callable runs its own inner loops: pass inner=None.
    inner_clock: a two-element int64 tensor on the loop's device, or None: each run of an inner graph is timed on
        the device (its nanosecond timer, read by a one-thread kernel before and after it) and the nanoseconds are
        added into `inner_clock[1]` (`inner_clock[0]` is the clock's scratch). Needs `inner`.

    `launch(max_steps=N)` runs at most N steps (streaming); `launches` counts graph launches.
    """

    def __init__(self, body, done: torch.Tensor, step: torch.Tensor, limit, *, count_steps: bool = False,
                 advance_rng: bool = False, rng_increment: int | None = None,
                 generator: torch.Generator | None = None, inner: list | None = None,
                 inner_clock: torch.Tensor | None = None):
        if not isinstance(limit, torch.Tensor):
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise ValueError(f"limit must be an int or a one-element int64 tensor; got {type(limit).__name__}")
            limit = torch.tensor(limit, dtype=torch.int64, device=getattr(step, "device", "cpu"))
        _check_tensors(done, step, limit)
        self.done, self.step, self.limit = done, step, limit
        self.count_steps, self.advance_rng = bool(count_steps), bool(advance_rng)
        self.launches = 0
        self.last_calls = None           # uncaptured: steps run by the last launch
        self.captured = isinstance(body, torch.cuda.CUDAGraph)
        self._exec = self._graph = self._rng = None
        if inner is not None and not _chain_shape(inner):
            raise ValueError("inner must be a non-empty list of (graph, settled) pairs, run in order before each body "
                             "run (a graph may be such a list again), or None")
        self.inner = inner
        if inner_clock is not None and (inner is None or not isinstance(inner_clock, torch.Tensor)
                                        or inner_clock.dtype != torch.int64 or inner_clock.numel() != 2
                                        or not inner_clock.is_contiguous() or inner_clock.device != done.device):
            raise ValueError("inner_clock must be a contiguous two-element int64 tensor on the loop's device, with "
                             "inner graphs to time (inner=[...])")
        self.inner_clock = inner_clock
        self._rollout_open = False
        self._closed = False
        self.body_nodes = self.rng_kernels = 0
        self.kernel_target = None        # "sm_90": what NVRTC compiled the condition kernel for
        if not self.captured:
            fn = getattr(body, "replay", body)
            if not callable(fn):
                raise TypeError(f"body must be a torch.cuda.CUDAGraph, a callable or an object with replay(); got "
                                f"{type(body).__name__}")
            self._fn = fn
            return
        if done.device.type != "cuda":
            raise ValueError(f"a captured body needs done/step/limit on its CUDA device; they are on {done.device}")
        if self.advance_rng:
            if isinstance(rng_increment, bool) or not isinstance(rng_increment, int) or rng_increment <= 0 \
                    or rng_increment % 4:
                raise ValueError(f"advance_rng=True needs rng_increment, the Philox offset one eager step advances the "
                                 f"generator by (a positive multiple of 4: measure generator.get_offset() around one "
                                 f"warm-up step); got {rng_increment!r}")
        self.rng_increment = rng_increment
        self.device = done.device
        self.generator = generator
        self._body = body
        with torch.cuda.device(self.device):
            self._build(body)

    # -- building the parent graph --
    def _build(self, body) -> None:
        check_device_loop_support(self.device)
        cu, nvrtc = support._bindings()
        self._cu = cu
        try:
            raw = body.raw_cuda_graph()
        except RuntimeError as error:
            raise ValueError("capture the step with torch.cuda.CUDAGraph(keep_graph=True): the device loop embeds the "
                             "captured cudaGraph_t, which torch otherwise destroys at the end of capture") from error
        body_graph = cu.CUgraph(int(raw))
        self.body_nodes = _check_body_nodes(cu, body_graph)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        ctx = _current_context(cu, index)
        self._kernels = _kernels(cu, nvrtc, index, ctx)
        self.kernel_target = self._kernels.target

        self._rng = None
        if self.advance_rng:
            arguments, undecoded = find_philox_arguments(cu, body_graph)
            pairs = sorted({(a.seed_ptr, a.offset_ptr) for a in arguments})
            if not pairs:
                raise ValueError("advance_rng=True, but the captured step has no torch RNG kernel reading the "
                                 "generator's offset (nothing to advance); pass advance_rng=False")
            if len(pairs) > 1:
                raise ValueError(f"the captured step draws from {len(pairs)} generators; advance_rng follows one: "
                                 f"sample from a single generator")
            last = max(a.offset_intragraph for a in arguments)
            if self.rng_increment <= last:
                raise ValueError(f"rng_increment={self.rng_increment} is not past the last captured RNG kernel's "
                                 f"offset ({last}): measure it as the generator offset one eager step uses")
            self._rng = pairs[0]
            self.rng_kernels = len(arguments)
            # A kernel that wraps its PhiloxCudaState in a struct still reads the same offset tensor, which is
            # what the loop advances; one that reads another one would repeat its draws every iteration.
            strays = [name for name, raws in undecoded.items() if not references(raws, self._rng[1])]
            if strays:
                raise ValueError(f"{len(strays)} captured RNG kernel(s) read a Philox state the loop cannot find "
                                 f"(first: {strays[0][:160]}); their draws would repeat every iteration: use greedy "
                                 f"decoding in the device loop, or mode='step-graph' for sampling")
        if self.generator is None:
            self.generator = torch.cuda.default_generators[index]

        self._stop_at = torch.zeros((), dtype=torch.int64, device=self.device)
        parent = _check(cu.cuGraphCreate(0), "cuGraphCreate")
        self._graph = parent
        handle = _check(cu.cuGraphConditionalHandleCreate(parent, ctx, 0, cu.CU_GRAPH_COND_ASSIGN_DEFAULT),
                        "cuGraphConditionalHandleCreate")
        self._handle = handle
        self._max_steps = None
        # inner loops: once in the launch's prologue (a rollout's first fill; after a step they have nothing to do),
        # and after the body inside the loop, so that the loop's condition sees what they did
        last = None
        if self.inner is not None:
            self._inner_scratch = torch.tensor([0, 1, 0], dtype=torch.int64, device=self.device)  # step, limit, stop_at
            self._inner_handles = []
            for graph, settled in self.inner:
                last = self._add_inner(parent, last, ctx, graph, settled)
        self._entry_params = self._condition_params(entering=True, max_steps=None)
        entry = _check(cu.cuGraphAddKernelNode(parent, None if last is None else [last], 0 if last is None else 1,
                                               self._entry_params), "cuGraphAddKernelNode (entry)")
        self._entry = entry

        _, loop_body = self._add_while(parent, entry, handle, ctx, "WHILE")
        child = _check(cu.cuGraphAddChildGraphNode(loop_body, None, 0, body_graph), "cuGraphAddChildGraphNode")
        if self.inner is not None:
            for graph, settled in self.inner:
                child = self._add_inner(loop_body, child, ctx, graph, settled)
        self._body_params = self._condition_params(entering=False, max_steps=None)
        _check(cu.cuGraphAddKernelNode(loop_body, [child], 1, self._body_params), "cuGraphAddKernelNode (condition)")
        try:
            self._exec = _check(cu.cuGraphInstantiate(parent, 0), "cuGraphInstantiate")
        except RuntimeError as error:
            raise RuntimeError(f"{error}: CUDA refused the captured step as a WHILE body ({self.body_nodes} nodes); "
                               f"kernels launched cooperatively or with device-side launches cannot run inside a "
                               f"conditional node; use mode='step-graph'") from None
        stream = torch.cuda.current_stream(self.device)
        _check(cu.cuGraphUpload(self._exec, cu.CUstream(stream.cuda_stream)), "cuGraphUpload")

    def _add_while(self, graph, after, handle, ctx, what: str):
        """A WHILE node on `handle` in `graph`, after node `after`: (the node, its body graph)."""
        cu = self._cu
        params = cu.CUgraphNodeParams()
        params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = ctx
        try:  # cuda-python 13: (graph, deps, edge data, count, params); 12.x: (graph, deps, count, params)
            node = _check(cu.cuGraphAddNode(graph, [after], None, 1, params), f"cuGraphAddNode ({what})")
        except TypeError:
            node = _check(cu.cuGraphAddNode(graph, [after], 1, params), f"cuGraphAddNode ({what})")
        return node, params.conditional.phGraph_out[0]

    def _add_inner(self, graph, after, ctx, inner_graph, settled):
        """In `graph`, after node `after` (None: first): an entry kernel, then a WHILE node running `inner_graph`
        while its `settled` flag is 0 (the same condition kernel: no step count, a limit of 1 never reached).
        `inner_graph` a list of pairs: the WHILE node's body is their chain. Returns the WHILE node."""
        cu = self._cu
        if not isinstance(settled, torch.Tensor) or settled.dtype != torch.int64 or settled.numel() != 1 \
                or settled.device != self.device:
            raise ValueError("inner=[(graph, settled), ...]: each settled must be a one-element int64 tensor on the "
                             "loop's device")
        inner_body = None
        if not isinstance(inner_graph, (list, tuple)):
            try:
                raw = inner_graph.raw_cuda_graph()
            except RuntimeError as error:
                raise ValueError("capture the inner graph with torch.cuda.CUDAGraph(keep_graph=True)") from error
            inner_body = cu.CUgraph(int(raw))
            self.body_nodes += _check_body_nodes(cu, inner_body)
        handle = _check(cu.cuGraphConditionalHandleCreate(graph, ctx, 0, cu.CU_GRAPH_COND_ASSIGN_DEFAULT),
                        "cuGraphConditionalHandleCreate (inner)")
        deps = None if after is None else [after]
        entry = _check(cu.cuGraphAddKernelNode(graph, deps, 0 if after is None else 1,
                                               self._inner_params(handle, settled, True)),
                       "cuGraphAddKernelNode (inner entry)")
        node, body = self._add_while(graph, entry, handle, ctx, "inner WHILE")
        if inner_body is not None:
            first = self._stamp(body, None, begin=True)
            deps = None if first is None else [first]
            last = _check(cu.cuGraphAddChildGraphNode(body, deps, 0 if first is None else 1, inner_body),
                          "cuGraphAddChildGraphNode (inner)")
            end = self._stamp(body, last, begin=False)
            last = last if end is None else end
        else:
            last = None
            for sub_graph, sub_settled in inner_graph:
                last = self._add_inner(body, last, ctx, sub_graph, sub_settled)
        _check(cu.cuGraphAddKernelNode(body, [last], 1, self._inner_params(handle, settled, False)),
               "cuGraphAddKernelNode (inner condition)")
        self._inner_handles.append(handle)
        return node

    _STAMP_TYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

    def _stamp(self, graph, after, begin: bool):
        """With an inner clock: in `graph` after node `after` (None: first), the clock kernel (begin: store the
        time; else add the time since into the total). Returns the node, or None without a clock."""
        if self.inner_clock is None:
            return None
        kp = self._cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = self._kernels.stamp
        kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1
        kp.blockDimX = kp.blockDimY = kp.blockDimZ = 1
        kp.sharedMemBytes = 0
        base = self.inner_clock.data_ptr()
        kp.kernelParams = ((base, base + 8, int(begin)), self._STAMP_TYPES)
        deps = None if after is None else [after]
        return _check(self._cu.cuGraphAddKernelNode(graph, deps, 0 if after is None else 1, kp),
                      "cuGraphAddKernelNode (inner clock)")

    def _inner_params(self, handle, settled: torch.Tensor, entering: bool):
        base = self._inner_scratch.data_ptr()
        return self._condition_kernel((int(handle), settled.data_ptr(), 1, 8, base, base + 8, base + 16, 0, 0, 0, 0,
                                       int(entering)))

    def _condition_params(self, *, entering: bool, max_steps: int | None):
        rng_offset = self._rng[1] if (self._rng is not None and not entering) else 0
        return self._condition_kernel((int(self._handle), self.done.data_ptr(), self.done.numel(),
                                       _DONE_WIDTHS[self.done.dtype], self.step.data_ptr(), self.limit.data_ptr(),
                                       self._stop_at.data_ptr(), max_steps or 0,
                                       1 if (self.count_steps and not entering) else 0, rng_offset,
                                       self.rng_increment or 0, int(entering)))

    # the condition kernel's arguments (nvrtc.py: gdtool_loop_condition)
    _CONDITION_TYPES = (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                        ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int)

    def _condition_kernel(self, values: tuple):
        """A one-thread launch of the condition kernel with `values` (handle, done, numel, width, step, limit,
        stop_at, max_steps, step increment, RNG offset, RNG increment, entering)."""
        kp = self._cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = self._kernels.condition
        kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1
        kp.blockDimX = kp.blockDimY = kp.blockDimZ = 1
        kp.sharedMemBytes = 0
        kp.kernelParams = (values, self._CONDITION_TYPES)
        return kp

    # -- running --
    def _stream(self, stream):
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        return self._cu.CUstream(stream if isinstance(stream, int) else stream.cuda_stream)

    def launch(self, stream=None, max_steps: int | None = None) -> None:
        """Run steps while not all(done) and step < min(step now + max_steps, limit). Asynchronous on the
        device; uncaptured, it runs on the host and `last_calls` says how many steps it ran."""
        _check_max_steps(max_steps)
        if self._closed:
            raise RuntimeError("this DeviceLoop is closed")
        if not self.captured:
            self.launches += 1
            self.last_calls = run_uncaptured(self._fn, self.done, self.step, self.limit, max_steps=max_steps,
                                             count_steps=self.count_steps)
            return
        if self._rng is not None and not self._rollout_open:
            raise RuntimeError("with advance_rng=True, call start_rollout() before the first launch of a rollout (it "
                               "hands the generator's seed and offset to the captured RNG kernels)")
        cu = self._cu
        if max_steps != self._max_steps:
            # Host-side update of the instantiated entry node: applies to this and later launches only.
            self._entry_params = self._condition_params(entering=True, max_steps=max_steps)
            _check(cu.cuGraphExecKernelNodeSetParams(self._exec, self._entry, self._entry_params),
                   "cuGraphExecKernelNodeSetParams")
            self._max_steps = max_steps
        _check(cu.cuGraphLaunch(self._exec, self._stream(stream)), "cuGraphLaunch")
        self.launches += 1

    def start_rollout(self, stream=None) -> None:
        """Before the first launch of a rollout: with advance_rng, give the captured RNG kernels the
        generator's seed and offset, as replay() would (no host sync). A no-op otherwise."""
        if not (self.captured and self._rng is not None):
            return
        seed, offset = _generator_state(self.generator)
        self._rng_start = offset
        self._rollout_open = True
        cu = self._cu
        args = ((self._rng[0], self._rng[1], seed, offset),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_longlong))
        _check(cu.cuLaunchKernel(self._kernels.rng_set, 1, 1, 1, 1, 1, 1, 0, self._stream(stream), args, 0),
               "cuLaunchKernel (RNG state)")

    def finish_rollout(self, steps: int | None = None, stream=None) -> int | None:
        """After the last launch: with advance_rng, move the generator to where `steps` replay() calls
        would have left it. Without `steps` it reads the device's offset (one host sync). Returns the
        generator offset set, or None when there is nothing to do."""
        if not (self.captured and self._rng is not None):
            return None
        if not self._rollout_open:
            raise RuntimeError("finish_rollout() without start_rollout(): there is no rollout to finish")
        self._rollout_open = False
        if steps is not None:
            offset = self._rng_start + steps * self.rng_increment
        else:
            self._stream_obj(stream).synchronize()
            value = ctypes.c_longlong()
            _check(self._cu.cuMemcpyDtoH(ctypes.addressof(value), self._rng[1], 8), "cuMemcpyDtoH (RNG offset)")
            offset = value.value
        _set_generator_offset(self.generator, offset)
        return offset

    def _stream_obj(self, stream):
        if stream is None:
            return torch.cuda.current_stream(self.device)
        if isinstance(stream, int):
            return torch.cuda.ExternalStream(stream, device=self.device)
        return stream

    # -- cleanup --
    def close(self) -> None:
        """Free the instantiated graph and the parent graph (waits for launches in flight). The compiled
        kernel module stays cached for other loops (`release_kernels()` unloads it)."""
        if self._closed:
            return
        self._closed = True
        if self.captured and (self._exec is not None or self._graph is not None):
            if self.launches:
                torch.cuda.synchronize(self.device)   # the graph reads buffers this object keeps alive
            if self._exec is not None:
                self._cu.cuGraphExecDestroy(self._exec)
            if self._graph is not None:
                self._cu.cuGraphDestroy(self._graph)
            self._exec = self._graph = None
            self._body = None
        self._fn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
