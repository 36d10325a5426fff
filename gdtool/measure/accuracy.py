"""Kernels against kernels: how far the compiled and fast steps' logits land from HF's kernels and from float32.

The step is the one `decode(mode="step-graph", kernels=...)` runs (`gdtool.kernels.step`), fed a given
continuation token by token whatever it would pick (teacher forcing), so two kernel choices see the same inputs
at every position and their logits can be compared position by position:

    teacher_forced   one kernels choice's logits [T, B, V] over a forced continuation, and its time per step
    compare_kernels  `kernels` against HF's kernels: top-1 agreement and the largest logit difference per position
    accuracy         `kernels` and HF's kernels, each against the same model upcast to float32
    agreement        the per-position table of two logits tensors

    df = gdtool.measure.accuracy.compare_kernels(model, batch=4, prompt_len=128, steps=64)   # agreement per position
    df = gdtool.measure.accuracy.accuracy(model, kernels="fast")                            # each against float32

Until the next release `gdtool.kernels.step.compare_kernels` (and the other three) still answer, with a
DeprecationWarning naming this module.
"""
from __future__ import annotations

import time

import torch

from ..core import compat, graphs
from ..core.capture import capture_phases
from ..core.step import new_state
from ..kernels import fuse
from ..kernels.step import check_kernels, new_step, watched

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
    step = new_step(kernels, "step-graph", model, cache, state, settings, width)
    forced = continuation.to(device=device, dtype=torch.long)
    step.prefill(input_ids, attention_mask.long())
    state.tokens.copy_(forced[:, :1])
    # one graph per phase of the sliding layers, entered, warmed up and captured as the decode loops do it
    by_phase = capture_phases(step, step, (step.feed.phase_of(j) for j in range(1, steps)),
                              capture=graphs.can_capture(device) and capture is not False, width=width,
                              warmup_steps=min(2, cache_len - width), model=model, watch=watched(model, kernels)).graphs
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
