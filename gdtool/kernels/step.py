"""The fast step: gdtool's decode step with fused kernels (`decode(..., kernels="compiled")`).

`kernels="hf"` (the default) runs HF's own kernels: hundreds of small launches per step, bit for
bit what `generate()` computes. `kernels="compiled"` runs the *same* step function, traced by
torch.compile (dynamo, one graph, no breaks) and lowered by inductor into fused kernels, with no
CUDA graphs of its own; gdtool then warms it up and captures it in its own graph exactly as it
captures the HF step. So the graph modes keep their buffers, their EOS polling and their ranges,
and only the kernels inside the replay change (plus, inside this step only, a grouped-query decode
attention that reads the cache without copying it, gpt-oss's with its sinks: `attention.py`):

    step-graph     forward + select + update compiled as one function, captured whole
    forward-graph  the forward compiled, captured; select and update stay eager
    eager          the forward compiled and called directly each step (still host-bound)

What changes with the kernels: logits differ from HF's by rounding (inductor fuses and reorders
float arithmetic), so tokens can differ from generate() where two logits are within rounding of
each other (`compare_kernels()` measures that: teacher-forced top-1 agreement and the largest
logit difference). What does not change: the step is a deterministic function of its buffers, so
it is bitwise equal to itself run uncaptured (`capture=False` calls the same compiled function).
Sampling with top-k uses the sort-free sampler of `kernels/sampling.py` (same noise, same candidate
rule); without top-k it uses `core/sampling.py`'s sorting top-p.

`kernels="fast"` is the same compiled step with the decode forward replaced, where it applies (Llama,
Mistral, Qwen2, Qwen3 at small batch: `forward.line_paths`), by gdtool's own Triton kernels run eagerly
around the compiled select and update (`forward.py`). On a mixture of experts of a known family
(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) at <= 16 tokens per step, the compiled HF forward calls gdtool's
experts kernels in place of each MoE block (`experts/`, a custom operator swapped in only for the
duration of the compiled call), gpt-oss's attention its split-KV kernels with sinks (`attention.py`), and at
1-4 rows the decoder's linear layers its matrix-vector kernel (`linear.py`, swapped in the same way).
Elsewhere it is exactly "compiled"; `compiles()` says which ran and why.

Sliding-window layers (Mistral-style, Gemma 2/3, gpt-oss, Cohere 2, OLMo 3) compile one step per window
phase, as the graph modes capture one graph per phase: their Python counters are pinned on the phase's
side of "full" for the length of each call (`core.feed.Feed.pinned`, which afterwards leaves them where the
step would have left the true counts), so the step compiles once per phase, not once per step.
Linear-attention and state-space layers are refused (use kernels="hf").

Compiled functions are kept on the model, one per shape key (batch, prompt width, cache length,
settings, which buffers exist), each with its own code object so dynamo's recompile limit never
sends a long sweep back to eager; a second `decode()` with the same shapes compiles nothing.
`compiles(model)` lists them with their compile counts (more than 1 for a key, with no
`torch._dynamo.reset()` in between, is a recompile and is warned about).

    out = gdtool.decode(model, ids, mask, mode="step-graph", max_new_tokens=256, kernels="compiled")
    df = gdtool.kernels.step.compare_kernels(model, batch=4, prompt_len=128, steps=64)   # agreement per position
    gdtool.kernels.step.compiles(model)                                                   # DataFrame, one row per key
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..core import compat, feed, graphs, sampling
from . import attention, experts, forward, fuse, gemv, linear, ops, tail
from . import sampling as fast_sampling  # beside the core sampling it speeds up
from . import triton as fast_triton  # not the triton package itself
from ..core.modes import DEFAULT_KERNELS, FORWARD_ONLY_MODES, KERNELS, check_kernels_name  # noqa: F401 (KERNELS: re-exported)
from ..core.step import Step, new_state

# The kernels options, and what runs compiled in each mode (the whole step where the mode captures the whole
# step; the forward alone elsewhere), are named in `gdtool.core.modes`.
# Inductor without CUDA graphs (gdtool captures); random draws through ATen, so the compiled step
# consumes the generator exactly as the HF step does and draws the same noise.
INDUCTOR_OPTIONS = {"triton.cudagraphs": False, "fallback_random": True}
_ATTR = "_gdtool_compiled_steps"


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


def _forward_only(step):
    return Step.forward(step)


def _select_update(step, logits):
    # kernels="fast": the forward ran gdtool's kernels eagerly; select and update stay compiled
    step.update(step.select(logits))


def _update_only(step, tokens):
    step.update(tokens)


@dataclass
class _Compiled:
    """One compiled function for one shape key."""
    fn: object
    name: str
    compiles: int = 0
    compile_s: float = 0.0
    fullgraph: bool = True
    calls: int = 0
    note: str = ""                # why it was split, or why it was compiled again
    kernels: str = "compiled"     # which kernels the step runs: for "fast", the decode forward's or why not


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
        # fast forward's batch line gave the batch to the matmuls (cuBLAS measured faster there: forward.line_paths)
        self.linear_plan = linear.plan(self.model, self.state.mask.shape[0],
                                       skip=tuple(x.block for x in self.moe_plan.layers if x.applies)) \
            if self.moe_plan is not None and not self.fast_plan.matmuls else None
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
            return self._run(_whole_step)
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
        moe = "; ".join(n for n in (step.moe_plan.note() if step.moe_plan is not None else "", step.sinks_note,
                                    step.split_note,
                                    step.linear_plan.note() if step.linear_plan is not None else "") if n)
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
    return f"fast: {step.fast_plan.reason}; {argmax}{combine}PDL {pdl} at first use"


def _fresh(fn):
    # dynamo caches compiled graphs on the code object, up to a recompile limit (8) shared by every
    # shape; a copy of the code per shape key keeps each key's cache to itself.
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _key(step: CompiledStep) -> tuple:
    """What the compiled graph is specialized on: the buffers' shapes and dtypes, and for the whole
    step also the settings and the prompt width (python constants in select and update)."""
    buffers = tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in sorted(vars(step.state).items())
                    if isinstance(t, torch.Tensor))
    param = next(step.model.parameters())
    base = (step.part, param.dtype, str(param.device), fuse.is_fused(step.model), step.kernels,
            step.fast_forward, step.moe_plan.key() if step.moe_plan is not None else (), step.sinks_kernel,
            step.split_kernel,
            step.linear_plan.key() if step.linear_plan is not None else ())
    if step.part == "forward":
        return base + tuple(b for b in buffers if b[0] in ("tokens", "positions", "mask"))
    return base + buffers + (step.settings, step.prompt_width, fast_sampling.TIE_SLACK)


def _name(step: CompiledStep) -> str:
    batch, cache_len = step.state.mask.shape
    name = f"{step.part}_b{batch}_w{step.prompt_width}_c{cache_len}"
    if step.part == "step":
        s = step.settings
        name += f"_n{s.max_new_tokens}_" + ("sample" if s.do_sample else "greedy")
    if step.kernels != "compiled":
        name += f"_{step.kernels}"
    return name


@contextmanager
def _no_function_modes():
    # A caller's TorchFunctionMode (gdtool's host-read counter on a CPU) would be traced into the graph
    # and make every call under a different mode stack a recompile; the compiled step reads nothing on
    # the host, so there is nothing for such a mode to see. Set them aside for the call.
    modes = []
    while getattr(torch._C, "_len_torch_function_stack", lambda: 0)() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _is_graph_break(error: Exception) -> bool:
    import torch._dynamo.exc as exc
    kinds = tuple(getattr(exc, name) for name in ("Unsupported", "UserError") if hasattr(exc, name))
    return isinstance(error, kinds)


def compiles(model) -> "pandas.DataFrame":
    """One row per compiled step kept on `model`: shape key name, compiles, compile seconds (first
    calls, warm-up included), whether it is one graph, calls, and a note on any break or recompile.
    (Warnings say the same, but decode() records warnings raised during its warm-up on CUDA.)"""
    import pandas as pd
    columns = ["step", "kernels", "compiles", "compile_s", "fullgraph", "calls", "note"]
    return pd.DataFrame([{c: getattr(e, "name" if c == "step" else c) for c in columns}
                         for e in getattr(model, _ATTR, {}).values()], columns=columns)


def compiled_nothing(model) -> bool:
    """Whether every step kept on `model` ran without torch.compile by design (kernels="fast": gdtool's forward and,
    greedy, its one-kernel tail; the fast forward alone in forward-graph): no dynamo graph is then expected of it."""
    entries = list(getattr(model, _ATTR, {}).values())
    return bool(entries) and all(entry.fn is None for entry in entries)


def forget(model) -> None:
    """Drop the compiled steps kept on `model` (they hold inductor's code, not device memory)."""
    model.__dict__.pop(_ATTR, None)


# -- kernels against kernels ---------------------------------------------------------------------

@torch.inference_mode()
def teacher_forced(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, continuation: torch.Tensor,
                   kernels: str = "compiled", capture: bool | None = None) -> dict:
    """Feed `continuation` [B, T] through the decode step token by token, whatever it would pick.

    The step is the one `decode(mode="step-graph", kernels=kernels)` runs, greedy, with its float32
    scores (= logits) recorded, captured where CUDA is available (capture=None) or called directly; over
    sliding-window layers, one graph (or uncaptured step) per window phase, as the decode loops run them.
    Position 0 comes from the prefill, which runs HF's kernels either way. Returns
    {"logits": [T, B, V] float32, "step_ms": device time per step (CUDA, captured) or wall time}.
    """
    from ..core.settings import resolve

    check_kernels(kernels, input_ids.device)
    batch, width = input_ids.shape
    steps = continuation.shape[1]
    if continuation.shape[0] != batch or steps < 2:
        raise ValueError(f"continuation must be [batch={batch}, T>=2] token ids; got {tuple(continuation.shape)}")
    settings = resolve(model, steps, dict(do_sample=False, eos_token_id=None, pad_token_id=0, repetition_penalty=1.0))
    device = input_ids.device
    cache_len = width + steps - 1
    cache = compat.static_cache(model, cache_len)
    vocab = model.config.get_text_config().vocab_size
    state = new_state(input_ids, attention_mask, settings, cache_len, vocab, True, None)
    cache_kw, logits_to_keep = compat.forward_kwargs(model)
    step = new_step(kernels, "step-graph", model, cache, state, settings, width, cache_kw, logits_to_keep)
    forced = continuation.to(device=device, dtype=torch.long)
    step.prefill(input_ids, attention_mask.long())
    state.tokens.copy_(forced[:, :1])
    use_graph = graphs.can_capture(device) and capture is not False
    snapshot, windows = state.snapshot(), step.feed.snapshot()
    by_phase = {}  # one graph per phase of the sliding layers, entered as the decode loops enter it
    for phase in dict.fromkeys(step.feed.phase_of(j) for j in range(1, steps)):
        def enter(phase=phase):
            step.feed.enter_phase(phase, windows)
        if use_graph:
            # as the decode loops warm up: HF's kernels watched in the first step (what the capture cannot hold
            # is refused with its cause; the constants the step copies from the host are pinned), then a second
            constants = graphs.warm_up(step, 1, watched(model, kernels), before=enter)
            graphs.warm_up(step, 1, before=enter)
            enter()
            by_phase[phase] = graphs.capture(step, device, model=model, constants=constants)
        else:
            enter()
            # each replay with the counters a graph captured now would hold
            by_phase[phase] = graphs.Uncaptured(step, step.feed.frozen_counters())
            by_phase[phase].replay()  # compile outside the timed loop
        state.restore(snapshot)
        compat.rewind(cache, width)
        step.feed.restore(windows)  # the sliding windows as the prefill left them (rewind leaves them)
    timer = _Timer(device)
    timer.start()
    for j in range(1, steps):
        by_phase[step.feed.phase_of(j)].replay()
        state.tokens.copy_(forced[:, j:j + 1])
    step_ms = timer.stop() / (steps - 1)
    for graph in by_phase.values():
        graph.close()
    return {"logits": state.scores.clone(), "step_ms": step_ms}


class _Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.events[1].record()
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1])
        return (time.perf_counter() - self.t0) * 1e3


def compare_kernels(model, batch: int = 4, prompt_len: int = 32, steps: int = 32, seed: int = 0,
                    capture: bool | None = None, kernels: str = "compiled") -> "pandas.DataFrame":
    """Teacher-forced comparison of `kernels` ("compiled" or "fast") with HF's kernels, one row per position.

    Both steps are fed the same random prompt and the same random continuation; per decode position
    (1..steps-1, position 0 is the shared prefill): share of rows whose top-1 token agrees, the
    largest absolute logit difference, the largest |logit| (for scale), and each step's time.
    """
    force = _forcing(model, batch, prompt_len, steps, seed)
    hf, compiled = force("hf", capture), force(kernels, capture)
    df = _labelled(agreement(hf["logits"], compiled["logits"]), model, batch, prompt_len, kernels)
    df["hf_step_ms"], df["compiled_step_ms"] = hf["step_ms"], compiled["step_ms"]
    return df


def _forcing(model, batch: int, prompt_len: int, steps: int, seed: int):
    """teacher_forced over one seeded random prompt and continuation, as a function of the kernels (and capture)."""
    from ..core.models import random_prompts

    prompt = random_prompts(model, batch=batch, lengths=(prompt_len, prompt_len), seed=seed)
    vocab = model.config.get_text_config().vocab_size
    continuation = torch.randint(3, vocab, (batch, steps), generator=torch.Generator().manual_seed(seed + 1))
    return lambda kernels, capture=None: teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation,
                                                        kernels, capture)


def _labelled(df, model, batch: int, prompt_len: int, kernels: str):
    """df with the run's model, dtype, batch, prompt length and kernels as its first columns."""
    name = getattr(model, "gdtool_name", type(model).__name__)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    columns = dict(model=name, dtype=dtype, batch=batch, prompt_len=prompt_len, kernels=kernels)
    for column, value in reversed(list(columns.items())):
        df.insert(0, column, value)
    return df


def accuracy(model, batch: int = 4, prompt_len: int = 32, steps: int = 16, seed: int = 0,
             kernels: str = "fast") -> "pandas.DataFrame":
    """How far `kernels` and HF's kernels each land from float32, one row per decode position.

    Two bf16 (or fp16) forwards agree only up to rounding, and on random weights the logits are so flat
    that top-1 flips between any two of them (compare_kernels). The question that has an answer is
    whether gdtool's kernels round more than HF's own: the same teacher-forced steps (compare_kernels'
    prompt and continuation), then the model upcast to float32 (its weights exactly as they were) and
    run with HF's kernels, uncaptured, as the reference, then cast back. Per position: each one's mean
    and largest |logit - reference| over rows and vocabulary, and its rows whose top-1 token is the
    reference's.
    """
    import pandas as pd

    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        raise ValueError("accuracy() measures a bf16 or fp16 model against itself in float32; this model is "
                         "float32 already: use compare_kernels(model)")
    if fuse.is_fused(model):
        raise ValueError("accuracy() casts the model to float32 and back, which would leave fused projections' "
                         "shared weight behind; call it on a model without fuse_projections")
    force = _forcing(model, batch, prompt_len, steps, seed)
    ran = {name: force(name)["logits"] for name in dict.fromkeys(("hf", kernels))}
    try:
        model.float()
        # uncaptured: HF's float32 experts (grouped_mm's fallback) read their offsets on the host, which no
        # graph holds (the H200 at 9e35b5d, gpt-oss-20b); the reference needs no graph
        reference = force("hf", capture=False)["logits"]
    finally:
        model.to(dtype)
    ref = reference[1:]
    columns = {"position": range(1, steps)}
    for name, logits in ran.items():
        error = (logits[1:] - ref).abs()
        columns[f"{name}_mean_error"] = error.mean(dim=(1, 2)).cpu().numpy()
        columns[f"{name}_max_error"] = error.amax(dim=(1, 2)).cpu().numpy()
        columns[f"{name}_top1"] = (logits[1:].argmax(-1) == ref.argmax(-1)).float().mean(-1).cpu().numpy()
    columns["max_abs_logit"] = ref.abs().amax(dim=(1, 2)).cpu().numpy()
    return _labelled(pd.DataFrame(columns), model, batch, prompt_len, kernels)


def agreement(reference: torch.Tensor, other: torch.Tensor) -> "pandas.DataFrame":
    """Per decode position of two [T, B, V] logits tensors (position 0, the prefill, left out): share
    of rows with the same top-1 token, largest |difference|, largest |reference logit|."""
    import pandas as pd

    a, b = reference[1:].float(), other[1:].float()
    return pd.DataFrame({
        "position": range(1, reference.shape[0]),
        "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean(-1).cpu().numpy(),
        "max_abs_logit_diff": (a - b).abs().amax(dim=(1, 2)).cpu().numpy(),
        "max_abs_logit": a.abs().amax(dim=(1, 2)).cpu().numpy(),
    })
