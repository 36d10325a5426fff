"""The model zoo: every causal-LM architecture of the installed transformers, as a tiny random model,
in every mode and polling setting, greedy and sampling with EOS firing at different steps in
left-padded rows, against generate(static) bit for bit (tokens and processed scores). Each
architecture ends as a pass or as a refusal whose reason is listed in REFUSED; a mismatch, a crash
or an unlisted refusal fails. Sliding-window variants use a window filled by the prompt (4) and
one filled while decoding (10). `pytest -m cuda` runs it again with real capture.
"""
import re

import pytest
import torch

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
}
# model type -> what a refusal of the graph modes only must say (eager decodes it)
GRAPH_REFUSED = {
    "llama4": "chunked-attention", "llama4_text": "chunked-attention",
    "qwen4_exp": "grows by one at every step", "qwen4_exp_text": "grows by one at every step",
}
# model type -> what generate() itself raises on the tiny model: the only architectures skipped
GENERATE_FAILS = {
    "deepseek_v4": "heavily_compressed_attention",  # StaticCache has no layer for its compressed attention
    "gemma4_unified_assistant": "get_seq_length",   # a draft model: its layers read the target model's cache
    "cpmant": "index_copy_",                         # prepends its prompt tokens, past the static cache's end
    "prophetnet": "must match the size",             # its decoder's mask does not take a static cache
}
# state-space models with no attention at all; every other model with linear-attention / state-space layers
# is a hybrid, and the zoo must build it with an attention layer beside them
SSM_ONLY = {"mamba", "falcon_mamba", "mamba2"}
# the same, where transformers' code reads the host inside the forward only on a GPU: 5.17's AriaExperts
# counts tokens per expert with `.cpu()` (later releases dispatch it through the experts implementations)
GRAPH_REFUSED_ON_CUDA = {"aria_text": "reads a device value on the host"}


def _cases():
    out = []
    for model_type in zoo.architectures():
        try:
            out += [(name, model_type, overrides) for name, overrides in zoo.variants(model_type)]
        except Exception:  # noqa: BLE001 - a config class that cannot be built with defaults
            out.append((model_type, model_type, {}))
    return out


CASES = _cases()


def _cuda_error(error) -> bool:
    # a device-side assert poisons the process's CUDA context: fail loudly instead of skipping every later case
    return "CUDA error" in str(error) or type(error).__name__ == "AcceleratorError"


def check_hybrid(model_type, model) -> None:
    """A model with linear-attention / state-space layers has an attention layer too, unless it is SSM_ONLY."""
    from gdtool import compat
    layers = compat.cache_layers(compat.static_cache(model, 16))
    linear = [layer for layer in layers if compat.is_linear(layer)]
    attention = [layer for layer in layers if hasattr(layer, "keys")]
    if linear and model_type not in SSM_ONLY:
        assert attention, f"{model_type} was built without an attention layer: {[type(x).__name__ for x in layers]}"
    if model_type in SSM_ONLY:
        assert linear and not attention, [type(x).__name__ for x in layers]


def _check(model_type, overrides, device):
    try:
        model = zoo.build(model_type, **overrides)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"the tiny config does not build: {type(error).__name__}: {str(error)[:120]}")
    embeddings = model.get_input_embeddings()
    if getattr(embeddings, "num_embeddings", zoo.VOCAB) < zoo.VOCAB:
        pytest.skip(f"the tiny config keeps a vocabulary of {embeddings.num_embeddings} < {zoo.VOCAB} prompt ids")
    model = model.to(device)
    try:
        results = zoo.run_architecture(model, device)
    except zoo.GenerateFailed as error:
        if _cuda_error(error) or model_type not in GENERATE_FAILS:
            raise
        assert GENERATE_FAILS[model_type] in str(error), error
        pytest.skip(f"generate() cannot decode the tiny config: {error}")
    refusals = {key: r for key, r in results.items() if r != "pass"}
    expected = REFUSED.get(model_type)
    check_hybrid(model_type, model)
    assert model_type not in GENERATE_FAILS, f"generate() decodes {model_type} now: drop it from GENERATE_FAILS"
    for (case, mode, poll), result in results.items():
        if expected is not None:
            assert result.startswith("refused") and expected in result, (case, mode, poll, result)
        elif mode != "eager" and model_type in GRAPH_REFUSED:
            assert result.startswith("refused") and GRAPH_REFUSED[model_type] in result, (case, mode, poll, result)
        elif mode != "eager" and device == "cuda" and result != "pass" and model_type in GRAPH_REFUSED_ON_CUDA:
            assert GRAPH_REFUSED_ON_CUDA[model_type] in result, (case, mode, poll, result)
        else:
            assert result == "pass", (case, mode, poll, result)
    return results, refusals


@pytest.mark.parametrize("name,model_type,overrides", CASES, ids=[c[0] for c in CASES])
def test_zoo(name, model_type, overrides):
    _check(model_type, overrides, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name,model_type,overrides", CASES, ids=[c[0] for c in CASES])
def test_zoo_captured(name, model_type, overrides):
    torch.use_deterministic_algorithms(True, warn_only=True)
    _check(model_type, overrides, "cuda")
