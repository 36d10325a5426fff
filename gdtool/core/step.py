"""The decode step: one function over device buffers, shared by every mode.

A step feeds the last token to the model, turns the logits into the next token exactly as
generate() does, and does all of generate()'s bookkeeping on the device:

    forward   model(**inputs generate() would build: `feed.py`) -> float32 logits
    select    repetition penalty (a per-row "seen" mask) -> temperature -> top-k -> top-p ->
              argmax, or softmax + exponential race (= torch.multinomial, same bits)
    update    forced EOS (length harness) -> finished rows get pad -> write the token and its
              scores at the step index -> seen mask, lengths, unfinished rows, "all finished"
              flag -> next token, position + 1, next mask column, step index + 1

Nothing here reads a tensor on the host, so `Step.__call__` can be captured whole (step-graph),
`Step.forward` alone (forward-graph), or run as is (eager, and every mode on a CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import compat, sampling
from .feed import Feed
from .settings import Settings


@dataclass
class State:
    """Device buffers of one rollout. Their addresses never change: a captured step reads them."""
    tokens: torch.Tensor       # [B, 1] token fed to the next forward
    positions: torch.Tensor    # [B, 1] its RoPE position
    mask: torch.Tensor         # [B, C] 2-D mask over cache slots; a column turns on when its slot is fed
    index: torch.Tensor        # [] index of the token the next select produces
    out: torch.Tensor          # [B, N] new tokens
    lengths: torch.Tensor      # [B] tokens per row up to and including its EOS
    unfinished: torch.Tensor   # [B] 1 while a row has not emitted EOS
    done: torch.Tensor         # [] every row finished
    done_at: torch.Tensor      # [] index of the token at which the last row finished, -1 before
    seen: torch.Tensor | None  # [B, V] ids the repetition penalty sees (prompt, pads, new tokens)
    scores: torch.Tensor | None  # [N, B, V] processed scores, when asked for
    eos: torch.Tensor | None   # [E] EOS ids
    targets: torch.Tensor | None  # [B] forced lengths (length harness), else None
    logprobs: torch.Tensor | None = None  # [N, B] float32 log-probability of each written token, when asked for

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name).clone() for f in fields(self) if getattr(self, f.name) is not None}

    def restore(self, snap: dict) -> None:
        for name, saved in snap.items():
            getattr(self, name).copy_(saved)


def new_state(input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: Settings, cache_len: int,
              vocab: int, return_scores: bool, targets: torch.Tensor | None, return_logprobs: bool = False) -> State:
    batch, width = input_ids.shape
    n = settings.max_new_tokens
    device = input_ids.device
    long = dict(dtype=torch.long, device=device)
    mask = torch.zeros(batch, cache_len, **long)
    mask[:, :width] = attention_mask
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device) if settings.uses_penalty else None
    pad = settings.pad_token_id if settings.pad_token_id is not None else 0
    return State(
        tokens=torch.zeros(batch, 1, **long),
        positions=torch.zeros(batch, 1, **long),
        mask=mask,
        index=torch.zeros((), **long),
        out=torch.full((batch, n), pad, **long),
        lengths=torch.zeros(batch, **long),
        unfinished=torch.ones(batch, **long),
        done=torch.zeros((), dtype=torch.bool, device=device),
        done_at=torch.full((), -1, **long),
        seen=seen,
        scores=torch.zeros(n, batch, vocab, dtype=torch.float32, device=device) if return_scores else None,
        eos=torch.tensor(settings.eos_token_id, **long) if settings.has_eos else None,
        targets=None if targets is None else targets.to(device=device, dtype=torch.long),
        logprobs=torch.zeros(n, batch, dtype=torch.float32, device=device) if return_logprobs else None,
    )


def seed_seen(seen: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """The ids the repetition penalty sees in the prompt: all of them, or only the real tokens."""
    seen.zero_()
    if not compat.PENALTY_SEES_LEFT_PADS:
        # A pad position repeats the row's last token, which is real and seen anyway.
        input_ids = torch.where(attention_mask.bool(), input_ids, input_ids[:, -1:])
    seen.scatter_(1, input_ids, True)


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """generate()'s prefill positions: running count of real tokens, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


class Step:
    """forward + select + update over one `State`; every mode calls this object."""

    logprobs_of = "processed"   # what State.logprobs records (sampling.logprobs_kind); the loop that builds it sets it

    def __init__(self, model, cache, state: State, settings: Settings, prompt_width: int, *, feed: Feed | None = None):
        self.model, self.cache, self.state, self.settings = model, cache, state, settings
        self.prompt_width = prompt_width
        self.last_slot = state.mask.shape[1] - 1
        self.last_index = settings.max_new_tokens - 1
        self.pad = settings.pad_token_id if settings.pad_token_id is not None else 0
        self.feed = feed or Feed(model, cache, prompt_width, state.mask.shape[1])

    def logits(self, inputs: dict, cast: bool = True) -> torch.Tensor:
        """The last position's logits, float32 as generate() reads them; cast=False: the model's own (a view)."""
        out = self.model(**inputs)
        self.feed.settle()
        return out.logits[:, -1].to(copy=True, dtype=torch.float32) if cast else out.logits[:, -1]

    def forward(self, cast: bool = True) -> torch.Tensor:
        s = self.state
        return self.logits(self.feed.decode(s.tokens, s.positions, s.mask, s.index), cast)

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        scores = sampling.process(logits, self.state.seen, self.settings)
        if self.state.scores is not None:
            self.state.scores.index_copy_(0, self._index(), scores[None])
        if self.state.logprobs is not None:
            # read by update() at the token it finally writes (forced EOS and finished-row pads included)
            self.log_probs = sampling.log_probs(logits, scores, self.logprobs_of, self.settings)
        return sampling.choose(scores, self.settings.do_sample)

    def update(self, next_tokens: torch.Tensor) -> None:
        s = self.state
        index = self._index()
        if s.targets is not None:
            forced = s.targets == s.index + 1
            next_tokens = torch.where(forced, s.eos[0], next_tokens)
        if s.eos is not None:
            next_tokens = next_tokens * s.unfinished + self.pad * (1 - s.unfinished)
        s.out.index_copy_(1, index, next_tokens[:, None])
        if s.logprobs is not None:
            # rows that had finished write a pad nobody chose: 0, so a row's sum is its sequence log-probability
            chosen = self.log_probs.gather(1, next_tokens[:, None]).squeeze(1)
            s.logprobs.index_copy_(0, index, torch.where(s.unfinished.bool(), chosen, 0.0)[None])
        s.lengths.add_(s.unfinished)
        if s.seen is not None:
            s.seen.scatter_(1, next_tokens[:, None], True)
        if s.eos is not None:
            hit = (next_tokens[:, None] == s.eos[None, :]).any(-1)
            s.unfinished.mul_((~hit).long())
        # generate() also stops every row at max_new_tokens.
        s.done.copy_((s.unfinished.max() == 0) | (s.index >= self.last_index))
        s.done_at.copy_(torch.where(s.done & (s.done_at < 0), s.index, s.done_at))
        s.tokens.copy_(next_tokens[:, None])
        s.positions.add_(1)
        slot = (s.index + self.prompt_width).clamp(max=self.last_slot)
        s.mask.index_fill_(1, slot.view(1), 1)
        s.index.add_(1)

    def _index(self) -> torch.Tensor:
        # Warm-up steps run past the last token; clamping keeps their writes in bounds (they are undone).
        return self.state.index.clamp(max=self.last_index).view(1)

    def __call__(self) -> None:
        self.update(self.select(self.forward()))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """The prompt's forward (as generate() runs it) and the first token's select + update."""
        positions = prefill_positions(attention_mask)
        logits = self.logits(self.feed.prefill(input_ids, attention_mask, positions))
        s = self.state
        s.positions.copy_(positions[:, -1:])
        self.update(self.select(logits))
