"""What a captured decode step bakes in, as one hashable key.

A CUDA graph records kernel launches with their arguments: the addresses of every tensor it reads,
their shapes and strides, the kernels the dispatcher picked (which depends on dtypes and on global
precision flags), and every Python value the step turned into a constant (sampling settings, EOS
ids, the batch and cache sizes). Replaying it is correct exactly when all of that is unchanged. The
`Signature` collects it; `gdtool.Decoder` replays a graph only for an equal signature and captures
a new one otherwise.

What it covers:

    shapes        mode, kernels (HF's or compiled), capture on/off, device, batch (after num_samples), prompt width (after
                  bucketing), static cache length, whether forced target lengths are given
    settings      the resolved `Settings` (sampling, penalty, EOS, pad, max_new_tokens), scores and
                  log-probabilities returned or not, num_samples
    model         every parameter and buffer (RoPE `inv_freq` included): address, dtype, shape,
                  strides; the attention implementation; which modules are in training mode
    precision     TF32 / reduced-precision matmul flags, float32 matmul precision, the SDPA backends
                  enabled, deterministic algorithms, the preferred BLAS library

What it leaves out on purpose: the values in the weights. `p.copy_(new)` (an RL weight sync) keeps
every address, so the next replay reads the new values. Tensors a model keeps as plain attributes
(not registered as parameters or buffers) are invisible to it; so are Python attributes changed on
a module after construction.

    sig = gdtool.core.signature.of(model, mode="step-graph", batch=4, width=12, cache_len=43, settings=settings)
    sig.diff(other)     # ['width', 'tensor model.layers.0.mlp.up_proj.weight: stride (128, 1) -> (1, 64)']
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch

from .settings import Settings


def _flag(getter):
    try:
        return getter()
    except (AttributeError, RuntimeError):  # a flag this torch release does not have
        return None


_PRECISION = {
    "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
    "cuda.matmul.allow_bf16_reduced_precision_reduction":
        lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    "cuda.matmul.allow_fp16_reduced_precision_reduction":
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    "cuda.matmul.allow_fp16_accumulation": lambda: torch.backends.cuda.matmul.allow_fp16_accumulation,
    "cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "float32_matmul_precision": torch.get_float32_matmul_precision,
    "sdp.flash": torch.backends.cuda.flash_sdp_enabled,
    "sdp.mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "sdp.math": torch.backends.cuda.math_sdp_enabled,
    "sdp.cudnn": lambda: torch.backends.cuda.cudnn_sdp_enabled(),
    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
    "preferred_blas_library": lambda: str(torch.backends.cuda.preferred_blas_library()),
    "mkldnn.enabled": lambda: torch.backends.mkldnn.enabled,
}


def precision_flags() -> tuple:
    """((name, value), ...) of every global flag that changes which kernel a matmul or attention runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch releases warn on the legacy TF32 getters
        return tuple((name, _flag(getter)) for name, getter in _PRECISION.items())


def model_layout(model) -> tuple[tuple, tuple]:
    """One walk over the modules: (tensors, training).

    tensors: ((module, name, address, dtype, shape, strides), ...) for every parameter and buffer,
    tied ones under each name they have; training: names of the modules in training mode.
    """
    tensors, training = [], []
    for prefix, module in model.named_modules():
        if module.training:
            training.append(prefix)
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    tensors.append((prefix, name, t.data_ptr(), t.dtype, t.shape, t.stride()))
    return tuple(tensors), tuple(training)


@dataclass(frozen=True)
class Signature:
    """Everything a replay of a captured decode step depends on. Equal signatures: replay is exact."""
    mode: str
    kernels: str
    captured: bool
    device: str
    dtype: torch.dtype
    batch: int
    width: int
    cache_len: int
    targets: bool
    settings: Settings
    return_scores: bool
    return_logprobs: bool
    num_samples: int
    attn_implementation: str | None
    training: tuple
    precision: tuple
    tensors: tuple

    def __post_init__(self):
        # Hashed once: a dict lookup then costs one comparison of the (long) tensor tuple.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    def diff(self, other: "Signature", limit: int = 8) -> list[str]:
        """What differs from `other`, readably: field names, and for tensors which ones and how."""
        changes = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine == theirs:
                continue
            if f.name == "tensors":
                changes += _tensor_diff(mine, theirs, limit)
            elif f.name == "precision":
                changes += [f"precision {name}: {a!r} -> {b!r}" for (name, a), (_, b) in zip(mine, theirs) if a != b]
            else:
                changes.append(f"{f.name}: {theirs!r} -> {mine!r}")
        return changes


def _tensor_diff(mine: tuple, theirs: tuple, limit: int) -> list[str]:
    what = ("address", "dtype", "shape", "stride")
    old = {(m, n): rest for m, n, *rest in theirs}
    new = {(m, n): rest for m, n, *rest in mine}
    changes = []
    for key in new.keys() | old.keys():
        name = ".".join(p for p in key if p)
        if key not in old:
            changes.append(f"tensor {name}: added")
        elif key not in new:
            changes.append(f"tensor {name}: removed")
        elif new[key] != old[key]:
            parts = [f"{w} {_show(w, a)} -> {_show(w, b)}" for w, a, b in zip(what, old[key], new[key]) if a != b]
            changes.append(f"tensor {name}: {', '.join(parts)}")
    changes.sort()
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more tensors"]
    return changes


def _show(what: str, value) -> str:
    if what == "address":
        return hex(value)
    if what == "shape":
        return str(tuple(value))
    return str(value)


def of(model, *, mode: str, batch: int, width: int, cache_len: int, settings: Settings, captured: bool = True,
       targets: bool = False, return_scores: bool = False, return_logprobs: bool = False,
       num_samples: int = 1, kernels: str = "hf") -> Signature:
    """The signature of a decode of `model` with these shapes and settings, read now."""
    tensors, training = model_layout(model)
    first = next(model.parameters())
    return Signature(mode=mode, kernels=kernels, captured=captured, device=str(first.device), dtype=first.dtype, batch=batch,
                     width=width, cache_len=cache_len, targets=targets, settings=settings,
                     return_scores=return_scores, return_logprobs=return_logprobs, num_samples=num_samples,
                     attn_implementation=getattr(model.config, "_attn_implementation", None), training=training,
                     precision=precision_flags(), tensors=tensors)
