"""Generation settings, resolved exactly as `model.generate()` resolves them, and checked.

Priority: explicit arguments, then `model.generation_config`, then transformers' global defaults
(so `top_k` is 50 unless given; an explicit `None` overrides). The resolution runs through
transformers' own `GenerationConfig.update`, so it cannot drift from generate().

Settings that would change generate()'s output and that gdtool does not implement are refused by
name, never ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .feed import Unsupported

UNSET = object()

# Settings gdtool implements: resolved and used.
SUPPORTED = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "eos_token_id", "pad_token_id")

# Settings that change generate()'s output and that gdtool does not implement, with the value that
# means "off". A value other than "off" (given explicitly or by the model's generation_config) is refused.
_OFF = {
    "min_length": (None, 0), "min_new_tokens": (None, 0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "sequence_bias": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "min_p": (None,), "typical_p": (None, 1.0), "top_h": (None,),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "num_beams": (None, 1),
    "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0), "num_return_sequences": (None, 1),
    "stop_strings": (None,), "max_time": (None,), "guidance_scale": (None, 1.0), "renormalize_logits": (None, False),
    "remove_invalid_values": (None, False), "exponential_decay_length_penalty": (None,),
    "encoder_repetition_penalty": (None, 1.0), "watermarking_config": (None,), "penalty_alpha": (None,),
    "low_memory": (None, False), "prompt_lookup_num_tokens": (None,), "assistant_model": (None,),
    "constraints": (None,), "force_words_ids": (None,), "logits_processor": (None,),
    "stopping_criteria": (None,), "prefix_allowed_tokens_fn": (None,), "streamer": (None,),
}
REFUSED = tuple(sorted(_OFF))


@dataclass(frozen=True)
class Settings:
    """What a decode needs, after resolution. Hashable: graphs key on it."""
    max_new_tokens: int
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None

    @property
    def uses_temperature(self) -> bool:
        return self.do_sample and self.temperature is not None and self.temperature != 1.0

    @property
    def uses_top_k(self) -> bool:
        return self.do_sample and self.top_k is not None and self.top_k != 0

    @property
    def uses_top_p(self) -> bool:
        return self.do_sample and self.top_p is not None and self.top_p < 1.0

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def has_eos(self) -> bool:
        return len(self.eos_token_id) > 0


def resolve(model, max_new_tokens, explicit: dict, extra: dict | None = None) -> Settings:
    """Resolve `explicit` (only the keys the caller gave) against the model as generate() does."""
    from transformers import GenerationConfig
    extra = dict(extra or {})
    for name in extra:
        if name not in _OFF:
            raise TypeError(f"decode() got an unexpected keyword argument {name!r}")
    if max_new_tokens is None or isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be a positive int (it is required); got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    _refuse_unsupported(None, extra)
    config = GenerationConfig()
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**model.generation_config._get_default_generation_params(), defaults_only=True)
    given = {k: v for k, v in explicit.items() if v is not UNSET}
    config.update(**given, **extra)
    _refuse_unsupported(config, extra)

    do_sample = bool(config.do_sample)
    if not do_sample:
        warpers = [k for k in ("temperature", "top_k", "top_p") if k in given and given[k] is not None]
        if warpers:
            raise ValueError(f"{', '.join(warpers)} given with do_sample=False: generate() would ignore them; "
                             "pass do_sample=True to sample, or drop them for greedy decoding")
    eos = config.eos_token_id
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = config.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # generate() does the same (and logs it)
    settings = Settings(max_new_tokens=max_new_tokens, do_sample=do_sample,
                        temperature=_num(config.temperature), top_k=config.top_k, top_p=_num(config.top_p),
                        repetition_penalty=_num(config.repetition_penalty), eos_token_id=eos,
                        pad_token_id=None if pad is None else int(pad))
    _check_values(settings, model.config.get_text_config().vocab_size)
    return settings


def _num(value):
    return None if value is None else float(value)


def _refuse_unsupported(config, extra: dict) -> None:
    """Refuse explicit values first (config=None), then what the model's generation_config sets."""
    for name, off in _OFF.items():
        if config is None and name not in extra:
            continue
        value = extra[name] if name in extra else getattr(config, name, None)
        if value is None or any(value == o for o in off if o is not None):
            continue
        source = "given" if name in extra else "set in model.generation_config"
        raise Unsupported(f"{name}={value!r} ({source}) changes generate()'s output and gdtool does not implement "
                         f"it; pass {name}={off[-1]!r} to turn it off, or use model.generate() for this setting")


def _check_values(s: Settings, vocab: int) -> None:
    if s.do_sample:
        if s.temperature is not None and not (s.temperature > 0 and math.isfinite(s.temperature)):
            raise ValueError(f"temperature={s.temperature} must be > 0 when sampling; use do_sample=False "
                             "for greedy decoding")
        if s.top_k is not None and (not isinstance(s.top_k, int) or s.top_k < 0):
            raise ValueError(f"top_k={s.top_k!r} must be an int >= 0; use top_k=0 or None to turn top-k off")
        if s.top_p is not None and not (0 < s.top_p <= 1):
            raise ValueError(f"top_p={s.top_p} is outside (0, 1]; use top_p=1.0 to turn nucleus sampling off")
    if s.repetition_penalty is not None and not (s.repetition_penalty > 0 and math.isfinite(s.repetition_penalty)):
        raise ValueError(f"repetition_penalty={s.repetition_penalty} must be > 0; use 1.0 to turn it off")
    for e in s.eos_token_id:
        if not 0 <= e < vocab:
            raise ValueError(f"eos_token_id {e} is outside the vocabulary [0, {vocab}); pass ids the model can emit, "
                             "or eos_token_id=None to run to max_new_tokens")
    if s.pad_token_id is not None and not 0 <= s.pad_token_id < vocab:
        raise ValueError(f"pad_token_id {s.pad_token_id} is outside the vocabulary [0, {vocab}); "
                         "pass an id inside it")
