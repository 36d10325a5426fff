"""CUDA-graph capture of a step function, and its CPU stand-in.

On CUDA a function is warmed up on a side stream (cuBLAS handles, lazy buffers) and captured once;
`replay()` then launches every kernel it ran with one call. Without CUDA the same function is kept
uncaptured and `replay()` calls it, so the graph modes run their whole logic on a CPU.

Warm-up runs the function for real: the caller snapshots its buffers first and restores them
after capture (`decode.py`), as it restores the random generator.
"""
from __future__ import annotations

import os
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class Uncaptured:
    """Stand-in used where there is no CUDA: replay() runs the function."""
    captured = False

    def __init__(self, fn, before=None):
        # before: called ahead of each replay (the Python state a captured graph would have frozen)
        self.fn, self.before = fn, before
        self.output = None

    def replay(self) -> None:
        if self.before is not None:
            self.before()
        self.output = self.fn()

    def close(self) -> None:
        self.fn = None


class CaptureError(ValueError):
    """A step that cannot be captured, with the model, the cause and where it happens."""


class Captured:
    """A CUDA graph of `fn`; `output` holds what `fn` returned during capture (static buffers)."""
    captured = True

    def __init__(self, fn, pool=None, keep_graph: bool = False, model=None, constants: list | None = None):
        # keep_graph: keep the cudaGraph_t after instantiation, for a device loop to embed it
        self.graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
        # the pinned host copies of the constants the step copies to the GPU: the graph reads them at every replay
        self.constants = constants if constants is not None else []
        # captured on the warm-up stream: the cuBLAS workspace it made there is reused, not made during capture
        generator = _generator_snapshot()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=side_stream()), HostConstants(self.constants):
                self.output = fn()
        except RuntimeError as error:
            _restore_generator(generator)
            name = type(model).__name__ if model is not None else "the model"
            first, where = _first_error(error)
            seen = getattr(self.constants, "copies", None)
            cause = (f"in the warm-up step: {'; '.join(seen)}" if seen else
                     "the forward reads the host or copies a CPU tensor inside the step")
            raise CaptureError(f"capturing {name}'s decode step failed: {str(first).strip().splitlines()[0][:300]}"
                               f"{f', at {where}' if where else ''} ({cause}); use mode='eager'. A failed capture "
                               "can leave CUDA unusable in this process: restart it before the next decode") from error

    def replay(self) -> None:
        self.graph.replay()

    def close(self) -> None:
        self.graph.reset()
        self.output = None
        self.constants = []


def _first_error(error: BaseException):
    """(the error that broke the capture, the model code that raised it). An op the stream cannot capture
    raises inside the step; leaving `torch.cuda.graph` then raises again ("operation failed due to a previous
    error during capture"), with the first as its context: that first one names the op."""
    first = error
    while isinstance(first.__context__, RuntimeError) and first.__context__ is not first:
        first = first.__context__
    return first, _outside(traceback.extract_tb(first.__traceback__))


def _generator_snapshot():
    """(CUDA's default generator, a copy of its state) before a capture. A capture that fails half way never
    reaches the generator's capture epilogue, and every later random draw in the process then raises
    ("Offset increment outside graph capture encountered unexpectedly"): the copy put back repairs it."""
    try:
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        return generator, generator.clone_state()
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without graph-safe generator states
        return None


def _restore_generator(snapshot) -> None:
    if snapshot is not None:
        generator, state = snapshot
        try:
            generator.graphsafe_set_state(state)
        except (AttributeError, RuntimeError):  # pragma: no cover
            pass


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


def warm_up(fn, steps: int, model=None, before=None) -> list | None:
    """Run `fn` on a side stream, as torch asks before capturing; with `model`, the first run also checks
    that nothing in it would break the capture and returns the host constants it copies (`check_capturable`).
    `before` runs ahead of every step (the caller's per-step setup, on the same stream)."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    constants = None
    with torch.cuda.stream(side):
        for i in range(steps):
            if before is not None:
                before()
            if i == 0 and model is not None:
                constants = check_capturable(fn, model)
            else:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    return constants


def capture(fn, device: torch.device, pool=None, keep_graph: bool = False, model=None, constants=None):
    return Captured(fn, pool, keep_graph, model, constants) if can_capture(device) else Uncaptured(fn)


# -- what makes a step uncapturable, found before capture ------------------------------------------

# aten ops that make the host wait for the device (a value read back, or a size known only on the device)
_SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "is_nonzero", "item")


# aten ops that take a list of index tensors: a boolean one is expanded with `nonzero` inside the op
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put")


class _Hazards(TorchDispatchMode):
    """Record the ops of one step that a CUDA graph cannot hold: host reads and CPU tensors fed to the GPU."""

    def __init__(self, constants: HostConstants | None = None):
        super().__init__()
        self.found: list[str] = []
        self.copies: list[str] = []  # host-to-device copies HostConstants does not serve (named if capture fails)
        self.constants = constants  # the copies it serves are not hazards

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = list(args) + list(kwargs.values())
        flat += [b for a in flat if isinstance(a, (list, tuple)) for b in a]  # index_put_'s list of indices
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        on_cuda = any(t.device.type == "cuda" for t in tensors) or str(kwargs.get("device", "")).startswith("cuda")
        # copies to the GPU are HostConstants' business (it pins them); a CPU tensor any other op takes is not
        copying = name in ("_to_copy", "copy_", "copy", "_copy_from", "lift_fresh", "lift_fresh_copy")
        cpu = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0 and not copying]
        out = func(*args, **kwargs)
        to_host = copying and isinstance(out, torch.Tensor) and out.device.type == "cpu" \
            and any(t.device.type == "cuda" for t in tensors)
        # a copy from pageable host memory that HostConstants does not serve (made inside an op: an index list)
        unserved = [t for t in tensors if t.device.type == "cpu" and not t.is_pinned()] \
            if copying and isinstance(out, torch.Tensor) and out.device.type == "cuda" \
            and not (self.constants is not None and self.constants.copying) else []
        if unserved and len(self.copies) < 3:
            # not refused here: a copy made once (a buffer built at first use) captures fine afterwards
            self.copies.append(f"{name} copies a CPU tensor of shape {tuple(unserved[0].shape)} to the GPU, at "
                               f"{_where()}")
        if len(self.found) < 3:
            found = None
            if (name in _SYNCING and on_cuda) or to_host:
                found = f"{name} reads a device value on the host, at {_where()}"
            elif _mask_counted_on_host(name, args, kwargs):
                found = (f"{name} takes a boolean mask on the device, whose true elements torch counts on the host, "
                         f"at {_where()}")
            elif on_cuda and cpu:
                found = f"{name} takes a CPU tensor of shape {tuple(cpu[0].shape)} (a host-to-device copy), at {_where()}"
            if found is not None and found not in self.found:  # one line names a place once
                self.found.append(found)
        return out


def _mask_counted_on_host(name: str, args: tuple, kwargs: dict) -> bool:
    """An indexing op given a boolean (or byte) mask on the device: torch expands the mask with `nonzero`, whose
    result's length only the host can learn (a sync, and a shape no graph can hold). One case does not: an
    assignment of one host value through a single mask, `x[mask] = 0`, which ATen's index_put_ runs as
    `masked_fill_` (its canDispatchToMaskedFill: not accumulating, a value of one element on the CPU, exactly one
    mask, on self's device), with no count at all."""
    if name not in _INDEXING or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    indices = [t for t in args[1] if isinstance(t, torch.Tensor)]
    masks = [t for t in indices if t.device.type != "cpu" and t.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return False
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        value = args[2] if len(args) > 2 else kwargs.get("values")
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if (not accumulate and isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"
                and len(indices) == 1 and masks[0].device == args[0].device):
            return False
    return True


def _where() -> str:
    """The innermost frame outside torch and gdtool: the model code that made the op."""
    return _outside(traceback.extract_stack()[:-2]) or "an unknown place"


def _outside(frames) -> str | None:
    """The innermost of `frames` outside torch and gdtool, as `file:line (function: code)`."""
    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.dirname(__file__)
    for frame in reversed(frames):
        if not frame.filename.startswith((torch_dir, here)):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name}: {(frame.line or '').strip()[:80]})"
    return None


class HostConstants(TorchFunctionMode):
    """Constants a forward makes on the host and copies to the GPU at every call (`torch.tensor(0.0,
    device="cuda")`, `cpu_tensor.to("cuda")`, `logits[:, :, [3, 7]]`: an index list). A graph cannot
    capture a copy from pageable host memory, but it can capture one from pinned memory, replayed as a
    memcpy node.

    Recording (`constants=None`, in a warm-up step): each such copy is done as asked and a pinned
    host copy of its source kept, in call order. Serving (in capture, with the recorded list): the
    i-th copy is made from the i-th pinned source when it holds the same values; otherwise the copy
    runs as asked and the capture fails with its own error (the source changes from call to call:
    no constant). An index list is served as the index tensor it stands for (the same values, so
    the same indexing). `copying` is true while a copy it serves runs (`_Hazards` flags the others).
    """

    def __init__(self, constants: list | None = None):
        super().__init__()
        self.recording = constants is None
        self.constants = Recorded() if constants is None else constants
        self.calls = 0
        self.copying = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = _host_index(args)
            if index is not None:
                served = tuple(self._serve(x, args[0].device, None) if isinstance(x, torch.Tensor) else x
                               for x in index)
                args = (args[0], served if isinstance(args[1], tuple) or len(served) > 1 else served[0], *args[2:])
            if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], (bool, int, float)) \
                    and args[0].device.type == "cuda" and not _fills_through_a_mask(args[0], args[1]):
                # `cuda_tensor[index] = -1.0`: torch makes the value a CPU tensor and copies it over inside the op;
                # made on the device instead, in the tensor's dtype as torch would cast it (no copy). Not through a
                # single device mask (`ids[image_mask] = 0`): ATen fills through it with the host value
                # (masked_fill_, no copy), and a device value would send it to index_put_, which counts the mask
                args = (args[0], args[1], torch.full((), args[2], dtype=args[0].dtype, device=args[0].device))
            return func(*args, **kwargs)
        source = _host_source(func, args, kwargs)
        if source is None:
            return func(*args, **kwargs)
        host, device, dtype = source
        return self._serve(host, device, dtype, lambda: func(*args, **kwargs))

    def _serve(self, host, device, dtype, copy=None):
        copy = copy or (lambda: host.to(device=device, dtype=dtype or host.dtype))
        self.copying = True
        try:
            if self.recording:
                # a contiguous copy: pinning an expanded source fails (PhiMoE copies `inv_freq[None, :, None].expand(B,
                # -1, 1)`), and the copy to the GPU makes it contiguous anyway: the same values either way
                self.constants.append(host.clone(memory_format=torch.contiguous_format).pin_memory())
                return copy()
            index, self.calls = self.calls, self.calls + 1
            pinned = self.constants[index] if index < len(self.constants) else None
            if pinned is None or pinned.shape != host.shape or pinned.dtype != host.dtype or not torch.equal(pinned, host):
                return copy()
            return pinned.to(device=device, dtype=dtype or pinned.dtype, non_blocking=True)
        finally:
            self.copying = False


class Recorded(list):
    """The pinned host constants a warm-up step recorded, in call order; `copies` names the host-to-device
    copies it saw that they do not cover (made inside an op), for the message of a capture that fails."""

    def __init__(self):
        super().__init__()
        self.copies: list[str] = []


def _fills_through_a_mask(tensor: torch.Tensor, index) -> bool:
    """`tensor[index] = scalar` runs as `masked_fill_` in ATen (no host read): the index holds exactly one tensor, a
    boolean (or byte) mask on the tensor's device, beside slices, integers and ellipses (applied as views first)."""
    items = index if isinstance(index, tuple) else (index,)
    tensors = [x for x in items if isinstance(x, torch.Tensor)]
    return (len(tensors) == 1 and tensors[0].dtype in (torch.bool, torch.uint8) and tensors[0].device == tensor.device
            and all(isinstance(x, (torch.Tensor, slice, int, type(Ellipsis))) and not isinstance(x, bool) for x in items))


def _host_index(args):
    """The index of `cuda_tensor[index]` (or of its assignment) as a tuple with every host-made index list
    (a flat list of ints or bools, or a CPU tensor of them) turned into CPU index tensors, or None where it
    has none: the indexing would copy those to the GPU at every call. A boolean mask becomes the positions
    it selects, one index tensor per dimension, as torch itself expands it; on the GPU torch would find
    them with `nonzero`, which reads their count on the host."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or args[0].device.type != "cuda":
        return None
    items = args[1] if isinstance(args[1], tuple) else (args[1],)
    out, found = [], False
    for x in items:
        if isinstance(x, list) and x and all(type(v) in (int, bool) for v in x) and len({type(v) for v in x}) == 1:
            x, found = torch.tensor(x), True
        elif isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0 and not x.is_floating_point():
            found = True
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in (torch.bool, torch.uint8) and x.dim():
            out.extend(x.bool().nonzero().unbind(1))
        else:
            out.append(x)
    return tuple(out) if found else None


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _host_source(func, args, kwargs):
    """(CPU source, CUDA device, dtype) when `func` copies host data to the GPU, else None."""
    if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor) \
            and _is_cuda(kwargs.get("device")):
        return torch.as_tensor(args[0], dtype=kwargs.get("dtype")), kwargs["device"], kwargs.get("dtype")
    if func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(args[0], torch.Tensor) \
            and args[0].device.type == "cpu":
        if func is torch.Tensor.cuda:
            return args[0], torch.device("cuda", torch.cuda.current_device()), None
        try:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (TypeError, RuntimeError):
            return None
        if _is_cuda(device):
            return args[0], device, dtype
    return None


def device_constants(model) -> list[str]:
    """Move the CPU tensors a model keeps as plain attributes onto its device, where its forward would copy
    them at every call (a copy a graph cannot capture). Returns the moved names."""
    device = next(model.parameters()).device
    moved = []
    for module_name, module in model.named_modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and value.device != device and value.device.type == "cpu":
                setattr(module, key, value.to(device))
                moved.append(f"{module_name}.{key}" if module_name else key)
    return moved


def check_capturable(fn, model) -> list:
    """Run `fn` once (a warm-up step) watching for what a graph cannot capture; refuse it with the cause.
    Returns the host constants the step copies to the GPU (pinned), for the capture to replay."""
    moved = device_constants(model)
    if moved:
        warnings.warn(f"gdtool: moved {len(moved)} CPU tensor(s) {moved[:3]} of {type(model).__name__} to its device "
                      "before capture (its forward copies them there at every call)", stacklevel=3)
    constants = HostConstants()
    watch = _Hazards(constants)
    with constants, watch:
        fn()
    if watch.found:
        raise CaptureError(f"{type(model).__name__}'s decode step cannot be captured in a CUDA graph: "
                           f"{'; '.join(watch.found)}; use mode='eager'")
    constants.constants.copies = watch.copies
    return constants.constants
