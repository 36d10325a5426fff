"""Tiny random models from the config class of every causal-LM architecture transformers ships.

`architectures()` lists the model types of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`; `build(type)` makes
a model of that type from its default config with every size field shrunk (2-4 layers, hidden 64,
vocabulary 512, 4 experts, one layer of each layer kind), in eval mode. `variants(type)` adds
sliding-window versions (a window filled by the prompt, one filled while decoding) where the
config has a window.
"""
from __future__ import annotations

import copy
import random
import re
import warnings
from dataclasses import dataclass

import torch

VOCAB = 512
# (pattern over a config field name, small value); the first match wins
SMALL = [
    (r"vocab_size", VOCAB),
    (r"hidden_size|n_embd|d_model|embedding_dim|n_embed|embed_dim|attention_hidden_size", 64),
    # the widths where a tower meets the text model (they must equal its hidden size) and projections
    (r"out_hidden_size|text_hidden_size|backbone_hidden_size|adapter_(in|out)_dim|adapter_input_size|codebook_dim|vision_output_dim|projector_(input|output)_dim|"
     r"projection_dim|projector_hidden_size|projection_hidden_dim|image_token_embed_dim|output_channels|downsample_channels|"
     r"latent_channels", 64),
    (r"base_channels", 32), (r"num_res_blocks", 1),  # image tokenizers (VQ-GAN): group norms over 32 channels
    (r"intermediate_size|ffn_hidden_size|n_inner|dim_ff|ffn_dim|decoder_ffn_dim|encoder_ffn_dim|d_ff|inner_size|"
     r"intermediate_size_mlp|projection_intermediate_size|mlp_dim", 128),
    (r"moe_intermediate_size|expert_ffn_hidden_size|shared_expert_intermediate_size|moe_ffn_hidden_size|"
     r"expert_intermediate_size", 32),
    (r"num_hidden_layers|n_layer|n_layers|num_layers|decoder_layers|num_blocks", 2),
    (r"num_attention_heads|n_head|n_heads|decoder_attention_heads|encoder_attention_heads|num_heads", 4),
    (r"num_key_value_heads|n_kv_heads|num_kv_heads|multi_query_group_num", 2),
    (r"head_dim|dim_head|attention_head_dim", 16),
    (r"kv_lora_rank", 16), (r"q_lora_rank", 32), (r"qk_rope_head_dim", 8), (r"qk_nope_head_dim", 8),
    (r"v_head_dim", 16), (r"qk_head_dim", 16), (r"rotary_dim", 8),
    (r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts", 4),
    (r"num_experts_per_tok|moe_topk|moe_k|num_experts_per_token", 2),
    (r"n_shared_experts|num_shared_experts", 1),
    (r"n_group|num_expert_group", 2), (r"topk_group", 1),  # grouped routing over the 4 experts
    (r"max_position_embeddings|n_positions|n_ctx|max_seq_len|seq_length", 256),
    # mixture-of-experts layers from the first or second layer on, so a 2-layer model has one
    (r"first_k_dense_replace|num_dense_layers|moe_layer_start_index", 1),
]
IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def image_text_architectures() -> list[str]:
    """Image-text-to-text model types whose class (what generate() decodes a text prompt with) is not the
    causal-LM class of the same type: Gemma 3, Qwen3-VL, Mistral 3, LLaVA... loaded as users load them.

    A type whose config the auto class does not take is left out: no one loads it as image-text-to-text.
    That is Evolla, a protein-text model the mapping lists, whose config class is registered under a second
    type (`EvollaModel`) with no image-text class, so `AutoModelForImageTextToText` refuses its config."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(t for t, cls in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()
                  if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t) != cls
                  and CONFIG_MAPPING[t] in AutoModelForImageTextToText._model_mapping)


def _small_value(key: str, value):
    """`value` made small if `key` names a size (an int, or a list of them: one per stage of a tower)."""
    for pattern, small in SMALL:
        if re.fullmatch(pattern, key):
            return min(value, small) if value > 0 else value
    return None


def _small(d: dict) -> dict:
    out = {}
    for key, value in d.items():
        if not isinstance(key, str):  # a table keyed by numbers (patches -> queries), not a size field
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            small = _small_value(key, value)
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            small = [_small_value(key, v) for v in value]
            small = None if None in small else small
        else:
            continue
        if small is not None:
            out[key] = small
    for key in IDS:
        value = d.get(key)
        if isinstance(value, int) and value >= VOCAB:
            out[key] = {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB for v in value):
            out[key] = [2]
    return out


def shrink(d: dict) -> dict:
    """Small values for the size fields of a config dict; per-layer lists keep one layer of each kind."""
    kw = _small(d)
    count = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    per_layer = {k: v for k, v in d.items()
                 if isinstance(v, list) and v and count is not None and len(v) == count}
    kinds = {k: list(dict.fromkeys(map(str, v))) for k, v in per_layer.items() if all(isinstance(x, str) for x in v)}
    layers = max([2] + [len(v) for v in kinds.values()])
    for key in LAYER_COUNTS:
        if key in d:
            kw[key] = layers
    for key, value in per_layer.items():
        if key in kinds:
            kw[key] = [kinds[key][i % len(kinds[key])] for i in range(layers)]
        else:
            kw[key] = [value[i % len(value)] for i in range(layers)]
    if "qk_rope_head_dim" in d and "head_dim" in d:  # multi-head latent attention: RoPE runs over head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "kv_lora_rank" in d and "num_key_value_heads" in d:  # latent attention: a key/value head per query head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if isinstance(d.get("moe_layers"), list):
        kw["moe_layers"] = list(range(1, layers))
    for key, value in d.items():  # nested configs (a tower's own encoder) and per-layer dicts: small too
        if isinstance(value, dict) and value and all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items()):
            # per-layer settings keyed by layer index: the first layer's settings on the last layer, so the
            # layers keep one of each kind (layer 0 default, layer 1 the other)
            first = next(iter(value))
            index = str(layers - 1).zfill(len(str(first))) if isinstance(first, str) else layers - 1
            kw[key] = {index: dict(value[first], **shrink(value[first]))}
        elif isinstance(value, dict) and key not in kw:
            inner = shrink(value)
            if inner:  # a config by its model type (some outer configs pick its class by it), or a plain dict
                kw[key] = dict(inner, model_type=value["model_type"]) if "model_type" in value else dict(value, **inner)
    return kw


# Qwen4-Exp's sparse-attention indexer (default: no indexer fields) and linear-attention heads, at tiny size
QWEN4_EXP = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 hc_lowrank=8, ple_embed_dim=64)
INKLING2 = dict(unpadded_vocab_size=VOCAB, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16)
MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # one SSM / linear layer, one attention layer
NEMOTRON_H_MAMBA = dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)  # heads x head = 2 x hidden
# per-layer widths and key/value sharing sized for 2 layers (the default shares the last 15 of 35)
GEMMA3N_TEXT = dict(intermediate_size=[128, 128], num_kv_shared_layers=0, hidden_size_per_layer_input=16, laurel_rank=8,
                    activation_sparsity_pattern=[0.0, 0.0], vocab_size_per_layer_input=VOCAB)
# model type -> config fields set after `shrink`, where the shrunk default does not build, or builds a model
# generate() cannot decode, or leaves a hybrid without its attention layer (text config of a nested config)
KNOBS = {
    # attention every 2nd layer from layer 1 (the default period of 8 leaves 2 layers all Mamba); no CUDA kernels
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    "bamba": dict(attn_layer_indices=[1], **MAMBA2),  # its default has no attention layer
    "granitemoehybrid": dict(HYBRID, **MAMBA2),        # its default is all Mamba
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], head_dim=16, lru_width=64),
    # a convolution layer and an attention layer (LFM2's default is attention in every layer)
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16),  # heads x head = expand x hidden
    # Nemotron-H's Mamba-2 layer at its default width is 128 heads x 64, state 128, chunks of 128 (8192 channels
    # beside a hidden size of 64): without mamba_ssm, 5.17's reference chunked scan took 15 s of each 24 s
    # generate() on a CPU (3 minutes for the architecture); at this width 1 s
    "nemotron_h": NEMOTRON_H_MAMBA, "nemotron_h_omni": NEMOTRON_H_MAMBA,
    # Zamba's shared transformer block is tied across its hybrid layers: two of them, after a Mamba layer
    # (the hybrid layer reads [hidden, embeddings] concatenated: attention width 2 x hidden)
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=128, mamba_dt_rank=8, use_mamba_kernels=False),
    # the shared block reads [hidden, embeddings] concatenated: attention width 2 x hidden
    "zamba2": dict(attention_hidden_size=128, n_mamba_heads=8, mamba_headdim=16, mamba_d_state=16, chunk_size=16,
                   kv_channels=16, num_query_groups=2, hybrid_layer_ids=[1], use_mamba_kernels=False),
    "deepseek_v2": dict(num_experts_per_tok=2),  # the default (None) routes to no expert
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),  # defaults are None
    "glm4_moe_lite": dict(num_key_value_heads=4),  # multi-head latent attention: a key/value head per query head
    "nemotron": dict(num_key_value_heads=2),  # the default (None) breaks the attention's head groups
    "hunyuan_v1_dense": dict(head_dim=16), "hunyuan_v1_moe": dict(head_dim=16),  # default head_dim None
    "ministral": dict(head_dim=16),
    "mistral4": dict(head_dim=16),  # latent attention with partial RoPE: half of head_dim is qk_rope_head_dim
    # nested attention / FFN configs the shrinker does not enter; the attention config lacks rope_theta
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=128)),
    # RoPE per layer type (the default has none), its multimodal sections summing to head_dim / 2
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                        mrope_section=[3, 3, 2])}),
    "gemma3n_text": GEMMA3N_TEXT,
    "gemma3n": GEMMA3N_TEXT,  # its text config (the causal-LM class of a `gemma3n` config is the image-text model)
    "qwen4_exp_text": QWEN4_EXP,
    "qwen4_exp": QWEN4_EXP,
    "gemma4_assistant": dict(num_kv_shared_layers=2), "gemma4_unified_assistant": dict(num_kv_shared_layers=2),
    # size fields under names the shrinker does not know
    "inkling2_text": INKLING2, "inkling2_loop_text": INKLING2, "inkling2": INKLING2, "inkling2_loop": INKLING2,
    "roc_bert": dict(shape_vocab_size=64, pronunciation_vocab_size=64, shape_embed_dim=16, pronunciation_embed_dim=16,
                     is_decoder=True),
    "xlm": dict(emb_dim=64),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB),
    # its causal-LM class refuses a config that is not a decoder; axial position factors summing to hidden
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32]),
    # multimodal RoPE sections (time, height, width) summing to head_dim / 2
    "qwen2_vl": MROPE, "qwen2_5_vl": MROPE, "paddleocr_vl": MROPE, "qwen2_5_omni_thinker": MROPE,
    "hunyuan_vl": dict(MROPE, head_dim=16), "cosmos3_edge": dict(MROPE, head_dim=16),
    "hy_v4_vl": dict(rope_parameters=dict(MROPE["rope_parameters"], mrope_section=[2, 1, 1])),  # qk_rope_head_dim 8
    # sliding-window layers whose head width is the latent attention's (no-RoPE + RoPE parts)
    "dots3_note_text": dict(head_dim=16), "dots3_note": dict(head_dim=16),
    "diffusion_gemma": dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32),  # defaults are None
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
    "gemma4": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
    # RoPE per layer type, as for its text model above
    "cohere_compass": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0,
                                                                   mrope_section=[3, 3, 2])}),
    "ernie4_5_vl_moe": dict(rope_parameters=dict(MROPE["rope_parameters"], mrope_section=[3, 3, 2])),
    # one input, one recurrent and one output layer (its default derives 36 layers from the 72-entry list)
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # the defaults (None) name no layer's MLP and route to no expert
    "deepseek_ocr2": dict(mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2),
    # multimodal RoPE sections summing to the rotary width / 2 (partial rotary: 8 of the 16 head dims)
    "glm4v": MROPE, "glm46v": MROPE, "glmga": MROPE, "glm_ocr": MROPE, "glm5_next": MROPE,
    "glm4v_moe": dict(rope_parameters=dict(MROPE["rope_parameters"], mrope_section=[1, 1, 2])),
    # its indexer's heads must fit in one key head's query group (the default: 12 of 48 / 4); a budget of 2 + 2 local
    # + 1 sink keys and a pool of 2 blocks of 2, below the prompt's length, so that the sparse selection runs
    "kolibri1_1": dict(index_num_heads=1, index_topk=2, index_num_local_tokens=2, index_num_sink_tokens=1,
                       index_pool_size=4, index_compression=2),
}
MEDIA_ID = 2  # the id of an image or vision-start token: one a prompt never holds (it draws ids from 3 up)
# Gemma 4's drafting assistants: a text config without per-layer inputs, MoE or double-wide MLPs, whose layers
# all share the key/value cache (5.17 has no default text config; later releases one that fails validation)
ASSISTANT = dict(text_config=dict(model_type="gemma4_text", hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                  enable_moe_block=False, use_double_wide_mlp=False),
                 num_centroids=16, centroid_intermediate_top_k=4)
# model type -> fields of the outer config of a nested one (KNOBS go to its text config), given to its default too
# a timm tower at tiny size (the classes' defaults are FastViT-MCI3 / ResNet-50; Perception LM's projector reads the
# tower's `model_args["embed_dim"]`): a one-block ViT, built by timm where it is installed
TIMM_TINY_VIT = dict(model_type="timm_wrapper", architecture="vit_tiny_patch16_224", hidden_size=16,
                     model_args=dict(embed_dim=16, depth=1, num_heads=2, img_size=32))
OUTER_KNOBS = {
    "fast_vlm": dict(vision_config=TIMM_TINY_VIT), "perception_lm": dict(vision_config=TIMM_TINY_VIT),
    "gemma3n": dict(vision_config=dict(TIMM_TINY_VIT, model_type="gemma3n_vision")),  # MobileNet-V5 by default
    "gemma4_assistant": ASSISTANT, "gemma4_unified_assistant": ASSISTANT,
    # the image-token table (the default is None)
    "chameleon": dict(vocabulary_map={"<image>": MEDIA_ID}), "emu3": dict(vocabulary_map={"<image>": MEDIA_ID}),
    # the thinkers' position code reads a vision-start id their configs do not have (their talkers' do)
    "qwen2_5_omni_thinker": dict(vision_start_token_id=MEDIA_ID),
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=MEDIA_ID),
    "diffusion_gemma": dict(vision_config=dict(model_type="gemma4_vision")),  # 5.17's default has none
    # 5.17's default has neither (later releases: ViT and GPT-2)
    "vision-encoder-decoder": dict(encoder=dict(model_type="vit"), decoder=dict(model_type="bert"),
                                   decoder_start_token_id=1),
    # 5.17's defaults have no text or audio encoder; the causal-LM class is the decoder alone
    "musicgen": dict(text_encoder=dict(model_type="t5"), audio_encoder=dict(model_type="encodec"),
                     decoder=dict(model_type="musicgen_decoder")),
    "musicgen_melody": dict(text_encoder=dict(model_type="t5"), audio_encoder=dict(model_type="encodec"),
                            decoder=dict(model_type="musicgen_melody_decoder")),
    # codebooks of 64 image and 64 audio codes at the end of the small vocabulary (their ranges must fit in it,
    # the audio range right after the image range); text alone uses neither
    "apertus1p5": dict(vision_config=dict(model_type="apertus1p5_vision_tokenizer", codebook_size=64),
                       audio_config=dict(model_type="wavtokenizer_encoder", codebook_size=64),
                       image_token_offset=VOCAB - 128, audio_token_offset=VOCAB - 64,
                       image_token_id=MEDIA_ID, audio_token_id=MEDIA_ID),
    # its vision tower reads features from two of its layers (the defaults: 24 and 18 of 27)
    "molmo2": dict(adapter_config=dict(model_type="molmo2_adapter", vision_feature_layer=[-1, -2])),
    # the tower's copy of the video patch size, which its default gets only when the config builds the tower
    "nemotron_h_omni": dict(vision_config=dict(model_type="radio", video_temporal_patch_size=2)),
    "udop": dict(decoder_start_token_id=1),  # encoder-decoders: the default has no decoder start
    # 5.17's default text config is Llama's, whose fields Granite's layers do not find (later: Granite's); a
    # vision layer -> text layer map and a Q-Former window (the defaults are None)
    "granite4_vision": dict(text_config=dict(model_type="granite"), deepstack_layer_map=[[1, 1]],
                            downsample_rate="1/2"),
}


def tiny_config(model_type: str, **overrides):
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    overrides = dict(KNOBS.get(model_type, {}), **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outer = copy.deepcopy(OUTER_KNOBS.get(model_type, {}))  # some configs pop fields of the dicts given
        d = cls(**copy.deepcopy(outer)).to_dict()
        kw = shrink(d)
        nested = [k for k in ("text_config", "decoder") if isinstance(d.get(k), dict)]
        for sub in nested:
            given = outer.get(sub, {})  # what the default was given, kept
            kw[sub] = {**given, **shrink(d[sub]), "model_type": d[sub].get("model_type"), **overrides}
        if not nested:
            kw.update(overrides)
        # a sub-config among them was given to the default above, and shrunk from there
        kw.update({k: v for k, v in outer.items()
                   if not (isinstance(v, dict) and "model_type" in v)})
        # the fields it was given that the shrinker leaves alone (a codebook size) kept, as for the text config
        kw.update({k: {**v, **kw.get(k, {})} for k, v in outer.items()
                   if isinstance(v, dict) and "model_type" in v and k not in nested})
        return cls(**kw)


MAX_PARAMS = 12_000_000  # image-text models keep a small vision tower beside the text model


class NotTiny(Exception):
    """The shrunk config still has fields this builder does not know: too big for the zoo."""


def build(model_type: str, seed: int = 0, dtype=torch.float32, device=None, image_text: bool = False, **overrides):
    """The tiny model of `model_type`: its causal-LM class, or with `image_text` its image-text-to-text class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    config = tiny_config(model_type, **overrides)
    make = auto.from_config
    model_class = auto._model_mapping[type(config)] if type(config) in auto._model_mapping else None
    if model_class is not None and not isinstance(config, model_class.config_class) and hasattr(config, "decoder"):
        # the causal-LM class of a composite model (MusicGen) is its decoder, built from the decoder's config
        config, make = config.decoder, model_class._from_config
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = sum(p.numel() for p in make(config).parameters())
    if params > MAX_PARAMS:
        raise NotTiny(f"{params / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make(config, dtype=dtype)
    return model.to(device).eval() if device is not None else model.eval()


def window_overrides(model_type: str, window: int) -> dict | None:
    """Config fields that give `model_type` sliding-window layers of `window` tokens, or None."""
    from transformers import CONFIG_MAPPING
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = CONFIG_MAPPING[model_type]().to_dict()
    d = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    if "sliding_window" not in d:
        return None
    out = {"sliding_window": window}
    if "use_sliding_window" in d:
        out["use_sliding_window"] = True
    if "max_window_layers" in d:
        out["max_window_layers"] = 1  # layer 0 full attention, the rest sliding
    return out


def variants(model_type: str, windows=(4, 10)) -> list[tuple[str, dict]]:
    """(name, config overrides): the architecture as it ships, and with each sliding window."""
    out = [(model_type, {})]
    for window in windows:
        overrides = window_overrides(model_type, window)
        if overrides is not None:
            out.append((f"{model_type}@window{window}", overrides))
    return out


# -- one architecture, every mode, against generate() ------------------------------------------------

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1)
# (case, settings, [(mode, eos_poll_interval)])
CASES = [
    ("greedy", dict(do_sample=False),
     [("eager", 1), ("forward-graph", 1), ("step-graph", 1), ("step-graph", 3), ("step-graph", "async"),
      ("step-graph", 0), ("device-loop", None)]),
    ("sampling", SAMPLING, [("eager", 1), ("forward-graph", 1), ("step-graph", 4), ("device-loop", None)]),
]
# the architectures the knob table or the image-text list brought in run these on a CPU (the zoo's CPU time
# is bounded in CI); every case and mode above runs for them under `pytest -m cuda`
SAMPLED_CASES = [
    ("greedy", dict(do_sample=False), [("forward-graph", 1), ("step-graph", 3)]),
    ("sampling", SAMPLING, [("eager", 1), ("device-loop", None)]),
]
NEW_TOKENS = 12


class GenerateFailed(Exception):
    """generate() itself cannot decode this tiny model: nothing to compare with."""


def vocabulary(model) -> int:
    """How many ids the prompt draws from: VOCAB, or fewer where the model has fewer (bytes, Reformer)."""
    try:
        embeddings = model.get_input_embeddings()
    except NotImplementedError:  # a class that does not name its embeddings (PP-FormulaNet): the text config's
        return min(VOCAB, model.config.get_text_config().vocab_size)
    return min(VOCAB, getattr(embeddings, "num_embeddings", VOCAB))


def prompt(model, device, batch: int = 3, width: int = 7, seed: int = 0, pads: tuple | None = None):
    """`batch` rows of `width` ids, left-padded by `pads` (one count per row; by default different widths, the last
    row unpadded)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocabulary(model), (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    pads = pads if pads is not None else [max(0, width - 3 - 2 * row) for row in range(batch)]
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
    return ids.to(device), mask.to(device)


@dataclass(frozen=True)
class Shape:
    """The prompt and length one zoo run decodes: the zoo test's fixed one by default, or a draw (`shapes`)."""
    batch: int = 3
    width: int = 7
    pads: tuple | None = None
    new_tokens: int = 12
    seed: int = 0


def shapes(seed: int | str, count: int) -> list[Shape]:
    """`count` seeded random shapes: 1-6 rows, prompts of 1-12 ids with left pads of any width short of the row
    (one row unpadded, so the width is the longest prompt), 2-16 new tokens. The edges are drawn more often than
    their share: one-id prompts (where RecurrentGemma's prefill took its decode branch and read stale state), one
    row, one decode step (2 new tokens)."""
    rng = random.Random(f"zoo-shapes-{seed}")
    out = []
    for _ in range(count):
        batch = 1 if rng.random() < 0.15 else rng.randint(1, 6)
        width = 1 if rng.random() < 0.15 else rng.randint(1, 12)
        pads = [rng.randint(0, width - 1) for _ in range(batch)]
        pads[rng.randrange(batch)] = 0
        new_tokens = 2 if rng.random() < 0.15 else rng.randint(2, 16)
        out.append(Shape(batch, width, tuple(pads), new_tokens, rng.randrange(1 << 16)))
    return out


def _reference(model, ids, mask, seed, new_tokens=NEW_TOKENS, **settings):
    from reference import generate
    try:
        return generate(model, ids, mask, new_tokens, seed=seed, **settings)
    except Exception as error:  # noqa: BLE001 - any failure of generate() means there is no reference
        raise GenerateFailed(f"{type(error).__name__}: {str(error)[:160]}") from error


def run_architecture(model, device, cases=None, shape: Shape = Shape()) -> dict:
    """Decode `model` in every mode and case at `shape`; {(case, mode, poll): 'pass' | 'refused: <reason>'}.
    Raises AssertionError on any mismatch with generate(), GenerateFailed when there is no reference."""
    import gdtool
    from gdtool.core.feed import Unsupported
    from gdtool.core.graphs import CaptureError
    from reference import assert_same, decode
    ids, mask = prompt(model, device, shape.batch, shape.width, shape.seed, shape.pads)
    n, seed = shape.new_tokens, shape.seed + 5
    plain, _ = _reference(model, ids, mask, 0, n, do_sample=False, eos_token_id=None, pad_token_id=0)
    # EOS: the first row's third token and the second row's seventh (or the last ones there are), so rows
    # finish at different steps
    early, late = int(plain[0, min(2, n - 1)]), int(plain[min(1, shape.batch - 1), min(6, n - 1)])
    eos = [early, late] if early != late else [early]
    # every reference before any decode: a capture that fails half way left CUDA's generator unusable in the
    # process ("Offset increment outside graph capture" at the next random draw, charged to generate());
    # gdtool puts it back now, but the references must not depend on what a failed capture left
    cases = [(case, dict(settings, eos_token_id=eos, pad_token_id=1), modes) for case, settings, modes in cases or CASES]
    references = [_reference(model, ids, mask, seed, n, **settings) for _, settings, _ in cases]
    results = {}
    for (case, settings, modes), (ref_tokens, ref_scores) in zip(cases, references):
        for mode, poll in modes:
            key = (case, mode, poll)
            try:
                out = decode(model, ids, mask, n, seed=seed, mode=mode, eos_poll_interval=poll, **settings)
            except (Unsupported, CaptureError) as refusal:
                results[key] = f"refused: {refusal}"
                continue
            try:
                assert_same(out, ref_tokens, ref_scores)
            except AssertionError as error:
                raise AssertionError(f"{case} {mode} poll={poll}: {str(error)[:300]}") from None
            results[key] = "pass"
    del gdtool
    return results


# -- one architecture as a JSON outcome, in this process or a fresh one ---------------------------------

def outcome(model_type: str, overrides: dict, device: str = "cpu", image_text: bool = False,
            sampled: bool = False, shape: dict | None = None) -> dict:
    """What the zoo test asserts on, as JSON: {"status": "ran", "results": [[case, mode, poll, result]...],
    "cache": [cache layer kinds]}, or "not built" / "generate failed" / "mismatch" with "error". `shape`: the
    fields of a `Shape` (the prompt and length), the zoo test's fixed one where None."""
    from gdtool.core import compat
    try:
        model = build(model_type, image_text=image_text, **overrides)
        vocabulary(model)
    except Exception as error:  # noqa: BLE001 - reported, and asserted on by the test
        return {"status": "not built", "error": f"{type(error).__name__}: {str(error)[:300]}"}
    model = model.to(device)
    try:
        results = run_architecture(model, device, SAMPLED_CASES if sampled else CASES, Shape(**(shape or {})))
    except GenerateFailed as error:
        return {"status": "generate failed", "error": str(error)}
    except AssertionError as error:
        return {"status": "mismatch", "error": str(error)}
    try:
        layers = compat.cache_layers(compat.static_cache(model, 16))
    except Exception:  # noqa: BLE001 - generate() built one above, so this does not happen
        layers = []
    kinds = [("linear" if compat.is_linear(layer) else "") + ("attention" if hasattr(layer, "keys") else "")
             for layer in layers]
    return {"status": "ran", "results": [[*key, result] for key, result in results.items()], "cache": kinds}


MARK = "zoo-outcome: "


def outcome_in_subprocess(timeout: float = 1200, **kwargs) -> dict:
    """`outcome(**kwargs)` in a fresh Python process: a CUDA error (a device-side assert, a poisoned
    context) ends that process only, not the architectures after it."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(here, "zoo.py"), json.dumps(kwargs)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"status": "crashed", "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def per_mode(found: dict, width: int = 110) -> dict:
    """An outcome condensed to one entry per mode: "pass", or "refused: <reason>" (the mode's first refusal,
    its reason cut to `width` characters)."""
    modes = {}
    for _, mode, _, result in found.get("results", []):
        if result != "pass" and not modes.get(mode, "").startswith("refused"):
            reason = re.sub(r"\s+", " ", result.removeprefix("refused: "))[:width]
            modes[mode] = f"refused: {reason}"
        else:
            modes.setdefault(mode, "pass")
    return modes


def keep_outcome(path: str, name: str, device: str, found: dict) -> None:
    """Append one architecture's outcome to the JSON-lines file `path` (the zoo test writes one per case where
    ZOO_OUTCOMES is set: profiles/zoo_table.py renders a GPU run's from it). Reasons are kept long enough to
    hold the model line a capture refusal names."""
    import json

    import transformers
    line = dict(name=name, device=device, status=found["status"], error=found.get("error", "")[:300],
                modes=per_mode(found, width=400), torch=torch.__version__, transformers=transformers.__version__)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    import json
    import sys
    args = json.loads(sys.argv[1])
    if args.get("device") == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    print(MARK + json.dumps(outcome(**args)), flush=True)
