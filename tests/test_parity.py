"""Every mode, every polling interval: bit for bit generate()'s tokens and processed scores."""
import pytest
import torch

import gdtool
from reference import assert_same, decode, generate

MODELS = ["tiny-llama", "tiny-qwen2"]
DTYPES = [torch.float32, torch.bfloat16]
POLLS = {"eager": [1, 3], "forward-graph": [1, 0], "step-graph": [16, 1, 4, 0, "async"], "device-loop": [None]}
MODE_POLLS = [(mode, poll) for mode, polls in POLLS.items() for poll in polls]

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
CASES = {
    "greedy": dict(do_sample=False),
    "sampling": SAMPLING,
    "default-top-k": dict(do_sample=True),
    "penalty-greedy": dict(do_sample=False, repetition_penalty=1.3),
    "penalty-sampling": dict(SAMPLING, repetition_penalty=1.1),
    "top-p-only": dict(do_sample=True, top_k=None, top_p=0.5, temperature=1.3),
}


def _prompt(model, batch=4, seed=0):
    return gdtool.random_prompts(model, batch=batch, lengths=(3, 9), seed=seed)


def _eos_ids(model, prompt, n):
    """Two EOS ids that fire at different steps in different rows (read off a greedy run without EOS)."""
    out = decode(model, prompt.input_ids, prompt.attention_mask, n, eos_token_id=None, pad_token_id=0)
    early, late = int(out.tokens[0, 2]), int(out.tokens[1, 6])
    return [early, late] if early != late else [early]


@pytest.mark.parametrize("mode,poll", [("eager", 1), ("forward-graph", 1), ("step-graph", 16), ("device-loop", None)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_parity_no_eos(load, name, dtype, case, mode, poll):
    model = load(name, dtype)
    prompt = _prompt(model)
    settings = dict(CASES[case], eos_token_id=None, pad_token_id=0)
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 12, seed=7, **settings)
    out = decode(model, prompt.input_ids, prompt.attention_mask, 12, seed=7, mode=mode, eos_poll_interval=poll,
                 **settings)
    assert_same(out, *ref)
    assert out.steps == 11 and out.wasted_steps == 0


@pytest.mark.parametrize("mode,poll", MODE_POLLS)
@pytest.mark.parametrize("case", ["greedy", "sampling", "penalty-sampling"])
@pytest.mark.parametrize("name", MODELS)
def test_parity_eos_at_different_steps(load, name, case, mode, poll):
    model = load(name)
    prompt = _prompt(model, seed=3)
    n = 16
    eos = _eos_ids(model, prompt, n)
    for seed in (0, 1, 2):
        settings = dict(CASES[case], eos_token_id=eos, pad_token_id=5)
        ref_tokens, ref_scores = generate(model, prompt.input_ids, prompt.attention_mask, n, seed=seed, **settings)
        out = decode(model, prompt.input_ids, prompt.attention_mask, n, seed=seed, mode=mode, eos_poll_interval=poll,
                     **settings)
        assert_same(out, ref_tokens, ref_scores)
        used = ref_tokens.shape[1]
        if mode == "device-loop":
            assert out.wasted_steps == 0 and out.polls == 0
        elif poll == "async":
            assert out.wasted_steps <= 1
        elif poll >= 1:
            assert out.wasted_steps < poll
        else:
            assert out.steps == n - 1
        assert out.steps == used - 1 + out.wasted_steps


def test_greedy_eos_really_fires_in_different_rows(load):
    model = load("tiny-llama")
    prompt = _prompt(model, seed=3)
    eos = _eos_ids(model, prompt, 16)
    out = decode(model, prompt.input_ids, prompt.attention_mask, 16, eos_token_id=eos, pad_token_id=5)
    assert len(set(out.lengths.tolist())) > 1 and out.lengths.min() < 16
    finished = out.lengths < out.tokens.shape[1]
    for row in finished.nonzero().flatten().tolist():
        assert (out.tokens[row, out.lengths[row]:] == 5).all()


@pytest.mark.parametrize("mode", gdtool.MODES)
def test_penalized_pad_competes(load, mode):
    """Make the pad id the best first pick of a padded row among the ids it has not seen: the penalty
    on it changes that pick exactly when this transformers' generate() lets the penalty see left pads."""
    from gdtool.core.compat import PENALTY_SEES_LEFT_PADS
    model = load("tiny-llama")
    prompt = _prompt(model, seed=1)
    padded = int((prompt.attention_mask == 0).any(1).nonzero()[0])
    first = decode(model, prompt.input_ids, prompt.attention_mask, 1, eos_token_id=None)
    raw = first.scores[0][padded].clone()
    raw[prompt.input_ids[padded][prompt.attention_mask[padded].bool()]] = -float("inf")
    pad = int(raw.argmax())
    assert raw[pad] > 0
    ids = torch.where(prompt.attention_mask.bool(), prompt.input_ids, torch.full_like(prompt.input_ids, pad))
    settings = dict(do_sample=False, repetition_penalty=1000.0, eos_token_id=None, pad_token_id=pad)
    ref = generate(model, ids, prompt.attention_mask, 6, **settings)
    out = decode(model, ids, prompt.attention_mask, 6, mode=mode, **settings)
    assert_same(out, *ref)
    assert (int(out.tokens[padded, 0]) != pad) == PENALTY_SEES_LEFT_PADS


@pytest.mark.parametrize("mode", gdtool.MODES)
@pytest.mark.parametrize("seed", range(8))
def test_many_seeds(load, mode, seed):
    model = load("tiny-qwen2")
    prompt = _prompt(model, batch=3, seed=seed)
    settings = dict(SAMPLING, repetition_penalty=1.2, eos_token_id=[int(prompt.input_ids[0, -1])])
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 10, seed=seed, **settings)
    out = decode(model, prompt.input_ids, prompt.attention_mask, 10, seed=seed, mode=mode, **settings)
    assert_same(out, *ref)


@pytest.mark.parametrize("mode,poll", [("eager", 1), ("step-graph", 16), ("step-graph", "async"),
                                       ("forward-graph", 0)])
def test_unseeded_calls_leave_the_generator_where_generate_does(load, mode, poll):
    """Without reseeding, a run of decode() calls draws what a run of generate() calls draws."""
    model = load("tiny-llama")
    prompt = _prompt(model, seed=4)
    # a quarter of the vocabulary ends a row: rows finish after a few sampled tokens, at different steps
    settings = dict(SAMPLING, eos_token_id=list(range(3, 1000)), pad_token_id=0)
    torch.manual_seed(123)
    refs = [generate(model, prompt.input_ids, prompt.attention_mask, 16, **settings)[0] for _ in range(3)]
    after_ref = torch.rand(4)
    torch.manual_seed(123)
    outs = [decode(model, prompt.input_ids, prompt.attention_mask, 16, mode=mode, eos_poll_interval=poll,
                   **settings) for _ in range(3)]
    after = torch.rand(4)
    for out, ref in zip(outs, refs):
        assert torch.equal(out.tokens, ref)
    assert torch.equal(after, after_ref)
    assert any(out.wasted_steps > 0 for out in outs) or poll == 1
    assert all(out.tokens.shape[1] < 16 for out in outs)


@pytest.mark.parametrize("mode", gdtool.MODES)
def test_prefill_eos_for_every_row_gives_one_token(load, mode):
    model = load("tiny-llama")
    prompt = _prompt(model)
    first = decode(model, prompt.input_ids, prompt.attention_mask, 1, eos_token_id=None)
    eos = sorted(set(first.tokens[:, 0].tolist()))
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 8, eos_token_id=eos, pad_token_id=0)
    out = decode(model, prompt.input_ids, prompt.attention_mask, 8, mode=mode, eos_token_id=eos, pad_token_id=0,
                 eos_poll_interval=None if mode == "device-loop" else 1)
    assert_same(out, *ref)
    assert out.tokens.shape[1] == 1 and out.steps == 0


def test_defaults_come_from_generation_config(load):
    model = load("tiny-llama")
    prompt = _prompt(model)
    config = model.generation_config
    saved = (config.do_sample, config.temperature, config.repetition_penalty)
    try:
        config.do_sample, config.temperature, config.repetition_penalty = True, 0.7, 1.2
        ref = generate(model, prompt.input_ids, prompt.attention_mask, 8, seed=2)
        out = decode(model, prompt.input_ids, prompt.attention_mask, 8, seed=2, mode="step-graph")
        assert_same(out, *ref)
        # an explicit None overrides the model's setting (and HF's default top_k=50)
        ref = generate(model, prompt.input_ids, prompt.attention_mask, 8, seed=2, top_k=None)
        out = decode(model, prompt.input_ids, prompt.attention_mask, 8, seed=2, top_k=None)
        assert_same(out, *ref)
    finally:
        config.do_sample, config.temperature, config.repetition_penalty = saved


def test_mask_inferred_like_generate(load):
    model = load("tiny-llama")
    prompt = _prompt(model)
    ids = torch.where(prompt.attention_mask.bool(), prompt.input_ids, torch.full_like(prompt.input_ids, 9))
    ref = generate(model, ids, None, 6, eos_token_id=2, pad_token_id=9)
    out = decode(model, ids, None, 6, eos_token_id=2, pad_token_id=9, mode="step-graph")
    assert_same(out, *ref)


def test_model_from_a_non_preset_config_decodes():
    from transformers import MistralConfig, AutoModelForCausalLM
    config = MistralConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6))
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 6, eos_token_id=None)
    for mode in gdtool.MODES:
        assert_same(decode(model, prompt.input_ids, prompt.attention_mask, 6, mode=mode, eos_token_id=None), *ref)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _recurrent_gemma(device="cpu"):
    from transformers import AutoModelForCausalLM, RecurrentGemmaConfig
    # one recurrent block (its conv and recurrent states live on the module, rebound every forward) and one
    # sliding-window attention block
    config = RecurrentGemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, lru_width=64,
                                  block_types=["recurrent", "attention"], attention_window_size=6)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["greedy", "penalty-sampling"])
def test_state_kept_on_the_modules_is_decoded_exactly_in_every_mode(case, device):
    model = _recurrent_gemma(device)
    assert sum(hasattr(m, "conv1d_state") for m in model.modules()) == 1  # one recurrent block, one attention
    prompt = gdtool.random_prompts(model, batch=3, lengths=(2, 7), seed=1)
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 9, seed=3, eos_token_id=None, **CASES[case])
    for mode in gdtool.MODES:
        out = decode(model, prompt.input_ids, prompt.attention_mask, 9, seed=3, mode=mode, eos_token_id=None,
                     **CASES[case])
        assert_same(out, *ref)


@pytest.mark.parametrize("device", DEVICES)
def test_a_one_token_prompt_decodes_from_a_fresh_state_whatever_ran_before(device):
    """RecurrentGemma's prefill of a one-token prompt takes its decode branch, which reads the convolution state the
    previous forward left on the module (transformers 5.17-5.25: generate() itself answers such a prompt
    differently on a model that has decoded before). gdtool starts every prefill fresh (`compat.start_fresh`): a
    one-token prompt gets what generate() gives on a freshly loaded model, in every mode and through a Decoder,
    after other prompts of the same batch size were decoded by generate() and by gdtool."""
    model = _recurrent_gemma(device)
    ids = torch.tensor([[17], [301]], device=device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static",
                         disable_compile=True, output_scores=True, return_dict_in_generate=True, **kw)
    ref = ref.sequences[:, 1:], ref.scores
    other = gdtool.random_prompts(model, batch=2, lengths=(4, 9), seed=4)
    for mode in gdtool.MODES:
        generate(model, other.input_ids, other.attention_mask, 5, **kw)
        decode(model, other.input_ids, other.attention_mask, 5, mode=mode, **kw)
        assert_same(decode(model, ids, mask, 6, mode=mode, **kw), *ref)
    dec = gdtool.Decoder(model, mode="step-graph", max_new_tokens=6, **kw)
    for _ in range(2):
        assert torch.equal(dec.generate(ids, mask).tokens, ref[0].cpu())
        decode(model, other.input_ids, other.attention_mask, 5, **kw)
    dec.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["step-graph", "device-loop"])
def test_state_kept_on_the_modules_is_refilled_by_each_call_of_a_decoder(mode, device):
    # the second call replays the first call's steps: they must read the state its own prefill made
    model = _recurrent_gemma(device)
    dec = gdtool.Decoder(model, mode=mode, max_new_tokens=7, do_sample=False, eos_token_id=None)
    for seed in (1, 2):
        prompt = gdtool.random_prompts(model, batch=2, lengths=(6, 6), seed=seed)  # one shape: one engine
        out = dec.generate(prompt.input_ids, prompt.attention_mask)
        ref_tokens, _ = generate(model, prompt.input_ids, prompt.attention_mask, 7, eos_token_id=None,
                                 do_sample=False)
        assert torch.equal(out.tokens, ref_tokens.cpu()), (seed, out.tokens, ref_tokens)
    dec.close()
