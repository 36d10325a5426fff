"""The fast step: gdtool's decode step with fused kernels (`decode(..., kernels="compiled")` and `"fast"`).

`kernels="hf"` (the default) runs HF's own kernels: hundreds of small launches per step, bit for
bit what `generate()` computes. `kernels="compiled"` runs the *same* step function, traced by
torch.compile (dynamo, one graph, no breaks) and lowered by inductor into fused kernels, with no
CUDA graphs of its own; gdtool then warms it up and captures it in its own graph exactly as it
captures the HF step. So the graph modes keep their buffers, their EOS polling and their ranges,
and only the kernels inside the replay change (plus, inside this step only, a grouped-query decode
attention that reads the cache without copying it, gpt-oss's with its sinks: `attention.py`):

    step-graph     forward + select + update compiled as one function, captured whole
    device-loop    as step-graph; the captured step is the body of the WHILE node
    forward-graph  the forward compiled, captured; select and update stay eager
    eager          the forward compiled and called directly each step (still host-bound)

What changes with the kernels: logits differ from HF's by rounding (inductor fuses and reorders
float arithmetic), so tokens can differ from generate() where two logits are within rounding of
each other (`gdtool.measure.accuracy.compare_kernels()` measures that: teacher-forced top-1 agreement
and the largest logit difference). What does not change: the step is a deterministic function of its buffers, so
it is bitwise equal to itself run uncaptured (`capture=False` calls the same compiled function).
Sampling with top-k uses the sort-free sampler of `kernels/sampling.py` (same noise, same candidate
rule); without top-k it uses `core/sampling.py`'s sorting top-p.

`kernels="fast"` is the same compiled step with the decode forward replaced, where it applies (the families
of `forward.FAMILIES` at small batch: `forward.plan`, `forward.line_paths`), by gdtool's own Triton kernels run
eagerly around the compiled select and update (`forward.py`). Elsewhere, on a mixture of experts of a known
family (`experts.FAMILIES`: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss), the compiled HF forward calls
gdtool's experts kernels in place of each MoE block (`experts/`, a custom operator swapped in only for the
duration of the compiled call) up to `experts.MAX_GROUPED_TOKENS` (64) tokens per step, or
`experts.MAX_TOKENS` (16) for Qwen2-MoE, whose shared expert the grouped kernels do not take; gpt-oss's
attention runs gdtool's split-KV kernels with sinks, and other models' one-token sdpa calls the split-KV kernels
without them (`attention.py`); and at 1-4 rows the decoder's linear layers run gdtool's matrix-vector kernel
(`linear.py`, swapped in the same way). Beyond those it is exactly "compiled"; `compiles()` says which ran and why.

Sliding-window layers (Mistral-style, Gemma 2/3, gpt-oss, Cohere 2, OLMo 3) compile one step per window
phase, as the graph modes capture one graph per phase: their Python counters are pinned on the phase's
side of "full" for the length of each call (`core.feed.Feed.pinned`, which afterwards leaves them where the
step would have left the true counts), so the step compiles once per phase, not once per step.
Linear-attention and state-space layers are refused (use kernels="hf").

Compiled functions are kept on the model (`compiled.py`), one per shape key (batch, prompt width, cache
length, settings, which buffers exist), each with its own code object so dynamo's recompile limit never
sends a long sweep back to eager; a second `decode()` with the same shapes compiles nothing.
`compiles(model)` lists them with their compile counts (more than 1 for a key, with no
`torch._dynamo.reset()` in between, is a recompile and is warned about).

    out = gdtool.decode(model, ids, mask, mode="step-graph", max_new_tokens=256, kernels="compiled")
    df = gdtool.measure.accuracy.compare_kernels(model, batch=4, prompt_len=128, steps=64)  # agreement per position
    gdtool.kernels.step.compiles(model)                                    # DataFrame, one row per key
"""
from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import time
import warnings
from contextlib import contextmanager

import torch

from ..core import compat, feed, sampling
from . import attention, experts, forward, gemv, linear, ops, tail
from . import sampling as fast_sampling  # beside the core sampling it speeds up
from . import triton as fast_triton  # not the triton package itself
from ..core.modes import DEFAULT_KERNELS, FORWARD_ONLY_MODES, KERNELS, check_kernels_name  # noqa: F401 (KERNELS: re-exported)
from ..core.step import Step
from .compiled import (_ATTR, _Compiled, _fresh, _graphs_compiled, _is_graph_break, _key, _name,
                       _no_function_modes, compiled_nothing, compiles, forget)

# The kernels options, and what runs compiled in each mode (the whole step where the mode captures the whole
# step; the forward alone elsewhere), are named in `gdtool.core.modes`.
# Inductor without CUDA graphs (gdtool captures); random draws through ATen, so the compiled step
# consumes the generator exactly as the HF step does and draws the same noise.
INDUCTOR_OPTIONS = {"triton.cudagraphs": False, "fallback_random": True}


@contextmanager
def inductor_options(**extra):
    """Inside, gdtool's programs compile with `extra` added to INDUCTOR_OPTIONS (e.g. `max_autotune=True`: Triton
    matmul templates with their epilogues fused, chosen by timing them at compile). A program already compiled for
    a shape key is kept as it is: set it before the first decode of a model."""
    global INDUCTOR_OPTIONS
    before = INDUCTOR_OPTIONS
    INDUCTOR_OPTIONS = {**before, **extra}
    try:
        yield INDUCTOR_OPTIONS
    finally:
        INDUCTOR_OPTIONS = before


# One-release deprecation aliases: the accuracy harness moved up to gdtool.measure.accuracy. The measurement
# layer stands above this one, so it is imported by name, only when an old name is asked for (`__getattr__`).
_MOVED = {name: "gdtool.measure.accuracy" for name in ("teacher_forced", "compare_kernels", "accuracy", "agreement")}


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"gdtool.kernels.step.{name} moved to {_MOVED[name]}.{name}; the old name goes in the next "
                      "release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def watched(model, kernels: str):
    """The model `graphs.warm_up` watches in a step's first warm-up (host reads, host constants), or None.

    HF's kernels only. A compiled step is one dynamo graph already (a host read is a graph break there),
    and dynamo compiles nothing under the watching dispatch mode: the step would run eagerly in that
    warm-up, its host constants unrecorded (torch 2.13 refuses such a fullgraph call outright)."""
    return model if kernels == DEFAULT_KERNELS else None


def check_kernels(kernels, device: torch.device | None = None, model=None, mode: str | None = None) -> str:
    """The kernels choice, validated; on 'compiled', whether inductor can build kernels here and the
    model is one the graph modes accept (eager mode too: its compiled forward has the same needs)."""
    check_kernels_name(kernels)
    if kernels != DEFAULT_KERNELS and device is not None:
        compilers = ("g++", "clang++", "c++")
        if device.type == "cpu" and not (os.environ.get("CXX") or any(shutil.which(c) for c in compilers)):
            raise ValueError(f"kernels={kernels!r} on a CPU needs a C++ compiler for inductor (g++ or clang++, or "
                             "set CXX); install one, or use kernels='hf'")
        if device.type == "cuda":
            from torch.utils._triton import has_triton
            if not has_triton():
                raise ValueError(f"kernels={kernels!r} on CUDA needs Triton for inductor's kernels; "
                                 "pip install triton (the version your torch names), or use kernels='hf'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kernels={kernels!r} supports CPU and CUDA devices, not {device.type}; use kernels='hf'")
    if kernels != DEFAULT_KERNELS and model is not None and mode == "eager":
        feed.check(model, "forward-graph", device)
    return kernels


def new_step(kernels: str, mode: str, *args, **kwargs) -> Step:
    """The step object a mode drives: HF's kernels, or the compiled step (same buffers, same arguments).
    `kernels` is checked by the caller (`check_kernels`)."""
    if kernels == DEFAULT_KERNELS:
        return Step(*args, **kwargs)
    return CompiledStep(*args, part="forward" if mode in FORWARD_ONLY_MODES else "step", kernels=kernels, **kwargs)


def uncaptured_twin(mode: str, kernels: str) -> tuple[str, bool | None]:
    """(mode, capture) of the uncaptured run that `mode` with `kernels` equals bit for bit, as `decode()` takes
    them: the same programs called directly. HF's kernels: eager (every mode computes generate()'s step). Fused
    kernels: eager for the modes that compile the forward alone, the step-graph uncaptured (`capture=False`) for
    those that compile the whole step. Those two are separate inductor programs and may round a logit apart (one
    bf16 unit in one logit of one row of 33, Mistral on the H200, `profiles/h200/tests/`), so across them only
    float32 agrees."""
    if kernels == DEFAULT_KERNELS or mode in FORWARD_ONLY_MODES:
        return "eager", None
    return "step-graph", False


# -- the compiled step ---------------------------------------------------------------------------

def _whole_step(step):
    # Step.__call__ is forward + select + update; CompiledStep.forward falls through to HF's forward here.
    Step.__call__(step)


def _greedy_step(step):
    # greedy past gdtool's own forward: the compiled HF forward's logits as the model gives them into gdtool's
    # two-stage argmax (`fast_sampling.argmax_op`: inductor keeps an argmax in one program per row), then the update
    step.update(fast_sampling.argmax_op(Step.forward(step, cast=False)))


def _forward_only(step):
    return Step.forward(step)


def _select_update(step, logits):
    # kernels="fast": the forward ran gdtool's kernels eagerly; select and update stay compiled
    step.update(step.select(logits))


def _update_only(step, tokens):
    step.update(tokens)




class CompiledStep(Step):
    """`Step` whose `__call__` (part="step") or `forward` (part="forward") runs a compiled function."""

    def __init__(self, *args, part: str = "step", kernels: str = "compiled", **kwargs):
        super().__init__(*args, **kwargs)
        if part not in ("step", "forward"):
            raise ValueError(f"part={part!r} must be 'step' or 'forward'")
        layers = compat.cache_layers(self.cache)
        other = sorted({type(layer).__name__ for layer in layers
                        if type(layer).__name__ != "StaticLayer" and not compat.is_sliding(layer)})
        if other:
            raise feed.Unsupported(f"kernels={kernels!r} supports static caches of full-attention and sliding-window "
                                   f"layers; this model also has {other[0]} (linear-attention, state-space or other "
                                   "layers, whose state the compiled step does not model); use kernels='hf'")
        # sliding layers branch on a Python counter, which dynamo specializes on: one compiled step per
        # window phase, with the counters pinned where the phase takes its branch (`Feed.pinned`)
        self.sliding = [layer for layer in layers if compat.is_sliding(layer)]
        self._by_phase: dict = {}
        self.part = part
        self.kernels = kernels
        # kernels="fast": gdtool's decode forward where it applies (a Llama-family model at small batch, a
        # sliding window no shorter than the cache: plan() reads batch and cache length off the mask), the
        # compiled HF forward elsewhere; `compiles()` says which ran and why.
        self.fast_plan = forward.plan(self.model, *self.state.mask.shape) if kernels == "fast" else None
        # kernels="fast" on a mixture of experts: inside the compiled HF forward, each known MoE block
        # calls gdtool's experts kernels (`experts.scope`, only for the duration of the compiled call)
        self.moe_plan = experts.plan(self.model, self.state.mask.shape[0]) \
            if kernels == "fast" and not self.fast_forward else None
        # kernels="fast" outside the fast forward at 1-4 rows: the decoder's nn.Linear modules in gdtool's
        # matrix-vector kernel (`linear.scope`), the MoE blocks the experts plan replaces left out; not where the
        # fast forward's batch line gave the batch to the matmuls (cuBLAS measured faster there: forward.line_paths).
        # Past those, up to 64 rows, its split-K dot kernel where GDTOOL_DOT_LINEAR=1 (`linear.kernel_for`)
        self.linear_plan = linear.plan(self.model, self.state.mask.shape[0],
                                       skip=tuple(x.block for x in self.moe_plan.layers if x.applies),
                                       matmuls=self.fast_plan.matmuls) if self.moe_plan is not None else None
        # kernels="fast" on gpt-oss (attention with sinks): its attention in gdtool's split-KV kernels
        self.sinks_kernel, self.sinks_note = attention.sinks_plan(self.model, kernels) \
            if not self.fast_forward else (False, "")
        # kernels="fast" elsewhere in the compiled HF forward: its one-token sdpa calls in the split-KV kernels
        self.split_kernel, self.split_note = attention.split_kv_plan(self.model, kernels) \
            if not self.fast_forward else (False, "")
        self._compiled = None
        self._cache_checked = False
        attention.install()

    @property
    def fast_forward(self) -> bool:
        return self.fast_plan is not None and self.fast_plan.applies

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.state
        if self._eager_argmax():
            # greedy after the fast forward: the same processed scores, a two-stage argmax (the index
            # torch.argmax gives, ties and NaN included), run eagerly like the forward
            return ops.argmax(sampling.process(logits, s.seen, self.settings))
        # Processed scores and log-probabilities are defined over the whole vocabulary: HF's path.
        if self._recorded() or not fast_sampling.applies(self.settings):
            return super().select(logits)
        return fast_sampling.choose(logits, s.seen, self.settings)

    def _recorded(self) -> bool:
        return self.state.scores is not None or getattr(self.state, "logprobs", None) is not None

    def _eager_argmax(self) -> bool:
        return self.fast_forward and not self.settings.do_sample and not self._recorded()

    def decode_logits(self, advance: bool = True):
        """kernels="fast": the decode forward in gdtool's kernels, run eagerly (`forward`); advance=False: (logits,
        the caches' counters left for the caller to advance), or the logits alone where the fast path declined."""
        if self._compiled is None and not self._cache_checked:
            # the cache's tensors exist once the prefill has run: check their layout on first use
            self._cache_checked = True
            why = forward.cache_ready(self.cache, self.model)
            if why:
                self.fast_plan = forward.Plan(False, why)
                return self.forward()
        s = self.state
        windows = self.feed.windows.layer_masks(s.mask, s.index) if self.feed.windows else None
        return forward.forward(self.model, self.cache, s.tokens, s.positions, s.mask, windows, advance=advance)

    def forward(self) -> torch.Tensor:
        if self.fast_forward:
            if self.part == "forward" and self._compiled is None:
                self._compiled = _compiled_for(self, None)  # nothing to compile: listed in compiles() all the same
            if self._compiled is not None:
                self._compiled.calls += 1
            return self.decode_logits()
        if self.part == "forward":
            return self._run(_forward_only)
        return Step.forward(self)

    def __call__(self) -> None:
        if self.part != "step":
            return super().__call__()
        if not self.fast_forward:
            return self._run(_greedy_step if self._argmax_op() else _whole_step)
        one_tail = self._one_kernel_tail()
        logits = self.decode_logits(advance=not one_tail)
        if not self.fast_forward:  # the cache check declined it: decode_logits ran the compiled HF forward
            return self._run(_select_update, logits)
        if one_tail:  # greedy: argmax, update and the counters' add in gdtool's kernels, nothing compiled
            logits, counters = logits
            self._entry(None, None).calls += 1  # listed in compiles(), with nothing compiled
            return ops.greedy_tail(sampling.process(logits, self.state.seen, self.settings), self, counters)
        if self._eager_argmax():
            return self._run(_update_only, self.select(logits))
        self._run(_select_update, logits)

    def _one_kernel_tail(self) -> bool:
        """Greedy after the fast forward, nothing recorded, no forced lengths, tested on this device: the step's
        tail in one kernel (`tail`)."""
        return self._eager_argmax() and not tail.refusal(self.state, self.state.mask.device)

    def _argmax_op(self) -> bool:
        """kernels="fast" past gdtool's own forward, greedy, the scores the logits, tested on this device: the step's
        argmax in gdtool's two stages (`fast_sampling.argmax_refusal`)."""
        return self.fast_plan is not None and self.part == "step" and not self.fast_forward and \
            not fast_sampling.argmax_refusal(self.settings, self.state, self.state.mask.device)

    @contextmanager
    def _scopes(self):
        """gdtool's kernels swapped into the HF modules for the duration of a compiled call (a captured graph
        replays no Python: the swap costs nothing after capture)."""
        with attention.scope(self.sinks_kernel, self.split_kernel), experts.scope(self.moe_plan), \
                linear.scope(self.linear_plan):
            yield

    def _run(self, body, *args):
        # sliding layers: dynamo specializes the step on their Python counters, pinned for the call at one value
        # per window phase (`Feed.pinned`). After the fast forward, select and update read no window: no phase,
        # and the counters it advanced stay where HF's update would leave them
        pinned = self.feed.pinned() if self.sliding and not self.fast_forward else contextlib.nullcontext(None)
        with pinned as phase:
            return self._run_in_phase(body, phase, *args)

    def _entry(self, body, phase) -> _Compiled:
        """This step's entry for `body` (None: nothing to compile) in the model's table, looked up once."""
        which = (getattr(body, "__name__", None), self.fast_forward, phase)  # a step runs one body per path, but
        if which not in self._by_phase:                    # the fast path declined at first use changes body mid-decode
            self._by_phase[which] = _compiled_for(self, body, phase)
        self._compiled = self._by_phase[which]
        return self._compiled

    def _run_in_phase(self, body, phase, *args):
        entry = self._entry(body, phase)
        before = _graphs_compiled()
        t0 = time.perf_counter()
        try:
            with _no_function_modes(), self._scopes():
                result = entry.fn(self, *args)
        except Exception as error:
            if entry.calls or not entry.fullgraph or not _is_graph_break(error):
                raise
            # Not expected (the step reads nothing on the host); keep running, split, and say so.
            entry.note = f"graph break: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            warnings.warn(f"gdtool: the {entry.name} step could not be compiled as one graph ({entry.note}); compiling "
                          "it with graph breaks (slower, and a break that reads a tensor on the host cannot be "
                          "captured)", stacklevel=3)
            entry.fn = torch.compile(_fresh(body), backend="inductor", fullgraph=False, dynamic=False,
                                     options=INDUCTOR_OPTIONS)
            entry.fullgraph = False
            with _no_function_modes(), self._scopes():
                result = entry.fn(self, *args)
        compiled = _graphs_compiled() - before
        if compiled:
            entry.compile_s += time.perf_counter() - t0
            if entry.compiles and entry.fullgraph:
                entry.note = "recompiled: a guard failed for the same shapes and settings (TORCH_LOGS=recompiles)"
                warnings.warn(f"gdtool: the compiled step {entry.name} was compiled again (a recompile: a guard "
                              "failed for the same shapes and settings); TORCH_LOGS=recompiles says why", stacklevel=3)
            entry.compiles += compiled if entry.fullgraph else 1
        entry.calls += 1
        return result


# The table of compiled functions is compiled.py's; making an entry stays here, beside INDUCTOR_OPTIONS, which it
# reads at each compile (`inductor_options` adds to them for a block: profiles/fresh_compiles.py, plan_bench.py).
def _compiled_for(step: CompiledStep, body, phase: int | None = None) -> _Compiled:
    """The model's compiled function for this step's shape key (and window phase: how many window sizes are
    full, None without sliding layers), made on first use."""
    key = _key(step) + (getattr(body, "__name__", None), phase)
    table = step.model.__dict__.setdefault(_ATTR, {})
    if key not in table:
        groups = len(step.feed.windows.groups)
        name = _name(step) + (f"_windows{phase}of{groups}full" if phase is not None else "")
        fn = None if body is None else torch.compile(_fresh(body), backend="inductor", fullgraph=True, dynamic=False,
                                                     options=INDUCTOR_OPTIONS)
        table[key] = _Compiled(fn, name, kernels=_kernels_note(step))
    return table[key]


def _kernels_note(step: CompiledStep) -> str:
    if step.fast_plan is None:
        return step.kernels
    if not step.fast_plan.applies:
        argmax = "argmax: gdtool's two stages" if step._argmax_op() else ""
        moe = "; ".join(n for n in (step.moe_plan.note() if step.moe_plan is not None else "", step.sinks_note,
                                    step.split_note, step.linear_plan.note() if step.linear_plan is not None else "",
                                    argmax) if n)
        if moe:
            return f"fast: HF forward compiled ({step.fast_plan.reason}); {moe}"
        return f"fast: HF forward compiled, as kernels='compiled' ({step.fast_plan.reason})"
    device = next(step.model.parameters()).device
    pdl = fast_triton.pdl_label() if fast_triton.pdl_supported(device) else "off"
    if pdl != "off" and gemv.late_trigger(device):
        pdl += ", the products triggering the next kernel in their last tile round"
    argmax = "argmax, update and counters in one kernel after the argmax's first stage; " \
        if step._one_kernel_tail() else "two-stage argmax; " if step._eager_argmax() else ""
    combine = "attention combined in the split kernel's last program where the cache is short; " \
        if attention.fused_combine(device) else ""
    embed = f"{gemv.FOLD_EMBEDDING_PATH}; " if gemv.fold_embedding(device) \
        and getattr(step.model.get_input_embeddings(), "max_norm", None) is None else ""   # as forward.forward folds
    return f"fast: {step.fast_plan.reason}; {argmax}{combine}{embed}PDL {pdl} at first use"
