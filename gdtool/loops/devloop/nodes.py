"""Reading a captured CUDA graph: its nodes, and torch's Philox RNG arguments in its kernels' parameters.

`_check_body_nodes()` walks the graph (child graphs included) and refuses node types a WHILE body cannot
hold. `find_philox_arguments()` finds the `PhiloxCudaState` argument of each captured torch RNG kernel in
its parameter bytes: the seed and offset tensors the loop must advance for sampling to draw fresh numbers.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

from .support import _check


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
