"""What the hand-written decode kernels need from Triton, and whether it is there.

Triton comes with CUDA builds of torch; CPU builds have none. Every kernel module imports Triton
through here, so that without it the modules still import (their torch references run instead),
and programmatic dependent launch (PDL) is switched in one place.

PDL (Hopper and later): a kernel launched with it may start while the previous kernel in the stream
is still running; it must call `gdc_wait()` before it reads anything that kernel wrote. The decode
kernels issue their weight loads first (weights are never written during a step), then wait: the
loads of one kernel overlap the tail of the one before. Inside a captured graph the launch attribute
becomes a programmatic edge between the two kernel nodes.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

try:  # a CPU build of torch has no Triton: the kernels' torch references run instead
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

HAVE_TRITON = triton is not None

# Programmatic dependent launch: False (off), True (every kernel) or "auto" (per kernel, by the weights it
# reads: `uses_pdl`). "auto" unless set otherwise (GDTOOL_PDL=0 / 1 / auto, or `pdl(...)`): the fast step measured
# fastest with it on both presets run (H200, 69c20df, profiles/h200/bench/<preset>/pdl-*: gemma-3-1b at batch 1
# 1.113 ms off, 0.975 on, 0.977 auto; llama-1b 0.919, 0.881, 0.875), and per kernel it leaves off the large
# products where PDL cost time. docs/fast.md has what was measured.
PDL_MODES = (False, True, "auto")
# "auto": PDL on a kernel that reads at most this many weight bytes. Measured per kernel on the H200 (each kernel
# after itself in a graph; profiles/h200/decode-kernels/): PDL saved 0.4-1.7 us a call on every product of at
# most 50 MB but Llama-1B's down projection (+0.8 us, 34 MB), and cost 8-9 us on Qwen3-8B's and Llama-8B's
# gate/up (201 and 117 MB) and 5 us on Gemma-3-1B's lm_head (604 MB); larger products were mixed.
PDL_AUTO_MAX_BYTES = 64 << 20


_OFF, _ON = ("0", "false", "off", "", "none"), ("1", "true", "on")


def env_flag(name: str, default: bool = False) -> bool:
    """An on/off environment variable of gdtool's kernels (GDTOOL_FUSED_COMBINE, GDTOOL_UNTESTED_KERNELS): 0,
    false or off; 1, true or on; unset: `default`. Anything else is refused, not read as on."""
    if name not in os.environ:
        return default
    value = os.environ[name].strip().lower()
    if value in _OFF or value in _ON:
        return value in _ON
    raise ValueError(f"{name}={os.environ[name]!r}: give 1 (on) or 0 (off)")


# The kernels' on/off switches: each read from its environment variable when gdtool is imported (its default where
# unset), and set for a block by `switches(...)` (a probe's A/B, a test), as `pdl(...)` sets PDL and `tuning.use`
# the tuning, never by patching a module's globals. What each one does is said where it is read:
# `attention.fused_combine`, `attention.scope` (sliding_split), `gemv.early_norm`, `gemv.fold_embedding`,
# `gemv.late_trigger`, `tail.refusal`, `sampling.argmax_refusal` (compiled_argmax), `linear.kernel_for` (dot_linear:
# off until a bench shows the split-K dot kernel ahead of cuBLAS's products). On CUDA a switched-on path still
# runs only once it passed its cuda tests there (`untested_on_cuda`).
SWITCHES = {"fused_combine": ("GDTOOL_FUSED_COMBINE", True), "early_norm": ("GDTOOL_EARLY_NORM", True),
            "fold_embedding": ("GDTOOL_FOLD_EMBEDDING", True), "late_trigger": ("GDTOOL_LATE_TRIGGER", False),
            "one_kernel_tail": ("GDTOOL_ONE_KERNEL_TAIL", True), "sliding_split": ("GDTOOL_SLIDING_SPLIT", True),
            "compiled_argmax": ("GDTOOL_COMPILED_ARGMAX", True), "dot_linear": ("GDTOOL_DOT_LINEAR", False)}
_FROM_ENV = {name: env_flag(variable, default) for name, (variable, default) in SWITCHES.items()}   # at import
_switched: list[dict] = []


def asked(name: str) -> bool:
    """Whether switch `name` (a key of SWITCHES) is on: the innermost `switches(...)` block that sets it, else its
    environment variable, else its default."""
    if name not in SWITCHES:
        raise ValueError(f"{name!r} is not a switch of gdtool's kernels; they are: {', '.join(SWITCHES)}")
    for block in reversed(_switched):
        if name in block:
            return block[name]
    return _FROM_ENV[name]


@contextmanager
def switches(**values: bool):
    """Inside the block each named switch is on or off as given (`switches(fused_combine=False)`), whatever its
    environment variable says; the others keep theirs."""
    unknown = sorted(set(values) - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown switch(es) of gdtool's kernels {unknown}: they are {', '.join(SWITCHES)}")
    _switched.append({name: bool(value) for name, value in values.items()})
    try:
        yield
    finally:
        _switched.pop()


def _pdl_mode(value) -> bool | str:
    text = str(value).strip().lower()
    if text in _OFF:
        return False
    if text == "auto":
        return "auto"
    if text in _ON:
        return True
    raise ValueError(f"PDL setting {value!r} (GDTOOL_PDL or pdl()): give 0 (off), 1 (every kernel) or auto (kernels "
                     f"reading at most {PDL_AUTO_MAX_BYTES >> 20} MB of weights)")


_pdl = _pdl_mode(os.environ.get("GDTOOL_PDL", "auto"))


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def usable(*tensors) -> bool:
    """Whether the Triton kernels run on these tensors: CUDA tensors with Triton present, or any tensors
    under Triton's interpreter (the CPU tests)."""
    if not HAVE_TRITON:
        return False
    if interpreting():
        return True
    return all(t.is_cuda for t in tensors)


# Kernel paths whose cuda tests (`pytest -m cuda`) have passed on a GPU, per (capability, Triton major.minor): what
# passed on one sm_90 GPU (an H200) with Triton 3.6 runs on any sm_90 GPU (an H100) with Triton 3.6. A path not listed
# for the device's key runs on a CPU (Triton's interpreter, the torch references) but is refused on CUDA with the
# reason `untested_on_cuda` gives; GDTOOL_UNTESTED_KERNELS=1 runs it anyway (the cuda tests set it). A name goes in
# once every cuda test that ran the path has passed (profiles/kernel_paths.py reads that from the test run's record;
# the records are kept under profiles/h200/tests/ and profiles/h100/tests/).
_SM90_TRITON_36 = frozenset({
    "Gemma3, (1 + w) norms, gelu_tanh, post norms, q/k norm, sliding window, <= 4 rows",
    "Gemma3, (1 + w) norms, gelu_tanh, post norms, q/k norm, sliding window, passes of 4 rows",
    "Llama, <= 4 rows",
    "Llama, passes of 4 rows",
    "Mistral, window >= cache, <= 4 rows",
    "Mistral, window >= cache, passes of 4 rows",
    "Qwen2, q/k/v biases, <= 4 rows",
    "Qwen2, q/k/v biases, passes of 4 rows",
    "Qwen3, q/k norm, <= 4 rows",
    "Qwen3, q/k norm, passes of 4 rows",
    "Mixtral, experts, <= 4 rows",
    "Qwen2Moe, experts, q/k/v biases, <= 4 rows",
    "Qwen3Moe, experts, q/k norm, <= 4 rows",
    "gpt_oss attention, sinks, split-KV",
    "gpt_oss experts",
    "gpt_oss experts, grouped",
    "embedding lookup in the first qkv_rope",   # 27 cuda tests on the H100 at 1bc10cb and 4750d72
    "greedy tail in one kernel",
    "linear, <= 4 rows",
    "linear, bias, <= 4 rows",
    "mixtral experts",
    "mixtral experts, grouped",
    "norm weights before the PDL wait",
    "PDL trigger in the last tile round",   # runs only with GDTOOL_LATE_TRIGGER=1 (off by default)
    "olmoe experts",
    "olmoe experts, grouped",
    "qwen2_moe experts",
    "qwen3_moe experts",
    "qwen3_moe experts, grouped",
    "split-KV attention, combine in the last program",
    "split-KV attention in the compiled HF forward",
})
CUDA_TESTED = {((9, 0), "3.6"): _SM90_TRITON_36}

# The kernel paths this process has asked about on CUDA, tested or not (the cuda tests report, per test,
# which paths it ran: tests/conftest.py, profiles/kernel_paths.py).
asked_on_cuda: set[str] = set()


def version() -> str | None:
    """Triton's version ("3.6.0"), None without Triton."""
    return getattr(triton, "__version__", None)


def kernel_key(device) -> tuple:
    """(capability, Triton major.minor) of a CUDA device: the key of CUDA_TESTED, ((9, 0), "3.6") for an H100 or H200
    with Triton 3.6."""
    import torch
    minor = ".".join((version() or "none").split("+")[0].split(".")[:2])
    return tuple(torch.cuda.get_device_capability(device)), minor


def untested_on_cuda(path: str, device) -> str:
    """'' where kernel path `path` may run on `device`; else why it is refused there."""
    if device.type == "cuda":
        asked_on_cuda.add(path)
    if device.type != "cuda" or env_flag("GDTOOL_UNTESTED_KERNELS"):
        return ""
    key = kernel_key(device)
    tested = CUDA_TESTED.get(key, frozenset())
    if path in tested:
        return ""
    (major, minor), triton_version = key
    where = f"sm_{major}{minor} with Triton {triton_version}"
    return (f"gdtool's kernels for {path} have not passed their cuda tests on {where} yet (tested there: "
            f"{', '.join(sorted(tested)) or 'none'}); GDTOOL_UNTESTED_KERNELS=1 runs them anyway")


def pdl_supported(device) -> bool:
    import torch
    if not HAVE_TRITON or interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled() -> bool | str:
    """The PDL setting for the next kernel launches (where the device supports it): False, True or "auto".
    Read at launch: a captured graph keeps what was set when it was captured."""
    return _pdl


def pdl_label() -> str:
    return {False: "off", True: "on"}.get(_pdl, f"on kernels reading <= {PDL_AUTO_MAX_BYTES >> 20} MB of weights")


def set_pdl(enabled: bool | str) -> None:
    global _pdl
    _pdl = _pdl_mode(enabled)


@contextmanager
def pdl(enabled: bool | str):
    """Launch the decode kernels with (True), without (False) programmatic dependent launch, or with it on the
    kernels that read at most PDL_AUTO_MAX_BYTES of weights ("auto")."""
    global _pdl
    before, _pdl = _pdl, _pdl_mode(enabled)
    try:
        yield
    finally:
        _pdl = before


def uses_pdl(weight_bytes: int = 0) -> bool:
    """Whether a kernel reading `weight_bytes` of weights launches with PDL under the current setting."""
    return _pdl is True or (_pdl == "auto" and weight_bytes <= PDL_AUTO_MAX_BYTES)


def launch_options(device, weight_bytes: int = 0) -> dict:
    """Keyword arguments for a kernel launch: the PDL attribute, and the flag that makes the kernel wait."""
    use = uses_pdl(weight_bytes) and pdl_supported(device)
    return {"launch_pdl": True, "PDL": True} if use else {"PDL": False}


_COUNTS: dict = {}


def zero_counts(name: str, n: int, device):
    """A kernel's completion counters (int32, at least n): how many of a group's programs have finished, for
    the last one to finish to do the group's final step (the fused attention combine, the experts router's
    routing). Zero between calls: the last program resets its group's count. One buffer per (name, device),
    made before any capture (the warm-up's first call)."""
    import torch
    key = (name, str(device))
    if key not in _COUNTS or _COUNTS[key].numel() < n:
        _COUNTS[key] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return _COUNTS[key]


def dot_precision(dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`. float32 follows torch's float32 matmul precision:
    "ieee" at "highest" (torch's default: its float32 matmuls keep float32 products, which Triton's default
    would round to TF32's 10 mantissa bits), "tf32" where the user chose "high" or "medium". Other dtypes get
    "tf32", Triton's default, which it ignores for 16-bit operands (a bf16 program is the one compiled before)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
