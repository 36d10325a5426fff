"""kernels="compiled" on a CPU: the sort-free sampler against generate()'s order, and the compiled step.

Compiling takes tens of seconds on a small CPU: one compile runs by default (greedy step-graph), the
others are marked slow.
"""
import contextlib
import warnings

import pytest
import torch

import gdtool
import gdtool.kernels.fuse
from gdtool.loops.decode import WARMUP_STEPS
import gdtool.core.step
from gdtool.kernels import step as fast, sampling as fast_sampling
from gdtool.measure import accuracy
from gdtool.core import sampling
from gdtool.core.settings import Settings

# Compile counts (fast.compiles) depend on what torch._dynamo already holds in the process, and some tests
# here reset it: under pytest-xdist these tests, and test_fast_kernels.py's, run on one worker, in file order.
pytestmark = pytest.mark.xdist_group("dynamo")

NEG = -float("inf")


def _settings(**kw):
    base = dict(max_new_tokens=4, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                eos_token_id=(), pad_token_id=0)
    base.update(kw)
    return Settings(**base)


def _kept(values, ids, vocab):
    return torch.zeros(ids.shape[0], vocab, dtype=torch.bool).scatter_(1, ids, values > NEG)


def _reference_kept(scores, seen, settings):
    """The tokens generate()'s order keeps, top-p through a stable sort (ties in id order)."""
    scores = fast_sampling.warp(scores, seen, settings)
    scores = sampling.top_k_filter(scores, settings.top_k)
    if settings.uses_top_p:
        ordered, order = torch.sort(scores, stable=True)
        remove = ordered.softmax(-1).cumsum(-1) <= 1 - settings.top_p
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), NEG)
    return scores > NEG


@pytest.mark.parametrize("rounding", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-ties"])
def test_sampler_keeps_the_same_candidates_and_picks_the_same_token(rounding):
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 6, 4096
    for trial in range(40):
        # bf16-rounded logits tie often, at the k-th score and at the top-p boundary
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(rounding).float()
        seen = torch.rand(batch, vocab, generator=gen) < 0.02
        settings = _settings(top_k=int(torch.randint(1, 300, (1,), generator=gen)),
                             top_p=float(torch.rand(1, generator=gen)) * 0.98 + 0.02,
                             temperature=float(torch.rand(1, generator=gen)) + 0.3)
        noise = torch.empty(batch, vocab).exponential_(1, generator=gen)
        values, ids = fast_sampling.candidates(fast_sampling.warp(logits, seen, settings), settings.top_k,
                                               settings.top_p)
        assert torch.equal(_kept(values, ids, vocab), _reference_kept(logits, seen, settings)), trial
        fast_token = fast_sampling.choose(logits, seen, settings, noise)
        assert torch.equal(fast_token, fast_sampling.reference_choose(logits, seen, settings, noise)), trial
        if rounding == torch.float32:  # no ties: HF's own (unstable-sort) path agrees too
            assert torch.equal(fast_token, fast_sampling.reference_choose(logits, seen, settings, noise,
                                                                          stable_sort=False)), trial


@pytest.mark.parametrize("width", [1, 7, 66])
def test_ascending_orders_as_a_stable_sort_by_value_then_id(width):
    """The counting order is the permutation two sorts give (ids, then values stably), ties and -inf
    included, bit for bit."""
    gen = torch.Generator().manual_seed(width)
    for trial in range(30):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        # few distinct values: many ties; some -inf as a penalty or mask leaves them
        values = torch.randint(-3, 3, (batch, width), generator=gen).float() / 4
        values[torch.rand(batch, width, generator=gen) < 0.1] = NEG
        ids = torch.stack([torch.randperm(5000, generator=gen)[:width] for _ in range(batch)])
        by_id_ids, by_id = torch.sort(ids, dim=-1)
        want_values, by_value = torch.sort(values.gather(-1, by_id), dim=-1, stable=True)
        want_ids = by_id_ids.gather(-1, by_value)
        got_values, got_ids = fast_sampling.ascending(values, ids)
        assert torch.equal(got_ids, want_ids), trial
        assert torch.equal(got_values, want_values), trial


def test_top_p_cumsum_is_opaque_to_the_compiler_and_unchanged():
    """Under torch.compile the vocabulary-wide cumsum of top-p is gdtool::cumsum (inductor's scan over
    a 128k row fails on CUDA with torch 2.11); compiled or not, top_p_filter gives the same scores."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    scores = (torch.randn(3, 2000, generator=torch.Generator().manual_seed(0)) * 3).bfloat16().float()
    eager = sampling.top_p_filter(scores, 0.9)
    traced = torch.compile(lambda x: sampling.top_p_filter(x, 0.9), backend=backend, fullgraph=True)(scores)
    assert any("gdtool.cumsum" in g for g in graphs) and not any("torch.cumsum" in g for g in graphs)
    compiled = torch.compile(lambda x: sampling.top_p_filter(x, 0.9), backend="inductor", fullgraph=True)(scores)
    assert torch.equal(traced, eager) and torch.equal(compiled, eager)
    assert torch.equal(sampling.cumsum(scores, -1), scores.cumsum(-1))


def test_sampler_keeps_every_token_tied_with_the_kth():
    vocab, k = 1000, 10
    logits = torch.linspace(-5, 0, vocab)[None].clone()
    tied = torch.arange(100, 100 + k + 5)  # 15 tokens share the k-th best score, within TIE_SLACK
    logits[0, :k - 1] = torch.arange(k - 1, dtype=torch.float32) + 10
    logits[0, tied] = 5.0
    settings = _settings(top_k=k, top_p=None, repetition_penalty=None, temperature=None)
    values, ids = fast_sampling.candidates(logits, k, None)
    kept = _kept(values, ids, vocab)
    assert torch.equal(kept, sampling.top_k_filter(logits, k) > NEG)
    assert int(kept.sum()) == k - 1 + len(tied)
    assert fast_sampling.applies(settings)


def test_sampler_draws_like_the_hf_path():
    """Same generator consumption and, for the same logits, the same token as sampling.choose."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 512, generator=gen) * 2
    settings = _settings(repetition_penalty=None)
    torch.manual_seed(11)
    hf = sampling.choose(sampling.process(logits, None, settings), True)
    after_hf = torch.random.get_rng_state()
    torch.manual_seed(11)
    mine = fast_sampling.choose(logits, None, settings)
    assert torch.equal(torch.random.get_rng_state(), after_hf)
    assert torch.equal(mine, hf)


def test_sampler_applies_only_with_top_k():
    assert fast_sampling.applies(_settings())
    assert not fast_sampling.applies(_settings(top_k=None))
    assert not fast_sampling.applies(_settings(top_k=0))
    assert not fast_sampling.applies(_settings(do_sample=False, top_k=None, top_p=None, temperature=None))


def test_unknown_kernels_are_refused(load):
    model = load("tiny-llama")
    prompt = gdtool.random_prompts(model, batch=1, lengths=4)
    with pytest.raises(ValueError, match="kernels='fused' is not one of"):
        gdtool.decode(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=2, kernels="fused")


def test_each_mode_is_held_to_the_uncaptured_run_of_its_own_programs():
    """uncaptured_twin: with HF's kernels every mode is eager's; with fused kernels the modes that compile the
    forward alone are eager's, those that compile the whole step the step-graph's run with capture=False (the
    compiled keys they share: test_compiled_step_graph_matches_hf_and_compiles_once and the forward-only one)."""
    from gdtool.loops.decode import MODES
    for mode in MODES:
        assert fast.uncaptured_twin(mode, "hf") == ("eager", None)
        for kernels in ("compiled", "fast"):
            whole = mode in ("step-graph", "device-loop")
            assert fast.uncaptured_twin(mode, kernels) == (("step-graph", False) if whole else ("eager", None))
            assert (mode in fast.FORWARD_ONLY_MODES) != whole


@pytest.fixture
def model():
    # a model of its own: compiled steps are kept on the model
    return gdtool.load_model("tiny-llama", seed=0)


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, seed=5), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_compiled_step_graph_matches_hf_and_compiles_once(model, monkeypatch):
    packed = torch.zeros((), dtype=torch.int64)  # layer calls through the packed grouped-query attention,
    original = gdtool.kernels.attention.decode_attention  # counted by the compiled code itself (an in-place add)
    monkeypatch.setattr(gdtool.kernels.attention, "decode_attention", lambda *a: (packed.add_(1), original(*a))[1])
    fast.forget(model)
    prompt = gdtool.random_prompts(model, batch=3, lengths=(3, 7), seed=0)
    hf = _decode(model, prompt, mode="step-graph", do_sample=False)
    assert packed.item() == 0  # HF's kernels keep HF's attention
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled")
        again = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled")
        direct = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled", capture=False)
    assert not [w for w in caught if str(w.message).startswith("gdtool:")]  # no graph break, no recompile
    # fp32 on a CPU: inductor's fused arithmetic lands on the same greedy tokens here
    assert torch.equal(first.tokens, hf.tokens)
    assert torch.equal(again.tokens, first.tokens) and torch.equal(direct.tokens, first.tokens)
    table = fast.compiles(model)
    assert len(table) == 1 and table.compiles.iloc[0] == 1 and bool(table.fullgraph.iloc[0])
    # each decode: its steps, and the warm-up steps the graph modes run (and undo) before capture, on a CPU too
    assert table.calls.iloc[0] == 3 * (first.steps + WARMUP_STEPS)
    assert packed.item() == model.config.num_hidden_layers * table.calls.iloc[0]  # every layer, every step


@pytest.mark.slow
def test_compiled_sampling_matches_hf(model):
    prompt = gdtool.random_prompts(model, batch=3, lengths=(3, 7), seed=1)
    cases = [dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1),  # sort-free
             dict(do_sample=True, top_k=None, top_p=0.5, temperature=1.3)]                        # sorting top-p
    for settings in cases:
        hf = _decode(model, prompt, mode="step-graph", **settings)
        compiled = _decode(model, prompt, mode="step-graph", kernels="compiled", **settings)
        assert torch.equal(compiled.tokens, hf.tokens), settings


@pytest.mark.slow
def test_compiled_forward_in_eager_and_forward_graph(model):
    prompt = gdtool.random_prompts(model, batch=2, lengths=(4, 6), seed=2)
    hf = _decode(model, prompt, mode="eager", do_sample=False)
    for mode in ("eager", "forward-graph"):
        out = _decode(model, prompt, mode=mode, do_sample=False, kernels="compiled")
        assert torch.equal(out.tokens, hf.tokens), mode
    table = fast.compiles(model)
    assert list(table.step) == ["forward_b2_w6_c13"] and table.compiles.iloc[0] == 1  # both modes share it


@pytest.mark.slow
def test_compare_kernels_reports_agreement(model):
    df = accuracy.compare_kernels(model, batch=2, prompt_len=5, steps=6)
    assert list(df.position) == [1, 2, 3, 4, 5]
    assert (df.top1_agreement == 1.0).all()
    assert (df.max_abs_logit_diff < 1e-4 * df.max_abs_logit.clip(lower=1)).all()  # fp32 rounding only
    assert df.compiled_step_ms.iloc[0] > 0 and df.hf_step_ms.iloc[0] > 0


def _storages(model):
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def test_fused_projections_keep_hf_bits_and_memory():
    model = gdtool.load_model("tiny-qwen2", seed=0)  # q/k/v with biases
    prompt = gdtool.random_prompts(model, batch=3, lengths=(3, 7), seed=0)
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, mode="step-graph", return_scores=True,
              do_sample=True, top_k=20, seed=4)
    before = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)
    names = {name: p.clone() for name, p in model.named_parameters()}
    bytes_before = sum(_storages(model).values())
    assert gdtool.kernels.fuse.fuse_projections(model) == 4  # 2 layers x (q/k/v, gate/up)
    assert gdtool.kernels.fuse.fuse_projections(model) == 0
    assert sum(_storages(model).values()) == bytes_before  # one buffer per group, the Linears view it
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.bias.untyped_storage().data_ptr() == attn.q_proj.bias.untyped_storage().data_ptr()
    assert all(torch.equal(p, names[name]) for name, p in model.named_parameters())
    after = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)
    assert torch.equal(after.tokens, before.tokens)
    assert all(torch.equal(a, b) for a, b in zip(after.scores, before.scores))  # HF's kernels, same bits


def test_fused_projections_trace_one_matmul_per_group():
    model = gdtool.load_model("tiny-llama", seed=0)
    ids = gdtool.random_prompts(model, batch=2, lengths=4).input_ids
    linears = []

    def count_linears(gm, example_inputs):
        linears.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)))
        return gm.forward

    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        torch._dynamo.reset()
        assert torch.equal(torch.compile(lambda: model(input_ids=ids).logits, backend=count_linears)(), reference)
        gdtool.kernels.fuse.fuse_projections(model)
        torch._dynamo.reset()
        elsewhere = torch.compile(lambda: model(input_ids=ids).logits, backend=count_linears)()
        torch._dynamo.reset()
        with gdtool.kernels.attention.scope():  # as inside gdtool's compiled step
            fused = torch.compile(lambda: model(input_ids=ids).logits, backend=count_linears)()
    # per layer q,k,v,o,gate,up,down -> qkv,o,gate_up,down; + lm_head; another compile of the model is untouched
    assert linears == [2 * 7 + 1, 2 * 7 + 1, 2 * 4 + 1]
    assert torch.equal(elsewhere, reference)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].self_attn.k_proj._gdtool_pending is None  # nothing left behind


@pytest.mark.slow
def test_compiled_step_with_fused_projections(model):
    prompt = gdtool.random_prompts(model, batch=3, lengths=(3, 7), seed=0)
    hf = _decode(model, prompt, mode="step-graph", do_sample=False)
    gdtool.kernels.fuse.fuse_projections(model)
    compiled = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled")
    assert torch.equal(compiled.tokens, hf.tokens)
    assert fast.compiles(model).compiles.sum() == 1


@pytest.mark.slow
def test_a_graph_break_falls_back_with_a_warning(model, monkeypatch):
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 5), seed=0)
    hf = _decode(model, prompt, mode="step-graph", do_sample=False)
    update = gdtool.core.step.Step.update

    def update_with_a_break(self, next_tokens):
        torch._dynamo.graph_break()
        return update(self, next_tokens)

    monkeypatch.setattr(gdtool.core.step.Step, "update", update_with_a_break)
    with pytest.warns(UserWarning, match="could not be compiled as one graph"):
        out = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled")
    assert torch.equal(out.tokens, hf.tokens)
    table = fast.compiles(model)
    assert not table.fullgraph.iloc[0] and table.note.iloc[0].startswith("graph break")


def test_compiled_step_on_sliding_windows_compiles_once_per_window_phase():
    """A sliding layer's Python counter picks its update branch, and dynamo specializes on it: the counters are
    pinned on their phase's side of "full", so a decode whose window fills midway compiles two steps, once each."""
    model = gdtool.load_model("tiny-gemma3", seed=0)  # sliding layers (window 8) beside a full one
    fast.forget(model)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=3)  # the window fills at decode step 2
    hf = _decode(model, prompt, mode="step-graph", do_sample=False, max_new_tokens=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled", max_new_tokens=7)
        again = _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled", max_new_tokens=7)
    assert not [w for w in caught if str(w.message).startswith("gdtool:")]  # no graph break, no recompile
    assert torch.equal(first.tokens, hf.tokens) and torch.equal(again.tokens, first.tokens)  # fp32 CPU: same tokens
    table = fast.compiles(model)
    assert sorted(table.step.str.extract(r"windows(\d+)of")[0].astype(int)) == [0, 1]  # not full, then full
    assert (table.compiles == 1).all() and table.fullgraph.all()


@pytest.mark.slow  # ~21 s on 2 cores (inductor compiles, cold cache)
def test_compiled_eager_mode_across_a_sliding_window_edge_decodes_hf_tokens():
    """Eager mode calls the compiled forward directly each step, with nothing putting the sliding layers'
    counters back in between: each call must leave them where HF's update would (it left them pinned at
    window - 1 + 1, so the second step already rolled the window)."""
    model = gdtool.load_model("tiny-gemma3", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 5), seed=1)  # the window fills at decode step 4
    hf = _decode(model, prompt, mode="eager", do_sample=False, max_new_tokens=8)
    out = _decode(model, prompt, mode="eager", do_sample=False, max_new_tokens=8, kernels="compiled")
    assert torch.equal(out.tokens, hf.tokens)


def _full_forward_logits(model, prompt, continuation):
    """float32 logits [T, B, V] of one forward over prompt + continuation (no cache): position j's logits are
    those after continuation token j, what teacher forcing reads at step j."""
    ids = torch.cat([prompt.input_ids, continuation], dim=1)
    mask = torch.cat([prompt.attention_mask, torch.ones_like(continuation)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    width = prompt.input_ids.shape[1]
    return logits[:, width - 1:width - 1 + continuation.shape[1]].transpose(0, 1)


@pytest.mark.slow  # five compiles (three shapes, two window phases)
def test_teacher_forced_across_a_sliding_window_edge_keeps_each_step_in_its_phase():
    """Uncaptured teacher forcing over tiny-gemma3 (window 8) with prompts and continuations that cross the
    window's edge: with HF's kernels its logits are a whole-sequence forward's, and with compiled kernels they
    agree with HF's (the compiled step pins the sliding layers' Python counters for dynamo; a step that left
    them pinned put the next step in the full-window phase too early)."""
    model = gdtool.load_model("tiny-gemma3", seed=0)
    vocab = model.config.vocab_size
    for prompt_len, steps in ((4, 10), (6, 5), (7, 4)):  # the window fills at step 5, 3, 2
        prompt = gdtool.random_prompts(model, batch=2, lengths=(prompt_len, prompt_len), seed=prompt_len)
        continuation = torch.randint(3, vocab, (2, steps), generator=torch.Generator().manual_seed(steps))
        hf = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, "hf", capture=False)
        whole = _full_forward_logits(model, prompt, continuation)
        assert (hf["logits"] - whole).abs().max() < 1e-4, (prompt_len, steps)
        compiled = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, "compiled",
                                       capture=False)
        df = accuracy.agreement(hf["logits"], compiled["logits"])
        assert (df.top1_agreement == 1.0).all() and (df.max_abs_logit_diff < 1e-4).all(), (prompt_len, steps, df)


def test_teacher_forced_warms_up_and_captures_as_the_decode_loops_do(monkeypatch):
    """The capture path of teacher forcing, on a CPU (streams and the graph stood in for): the first warm-up
    step is watched for host reads with HF's kernels only. Watched, a compiled step ran eagerly (dynamo
    compiles nothing under the watching dispatch mode): its host constants went unrecorded, and on the GPU
    gpt-oss's eager mask (`torch.tensor(0.0, device=...)`) then failed inside the capture."""
    from gdtool.core import graphs

    class Stream:
        def wait_stream(self, other):
            pass
    watched, captured = [], []

    class Graph(graphs.Uncaptured):
        def __init__(self, fn, device, pool=None, keep_graph=False, model=None, constants=None):
            super().__init__(fn)
            with graphs.HostConstants(constants):  # as Captured runs the step inside torch.cuda.graph
                fn()
            captured.append(constants)
    real_warm_up = graphs.warm_up
    monkeypatch.setattr(graphs, "can_capture", lambda device: True)
    monkeypatch.setattr(graphs, "side_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(graphs, "warm_up", lambda fn, steps, model=None, before=None:
                        watched.append(model) or real_warm_up(fn, steps, model, before))
    monkeypatch.setattr(graphs, "capture", Graph)
    model = gdtool.load_model("tiny-llama", seed=0)
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=1)
    continuation = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    logits = {}
    for kernels in ("hf", "compiled"):
        watched.clear()
        logits[kernels] = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation,
                                              kernels)["logits"]
        assert watched == [model if kernels == "hf" else None, None] and len(captured) > 0, (kernels, watched)
    table = fast.compiles(model)
    assert (table.compiles == 1).all() and table.fullgraph.all() and (table.note == "").all(), table
    df = accuracy.agreement(logits["hf"], logits["compiled"])
    assert (df.top1_agreement == 1.0).all() and (df.max_abs_logit_diff < 1e-4).all(), df


def test_accuracy_measures_against_float32_and_leaves_the_model_as_it_was(monkeypatch):
    """accuracy(): bf16 tiny-llama with HF's kernels lands near float32 but not on it; the model comes back
    in bf16 with the same weights, bit for bit; a float32 or fused model is refused with the reason."""
    model = gdtool.load_model("tiny-llama", seed=0, dtype=torch.bfloat16)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    calls = []
    forced = accuracy.teacher_forced
    monkeypatch.setattr(accuracy, "teacher_forced", lambda m, *a: calls.append((next(m.parameters()).dtype, a[-1]))
                        or forced(m, *a))
    df = accuracy.accuracy(model, batch=2, prompt_len=6, steps=5, kernels="hf")
    # the float32 reference runs uncaptured (HF's float32 experts copy from the host: no graph holds them)
    assert calls == [(torch.bfloat16, None), (torch.float32, False)], calls
    assert list(df.position) == [1, 2, 3, 4] and (df.hf_top1 == 1.0).all(), df
    assert (df.hf_mean_error > 0).all() and (df.hf_max_error < 0.02 * df.max_abs_logit).all(), df
    after = model.state_dict()
    assert all(after[name].dtype == p.dtype and torch.equal(after[name], p) for name, p in before.items())
    with pytest.raises(ValueError, match="float32 already"):
        accuracy.accuracy(gdtool.load_model("tiny-llama", seed=0), steps=3)
    gdtool.kernels.fuse.fuse_projections(model)
    with pytest.raises(ValueError, match="fuse_projections"):
        accuracy.accuracy(model, steps=3)


def test_compiled_step_refuses_linear_attention_layers():
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    config = Qwen3NextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             layer_types=["linear_attention", "full_attention"], num_experts=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = gdtool.random_prompts(model, batch=1, lengths=4)
    with pytest.raises(gdtool.core.feed.Unsupported, match="linear-attention.*use kernels='hf'"):
        _decode(model, prompt, mode="step-graph", do_sample=False, kernels="compiled")
