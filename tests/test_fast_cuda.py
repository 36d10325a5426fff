"""kernels="compiled" on a CUDA GPU: captured equals uncaptured, one compile, and the sort-free
sampler against HF's sampler on this GPU's sort. Small models only: compiling takes tens of seconds."""
import warnings

import pytest
import torch

import gdtool
import gdtool.loops.devloop
from gdtool.kernels import step as fast, sampling as fast_sampling
from gdtool.core import sampling
from gdtool.core.settings import Settings

pytestmark = pytest.mark.cuda

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def model():
    return gdtool.load_model("tiny-llama", seed=0, device="cuda")  # bf16


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0, seed=5, mode="step-graph",
                   kernels="compiled"), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_compiled_step_captured_equals_uncaptured(model):
    prompt = gdtool.random_prompts(model, batch=4, lengths=(5, 12), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = _decode(model, prompt, **SAMPLING)
        again = _decode(model, prompt, **SAMPLING)
        direct = _decode(model, prompt, capture=False, **SAMPLING)
    assert not [w for w in caught if str(w.message).startswith("gdtool:")]  # no graph break, no recompile
    assert captured.replays == captured.steps > 0
    # uncaptured, the compiled step ran once a token as Python: no CUDA-graph replays (they count graphs only)
    assert not direct.captured and direct.replays == 0 and direct.launches == direct.steps == captured.steps
    assert torch.equal(captured.tokens, direct.tokens)   # same compiled function, same noise
    assert torch.equal(captured.tokens, again.tokens)
    table = fast.compiles(model)
    mine = table[table.step.str.startswith("step_b4_w12_") & table.step.str.endswith("_sample")]
    assert len(mine) == 1 and mine.compiles.iloc[0] == 1 and bool(mine.fullgraph.iloc[0])  # reused 3 times
    assert mine.note.iloc[0] == ""  # decode() records warnings raised in its CUDA warm-up: read the table
    if gdtool.loops.devloop.device_loop_support() is None:
        loop = _decode(model, prompt, mode="device-loop", **SAMPLING)  # the same compiled step in a WHILE node
        assert torch.equal(loop.tokens, captured.tokens)


def test_compiled_step_with_top_p_and_no_top_k(model):
    """The sorting path (top-p over the whole vocabulary) compiles, captures, and equals itself uncaptured:
    inductor's own scan over a vocabulary row failed in codegen on CUDA (torch 2.11), gdtool.core.sampling.cumsum
    keeps ATen's kernel there."""
    prompt = gdtool.random_prompts(model, batch=64, lengths=(5, 12), seed=2)
    settings = dict(SAMPLING, top_k=0)
    captured = _decode(model, prompt, max_new_tokens=8, **settings)
    direct = _decode(model, prompt, max_new_tokens=8, capture=False, **settings)
    assert captured.replays == captured.steps > 0
    assert torch.equal(captured.tokens, direct.tokens)


def test_compiled_step_graph_with_eos_and_polling(model):
    prompt = gdtool.random_prompts(model, batch=4, lengths=(5, 12), seed=1)
    targets = [3, 5, 7, 16]  # the length harness forces EOS inside the step
    runs = [_decode(model, prompt, do_sample=False, max_new_tokens=16, eos_token_id=[2], target_lengths=targets,
                    eos_poll_interval=poll) for poll in (1, 4, "async")]
    for out in runs[1:]:
        assert torch.equal(out.tokens, runs[0].tokens) and torch.equal(out.lengths, runs[0].lengths)
    assert (runs[0].lengths <= torch.tensor(targets)).all() and runs[0].tokens.shape[1] <= 16
    assert runs[0].polls > runs[1].polls


def test_sort_free_sampler_matches_hf_sampler_on_this_gpu():
    """HF's top-p sorts on the GPU; where that sort keeps ties in id order, the sort-free sampler is
    exact, bf16 ties included."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = 128256
    logits = (torch.randn(64, vocab, device="cuda", generator=gen) * 3).bfloat16().float()
    settings = Settings(max_new_tokens=2, eos_token_id=(), pad_token_id=0, **SAMPLING)
    seen = torch.rand(64, vocab, device="cuda", generator=gen) < 0.001
    noise = torch.empty_like(logits).exponential_(1, generator=gen)
    warped = fast_sampling.warp(logits, seen, settings)
    stable = torch.equal(torch.sort(warped, -1)[1], torch.sort(warped, dim=-1, stable=True)[1])
    fast_tokens = fast_sampling.choose(logits, seen, settings, noise)
    assert torch.equal(fast_tokens, fast_sampling.reference_choose(logits, seen, settings, noise))
    hf_tokens = torch.argmax(torch.softmax(sampling.process(logits, seen, settings), -1) / noise, -1)
    if stable:
        assert torch.equal(fast_tokens, hf_tokens)
    else:  # only tied tokens at the top-p boundary can differ
        assert (fast_tokens == hf_tokens).float().mean() > 0.95


@pytest.mark.parametrize("arch,pattern", [("mistral", "sliding"), ("gemma3_text", "mixed"), ("gpt_oss", "mixed"),
                                          ("cohere2", "mixed"), ("olmo3", "mixed")])
def test_compiled_step_on_sliding_windows_captured_equals_uncaptured(arch, pattern):
    import windows
    # window 6: prompt 4 fills it at the second decode step, so both window phases run, captured and not
    model = windows.build(arch, 6, pattern).to(device="cuda", dtype=torch.bfloat16)
    prompt = gdtool.random_prompts(model, batch=3, lengths=(2, 4), seed=4)
    for settings in (dict(do_sample=False), SAMPLING):
        captured = _decode(model, prompt, max_new_tokens=12, **settings)
        direct = _decode(model, prompt, max_new_tokens=12, capture=False, **settings)
        assert captured.replays == captured.steps > 0
        assert torch.equal(captured.tokens, direct.tokens), (arch, settings)
    table = fast.compiles(model)
    assert (table.compiles == 1).all() and table.fullgraph.all(), table
