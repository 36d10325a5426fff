"""Token selection for the fast step: sort-free sampling (top-k first, then top-p within the k
candidates), and a two-stage argmax for greedy decoding.

Sampling. generate()'s top-p sorts the whole vocabulary every step (128k entries for Llama 3), which
costs a noticeable share of a fused decode step at large batch. HF applies top-k before top-p, so
when top-k is on, every token that top-p could keep is among the k best, and the nucleus can be
found among those k alone:

    scores -> repetition penalty -> / temperature          (as generate(), same arithmetic)
    values, ids = topk(scores, k + TIE_SLACK)               (one partial selection over the vocabulary)
    order those few ascending, ties by id                   (as a stable sort of the vocabulary orders them;
                                                             by counting, not torch.sort: see `ascending`)
    drop values below the k-th (ties with it stay, as HF keeps them)
    top-p over the ascending candidates (HF's rule: remove where cumsum <= 1 - top_p, keep the best)
    token = ids[argmax(softmax(values) / noise[ids])]       (exponential race, Gumbel-max)

The noise is drawn over the whole vocabulary, exactly as `sampling.choose` draws it, so both paths
consume the random generator alike, and with the same noise tensor they pick the same token.

Where it can differ from generate() (both are edge cases of rounding or ties, not of the rule):
- more than `TIE_SLACK` tokens tied with the k-th score: HF keeps them all, this keeps the first
  k + TIE_SLACK that topk returns. With bf16 logits small ties are common, large ones rare.
- the softmax and cumulative sums run over the candidates rather than over the vocabulary (where
  every other entry is 0), so a sum may round differently in its last bit; a token whose cumulative
  probability lies within that rounding of `1 - top_p` can fall on the other side.
- tied tokens at the top-p boundary: which of them HF drops depends on how its sort orders ties.
  Here they are in id order, as a stable sort leaves them (CUDA's radix sort of a long row is
  stable; torch.sort on a CPU is not, so on a CPU HF may drop a different one of the tied tokens).

Without top-k (`top_k=None` or 0) there is no candidate bound, and `applies()` is False: the step
uses the exact, sorting path of `core/sampling.py`.

Greedy after the fast forward: `argmax`, two stages. `torch.argmax` over a [B, 128256] row is one
reduction kernel of ~30 us at batch 1 (a handful of programs walk the whole row); two stages (the
best of each 2048-entry block, then the best of the blocks) spread the read over the whole GPU. Ties
go to the smallest index and NaN wins, as torch.argmax's do.

Greedy in the compiled HF forward's step (past gdtool's own forward: 64 rows): `argmax_op`, the same two stages as a
custom operator, over the model's own logits. Inductor never splits an argmax: it fuses the float32 cast into one
program per row, 64 programs walking 128k-262k entries each (H100, 64 rows: 28 us for Llama-1B's logits, 60 us for
Gemma-3-1B's, against floors of 5.5 and 11). Float32 holds every bf16 or float16 value exactly and keeps their
order, so the argmax of the model's logits is the argmax of generate()'s float32 scores (with no processor between:
`argmax_refusal`).
"""
from __future__ import annotations

import torch

from ..core import sampling
from ..core.settings import Settings
from .triton import HAVE_TRITON, asked, cdiv, interpreting, launch_options, next_pow2, tl, triton, untested_on_cuda, \
    usable

# Extra candidates beyond k, so that tokens tied with the k-th score stay candidates (HF keeps ties).
TIE_SLACK = 16
ARGMAX_BLOCK = 2048


def applies(settings: Settings) -> bool:
    """Whether the sort-free sampler is used for these settings (sampling with top-k on)."""
    return settings.do_sample and settings.uses_top_k


def warp(scores: torch.Tensor, seen: torch.Tensor | None, settings: Settings) -> torch.Tensor:
    """Repetition penalty, then temperature: generate()'s first two steps, same arithmetic."""
    if settings.uses_penalty:
        scores = sampling.penalize(scores, seen, settings.repetition_penalty)
    if settings.uses_temperature:
        scores = scores / settings.temperature
    return scores


def ascending(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [B, W] ordered ascending by value, tied values by id: the order HF's stable sort
    of the vocabulary gives them, which decides which tied tokens top-p drops (topk leaves ties in no
    particular order).

    No torch.sort: each candidate's place is the number of candidates ordered before it, from a
    [B, W, W] comparison (W is k + TIE_SLACK, a few dozen), and a scatter puts it there. Inductor's
    Triton sort-with-index kernel for a [64, W] block had not compiled after 50 s on an H200 (batch 1:
    15 s), and the batch-64 sampling step never got going in runs of 85-180 s; this is one small
    fused reduction (6-7 s to compile at either batch size). Ids are distinct, so the places
    are a permutation, the same one a stable sort by (value, id) gives. NaN scores are not ordered
    (a model that emits NaN logits has no defined sample)."""
    v, i = values.unsqueeze(-1), ids.unsqueeze(-1)                            # candidate [B, W, 1]
    before = (values.unsqueeze(-2) < v) | ((values.unsqueeze(-2) == v) & (ids.unsqueeze(-2) < i))
    place = before.sum(dim=-1)                                                # [B, W], a permutation
    return torch.zeros_like(values).scatter(-1, place, values), torch.zeros_like(ids).scatter(-1, place, ids)


def candidates(scores: torch.Tensor, top_k: int, top_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [B, K], ascending as HF's stable sort orders them (ties by token id); the
    candidates top-k and top-p drop hold -inf."""
    vocab = scores.size(-1)
    k = min(max(top_k, 1), vocab)
    width = min(k + TIE_SLACK, vocab)
    # unsorted: `ascending` orders the candidates anyway (the same set either way: topk picks, then sorts)
    values, ids = ascending(*torch.topk(scores, width, dim=-1, sorted=False))
    kth = values[..., width - k:width - k + 1]
    values = values.masked_fill(values < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        # The tokens top-k removed have probability 0 and sort first in HF's ascending order, so the
        # cumulative sums over the ascending candidates are HF's sums.
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        values = values.masked_fill(remove, -float("inf"))
    return values, ids


def choose(scores: torch.Tensor, seen: torch.Tensor | None, settings: Settings,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """Next token per row, [B] int64, from raw float32 logits [B, V] (settings must satisfy `applies`).

    `noise` ([B, V], Exp(1) draws) replaces the draw, for tests; by default it is drawn like
    `sampling.choose` draws it.
    """
    scores = warp(scores, seen, settings)
    top_p = settings.top_p if settings.uses_top_p else None
    values, ids = candidates(scores, settings.top_k, top_p)
    probs = torch.nn.functional.softmax(values, dim=-1)
    if noise is None:
        noise = torch.empty_like(scores).exponential_(1)
    race = noise.gather(-1, ids)
    return ids.gather(-1, torch.argmax(probs / race, dim=-1, keepdim=True)).squeeze(-1)


def reference_choose(scores: torch.Tensor, seen: torch.Tensor | None, settings: Settings, noise: torch.Tensor,
                     stable_sort: bool = True) -> torch.Tensor:
    """generate()'s order over the whole vocabulary (`sampling.process`, sorting top-p) with a given
    noise tensor, for comparison. `stable_sort` orders tied scores by id, as CUDA's radix sort does."""
    if not stable_sort:
        probs = torch.nn.functional.softmax(sampling.process(scores, seen, settings), dim=-1)
        return torch.argmax(probs / noise, dim=-1)
    scores = warp(scores, seen, settings)
    if settings.uses_top_k:
        scores = sampling.top_k_filter(scores, settings.top_k)
    if settings.uses_top_p:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False, stable=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - settings.top_p)
        remove_sorted[..., -1:] = 0
        scores = scores.masked_fill(remove_sorted.scatter(1, sorted_indices, remove_sorted), -float("inf"))
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return torch.argmax(probs / noise, dim=-1)


# -------------------------------------------------------------------- greedy: a two-stage argmax

def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


if HAVE_TRITON:
    @triton.jit
    def _argmax_blocks(x_ptr, v_ptr, i_ptr, V, stride_x, BLOCKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        offs = c * BLOCK + tl.arange(0, BLOCK)
        # compared in float32, which holds a bf16 or float16 logit exactly (argmax_op reads the model's own)
        x = tl.load(x_ptr + b * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        big = 2147483647
        isnan = x != x
        nan_at = tl.min(tl.where(isnan, offs, big), axis=0)
        top = tl.max(tl.where(isnan, float("-inf"), x), axis=0)
        at = tl.min(tl.where((x == top) & (offs < V), offs, big), axis=0)
        found_nan = nan_at < big
        tl.store(v_ptr + b * BLOCKS + c, tl.where(found_nan, float("nan"), top))
        tl.store(i_ptr + b * BLOCKS + c, tl.where(found_nan, nan_at, at))

    @triton.jit
    def _best(x, idx, inside, AXIS: tl.constexpr):
        """The index (from idx) of the largest x along AXIS where inside: the first NaN's if any (NaN wins), else
        the smallest index among the ties, as torch.argmax picks."""
        big = 2147483647
        isnan = (x != x) & inside
        nan_at = tl.min(tl.where(isnan, idx, big), axis=AXIS)
        top = tl.max(tl.where(isnan, float("-inf"), x), axis=AXIS)
        at = tl.min(tl.where((x == tl.expand_dims(top, AXIS)) & inside, idx, big), axis=AXIS)
        return tl.where(nan_at < big, nan_at, at)

    @triton.jit
    def _argmax_final(v_ptr, i_ptr, out_ptr, BLOCKS, BLOCK: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        c = tl.arange(0, BLOCK)
        inside = c < BLOCKS
        x = tl.load(v_ptr + b * BLOCKS + c, mask=inside, other=float("-inf"))
        idx = tl.load(i_ptr + b * BLOCKS + c, mask=inside, other=2147483647)
        tl.store(out_ptr + b, _best(x, idx, inside, 0).to(tl.int64))


def argmax_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage: each row's best value and its index in every ARGMAX_BLOCK-entry block, [B, blocks]."""
    b, v = x.shape
    blocks = cdiv(v, ARGMAX_BLOCK)
    values = torch.empty(b, blocks, device=x.device, dtype=torch.float32)
    index = torch.empty(b, blocks, device=x.device, dtype=torch.int32)
    _argmax_blocks[(b, blocks)](x, values, index, v, x.stride(0), blocks, BLOCK=ARGMAX_BLOCK, num_warps=8,
                                **launch_options(x.device))
    return values, index


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Triton two-stage argmax over the last dim of a [B, V] float tensor -> [B] int64."""
    values, index = argmax_blocks(x)
    b, blocks = values.shape
    out = torch.empty(b, device=x.device, dtype=torch.int64)
    _argmax_final[(b,)](values, index, out, blocks, BLOCK=max(2, next_pow2(blocks)), num_warps=4,
                        **launch_options(x.device))
    return out


# the kernel path `argmax_refusal` asks about (`triton.CUDA_TESTED`)
ARGMAX_OP_PATH = "two-stage argmax in the compiled step"


@torch.library.custom_op("gdtool::argmax", mutates_args=())
def argmax_op(x: torch.Tensor) -> torch.Tensor:
    """`argmax` inside a compiled function ([B, V] of any float dtype -> [B] int64): the two stages where Triton
    runs, else torch.argmax."""
    if not usable(x):
        return argmax_reference(x)
    return argmax(x if x.stride(-1) == 1 else x.contiguous())


@argmax_op.register_fake
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


def argmax_refusal(settings: Settings, state, device) -> str:
    """'' where a compiled greedy step may take its token from `argmax_op` over the model's own logits, else why
    not: the scores must be the logits themselves (no repetition penalty) and not recorded."""
    if settings.do_sample:
        return "sampling"
    if not asked("compiled_argmax"):
        return "GDTOOL_COMPILED_ARGMAX=0"
    if settings.uses_penalty:
        return "a repetition penalty (the scores are not the logits)"
    if state.scores is not None or state.logprobs is not None:
        return "scores or log-probabilities recorded"
    if not HAVE_TRITON or (device.type != "cuda" and not interpreting()):
        return "no Triton for this device"
    return untested_on_cuda(ARGMAX_OP_PATH, device)
