"""The model zoo: every causal-LM architecture of the installed transformers, and every image-text-to-text
architecture fed text alone, as a tiny random model, in every mode and polling setting, greedy and
sampling with EOS firing at different steps in left-padded rows, against generate(static) bit for bit
(tokens and processed scores). Each architecture ends as a pass or as a refusal whose reason is listed
in REFUSED; a mismatch, a crash or an unlisted refusal fails; the only skips are the architectures
generate() itself cannot decode (GENERATE_FAILS, its error asserted) or this builder cannot build
(NOT_BUILT, the error asserted). Sliding-window variants use a window filled by the prompt (4) and one
filled while decoding (10). The architectures the knob table and the image-text list brought in run
`zoo.SAMPLED_CASES` on a CPU.

`pytest -m cuda` runs every case again with real capture, each architecture in a fresh process (a CUDA
error poisons its process's context; it must not fail the architectures after it). ZOO_SUBPROCESS=1
takes that path on a CPU too.
"""
import dataclasses
import os
import random
import re

import transformers

import pytest

import zoo

# model type -> what its refusal must say (every mode refuses it)
REFUSED = {
    "mpt": "use_cache=False",
    "openai-gpt": "takes no cache",
    "rwkv": "cache of its own", "xlnet": "cache of its own", "minimax": "cache of its own",
    "xlstm": "cache of its own", "reformer": "cache of its own",
    "bart": "forced_eos_token_id", "mbart": "forced_eos_token_id", "marian": "forced_eos_token_id",
    "pegasus": "forced_eos_token_id", "plbart": "forced_eos_token_id", "blenderbot-small": "forced_eos_token_id",
    "blenderbot": "encoder_no_repeat_ngram_size", "whisper": "begin_suppress_tokens",
    "florence2": "forced_eos_token_id", "t5gemma2": "is an encoder-decoder model",
    "diffusion_gemma": "not a GenerationMixin",  # block diffusion: its own generate(), no token-by-token scores
}
# model type -> what a refusal of the graph modes only must say (eager decodes it)
GRAPH_REFUSED = {
    "llama4": "chunked-attention", "llama4_text": "chunked-attention",
    "qwen4_exp": "grows by one at every step", "qwen4_exp_text": "grows by one at every step",
    "unlimited_ocr": "do not know the cache layer UnlimitedOcrStaticReferenceSlidingWindowLayer",
}
# model type -> what generate() itself raises on the tiny model: the only architectures skipped
GENERATE_FAILS = {
    "deepseek_v4": "heavily_compressed_attention",  # StaticCache has no layer for its compressed attention
    # draft models: their layers read the target model's cache (5.17: its shared key/value states)
    "gemma4_assistant": "get_seq_length|shared_kv_states", "gemma4_unified_assistant": "get_seq_length|shared_kv_states",
    "blt": "no attribute 'num_hidden_layers'",       # StaticCache reads a field its nested config does not have
    # MusicGen's own generate() sizes the static cache from generation-config fields it leaves None; the melody
    # decoder reads its prompt as (batch x codebooks) rows, which 3 text rows are not
    "musicgen": "'>' not supported", "musicgen_melody": "is invalid for input of size",
    # prepends its prompt tokens, past the static cache's end (on CUDA: a device-side assert, in its own process)
    "cpmant": "index_copy_|device-side assert",
    "prophetnet": "must match the size",             # its decoder's mask does not take a static cache
    "xlm": "expanded size",                          # its attention mask is not sized for a static cache
    "xmod": "language unknown",                      # needs a default language set on the model
    "xlstm": "matC_old has wrong shape",             # its own cache, which generate() sizes wrong for 3 rows
}
# generate() fails on these on a CPU only (5.17's tiny Falcon-H1 asks for 24 GiB there; on the H200 it decodes)
CPU_ONLY_GENERATE_FAILS = {"falcon_h1"}
# state-space models with no attention at all; every other model with linear-attention / state-space layers
# is a hybrid, and the zoo must build it with an attention layer beside them
SSM_ONLY = {"mamba", "falcon_mamba", "mamba2"}
# the same, where transformers' code reads the host inside the forward only on a GPU: 5.17's AriaExperts
# counts tokens per expert with `.cpu()` (later releases dispatch it through the experts implementations)
# (H200, torch 2.11, transformers 5.17, at b1a9ab4: each of these refused there with this cause)
GRAPH_REFUSED_ON_CUDA = {"aria_text": "reads a device value on the host|copies a CPU tensor|Cannot copy between CPU and CUDA",
                         "aria": "reads a device value on the host|copies a CPU tensor|Cannot copy between CPU and CUDA",
                         # a CPU tensor copied inside the step that HostConstants does not catch (source not found)
                         "falcon": "copies a CPU tensor|Cannot copy between CPU and CUDA",
                         "kosmos-2.5": r"is_nonzero reads a device value on the host, at modeling_kosmos2_5\.py",
                         "step3p7": "finds which tokens each expert gets on the host",
                         # experts blocks of their own that route on the host (`nonzero`, `expert_size.tolist()`)
                         "longcat_flash": "finds which tokens each expert gets on the host",
                         "jetmoe": "finds which tokens each expert gets on the host",
                         "dbrx": "finds which tokens each expert gets on the host",
                         # its sparse-attention indexer keeps the pooled keys a device mask selects (`pool_keys[:,
                         # keep]`): a shape known only on the device
                         "glm5_next": r"boolean mask on the device, .* at modeling_glm5_next\.py"}


# model type -> what building its tiny model raises (asserted, then skipped): what this builder cannot make yet
# (the config classes' own defaults fail validation or miss fields; an optional package is missing; or the
# shrinker leaves sizes it does not know). Each is a knob to find, not a decoding problem.
TIMM = r"^ImportError: .*\btimm\b"
NOT_BUILT = {
    # the causal-LM class of a `gemma3n` config is the whole image-text model, whose vision tower is timm's
    # (its text model alone is `gemma3n_text`); where timm is installed it builds (a tiny ViT) and decodes
    "gemma3n": TIMM,
}
IMAGE_TEXT_NOT_BUILT = {
    # optional packages, needed where the class builds its vision tower: timm's models (tiny ViTs in place of
    # FastViT and the Perception Encoder: zoo.TIMM_TINY_VIT), and Inkling's tower plans its output scales with
    # scipy's linear_sum_assignment (scipy is in the dev extras); where installed, they build and must decode
    "fast_vlm": TIMM, "perception_lm": TIMM, "inkling_mm_model": r"^ModuleNotFoundError: No module named 'scipy'",
}
RELEASE = tuple(int(x) for x in transformers.__version__.split(".")[:2])  # (major, minor) of the installed one
OLDEST = RELEASE < (5, 18)
if OLDEST:  # what 5.17 refuses or cannot decode and later releases can
    # 5.17's XLM names its cache `cache`, a name 5.17's generate() does not hand one by: generate() recomputes
    # the sequence at every step (later releases hand it `cache`, and generate() itself fails)
    del GENERATE_FAILS["xlm"]
    REFUSED["xlm"] = "takes no cache under a name generate"
    GENERATE_FAILS.update({"llama4": "block_sequence_ids", "llama4_text": "block_sequence_ids",  # 5.17's chunked mask
                           "git": "same number of dimensions",
                           # 5.17 sizes something of the tiny Falcon-H1 at 24 GiB: a knob to find, not generate()
                           "falcon_h1": "can't allocate memory"})
# image-text type -> what generate() raises on a text-only prompt: the model needs pixels, or is an encoder-decoder
IMAGE_TEXT_GENERATE_FAILS = {
    # generate() hands the prompt to the vision tower as its main input (`pixel_values.shape` unpacked)
    "blip": "not enough values to unpack", "blip-2": "not enough values to unpack",
    "instructblip": "not enough values to unpack", "instructblipvideo": "not enough values to unpack",
    "kosmos-2": "not enough values to unpack", "pix2struct": "too many indices",
    "idefics": "pixel_values", "udop": "Bbox is required", "vision-encoder-decoder": "not enough values to unpack",
    "pp_formulanet": "not enough values to unpack",
    "llama4": "image_outputs|block_sequence_ids",  # its output lacks a field generate() reads (5.17: chunked mask)
    "pi0": "has no attribute 'generate'", "pi05": "has no attribute 'generate'",  # action models: no generate()
}
if RELEASE >= (5, 25):
    # 5.25's Llama 4 image-text output has the field generate() reads: it decodes text alone (eager; the graph
    # modes refuse its chunked attention, as for its causal-LM class)
    del IMAGE_TEXT_GENERATE_FAILS["llama4"]


# types the sub-config shrinking brought in (not in KNOBS): sampled on a CPU like the knob table's
NEWLY_BUILT = {"gemma3", "gemma4", "gemma4_text", "git", "got_ocr2", "moss_transcribe_diarize", "phi4_multimodal"}


def _cases():
    out = []
    for model_type in zoo.architectures():
        try:
            out += [(name, model_type, overrides, False) for name, overrides in zoo.variants(model_type)]
        except Exception:  # noqa: BLE001 - a config class that cannot be built with defaults
            out.append((model_type, model_type, {}, False))
    causal = set(zoo.architectures())
    # a type in both lists runs as a causal LM above, and as its image-text class here
    out += [(f"{t}:image-text" if t in causal else t, t, {}, True) for t in zoo.image_text_architectures()]
    return out


CASES = _cases()
IDS = [c[0] for c in CASES]



def _check(name, model_type, overrides, image_text, device, shape=None):
    sampled = device == "cpu" and (image_text or model_type in zoo.KNOBS or model_type in NEWLY_BUILT)
    args = dict(model_type=model_type, overrides=overrides, device=device, image_text=image_text, sampled=sampled,
                shape=None if shape is None else dataclasses.asdict(shape))
    isolated = device == "cuda" or os.environ.get("ZOO_SUBPROCESS") == "1"
    found = zoo.outcome_in_subprocess(**args) if isolated else zoo.outcome(**args)
    if os.environ.get("ZOO_OUTCOMES"):  # kept before any assertion: a failing case is recorded too
        zoo.keep_outcome(os.environ["ZOO_OUTCOMES"], name, device, found)
    status, error = found["status"], found.get("error", "")
    not_built = IMAGE_TEXT_NOT_BUILT if image_text else NOT_BUILT
    generate_fails = IMAGE_TEXT_GENERATE_FAILS if image_text else GENERATE_FAILS
    if status == "not built":
        assert model_type in not_built, f"{model_type} does not build: {error}"
        assert re.search(not_built[model_type], error, re.DOTALL), error
        pytest.skip(f"the tiny config does not build: {error}")
    # a build that needs an optional package (timm, scipy) succeeds where it is installed
    optional = model_type in not_built and re.search("timm|scipy", not_built[model_type])
    assert model_type not in not_built or optional, f"{model_type} builds now: drop it from NOT_BUILT"
    if model_type in CPU_ONLY_GENERATE_FAILS and device != "cpu":
        generate_fails = {k: v for k, v in generate_fails.items() if k != model_type}
    if status == "generate failed":
        # in its own process a device-side assert is generate()'s failure like any other (cpmant on CUDA)
        assert model_type in generate_fails and (not _cuda_error(error) or device == "cuda"), \
            f"generate() fails on {model_type}: {error}"
        assert re.search(generate_fails[model_type], error), error
        pytest.skip(f"generate() cannot decode the tiny config: {error}")
    assert status == "ran", f"{model_type}: {status}: {error}"
    assert model_type not in generate_fails, f"generate() decodes {model_type} now: drop it from GENERATE_FAILS"
    check_hybrid(model_type, found["cache"])
    expected = REFUSED.get(model_type)
    for case, mode, poll, result in found["results"]:
        if expected is not None:
            assert result.startswith("refused") and expected in result, (case, mode, poll, result)
        elif mode != "eager" and model_type in GRAPH_REFUSED:
            assert result.startswith("refused") and GRAPH_REFUSED[model_type] in result, (case, mode, poll, result)
        elif mode != "eager" and device == "cuda" and result != "pass" and model_type in GRAPH_REFUSED_ON_CUDA:
            assert re.search(GRAPH_REFUSED_ON_CUDA[model_type], result), (case, mode, poll, result)
        else:
            assert result == "pass", (case, mode, poll, result)
    return found


def _cuda_error(error: str) -> bool:
    # a device-side assert poisons the process's CUDA context: fail loudly instead of skipping
    return "CUDA error" in error or "AcceleratorError" in error


def check_hybrid(model_type, cache_kinds) -> None:
    """A model with linear-attention / state-space layers has an attention layer too, unless it is SSM_ONLY."""
    linear = [k for k in cache_kinds if "linear" in k]
    attention = [k for k in cache_kinds if "attention" in k]
    if model_type in SSM_ONLY:
        assert linear and not attention, cache_kinds
    elif linear:
        assert attention, f"{model_type} was built without an attention layer: {cache_kinds}"


@pytest.mark.parametrize("name,model_type,overrides,image_text", CASES, ids=IDS)
def test_zoo(name, model_type, overrides, image_text):
    _check(name, model_type, overrides, image_text, "cpu")


# The cases above decode one prompt (3 rows, 7 wide, 12 new tokens). A seeded draw of the causal-LM cases (window
# variants among them) each decodes a random shape besides: 1-6 rows, 1-12 ids, any left padding, 2-16 new tokens
# (`zoo.shapes`); `profiles/zoo_sweep.py` runs every case at as many shapes as asked.
def _shape_sweep(count: int = 120):
    rng = random.Random("zoo-shape-sweep")
    causal = [c for c in CASES if not c[3]]
    return [(name, model_type, overrides, zoo.shapes(name, 1)[0])
            for name, model_type, overrides, _ in rng.sample(causal, count)]


SHAPE_SWEEP = _shape_sweep()


@pytest.mark.parametrize("name,model_type,overrides,shape", SHAPE_SWEEP,
                         ids=[f"{c[0]}-b{c[3].batch}-p{c[3].width}-n{c[3].new_tokens}" for c in SHAPE_SWEEP])
def test_zoo_at_random_shapes(name, model_type, overrides, shape):
    _check(name, model_type, overrides, False, "cpu", shape=shape)


@pytest.mark.cuda
@pytest.mark.parametrize("name,model_type,overrides,image_text", CASES, ids=IDS)
def test_zoo_captured(name, model_type, overrides, image_text):
    _check(name, model_type, overrides, image_text, "cuda")


def test_hybrids_keep_an_attention_layer():
    """The zoo builds each hybrid with an attention layer beside its linear-attention / state-space layer."""
    for model_type in ("jamba", "bamba", "granitemoehybrid", "zamba", "zamba2", "recurrent_gemma", "lfm2", "lfm2_moe",
                       "falcon_h1", "nemotron_h", "qwen3_next", "kimi_linear", "olmo_hybrid", "bailing_hybrid"):
        if model_type not in zoo.architectures():
            continue  # not in this transformers release
        from gdtool.core import compat
        model = zoo.build(model_type)
        layers = compat.cache_layers(compat.static_cache(model, 16))
        # 5.17's RecurrentGemma keeps its recurrent state on the modules, not in the cache
        recurrent = "recurrent" in (getattr(model.config, "block_types", None) or ())
        assert recurrent or any(compat.is_linear(layer) for layer in layers), model_type
        assert any(hasattr(layer, "keys") for layer in layers), model_type
