"""The device-loop mode: the loop condition, exact stop and chunking (uncaptured on a CPU, captured on a GPU)."""
import pytest
import torch

import gdtool
from reference import assert_same, decode, generate

LENGTHS = [3, 5, 7, 4]


def _run(model, prompt, **kw):
    kw.setdefault("max_new_tokens", 20)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, eos_token_id=[2], pad_token_id=0,
                         target_lengths=LENGTHS, **kw)


@pytest.fixture(scope="module")
def setup():
    model = gdtool.load_model("tiny-llama", seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    return model, gdtool.random_prompts(model, batch=4, lengths=(3, 9), seed=3)


@pytest.mark.parametrize("sample", [False, True])
def test_stops_exactly_in_one_launch(setup, sample):
    model, prompt = setup
    kw = dict(do_sample=True, temperature=0.9, repetition_penalty=1.1, seed=4) if sample else {}
    ref = _run(model, prompt, mode="step-graph", eos_poll_interval=1, **kw)
    out = _run(model, prompt, mode="device-loop", **kw)
    assert torch.equal(out.tokens, ref.tokens)
    assert out.tokens.shape[1] == max(LENGTHS) and out.lengths.tolist() == LENGTHS
    assert out.launches == 1 and out.wasted_steps == 0 and out.polls == 0
    assert out.replays == (out.launches if out.captured else 0)  # replays count CUDA graphs only
    assert out.steps == max(LENGTHS) - 1


@pytest.mark.parametrize("chunk", [1, 2, 4, 100])
def test_chunked_launches_stream_tokens(setup, chunk):
    model, prompt = setup
    seen = []
    ref = _run(model, prompt, mode="step-graph", eos_poll_interval=1)
    out = _run(model, prompt, mode="device-loop", steps_per_launch=chunk, on_chunk=lambda t: seen.append(t.clone()))
    assert torch.equal(out.tokens, ref.tokens)
    steps = max(LENGTHS) - 1
    assert out.launches == -(-steps // chunk) and out.wasted_steps == 0
    assert out.replays == (out.launches if out.captured else 0)
    assert [t.shape[1] for t in seen] == [min(1 + chunk * (i + 1), steps + 1) for i in range(len(seen))]
    for tokens in seen:  # each chunk is a prefix of the final tokens
        assert torch.equal(tokens, out.tokens[:, :tokens.shape[1]])


def test_runs_to_max_new_tokens_without_eos(setup):
    model, prompt = setup
    out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="device-loop", max_new_tokens=9,
                        eos_token_id=None)
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 9, eos_token_id=None)[0]
    assert torch.equal(out.tokens, ref.cpu()) and out.steps == 8 and out.launches == 1


def test_one_token_needs_no_launch(setup):
    model, prompt = setup
    out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="device-loop", max_new_tokens=1)
    assert out.tokens.shape[1] == 1 and out.steps == 0 and out.launches == out.replays == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="device-loop", eos_poll_interval=4), "the device loop checks the flag on the device"),
    (dict(mode="device-loop", steps_per_launch=0), "steps_per_launch=0 must be an int >= 1"),
    (dict(mode="step-graph", steps_per_launch=4), "steps_per_launch and on_chunk belong to mode='device-loop'"),
])
def test_device_loop_settings_are_checked(setup, kwargs, message):
    model, prompt = setup
    with pytest.raises(ValueError, match=message):
        gdtool.decode(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["greedy", "penalty", "sampling"])
@pytest.mark.parametrize("name", ["tiny-llama", "llama-1b"])
def test_device_loop_parity_on_gpu(name, case):
    model = gdtool.load_model(name, seed=0, device="cuda")
    prompt = gdtool.random_prompts(model, batch=4, lengths=(5, 20), seed=2)
    settings = {"greedy": dict(do_sample=False), "penalty": dict(do_sample=False, repetition_penalty=1.3),
                "sampling": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)}[case]
    free = decode(model, prompt.input_ids, prompt.attention_mask, 24, eos_token_id=None)
    eos = sorted({int(free.tokens[0, 5]), int(free.tokens[2, 11])})
    settings.update(eos_token_id=eos, pad_token_id=0)
    step_graph = decode(model, prompt.input_ids, prompt.attention_mask, 24, seed=9, mode="step-graph", **settings)
    loop = decode(model, prompt.input_ids, prompt.attention_mask, 24, seed=9, mode="device-loop", **settings)
    ref = generate(model, prompt.input_ids, prompt.attention_mask, 24, seed=9, **settings)
    assert_same(loop, *ref)
    assert torch.equal(loop.tokens, step_graph.tokens)
    assert loop.replays == 1 and loop.wasted_steps == 0 and loop.captures == 1
