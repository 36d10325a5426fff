"""The greedy fast step's tail in one kernel (`gdtool.kernels.tail`): the argmax's second stage, `Step.update` and
the caches' counters, against the reference (torch.argmax, `Step.update`, `torch._foreach_add_`), bit for bit,
over a seeded sweep of batch, vocabulary, EOS ids, finished rows, repetition-penalty masks, step index (its clamp at
the last token included), prompt width, ties and NaN; then whole decodes against generate()."""
from __future__ import annotations

import random

import pytest
import torch

import gdtool
from gdtool.core.settings import Settings
from gdtool.core.step import Step, new_state
from gdtool.kernels import tail, triton as fast_triton
from interpreter import run_interpreted

FIELDS = ("tokens", "positions", "mask", "index", "out", "lengths", "unfinished", "done", "done_at", "seen")


def case(seed: int, device: str = "cpu"):
    """One random step: (Step over a random mid-decode state, float32 scores [B, V], counters)."""
    rng = random.Random(seed)
    batch, vocab = rng.randint(1, 6), rng.choice((5, 2048, 2049, 5000))
    n, width = rng.randint(1, 7), rng.randint(1, 6)
    cache = width + n + rng.randint(-1, 2)  # the mask's last slot below, at or past the last token's
    cache = max(cache, width + 1)
    eos = tuple(rng.sample(range(vocab), rng.randint(0, min(3, vocab))))
    settings = Settings(max_new_tokens=n, do_sample=False, temperature=None, top_k=None, top_p=None,
                        repetition_penalty=rng.choice((None, 1.3)), eos_token_id=eos,
                        pad_token_id=rng.choice((None, 0, vocab - 1)))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    attention = (torch.rand(batch, width, generator=gen) > 0.3).long()
    attention[:, -1] = 1
    state = new_state(ids, attention, settings, cache, vocab, return_scores=False, targets=None)
    state.index.fill_(rng.randint(0, n + 1))  # past the last token as in warm-up steps
    state.unfinished.copy_((torch.rand(batch, generator=gen) > 0.3).long())
    state.lengths.copy_(torch.randint(0, n + 1, (batch,), generator=gen))
    state.positions.copy_(torch.randint(0, 50, (batch, 1), generator=gen))
    state.done_at.fill_(rng.choice((-1, 0, n - 1)))
    if state.seen is not None:
        state.seen.copy_(torch.rand(batch, vocab, generator=gen) > 0.8)
    scores = torch.randn(batch, vocab, generator=gen)
    if rng.random() < 0.4:   # ties: the smallest index wins, across the argmax's blocks too
        scores = scores.round()
    for row in range(batch):
        if rng.random() < 0.15:
            scores[row, rng.randrange(vocab)] = float("nan")
        if eos and rng.random() < 0.5:   # a row that picks EOS
            scores[row, rng.choice(eos)] = 1e4
        if rng.random() < 0.1:
            scores[row] = float("-inf")
    step = Step(None, None, _to(state, device), settings, width, feed=object())
    counters = [torch.full((), rng.randint(0, 9), dtype=torch.long, device=device) for _ in range(rng.randint(0, 5))]
    return step, scores.to(device), counters


def _to(state, device):
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(state, name, value.to(device))
    return state


def check(seeds, device: str = "cpu") -> int:
    """tail.update against tail.update_reference on each seed's case; returns how many cases ran."""
    for seed in seeds:
        step, scores, counters = case(seed, device)
        ref_step, _, ref_counters = case(seed, device)
        tail.update(scores, step, counters)
        tail.update_reference(scores, ref_step, ref_counters)
        for name in FIELDS:
            mine, ref = getattr(step.state, name), getattr(ref_step.state, name)
            assert (mine is None) == (ref is None) and (mine is None or torch.equal(mine, ref)), (seed, name, mine, ref)
        assert [int(c) for c in counters] == [int(c) for c in ref_counters], (seed, counters, ref_counters)
    return len(seeds)


def test_the_sweep_covers_what_it_says():
    """The seeded cases reach every branch the kernel has: EOS on and off, the penalty's mask, several argmax
    blocks, the step index past the last token, rows finished, no counters and several."""
    seen = {"eos": set(), "penalty": set(), "blocks": set(), "clamped": set(), "finished": set(), "counters": set()}
    for seed in range(40):
        step, scores, counters = case(seed)
        s = step.state
        seen["eos"].add(s.eos is not None)
        seen["penalty"].add(s.seen is not None)
        seen["blocks"].add(scores.shape[1] > 2048)
        seen["clamped"].add(int(s.index) > step.last_index)
        seen["finished"].add(bool((s.unfinished == 0).any()))
        seen["counters"].add(len(counters) > 0)
    assert all(found == {True, False} for found in seen.values()), seen


def test_the_reference_is_step_update():
    """update_reference is Step.update of torch.argmax's token and the counters' add, on one case written out."""
    step, scores, counters = case(3)
    before = [int(c) for c in counters]
    token = torch.argmax(scores, -1)
    expected_index = min(int(step.state.index), step.last_index)
    tail.update_reference(scores, step, counters)
    unfinished_before = case(3)[0].state.unfinished
    pad = step.pad
    written = torch.where(unfinished_before.bool(), token, pad) if step.state.eos is not None else token
    assert torch.equal(step.state.out[:, expected_index], written)
    assert [int(c) for c in counters] == [b + 1 for b in before]


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_one_kernel_tail_under_the_interpreter_equals_the_reference():
    """The kernel itself (Triton's CPU interpreter) over 40 seeded cases: every state buffer and counter equal."""
    run_interpreted("import test_fast_tail\nprint('cases', test_fast_tail.check(range(40)))\nprint('ok')\n",
                    timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~110 s on 2 cores (Triton's interpreter)
def test_fast_greedy_decode_with_the_one_kernel_tail_under_the_interpreter_equals_generate():
    """Whole greedy decodes with kernels="fast" under the interpreter (every kernel of the step Triton's, the tail
    in one), step-graph: the tokens generate() gives, with EOS, padding and a repetition penalty, and the
    compiles() note names the tail. tiny-gemma3's sliding layers: their counters stop when a window is full."""
    code = (
        "import torch, gdtool\n"
        "from gdtool.kernels import step as fast\n"
        "for name, penalty in (('tiny-llama', 1.3), ('tiny-gemma3', None)):\n"
        "    model = gdtool.load_model(name, seed=0)\n"
        "    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 7), seed=1)   # tiny-llama's line: 2 rows\n"
        "    kw = dict(max_new_tokens=10, eos_token_id=[5, 9], pad_token_id=0, repetition_penalty=penalty)\n"
        "    ids, mask = prompt.input_ids, prompt.attention_mask\n"
        "    ref = model.generate(ids, attention_mask=mask, do_sample=False, **kw)[:, ids.shape[1]:]\n"
        "    out = gdtool.decode(model, ids, mask, mode='step-graph', kernels='fast', do_sample=False, **kw)\n"
        "    assert torch.equal(out.tokens, ref), (name, out.tokens, ref)\n"
        "    note = fast.compiles(model).kernels.iloc[-1]\n"
        "    assert 'argmax, update and counters in one kernel' in note, note\n"
        "print('ok')\n")
    run_interpreted(code, timeout=900)


@pytest.mark.cuda
def test_one_kernel_tail_on_cuda_equals_the_reference():
    """The same 200 seeded cases on the GPU, with PDL as the step launches it."""
    assert check(range(200), "cuda") == 200


def test_the_bench_expects_no_dynamo_graph_of_a_step_that_compiles_nothing():
    """kernels="fast", greedy: the forward and the tail are gdtool's kernels and nothing is compiled, so the bench
    must not call the run an eager fallback (`compiled_nothing`); sampling compiles its select and update."""
    from gdtool.frontends import bench
    from gdtool.kernels import step as fast
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=0)
    expects = bench._expects_graphs(model)
    gdtool.decode(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, mode="step-graph", kernels="fast",
                  do_sample=False, eos_token_id=None, pad_token_id=0)
    assert fast.compiled_nothing(model) and not expects()
    gdtool.decode(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=4, mode="step-graph", kernels="fast",
                  do_sample=True, top_k=5, seed=0, eos_token_id=None, pad_token_id=0)
    assert not fast.compiled_nothing(model) and expects()
    fast.forget(model)
    assert not fast.compiled_nothing(model)
