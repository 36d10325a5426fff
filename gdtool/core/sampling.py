"""Capture-safe token selection, bit for bit what generate() computes.

generate() processes float32 scores in this order: repetition penalty, then (sampling only)
temperature, top-k, top-p; then argmax, or softmax + `torch.multinomial(probs, 1)`. Each function
below repeats transformers' arithmetic exactly (`s / T`, never `s * (1 / T)`; top-k keeps ties;
top-p compares against `1 - top_p` computed in Python double). None of them reads a tensor on the
host, so the whole selection can live inside a CUDA graph.

The multinomial draw is replaced by its exponential race,
`argmax(probs / Exp(1))`, which is how ATen itself draws one sample: same bits, same generator
consumption, and no host synchronization. `choose_keyed` races the same way with exponentials keyed by
(seed, prompt, sample, token) (`core.noise`) instead of the generator's, for rollouts whose sequences must not
depend on their slot.
"""
from __future__ import annotations

import torch

from . import noise
from .settings import Settings


@torch.library.custom_op("gdtool::cumsum", mutates_args=())
def _opaque_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim)


@_opaque_cumsum.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x)


def cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.cumsum; under torch.compile an opaque op that runs ATen's cumsum.

    Inductor's scan over a whole vocabulary row ([64, 128256], a "SplitScan") fails in codegen on
    CUDA with torch 2.11 (`TypeError: list indices must be integers or slices, not NoneType`; seen on
    an H200), which stopped `kernels="compiled"` with top-p and no top-k. ATen's kernel is also what
    generate() runs, so the values are the eager path's."""
    if torch.compiler.is_compiling():
        return _opaque_cumsum(x, dim)
    return torch.cumsum(x, dim)


def penalize(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """RepetitionPenaltyLogitsProcessor over a per-row "seen" mask instead of gathered ids."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(max(top_k, 1), scores.size(-1))
    kth = torch.topk(scores, top_k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, -float("inf"))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = cumsum(sorted_logits.softmax(dim=-1), -1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = 0
    remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
    return scores.masked_fill(remove, -float("inf"))


LOGPROBS = ("processed", "temperature")


def logprobs_kind(value) -> str | None:
    """What `return_logprobs=value` asks for: None (False), "processed" (True): the log-probability of each
    chosen token under the processed scores generate() returns (penalty, temperature, top-k, top-p applied), or
    "temperature": under softmax(logits / temperature) alone, what PPO/GRPO ratios compare a trainer's
    recomputed log-probabilities against."""
    if value is None or value is False:
        return None
    if value is True:
        return "processed"
    if isinstance(value, str) and value in LOGPROBS:
        return value
    raise ValueError(f"return_logprobs={value!r}: use True or 'processed' (under the processed scores generate() "
                     "returns), 'temperature' (under softmax(logits / temperature) alone: no repetition penalty, "
                     "top-k or top-p), or False")


def log_probs(logits: torch.Tensor, scores: torch.Tensor, kind: str, s: Settings) -> torch.Tensor:
    """[batch, vocab] log-probabilities of `kind` (see `logprobs_kind`) from a step's raw float32 logits and its
    processed scores."""
    if kind == "temperature":
        return torch.log_softmax(logits / s.temperature if s.uses_temperature else logits, dim=-1)
    return torch.log_softmax(scores, dim=-1)


def process(scores: torch.Tensor, seen: torch.Tensor | None, s: Settings) -> torch.Tensor:
    """The scores generate() would return (`output_scores=True`) for this step."""
    if s.uses_penalty:
        scores = penalize(scores, seen, s.repetition_penalty)
    if s.uses_temperature:
        scores = scores / s.temperature
    if s.uses_top_k:
        scores = top_k_filter(scores, s.top_k)
    if s.uses_top_p:
        scores = top_p_filter(scores, s.top_p)
    return scores


def choose(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """Next token per row, [batch] int64."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.nn.functional.softmax(scores, dim=-1)
    race = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / race, dim=-1)


def choose_keyed(scores: torch.Tensor, seed, prompt: torch.Tensor, sample: torch.Tensor,
                 token: torch.Tensor) -> torch.Tensor:
    """A sampled token per row, [batch] int64, from keyed noise: argmax(probs / E) with E[b, v] = -log u(seed,
    prompt[b], sample[b], token[b], v) (`core.noise`). The exponential race of `choose`, so the token is drawn
    from softmax(scores); the draw is a function of the key and the scores alone. float64 race (probs are exact
    in it), so a float32 ratio cannot overflow or round two candidates together."""
    probs = torch.nn.functional.softmax(scores, dim=-1)
    race = noise.exponentials(seed, prompt, sample, token, scores.shape[-1])
    return torch.argmax(probs.to(torch.float64) / race, dim=-1)
