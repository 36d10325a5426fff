"""The compiled greedy step's argmax in gdtool's two stages (`kernels.sampling.argmax_op`), past gdtool's own forward:
the index torch.argmax gives over generate()'s float32 scores, from the model's own logits (float32, bf16, float16),
over a seeded sweep of rows, vocabularies across the blocks, ties, NaN and rows of -inf; when it is refused and why;
then whole decodes at 12 rows against generate(), and with the switch off."""
from __future__ import annotations

import random

import pytest
import torch

import gdtool
from gdtool.core.settings import Settings
from gdtool.core.step import new_state
from gdtool.kernels import sampling, triton as fast_triton
from interpreter import run_interpreted

GREEDY = dict(max_new_tokens=4, do_sample=False, temperature=None, top_k=None, top_p=None, eos_token_id=(5,),
              pad_token_id=0)


def logits(seed: int, device: str = "cpu", vocab: int | None = None) -> torch.Tensor:
    """One random [B, V] view of [B, 1, V] logits, as `Step.logits(cast=False)` returns it."""
    rng = random.Random(seed)
    batch, vocab = rng.randint(1, 9), vocab or rng.choice((7, 2048, 2049, 5000, 9000))
    dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, vocab, generator=gen) * 4
    if rng.random() < 0.5:   # ties, across blocks too: the smallest index wins
        x = x.round()
    for row in range(batch):
        if rng.random() < 0.2:
            x[row, 0, rng.randrange(vocab)] = float("nan")
        if rng.random() < 0.1:
            x[row] = float("-inf")
    return x.to(dtype).to(device)[:, -1]


def check(seeds, device: str = "cpu", vocab: int | None = None) -> int:
    for seed in seeds:
        x = logits(seed, device, vocab)
        got, want = sampling.argmax_op(x), torch.argmax(x.float(), dim=-1)
        assert got.dtype == torch.int64 and torch.equal(got, want), (seed, x.dtype, got, want)
    return len(seeds)


def test_argmax_op_equals_torch_argmax_of_the_float32_scores():
    """Without the interpreter (or Triton): the operator's torch reference."""
    assert check(range(20)) == 20


def test_argmax_op_is_refused_where_the_scores_are_not_the_logits_or_are_recorded():
    ids, mask = torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long)
    settings = Settings(repetition_penalty=None, **GREEDY)

    def refusal(state_kw=None, **changes):
        s = Settings(**{**vars(settings), **changes}) if changes else settings
        state = new_state(ids, mask, s, 8, 16, **{"return_scores": False, "targets": None, **(state_kw or {})})
        return sampling.argmax_refusal(s, state, torch.device("cpu"))

    assert refusal(do_sample=True) == "sampling"
    assert refusal(repetition_penalty=1.3) == "a repetition penalty (the scores are not the logits)"
    assert refusal({"return_scores": True}) == "scores or log-probabilities recorded"
    with fast_triton.switches(compiled_argmax=False):
        assert refusal() == "GDTOOL_COMPILED_ARGMAX=0"
    expected = "" if fast_triton.HAVE_TRITON and fast_triton.interpreting() else "no Triton for this device"
    assert refusal() == expected


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~60 s on 2 cores (Triton's interpreter)
def test_argmax_op_under_the_interpreter_and_in_compiled_greedy_decodes():
    """The kernels (Triton's interpreter) over 30 seeded cases; then tiny-llama and tiny-gemma3 (sliding layers) at 12
    rows (past gdtool's own forward), step-graph: generate()'s tokens with the operator in the step (the note says so)
    and with the switch off (inductor's argmax, the operator not called); with a repetition penalty it is not called."""
    code = (
        "import torch, gdtool, test_fast_argmax as t\n"
        "from gdtool.kernels import sampling, step as fast, triton as fast_triton\n"
        "print('cases', t.check(range(30)))\n"
        "calls, kernel = [], sampling.argmax\n"
        "sampling.argmax = lambda x: calls.append(x.dtype) or kernel(x)\n"
        "for name in ('tiny-llama', 'tiny-gemma3'):\n"
        "    model = gdtool.load_model(name, seed=0)\n"
        "    prompt = gdtool.random_prompts(model, batch=12, lengths=(3, 9), seed=3)\n"
        "    ids, mask = prompt.input_ids, prompt.attention_mask\n"
        "    for on, penalty in ((True, None), (False, None), (True, 1.3)):\n"
        "        kw = dict(max_new_tokens=6, eos_token_id=[5, 9], pad_token_id=0, do_sample=False,\n"
        "                  repetition_penalty=penalty)\n"
        "        ref = model.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:]\n"
        "        calls.clear()\n"
        "        with fast_triton.switches(compiled_argmax=on):\n"
        "            out = gdtool.decode(model, ids, mask, mode='step-graph', kernels='fast', **kw)\n"
        "        assert torch.equal(out.tokens, ref), (name, on, penalty, out.tokens, ref)\n"
        "        note = fast.compiles(model).kernels.iloc[-1]\n"
        "        used = on and penalty is None\n"
        "        assert bool(calls) == used and (\"argmax: gdtool's two stages\" in note) == used, (name, on, note)\n"
        "print('ok')\n")
    run_interpreted(code, timeout=900)


@pytest.mark.cuda
def test_argmax_op_on_cuda():
    """200 seeded cases on the GPU, then the real shapes at 64 rows (Llama 3's 128256 and Gemma 3's 262144 bf16
    logits); tiny-llama and tiny-gemma3 at 12 rows in bf16, step-graph: captured equal to uncaptured and to the step
    with the switch off (inductor's argmax over the same forward), the note naming the operator."""
    from gdtool.kernels import step as fast_step
    assert check(range(200), "cuda") == 200
    assert check(range(300, 310), "cuda", vocab=128256) == 10 and check(range(310, 320), "cuda", vocab=262144) == 10
    for name in ("tiny-llama", "tiny-gemma3"):
        model = gdtool.load_model(name, seed=0, device="cuda", dtype=torch.bfloat16)
        prompt = gdtool.random_prompts(model, batch=12, lengths=(5, 12), seed=0)
        kw = dict(max_new_tokens=24, eos_token_id=None, pad_token_id=0, do_sample=False, kernels="fast",
                  mode="step-graph")
        captured = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)
        assert "argmax: gdtool's two stages" in fast_step.compiles(model).kernels.iloc[-1], name
        direct = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, capture=False, **kw)
        with fast_triton.switches(compiled_argmax=False):
            inductor = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)
        assert torch.equal(captured.tokens, direct.tokens) and torch.equal(captured.tokens, inductor.tokens), name
