"""The decode step of a rollout whose rows are independent sequences: a finished row takes the next prompt.

`step.Step` decodes a batch in lockstep, as generate() does: transformers' StaticCache writes every row's
new key/value at one shared slot (`cumulative_length`), so every row has the same number of cache
columns behind it and pads fill the difference. A rollout that refills finished rows cannot keep that
lockstep: a new prompt starts at position 0 while its neighbours are hundreds of tokens in. Here each
row (slot) is its own sequence, and everything a refill needs is on the device:

    queue    the sequences' prompts, right-padded to the longest (W), their lengths and keys (prompt index,
             sample index), and `next`, the first sequence no slot has taken yet.
    cache    slots x C columns, C = W + max_new_tokens (one column more than a row can reach, so no row's mask
             is ever all ones: transformers would then skip the mask in eager runs and not in captured ones),
             in every layer, sliding ones too (their window is a per-row mask: `row_window`). The token at
             position p of a row is written at column p of that row.
    mask     [slots, C]: row b attends to its columns [0, position]. transformers builds the 4-D mask as
             causal(q_offset + q >= kv) AND the 2-D mask, with q_offset the cache's shared counter; here
             the cache answers q_offset = C - 1 while decoding (the causal part allows every column, the 2-D
             mask alone decides) and 0 while prefilling a prompt (columns [0, w) causal, as a prompt alone).
    results  per sequence, not per slot: `out` [Q + 1, N + 1] tokens, `out_lengths`, `finished` and the
             log-probabilities. A step writes each live row's token straight into its sequence's row (row Q
             and column N take the writes of empty and finished slots), so nothing is copied when a slot
             is refilled, and the host reads finished sequences whenever it likes.
    flags    `settled` (no refill now: too few slots free, or the queue is empty), `group` (the rows the next
             refill takes, 0 when settled), `width` (the columns it prefills, 0 when settled), `pick` (per size:
             0 where it is `group`), `pick_width` (per size and width: 0 where they are `group` and `width`) and
             `done` (every slot is free and the queue is empty), set by the step and by each refill.

`RowStep.__call__` is one decode step over every slot; `RowStep.refill(g, w)` starts g sequences together: the
next g of the queue, in the g first free slots (the lowest indices whose `unfinished` is 0), in order. It
prefills their prompts in one forward (g rows, w columns, right-padded, positions 0..w-1), writing each row's
keys and values straight into its slot's columns [0, w) of the rollout's cache, picks each first token at its
prompt's last position, and updates the slots. w is a width bucket (`width_buckets`: the longest prompt W and
up to `refill_widths - 1` halvings of it, rounded up to a multiple of 16): the smallest that holds the g
prompts, so short prompts do not pay for the longest one's columns. Neither reads a tensor on the host (slots,
sequences and width are picked on the device), so both can be captured, one refill graph per (g, w) that the
queue can ask for (`refill_shapes`), and a captured refill can run inside a conditional node. Every refill policy runs these functions in one order, which is the admission
rule (`refill_rows` R, `refill_after` A; `sizes`: R and the powers of two below it, largest first):

    after each decode step, while the queue is not empty and at least min(A, queue left, slots) slots are free:
    refill g = the largest size <= min(free slots, queue left), at w = the smallest width bucket that holds
    the next g prompts
    (with A = 1 the slots that finish at step t take the next sequences, in slot order, before step t + 1;
    a sequence that ends at its first token frees its slot again at once; A > 1 lets free slots gather
    so that one forward prefills several prompts)

g never grows between two decode steps (a refill takes g free slots and frees at most g), so the sizes run in
descending order; the width may go up or down from one refill to the next. `host` reads `settled`, `group` and
`width` after each step and each refill and replays the refill of that shape; `device` leaves the decision to
the device (`gdtool.loops.devloop`: one WHILE node per size, in descending order, each running while `group` is
its size; where a size has several widths, its body is one WHILE node per width, each running its refill while
`width` is its width). The tokens are the same bits either way.

Noise. With sampling, a row's token t (t = its `lengths` before the token: 0 for the first one) is drawn by
`sampling.choose_keyed` from noise keyed by (seed, prompt index, sample index, t), never from a generator
stream, so a sequence's tokens do not depend on its slot, the slot count, or what ran beside it.

`check_rows` refuses, with the reason, the models the per-row write cannot decode as generate() does.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, fields

import torch

from . import compat, noise, sampling
from .feed import Unsupported, experts_modules
from .settings import Settings
from .step import Step

# Families whose per-row decode was checked against generate() on each prompt alone (tests/test_rollout.py).
# mixture-of-experts families whose router picks each token's experts from that token alone (no capacity limit,
# no dropped tokens), so a row's tokens do not depend on what the other rows or a prompt's pads route
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
# families whose forward takes its masks built, one per layer type ({"full_attention": .., "sliding_attention":
# ..}): their sliding windows are decoded per row (`row_window`)
WINDOW_FAMILIES = ("gemma3_text", "gpt_oss", "qwen2", "qwen3")
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_FAMILIES
ROW_ATTENTION = ("sdpa", "eager")


@dataclass
class RowState:
    """Device buffers of a rollout with one sequence per row (slot). Their addresses never change."""
    tokens: torch.Tensor          # [S, 1] token fed to the next forward
    positions: torch.Tensor       # [S, 1] its position, which is also the cache column it is written at
    mask: torch.Tensor            # [S, C] the columns each row attends to
    index: torch.Tensor           # [] the Feed's step index (read only by sliding layers, which a rollout refuses)
    prompt_lengths: torch.Tensor  # [S] prompt length of the row's sequence
    lengths: torch.Tensor         # [S] tokens so far, up to and including EOS (the next write column of `out`)
    unfinished: torch.Tensor      # [S] 1 while the row's sequence runs; 0 once finished, and in an empty slot
    ran: torch.Tensor             # [S] row-steps the slot ran: each decode step counts every slot, a refill its row
    sequence: torch.Tensor        # [S] the sequence the slot runs (or ran last); Q while it never held one
    prompt_index: torch.Tensor    # [S] the row's sequence key for the noise: its prompt's index in the rollout
    sample_index: torch.Tensor    # [S] and its sample index (the token index is `lengths`)
    seen: torch.Tensor | None     # [S, V] ids the repetition penalty sees (prompt and new tokens)
    eos: torch.Tensor | None      # [E] EOS ids
    queue_ids: torch.Tensor       # [Q, W] the prompts, right-padded
    queue_lengths: torch.Tensor   # [Q]
    queue_prompt: torch.Tensor    # [Q] prompt index of each sequence
    queue_sample: torch.Tensor    # [Q] sample index of each sequence
    next: torch.Tensor            # [] the first sequence not started
    out: torch.Tensor             # [Q + 1, N + 1] tokens per sequence; row Q and column N take discarded writes
    out_lengths: torch.Tensor     # [Q + 1]
    finished: torch.Tensor        # [Q + 1] 1 once the sequence has ended
    logprobs: torch.Tensor | None  # [Q + 1, N + 1] float32 log-probability of each token, when asked for
    settled: torch.Tensor         # [1] 1 when no refill runs now (too few slots free, or the queue is empty)
    group: torch.Tensor           # [1] the rows the next refill takes (one of the sizes), 0 when settled
    width: torch.Tensor           # [1] the columns it prefills (one of the width buckets), 0 when settled
    pick: torch.Tensor            # [K] per refill size, largest first: 0 where that size is `group`, else 1
    pick_width: torch.Tensor      # [K, J] per size and width bucket (ascending): 0 where they are `group`, `width`
    done: torch.Tensor            # [1] 1 when every slot is free and the queue is empty
    refills: torch.Tensor         # [] refills run (prefill forwards)
    refill_counts: torch.Tensor   # [K, J] refills run per size and width
    steps: torch.Tensor           # [] decode steps run (a device loop counts them)
    slot_of: torch.Tensor         # [Q + 1] the slot each sequence ran in
    queue_targets: torch.Tensor | None = None  # [Q] forced lengths (a harness: EOS as token number t), else None
    targets: torch.Tensor | None = None        # [S] the forced length of each slot's sequence

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name).clone() for f in fields(self) if getattr(self, f.name) is not None}

    def restore(self, snap: dict) -> None:
        for name, saved in snap.items():
            getattr(self, name).copy_(saved)


REFILL_ROWS = 8   # the most prompts one refill prefills together, unless refill_rows says otherwise
# the most widths a refill prefills at (width buckets), unless refill_widths says otherwise: 1 (every refill at the
# longest prompt's width) until the captured twin rule has passed on a GPU with several (docs/rollout.md)
REFILL_WIDTHS = 1
WIDTH_STEP = 16    # width buckets below the longest prompt are multiples of this


def default_refill_after(slots: int) -> int:
    """refill_after unless given: refill once an eighth of the slots are free (at least one). Free slots then idle
    for a few steps (at most an eighth of the rows, about half that on average) while one forward prefills up to
    REFILL_ROWS prompts: with 64 slots on an H100 that made llama-1b's rollout 13% faster than refilling at once
    (docs/rollout.md). At 8 slots or fewer it refills at once."""
    return max(1, slots // 8)


def refill_sizes(rows: int, slots: int, queue: int) -> tuple[int, ...]:
    """The group sizes a refill runs, largest first: `rows` (at most slots and queue) and the powers of two below."""
    top = max(1, min(rows, slots, queue))
    return tuple(sorted({top} | {1 << i for i in range(top.bit_length()) if 1 << i <= top}, reverse=True))


def width_buckets(lengths, most: int = REFILL_WIDTHS) -> tuple[int, ...]:
    """The widths refills prefill at, ascending: the longest prompt W, and below it up to `most - 1` halvings
    (each rounded up to a multiple of WIDTH_STEP), as long as some prompt fits the smaller width."""
    lengths = [int(n) for n in lengths]
    widths = [max(lengths)]
    while len(widths) < most:
        half = -(-widths[-1] // 2 // WIDTH_STEP) * WIDTH_STEP
        if half >= widths[-1] or half < min(lengths):
            break
        widths.append(half)
    return tuple(sorted(widths))


def width_of(longest: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The smallest of `widths` (ascending, on longest's device) that is at least `longest` (one rule for the
    device's flags and the host's plan: `refill_shapes`)."""
    index = (widths < longest[..., None]).sum(-1).clamp(max=widths.numel() - 1)
    # gathered, not indexed: widths[index] with a 0-d index reads it on the host (a sync no graph can hold)
    return widths.gather(0, index.reshape(-1)).reshape(index.shape)


def refill_shapes(sizes: tuple, widths: tuple, lengths) -> dict:
    """{g: the widths a refill of g can ask for, ascending}: for every run of g consecutive sequences of the
    queue (a refill of g takes the next g, all of them in the queue), the width bucket of the longest. Only
    these (g, w) get a refill graph; the flags never pick another."""
    lengths = torch.as_tensor([int(n) for n in lengths], dtype=torch.long)
    ladder = torch.tensor(widths, dtype=torch.long)
    return {g: tuple(sorted(set(width_of(lengths.unfold(0, g, 1).max(1).values, ladder).tolist())))
            for g in sizes}


def refill_plan(lengths, slots: int, refill_rows: int, refill_widths: int) -> tuple[int, tuple, tuple]:
    """(W, the width buckets, the (g, w) shapes that get a refill graph) of a queue of sequences of these
    lengths: what a rollout builds (warms up, captures, compiles) before its first prefill. Two queues with one
    plan build the same graphs and programs."""
    lengths = [int(n) for n in lengths]
    sizes = refill_sizes(refill_rows, slots, len(lengths))
    widths = width_buckets(lengths, refill_widths)
    shapes = tuple((g, w) for g, ws in refill_shapes(sizes, widths, lengths).items() for w in ws)
    return max(lengths), widths, shapes


def new_row_state(slots: int, sequences: list, settings: Settings, vocab: int, device,
                  return_logprobs: bool, targets: list | None = None, sizes: tuple = (1,),
                  widths: tuple | None = None) -> RowState:
    """`sequences`: (prompt index, sample index, token ids) per sequence, in queue order; `targets`: a forced
    length per sequence (its first EOS id is forced as that token), or None; `sizes`: the refill group sizes,
    largest first (`refill_sizes`); `widths`: the width buckets, ascending (`width_buckets`; default: the
    longest prompt alone)."""
    long = dict(dtype=torch.long, device=device)
    n = settings.max_new_tokens
    q = len(sequences)
    width = max(len(ids) for _, _, ids in sequences)
    widths = (width,) if widths is None else tuple(widths)
    cache_len = width + n
    pad = settings.pad_token_id if settings.pad_token_id is not None else 0
    ids = torch.zeros(q, width, dtype=torch.long)
    for i, (_, _, prompt) in enumerate(sequences):
        ids[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    mask = torch.zeros(slots, cache_len, **long)
    mask[:, 0] = 1  # an empty slot attends to one column: its row stays finite, and is never read
    return RowState(
        tokens=torch.zeros(slots, 1, **long), positions=torch.zeros(slots, 1, **long), mask=mask,
        index=torch.zeros((), **long), prompt_lengths=torch.zeros(slots, **long),
        lengths=torch.zeros(slots, **long), unfinished=torch.zeros(slots, **long), ran=torch.zeros(slots, **long),
        sequence=torch.full((slots,), q, **long), prompt_index=torch.zeros(slots, **long),
        sample_index=torch.zeros(slots, **long),
        seen=torch.zeros(slots, vocab, dtype=torch.bool, device=device) if settings.uses_penalty else None,
        eos=torch.tensor(settings.eos_token_id, **long) if settings.has_eos else None,
        queue_ids=ids.to(device),
        queue_lengths=torch.tensor([len(p) for _, _, p in sequences], **long),
        queue_prompt=torch.tensor([p for p, _, _ in sequences], **long),
        queue_sample=torch.tensor([k for _, k, _ in sequences], **long),
        next=torch.zeros((), **long),
        out=torch.full((q + 1, n + 1), pad, **long), out_lengths=torch.zeros(q + 1, **long),
        finished=torch.zeros(q + 1, **long),
        logprobs=torch.zeros(q + 1, n + 1, dtype=torch.float32, device=device) if return_logprobs else None,
        settled=torch.zeros(1, **long), group=torch.zeros(1, **long), width=torch.zeros(1, **long),
        pick=torch.ones(len(sizes), **long), pick_width=torch.ones(len(sizes), len(widths), **long),
        done=torch.zeros(1, **long), refills=torch.zeros((), **long),
        refill_counts=torch.zeros(len(sizes), len(widths), **long),
        steps=torch.zeros((), **long), slot_of=torch.zeros(q + 1, **long),
        queue_targets=None if targets is None else torch.tensor(list(targets), **long),
        targets=None if targets is None else torch.zeros(slots, **long),
    )


# -- what the per-row write can decode ---------------------------------------------------------------

def check_rows(model, cache_len: int, refill: str = "host") -> None:
    # cache_len: the rollout's cache columns, longest prompt + max_new_tokens
    """Refuse, with the reason, a model whose rows cannot each decode their own sequence in one static cache
    exactly as generate() decodes that sequence alone. Reads the built model and the cache generate() would
    build for it; the family check comes last, so a known reason is named first."""
    name = type(model).__name__
    config = model.config.get_text_config()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ROW_ATTENTION:
        raise Unsupported(f"refill={refill!r} feeds each row its own columns through a 2-D mask, which attention "
                          f"{impl!r} does not take as sdpa and eager do; load the model with "
                          "attn_implementation='sdpa' (or 'eager'), or use refill='off'")
    moe = experts_modules(model) or [m for m in model.modules() if any(
        word in type(m).__name__ for word in ("MoE", "Moe", "Experts"))]
    if moe and getattr(config, "model_type", None) not in MOE_FAMILIES:
        raise Unsupported(f"{name} has mixture-of-experts blocks ({type(moe[0]).__name__}); refill={refill!r} is "
                          f"checked against generate() on the MoE families {', '.join(MOE_FAMILIES)} only (their "
                          "routing is per token, with no capacity limit across a batch); use refill='off'")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None or "chunked_attention" in (getattr(config, "layer_types", None) or ()):
        raise Unsupported(f"{name} has chunked-attention layers, whose mask depends on each row's absolute chunk; "
                          f"refill={refill!r} decodes full attention only: use refill='off'")
    for i, layer in enumerate(compat.cache_layers(compat.static_cache(model, cache_len))):
        kind = type(layer).__name__
        if compat.is_linear(layer):
            raise Unsupported(f"{name}'s layer {i} keeps a recurrent state ({kind}: linear attention or a state-space "
                              f"layer), which a refill would have to prefill and swap per row; refill={refill!r} decodes "
                              "full-attention caches only: use refill='off'")
        if compat.is_sliding(layer) and layer.max_cache_len < cache_len and row_window(model, cache_len) is None:
            raise Unsupported(f"{name}'s layer {i} has a sliding window of {layer.max_cache_len} tokens, shorter than "
                              f"the rollout's {cache_len} cache columns (longest prompt + max_new_tokens; the mask code "
                              "places each query at the last column): its window rolls over a shared counter, not per "
                              f"row, and {name}'s forward builds its masks from that counter; refill={refill!r} decodes "
                              f"windows per row for the families {', '.join(WINDOW_FAMILIES)} only: use refill='off' "
                              "(or prompts and max_new_tokens that fit the window)")
        if type(layer) is not _static_layer() and not compat.is_sliding(layer):
            raise Unsupported(f"{name}'s layer {i} uses cache layer {kind}, which refill={refill!r} does not know how to "
                              "write per row; use refill='off'")
    if getattr(model, "create_masks_for_generate", None) is not None:
        raise Unsupported(f"{name} builds its own masks for generate() (create_masks_for_generate); refill={refill!r} "
                          "feeds the standard causal mask only: use refill='off'")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise Unsupported(f"{name}'s forward takes no position_ids, so it would derive positions from the cache's "
                          "shared counter, not per row; use refill='off'")
    family = getattr(config, "model_type", None)
    if family not in TESTED_FAMILIES:
        raise Unsupported(f"{name} (model_type {family!r}) is not one of the families refill={refill!r} is checked on "
                          f"against generate() ({', '.join(TESTED_FAMILIES)}); use refill='off'")


def row_window(model, cache_len: int) -> int | None:
    """The sliding window a rollout's rows apply themselves, or None where every layer sees all its columns.

    Each row keeps all C columns in every layer (`row_cache`), so a sliding layer becomes a mask: the query at
    position p sees columns (p - window, p], the keys generate()'s sliding layer keeps for it. The masks go to
    the forward built, one per layer type, which the WINDOW_FAMILIES' forwards take as they are."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not window or "sliding_attention" not in types or window >= cache_len:
        return None
    if getattr(config, "model_type", None) not in WINDOW_FAMILIES or types - {"full_attention", "sliding_attention"}:
        return None
    if getattr(config, "use_bidirectional_attention", False):
        return None
    return int(window)


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
def row_writes(cache, slots: int, columns: torch.Tensor, phase: dict):
    """Each layer of `cache` writes per row while this holds. `phase["prefill"]` picks how:

    decode (None)   one token per row: row b's key/value at column `columns[b]` ([S, 1], read at every
                    forward); the layer returns the whole cache, and the mask code gets a query offset of C - 1
    prefill (rows)  g prompts of w tokens: prompt j's keys/values at columns [0, w) of row `rows[j]` ([g] device
                    tensor); the layer returns those rows of the cache ([g, heads, C, dim]), and the query offset
                    is 0

    The cache is allocated at the first write, `slots` rows (a refill runs before the first decode step)."""
    layers = compat.cache_layers(cache)
    last = layers[0].max_cache_len - 1
    ranges: dict = {}   # (n, device) -> arange(n), made once: the writes' index tensors (uncompiled)

    def arange(n: int, device) -> torch.Tensor:
        if torch.compiler.is_compiling():   # a constant of the program; a lookup here would be guarded on
            return torch.arange(n, device=device)
        if (n, device) not in ranges:
            ranges[n, device] = torch.arange(n, device=device)
        return ranges[n, device]

    # Both writes are one index_put_ into the cache tensor itself: torch.compile keeps it in place (a scatter_, or
    # a write through a slice, compiles to a copy of the whole cache and a copy back, at every step and layer)
    def writer(layer):
        def update(key_states, value_states, *args, **kwargs):
            if not layer.is_initialized:
                layer.lazy_initialization(*(t[:1].expand(slots, -1, -1, -1) for t in (key_states, value_states)))
            row = phase["prefill"]
            device = key_states.device
            heads = arange(key_states.shape[1], device)
            if row is None:
                if key_states.shape[-2] != 1 or key_states.shape[0] != slots:
                    raise RuntimeError("a rollout's decode step feeds one token per slot")
                at = (arange(slots, device)[:, None], heads[None, :], columns.view(-1, 1))   # [S, H]
                for store, new in ((layer.keys, key_states), (layer.values, value_states)):
                    store.index_put_(at, new[:, :, 0])
                return layer.keys, layer.values
            width = key_states.shape[-2]
            at = (row.view(-1, 1, 1), heads.view(1, -1, 1), arange(width, device).view(1, 1, -1))   # [g, H, W]
            for store, new in ((layer.keys, key_states), (layer.values, value_states)):
                store.index_put_(at, new)
            return layer.keys.index_select(0, row), layer.values.index_select(0, row)
        return update

    def get_query_offset(layer_idx=0, *args, **kwargs):
        return last if phase["prefill"] is None else 0

    for layer in layers:
        layer.update = writer(layer)
    cache.get_query_offset = get_query_offset
    try:
        yield
    finally:
        del cache.get_query_offset
        for layer in layers:
            del layer.update


# -- the step and the refill ------------------------------------------------------------------------

class RowStep(Step):
    """A decode step over every slot (`__call__`) and the refill of g slots at width w (`refill(g, w)`), over a
    `RowState`. `sizes`: the refill group sizes, largest first (`refill_sizes`); `widths`: the width buckets,
    ascending, the last the queue's width (`width_buckets`; default: that width alone); `after`: refill once this
    many slots are free (or all the queue has left)."""

    def __init__(self, model, cache, state: RowState, settings: Settings, seed: int | None = None,
                 sizes: tuple = (1,), after: int = 1, widths: tuple | None = None):
        if settings.do_sample and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r}: a rollout's sampling draws noise keyed by (seed, prompt, sample, "
                             "token); pass seed=<int>")
        super().__init__(model, cache, state, settings, prompt_width=0)
        self.seed = seed
        # read by the step from this buffer (noise.seed_words): a captured or compiled step holds no seed of its own
        self.seed_words = None if seed is None else noise.seed_words(seed, state.tokens.device)
        self.slots = state.tokens.shape[0]
        self.queue_size = state.queue_ids.shape[0]
        self.trash = settings.max_new_tokens  # the column of `out` that discarded writes go to
        device = state.tokens.device
        self.columns = torch.arange(state.mask.shape[1], device=device)[None]        # [1, C]
        self.prompt_positions = torch.arange(state.queue_ids.shape[1], device=device)[None]  # [1, W]
        self.slot_ids = torch.arange(self.slots, device=device)
        if tuple(sizes) != tuple(sorted(set(sizes), reverse=True)) or not sizes or sizes[-1] != 1 \
                or sizes[0] > min(self.slots, self.queue_size) or state.pick.numel() != len(sizes):
            raise ValueError(f"sizes={sizes!r}: refill group sizes, largest first, ending at 1, at most the slots and "
                             "the queue (refill_sizes), one `pick` flag each")
        self.sizes = tuple(int(g) for g in sizes)
        self.size_tensor = torch.tensor(self.sizes, dtype=torch.long, device=device)
        full = state.queue_ids.shape[1]
        widths = (full,) if widths is None else tuple(int(w) for w in widths)
        if widths != tuple(sorted(set(widths))) or widths[-1] != full or widths[0] < 1 \
                or tuple(state.pick_width.shape) != (len(self.sizes), len(widths)):
            raise ValueError(f"widths={widths!r}: refill widths, ascending, the last the queue's width {full} "
                             "(width_buckets), one `pick_width` flag per size and width")
        self.widths = widths
        self.width_tensor = torch.tensor(widths, dtype=torch.long, device=device)
        self.after = int(after)
        self.ones = torch.ones(self.sizes[0], dtype=torch.long, device=device)
        self.row_ids = torch.arange(self.sizes[0], device=device)
        self.phase = {"prefill": None}
        self.window = row_window(model, state.mask.shape[1])
        self.records_logprobs = state.logprobs is not None
        self.forward_fn = self.forward  # a forward-graph replay stands in here

    def forward(self) -> torch.Tensor:
        """The decode forward: the Feed's decode inputs over tokens, positions and the [S, C] mask (Step.forward);
        with a per-row window, the masks built here, one per layer type, and the model called with them."""
        if self.window is None:
            return super().forward()
        s = self.state
        masks = self._masks(s.mask.bool()[:, None, :], s.positions)
        inputs = {self.feed.cache_kw: self.cache, "input_ids": s.tokens, "attention_mask": masks,
                  "position_ids": s.positions, "use_cache": True}
        if self.feed.logits_to_keep:
            inputs["logits_to_keep"] = 1
        return self.logits(inputs)

    def _masks(self, allowed: torch.Tensor, queries: torch.Tensor):
        """The 4-D mask(s) of a forward whose query j of row b sits at position `queries[b, j]` and may see the
        columns `allowed[b, j]` ([B, Q, C] bool): that mask alone, or with a per-row window one per layer type,
        the sliding one also cut to the window's columns (p - window, p]. A query whose window holds no allowed
        column (a prompt's pad position far past its end) keeps its full row: its output is never read, and an
        empty row would make it NaN, which its key and value would carry into the cache."""
        if self.window is None:
            masks = {None: allowed[:, None]}
        else:
            sliding = allowed & (self.columns[:, None, :] > queries[..., None] - self.window)
            sliding = torch.where(sliding.any(-1, keepdim=True), sliding, allowed)
            masks = {"full_attention": allowed[:, None], "sliding_attention": sliding[:, None]}
        if getattr(self.model.config, "_attn_implementation", None) == "eager":
            dtype = self.model.dtype
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            masks = {k: torch.where(m, zero, torch.finfo(dtype).min) for k, m in masks.items()}
        return masks[None] if self.window is None else masks

    def select(self, logits: torch.Tensor, seen: torch.Tensor | None, prompt: torch.Tensor, sample: torch.Tensor,
               token: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        """(token per row, its log-probability under the processed scores or None). With sampling, row b's draw
        is keyed by (seed, prompt[b], sample[b], token[b]). With `targets`, a row whose token number token + 1
        is its target gets the first EOS id instead (the length harness)."""
        scores = sampling.process(logits, seen, self.settings)
        if self.settings.do_sample:
            chosen = sampling.choose_keyed(scores, self.seed_words, prompt, sample, token)
        else:
            chosen = sampling.choose(scores, False)
        if targets is not None:
            chosen = torch.where(token + 1 >= targets, self.state.eos[0], chosen)
        if not self.records_logprobs:   # a Python flag: the compiled step reads nothing sized by the queue
            return chosen, None
        logprobs = sampling.log_probs(logits, scores, self.logprobs_of, self.settings)
        return chosen, logprobs.gather(1, chosen[:, None]).squeeze(1)

    def forward_select(self) -> tuple:
        """The decode forward over every slot and each slot's token (and its log-probability or None): what
        reads the slot-sized buffers and the cache alone, never the queue or the per-sequence results."""
        s = self.state
        return self.select(self.forward_fn(), s.seen, s.prompt_index, s.sample_index, s.lengths, s.targets)

    def update(self, chosen: torch.Tensor, logprob: torch.Tensor | None, writing: torch.Tensor) -> None:
        """Rows where `writing` is 1 take `chosen` as their next token; the others are left as they are."""
        s = self.state
        live = writing.bool()
        column = torch.where(live, s.lengths, self.trash)
        s.out.index_put_((s.sequence, column), chosen)
        if s.logprobs is not None:
            s.logprobs.index_put_((s.sequence, column), logprob)
        if s.seen is not None:
            s.seen.scatter_(1, chosen[:, None], s.seen.gather(1, chosen[:, None]) | live[:, None])
        s.lengths.add_(writing)
        ended = s.lengths >= self.settings.max_new_tokens
        if s.eos is not None:
            ended |= (chosen[:, None] == s.eos[None, :]).any(-1)
        s.unfinished.copy_(torch.where(live & ended, 0, s.unfinished))
        s.out_lengths.index_put_((s.sequence,), s.lengths)
        s.finished.index_put_((s.sequence,), 1 - s.unfinished)
        s.tokens.copy_(torch.where(live[:, None], chosen[:, None], s.tokens))
        # the next token's position is its column; a finished row stays on its last one (in bounds, never read)
        s.positions.copy_((s.prompt_lengths + s.lengths - 1).clamp(0, self.last_slot)[:, None])
        s.mask.scatter_(1, s.positions, 1)

    def flags(self) -> None:
        """`settled`, `group`, `width`, the picks and `done` from the slots and the queue (the admission rule,
        module doc)."""
        s = self.state
        left = self.queue_size - s.next                       # sequences not started
        free = (s.unfinished == 0).sum()
        ready = (left > 0) & (free >= left.clamp(max=min(self.after, self.slots)))
        room = torch.minimum(free, left)
        group = torch.where(self.size_tensor <= room, self.size_tensor, 0).max() * ready
        if len(self.widths) == 1:   # one width: nothing to pick (a Python branch, fixed for the rollout)
            width = self.width_tensor[0] * ready
        else:
            q = (s.next + self.row_ids).clamp(max=self.queue_size - 1)  # the next sequences, as refill(g) takes them
            longest = torch.where(self.row_ids < group, s.queue_lengths.index_select(0, q), 0).max()
            width = width_of(longest, self.width_tensor) * ready
        s.settled.copy_((~ready).long().view(1))
        s.group.copy_(group.view(1))
        s.width.copy_(width.view(1))
        s.pick.copy_((self.size_tensor != group).long())
        s.pick_width.copy_(((self.size_tensor[:, None] != group) | (self.width_tensor[None, :] != width)).long())
        s.done.copy_(((s.unfinished.max() == 0) & (left <= 0)).long().view(1))

    def prefill(self, *args, **kwargs):
        raise TypeError("a RowStep starts sequences with refill(g, w), g prompts of its queue at a time")

    def __call__(self) -> None:
        """One decode step over every slot, then the flags."""
        s = self.state
        writing = s.unfinished.clone()
        self.update(*self.forward_select(), writing)
        s.ran.add_(1)
        s.steps.add_(1)
        self.flags()

    @contextlib.contextmanager
    def decoding(self):
        with self.feed.decoding(), row_writes(self.cache, self.slots, self.state.positions, self.phase):
            yield

    def refill(self, rows: int = 1, width: int | None = None) -> None:
        """The next `rows` sequences of the queue start in the first `rows` free slots, in order, prefilled in one
        forward `width` columns wide (default: the queue's width; see the module doc); then the flags. Run it only
        with `group` == rows and `width` == width: with fewer slots free it would overwrite running sequences, with
        fewer sequences left it would start the last one again, and a narrower width would cut a prompt short."""
        width = self.widths[-1] if width is None else width
        if rows not in self.sizes or width not in self.widths:
            raise ValueError(f"refill({rows!r}, {width!r}): the refill sizes are {self.sizes}, the widths "
                             f"{self.widths}")
        s = self.state
        ones = self.ones[:rows]
        # the first `rows` free slots: free slots sort before busy ones, each group by index
        slot = torch.topk(s.unfinished * self.slots + self.slot_ids, rows, largest=False, sorted=True).indices
        q = (s.next + self.row_ids[:rows]).clamp(max=self.queue_size - 1)   # the next `rows` sequences
        ids = s.queue_ids[:, :width].index_select(0, q)         # [g, w]
        # at most the width: a no-op in the rollout's order (the flags pick a width that holds the g prompts), and
        # in bounds when a refill runs out of turn (the warm-up and timing replays of each shape, from the first state)
        length = s.queue_lengths.index_select(0, q).clamp(max=width)   # [g]
        prompt = s.queue_prompt.index_select(0, q)
        sample = s.queue_sample.index_select(0, q)
        prompt_mask = (self.columns < length[:, None]).long()   # [g, C]
        seen = target = None
        if s.seen is not None:
            real = torch.where(self.prompt_positions[:, :width] < length[:, None], ids, ids[:, :1])  # not its pads
            seen = torch.zeros(rows, s.seen.shape[1], dtype=torch.bool, device=ids.device).scatter_(1, real, True)
        if s.targets is not None:
            target = s.queue_targets.index_select(0, q)
        # the experts as a prefill runs them, not the decode's batched_mm (`feed.prefilling`); outside the program a
        # compiled row step calls (dynamo would trace the switch)
        with self.feed.prefilling():
            chosen, logprob = self.prefill_select(ids, prompt_mask, slot, length, seen, prompt, sample, target)
        s.sequence.index_copy_(0, slot, q)
        s.slot_of.index_copy_(0, q, slot)
        s.prompt_index.index_copy_(0, slot, prompt)
        s.sample_index.index_copy_(0, slot, sample)
        s.prompt_lengths.index_copy_(0, slot, length)
        s.lengths.index_fill_(0, slot, 0)
        s.unfinished.index_fill_(0, slot, 1)
        s.mask.index_copy_(0, slot, prompt_mask)
        if seen is not None:
            s.seen.index_copy_(0, slot, seen)
        if target is not None:
            s.targets.index_copy_(0, slot, target)
        writing = torch.zeros_like(s.unfinished).index_fill_(0, slot, 1)
        self.update(s.tokens[:, 0].index_copy(0, slot, chosen),
                    None if logprob is None else torch.zeros(self.slots, dtype=torch.float32,
                                                             device=ids.device).index_copy(0, slot, logprob),
                    writing)
        s.ran.index_add_(0, slot, ones)
        s.next.add_(rows)
        s.refills.add_(1)
        s.refill_counts[self.sizes.index(rows), self.widths.index(width)] += 1
        self.flags()

    def prefill_select(self, ids, prompt_mask, slot, length, seen, prompt, sample, target) -> tuple:
        """g prompts' forward in their slots and their first tokens (and their log-probabilities or None): what
        reads the prompts, their slots and the cache alone, never the queue or the per-sequence results."""
        logits = self._prefill_logits(ids, prompt_mask, slot, length)
        return self.select(logits, seen, prompt, sample, torch.zeros_like(length), target)

    def _prefill_logits(self, ids, prompt_mask, slot, length) -> torch.Tensor:
        """The g prompts' forward, w columns each (keys and values written into their slots' columns [0, w)), and
        the float32 logits at each prompt's last position, [g, V].

        The mask goes in built, 4-D ([g, 1, w, C]: causal over the prompt AND its columns [0, L)), which
        transformers takes as it is. From a 2-D mask it would, uncaptured, read the mask on the host and drop it
        for sdpa's is_causal where the prompt fills W (a prefill from an empty cache may), while a captured
        prefill always keeps it: two kernels, two roundings."""
        rows, width = ids.shape
        prompt_positions = self.prompt_positions[:, :width]
        causal = self.columns <= prompt_positions[0, :, None]                            # [w, C]
        allowed = causal[None] & prompt_mask.bool()[:, None, :]                           # [g, w, C]
        positions = prompt_positions.expand(rows, -1)
        mask = self._masks(allowed, positions)
        inputs = {self.feed.cache_kw: self.cache, "input_ids": ids, "attention_mask": mask,
                  "position_ids": positions, "use_cache": True}
        last = (length - 1)
        if self.feed.logits_to_keep:
            # a 1-D tensor: the positions to keep, the same for every row ([g, g, V]); row j's is its own, last[j]
            inputs["logits_to_keep"] = last
        self.phase["prefill"] = slot
        try:
            logits = self.model(**inputs).logits
        finally:
            self.phase["prefill"] = None
        self.feed.settle()
        row = self.row_ids[:rows]
        return logits[row, row if self.feed.logits_to_keep else last].to(copy=True, dtype=torch.float32)
