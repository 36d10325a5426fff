"""gdtool.rollout: refill="off" is generate() on each static batch, bit for bit; refill="host" (each slot its own
sequence, finished slots refilled between steps) is generate() on each prompt alone, in float64 greedy: the same
tokens, log-probabilities within 1e-9. With sampling, refill="host" draws keyed noise (seed, prompt, sample,
token): the same sequences at every slot count, and what a plain reference loop draws with that noise. Prompts, slot
counts and EOS ids come from seeded draws.

The presets' random weights tie the head to the embedding, so greedy decoding repeats the last prompt token
whatever the attention sees. The models here get a random untied head (`_lively`): each token then depends on
the whole context, so a row that attended to a wrong column would show in its tokens.
"""
import collections
import math
import random

import pytest
import torch

import gdtool
from gdtool.core import rollout_step
from gdtool.core.settings import resolve
from reference import generate

N = 10
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
_models: dict = {}


def _lively(name: str, dtype=torch.float64, **overrides):
    """A preset (or a tiny zoo model, "zoo:<model_type>") with a seeded random head of its own."""
    key = (name, dtype, repr(sorted(overrides.items())))
    if key not in _models:
        if name.startswith("zoo:"):
            import zoo
            model = zoo.build(name[4:], dtype=dtype, **overrides)
        else:
            model = gdtool.load_model(name, seed=0, dtype=dtype, **overrides)
        config = model.config.get_text_config()
        gen = torch.Generator().manual_seed(123)
        head = torch.randn(config.vocab_size, config.hidden_size, generator=gen, dtype=torch.float64)
        model.lm_head.weight = torch.nn.Parameter(head.to(dtype), requires_grad=False)
        _models[key] = model
    return _models[key]


def _prompts(model, count: int, seed: int, lengths=(1, 9)) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.config.get_text_config().vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _alone(model, prompt, n=N, **settings):
    """generate() on one prompt (batch 1, no padding): its new tokens and the log-probability of each under
    generate's processed scores."""
    tokens, scores = generate(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), n,
                              **settings)
    tokens = tokens[0].tolist()
    logprobs = torch.stack([torch.log_softmax(s[0], dim=-1)[t] for s, t in zip(scores, tokens)])
    return tokens, logprobs


def _eos_cases(model, prompts, seed: int, n=N) -> dict:
    """EOS settings by name, drawn from each prompt's greedy continuation without EOS."""
    free = [_alone(model, p, n, eos_token_id=None, pad_token_id=0)[0] for p in prompts]
    rng = random.Random(seed)
    seen = {t for row in free for t in row}
    never = next(t for t in range(3, 4096) if t not in seen)
    long = set(rng.sample(range(len(prompts)), 2))
    # most rows end within their first 3 tokens, two run to the cap: the lengths of a long tail
    tail = {row[rng.randrange(3)] for i, row in enumerate(free) if i not in long} - {t for i in long for t in free[i]}
    mixed = {free[i][rng.randrange(n)] for i in rng.sample(range(len(prompts)), 3)}
    return {"none": dict(eos_token_id=None, pad_token_id=0),
            "first": dict(eos_token_id=sorted({row[0] for row in free}), pad_token_id=0),
            "never": dict(eos_token_id=[never], pad_token_id=0),
            "mixed": dict(eos_token_id=sorted(mixed), pad_token_id=0),
            "tail": dict(eos_token_id=sorted(tail), pad_token_id=0)}


def _assert_same_sequences(a, b):
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences):
        assert (x.prompt_index, x.sample_index, x.finish_reason, x.slot) == (y.prompt_index, y.sample_index,
                                                                             y.finish_reason, y.slot)
        assert torch.equal(x.tokens, y.tokens)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert torch.equal(x.logprobs, y.logprobs)
    assert (a.useful_tokens, a.row_steps, a.decode_steps, a.prefills) == (b.useful_tokens, b.row_steps,
                                                                         b.decode_steps, b.prefills)


def _assert_alone(model, prompts, out, n=N, tolerance=1e-9, **settings):
    assert [(s.prompt_index, s.sample_index) for s in out.sequences] == [(i, 0) for i in range(len(prompts))]
    eos = settings.get("eos_token_id") or []
    for i, (prompt, seq) in enumerate(zip(prompts, out.sequences)):
        tokens, logprobs = _alone(model, prompt, n, **settings)
        assert seq.tokens.tolist() == tokens, (i, seq.tokens.tolist(), tokens)
        assert seq.length == len(tokens)
        assert seq.finish_reason == ("eos" if tokens[-1] in eos else "length")
        assert seq.logprobs.dtype == torch.float32
        assert (seq.logprobs - logprobs).abs().max().item() <= tolerance, i
    assert out.useful_tokens == sum(s.length for s in out.sequences)


@pytest.mark.parametrize("name", FAMILIES)
def test_host_equals_generate_alone(name):
    """Every family x slot count (1, 2, 3, 5, more than the prompts) x EOS case (all at the cap, all 1 token, EOS
    set but never hit, mixed, long tail), with refills of one prompt or several in one forward, at once or once
    some slots are free: each sequence is generate() on its prompt alone."""
    model = _lively(name)
    prompts = _prompts(model, 7, seed=FAMILIES.index(name))
    cases = _eos_cases(model, prompts, seed=1)
    lengths = {}
    shapes = {1: (8, 1), 2: (1, 1), 3: (3, 2), 5: (8, 3), 9: (2, 1)}   # slots: (refill_rows, refill_after)
    for case, settings in cases.items():
        for slots, (rows_, after) in shapes.items():
            shape = dict(refill_rows=rows_, refill_after=after)
            out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **shape, **settings)
            _assert_alone(model, prompts, out, **settings)
            rows = min(slots, len(prompts))   # more slots than sequences: only the rows that hold one run
            assert out.slots == rows and out.row_steps == out.prefilled_rows + rows * out.decode_steps
            assert out.prefilled_rows == len(prompts) == sum(g * n for g, n in out.refill_sizes.items())
            assert out.prefills == sum(out.refill_sizes.values()) and max(out.refill_sizes) <= min(rows_, rows)
            lengths[case] = [s.length for s in out.sequences]
            if slots == 3:  # the device policy, uncaptured: the same calls in the same order, the same bits
                twin = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="device", **shape,
                                      **settings)
                _assert_same_sequences(out, twin)
    assert set(lengths["none"]) == set(lengths["never"]) == {N}
    assert set(lengths["first"]) == {1}
    assert len(set(lengths["mixed"])) > 1
    assert sorted(lengths["tail"])[-2:] == [N, N] and sorted(lengths["tail"])[-3] <= 3


def _moe_switched_for_decode(monkeypatch):
    """tiny-qwen3-moe with grouped_mm experts, switched to batched_mm for decoding as transformers does on a GPU."""
    import contextlib
    model = gdtool.load_model("tiny-qwen3-moe", seed=0)
    model.set_experts_implementation("grouped_mm")

    @contextlib.contextmanager
    def switch():
        model.set_experts_implementation("batched_mm")
        try:
            yield
        finally:
            model.set_experts_implementation("grouped_mm")

    monkeypatch.setattr(model, "_optimize_model_for_decode", switch)
    return model


@pytest.mark.parametrize("capturable", [True, False], ids=["grouped-mm-capturable", "not-capturable"])
def test_refills_prefill_the_experts_as_generates_prefill(capturable, monkeypatch):
    """Inside the rollout's decode context (generate()'s switch of grouped_mm experts to batched_mm, which on a GPU
    copies every routed expert's weights per token), a refill's prefill runs the model's own grouped_mm where
    grouped_mm is capturable (bf16 on sm_90+; here said so), batched_mm elsewhere; the decode steps keep batched_mm,
    and the model's implementation is as it was after the rollout."""
    from gdtool.core import feed
    model = _moe_switched_for_decode(monkeypatch)
    monkeypatch.setattr(feed, "grouped_mm_capturable", lambda param: capturable)
    seen = []
    for module in feed.experts_modules(model):
        def spy(hidden, *args, _forward=module.forward, _module=module, **kwargs):
            seen.append((hidden.shape[0], _module.config._experts_implementation))
            return _forward(hidden, *args, **kwargs)
        monkeypatch.setattr(module, "forward", spy)
    prompts = _prompts(model, 5, seed=2)
    slots = 2
    out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=4, refill="host", mode="eager", pad_token_id=0,
                         eos_token_id=None)
    assert len(out.sequences) == 5
    prefills = {impl for tokens, impl in seen if tokens > slots}
    decodes = {impl for tokens, impl in seen if tokens <= slots}
    assert prefills == {"grouped_mm" if capturable else "batched_mm"} and decodes == {"batched_mm"}, seen
    assert model.get_experts_implementation()[""] == "grouped_mm"


def test_a_refill_out_of_memory_in_batched_mm_experts_says_why_and_what_to_change(monkeypatch):
    """Where grouped_mm is not capturable (float32, a GPU before sm_90) a refill's prefill keeps the decode's
    batched_mm experts; when that runs out of memory the error names the copy, refill_rows and bf16 on sm_90+."""
    from gdtool.core import feed
    model = _moe_switched_for_decode(monkeypatch)
    module = feed.experts_modules(model)[0]

    def heavy(hidden, *args, _forward=module.forward, **kwargs):
        if hidden.shape[0] > 2:   # a prefill's tokens: the copy of their experts' weights does not fit
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB.")
        return _forward(hidden, *args, **kwargs)
    monkeypatch.setattr(module, "forward", heavy)
    with pytest.raises(torch.OutOfMemoryError, match=r"batched_mm experts, which copy every routed expert's weights.*"
                                                     r"Lower refill_rows.*bfloat16 on a GPU of compute capability 9\.0"
                                                     r".*Tried to allocate 48\.00 GiB"):
        gdtool.rollout(model, _prompts(model, 5, seed=2), slots=2, max_new_tokens=4, refill="host", mode="eager",
                       pad_token_id=0, eos_token_id=None)
    assert model.get_experts_implementation()[""] == "grouped_mm"


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "zoo:mixtral"])
def test_moe_equals_generate_alone(name):
    """Mixture-of-experts families (routing per token, no capacity limit): each sequence is generate() on its
    prompt alone, with the batched_mm experts (generate()'s decode path; grouped_mm takes no float64), at several
    slot counts and EOS cases, and the device policy's twin gives the same bits."""
    model = _lively(name)
    model.set_experts_implementation("batched_mm")
    prompts = _prompts(model, 6, seed=3)
    cases = _eos_cases(model, prompts, seed=1)
    for case in ("none", "tail", "mixed"):
        for slots in (1, 2, 4):
            out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **cases[case])
            _assert_alone(model, prompts, out, **cases[case])
            if slots == 2:
                twin = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="device",
                                      mode="step-graph", **cases[case])
                _assert_same_sequences(out, twin)


def test_host_with_repetition_penalty_resets_each_slot():
    """The seen-mask is per sequence: a refilled slot forgets the tokens of the sequence before it."""
    model = _lively("tiny-llama")
    prompts = _prompts(model, 6, seed=5)
    settings = dict(_eos_cases(model, prompts, seed=2)["mixed"], repetition_penalty=1.5)
    for slots in (1, 4):
        out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **settings)
        _assert_alone(model, prompts, out, **settings)


def test_host_eager_attention():
    """Eager attention: the same tokens. Its softmax runs in float32 even in a float64 model (transformers'
    `eager_attention_forward`), and a float32 sum over the rollout's longer cache rounds differently, so the
    log-probabilities agree to float32 rounding (measured: up to 9e-7), not to 1e-9 as with sdpa."""
    model = _lively("tiny-llama", attn_implementation="eager")
    prompts = _prompts(model, 5, seed=29)
    settings = _eos_cases(model, prompts, seed=9)["mixed"]
    out = gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", **settings)
    _assert_alone(model, prompts, out, tolerance=1e-5, **settings)


WINDOWED = {
    "gemma3": ("tiny-gemma3", {}),                                     # window 8, sliding and full layers
    "gpt-oss": ("tiny-gpt-oss", {}),                                   # window 8, sinks, eager attention, MoE
    "qwen3": ("zoo:qwen3", dict(use_sliding_window=True, sliding_window=6,
                                layer_types=["sliding_attention", "full_attention"])),
    "qwen2": ("zoo:qwen2", dict(use_sliding_window=True, sliding_window=5,
                                layer_types=["full_attention", "sliding_attention"])),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windows_per_row_equal_generate_alone(family):
    """Sliding windows shorter than the rollout's columns, decoded per row (each query sees (p - window, p] of
    its own row): prompts of 1-14 tokens and 10 new ones cross the window in the prefill and in the decode; each
    sequence is generate() on its prompt alone, and the device policy's twin gives the same bits. gpt-oss runs
    eager attention (float32 softmax: log-probabilities to float32 rounding, as test_host_eager_attention)."""
    name, overrides = WINDOWED[family]
    model = _lively(name, **overrides)
    if rollout_step.experts_modules(model):
        model.set_experts_implementation("batched_mm")
    window = model.config.get_text_config().sliding_window
    prompts = _prompts(model, 6, seed=3, lengths=(1, 14))
    assert max(map(len, prompts)) > window and rollout_step.row_window(model, 14 + N) == window
    cases = _eos_cases(model, prompts, seed=1)
    tolerance = 1e-5 if family == "gpt-oss" else 1e-9
    for case in ("none", "tail"):
        for slots in (1, 3):
            out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **cases[case])
            _assert_alone(model, prompts, out, tolerance=tolerance, **cases[case])
            if slots == 3:
                twin = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="device",
                                      mode="step-graph", **cases[case])
                _assert_same_sequences(out, twin)


@pytest.mark.parametrize("seed", range(8))
def test_windows_per_row_seeded_sweep(seed):
    """A seeded sweep of per-row windows: Gemma 3 (sdpa) and gpt-oss (eager, sinks, MoE) with a window of 1-9
    tokens, 3-9 prompts of 1-16 tokens, 1-5 slots, EOS at the cap or in a long tail: each sequence is generate()
    on its prompt alone (eager attention to float32 rounding, as above)."""
    rng = random.Random(1000 + seed)
    family = ("gemma3_text", "gpt_oss")[seed % 2]
    window = rng.randint(1, 9)
    model = _lively(f"zoo:{family}", sliding_window=window)
    if rollout_step.experts_modules(model):
        model.set_experts_implementation("batched_mm")
    prompts = _prompts(model, rng.randint(3, 9), seed=seed, lengths=(1, 16))   # _eos_cases draws 3
    case = rng.choice(["none", "tail"])
    settings = _eos_cases(model, prompts, seed=seed)[case]
    slots = rng.randint(1, 5)
    out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **settings)
    _assert_alone(model, prompts, out, tolerance=1e-5 if family == "gpt_oss" else 1e-9, **settings)


def test_width_buckets_and_the_shapes_the_queue_asks_for():
    assert rollout_step.width_buckets([128] * 5) == (128,)
    assert rollout_step.width_buckets([20, 512, 300], most=3) == (128, 256, 512)
    assert rollout_step.width_buckets([20, 512, 300]) == (512,)         # the default: one width
    assert rollout_step.width_buckets([20, 512, 300], most=1) == (512,)
    assert rollout_step.width_buckets([20, 512, 300], most=9) == (32, 64, 128, 256, 512)
    assert rollout_step.width_buckets([100, 120], most=3) == (120,)    # no prompt fits 64
    assert rollout_step.width_buckets([3, 40], most=3) == (16, 32, 40)  # halvings rounded up to 16
    assert rollout_step.width_buckets([3, 9], most=3) == (9,)          # nothing narrower than 16 below 9
    widths = (16, 32, 40)
    assert rollout_step.refill_shapes((2, 1), widths, [5, 40, 3, 20]) == {2: (32, 40), 1: (16, 32, 40)}
    assert rollout_step.refill_shapes((4,), widths, [5, 6, 3, 20]) == {4: (32,)}
    ladder = torch.tensor(widths)
    assert [rollout_step.width_of(torch.tensor(n), ladder).item() for n in (1, 16, 17, 32, 33, 40)] == \
        [16, 16, 32, 32, 40, 40]


WIDTH_FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "gemma3", "tiny-qwen3-moe", "gpt-oss"]


@pytest.mark.parametrize("seed", range(12))   # two draws per family
def test_width_buckets_seeded_sweep(seed):
    """Ragged prompts of 1-40 tokens: each refill prefills the narrowest width bucket that holds its prompts
    (16, 32 or 40 columns with three buckets). Seeded draws over dense, MoE (Qwen3-MoE) and sliding-window families
    (Gemma 3; gpt-oss, also MoE with sinks; windows of 4-12), slots, refill rows, refill_after, the number of
    buckets and the EOS case: each sequence is generate() on its prompt alone (gpt-oss's eager attention to
    float32 rounding, as test_host_eager_attention), the device policy's uncaptured twin gives the same bits and
    counts, and with one prompt per refill each ran at its own prompt's bucket."""
    rng = random.Random(2000 + seed)
    name = WIDTH_FAMILIES[seed % len(WIDTH_FAMILIES)]
    if name in ("gemma3", "gpt-oss"):
        model = _lively({"gemma3": "zoo:gemma3_text", "gpt-oss": "zoo:gpt_oss"}[name],
                        sliding_window=rng.randint(4, 12))
    else:
        model = _lively(name)
    if rollout_step.experts_modules(model):
        model.set_experts_implementation("batched_mm")   # generate()'s decode path; grouped_mm takes no float64
    prompts = _prompts(model, rng.randint(6, 12), seed=seed, lengths=(1, 40))   # several refills at 1-5 slots
    settings = _eos_cases(model, prompts, seed=seed)[rng.choice(["none", "tail", "mixed", "first"])]
    shape = dict(refill_rows=rng.choice([1, 2, 3, 8]), refill_after=rng.choice([1, 2]),
                 refill_widths=rng.choice([1, 2, 3, 4]))
    slots = rng.choice([1, 2, 3, 5])
    out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **shape, **settings)
    _assert_alone(model, prompts, out, tolerance=1e-5 if name == "gpt-oss" else 1e-9, **settings)
    widths = rollout_step.width_buckets([len(p) for p in prompts], shape["refill_widths"])
    assert set(out.refill_widths) <= set(widths) and sum(out.refill_widths.values()) == out.prefills
    if shape["refill_rows"] == 1:
        ladder = torch.tensor(widths)
        own = collections.Counter(rollout_step.width_of(torch.tensor(len(p)), ladder).item() for p in prompts)
        assert out.refill_widths == dict(own)
    twin = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="device", **shape, **settings)
    _assert_same_sequences(out, twin)
    assert (twin.refill_sizes, twin.refill_widths) == (out.refill_sizes, out.refill_widths)


@pytest.mark.parametrize("window", [None, 4096], ids=["no-window", "window-longer-than-cache"])
def test_host_mistral(window):
    model = _lively("zoo:mistral", sliding_window=window)
    prompts = _prompts(model, 5, seed=7)
    settings = _eos_cases(model, prompts, seed=3)["mixed"]
    for slots in (2, 3):
        out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **settings)
        _assert_alone(model, prompts, out, **settings)


def _forget_cache_length(model) -> None:
    """The static cache length generate() (and gdtool, as it does) keeps on the model, forgotten."""
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length


def _generate_batches(model, prompts, slots, num_samples, seed, bucket=0, **settings):
    """generate() on each static batch in turn (left-padded to its widest prompt, or to `bucket` where wider; rows
    repeated num_samples times), as a caller would run them: the cache length generate() remembers on the model
    carries over, one seed before the first."""
    rows = [p for p in prompts for _ in range(num_samples)]
    _forget_cache_length(model)
    if seed is not None:
        torch.manual_seed(seed)
    out = []
    for first in range(0, len(rows), slots):
        batch = rows[first:first + slots]
        width = max(bucket, *map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=N, cache_implementation="static",
                             disable_compile=True, output_scores=True, return_dict_in_generate=True, **settings)
        tokens = ref.sequences[:, width:]
        logprobs = torch.stack([torch.log_softmax(s, dim=-1).gather(1, tokens[:, j:j + 1])[:, 0]
                                for j, s in enumerate(ref.scores)], dim=1)
        out.append((tokens, logprobs, len(ref.scores)))
    return out


@pytest.mark.parametrize("mode", ["eager", "step-graph"])
@pytest.mark.parametrize("case", ["greedy", "sampling"])
def test_off_is_generate_on_each_batch(mode, case):
    model = _lively("tiny-llama", dtype=torch.float32)
    prompts = _prompts(model, 5, seed=11)
    samples = 2 if case == "sampling" else 1
    settings = dict(pad_token_id=0, eos_token_id=_eos_cases(model, prompts, seed=4)["mixed"]["eos_token_id"])
    if case == "sampling":
        settings.update(do_sample=True, temperature=0.9, top_k=40, repetition_penalty=1.2)
    for slots in (2, 3):
        refs = _generate_batches(model, prompts, slots, samples, seed=3, **settings)
        del model._previous_max_cache_length
        out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, num_samples=samples, refill="off",
                             mode=mode, seed=3, **settings)
        assert [(s.prompt_index, s.sample_index) for s in out.sequences] == \
            [(p, k) for p in range(len(prompts)) for k in range(samples)]
        for i, seq in enumerate(out.sequences):
            tokens, logprobs, _ = refs[i // slots]
            row = i % slots
            assert seq.batch == i // slots and seq.slot == row
            assert torch.equal(seq.tokens, tokens[row, :seq.length])
            assert torch.equal(seq.logprobs, logprobs[row, :seq.length])
            after = tokens[row, seq.length:]
            assert (after == 0).all() and (seq.length == N or seq.finish_reason == "eos")
        needed = sum(used - 1 for _, _, used in refs)
        # eager checks EOS every step; step-graph polls every 16 steps, so it may run past the last EOS
        assert out.decode_steps == needed if mode == "eager" else out.decode_steps >= needed


@pytest.mark.parametrize("seed", range(6))
def test_off_with_one_bucket_builds_one_graph_and_is_generate_on_each_padded_batch(monkeypatch, seed):
    """refill="off" runs each batch at its widest prompt: ragged batches build a graph per (rows, width) (on an H100,
    16 warm-ups and captures in a rollout of 16 batches, more time than their decode steps). buckets=(W,), the static
    Decoder's buckets, pads every batch to W: one graph per batch size, each sequence generate() on its batch as
    padded, bit for bit. A Decoder's buckets carry over to rollout(decoder, refill="off"). Seeded: family (sliding
    windows among them), prompt count and widths, slots, W at or past the widest prompt, greedy and sampling."""
    import gdtool.loops.decoder as decoder
    rng = random.Random(seed)
    model = _lively((FAMILIES + ["tiny-gemma3"])[seed % 4], dtype=torch.float32)
    prompts = _prompts(model, rng.randint(3, 8), seed=100 + seed, lengths=(1, 12))
    slots = rng.randint(1, 4)
    bucket = max(map(len, prompts)) + rng.choice([0, 0, 3])
    settings = dict(pad_token_id=0, eos_token_id=_eos_cases(model, prompts, seed=seed)["mixed"]["eos_token_id"])
    if seed % 2:
        settings.update(do_sample=True, temperature=0.9, top_k=40)
    built = []
    engine = decoder.Engine
    monkeypatch.setattr(decoder, "Engine", lambda *a, **k: built.append(tuple(a[3].shape)) or engine(*a, **k))
    batches = [prompts[i:i + slots] for i in range(0, len(prompts), slots)]
    runs = {}
    for name, buckets in (("own widths", None), ("one bucket", (bucket,))):
        built.clear()
        _forget_cache_length(model)   # each run starts as its reference does (generate() remembers the longest)
        runs[name] = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="off", mode="step-graph",
                                    seed=3, buckets=buckets, **settings)
        # a graph per (rows, width, cache length) in order of first use; the cache length, as generate()'s, never
        # shrinks below the longest so far (so a width seen before builds again once a wider batch grew it)
        keys, longest = [], -1
        for b in batches:
            width = bucket if buckets else max(map(len, b))
            longest = max(longest, width + N - 1)
            keys.append((len(b), width, longest))
        assert built == [k[:2] for k in dict.fromkeys(keys)], (name, built)
    built.clear()
    _forget_cache_length(model)
    dec = gdtool.Decoder(model, "step-graph", buckets=(bucket,), max_new_tokens=N, return_logprobs=True, **settings)
    runs["a Decoder's buckets"] = gdtool.rollout(dec, prompts, slots=slots, refill="off", seed=3)
    assert built == list(dict.fromkeys((len(b), bucket) for b in batches))
    for name, out in runs.items():
        refs = _generate_batches(model, prompts, slots, 1, seed=3, bucket=0 if name == "own widths" else bucket,
                                 **settings)
        assert [s.batch for s in out.sequences] == [i // slots for i in range(len(prompts))]
        assert out.prefills == len(batches)
        for i, seq in enumerate(out.sequences):
            tokens, logprobs, _ = refs[i // slots]
            assert torch.equal(seq.tokens, tokens[i % slots, :seq.length]), name
            assert torch.equal(seq.logprobs, logprobs[i % slots, :seq.length]), name


@pytest.mark.parametrize("slots", [1, 3, 4])
def test_off_and_host_agree(slots):
    model = _lively("tiny-qwen2")
    prompts = _prompts(model, 8, seed=13)
    settings = _eos_cases(model, prompts, seed=5)["mixed"]
    off = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="off", **settings)
    host = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", **settings)
    for a, b in zip(off.sequences, host.sequences):
        assert (a.prompt_index, a.sample_index, a.finish_reason) == (b.prompt_index, b.sample_index, b.finish_reason)
        assert torch.equal(a.tokens, b.tokens)
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-9
    assert off.useful_tokens == host.useful_tokens


@pytest.mark.parametrize("refill", ["off", "host"])
def test_without_logprobs(refill):
    model = _lively("tiny-llama")
    prompts = _prompts(model, 4, seed=23)
    settings = _eos_cases(model, prompts, seed=8)["mixed"]
    out = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill=refill, return_logprobs=False, **settings)
    assert all(s.logprobs is None for s in out.sequences)
    assert [s.tokens.tolist() for s in out.sequences] == [_alone(model, p, **settings)[0] for p in prompts]
    assert out.to_frame()["logprob"].isna().all()


def test_same_seed_same_rollout_and_callbacks():
    model = _lively("tiny-llama", dtype=torch.float32)
    prompts = _prompts(model, 6, seed=17)
    eos = _eos_cases(model, prompts, seed=6)["mixed"]
    runs = {}
    for refill, settings in (("host", {}), ("off", dict(do_sample=True, num_samples=2))):
        for attempt in range(2):
            finished = []
            out = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill=refill, seed=9,
                                 on_finished=finished.append, **eos, **settings)
            assert sorted(id(s) for s in finished) == sorted(id(s) for s in out.sequences)
            runs.setdefault(refill, []).append([(s.tokens.tolist(), s.logprobs.tolist(), s.finish_reason)
                                                for s in out.sequences])
        assert runs[refill][0] == runs[refill][1]


def test_figures_add_up_and_refill_keeps_rows_busy():
    model = _lively("tiny-qwen3")
    prompts = _prompts(model, 12, seed=19)
    settings = _eos_cases(model, prompts, seed=7)["tail"]
    off = gdtool.rollout(model, prompts, slots=4, max_new_tokens=N, refill="off", **settings)
    host = gdtool.rollout(model, prompts, slots=4, max_new_tokens=N, refill="host", **settings)
    lengths = [s.length for s in off.sequences]
    assert max(lengths) == N and sorted(lengths)[len(lengths) // 2] <= 3  # a long tail
    for out in (off, host):
        assert out.useful_tokens == sum(lengths)
        assert out.row_step_share == pytest.approx(out.useful_tokens / out.row_steps)
        assert out.prefilled_rows == len(prompts)
        assert out.host_syncs > 0 and out.prefill_s > 0 and out.decode_s > 0 and out.tokens_per_s > 0
        frame = out.to_frame()
        assert list(frame["length"]) == lengths and len(frame) == len(prompts)
    # off: 3 full batches of 4 rows, each running its prefill and its decode steps
    assert off.row_steps == 4 * (off.decode_steps + off.prefills)
    assert host.row_steps == host.prefilled_rows + 4 * host.decode_steps
    assert host.row_step_share > off.row_step_share
    assert host.decode_steps < off.decode_steps
    assert off.setup_parts is None and host.setup_parts is None   # nothing captured on a CPU: no setup to split


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_mask_is_the_rows_columns(attn):
    """What transformers builds from the rollout's 2-D mask: causal(q_offset + q >= kv) AND the 2-D mask, where
    q_offset is the cache's shared counter. With the rollout's cache answering q_offset = C - 1, the 4-D mask is
    the 2-D mask itself, row by row; with the shared counter (0: the rollout's writes never advance it) the causal
    part would hide every column but the first."""
    model = gdtool.load_model("tiny-llama", seed=0, dtype=torch.float64, attn_implementation=attn)
    slots, cache_len = 3, 12
    settings = resolve(model, 4, dict(eos_token_id=None, pad_token_id=0))
    sequences = [(0, 0, [1] * 8)]  # the cache has the longest prompt + max_new_tokens columns
    state = rollout_step.new_row_state(slots, sequences, settings, 4096, torch.device("cpu"), False)
    step = rollout_step.RowStep(model, rollout_step.row_cache(model, cache_len), state, settings)
    state.mask.copy_(torch.tensor([[1] * 3 + [0] * 9, [1] * 12, [1] * 7 + [0] * 5]))

    def built():
        inputs = step.feed.decode(state.tokens, state.positions, state.mask, state.index)
        mask = inputs["attention_mask"]
        mask = mask["full_attention"] if isinstance(mask, dict) else mask
        assert mask.shape == (slots, 1, 1, cache_len)
        return mask if mask.dtype == torch.bool else mask == 0

    with torch.inference_mode(), step.decoding():
        assert torch.equal(built(), state.mask.bool()[:, None, None, :])
    with torch.inference_mode(), step.feed.decoding():
        shared = built()
        assert shared[..., 0].all() and not shared[..., 1:].any()


def test_step_and_refills_read_nothing_on_the_host(monkeypatch):
    """A captured step or refill cannot read a device value on the host (CUDA refuses it mid-capture), and a CPU
    run would not notice: every op of RowStep's step and refills is watched here for the ops that read back
    (`graphs._SYNCING`: `.item()`, a tensor indexed by a 0-d tensor, `nonzero`, ...), with ragged prompts over
    three width buckets, sampling, a repetition penalty, forced lengths and log-probabilities."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from gdtool.core import graphs

    found = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in graphs._SYNCING:
                found.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for name in ("__call__", "refill", "flags"):
        def watched(self, *args, _original=getattr(rollout_step.RowStep, name), **kwargs):
            with Reads():
                return _original(self, *args, **kwargs)
        monkeypatch.setattr(rollout_step.RowStep, name, watched)
    model = _lively("tiny-llama")
    prompts = _prompts(model, 9, seed=4, lengths=(1, 40))
    out = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill="host", refill_rows=2, do_sample=True,
                         seed=1, repetition_penalty=1.3, eos_token_id=1, pad_token_id=0, refill_widths=3,
                         target_lengths=[1 + i % N for i in range(9)])
    assert len(out.refill_widths) > 1 and out.prefills >= 5
    assert not found, found


def test_a_refill_out_of_turn_stays_in_bounds():
    """A captured rollout warms up and times each (size, width) refill from its first state, where the next prompt
    may be wider than that width: the refill must still index inside its w columns (on a GPU an index past them
    is a device-side assert that takes the process down)."""
    model = _lively("tiny-llama")
    sequences = [(0, 0, list(range(3, 33))), (1, 0, [5, 6, 7])]      # 30 tokens, then 3
    settings = resolve(model, N, dict(eos_token_id=None, pad_token_id=0), {})
    widths = rollout_step.width_buckets([30, 3], most=3)
    assert widths == (16, 30)
    state = rollout_step.new_row_state(2, sequences, settings, model.config.vocab_size, "cpu", True, None, (1,),
                                       widths)
    step = rollout_step.RowStep(model, rollout_step.row_cache(model, 30 + N), state, settings, sizes=(1,),
                                widths=widths)
    step.flags()
    assert (state.group.item(), state.width.item()) == (1, 30)
    with torch.inference_mode(), step.decoding():
        step.refill(1, 16)   # out of turn: prompt 0 is 30 tokens wide
    assert state.lengths[0].item() == 1 and state.prompt_lengths[0].item() == 16


def test_per_row_write_lands_in_each_rows_column():
    model = gdtool.load_model("tiny-llama", seed=0, dtype=torch.float64)
    cache = rollout_step.row_cache(model, 6)
    shape = (3, 2, 1, 16)  # slots, key/value heads, one token, head dim
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
    columns = torch.tensor([[4], [0], [2]])
    new = torch.arange(3 * 2 * 16, dtype=torch.float64).view(3, 2, 1, 16) + 1
    phase = {"prefill": None}
    with rollout_step.row_writes(cache, 3, columns, phase):
        assert cache.get_query_offset(0) == 5
        keys, values = cache.update(new, -new, 0)
        assert keys is cache.layers[0].keys and values is cache.layers[0].values
        for row, column in enumerate(columns[:, 0].tolist()):
            assert torch.equal(keys[row, :, column], new[row, :, 0])
            assert torch.equal(values[row, :, column], -new[row, :, 0])
            others = [c for c in range(6) if c != column]
            assert not keys[row][:, others].any()
        # a prompt of 4 tokens prefilled alone into row 1: its columns [0, 4), that row returned, query offset 0
        phase["prefill"] = torch.tensor([1])
        prompt = torch.arange(2 * 4 * 16, dtype=torch.float64).view(1, 2, 4, 16) + 1000
        before = cache.layers[0].keys.clone()
        keys, values = cache.update(prompt, -prompt, 0)
        assert cache.get_query_offset(0) == 0
        assert keys.shape == (1, 2, 6, 16) and torch.equal(keys[0, :, :4], prompt[0])
        assert torch.equal(values[0, :, :4], -prompt[0])
        after = cache.layers[0].keys
        assert torch.equal(after[1, :, :4], prompt[0]) and torch.equal(after[1, :, 4:], before[1, :, 4:])
        assert torch.equal(after[[0, 2]], before[[0, 2]])
    assert "update" not in vars(cache.layers[0]) and "get_query_offset" not in vars(cache)


# -- refusals and bad input: one ValueError each, before any forward --------------------------------------------

BAD_INPUT = [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[5, 6], []]), "prompt 1 is empty"),
    (dict(prompts=[[5, 4096]]), r"prompt 0 holds token ids outside the vocabulary \[0, 4096\)"),
    (dict(prompts=[[5, -1]]), "outside the vocabulary"),
    (dict(prompts=[[5, 6.0]]), "token ids are ints"),
    (dict(prompts=["some text"]), "tokenize text first"),
    (dict(prompts=[[7] * 2040]), "prompt 0 has 2040 tokens: with max_new_tokens 10 it needs 2049 positions, more than"),
    (dict(slots=0), "slots=0 must be an int >= 1"),
    (dict(slots=True), "slots=True must be an int >= 1"),
    (dict(refill="sideways"), "refill='sideways' is not one of"),
    (dict(num_samples=0), "num_samples=0 must be an int >= 1"),
    (dict(num_samples=2), "num_samples=2 with greedy decoding would repeat one answer"),
    (dict(num_return_sequences=2), "gdtool calls it num_samples"),
    (dict(on_finished=3), "on_finished=3 must be callable"),
    (dict(mode="fast"), "mode='fast' is not one of"),
    (dict(refill="host", mode="device-loop"), "refill='host' with mode='device-loop'"),
    (dict(refill="device", mode="forward-graph"), "refill='device' with mode='forward-graph'"),
    (dict(refill="device", mode="device-loop", eos_poll_interval=4), "a rollout polls only with refill='device' in"),
    (dict(refill="device", mode="step-graph", eos_poll_interval=0), "eos_poll_interval=0"),
    (dict(refill="device", mode="step-graph", steps_per_launch=4), "steps_per_launch=4: an int >= 1 with mode="),
    (dict(refill="off", on_group=print), "on_group, eos_poll_interval, steps_per_launch, refill_rows,"),
    (dict(refill="off", refill_rows=4), "refill_after and refill_widths are refill='host'/'device' options"),
    (dict(refill="off", refill_widths=2), "refill_widths are refill='host'/'device' options"),
    (dict(refill="host", buckets=(8,)), r"buckets=\(8,\) pads the static batches of refill='off'; .* use refill_widths"),
    (dict(refill="off", buckets=(8, 4)), r"buckets=\(8, 4\) must be increasing positive ints"),
    (dict(refill="host", refill_widths=0), r"refill_widths=0 must be an int >= 1 \(the most widths a refill"),
    (dict(refill="host", refill_rows=0), r"refill_rows=0 must be an int >= 1 \(the most prompts one refill"),
    (dict(refill="device", refill_after="2"), r"refill_after='2' must be an int >= 1 \(refill once"),
    (dict(on_group=3), "on_group=3 must be callable"),
    (dict(refill="host", eos_token_id=1, target_lengths=[2]), "target_lengths has 1 values; pass one per sequence"),
    (dict(refill="device", eos_token_id=1, target_lengths=[2, 11]), r"target_lengths holds 11, outside \[1, max_new"),
    (dict(refill="host", target_lengths=[2, 3]), "no eos_token_id is set; pass eos_token_id=<id>"),
    (dict(refill="device", do_sample=True), r"refill='device' samples with noise keyed .* pass seed=<int>"),
    (dict(refill="host", do_sample=True), r"needs a seed: pass seed=<int> \(got seed=None\)"),
    (dict(refill="host", do_sample=True, seed="7"), r"pass seed=<int> \(got seed='7'\)"),
    (dict(refill="host", do_sample=True, seed=True), r"pass seed=<int> \(got seed=True\)"),
    (dict(refill="host", mode="forward-graph", kernels="compiled"), "kernels='compiled' compiles the whole decode"),
    (dict(refill="host", mode="forward-graph", kernels="fast"), "kernels='fast' compiles the whole decode"),
    (dict(return_logprobs="raw"), "return_logprobs='raw': use True or 'processed'"),
]


def _refused(model, match, **kwargs):
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        args = dict(prompts=[[5, 6, 7], [8]], slots=2, max_new_tokens=N, eos_token_id=None, pad_token_id=0)
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            gdtool.rollout(model, args.pop("prompts"), **args)
    finally:
        hook.remove()
    assert not calls, "a forward ran before the refusal"


@pytest.mark.parametrize("kwargs,match", BAD_INPUT, ids=[m[:28] for _, m in BAD_INPUT])
def test_bad_input(kwargs, match):
    _refused(_lively("tiny-llama"), match, **kwargs)


REFUSED_MODELS = [
    ("zoo:mistral", dict(sliding_window=8), "sliding window of 8 tokens, shorter than the rollout's 1[0-9] cache columns"),
    ("zoo:qwen2_moe", {}, "mixture-of-experts blocks.*MoE families qwen3_moe, mixtral, gpt_oss only"),
    ("zoo:lfm2", {}, "keeps a recurrent state"),
    ("zoo:gpt2", {}, "model_type 'gpt2'.* is not one of the families"),
]


@pytest.mark.parametrize("name,overrides,match", REFUSED_MODELS, ids=[n for n, _, _ in REFUSED_MODELS])
def test_refused_models(name, overrides, match):
    if name.startswith("zoo:"):
        import zoo
        model = zoo.build(name[4:], **overrides)
    else:
        model = gdtool.load_model(name, seed=0)
    _refused(model, match, refill="host", prompts=[[5, 6, 7, 8, 9], [8]])
    out = gdtool.rollout(model, [[5, 6, 7, 8, 9], [8]], slots=2, max_new_tokens=3, refill="off", eos_token_id=None,
                         pad_token_id=0)
    assert [s.length for s in out.sequences] == [3, 3]


def test_refused_attention(monkeypatch):
    model = gdtool.load_model("tiny-llama", seed=0)
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    _refused(model, "attention 'flash_attention_2'", refill="host")


def test_long_window_fits_short_does_not():
    """Mistral's forward builds its masks from the cache's shared counter (it takes no mask per layer type), so its
    sliding window is refused exactly when it is shorter than the rollout's cache columns (the mask code puts
    each decode query at the last column, so a window one shorter would hide a row's first column)."""
    model = _lively("zoo:mistral", sliding_window=13)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    out = gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", eos_token_id=None)  # 3 + 10
    _assert_alone(model, prompts, out, eos_token_id=None)
    _refused(model, "sliding window of 13 tokens, shorter than the rollout's 14 cache columns", refill="host",
             prompts=[[5, 6, 7, 8]])


# -- sampling with refill: noise keyed by (seed, prompt, sample, token) -----------------------------------------

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.3, pad_token_id=0)
MASK32 = 0xFFFFFFFF


def _murmur3(words, seed):
    """MurmurHash3_x86_32 of 32-bit words, written out on Python ints (independent of gdtool.core.noise)."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & MASK32
    h = seed
    for k in words:
        k = rotl((k * 0xCC9E2D51) & MASK32, 15) * 0x1B873593 & MASK32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & MASK32
    h ^= 4 * len(words)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _uniform_ref(seed, prompt, sample, token, v):
    words = []
    for x in (seed, prompt, sample, token):
        x &= (1 << 64) - 1
        words += [x & MASK32, x >> 32]
    a, b = (_murmur3(words + [v], lane) for lane in (0, 0x9E3779B9))
    return (2 * (((a >> 12) << 32) | b) + 1) * 2.0 ** -53


def test_murmur3_vectors_and_uniform_pinned():
    """The hash is MurmurHash3_x86_32 (published vectors for 4-byte inputs) and u is built from it as documented,
    bit for bit, for ordinary and extreme keys."""
    from gdtool.core import noise
    for words, seed, expected in (([0], 0, 0x2362F9DE), ([0xFFFFFFFF], 0, 0x76293B50), ([0x87654321], 0, 0xF55B516B),
                                  ([0x87654321], 0x5082EDEE, 0x2362F9DE), ([], 1, 0x514E28B7)):
        assert noise.murmur3_words(words, seed) == _murmur3(words, seed) == expected
    rng = random.Random(0)
    words = [rng.randrange(2 ** 32) for _ in range(9)]
    assert noise.murmur3_words([torch.tensor([w]) for w in words], 77).item() == _murmur3(words, 77)
    keys = [(0, 0, 0, 0), (2 ** 64 - 1, 2 ** 62, 2 ** 63 - 1, -1), (-5, -(2 ** 63), 3, 2 ** 62), (12345, 17, 2, 9)]
    for seed, p, k, t in keys:
        u = noise.uniform(seed, torch.tensor([p]), torch.tensor([k]), torch.tensor([t]), 40)[0]
        assert u.tolist() == [_uniform_ref(seed, p, k, t, v) for v in range(40)]


@pytest.mark.parametrize("seed", [0, 5, 2**32 + 7, 2**63 + 11, 2**64 - 1, -3, 2**70 + 9])
def test_seed_words_draw_what_the_int_draws(seed):
    """A step reads its seed from a [2] int64 buffer (noise.seed_words): the same noise, bit for bit, as the int."""
    from gdtool.core import noise
    prompt, sample, token = torch.tensor([0, 3, 9]), torch.tensor([1, 0, 2]), torch.tensor([0, 7, 2**40])
    assert torch.equal(noise.uniform(seed, prompt, sample, token, 50),
                       noise.uniform(noise.seed_words(seed), prompt, sample, token, 50))


def test_keyed_uniform_extremes_and_components():
    """u is strictly inside (0, 1), so -log u is finite and positive, for extreme keys; changing any key component
    (or v) changes it."""
    from gdtool.core import noise
    extremes = [0, 1, 2 ** 62, 2 ** 63 - 1, -1, -(2 ** 63), -(2 ** 62)]
    grid = torch.tensor([(p, k, t) for p in extremes for k in extremes for t in extremes])
    vocab = 512
    for seed in (0, 2 ** 64 - 1, -1, 2 ** 70 + 3):
        u = noise.uniform(seed, grid[:, 0], grid[:, 1], grid[:, 2], vocab)
        assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
        e = noise.exponentials(seed, grid[:, 0], grid[:, 1], grid[:, 2], vocab)
        assert (torch.isfinite(e) & (e > 0)).all()
        assert all(len(set(row)) == vocab for row in u.tolist())  # across v
    assert len({tuple(r) for r in noise.uniform(3, grid[:, 0], grid[:, 1], grid[:, 2], 8).tolist()}) == len(grid)
    base = dict(seed=11, prompt=torch.tensor([5]), sample=torch.tensor([1]), token=torch.tensor([4]))
    u0 = noise.uniform(vocab=vocab, **base)
    for name, other in (("seed", 12), ("seed", 11 + 2 ** 32), ("prompt", torch.tensor([6])),
                        ("prompt", torch.tensor([5 + 2 ** 32])), ("sample", torch.tensor([0])),
                        ("token", torch.tensor([5])), ("token", torch.tensor([-4]))):
        u1 = noise.uniform(vocab=vocab, **dict(base, **{name: other}))
        assert (u1 != u0).all(), name


def test_keyed_race_samples_the_distribution():
    """Over 12,000 fixed keys (varying the prompt, the sample, then the token index), each token's frequency is
    within 4.5 binomial standard deviations of its probability, and the chi-square statistic (6 degrees of freedom)
    stays under 22.5 (p = 0.001). Deterministic: fixed keys."""
    from gdtool.core import sampling
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
    m = 4000
    index = torch.arange(m)
    fixed = torch.full((m,), 3)
    for prompt, sample, token in ((index, fixed, fixed), (fixed, index, fixed), (fixed, fixed, index)):
        scores = probs.log()[None].expand(m, -1)
        p = torch.softmax(scores[0], dim=-1).double()
        chosen = sampling.choose_keyed(scores, 2024, prompt, sample, token)
        counts = torch.bincount(chosen, minlength=len(probs)).double()
        expected = m * p
        assert ((counts - expected).abs() <= 4.5 * (expected * (1 - p)).sqrt()).all(), counts.tolist()
        assert ((counts - expected) ** 2 / expected).sum().item() < 22.5, counts.tolist()
    # a masked token (score -inf) is never drawn
    scores = torch.tensor([0.0, -float("inf"), 0.0])[None].expand(500, -1)
    assert not (sampling.choose_keyed(scores, 1, torch.arange(500), torch.zeros(500, dtype=torch.long),
                                      torch.zeros(500, dtype=torch.long)) == 1).any()


def _sampled_eos(model, prompts, samples, seed, n=N, **settings):
    """EOS ids drawn from a free-running sampled rollout: the lengths then vary (some 1-3 tokens, some the cap)."""
    free = gdtool.rollout(model, prompts, slots=len(prompts), max_new_tokens=n, refill="host", num_samples=samples,
                          seed=seed, eos_token_id=None, **settings)
    rng = random.Random(seed)
    rows = [s.tokens.tolist() for s in free.sequences]
    keep = set(rng.sample(range(len(rows)), 3))
    eos = {rows[i][rng.randrange(3)] for i in rng.sample(range(len(rows)), len(rows) // 3)} - \
        {t for i in keep for t in rows[i]}
    return sorted(eos)


@pytest.mark.parametrize("name,dtype", [("tiny-llama", torch.float64), ("tiny-qwen2", torch.float32)],
                         ids=["llama-f64", "qwen2-f32"])
def test_host_sampling_does_not_depend_on_slots(name, dtype):
    """Sampling with temperature, top-k, top-p and a repetition penalty, 3 samples of 7 ragged prompts, EOS ids that
    end some sequences early: at 1, 2, 3, 5 and 25 slots each (prompt, sample) gets the same tokens. float64: the
    same log-probabilities bit for bit (measured); float32: the batched forward rounds differently with the slot
    count, so log-probabilities within 1e-4 (measured up to 1.4e-5) and the tokens equal for these seeds."""
    model = _lively(name, dtype=dtype)
    prompts = _prompts(model, 7, seed=31)
    eos = _sampled_eos(model, prompts, 3, seed=5, **SAMPLING)
    runs = {slots: gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host", num_samples=3,
                                  seed=5, eos_token_id=eos, **SAMPLING) for slots in (1, 2, 3, 5, 25)}
    ref = runs[1].sequences
    assert [(s.prompt_index, s.sample_index) for s in ref] == [(p, k) for p in range(7) for k in range(3)]
    lengths = [s.length for s in ref]
    assert min(lengths) <= 3 and max(lengths) == N and len(set(lengths)) > 2
    assert {s.finish_reason for s in ref} == {"eos", "length"}
    for slots, out in runs.items():
        assert out.slots == min(slots, 21)   # 25 slots: 21 rows, one per sequence
        assert out.prefilled_rows == 21 and out.row_steps == out.prefilled_rows + out.slots * out.decode_steps
        for a, b in zip(ref, out.sequences):
            assert (a.prompt_index, a.sample_index, a.finish_reason) == (b.prompt_index, b.sample_index,
                                                                         b.finish_reason)
            assert torch.equal(a.tokens, b.tokens), (slots, a.prompt_index, a.sample_index)
            if dtype == torch.float64:
                assert torch.equal(a.logprobs, b.logprobs)
            else:
                assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-4
    assert len({s.slot for s in runs[5].sequences}) == 5  # the sequences did run in different slots


def test_host_sampling_seeds_and_samples():
    """The same seed gives the same rollout (and leaves the global generator alone); another seed another one;
    the samples of one prompt differ."""
    model = _lively("tiny-llama")
    prompts = _prompts(model, 4, seed=37)

    def run(seed):
        out = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill="host", num_samples=3, seed=seed,
                             eos_token_id=None, **SAMPLING)
        return [(s.tokens.tolist(), s.logprobs.tolist()) for s in out.sequences]

    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first = run(5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert run(5) == first
    other = run(6)
    assert sum(a[0] != b[0] for a, b in zip(first, other)) >= len(first) - 1
    for p in range(len(prompts)):
        samples = [tuple(first[3 * p + k][0]) for k in range(3)]
        assert len(set(samples)) == 3, p
    # a seed above 2**64 is taken mod 2**64
    assert run(5 + 2 ** 64) == first


def _keyed_reference(model, prompt, seed, prompt_index, sample_index, n, eos, temperature, top_k, top_p,
                     repetition_penalty):
    """A plain loop: the model on the whole growing sequence (no cache), transformers' own logits processors in
    generate()'s order, and the keyed exponential race over the Python-int hash above."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    processors = [RepetitionPenaltyLogitsProcessor(repetition_penalty), TemperatureLogitsWarper(temperature),
                  TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]
    ids, tokens, logprobs = list(prompt), [], []
    vocab = model.config.get_text_config().vocab_size
    for t in range(n):
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[:, -1].float()
        for proc in processors:
            scores = proc(torch.tensor([ids]), scores)
        probs = torch.softmax(scores[0], dim=-1).double()
        race = torch.tensor([-math.log(_uniform_ref(seed, prompt_index, sample_index, t, v)) for v in range(vocab)],
                            dtype=torch.float64)
        token = int(torch.argmax(probs / race))
        tokens.append(token)
        logprobs.append(torch.log_softmax(scores[0], dim=-1)[token].item())
        ids.append(token)
        if token in eos:
            break
    return tokens, logprobs


def test_host_sampling_equals_keyed_reference():
    """slots=1, one prompt: each of its samples is what the plain reference loop draws with the same keyed noise."""
    model = _lively("tiny-llama")
    prompt = _prompts(model, 1, seed=41, lengths=(5, 5))[0]
    settings = dict(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.3)
    free = gdtool.rollout(model, [prompt], slots=1, max_new_tokens=N, refill="host", num_samples=2, seed=9,
                          eos_token_id=None, do_sample=True, pad_token_id=0, **settings)
    eos = [free.sequences[1].tokens[6].item()]  # sample 1 ends at its 7th token (unless its token shows up earlier)
    out = gdtool.rollout(model, [prompt], slots=1, max_new_tokens=N, refill="host", num_samples=2, seed=9,
                         eos_token_id=eos, do_sample=True, pad_token_id=0, **settings)
    assert out.sequences[1].length < N
    for seq in out.sequences:
        tokens, logprobs = _keyed_reference(model, prompt, 9, 0, seq.sample_index, N, eos, **settings)
        assert seq.tokens.tolist() == tokens
        assert (seq.logprobs.double() - torch.tensor(logprobs, dtype=torch.float64)).abs().max().item() <= 1e-9


@pytest.mark.slow  # one seed per family (the suite's time on 2 cores): the family varies the draw too
@pytest.mark.parametrize("name,seed", [(name, seed) for seed, name in enumerate(FAMILIES)])
def test_host_sweep_long(name, seed):
    model = _lively(name)
    prompts = _prompts(model, 16, seed=100 + seed, lengths=(1, 14))
    n = 24
    for case, settings in _eos_cases(model, prompts, seed=seed, n=n).items():
        for slots in (1, 4, 7, 20):
            out = gdtool.rollout(model, prompts, slots=slots, max_new_tokens=n, refill="host", **settings)
            _assert_alone(model, prompts, out, n=n, **settings)


TEMPERATURE = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, pad_token_id=0)


def _teacher_forced(model, prompt, tokens, temperature):
    """What a trainer recomputes: the float32 log-softmax of the logits over the temperature at each token of the
    response, from one forward over prompt + response."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:].to(torch.float32)
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("refill", ["off", "host", "device"])
def test_temperature_logprobs_are_what_a_trainer_recomputes(refill):
    """return_logprobs="temperature": each token's log-probability under softmax(logits / temperature) alone (no
    penalty, top-k or top-p), the distribution a PPO/GRPO trainer recomputes: equal to its teacher-forced forward
    to float32 rounding of the logits (float64 model), and different from the processed ones."""
    model = _lively("tiny-llama")
    prompts = _prompts(model, 5, seed=41)
    common = dict(max_new_tokens=N, num_samples=2, seed=3, eos_token_id=None, **TEMPERATURE)
    out = gdtool.rollout(model, prompts, slots=3, refill=refill, return_logprobs="temperature", **common)
    processed = gdtool.rollout(model, prompts, slots=3, refill=refill, **common)
    moved = 0
    for seq, other in zip(out.sequences, processed.sequences):
        assert torch.equal(seq.tokens, other.tokens)      # what is recorded does not change what is drawn
        ref = _teacher_forced(model, prompts[seq.prompt_index], seq.tokens.tolist(), 0.7)
        assert (seq.logprobs - ref).abs().max().item() <= 1e-6
        moved += int((seq.logprobs - other.logprobs).abs().max().item() > 1e-3)
    assert moved >= len(out.sequences) // 2     # top-k, top-p and the penalty move most sequences' figures


def test_temperature_logprobs_of_decode_are_generates_raw_logits():
    """gdtool.decode(return_logprobs="temperature"), captured modes' twins included, is log_softmax of generate()'s
    raw logits (`output_logits`) over the temperature, bit for bit."""
    model = _lively("tiny-qwen2")
    prompts = _prompts(model, 3, seed=43)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(7)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=N, cache_implementation="static",
                         disable_compile=True, output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                         **TEMPERATURE)
    tokens = ref.sequences[:, width:]
    expected = torch.stack([torch.log_softmax(l / 0.7, dim=-1).gather(1, tokens[:, j:j + 1])[:, 0]
                            for j, l in enumerate(ref.logits)], dim=1)
    for mode in gdtool.MODES:
        out = gdtool.decode(model, ids, mask, max_new_tokens=N, mode=mode, seed=7, eos_token_id=None,
                            return_logprobs="temperature", **TEMPERATURE)
        assert torch.equal(out.tokens, tokens) and torch.equal(out.logprobs, expected), mode
    # a Decoder keeps one engine per kind: switching back and forth gives each its own figures
    dec = gdtool.Decoder(model, "step-graph", max_new_tokens=N, eos_token_id=None, return_logprobs="temperature",
                         **TEMPERATURE)
    assert torch.equal(dec.generate(ids, mask, seed=7).logprobs, expected)
    processed = dec.configure(return_logprobs=True).generate(ids, mask, seed=7).logprobs
    assert not torch.equal(processed, expected)
    assert torch.equal(dec.configure(return_logprobs="temperature").generate(ids, mask, seed=7).logprobs, expected)


@pytest.mark.parametrize("refill", ["off", "host", "device"])
def test_weights_updated_in_place_are_seen(refill):
    """An RL loop updates the weights in place between rollouts: the next rollout (through a Decoder, whose
    graphs live across calls) decodes with the new weights, each sequence generate() alone on them."""
    model = _lively("tiny-llama", dtype=torch.float64)
    prompts = _prompts(model, 4, seed=47)
    dec = gdtool.Decoder(model, "step-graph", max_new_tokens=N, eos_token_id=None, pad_token_id=0,
                         return_logprobs=True)
    before = gdtool.rollout(dec, prompts, slots=2, refill=refill)
    saved = model.lm_head.weight.detach().clone()
    try:
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        after = gdtool.rollout(dec, prompts, slots=2, refill=refill)
        if refill != "off":
            _assert_alone(model, prompts, after, eos_token_id=None, pad_token_id=0)
        else:   # static batches: generate() on each batch of 2, left-padded
            batches = _generate_batches(model, prompts, 2, 1, None, eos_token_id=None, pad_token_id=0)
            expected = [row.tolist() for tokens, _, _ in batches for row in tokens]
            assert [seq.tokens.tolist() for seq in after.sequences] == expected
        assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(before.sequences, after.sequences))
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(saved)


def test_compiled_kernels_per_row():
    """kernels="compiled": the decode step over the per-row write and a refill's prefill, each one inductor
    program. Every mode and both
    policies give the same bits as its eager run (one program); against HF's kernels the same tokens, with
    log-probabilities to float32 rounding (the fused log-softmax; measured 6.6e-7). Another rollout of the same
    slots and cache columns, with more prompts or another seed, compiles nothing."""
    from gdtool.kernels import compiled
    model = _lively("tiny-llama")
    compiled.forget(model)
    prompts = _prompts(model, 6, seed=3)
    settings = _eos_cases(model, prompts, seed=1)["tail"]
    hf = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill="host", **settings)
    twin = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill="host", kernels="compiled", **settings)
    for a, b in zip(hf.sequences, twin.sequences):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.logprobs - b.logprobs).abs().max().item() <= 1e-5
    for refill, mode in [("host", "step-graph"), ("device", "eager"), ("device", "step-graph"),
                         ("device", "device-loop")]:
        out = gdtool.rollout(model, prompts, slots=3, max_new_tokens=N, refill=refill, mode=mode, kernels="compiled",
                             **settings)
        _assert_same_sequences(twin, out)
    table = compiled.compiles(model).set_index("step")
    # one prefill program per refill size that ran, and the decode step's, each compiled once
    assert len(hf.refill_sizes) >= 2 and set(table.compiles) == {1}
    assert table.calls.to_dict() == {**{f"rows_prefill_g{g}_w9_s3_c19_n10_greedy": 5 * n
                                        for g, n in hf.refill_sizes.items()},
                                     "rows_decode_s3_c19_n10_greedy": 5 * hf.decode_steps}
    more = prompts + prompts[:3]   # more prompts, the same slots and cache columns: the same programs
    out = gdtool.rollout(model, more, slots=3, max_new_tokens=N, refill="device", kernels="compiled", **settings)
    assert [s.tokens.tolist() for s in out.sequences[:6]] == [s.tokens.tolist() for s in twin.sequences]
    table = compiled.compiles(model)
    assert set(table.compiles) == {1} and len(table) == 1 + len(hf.refill_sizes.keys() | out.refill_sizes.keys())
    for seed in (1, 2):   # keyed sampling: the seed is a buffer, not a constant of the program
        args = dict(slots=3, max_new_tokens=N, refill="host", seed=seed, eos_token_id=None, **TEMPERATURE)
        ref = gdtool.rollout(model, prompts, **args)
        out = gdtool.rollout(model, prompts, kernels="compiled", **args)
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(ref.sequences, out.sequences))
    assert set(compiled.compiles(model).compiles) == {1}


def test_fast_kernels_per_row_without_triton():
    """kernels="fast" with refill: the compiled row step, plus gdtool's split-KV attention over each row's mask
    where Triton runs (tests/test_rollout_cuda.py). Without it the plan says why, and the step is the compiled
    one's program (the same entry of the model's table: nothing compiled again), so the same bits, in every mode
    of both policies."""
    from gdtool.kernels import attention, compiled
    model = _lively("tiny-llama")
    compiled.forget(model)
    split, note = attention.split_kv_plan(model, "fast")
    assert not split and "no Triton" in note
    prompts = _prompts(model, 5, seed=4)
    settings = _eos_cases(model, prompts, seed=2)["tail"]
    twin = gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", kernels="compiled", **settings)
    for refill, mode in [("host", "eager"), ("device", "step-graph")]:
        out = gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill=refill, mode=mode, kernels="fast",
                             **settings)
        _assert_same_sequences(twin, out)
    table = compiled.compiles(model)
    assert set(table.compiles) == {1} and len(table) == 1 + len(twin.refill_sizes)   # the compiled run's programs


def test_compiled_row_write_stays_in_place():
    """The per-row cache write compiles to a write of the new columns alone. A `scatter_` (or a write through a
    slice) into the cache compiled to a copy of the whole cache and a copy back at every layer and step: 1.4-1.9x
    the static step on an H100. Read from inductor's generated code: no loop spans a whole cache tensor."""
    from torch._inductor.utils import run_and_get_code
    from gdtool.kernels import compiled
    model = _lively("tiny-llama")
    compiled.forget(model)
    config = model.config.get_text_config()
    prompts = _prompts(model, 4, seed=6)
    slots, columns = 3, max(map(len, prompts)) + N
    heads = config.num_key_value_heads
    numel = slots * heads * columns * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    out, codes = run_and_get_code(lambda: gdtool.rollout(model, prompts, slots=slots, max_new_tokens=N, refill="host",
                                                         kernels="compiled", eos_token_id=None, pad_token_id=0))
    # the decode step's program and a prefill's per refill size that ran (3 rows, then 1)
    assert out.useful_tokens == 4 * N and out.refill_sizes == {3: 1, 1: 1} and len(codes) == 3
    for code in codes:
        assert f"{numel}L" not in code, "a loop over a whole cache tensor: the write is not in place"
        assert f"{slots * heads * columns}L" not in code


def test_compiled_row_step_refuses_a_dispatch_mode():
    """Under a TorchDispatchMode (a capture's watching warm-up is one) dynamo skips the compiled step's function and
    marks its code to run uncompiled for good; the step refuses to be called there, naming the mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = _lively("tiny-llama")
    prompts = _prompts(model, 3, seed=5)
    with Passthrough(), pytest.raises(RuntimeError, match=r"ran under a TorchDispatchMode \(Passthrough\)"):
        gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", kernels="compiled",
                       eos_token_id=None, pad_token_id=0)
    out = gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", kernels="compiled",
                         eos_token_id=None, pad_token_id=0)
    assert out.useful_tokens == 3 * N


@pytest.mark.parametrize("value", ["raw", 1, "Temperature"])
def test_return_logprobs_refuses_what_it_does_not_know(value):
    model = _lively("tiny-llama")
    for call in (lambda: gdtool.rollout(model, [[5, 6]], slots=1, max_new_tokens=2, return_logprobs=value),
                 lambda: gdtool.decode(model, torch.tensor([[5, 6]]), max_new_tokens=2, return_logprobs=value),
                 lambda: gdtool.Decoder(model, max_new_tokens=2, return_logprobs=value)):
        with pytest.raises(ValueError, match=f"return_logprobs={value!r}: use True or 'processed'"):
            call()


def test_decoder_rollout_takes_the_decoders_settings():
    model = _lively("tiny-llama", dtype=torch.float32)
    prompts = _prompts(model, 5, seed=3)
    decoder = gdtool.Decoder(model, mode="eager", max_new_tokens=6, eos_token_id=None, pad_token_id=0,
                             return_logprobs=True)
    for refill in ("off", "host", "device"):
        got = gdtool.rollout(decoder, prompts, slots=2, refill=refill)
        want = gdtool.rollout(model, prompts, slots=2, refill=refill, mode="eager", max_new_tokens=6,
                              eos_token_id=None, pad_token_id=0)
        _assert_same_sequences(got, want)
    targets = [1, 2, 3, 4, 5]
    out = gdtool.rollout(decoder, prompts, slots=2, refill="device", eos_token_id=1, target_lengths=targets)
    assert [s.length for s in out.sequences] == targets


def test_interrupt_keeps_the_finished_sequences():
    model = _lively("tiny-llama", dtype=torch.float32)
    prompts = _prompts(model, 6, seed=4)
    seen = []

    def stop_at_third(seq):
        seen.append(seq)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        gdtool.rollout(model, prompts, slots=2, max_new_tokens=N, refill="host", eos_token_id=1, pad_token_id=0,
                       target_lengths=[2, 5, 3, 9, 1, 4], on_finished=stop_at_third)
    partial = caught.value.output
    assert isinstance(caught.value, gdtool.RolloutInterrupted)
    assert len(partial.sequences) >= 3 and len(partial.sequences) < len(prompts)
    assert {s.prompt_index for s in seen} <= {s.prompt_index for s in partial.sequences}
