"""What the device loop needs and whether this machine has it: versions, cuda-python, the probe.

`device_loop_support()` probes once per device (torch's raw graph, cuda-python's conditional nodes, the
driver's and NVRTC's CUDA versions) and answers with the first thing missing, as a sentence naming the fix.
`_bindings()` hands out cuda-python's driver and NVRTC modules and `_check()` unpacks a driver call's
result: nvrtc.py and loop.py call both, nodes.py `_check`.
"""
from __future__ import annotations

import threading

import torch

MIN_CUDA = (12, 4)    # conditional graph nodes and cudaGraphSetConditional
MIN_TORCH = (2, 8)    # torch.cuda.CUDAGraph(keep_graph=True) and raw_cuda_graph()

_INSTALL_BINDINGS = "pip install 'cuda-python>=12.4'"


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
