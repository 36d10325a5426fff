"""The few places where supported transformers releases differ (5.17 on the GPU machine, newer on PyPI).

- The cache keyword of a model's forward: `past_key_values` (5.17; `cache_params` for Mamba-family
  classes, as 5.17's generate() names it) or `cache` (later 5.x); and the keywords generate() hands a
  cache by (`generate_cache_names`).
- The static cache: sized like generate() sizes it, and rewound after warm-up.
- The eager-attention mask: 5.17 makes its 0.0 with `torch.tensor(0.0, device=...)`, a host-to-device
  copy that a CUDA graph cannot capture; later releases use `torch.zeros(())` (`capturable_masks`).
- Position tables read at `cache.get_seq_length()`, a device tensor in 5.17 (`capturable_positions`): XGLM
  compares it with its table size to grow the table, a host read; the table already covers a cache that fits
  the model's positions, so while decoding that comparison is skipped. MVP, RoFormer and TrOCR take
  `torch.arange(past_length, past_length + seq_len)`, which reads it on the host; while decoding they take
  `past_length + torch.arange(seq_len)`, the same positions added on the device.
- Whether the repetition penalty sees left pads: up to 5.2x generate() penalizes every id of
  `input_ids`, pads included; later releases skip each row's left padding (`prompt_ignore_length`).

All of this rests on transformers' internals, checked on the releases the package requires (pyproject.toml's
range, the newest the zoo test ran against): `untested_transformers` says when the installed one is outside it.
"""
from __future__ import annotations

import contextlib
import inspect

import torch


def untested_transformers(version: str | None = None, requires: list[str] | None = None) -> str:
    """'' where transformers `version` (the installed one) is in the range gdtool's package metadata requires;
    else a warning that says so and what to do. '' too where gdtool is not installed (run from a source tree)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    if version is None:
        import transformers
        version = transformers.__version__
    if requires is None:
        try:
            requires = metadata.requires("gdtool") or []
        except metadata.PackageNotFoundError:
            return ""
    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and req.marker is None and not req.specifier.contains(version, prereleases=True):
            return (f"transformers {version} is outside the releases gdtool was tested with ({req.specifier}): "
                    "gdtool reads transformers' internals (caches, masks, generate()'s processors), which a release "
                    "may change, and its refusals and bitwise parity with generate() are checked on that range only. "
                    f"Install a tested release (pip install 'transformers{req.specifier}'), or run gdtool's tests on "
                    "this one first (bash scripts/dev.sh test).")
    return ""


def penalty_sees_left_pads() -> bool:
    """Whether this transformers' generate() lets the repetition penalty see the prompt's left pads."""
    from transformers.generation.utils import GenerationMixin
    return "prompt_ignore_length" not in inspect.getsource(GenerationMixin._get_logits_processor)


PENALTY_SEES_LEFT_PADS = penalty_sees_left_pads()


def generate_cache_names() -> list[str]:
    """The keywords generate() hands a cache by: `past_key_values` and `cache_params` in 5.17, `cache` later.
    A forward whose cache keyword is not among them (5.17's XLM names it `cache`) gets no cache from generate()."""
    from transformers.generation import utils
    return list(getattr(utils, "ALL_CACHE_NAMES", ["past_key_values", "cache_params"]))


def forward_kwargs(model) -> tuple[str, bool]:
    """(name of the cache keyword, whether forward accepts logits_to_keep)."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        cache_kw = "cache"
    elif "mamba" in type(model).__name__.lower() and "cache_params" in params:
        cache_kw = "cache_params"  # 5.17's generate() hands a Mamba-family model its cache under this name
    else:
        cache_kw = "past_key_values"
    return cache_kw, "logits_to_keep" in params


def cache_length(model, prompt_width: int, max_new_tokens: int) -> int:
    """The static cache length generate() would use, including what earlier generate() calls left behind."""
    length = prompt_width + max_new_tokens - 1
    max_cache_len = getattr(model.generation_config, "max_cache_len", None)
    if max_cache_len is not None:
        length = max(length, max_cache_len)
    return max(length, getattr(model, "_previous_max_cache_length", -1))


def remember_cache_length(model, length: int) -> None:
    # generate() keeps its largest static cache length on the model and never shrinks later caches below
    # it; keeping the same attribute lets generate() and gdtool.decode() calls interleave with the same bits.
    model._previous_max_cache_length = length


# State a model keeps on its modules between forwards, not in the cache, and resets only where its forward gets no
# cache or another batch size (class name -> attributes; None is how a freshly built module holds them).
# RecurrentGemma's recurrent blocks: a one-token prompt's prefill takes the decode branch, which reads the
# convolution state the previous call left (5.17-5.25), so generate() on a model that has decoded before gives
# another answer for the same one-token prompt than on a freshly loaded one.
FRESH_STATE = {"RecurrentGemmaRecurrentBlock": ("conv1d_state",), "RecurrentGemmaRglru": ("recurrent_states",)}


def start_fresh(model) -> None:
    """Clear the state `model` keeps on its modules (`FRESH_STATE`), as a freshly loaded model holds it: a decode
    then depends on its prompt alone, never on what ran before (every prefill does this; references taken with
    generate() do it first too)."""
    for module in model.modules():
        for name in FRESH_STATE.get(type(module).__name__, ()):
            setattr(module, name, None)


def static_cache(model, length: int):
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=length)


def cache_layers(cache):
    return list(cache.layers)


def full_attention_only(cache) -> bool:
    from transformers.cache_utils import StaticLayer
    return all(type(layer) is StaticLayer for layer in cache_layers(cache))


def _kind(layer, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(layer).__mro__)


def is_sliding(layer) -> bool:
    """A sliding-window layer: a window that rolls once full, and a Python counter beside the tensor one."""
    return _kind(layer, "StaticSlidingWindowLayer")


def is_linear(layer) -> bool:
    """A linear-attention / state-space layer: conv and recurrent states rewritten in place each step."""
    return _kind(layer, "LinearAttentionLayer")


def rewind(cache, length: int) -> None:
    """Forget everything written at or after slot `length` (warm-up steps) and write there next.

    A full-attention layer is rewound by zeroing its slots. A sliding window that rolled, or a linear
    layer's states, cannot be rewound that way: at `length` 0 they are reset, otherwise left to the
    caller (the decode engine saves and restores them around warm-up and capture)."""
    for layer in cache_layers(cache):
        sliding, linear = is_sliding(layer), is_linear(layer)
        if length and sliding:
            continue
        if getattr(layer, "is_initialized", True) and isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys[:, :, length:].zero_()
            layer.values[:, :, length:].zero_()
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        elif counter is not None:
            layer.cumulative_length = length
        if isinstance(getattr(layer, "indexer_keys", None), torch.Tensor):  # sparse attention's indexer cache
            layer.indexer_keys[:, length:].zero_()
            layer.indexer_cumulative_length.fill_(length)
        if sliding:
            layer.cumulative_length_int = 0
        if linear and not length:
            for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                for value in states.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
            flags = getattr(layer, "has_previous_state", None)
            if isinstance(flags, dict):
                for key in flags:
                    flags[key] = False


@contextlib.contextmanager
def capturable_masks():
    """While decoding, transformers' eager-attention mask without its host-to-device copy (5.17 builds
    its 0.0 with `torch.tensor(0.0, device=...)`; later releases with `torch.zeros(())`: same values)."""
    from transformers import masking_utils
    mapping = masking_utils.AttentionMaskInterface._global_mapping
    original = mapping.get("eager")
    try:
        copies = original is not None and "torch.tensor(0.0" in inspect.getsource(original)
    except (OSError, TypeError):
        copies = False
    if not copies:
        yield
        return

    def eager_mask(*args, dtype=torch.float32, **kwargs):
        kwargs.pop("allow_is_causal_skip", None)
        mask = masking_utils.sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
        if mask is not None:
            mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)
        return mask

    mapping["eager"] = eager_mask
    try:
        yield
    finally:
        mapping["eager"] = original


# position tables that 5.17 indexes with `torch.arange(past_length, past_length + seq_len)`: class -> whether it is a
# BART-style learned table (ids shifted by `offset`, one row per batch row) or RoFormer's sinusoidal one
ARANGE_POSITIONS = {"MvpLearnedPositionalEmbedding": True, "TrOCRLearnedPositionalEmbedding": True,
                    "RoFormerSinusoidalPositionalEmbedding": False}


def _reads_past_length_on_host(module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "past_key_values_length, past_key_values_length + seq_len" in source


def _xglm_lookup(module, cache_len: int):
    """XGLM's table lookup without its grow-the-table check, where the table covers the cache; else None."""
    weights = getattr(module, "weights", None)
    if not isinstance(weights, torch.Tensor) or weights.size(0) < module.offset + cache_len:
        return None

    def lookup(position_ids, *cache_length, **named):  # 5.17 and later name the cache length differently
        bsz, seq_len = position_ids.size()
        position_ids = position_ids + module.offset
        return module.weights.index_select(0, position_ids.view(-1)).view(bsz, seq_len, module.weights.shape[-1]).detach()
    return lookup


def _arange_lookup(module, learned: bool):
    """The table read at `past_length + arange(seq_len)`: the positions `torch.arange(past_length, past_length +
    seq_len)` gives, without reading a tensor `past_length` on the host."""
    def lookup(input_ids, past_key_values_length=0, position_ids=None):  # input_ids: RoFormer passes the shape
        if position_ids is None:
            bsz, seq_len = (input_ids if isinstance(input_ids, torch.Size) else input_ids.shape)[:2]
            position_ids = past_key_values_length + torch.arange(seq_len, dtype=torch.long, device=module.weight.device)
            if learned:
                position_ids = position_ids.expand(bsz, -1)
        elif learned:
            position_ids = position_ids.unsqueeze(0)
        with torch.no_grad():  # a decode step takes no gradients (RoFormer's forward says so itself)
            return torch.nn.Embedding.forward(module, position_ids + module.offset if learned else position_ids)
    return lookup


@contextlib.contextmanager
def capturable_positions(model, cache_len: int):
    """While decoding, position tables read without a host read of the cache's length (see the module doc).

    XGLM: `XGLMSinusoidalPositionalEmbedding.forward` computes `max_pos = 2 + seq_len + past_key_values_length` and
    rebuilds its table when `max_pos > table size`. With a static cache, 5.17's `past_key_values_length` is the
    cache's device counter, so the comparison is a host read (`is_nonzero`) that no graph can capture. A decode
    step never needs more than `offset + cache_len` rows, and gdtool validates that prompt + new tokens fit the
    model's positions, so where the table has them the branch is never taken: the lookup alone is the same
    computation. Tables too short for the cache keep the original forward (and its host read).

    MVP, RoFormer, TrOCR (`ARANGE_POSITIONS`), where their forward is 5.17's: `torch.arange` with a tensor start
    reads it on the host (`item`); `past_length + torch.arange(seq_len)` gives the same int64 positions."""
    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name == "XGLMSinusoidalPositionalEmbedding":
            lookup = _xglm_lookup(module, cache_len)
        elif name in ARANGE_POSITIONS and _reads_past_length_on_host(module):
            lookup = _arange_lookup(module, ARANGE_POSITIONS[name])
        else:
            continue
        if lookup is not None:
            module.forward = lookup
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
