"""Models to decode: named presets (random weights in real shapes) and local checkpoints.

No hub downloads: a preset is built from its config with random weights, seeded, in eval mode; a
local path loads a real checkpoint (and its tokenizer, when the folder has one).

    model = gdtool.load_model("tiny-llama", seed=0)              # CPU-sized, for tests
    model = gdtool.load_model("llama-1b", device="cuda")         # Llama-3.2-1B shapes, bf16
    model = gdtool.load_model("qwen3-8b", device="cuda")         # Qwen3-8B shapes (q/k norm), bf16
    model = gdtool.load_model("/data/ckpt/Qwen2.5-0.5B")          # a real checkpoint
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_LLAMA3_ROPE_1B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_8B = dict(_LLAMA3_ROPE_1B, factor=8.0)

PRESETS: dict[str, tuple[str, dict]] = {
    # Under 1M parameters with a 4k vocabulary: the embedding is tied so the head costs nothing.
    "tiny-llama": ("llama", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    "tiny-qwen2": ("qwen2", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 tie_word_embeddings=True, use_sliding_window=False, bos_token_id=1,
                                 eos_token_id=2)),
    "tiny-qwen3": ("qwen3", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                                 tie_word_embeddings=True, use_sliding_window=False, bos_token_id=1, eos_token_id=2)),
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE_1B, tie_word_embeddings=True, bos_token_id=128000,
                               eos_token_id=128001)),
    "llama-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE_8B, tie_word_embeddings=False, bos_token_id=128000,
                               eos_token_id=128001)),
    # Qwen3-8B: Llama's layer with a per-head RMSNorm of q and k before RoPE
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
                               eos_token_id=151645)),
    # Mixture of experts and sliding-window layers, CPU-sized
    "tiny-qwen3-moe": ("qwen3_moe", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                                         eos_token_id=2)),
    "tiny-gemma3": ("gemma3_text", dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"],
                                        max_position_embeddings=2048, query_pre_attn_scalar=16, bos_token_id=1,
                                        eos_token_id=2, pad_token_id=0)),
    "tiny-gpt-oss": ("gpt_oss", dict(vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"],
                                     max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Real shapes: Qwen3-30B-A3B (128 experts, 8 active), gpt-oss-20b (32 experts, 4 active; sliding-window
    # layers of 128 tokens alternating with full attention), Gemma-3-1B (5 sliding layers of 512 tokens per full one)
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                        rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
                                        eos_token_id=151645)),
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"] * 12,
                                    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=199998,
                                    eos_token_id=200002, pad_token_id=199999)),
    "gemma-3-1b": ("gemma3_text", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                       head_dim=256, sliding_window=512, max_position_embeddings=32768,
                                       query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                                   use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)),
}


def check_local(name: str) -> bool:
    """Whether `name` is a local checkpoint folder (True) or not a path at all (False: a preset name, or
    something unknown); a path that is missing, a file, or a folder without config.json raises ValueError
    naming it."""
    path = os.path.expanduser(name)
    checkpoint = os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
    if checkpoint or (os.path.isdir(path) and name not in PRESETS):  # a checkpoint wins over a preset's name
        if not checkpoint:
            raise ValueError(f"model folder {name} has no config.json: not a checkpoint folder; pass the folder "
                             "that holds config.json and the weights (as save_pretrained writes it)")
        return True
    if name in PRESETS:
        return False
    if os.path.exists(path):
        raise ValueError(f"model {name} is a file, not a checkpoint folder; pass the folder that holds it")
    if os.path.isabs(path) or name.startswith((".", "~")) or name.endswith(os.sep):
        shown = "" if os.path.abspath(path) == name else f" ({os.path.abspath(path)})"
        raise ValueError(f"model folder {name} does not exist{shown}; check the path, or "
                         f"use a preset ({', '.join(PRESETS)})")
    if "/" in name:
        raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a local checkpoint folder (no "
                         f"folder {os.path.abspath(path)}); hub names are not downloaded: download it first and pass "
                         "its folder")
    return False


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def preset_config(name: str):
    """The transformers config of a preset (sdpa attention where the model has it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; use one of {sorted(PRESETS)} or a local checkpoint path")
    family, fields = PRESETS[name]
    from transformers import CONFIG_MAPPING
    config_cls = CONFIG_MAPPING[family]
    fields = dict(fields)
    rope_scaling = fields.pop("rope_scaling", None)
    rope_theta = fields.pop("rope_theta", None)
    config = config_cls(**fields)
    _set_rope(config, rope_theta, rope_scaling)
    config._attn_implementation = default_attention(config)
    return config


def model_class(config):
    """The auto class generate() decodes a checkpoint of `config` with: its causal-LM class, or for an
    image-text-to-text checkpoint (Gemma 3 4B+, Qwen3-VL, Mistral 3, LLaVA...) the whole image-text model,
    which generate() decodes from a text prompt alone (no pixels: the vision tower never runs)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def default_attention(config) -> str:
    """sdpa where the architecture has it (gpt-oss, with its attention sinks, has not: eager)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None) or \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    return "sdpa" if model_cls is None or getattr(model_cls, "_supports_sdpa", True) else "eager"


def _set_rope(config, rope_theta, rope_scaling) -> None:
    # transformers 5.x keeps RoPE settings in `rope_parameters`; older releases in rope_theta/rope_scaling.
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if rope_theta is not None:
            params["rope_theta"] = rope_theta
        if rope_scaling is not None:
            params.update(rope_scaling)
        config.rope_parameters = params
    else:
        if rope_theta is not None:
            config.rope_theta = rope_theta
        if rope_scaling is not None:
            config.rope_scaling = rope_scaling


def load_model(name_or_path: str, seed: int = 0, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, attn_implementation: str | None = None):
    """A preset with random weights (seeded) or a local checkpoint, in eval mode on `device`.

    dtype defaults to bf16 on CUDA and fp32 on CPU; attention to sdpa where the architecture has it,
    else eager. A local checkpoint's tokenizer, if its folder has one, is attached as
    ``model.gdtool_tokenizer``.
    """
    from transformers import AutoModelForCausalLM
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}.get(dtype)
        if dtype is None:
            raise ValueError("dtype must be one of bf16, fp16, fp32")
    dtype = dtype or default_dtype(device)
    if check_local(str(name_or_path)):
        name_or_path = os.path.expanduser(name_or_path)
        try:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(name_or_path)
            if attn_implementation is None:
                attn_implementation = default_attention(config)
            model = model_class(config).from_pretrained(name_or_path, dtype=dtype,
                                                        attn_implementation=attn_implementation)
        except (OSError, ValueError) as err:  # no weights, a config that is not JSON: transformers' own words
            reason = " ".join(str(err).split())
            raise ValueError(f"model folder {name_or_path} holds no checkpoint transformers can load: "
                             f"{reason}") from None
        model = model.to(device)
        model.gdtool_tokenizer = _maybe_tokenizer(name_or_path)
    else:
        if name_or_path not in PRESETS:
            raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a local "
                             "checkpoint folder; hub downloads are not supported: download it first and pass its path")
        config = preset_config(name_or_path)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.gdtool_tokenizer = None
    model.gdtool_name = os.path.basename(os.path.normpath(name_or_path))
    return model.eval()


def _maybe_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # a checkpoint without tokenizer files decodes token ids only
        return None
    return tokenizer if len(tokenizer) > 0 else None  # an empty vocabulary would decode every token to ""


@dataclass
class Prompt:
    input_ids: torch.Tensor       # [batch, width], left-padded
    attention_mask: torch.Tensor  # [batch, width], 1 for real tokens


def random_prompts(model, batch: int, lengths: tuple[int, int] | int = (5, 12), seed: int = 0,
                   pad_token_id: int | None = None) -> Prompt:
    """Left-padded prompts of random tokens, row lengths drawn uniformly from `lengths` (inclusive)."""
    lo, hi = (lengths, lengths) if isinstance(lengths, int) else lengths
    if batch < 1 or lo < 1 or hi < lo:
        raise ValueError(f"need batch >= 1 and 1 <= lengths[0] <= lengths[1]; got batch={batch}, lengths={lengths}")
    vocab = model.config.get_text_config().vocab_size
    if pad_token_id is None:
        pad_token_id = _pad_id(model)
    gen = torch.Generator().manual_seed(seed)
    row_lengths = torch.randint(lo, hi + 1, (batch,), generator=gen)
    # Ids from 3 up keep clear of the usual special ids (0-2) so a random prompt holds no EOS.
    ids = torch.randint(3, vocab, (batch, hi), generator=gen)
    positions = torch.arange(hi)
    mask = (positions[None, :] >= hi - row_lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_token_id))
    device = next(model.parameters()).device
    return Prompt(ids.to(device), mask.to(device))


def eos_ids(model) -> list[int]:
    """The model's EOS ids (generation config, then config), [2] where it names none: what the benches and sweeps
    end a sequence on where they force lengths."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
    return [2]


def _pad_id(model) -> int:
    config = model.generation_config
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else 0
