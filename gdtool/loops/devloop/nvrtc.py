"""The loop's own kernels: the condition kernel, the RNG writer and the clock around inner graphs, compiled at
run time by NVRTC.

`compile_kernels()` turns `_KERNEL_SOURCE` into a CUBIN for the device (or PTX for the newest older
architecture NVRTC knows), with no nvcc and no CUDA headers; `_kernels()` loads the image once per
(context, architecture) and caches it for the process; `release_kernels()` unloads the cache.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from . import support
from .support import _check


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

// A clock around inner graphs (a rollout's refills): begin stores the device's nanosecond timer, end adds the
// time since into the total. Launched in the graph's order, so it spans exactly the work between the two.
extern "C" __global__ void gdtool_stamp(long long* clock, long long* total, int begin) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (begin) *clock = static_cast<long long>(now);
    else *total += static_cast<long long>(now) - *clock;
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
_STAMP = b"gdtool_stamp"


@dataclass
class _Kernels:
    module: object
    condition: object
    rng_set: object
    stamp: object        # the clock around inner graphs
    target: str          # "sm_90" (CUBIN) or "compute_89" (PTX, JIT-compiled by the driver)


_kernel_lock = threading.Lock()
_kernel_cache: dict = {}


def compile_kernels(capability: tuple[int, int], nvrtc=None) -> tuple[bytes, str]:
    """Compile the loop's kernels with NVRTC: (image, target). CUBIN for the device's architecture, or PTX
    for the newest older one NVRTC knows (the driver then compiles it). Needs no GPU."""
    if nvrtc is None:
        _, nvrtc = support._bindings()
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
            stamp = _check(cu.cuModuleGetFunction(module, _STAMP), "cuModuleGetFunction")
            _kernel_cache[key] = _Kernels(module, condition, rng_set, stamp, target)
        return _kernel_cache[key]


def release_kernels() -> None:
    """Unload the cached condition-kernel modules (after every DeviceLoop is closed)."""
    if not _kernel_cache:
        return
    cu, _ = support._bindings()
    with _kernel_lock:
        for kernels in _kernel_cache.values():
            cu.cuModuleUnload(kernels.module)
        _kernel_cache.clear()
