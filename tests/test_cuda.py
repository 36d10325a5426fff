"""On a GPU: real capture, bit for bit equal to generate() and to the uncaptured step."""
import pytest
import torch

import gdtool
from reference import assert_same, decode, generate

pytestmark = pytest.mark.cuda

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)


@pytest.fixture(scope="module")
def llama1b():
    return gdtool.load_model("llama-1b", seed=0, device="cuda")


def test_captured_forward_logits_equal_uncaptured_bf16(llama1b):
    """The first thing to know on a new torch: does capture change the bits of HF's forward?"""
    from transformers import StaticCache
    from gdtool.core.compat import forward_kwargs, rewind
    model = llama1b
    cache_kw, _ = forward_kwargs(model)
    prompt = gdtool.random_prompts(model, batch=4, lengths=(6, 12), seed=0)
    cache = StaticCache(config=model.config, max_cache_len=40)
    width = prompt.input_ids.shape[1]
    mask = torch.zeros(4, 40, dtype=torch.long, device="cuda")
    mask[:, :width] = prompt.attention_mask
    mask[:, width] = 1
    tok = torch.randint(3, 1000, (4, 1), device="cuda")
    pos = prompt.attention_mask.sum(1, keepdim=True)
    with torch.inference_mode():
        model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, **{cache_kw: cache})

        def forward():
            return model(input_ids=tok, position_ids=pos, attention_mask=mask, logits_to_keep=1,
                         **{cache_kw: cache}).logits[:, -1].float()
        eager = forward()
        rewind(cache, width)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        rewind(cache, width)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        rewind(cache, width)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("draw", ["exponential-race", "multinomial"])
def test_sampling_draw_captures_and_matches_eager(draw):
    probs = torch.randn(8, 128256, device="cuda").softmax(-1)

    def sample():
        if draw == "multinomial":
            return torch.multinomial(probs, 1).squeeze(1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1), -1)
    torch.manual_seed(3)
    eager = [sample() for _ in range(3)]
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sample()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample()
    torch.manual_seed(3)
    replayed = []
    for _ in range(3):
        graph.replay()
        replayed.append(out.clone())
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)
    eager_race = torch.manual_seed(3) and torch.multinomial(probs, 1).squeeze(1)
    torch.manual_seed(3)
    assert torch.equal(eager_race, torch.argmax(probs / torch.empty_like(probs).exponential_(1), -1))


_TINY = {}


def _tiny(name, dtype):
    if (name, dtype) not in _TINY:
        _TINY[name, dtype] = gdtool.load_model(name, seed=0, dtype=dtype, device="cuda")
    return _TINY[name, dtype]


CASES = {
    "greedy": dict(do_sample=False),
    "sampling": SAMPLING,
    "penalty-sampling": dict(SAMPLING, repetition_penalty=1.1),
    "penalty-greedy": dict(do_sample=False, repetition_penalty=1.3),
}


MODE_POLLS = [("eager", 1), ("forward-graph", 1), ("forward-graph", 0), ("step-graph", 4), ("step-graph", 0),
              ("step-graph", "async"), ("device-loop", None)]


@pytest.mark.parametrize("mode,poll", MODE_POLLS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name,dtype", [("tiny-llama", torch.float32), ("tiny-llama", torch.bfloat16),
                                        ("tiny-qwen2", torch.bfloat16)])
def test_captured_parity_tiny(name, dtype, case, mode, poll):
    model = _tiny(name, dtype)
    prompt = gdtool.random_prompts(model, batch=4, lengths=(3, 9), seed=1)
    greedy = decode(model, prompt.input_ids, prompt.attention_mask, 16, eos_token_id=None)
    eos = sorted({int(greedy.tokens[0, 3]), int(greedy.tokens[1, 8])})
    for seed in (0, 1):
        settings = dict(CASES[case], eos_token_id=eos, pad_token_id=0)
        ref = generate(model, prompt.input_ids, prompt.attention_mask, 16, seed=seed, **settings)
        out = decode(model, prompt.input_ids, prompt.attention_mask, 16, seed=seed, mode=mode,
                     eos_poll_interval=poll, **settings)
        assert_same(out, *ref)
        if mode == "device-loop":
            assert out.captures == 1 and out.replays == 1 and out.wasted_steps == 0
        elif mode != "eager":
            assert out.captures == 1 and out.replays == out.steps


@pytest.mark.parametrize("mode", gdtool.MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_captured_parity_llama1b(llama1b, case, mode):
    prompt = gdtool.random_prompts(llama1b, batch=4, lengths=(5, 20), seed=2)
    settings = dict(CASES[case], eos_token_id=None, pad_token_id=0)
    ref = generate(llama1b, prompt.input_ids, prompt.attention_mask, 24, seed=5, **settings)
    out = decode(llama1b, prompt.input_ids, prompt.attention_mask, 24, seed=5, mode=mode, **settings)
    assert_same(out, *ref)


def test_captured_parity_llama1b_unpadded_batch(llama1b):
    """No row padded and the cache exactly full at the last step."""
    prompt = gdtool.random_prompts(llama1b, batch=2, lengths=(9, 9), seed=3)
    ref = generate(llama1b, prompt.input_ids, prompt.attention_mask, 12, eos_token_id=None)
    for mode in gdtool.MODES:
        assert_same(decode(llama1b, prompt.input_ids, prompt.attention_mask, 12, mode=mode, eos_token_id=None), *ref)


def test_third_token_eos_stops_step_graph_early(llama1b):
    prompt = gdtool.random_prompts(llama1b, batch=4, lengths=(5, 20), seed=2)
    free = decode(llama1b, prompt.input_ids, prompt.attention_mask, 3, eos_token_id=None)
    eos = sorted(set(free.tokens[:, 2].tolist()))
    n = 64
    out = decode(llama1b, prompt.input_ids, prompt.attention_mask, n, mode="step-graph", eos_token_id=eos,
                 eos_poll_interval=4)
    ref = generate(llama1b, prompt.input_ids, prompt.attention_mask, n, eos_token_id=eos)
    assert_same(out, *ref)
    assert out.tokens.shape[1] == 3
    assert out.replays < n - 1 and out.replays == 4 and out.wasted_steps == 2


def test_generator_restored_after_warmup_and_capture():
    model = gdtool.load_model("tiny-llama", seed=0, device="cuda")
    prompt = gdtool.random_prompts(model, batch=4, lengths=(3, 9), seed=4)
    settings = dict(SAMPLING, eos_token_id=list(range(3, 1000)), pad_token_id=0)
    torch.manual_seed(11)
    refs = [generate(model, prompt.input_ids, prompt.attention_mask, 16, **settings)[0] for _ in range(3)]
    after_ref = torch.rand(4, device="cuda")
    torch.manual_seed(11)
    outs = [decode(model, prompt.input_ids, prompt.attention_mask, 16, mode="step-graph", eos_poll_interval=8,
                   **settings) for _ in range(3)]
    after = torch.rand(4, device="cuda")
    for out, ref in zip(outs, refs):
        assert torch.equal(out.tokens, ref.cpu())
    assert torch.equal(after, after_ref)
    assert any(out.wasted_steps for out in outs)


def test_step_graph_syncs_only_at_polls(llama1b):
    prompt = gdtool.random_prompts(llama1b, batch=2, lengths=(5, 9), seed=2)
    out = decode(llama1b, prompt.input_ids, prompt.attention_mask, 33, mode="step-graph", eos_token_id=None,
                 eos_poll_interval=16)
    eager = decode(llama1b, prompt.input_ids, prompt.attention_mask, 33, mode="eager", eos_token_id=None)
    assert out.polls == 3 and eager.polls == 33
    assert out.host_syncs < eager.host_syncs


def _captured_with_constants(step, owner, count):
    """`step` warmed up (its host constants recorded: `count`, all pinned), then captured."""
    from gdtool.core import graphs
    constants = graphs.warm_up(step, 1, owner)
    assert len(constants) == count and all(c.is_pinned() for c in constants)
    return graphs.capture(step, torch.device("cuda"), model=owner, constants=constants)


def _replayed(graph):
    graph.replay()
    torch.cuda.synchronize()
    return graph.output


@pytest.mark.cuda
def test_host_constants_are_captured_from_pinned_memory_and_host_reads_are_named():
    from gdtool.core import graphs
    owner = torch.nn.Linear(2, 2).cuda()           # check_capturable reads the model's device
    x = torch.arange(4.0, device="cuda")
    table = torch.tensor([10.0, 20.0, 30.0, 40.0])  # a CPU tensor copied to the GPU at every call
    column = torch.tensor([1.0, 2.0])

    def step():
        # an expanded source too (PhiMoE's rotary copies `inv_freq[None, :, None].expand(B, -1, 1)`): pinning it as
        # it is fails, since several of its elements share one memory location
        wide = column[:, None].expand(2, 2).to(device="cuda").sum()
        return x + torch.tensor(0.5, device="cuda") + table.to("cuda") + wide

    graph = _captured_with_constants(step, owner, 3)
    x.add_(1.0)
    assert torch.equal(_replayed(graph), x + 0.5 + table.cuda() + 6.0)

    def reads_host():
        return x * float(x.sum())

    with pytest.raises(ValueError, match="reads a device value on the host.*test_cuda.py"):
        graphs.warm_up(reads_host, 1, owner)


@pytest.mark.cuda
def test_index_lists_made_on_the_host_are_captured_and_other_host_copies_are_named():
    """Chameleon masks its image tokens with `logits[:, :, image_token_list] = min`: indexing a CUDA tensor with a
    host list copies it to the GPU inside the op, which a graph cannot capture; HostConstants serves it as a
    pinned index tensor; a scalar assigned is made on the device, and one assigned through a device mask is
    filled, not counted (image-text models' `ids[image_mask] = 0`). A host copy it does not serve is named, with the
    model code that made it, when the capture fails."""
    from gdtool.core import graphs
    owner = torch.nn.Linear(2, 2).cuda()
    x = torch.arange(48.0, device="cuda").view(2, 3, 8)
    columns, rows = [1, 5, 6], torch.tensor([0, 1])
    grid = torch.rand(3, 8, generator=torch.Generator().manual_seed(0)) > 0.5  # a host mask over two dimensions

    def step():
        y = x.clone()
        y[:, :, columns] = -1.0
        y[y > 40.0] = 0.0  # one host value through a device mask: ATen fills through it (masked_fill_), no count
        # host masks: on the GPU torch would count their true elements with `nonzero`, a host read; served as the
        # positions they select (one pinned index tensor per dimension)
        return y[rows] + x[:, :, [True] * 4 + [False] * 4].sum() + x[:, grid].sum(-1)[:, None, None]

    graph = _captured_with_constants(step, owner, 5)
    x.add_(2.0)
    assert torch.equal(_replayed(graph), step())

    def masks_on_the_device():
        return x[x > 10.0].sum()

    with pytest.raises(ValueError, match=r"index takes a boolean mask on the device, .* at test_cuda\.py"):
        graphs.warm_up(masks_on_the_device, 1, owner)

    table = torch.tensor([1.0, 2.0])

    def copies_inside_an_op():  # a CPU tensor handed to an op that copies it (not through .to())
        return x.flatten()[:2].copy_(table)

    constants = graphs.warm_up(copies_inside_an_op, 1, owner)  # not refused: a copy made once captures fine
    with pytest.raises(graphs.CaptureError, match=r"in the warm-up step: copy_ copies a CPU tensor of shape \(2,\) "
                                                  r"to the GPU, at test_cuda\.py"):
        graphs.capture(copies_inside_an_op, torch.device("cuda"), model=owner, constants=constants)


@pytest.mark.cuda
def test_a_failed_capture_leaves_the_random_generator_usable():
    """A capture that fails half way (here: a pageable host copy, which check_capturable would have named first)
    used to leave CUDA's default generator mid-capture: every later random draw in the process raised."""
    from gdtool.core import graphs
    x = torch.zeros(4, device="cuda")
    host = torch.ones(4)

    def step():
        noise = torch.rand(4, device="cuda")
        return x.copy_(host) + noise

    graphs.warm_up(step, 1)
    torch.manual_seed(3)
    expected = torch.rand(4, device="cuda")
    torch.manual_seed(3)
    # the message names the op that broke the capture and the line that ran it, not the error leaving the capture
    with pytest.raises(graphs.CaptureError, match=r"capturing .*, at test_cuda\.py:\d+ \(step: "):
        graphs.capture(step, torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(torch.rand(4, device="cuda"), expected)  # the failed capture drew nothing

