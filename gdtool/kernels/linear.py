"""The linear layers of a model outside the fast forward: at 1-4 rows in gdtool's matrix-vector kernel, up to 64 in
its split-K dot kernel (GDTOOL_DOT_LINEAR=1).

Where `forward.py` does not know a family (gpt-oss, and every other model that `kernels="fast"` runs as the
compiled HF forward), the step's products are cuBLAS's or inductor's. At one token a projection is a
matrix-vector product, and those run far from the copy bandwidth at these sizes: gpt-oss-20b's q/k/v and o
projections (53 MB a layer, with biases) took 825 us a step at batch 1 on the H200, 1.5 TB/s, in cuBLAS's
split-K kernels and their reduction (profiles/h200/nsys-fast/gpt-oss-20b-b1-c6bba88/). `gemv.rms_gemv` streams
its weight tiles with one tile's loads in flight (the fast forward's o, down and lm_head products, 3-4 TB/s).

`plan()` lists the decoder's `nn.Linear` modules at a batch size and which run `torch.ops.gdtool.linear`
(bias added to the float32 sum and rounded once, as F.linear's bias epilogue on CUDA); `scope()`, entered by
`step.CompiledStep` around each call of its compiled function as the experts' and attention's scopes are, gives
each listed module a forward that calls it: a custom operator, opaque to dynamo and inductor, reading the
module's parameters where they are (an in-place weight update is what the next step reads). Outside the scope
the modules are HF's. Left as they are: the output embedding (the lm_head, a long stream of tiles that cuBLAS
already reads near the copy bandwidth: 4.2 TB/s for gpt-oss-20b's), modules inside a MoE block that the experts
plan replaces, and more rows than one pass of the kernel (`gemv.ROWS_PER_PASS`); and the whole model where the fast
forward's line gave the batch to the matmuls (`forward.Plan.matmuls`: cuBLAS measured faster there). Where Triton
does not run (a CPU without the interpreter) the operator is F.linear itself: the swap is what the CPU tests
exercise, and the kernel under the interpreter.

Past those rows, or where the line gave the batch to the matmuls, up to 64 rows: with the switch `dot_linear`
(GDTOOL_DOT_LINEAR=1, off by default) the same modules call `torch.ops.gdtool.dot_linear`, the tensor-core kernel of
`dot.py` (cuBLAS's 64-row products of the narrow projections read at 43-67% of the copy bandwidth on the H100).
It stays off until a bench shows it ahead of cuBLAS's products (gpu_run.sh's `bench-dot`).

Projections fused by `fuse.fuse_projections` (q/k/v as one buffer, each module a view of its rows) run as one
product while the step compiles, as fuse's own forwards do: the group's first module calls the operator over the
whole buffer and hands the others their slices. One launch over 5120 rows instead of three, two of them 512-row
products that leave most of the GPU idle (gpt-oss-20b's k and v).
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import dot, gemv, swap
from .triton import asked, untested_on_cuda, usable

MAX_ROWS = gemv.ROWS_PER_PASS   # rows (batch x one decode token) the matrix-vector kernel takes: one pass a tile
PATH = f"linear, <= {MAX_ROWS} rows"           # the kernel path's name (CUDA_TESTED)
PATH_BIAS = f"linear, bias, <= {MAX_ROWS} rows"


@torch.library.custom_op("gdtool::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS: gdtool's matrix-vector kernel where Triton runs,
    F.linear elsewhere."""
    if usable(x, weight):
        return gemv.rms_gemv(x.contiguous(), None, 0.0, weight, bias=bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@dataclass
class Layer:
    name: str
    module: object
    applies: bool
    reason: str
    forward: object = None


@dataclass
class Plan:
    """The decoder's linear layers at one batch size: which run gdtool's kernel (`kernel`: "matrix-vector" or
    "split-K dot"), and why not."""
    layers: list = field(default_factory=list)
    kernel: str = "matrix-vector"

    @property
    def applies(self) -> bool:
        return any(layer.applies for layer in self.layers)

    def key(self) -> tuple:
        names = tuple(layer.name for layer in self.layers if layer.applies)
        return (self.kernel,) + names if names else ()

    def note(self) -> str:
        """One line for the kernels note: how many linear layers run the kernel, and why the others do not."""
        if not self.layers:
            return ""
        mine = sum(layer.applies for layer in self.layers)
        reasons = sorted({layer.reason for layer in self.layers if not layer.applies})
        groups = sum(layer.applies and _group(layer.module) is not None for layer in self.layers)
        line = f"linear layers {mine}/{len(self.layers)} in gdtool's {self.kernel} kernel"
        line += f", {groups} fused groups as one product each" if groups else ""
        return line + (f" (the others HF's: {'; '.join(reasons)})" if reasons else "")


def kernel_for(batch: int, matmuls: bool = False) -> str | None:
    """Which of gdtool's kernels takes the linear layers at `batch` rows: the matrix-vector kernel at up to MAX_ROWS
    (not where the batch line gave the batch to the matmuls), else the split-K dot kernel up to `dot.MAX_ROWS` where
    the switch `dot_linear` is on; None: HF's."""
    if batch <= MAX_ROWS and not matmuls:
        return "matrix-vector"
    if batch <= dot.MAX_ROWS and asked("dot_linear"):
        return "split-K dot"
    return None


def plan(model, batch: int, skip: tuple = (), matmuls: bool = False) -> Plan:
    """The model's nn.Linear modules at `batch` rows of one decode token each. `skip`: modules whose calls do
    not happen in the step (the MoE blocks the experts plan replaces: their routers stay HF's, never called);
    `matmuls`: the fast forward's batch line gave this batch to the matmuls (`kernel_for`)."""
    kernel = kernel_for(batch, matmuls)
    if kernel is None:
        return Plan()
    result = Plan(kernel=kernel)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skipped = {id(m) for block in skip for m in block.modules()}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output or id(module) in skipped:
            continue
        why = _why_not(module, kernel)
        layer = Layer(name, module, not why, why)
        if layer.applies:
            layer.forward = make_forward(module, kernel)
        result.layers.append(layer)
    if not any(layer.applies for layer in result.layers):
        return Plan()   # nothing swapped: no note, no key
    return result


def _why_not(module, kernel: str) -> str:
    weight = module.weight
    if "forward" in vars(module) and not _fused(module):
        return "a forward set on the module itself (a hook, e.g. accelerate's offload)"
    if type(module).forward is not torch.nn.Linear.forward:
        return f"{type(module).__name__}, a subclass with a forward of its own"
    if not weight.is_floating_point() or not weight.is_contiguous():
        return "weights not a contiguous floating-point matrix"
    if weight.device.type == "cuda" and weight.dtype not in (torch.bfloat16, torch.float16):
        return f"{str(weight.dtype).replace('torch.', '')} weights on CUDA (the kernel's cuda tests run bf16 and fp16)"
    if module.bias is not None and module.bias.dtype != weight.dtype:
        return "a bias in another dtype than the weight"
    paths = (PATH, PATH_BIAS) if kernel == "matrix-vector" else (dot.PATH, dot.PATH_BIAS)
    return untested_on_cuda(paths[module.bias is not None], weight.device)


def _fused(module) -> bool:
    """A member of a `fuse.fuse_projections` group (its forward is fuse's: the group's, or a slice of it)."""
    return "_gdtool_group" in vars(module) or "_gdtool_pending" in vars(module)


def _group(module):
    return vars(module).get("_gdtool_group")


def make_forward(module, kernel: str = "matrix-vector"):
    """The module's forward through `kernel`'s operator (`linear`, or `dot.linear` for "split-K dot"): HF's input
    ([..., K]), HF's result ([..., N]). A fused group's first module, while compiling, computes the whole group and
    leaves each other member its slice (fuse's protocol)."""
    original = vars(module).get("forward") or types.MethodType(type(module).forward, module)
    group = _group(module)
    op, limit = (torch.ops.gdtool.linear, MAX_ROWS) if kernel == "matrix-vector" else \
        (torch.ops.gdtool.dot_linear, dot.MAX_ROWS)

    def forward(x):
        rows = x.numel() // x.shape[-1]
        if rows > limit or x.dtype != module.weight.dtype:  # a shape or dtype the decode step never has
            return original(x)
        flat = x.reshape(rows, x.shape[-1])
        pending = vars(module).get("_gdtool_pending")
        if group is not None and torch.compiler.is_compiling():
            parts = op(flat, group.weight, group.bias).split(group.sizes, dim=-1)
            for other, part in zip(group.linears[1:], parts[1:]):
                other._gdtool_pending = (x, part)
            out = parts[0]
        elif pending is not None and pending[0] is x and torch.compiler.is_compiling():
            module._gdtool_pending = None
            out = pending[1]
        else:
            out = op(flat, module.weight, module.bias)
        return out.reshape(*x.shape[:-1], module.weight.shape[0])
    return forward


@contextmanager
def scope(linear_plan: Plan | None):
    """The planned modules run the kernel inside this scope; each module's own forward is back on exit."""
    layers = linear_plan.layers if linear_plan is not None else []
    with swap.forwards((layer.module, layer.forward) for layer in layers if layer.applies):
        yield
