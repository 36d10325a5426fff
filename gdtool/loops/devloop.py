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
"""
from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

import torch

__all__ = ["DeviceLoop", "run_uncaptured", "device_loop_support", "check_device_loop_support", "compile_kernels",
           "release_kernels", "MIN_CUDA", "MIN_TORCH"]

MIN_CUDA = (12, 4)    # conditional graph nodes and cudaGraphSetConditional
MIN_TORCH = (2, 8)    # torch.cuda.CUDAGraph(keep_graph=True) and raw_cuda_graph()

_INSTALL_BINDINGS = "pip install 'cuda-python>=12.4'"


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


# -- what this machine can do ----------------------------------------------------------------------

def _version_tuple(text: str) -> tuple[int, int]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (2 - len(parts)))


def _cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _explain(*, torch_version: str, has_raw_graph: bool, bindings_error: str | None, bindings_version: str | None,
             bindings_has_conditional: bool, driver_version: int | None, nvrtc_version: tuple[int, int] | None,
             nvrtc_error: str | None) -> str | None:
    """The first reason the device loop cannot run here, as a sentence that names the fix; None if it can."""
    if not has_raw_graph or _version_tuple(torch_version) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        return (f"torch {torch_version} cannot hand out a captured graph (torch.cuda.CUDAGraph(keep_graph=True) and "
                f"raw_cuda_graph() arrived in torch {need}); install torch>={need} or use mode='step-graph'")
    if bindings_error is not None:
        return (f"the device loop builds CUDA graph conditional nodes through cuda-python, which is missing "
                f"({bindings_error}): {_INSTALL_BINDINGS}")
    if not bindings_has_conditional:
        return (f"cuda-python {bindings_version} predates CUDA graph conditional nodes (CUDA 12.4): "
                f"{_INSTALL_BINDINGS}")
    need = ".".join(map(str, MIN_CUDA))
    if driver_version is not None and driver_version < MIN_CUDA[0] * 1000 + MIN_CUDA[1] * 10:
        return (f"the NVIDIA driver supports CUDA {_cuda_version_text(driver_version)}; conditional graph nodes need "
                f"CUDA {need} (driver r550 or newer): update the driver or use mode='step-graph'")
    if nvrtc_error is not None:
        return (f"NVRTC, which compiles the loop's condition kernel, did not load ({nvrtc_error}): pip install "
                f"nvidia-cuda-nvrtc (CUDA 13) or 'nvidia-cuda-nvrtc-cu12>=12.4' (CUDA 12), the same CUDA major "
                f"version as cuda-python")
    if nvrtc_version is not None and tuple(nvrtc_version) < MIN_CUDA:
        return (f"NVRTC {nvrtc_version[0]}.{nvrtc_version[1]} cannot compile cudaGraphSetConditional (CUDA {need} "
                f"or newer): pip install 'nvidia-cuda-nvrtc-cu12>=12.4' or nvidia-cuda-nvrtc (CUDA 13)")
    return None


def _bindings():
    """(driver, nvrtc) modules of cuda-python; ImportError with the install line if missing."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        try:  # cuda-python 12.x before the cuda.bindings namespace
            from cuda import cuda as driver, nvrtc
        except ImportError as error:
            raise ImportError(f"the device loop needs cuda-python (CUDA graph conditional nodes): "
                              f"{_INSTALL_BINDINGS}") from error
    return driver, nvrtc


_support_lock = threading.Lock()
_support_cache: dict = {}


def device_loop_support(device=None) -> str | None:
    """Why a captured device loop cannot run on `device` (a sentence naming the fix), or None if it can.

    Without CUDA the answer is a reason too: there the mode runs uncaptured (`run_uncaptured`).
    """
    if not torch.cuda.is_available():
        return "no CUDA device: the device loop runs uncaptured (same condition, evaluated on the host)"
    index = torch.device(device).index if device is not None else None
    index = torch.cuda.current_device() if index is None else index
    with _support_lock:
        if index not in _support_cache:
            _support_cache[index] = _probe_support()
        return _support_cache[index]


def check_device_loop_support(device=None) -> None:
    """Raise RuntimeError with `device_loop_support`'s reason, if there is one."""
    problem = device_loop_support(device)
    if problem is not None:
        raise RuntimeError(problem)


def _probe_support() -> str | None:
    facts = dict(torch_version=torch.__version__, has_raw_graph=hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"),
                 bindings_error=None, bindings_version=None, bindings_has_conditional=False, driver_version=None,
                 nvrtc_version=None, nvrtc_error=None)
    try:
        cu, nvrtc = _bindings()
    except ImportError as error:
        facts["bindings_error"] = str(error.__cause__ or error)
        return _explain(**facts)
    try:
        import cuda.bindings
        facts["bindings_version"] = getattr(cuda.bindings, "__version__", "?")
    except ImportError:
        facts["bindings_version"] = "?"
    facts["bindings_has_conditional"] = hasattr(cu, "cuGraphConditionalHandleCreate")
    torch.cuda.init()
    try:
        err, version = cu.cuDriverGetVersion()
        facts["driver_version"] = int(version) if int(err) == 0 else None
    except Exception as error:  # libcuda not found by cuda-python although torch found a device
        facts["bindings_error"] = f"cuda-python cannot reach the driver: {type(error).__name__}: {error}"
        return _explain(**facts)
    try:
        err, major, minor = nvrtc.nvrtcVersion()
        facts["nvrtc_version"] = (int(major), int(minor))
    except Exception as error:  # the library itself is missing: cuda.pathfinder raises its own error types
        facts["nvrtc_error"] = f"{type(error).__name__}: {error}"
    return _explain(**facts)


# -- driver calls ----------------------------------------------------------------------------------

def _check(result, what: str):
    """Unpack a cuda-python result tuple; raise RuntimeError naming the call and the CUDA error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise RuntimeError(f"{what} failed: {name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


# One module per (context, architecture) per process: the condition kernel and the RNG writer.
_KERNEL_SOURCE = r"""
typedef unsigned long long gdtool_handle;
// cudaGraphSetConditional is a builtin of the device runtime (cuda_device_runtime_api.h); declaring it
// here spares NVRTC the CUDA headers. The driver resolves it when the module is loaded.
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(gdtool_handle handle,
                                                                                   unsigned int value);

__device__ __forceinline__ bool gdtool_all_done(const void* done, long long numel, int width) {
    for (long long i = 0; i < numel; ++i) {
        bool row;
        if (width == 1) row = static_cast<const unsigned char*>(done)[i] != 0;
        else if (width == 4) row = static_cast<const int*>(done)[i] != 0;
        else row = static_cast<const long long*>(done)[i] != 0;
        if (!row) return false;
    }
    return true;
}

// Entry (before the WHILE node): fix this launch's stop point. Body (after each step): count the step
// if asked, advance the captured RNG offset if asked. Both: set the loop condition.
extern "C" __global__ void gdtool_loop_condition(
        gdtool_handle handle, const void* done, long long done_numel, int done_width,
        long long* step, const long long* limit, long long* stop_at, long long max_steps,
        long long step_increment, long long* rng_offset, long long rng_increment, int entering) {
    if (entering) {
        long long s = *step, l = *limit;
        *stop_at = (max_steps > 0 && max_steps < l - s) ? s + max_steps : l;
    } else {
        if (step_increment != 0) *step += step_increment;
        if (rng_offset != 0) *rng_offset += rng_increment;
    }
    bool again = *step < *stop_at && !gdtool_all_done(done, done_numel, done_width);
    cudaGraphSetConditional(handle, again ? 1u : 0u);
}

// What torch's replay prologue does before each replay: the captured RNG kernels' seed and offset.
extern "C" __global__ void gdtool_rng_set(long long* seed, long long* offset, unsigned long long seed_value,
                                          long long offset_value) {
    *seed = static_cast<long long>(seed_value);
    *offset = offset_value;
}
"""

_CONDITION = b"gdtool_loop_condition"
_RNG_SET = b"gdtool_rng_set"


@dataclass
class _Kernels:
    module: object
    condition: object
    rng_set: object
    target: str          # "sm_90" (CUBIN) or "compute_89" (PTX, JIT-compiled by the driver)


_kernel_lock = threading.Lock()
_kernel_cache: dict = {}


def compile_kernels(capability: tuple[int, int], nvrtc=None) -> tuple[bytes, str]:
    """Compile the loop's kernels with NVRTC: (image, target). CUBIN for the device's architecture, or PTX
    for the newest older one NVRTC knows (the driver then compiles it). Needs no GPU."""
    if nvrtc is None:
        _, nvrtc = _bindings()
    arch = capability[0] * 10 + capability[1]
    try:
        supported = [int(a) for a in _nvrtc_check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]
    except (AttributeError, RuntimeError):
        supported = [arch]
    if arch in supported:
        target, cubin = f"sm_{arch}", True
    else:
        older = [a for a in supported if a <= arch]
        if not older:
            raise RuntimeError(f"NVRTC knows architectures {supported}, none at or below the device's sm_{arch}; "
                               f"install an NVRTC of the same CUDA release as the driver")
        target, cubin = f"compute_{max(older)}", False
    prog = _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE.encode(), b"gdtool_devloop.cu", 0, [], []),
                        "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={target}".encode(), b"--std=c++17"]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the device loop's condition kernel for {target}:\n"
                               f"{log.decode(errors='replace').strip()}")
        if cubin:
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        else:
            size = _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = b" " * size
            _nvrtc_check(nvrtc, nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return image, target


def _nvrtc_check(nvrtc, result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        text = nvrtc.nvrtcGetErrorString(err)
        text = text[1] if isinstance(text, tuple) else text
        raise RuntimeError(f"{what} failed: {text.decode() if isinstance(text, bytes) else text}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _current_context(cu, device_index: int):
    """The CUDA context torch uses on this device, made current in this thread."""
    ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        dev = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def _kernels(cu, nvrtc, device_index: int, ctx) -> _Kernels:
    capability = torch.cuda.get_device_capability(device_index)
    key = (int(ctx), capability)
    with _kernel_lock:
        if key not in _kernel_cache:
            image, target = compile_kernels(capability, nvrtc)
            if target.startswith("compute_"):
                image = image.rstrip(b"\0") + b"\0"
            module = _check(cu.cuModuleLoadData(image), "cuModuleLoadData (the condition kernel)")
            condition = _check(cu.cuModuleGetFunction(module, _CONDITION), "cuModuleGetFunction")
            rng_set = _check(cu.cuModuleGetFunction(module, _RNG_SET), "cuModuleGetFunction")
            _kernel_cache[key] = _Kernels(module, condition, rng_set, target)
        return _kernel_cache[key]


def release_kernels() -> None:
    """Unload the cached condition-kernel modules (after every DeviceLoop is closed)."""
    if not _kernel_cache:
        return
    cu, _ = _bindings()
    with _kernel_lock:
        for kernels in _kernel_cache.values():
            cu.cuModuleUnload(kernels.module)
        _kernel_cache.clear()


# -- the captured graph: node types, torch's RNG arguments ------------------------------------------

_BODY_NODE_TYPES = ("KERNEL", "MEMCPY", "MEMSET", "GRAPH", "EMPTY", "CONDITIONAL")


def _nodes(cu, graph) -> list:
    count = _check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    count = count[1] if isinstance(count, tuple) else count
    if not count:
        return []
    nodes, _ = _check(cu.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    return list(nodes)


def _walk(cu, graph):
    """(node, type name) of every node, child graphs included."""
    for node in _nodes(cu, graph):
        kind = _check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        name = getattr(kind, "name", str(kind)).replace("CU_GRAPH_NODE_TYPE_", "")
        yield node, name
        if name == "GRAPH":
            yield from _walk(cu, _check(cu.cuGraphChildGraphNodeGetGraph(node), "cuGraphChildGraphNodeGetGraph"))


def _check_body_nodes(cu, graph) -> int:
    """Refuse node types a conditional body cannot hold; return the node count."""
    counts: dict[str, int] = {}
    for _, name in _walk(cu, graph):
        counts[name] = counts.get(name, 0) + 1
    bad = {name: n for name, n in counts.items() if name not in _BODY_NODE_TYPES}
    if bad:
        listed = ", ".join(f"{n} {name.lower().replace('_', '-')}" for name, n in sorted(bad.items()))
        raise ValueError(f"the captured step holds {listed} node(s), which CUDA does not allow in the body of a "
                         f"conditional node (allowed: kernels, memcpys, memsets, child graphs, empty nodes); "
                         f"capture the step on one stream without host callbacks or graph-owned allocations, "
                         f"or use mode='step-graph'")
    return sum(counts.values())


@dataclass(frozen=True)
class PhiloxArgument:
    """One captured RNG kernel's `at::PhiloxCudaState` argument: it reads seed = *seed_ptr and
    offset = *offset_ptr + offset_intragraph when it runs."""
    kernel: str
    seed_ptr: int
    offset_ptr: int
    offset_intragraph: int


# at::PhiloxCudaState (torch 2.3 and later): {int64_t* seed; int64_t* offset_extragraph;
# uint64_t offset_intragraph; bool captured;} = 32 bytes; `captured` is 1 in every captured kernel.
_PHILOX_SIZE = 32
_PHILOX_MANGLED = "PhiloxCudaState"


def decode_philox(raw: bytes, is_device_pointer=lambda pointer: True) -> tuple[int, int, int] | None:
    """(seed_ptr, offset_ptr, offset_intragraph) if `raw` reads as a captured PhiloxCudaState, else None."""
    if len(raw) != _PHILOX_SIZE or raw[24] != 1:
        return None
    seed_ptr, offset_ptr, intragraph = struct.unpack_from("<QQQ", raw)
    if not seed_ptr or not offset_ptr or intragraph % 4 or intragraph >= 1 << 32:
        return None
    if not (is_device_pointer(seed_ptr) and is_device_pointer(offset_ptr)):
        return None
    return seed_ptr, offset_ptr, intragraph


def kernel_param_bytes(kernel_params: int, extra: int, index: int, offset: int, size: int) -> bytes:
    """The bytes of argument `index` of a kernel node, from its kernelParams array (void*[]) or, if that
    is null, its `extra` packed buffer (CU_LAUNCH_PARAM_BUFFER_POINTER)."""
    if kernel_params:
        pointer = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[index]
        return ctypes.string_at(pointer, size)
    if extra:
        entries = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
        for i in range(0, 32, 2):
            key = entries[i] or 0
            if key == 0:       # CU_LAUNCH_PARAM_END
                break
            if key == 1:       # CU_LAUNCH_PARAM_BUFFER_POINTER
                return ctypes.string_at(entries[i + 1] + offset, size)
    raise RuntimeError("a kernel node exposes neither kernelParams nor a packed argument buffer")


def _kernel_function(cu, params):
    func = params.func
    if int(func) == 0 and int(getattr(params, "kern", 0) or 0) != 0:
        func = _check(cu.cuKernelGetFunction(params.kern), "cuKernelGetFunction")
    return func


def _is_device_pointer(cu, pointer: int) -> bool:
    result = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pointer)
    return int(result[0]) == 0 and int(result[1]) == int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE)


def find_philox_arguments(cu, graph) -> tuple[list[PhiloxArgument], dict[str, list[bytes]]]:
    """Every captured RNG kernel's PhiloxCudaState argument in `graph` (child graphs included), and the
    arguments (raw bytes) of kernels named after PhiloxCudaState where none decoded as one."""
    found, undecoded = [], {}
    for node, kind in _walk(cu, graph):
        if kind != "KERNEL":
            continue
        params = _check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        func = _kernel_function(cu, params)
        name = cu.cuFuncGetName(func)
        name = name[1] if int(name[0]) == 0 else None
        name = name.decode(errors="replace") if isinstance(name, bytes) else name
        if name is not None and _PHILOX_MANGLED not in name:
            continue
        hits, raws = 0, []
        for index in range(256):
            info = cu.cuFuncGetParamInfo(func, index)
            if int(info[0]) != 0:
                break
            offset, size = int(info[1]), int(info[2])
            raw = kernel_param_bytes(int(params.kernelParams or 0), int(params.extra or 0), index, offset, size)
            raws.append(raw)
            decoded = decode_philox(raw, lambda pointer: _is_device_pointer(cu, pointer))
            if decoded is not None:
                found.append(PhiloxArgument(name or "?", *decoded))
                hits += 1
        if name is not None and hits == 0:
            undecoded[name] = raws
    return found, undecoded


def references(raws: list[bytes], pointer: int) -> bool:
    """Whether any argument holds `pointer` at an 8-byte-aligned position (a struct that wraps it)."""
    needle = struct.pack("<Q", pointer)
    return any(raw[i:i + 8] == needle for raw in raws for i in range(0, len(raw) - 7, 8))


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

    `launch(max_steps=N)` runs at most N steps (streaming); `launches` counts graph launches.
    """

    def __init__(self, body, done: torch.Tensor, step: torch.Tensor, limit, *, count_steps: bool = False,
                 advance_rng: bool = False, rng_increment: int | None = None,
                 generator: torch.Generator | None = None):
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
        cu, nvrtc = _bindings()
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
        self._entry_params = self._condition_params(entering=True, max_steps=None)
        entry = _check(cu.cuGraphAddKernelNode(parent, None, 0, self._entry_params), "cuGraphAddKernelNode (entry)")
        self._entry = entry

        params = cu.CUgraphNodeParams()
        params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = ctx
        try:  # cuda-python 13: (graph, deps, edge data, count, params); 12.x: (graph, deps, count, params)
            _check(cu.cuGraphAddNode(parent, [entry], None, 1, params), "cuGraphAddNode (WHILE)")
        except TypeError:
            _check(cu.cuGraphAddNode(parent, [entry], 1, params), "cuGraphAddNode (WHILE)")
        loop_body = params.conditional.phGraph_out[0]
        child = _check(cu.cuGraphAddChildGraphNode(loop_body, None, 0, body_graph), "cuGraphAddChildGraphNode")
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

    def _condition_params(self, *, entering: bool, max_steps: int | None):
        cu = self._cu
        rng_offset = self._rng[1] if (self._rng is not None and not entering) else 0
        kp = cu.CUDA_KERNEL_NODE_PARAMS()
        kp.func = self._kernels.condition
        kp.gridDimX = kp.gridDimY = kp.gridDimZ = 1
        kp.blockDimX = kp.blockDimY = kp.blockDimZ = 1
        kp.sharedMemBytes = 0
        values = (int(self._handle), self.done.data_ptr(), self.done.numel(), _DONE_WIDTHS[self.done.dtype],
                  self.step.data_ptr(), self.limit.data_ptr(), self._stop_at.data_ptr(), max_steps or 0,
                  1 if (self.count_steps and not entering) else 0, rng_offset, self.rng_increment or 0, int(entering))
        types = (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                 ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int)
        kp.kernelParams = (values, types)
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
