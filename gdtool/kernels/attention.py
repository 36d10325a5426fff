"""Decode attention: for the compiled step, grouped-query attention without copying the cache
(`decode_attention`); for the fast step, split-KV attention over the live slots (`split_kv`).

The compiled step. HF's `sdpa` attention, traced by torch.compile, expands each key/value head of a
grouped-query model to every query head it serves (`repeat_kv`) before calling
scaled_dot_product_attention: for Llama 3 (32 query heads over 8 key/value heads) each step writes
and reads the whole static cache four times over, and at large batch that copy is most of the step.
At decode there is one query token per row, so the query heads of one group can be stacked as that
group's rows instead (HF's own `pack_gqa`, which it skips under torch.compile):

    query [B, Hq, 1, D] -> [B, Hkv, Hq/Hkv, D]     one "row" per query head of the group
    sdpa(query, key, value, mask [B, 1, 1, S])     key/value [B, Hkv, S, D], read once, no copy
    -> [B, Hkv, Hq/Hkv, D] -> [B, 1, Hq, D]

Same kernel family, same mask, same scale; only which heads share a launch changes (so logits move
by rounding, as everything else inductor fuses). gpt-oss supports no sdpa: its eager attention (HF's
`repeat_kv`, then a softmax joined by one learned logit per head, the sink) is packed the same way
(`sinks_decode_attention`, HF's ops in HF's order), since `repeat_kv` copies its cache 8 times a layer.

Scope: the swap applies only inside gdtool's compiled step (`scope()`, entered by
`step.CompiledStep` around each call of its compiled function; the captured replays run no Python).
`install()` puts a dispatcher in front of HF's registered `sdpa` function: outside the scope, or for
anything but a one-token query with a plain mask, it calls HF's function with the same arguments, so
HF's kernels, generate() and any other torch.compile of the model (the bench's peers) are unchanged.
Models set to another attention implementation (eager, flash) keep it.

The fast step (`split_kv`, Triton). At decode each row has one query token per head; the static
cache holds `C` slots of which only the first `slot + 1` have been written (`slot` is the cache
layer's own device counter, `cumulative_length`, read in the kernel: the captured graph needs no
host value). SDPA attends over all `C` slots with a mask; here the slots are split into chunks, one
program per (row, key/value head, chunk), and a program whose chunk starts past the live length
returns at once:

    split    per chunk: the group's query heads (grouped-query: one key/value head serves G query
             heads, read once for all G) against the chunk's keys, masked by the 2-D mask and the
             live length; online softmax; unnormalized output, running max and sum (float32). Under
             PDL the chunk's first keys and values (all but this step's slot) load before the wait
    combine  per (row, query head, 64 of its outputs): the live chunks' partial results, rescaled to
             the common max, read a block of chunks at a time (`combine_plan`). Where a cache is short
             (`fused_plan`: each chunk loaded whole before the wait, a (row, key/value head)'s
             partials one [G, chunks, D] tile) the last of its programs to finish combines them instead, in
             one load (GDTOOL_FUSED_COMBINE=0: never); one chunk a (row, key/value head) (large batches)
             finishes in the split kernel itself. One launch instead of two either way

The arithmetic is flash-decoding's: scores and softmax in float32, probabilities rounded to the
model dtype for the product with V (as SDPA's kernels do), output rounded once. With gpt-oss's sinks
(one learned logit per query head) the combine takes the sink into the common max and the sum; the
fast step calls it for gpt-oss through `sinks_attention`, a custom operator inside the compiled HF
forward (`sinks_plan` decides, `scope(sinks_kernel=True)` switches the dispatcher to it). Where `fast` runs
HF's forward compiled (batches past gdtool's own forward, MoE and Gemma 3 layers it leaves to HF), the
one-token sdpa calls with a boolean mask take the same kernels through `mask_attention` (`split_kv_plan`,
`scope(split_kernel=True)`): every slot counted live, the masked ones never read.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import tuning
from .triton import (HAVE_TRITON, asked, cdiv, dot_precision, launch_options, next_pow2, tl, triton,
                     untested_on_cuda, usable, zero_counts)

# The split-KV plan's parameters are the device's tuning (`tuning.py`, section "attention"):
#   programs_per_sm    split programs per multiprocessor at batch 1 (the device's count): enough chunks to fill the GPU
#   block_s            keys a split program's chunk is a multiple of, and its loop's least block
#   combine_d          a combine program's share of a head's outputs (`combine_plan`)
#   combine_elements   a combine program's tile of partials, float32 elements
#   early_elements     keys x head size a split program loads before its PDL wait (4096: 8 KB of bf16 keys, as many values)
#   fused_elements     the fused combine's [G, chunks, D] float32 tile of partials (16384: 64 KB over 4 warps)
#   loop_elements      keys x head size a split program loads per iteration past its early keys (`loop_keys`; 1024:
#                      block_s keys of a 64- to 256-wide head, as before it was a parameter; long chunks: large
#                      batches, long caches)

_active = False
_sinks_kernel = False  # inside the scope: gpt-oss's attention in gdtool's split-KV kernels (kernels="fast")
SINKS_PATH = "gpt_oss attention, sinks, split-KV"  # its kernel path's name (triton.CUDA_TESTED)
_split_kernel = False  # inside the scope: the packed sdpa calls in gdtool's split-KV kernels (kernels="fast")
_sliding = True  # inside the scope: a sliding layer's calls taken as a full layer's (GDTOOL_SLIDING_SPLIT; `applies`)
SPLIT_PATH = "split-KV attention in the compiled HF forward"  # its kernel path's name (triton.CUDA_TESTED)
_original = None
_original_sinks = None  # gpt-oss's eager attention (attention sinks), where the dispatcher replaced it
# keyword arguments that change the math: left to HF's function
_DECLINE = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def active() -> bool:
    """True while gdtool's compiled step runs (dynamo guards on it: read, it becomes part of the graph key)."""
    return _active


@contextmanager
def scope(sinks_kernel: bool = False, split_kernel: bool = False):
    """gdtool's compiled step runs inside: the dispatchers' packed forms apply; sinks_kernel (`sinks_plan`):
    gpt-oss's attention runs gdtool's split-KV kernels with its sinks (`sinks_attention`); split_kernel
    (`split_kv_plan`): the calls the packed sdpa would take run them instead (`mask_attention`)."""
    global _active, _sinks_kernel, _split_kernel, _sliding
    before = _active, _sinks_kernel, _split_kernel, _sliding
    _active, _sinks_kernel, _split_kernel = True, bool(sinks_kernel), bool(split_kernel)
    _sliding = asked("sliding_split")   # read here, a module global in the traced call (dynamo guards on it)
    try:
        yield
    finally:
        _active, _sinks_kernel, _split_kernel, _sliding = before


def install() -> None:
    """Put the dispatchers in front of HF's `sdpa` attention and gpt-oss's eager attention, once per process."""
    global _original, _original_sinks
    if _original is not None:
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", _dispatch)
    try:
        from transformers.models.gpt_oss import modeling_gpt_oss
    except ImportError:  # pragma: no cover - a transformers without gpt-oss
        return
    # gpt-oss supports no sdpa: its attention reads this module global at every call (the eager default of
    # `get_interface`), so the dispatcher stands in for it there
    _original_sinks = modeling_gpt_oss.eager_attention_forward
    modeling_gpt_oss.eager_attention_forward = _dispatch_sinks


def applies(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether the packed form computes this call: one query token, grouped heads, a [B, 1, 1, S]
    mask or none, no dropout, nothing else that changes the math. A sliding layer's window is in its mask, and
    HF's sdpa reads no `sliding_window` argument either: its calls are taken as a full layer's are
    (GDTOOL_SLIDING_SPLIT=0: left to HF's sdpa, as before; Gemma 3 at 64 rows ran cuDNN's SDPA over the whole
    window there)."""
    b, hq, length, _ = query.shape
    hkv = key.shape[1]
    if length != 1 or hq % hkv or dropout or any(kwargs.get(name) for name in _DECLINE):
        return False
    if kwargs.get("sliding_window") is not None and not _sliding:
        return False
    return attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1))


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scaling):
    """[B, Hq, 1, D] query over [B, Hkv, S, D] key/value -> [B, 1, Hq, D], as HF's attention returns it."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    if _active and applies(query, key, attention_mask, dropout, kwargs):
        # a boolean mask says only which slots attend (sdpa's masks are; a float one may add a bias): split-KV
        if _split_kernel and attention_mask is not None and attention_mask.dtype == torch.bool \
                and attention_mask.shape[-1] >= key.shape[2] and split_kv_fits(query.shape[-1]) \
                and value.shape[-1] == query.shape[-1]:   # one head size for keys and values (not MLA's)
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            return torch.ops.gdtool.mask_attention(query, key, value, attention_mask, scale), None
        return decode_attention(query, key, value, attention_mask, scaling), None
    return _original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def sinks_decode_attention(query, key, value, attention_mask, scaling, sinks):
    """gpt-oss's eager attention (one learned logit per head, the sink, joins each softmax and is dropped after
    it) for a one-token query, the query heads of each group packed as rows: key/value are read once, not
    copied to every query head (`repeat_kv`, 8x for gpt-oss-20b's 64 query over 8 key/value heads). HF's ops
    in HF's order and dtypes; only the batching of the two products changes. -> [B, 1, Hq, D]."""
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, hq // hkv, d)
    weights = torch.matmul(q, key.transpose(2, 3)) * scaling  # [B, Hkv, G, S]
    if attention_mask is not None:
        weights = weights + attention_mask  # [B, 1, 1, S]
    combined = torch.cat([weights, sinks.reshape(1, hkv, hq // hkv, 1).expand(b, -1, -1, -1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value).reshape(b, hq, 1, d).transpose(1, 2).contiguous()


def _dispatch_sinks(module, query, key, value, attention_mask, scaling, dropout: float = 0.0, **kwargs):
    # what HF's eager function does not read either: the window of a sliding layer (in its mask already) and
    # `s_aux` (the module's sinks, which it reads from the module); outside the scope nothing more is done
    if _active and applies(query, key, attention_mask, dropout,
                           {k: v for k, v in kwargs.items() if k not in ("sliding_window", "s_aux")}):
        if _sinks_kernel:
            return torch.ops.gdtool.sinks_attention(query, key, value, attention_mask, module.sinks, scaling), None
        return sinks_decode_attention(query, key, value, attention_mask, scaling, module.sinks), None
    return _original_sinks(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def split_kv_fits(head_dim: int) -> bool:
    """Whether the split kernel takes heads of this size: a power of two >= 16 (its dot products' tiles)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def _has_sinks(model) -> bool:
    """Whether the model has gpt-oss's attention modules (the ones whose calls `_dispatch_sinks` receives)."""
    return any(type(m).__module__.endswith("modeling_gpt_oss") and hasattr(m, "sinks") for m in model.modules())


def split_kv_plan(model, kernels: str) -> tuple[bool, str]:
    """(whether the compiled HF forward's one-token sdpa calls run gdtool's split-KV kernels, what the step's note
    says). kernels="fast" where the decode forward is HF's compiled (gdtool's own forward calls the kernels
    itself), on a model set to sdpa (gpt-oss: `sinks_plan`), where Triton runs on the model's device and the path
    has passed its cuda tests there (or GDTOOL_UNTESTED_KERNELS=1). The packed sdpa reads every static slot; the
    split kernel skips the masked ones (H200, 64 rows, 256 live of 384: 27.9 against 39.2 us a call,
    `profiles/h200/decode-kernels/run2/`)."""
    if kernels != "fast" or _has_sinks(model):
        return False, ""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None)
    d = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if d is not None and not split_kv_fits(d):
        return False, f"attention: the packed sdpa (head_dim {d}: the split kernel takes a power of two >= 16)"
    return _kernels_plan(model, "sdpa", SPLIT_PATH, "attention", "the packed sdpa")


def sinks_plan(model, kernels: str) -> tuple[bool, str]:
    """(whether gpt-oss's attention runs gdtool's split-KV kernels with its sinks, what the step's note says).
    kernels="fast" on gpt-oss's own attention modules (the ones whose calls `_dispatch_sinks` receives), where Triton
    runs on the model's device and the path has passed its cuda tests there (or GDTOOL_UNTESTED_KERNELS=1). Set to
    another attention implementation than eager, gpt-oss calls that one, not the dispatcher: said, not claimed."""
    if kernels != "fast" or not _has_sinks(model):
        return False, ""
    return _kernels_plan(model, "eager", SINKS_PATH, "attention with sinks", "the packed torch form")


def _kernels_plan(model, implementation: str, path: str, what: str, instead: str) -> tuple[bool, str]:
    """`split_kv_plan`'s and `sinks_plan`'s checks: the model set to the attention implementation whose calls the
    dispatcher receives, Triton on its device, `path`'s cuda tests passed there; the note names `what` and, where
    the kernels do not run, the form that does (`instead`) and why."""
    chosen = getattr(model.config, "_attn_implementation", None)
    if chosen != implementation:
        return False, f"{what}: HF's {chosen} attention (gdtool's kernels replace the {implementation} one)"
    param = next(model.parameters())
    if not usable(param):
        return False, f"{what}: {instead} (no Triton on this device)"
    untested = untested_on_cuda(path, param.device)
    if untested:
        return False, f"{what}: {instead} ({untested})"
    return True, f"{what}: gdtool's split-KV kernels"


@torch.library.custom_op("gdtool::sinks_attention", mutates_args=())
def sinks_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                    sinks: torch.Tensor, scaling: float) -> torch.Tensor:
    """gpt-oss's attention for a one-token query [B, Hq, 1, D] over the whole cache [B, Hkv, C, D] (a sliding
    layer's cache is its window) in the split-KV kernels, its sinks joining the combine's softmax:
    -> [B, 1, Hq, D]. The mask is HF's ([B, 1, 1, >= C], additive: 0 where a slot is attended; or boolean);
    every slot counts as live (HF's call gives no counter), the mask says which attend. Float32 softmax,
    where HF's eager attention takes it in the model dtype: it agrees with HF by rounding, as `fast` does."""
    b, hq, _, d = query.shape
    c = key.shape[2]
    if attention_mask is None:
        keep = torch.ones(b, c, dtype=torch.int8, device=query.device)
    else:
        cols = attention_mask[:, 0, 0, :c]
        keep = (cols if cols.dtype == torch.bool else cols == 0).to(torch.int8)
    q = query.reshape(b, hq, d).contiguous()
    run = split_kv if usable(q, key) else split_kv_reference
    return run(q, key.contiguous(), value.contiguous(), keep, _last_slot(c, query.device), scaling,
               sinks).reshape(b, 1, hq, d)


@sinks_attention.register_fake
def _(query, key, value, attention_mask, sinks, scaling):
    b, hq, _, d = query.shape
    return query.new_empty(b, 1, hq, d)


@torch.library.custom_op("gdtool::mask_attention", mutates_args=())
def mask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """The one-token sdpa call of the compiled HF forward ([B, Hq, 1, D] over the static cache [B, Hkv, C, D],
    HF's boolean [B, 1, 1, >= C] mask) in the split-KV kernels: -> [B, 1, Hq, D], as HF's attention returns it.
    Every slot counts as live (HF's call gives no counter): the mask, read in place as a [B, C] view, alone says
    which slots attend, and the kernel reads no key or value of a masked one (`split_kv`'s mask_only)."""
    b, hq, _, d = query.shape
    c = key.shape[2]
    cols = attention_mask[:, 0, 0, :c].expand(b, c)
    cols = cols if cols.stride(-1) == 1 else cols.contiguous()
    q = query.reshape(b, hq, d).contiguous()
    slot = _last_slot(c, query.device)
    if usable(q, key):
        out = split_kv(q, key.contiguous(), value.contiguous(), cols, slot, scaling, mask_only=True)
    else:
        out = split_kv_reference(q, key.contiguous(), value.contiguous(), cols, slot, scaling)
    return out.reshape(b, 1, hq, d)


@mask_attention.register_fake
def _(query, key, value, attention_mask, scaling):
    b, hq, _, d = query.shape
    return query.new_empty(b, 1, hq, d)


_LAST_SLOTS: dict = {}


def _last_slot(c: int, device) -> torch.Tensor:
    """The device scalar C - 1 (every slot of a C-slot cache counted live), made once per (C, device) outside a
    CUDA graph capture, so a captured call reads it and launches nothing for it."""
    key = (c, str(device))
    slot = _LAST_SLOTS.get(key)
    if slot is None:
        slot = torch.full((), c - 1, dtype=torch.long, device=device)
        if not (slot.is_cuda and torch.cuda.is_current_stream_capturing()):  # the graph's pool owns it then
            _LAST_SLOTS[key] = slot
    return slot


# -------------------------------------------------------------------- the fast step: split-KV

def split_kv_reference(q, k_cache, v_cache, mask, slot, scale, sinks=None):
    """q [B, Hq, D], caches [B, Hkv, C, D], mask [B, C] (nonzero = attend), slot [] -> [B, Hq * D].
    SDPA over the packed query heads of each group (attention's form), slots <= slot only. sinks [Hq] (gpt-oss):
    one more logit per head joins each softmax, its probability dropped after it; in float32 here."""
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    live = torch.arange(c, device=q.device) <= slot
    keep = (mask != 0) & live[None, :]
    qp = q.reshape(b, hkv, hq // hkv, d)
    if sinks is None:
        out = F.scaled_dot_product_attention(qp, k_cache, v_cache, attn_mask=keep[:, None, None, :], scale=scale)
        return out.reshape(b, hq * d)
    scores = torch.matmul(qp.float(), k_cache.float().transpose(2, 3)) * scale            # [B, Hkv, G, C]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    sink = sinks.float().reshape(1, hkv, hq // hkv, 1).expand(b, -1, -1, -1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(v_cache.dtype)
    return torch.matmul(probs, v_cache).reshape(b, hq * d)


def target_programs(tune: tuning.Tuning | None = None) -> int:
    """Split programs to aim for at batch 1: programs_per_sm times the device's multiprocessors (264 on the H200)."""
    tune = tune or tuning.current()
    return max(1, round(tune["attention"]["programs_per_sm"] * tune.multiprocessors))


def split_plan(batch: int, hkv: int, cache_len: int, tune: tuning.Tuning | None = None) -> tuple[int, int]:
    """(chunk, splits): chunks a multiple of block_s, enough of them for `target_programs` programs. tune: the
    device's tuning (None: the defaults)."""
    tune = tune or tuning.current()
    block_s = tune["attention"]["block_s"]
    want = max(1, target_programs(tune) // max(1, batch * hkv))
    chunk = max(block_s, cdiv(cdiv(cache_len, want), block_s) * block_s)
    return chunk, cdiv(cache_len, chunk)


def early_keys(chunk: int, d: int, tune: tuning.Tuning | None = None) -> int:
    """Keys of its chunk a split program loads in one block before its PDL wait: the whole chunk (its length
    rounded up to a power of two, the block's lanes past it masked) where that block's keys fit early_elements,
    else as many as fit, at least block_s; the rest of the chunk loads after the wait, a block at a time."""
    plan = (tune or tuning.current())["attention"]
    fit = max(plan["block_s"], 1 << max(0, (plan["early_elements"] // d).bit_length() - 1))
    return min(next_pow2(chunk), fit)


def loop_keys(d: int, tune: tuning.Tuning | None = None) -> int:
    """Keys a split program loads per iteration of its loop (the chunk past its early keys): loop_elements over the
    head size, a power of two, at least block_s."""
    plan = (tune or tuning.current())["attention"]
    return max(plan["block_s"], 1 << max(0, (plan["loop_elements"] // d).bit_length() - 1))


def fused_plan(batch: int, hkv: int, g: int, cache_len: int, d: int,
               tune: tuning.Tuning | None = None) -> tuple[int, int] | None:
    """(chunk, splits) for the combine in the split kernel's last program, or None where it does not apply:
    `split_plan`'s chunks, lengthened until a (row, key/value head)'s partials fit one [G, splits, D] float32 tile
    of at most fused_elements (one load), and only while each chunk still loads whole before the wait
    (`early_keys`): short caches. Llama-1B at 384 slots keeps its 24 chunks of 16 (a [4, 32, 64] tile);
    Qwen3-30B-A3B's 8 query heads of 128 a group take 12 chunks of 32 ([8, 16, 128])."""
    tune = tune or tuning.current()
    plan = tune["attention"]
    chunk, splits = split_plan(batch, hkv, cache_len, tune)
    most = plan["fused_elements"] // (next_pow2(g) * d)   # chunks the tile holds
    if most < 1:
        return None
    most = 1 << (most.bit_length() - 1)
    if splits > most:
        chunk = cdiv(cdiv(cache_len, most), plan["block_s"]) * plan["block_s"]
        splits = cdiv(cache_len, chunk)
    if early_keys(chunk, d, tune) < chunk:
        return None
    return chunk, splits


def attention_plan(batch: int, hkv: int, g: int, cache_len: int, d: int, device) -> tuple[int, int, bool]:
    """(chunk, splits, fused): `fused_plan` where it applies and the fused combine is on (`fused_combine`), else
    `split_plan` and the combine in its own kernel. One chunk a (row, key/value head) finishes in the split kernel
    either way. The parameters: the device's tuning."""
    tune = tuning.current(device)
    plan = fused_plan(batch, hkv, g, cache_len, d, tune) if fused_combine(device) else None
    if plan is not None:
        return (*plan, True)
    return (*split_plan(batch, hkv, cache_len, tune), False)


if HAVE_TRITON:
    @triton.jit
    def _attention_split_kernel(q_ptr, kc_ptr, vc_ptr, mask_ptr, slot_ptr, m_ptr, l_ptr, acc_ptr,
                      C, stride_mask, qk_scale, count_ptr, o_ptr, sink_ptr,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                      BLOCK_G: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                      EARLY: tl.constexpr, FUSED: tl.constexpr, COMBINE_G: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                      SINKS: tl.constexpr, MASK_ONLY: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // HKV
        hk = bh % HKV
        # Before the PDL wait: the slot counter, the mask and the chunk's first EARLY keys and values (the whole
        # chunk where it is short: `early_keys`), all but this step's slot. The kernel just before this one (q/k/v
        # + RoPE, or the norm and RoPE after its products) writes the cache at `slot` only; the counter, the mask and
        # the earlier slots were written before it, and under PDL this kernel starts only once every block of that
        # kernel has passed its own wait, so once every kernel before it has ended (window.py says the same of the
        # roll). Loaded early, they overlap that kernel's tail; this step's slot is read after the wait. HF's forward
        # (`mask_attention`, `sinks_attention`) launches no PDL kernel before this one: there it starts after the one
        # before ends.
        live = tl.load(slot_ptr) + 1
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, live)
        d = tl.arange(0, D)
        kv = kc_ptr + (bh.to(tl.int64) * C) * D
        vv = vc_ptr + (bh.to(tl.int64) * C) * D
        j = start + tl.arange(0, EARLY)
        inside = j < end
        keep = inside & (tl.load(mask_ptr + b * stride_mask + j, mask=inside, other=0) != 0)
        # MASK_ONLY (every slot live, the mask alone says which attend): no masked slot's key or value read
        read = keep if MASK_ONLY else inside
        fresh = j == live - 1
        k = tl.load(kv + j[:, None] * D + d[None, :], mask=(read & ~fresh)[:, None], other=0.0)
        v = tl.load(vv + j[:, None] * D + d[None, :], mask=(read & ~fresh)[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if start < live:
            g = tl.arange(0, BLOCK_G)
            q = tl.load(q_ptr + ((b * HQ + hk * G + g) * D)[:, None] + d[None, :], mask=(g < G)[:, None], other=0.0)
            now = (read & fresh)[:, None]
            k = tl.where(now, tl.load(kv + j[:, None] * D + d[None, :], mask=now, other=0.0), k)
            v = tl.where(now, tl.load(vv + j[:, None] * D + d[None, :], mask=now, other=0.0), v)
            m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
            m_i, l_i, acc = _attend(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT)
            for j0 in range(EARLY, CHUNK, BLOCK_S):  # static bounds; keys past `end` are masked (not read)
                # names of their own: the early block's are EARLY wide, a loop-carried value keeps one shape
                jb = start + j0 + tl.arange(0, BLOCK_S)
                inside_b = jb < end
                keep_b = inside_b & (tl.load(mask_ptr + b * stride_mask + jb, mask=inside_b, other=0) != 0)
                read_b = keep_b if MASK_ONLY else inside_b
                kb = tl.load(kv + jb[:, None] * D + d[None, :], mask=read_b[:, None], other=0.0)
                vb = tl.load(vv + jb[:, None] * D + d[None, :], mask=read_b[:, None], other=0.0)
                m_i, l_i, acc = _attend(q, kb, vb, keep_b, m_i, l_i, acc, qk_scale, DOT)
            heads = b * HQ + hk * G + g
            if SPLITS == 1:  # the only chunk: finished here, as the combine finishes one chunk's partials
                if SINKS:
                    sink = tl.load(sink_ptr + heads % HQ, mask=g < G, other=float("-inf")).to(tl.float32) \
                        * 1.4426950408889634
                else:
                    sink = tl.full([BLOCK_G], float("-inf"), tl.float32)
                out = _rescaled(acc[:, None, :], l_i[:, None], m_i[:, None], (g >= 0)[:, None], sink, SINKS)
                tl.store(o_ptr + heads[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])
            else:
                row = heads * SPLITS + s
                tl.store(m_ptr + row, m_i, mask=g < G)
                tl.store(l_ptr + row, l_i, mask=g < G)
                tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        if FUSED and SPLITS > 1:
            # The combine in the last of the (row, key/value head)'s SPLITS programs to finish: every thread's
            # stores done (the barrier), then one acq_rel count: the last sees the others' partials. It sets
            # the count back to 0 for the next call (the next kernel to use it waits for this one's end).
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel")
            if done == SPLITS - 1:
                tl.store(count_ptr + bh, 0)
                _combine_group(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, b * HQ + hk * G, live, HQ, D, G, COMBINE_G,
                               CHUNK, SPLITS, BLOCK_SPLITS, SINKS)

    @triton.jit
    def _attend(q, k, v, keep, m_i, l_i, acc, qk_scale, DOT: tl.constexpr):
        """One block of keys in the online softmax: (running max, sum, unnormalized output) after it (DOT: the
        products' precision, `dot_precision`)."""
        scores = tl.dot(q, tl.trans(k), input_precision=DOT) * qk_scale          # [BLOCK_G, BLOCK_S], log2 units
        scores = tl.where(keep[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row so far
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
        return m_new, l_i, acc

    @triton.jit
    def _rescaled(acc, l, m, valid, sink, SINKS: tl.constexpr):
        """Heads' outputs [H, Dt] from their chunks' partials acc [H, S, Dt], l and m [H, S] (m in log2 units),
        valid [H, S] (the live chunks), sink [H] (gpt-oss: joins the common max and the sum, never the output):
        each chunk rescaled to the common max, summed in chunk order, divided by the sum."""
        top = tl.maximum(tl.max(m, axis=1), sink)
        w = tl.where(valid, tl.exp2(m - top[:, None]), 0.0)
        total = tl.sum(l * w, axis=1)
        out = tl.sum(acc * w[:, :, None], axis=1)
        if SINKS:
            total += tl.exp2(sink - top)
        return out / total[:, None]

    @triton.jit
    def _combine_group(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, bh0, live, HQ: tl.constexpr, D: tl.constexpr,
                       G: tl.constexpr, COMBINE_G: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_SPLITS: tl.constexpr, SINKS: tl.constexpr):
        """The fused combine: the G query heads bh0 .. bh0 + G of one (row, key/value head), every live chunk's
        partials in one [G, chunks, D] load past L1 (.cg: other programs of this kernel stored them just before),
        combined as `_rescaled` combines them, stored."""
        n_live = (live + CHUNK - 1) // CHUNK
        g = tl.arange(0, COMBINE_G)
        s = tl.arange(0, BLOCK_SPLITS)
        d = tl.arange(0, D)
        rows = (bh0 + g)[:, None] * SPLITS + s[None, :]
        valid = (g < G)[:, None] & (s < n_live)[None, :]
        m = tl.load(m_ptr + rows, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + rows, mask=valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(acc_ptr + rows[:, :, None] * D + d[None, None, :], mask=valid[:, :, None], other=0.0,
                      cache_modifier=".cg")
        if SINKS:
            sink = tl.load(sink_ptr + (bh0 + g) % HQ, mask=g < G, other=float("-inf")).to(tl.float32) \
                * 1.4426950408889634
        else:
            sink = tl.full([COMBINE_G], float("-inf"), tl.float32)
        out = _rescaled(acc, l, m, valid, sink, SINKS)
        tl.store(o_ptr + (bh0 + g)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None])

    @triton.jit
    def _combine(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, bh, d0, live, HQ: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                 SINKS: tl.constexpr):
        """One (row, query head) bh, outputs d0 to d0 + BLOCK_D: its live chunks' partial results, rescaled to
        the common max, stored. Where every chunk fits one block (SPLITS <= BLOCK_SPLITS, `combine_plan`) the
        partials are read once, all loads in flight together (`_rescaled`); otherwise BLOCK_SPLITS chunks at a
        time, twice: the maxima for the common max, then the sums and outputs, added block by block in chunk
        order."""
        n_live = (live + CHUNK - 1) // CHUNK
        s = tl.arange(0, BLOCK_SPLITS)
        d = d0 + tl.arange(0, BLOCK_D)
        base = bh * SPLITS
        if SINKS:  # the head's sink joins the softmax: in the common max and the sum, never in the output
            sink = tl.load(sink_ptr + bh % HQ).to(tl.float32) * 1.4426950408889634   # log2 units, as m
        else:
            sink = tl.full([], float("-inf"), tl.float32)
        if SPLITS <= BLOCK_SPLITS:
            valid = s < n_live
            m = tl.load(m_ptr + base + s, mask=valid, other=float("-inf"))
            l = tl.load(l_ptr + base + s, mask=valid, other=0.0)
            acc = tl.load(acc_ptr + (base + s)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            out = _rescaled(acc[None, :, :], l[None, :], m[None, :], valid[None, :], tl.zeros([1], tl.float32) + sink,
                            SINKS)
            tl.store(o_ptr + bh * D + d[None, :], out.to(o_ptr.dtype.element_ty))
        else:
            top = sink
            for s0 in range(0, n_live, BLOCK_SPLITS):
                top = tl.maximum(top, tl.max(tl.load(m_ptr + base + s0 + s, mask=s0 + s < n_live, other=float("-inf")),
                                             axis=0))
            total = tl.zeros([], tl.float32)
            out = tl.zeros([BLOCK_D], tl.float32)
            for s0 in range(0, n_live, BLOCK_SPLITS):
                valid = s0 + s < n_live
                m = tl.load(m_ptr + base + s0 + s, mask=valid, other=float("-inf"))
                l = tl.load(l_ptr + base + s0 + s, mask=valid, other=0.0)
                acc = tl.load(acc_ptr + (base + s0 + s)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
                w = tl.where(valid, tl.exp2(m - top), 0.0)
                total += tl.sum(l * w, axis=0)
                out += tl.sum(acc * w[:, None], axis=0)
            if SINKS:
                total += tl.exp2(sink - top)
            tl.store(o_ptr + bh * D + d, (out / total).to(o_ptr.dtype.element_ty))

    @triton.jit
    def _attention_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, slot_ptr, sink_ptr,
                        HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                        SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr):
        bh = tl.program_id(0)  # row * Hq + query head
        d0 = tl.program_id(1) * BLOCK_D
        live = tl.load(slot_ptr) + 1   # before the wait: the split kernel does not write the counter (its own note)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        _combine(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, bh, d0, live, HQ, D, BLOCK_D, CHUNK, SPLITS, BLOCK_SPLITS,
                 SINKS)


def combine_plan(splits: int, d: int, tune: tuning.Tuning | None = None) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_SPLITS): the combine's programs each take BLOCK_D of a head's D outputs, and read its
    partials BLOCK_SPLITS chunks at a time, a [BLOCK_SPLITS, BLOCK_D] float32 tile of at most combine_elements.
    One [splits, D] tile spilled from registers at long caches: Gemma-3-1B's full layers at prompt 4096 (259
    chunks of 256-wide heads, 4 programs) took 18.1 us a combine (nsys, H200, 14cc799), 92 us a layer."""
    plan = (tune or tuning.current())["attention"]
    block_d = min(d, plan["combine_d"])
    return block_d, max(2, min(next_pow2(splits), plan["combine_elements"] // block_d))


def split_kv(q, k_cache, v_cache, mask, slot, scale, sinks=None, mask_only=False):
    """Triton split-KV attention: same arguments and result as `split_kv_reference`. mask_only (slot: the cache's
    last, the mask alone says which slots attend): the kernel reads no key or value of a masked slot."""
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    chunk, splits, fused = attention_plan(b, hkv, g, c, d, q.device)
    m = torch.empty(b * hq * splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(b * hq * splits, d, device=q.device, dtype=torch.float32)
    out = torch.empty(b, hq * d, device=q.device, dtype=q.dtype)
    opts = launch_options(q.device)
    sink = sinks if sinks is not None else m
    tune = tuning.current(q.device)
    block_d, block_splits = combine_plan(splits, d, tune)
    if fused:
        block_splits = max(2, next_pow2(splits))   # every chunk in the one tile (`fused_plan`)
    _attention_split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, mask, slot, m, l, acc, c, mask.stride(0), float(scale) * 1.4426950408889634,
        zero_counts("attention", b * hkv, q.device) if fused else m, out, sink,
        HQ=hq, HKV=hkv, D=d, G=g, BLOCK_G=max(16, next_pow2(g)), CHUNK=chunk, SPLITS=splits,
        BLOCK_S=loop_keys(d, tune), EARLY=early_keys(chunk, d, tune), FUSED=fused, COMBINE_G=next_pow2(g),
        BLOCK_SPLITS=block_splits,
        SINKS=sinks is not None, MASK_ONLY=mask_only, DOT=dot_precision(q.dtype), num_warps=4, **opts)
    if not fused and splits > 1:
        _attention_combine_kernel[(b * hq, d // block_d)](
            m, l, acc, out, slot, sink, HQ=hq, D=d, BLOCK_D=block_d, CHUNK=chunk, SPLITS=splits,
            BLOCK_SPLITS=block_splits, SINKS=sinks is not None, num_warps=4 if block_d * block_splits >= 4096 else 2,
            **opts)
    return out


# The combine inside the split kernel, in the last program of each (row, key/value head) to finish (`fused_plan`:
# short caches): one kernel instead of two per attention. In the step the combine kernel ended ~3.2 us after the
# split kernel at llama-1b's batch 1 (nsys, H200, a7748ba), where its own work is one load from L2. On unless
# GDTOOL_FUSED_COMBINE=0; on CUDA only while the path is in CUDA_TESTED (else two kernels).
FUSED_COMBINE_PATH = "split-KV attention, combine in the last program"


def fused_combine(device) -> bool:
    """Whether split_kv may combine inside its split kernel on `device` (where `fused_plan` applies): asked for
    (GDTOOL_FUSED_COMBINE, on by default) and, on CUDA, tested there."""
    return asked("fused_combine") and not untested_on_cuda(FUSED_COMBINE_PATH, device)
