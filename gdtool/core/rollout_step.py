"""The decode step of a rollout whose rows are independent sequences: a finished row takes the next prompt.

`step.Step` decodes a batch in lockstep, as generate() does: transformers' StaticCache writes every row's
new key/value at one shared slot (`cumulative_length`), so every row has the same number of cache
columns behind it and pads fill the difference. A rollout that refills finished rows cannot keep that
lockstep: a new prompt starts at position 0 while its neighbours are hundreds of tokens in. Here each
row is its own sequence:

    cache    slots x C columns (C = longest prompt + max_new_tokens - 1), full attention only. A row's
             prompt fills its columns [0, L) (prefilled elsewhere, copied in: `RowStep.refill`); the
             token at position p is written at column p of its own row, so a decode step writes
             each row at its own column (`row_writes`: each layer's `update` scatters one key/value
             per row at `state.positions`, and returns the whole cache, as StaticLayer does).
    mask     [slots, C]: row b attends to its columns [0, position]. transformers builds the 4-D mask
             as causal(q_offset + q >= kv) AND the 2-D mask, with q_offset the cache's shared counter;
             `row_writes` has the cache answer q_offset = C - 1, so the causal part allows every column
             and the 2-D mask alone decides (tests/test_rollout.py builds the mask through
             transformers' own code and checks exactly that).
    state    `RowState`: per row its token, position, prompt length, tokens so far (its write column in
             `out`), finished flag, seen-mask, and its sequence's key (prompt index, sample index);
             `ran` counts the row-steps each slot ran.
    step     `RowStep`: `Step.forward` (the same Feed, the same inputs generate() builds), selection by
             `core.sampling`, then a per-row update; `refill` prefills prompts into given rows.
    noise    with sampling, a row's token t (t = its `lengths` before the token: 0 for the prefill's) is
             drawn by `sampling.choose_keyed` from noise keyed by (seed, prompt index, sample index, t),
             never from a generator stream, so a sequence's tokens do not depend on its slot, the slot
             count, or what ran beside it.

A refill prefills the prompt alone, as generate() prefills it (its own static cache of L + N - 1 columns,
no padding), copies its keys/values into the row's columns [0, L) and resets the row's mask, position,
output count, seen-mask and finished flag. Nothing here reads a tensor on the host except `refill`'s
indexing by row (the host picks the rows), so the decode step itself can be captured later.

`check_rows` refuses, with the reason, the models the per-row write cannot decode as generate() does.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from . import compat, sampling
from .feed import Feed, Unsupported, experts_modules
from .settings import Settings
from .step import Step, prefill_positions, seed_seen

# Families whose per-row decode was checked against generate() on each prompt alone (tests/test_rollout.py).
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROW_ATTENTION = ("sdpa", "eager")


@dataclass
class RowState:
    """Device buffers of a rollout with one sequence per row (slot). Their addresses never change."""
    tokens: torch.Tensor          # [S, 1] token fed to the next forward
    positions: torch.Tensor       # [S, 1] its position, which is also the cache column it is written at
    mask: torch.Tensor            # [S, C] the columns each row attends to
    index: torch.Tensor           # [] the Feed's step index (read only by sliding layers, which a rollout refuses)
    prompt_lengths: torch.Tensor  # [S] prompt length of the row's sequence
    out: torch.Tensor             # [S, N + 1] the sequence's tokens; column N takes the writes of finished rows
    lengths: torch.Tensor         # [S] tokens so far, up to and including EOS (the next write column of `out`)
    unfinished: torch.Tensor      # [S] 1 while the row's sequence runs; 0 once finished, and in an empty slot
    ran: torch.Tensor             # [S] row-steps the slot ran: each decode step counts every slot, a prefill its rows
    seen: torch.Tensor | None     # [S, V] ids the repetition penalty sees (prompt and new tokens)
    eos: torch.Tensor | None      # [E] EOS ids
    logprobs: torch.Tensor | None  # [S, N + 1] float32 log-probability of each token, when asked for
    prompt_index: torch.Tensor    # [S] the row's sequence key for the noise: its prompt's index in the rollout
    sample_index: torch.Tensor    # [S] and its sample index (the token index is `lengths`)


def new_row_state(slots: int, cache_len: int, settings: Settings, vocab: int, device,
                  return_logprobs: bool) -> RowState:
    long = dict(dtype=torch.long, device=device)
    n = settings.max_new_tokens
    pad = settings.pad_token_id if settings.pad_token_id is not None else 0
    mask = torch.zeros(slots, cache_len, **long)
    mask[:, 0] = 1  # an empty slot attends to one (zero) column: its row stays finite, and is never read
    return RowState(
        tokens=torch.zeros(slots, 1, **long), positions=torch.zeros(slots, 1, **long), mask=mask,
        index=torch.zeros((), **long), prompt_lengths=torch.zeros(slots, **long),
        out=torch.full((slots, n + 1), pad, **long), lengths=torch.zeros(slots, **long),
        unfinished=torch.zeros(slots, **long), ran=torch.zeros(slots, **long),
        seen=torch.zeros(slots, vocab, dtype=torch.bool, device=device) if settings.uses_penalty else None,
        eos=torch.tensor(settings.eos_token_id, **long) if settings.has_eos else None,
        logprobs=torch.zeros(slots, n + 1, dtype=torch.float32, device=device) if return_logprobs else None,
        prompt_index=torch.zeros(slots, **long), sample_index=torch.zeros(slots, **long),
    )


# -- what the per-row write can decode ---------------------------------------------------------------

def check_rows(model, cache_len: int) -> None:
    """Refuse, with the reason, a model whose rows cannot each decode their own sequence in one static cache
    exactly as generate() decodes that sequence alone. Reads the built model and the cache generate() would
    build for it; the family check comes last, so a known reason is named first."""
    name = type(model).__name__
    config = model.config.get_text_config()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ROW_ATTENTION:
        raise Unsupported(f"refill='host' feeds each row its own columns through a 2-D mask, which attention "
                          f"{impl!r} does not take as sdpa and eager do; load the model with "
                          "attn_implementation='sdpa' (or 'eager'), or use refill='off'")
    moe = experts_modules(model) or [m for m in model.modules() if any(
        word in type(m).__name__ for word in ("MoE", "Moe", "Experts"))]
    if moe:
        raise Unsupported(f"{name} has mixture-of-experts blocks ({type(moe[0]).__name__}); refill='host' is not yet "
                          "checked against generate() on them (the experts implementations route tokens per batch); "
                          "use refill='off'")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None or "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        raise Unsupported(f"{name} has chunked-attention layers, whose mask depends on each row's absolute chunk; "
                          "refill='host' decodes full attention only: use refill='off'")
    for i, layer in enumerate(compat.cache_layers(compat.static_cache(model, cache_len))):
        kind = type(layer).__name__
        if compat.is_linear(layer):
            raise Unsupported(f"{name}'s layer {i} keeps a recurrent state ({kind}: linear attention or a state-space "
                              "layer), which a refill would have to prefill and swap per row; refill='host' decodes "
                              "full-attention caches only: use refill='off'")
        if compat.is_sliding(layer) and layer.max_cache_len < cache_len:
            raise Unsupported(f"{name}'s layer {i} has a sliding window of {layer.max_cache_len} tokens, shorter than "
                              f"the rollout's {cache_len} cache columns (longest prompt + max_new_tokens - 1): its "
                              "window rolls over a shared counter, not per row; refill='host' decodes full attention "
                              "only: use refill='off' (or prompts and max_new_tokens that fit the window)")
        if type(layer) is not _static_layer() and not compat.is_sliding(layer):
            raise Unsupported(f"{name}'s layer {i} uses cache layer {kind}, which refill='host' does not know how to "
                              "write per row; use refill='off'")
    if getattr(model, "create_masks_for_generate", None) is not None:
        raise Unsupported(f"{name} builds its own masks for generate() (create_masks_for_generate); refill='host' "
                          "feeds the standard causal mask only: use refill='off'")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise Unsupported(f"{name}'s forward takes no position_ids, so it would derive positions from the cache's "
                          "shared counter, not per row; use refill='off'")
    family = getattr(config, "model_type", None)
    if family not in TESTED_FAMILIES:
        raise Unsupported(f"{name} (model_type {family!r}) is not one of the families refill='host' is checked on "
                          f"against generate() ({', '.join(TESTED_FAMILIES)}); use refill='off'")


def _static_layer():
    from transformers.cache_utils import StaticLayer
    return StaticLayer


def row_cache(model, cache_len: int):
    """A static cache of full-attention layers, C columns each (every layer of the model's StaticCache is a
    full layer, or a sliding window at least C long, which never masks a column a row can have)."""
    cache = compat.static_cache(model, cache_len)
    layer_class = _static_layer()
    cache.layers = [layer if type(layer) is layer_class else layer_class(max_cache_len=cache_len)
                    for layer in compat.cache_layers(cache)]
    return cache


@contextlib.contextmanager
def row_writes(cache, columns: torch.Tensor):
    """While decoding one token per row: each layer writes row b's key/value at column `columns[b]` (a [S, 1]
    device tensor read at every forward) and returns the whole cache, and the mask code gets a query offset of
    C - 1, so its causal part allows every column and the 2-D mask decides."""
    layers = compat.cache_layers(cache)
    last = layers[0].max_cache_len - 1

    def writer(layer):
        def update(key_states, value_states, *args, **kwargs):
            if key_states.shape[-2] != 1:
                raise RuntimeError("a rollout's cache takes one token per row; prompts are prefilled in a cache "
                                   "of their own")
            for store, new in ((layer.keys, key_states), (layer.values, value_states)):
                store.scatter_(2, columns.view(-1, 1, 1, 1).expand(-1, new.shape[1], 1, new.shape[3]), new)
            return layer.keys, layer.values
        return update

    def get_query_offset(layer_idx=0, *args, **kwargs):
        return last

    for layer in layers:
        layer.update = writer(layer)
    cache.get_query_offset = get_query_offset
    try:
        yield
    finally:
        del cache.get_query_offset
        for layer in layers:
            del layer.update


# -- the step ---------------------------------------------------------------------------------------

class RowStep(Step):
    """forward + select + update over a `RowState`, each row its own sequence; `refill` starts new ones."""

    def __init__(self, model, cache, state: RowState, settings: Settings, seed: int | None = None):
        if settings.do_sample and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r}: a rollout's sampling draws noise keyed by (seed, prompt, sample, "
                             "token); pass seed=<int>")
        super().__init__(model, cache, state, settings, prompt_width=0)
        self.seed = seed
        self.trash = settings.max_new_tokens  # the column of `out` that finished rows write to

    # forward: Step.forward, the Feed's decode inputs over tokens, positions and the [S, C] mask

    def select(self, logits: torch.Tensor, seen: torch.Tensor | None, prompt: torch.Tensor, sample: torch.Tensor,
               token: torch.Tensor) -> tuple:
        """(token per row, its log-probability under the processed scores or None). With sampling, row b's draw
        is keyed by (seed, prompt[b], sample[b], token[b])."""
        scores = sampling.process(logits, seen, self.settings)
        if self.settings.do_sample:
            chosen = sampling.choose_keyed(scores, self.seed, prompt, sample, token)
        else:
            chosen = sampling.choose(scores, False)
        if self.state.logprobs is None:
            return chosen, None
        return chosen, torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None]).squeeze(1)

    def update(self, chosen: torch.Tensor, logprob: torch.Tensor | None, writing: torch.Tensor) -> None:
        """Rows where `writing` is 1 take `chosen` as their next token; the others are left as they are."""
        s = self.state
        live = writing.bool()
        column = torch.where(live, s.lengths, self.trash)[:, None]
        s.out.scatter_(1, column, chosen[:, None])
        if s.logprobs is not None:
            s.logprobs.scatter_(1, column, logprob[:, None])
        if s.seen is not None:
            s.seen.scatter_(1, chosen[:, None], s.seen.gather(1, chosen[:, None]) | live[:, None])
        s.lengths.add_(writing)
        ended = s.lengths >= self.settings.max_new_tokens
        if s.eos is not None:
            ended |= (chosen[:, None] == s.eos[None, :]).any(-1)
        s.unfinished.copy_(torch.where(live & ended, 0, s.unfinished))
        s.tokens.copy_(torch.where(live[:, None], chosen[:, None], s.tokens))
        # the next token's position is its column; a finished row stays on its last one (in bounds, never read)
        s.positions.copy_((s.prompt_lengths + s.lengths - 1).clamp(0, self.last_slot)[:, None])
        s.mask.scatter_(1, s.positions, 1)

    def prefill(self, *args, **kwargs):
        raise TypeError("a RowStep starts sequences with refill(rows, input_ids), one prompt per row")

    def __call__(self) -> None:
        s = self.state
        writing = s.unfinished.clone()
        self.update(*self.select(self.forward(), s.seen, s.prompt_index, s.sample_index, s.lengths), writing)
        s.ran.add_(1)

    @contextlib.contextmanager
    def decoding(self):
        with self.feed.decoding(), row_writes(self.cache, self.state.positions):
            yield

    def refill(self, rows: torch.Tensor, input_ids: torch.Tensor, prompt_index: torch.Tensor | None = None,
               sample_index: torch.Tensor | None = None) -> None:
        """Start the prompts `input_ids` [g, L] (no padding) in `rows` [g]: prefill them alone, as generate()
        prefills a prompt (its own static cache of L + N - 1 columns), copy their keys and values into the rows'
        columns [0, L), reset the rows and write each one's first token (token index 0 of the noise key).
        `prompt_index` and `sample_index` [g] key the rows' sequences (zeros when not given)."""
        s, n = self.state, self.settings.max_new_tokens
        zeros = torch.zeros_like(rows)
        prompt_index = zeros if prompt_index is None else prompt_index.to(rows.device, torch.long)
        sample_index = zeros if sample_index is None else sample_index.to(rows.device, torch.long)
        s.prompt_index.index_copy_(0, rows, prompt_index)
        s.sample_index.index_copy_(0, rows, sample_index)
        width = input_ids.shape[1]
        small = compat.static_cache(self.model, width + n - 1)
        feed = Feed(self.model, small, width, width + n - 1)
        prompt_mask = torch.ones_like(input_ids)
        logits = self.model(**feed.prefill(input_ids, prompt_mask, prefill_positions(prompt_mask))).logits
        feed.settle()
        logits = logits[:, -1].to(copy=True, dtype=torch.float32)
        self._copy_rows(small, rows, width)
        s.prompt_lengths.index_fill_(0, rows, width)
        s.lengths.index_fill_(0, rows, 0)
        s.unfinished.index_fill_(0, rows, 1)
        s.mask.index_fill_(0, rows, 0)
        s.mask[:, :width].index_fill_(0, rows, 1)
        s.out.index_fill_(0, rows, self.pad)
        seen = None
        if s.seen is not None:
            seen = torch.zeros(len(rows), s.seen.shape[1], dtype=torch.bool, device=s.seen.device)
            seed_seen(seen, input_ids, prompt_mask)
            s.seen.index_copy_(0, rows, seen)
        if s.logprobs is not None:
            s.logprobs.index_fill_(0, rows, 0.0)
        chosen, logprob = self.select(logits, seen, prompt_index, sample_index, zeros)
        writing = torch.zeros_like(s.unfinished).index_fill_(0, rows, 1)
        self.update(s.tokens[:, 0].index_copy(0, rows, chosen),
                    None if logprob is None else torch.zeros_like(s.logprobs[:, 0]).index_copy_(0, rows, logprob),
                    writing)
        s.ran.add_(writing)

    def _copy_rows(self, small, rows: torch.Tensor, width: int) -> None:
        for big, alone in zip(compat.cache_layers(self.cache), compat.cache_layers(small)):
            if not big.is_initialized:  # [S, heads, C, head dim], the prompt cache's dtype and device
                slots = self.state.tokens.shape[0]
                big.lazy_initialization(*(t[:1, :, :1].expand(slots, -1, -1, -1) for t in (alone.keys, alone.values)))
            for store, prompt in ((big.keys, alone.keys), (big.values, alone.values)):
                store.index_fill_(0, rows, 0)
                store[:, :, :width].index_copy_(0, rows, prompt[:, :, :width])
