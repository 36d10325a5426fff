"""kernels="fast" outside the fast forward: the decoder's linear layers at 1-4 rows in gdtool's matrix-vector
kernel (`gdtool/kernels/linear.py`), swapped into the compiled HF forward for the duration of each call.

On a CPU the operator is F.linear itself (the swap is what runs); under Triton's interpreter the kernel; on a
GPU (`pytest -m cuda`) the kernel captured. The kernel's float64 checks with a bias are in check_all
(tests/test_fast_kernels.py: gpt-oss-20b's q, k/v and o shapes on CUDA)."""
import pytest
import torch

import gdtool
from gdtool.kernels import linear
from gdtool.kernels import step as fast
from gdtool.measure import accuracy

import moe
from interpreter import run_interpreted

pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py


def _gpt_oss(dtype=torch.float32, device="cpu"):
    """tests/moe.py's tiny gpt-oss, its attention projections' biases drawn non-zero (HF's init leaves them 0)."""
    model = moe.build("gpt_oss", dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.bias.copy_((torch.randn(proj.bias.shape, generator=gen) * 0.1).to(proj.bias))
    return model


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def test_plan_takes_the_decoders_linear_layers_at_up_to_four_rows():
    model = _gpt_oss()
    plan = linear.plan(model, 4)
    names = [layer.name for layer in plan.layers]
    assert names == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"], names
    assert plan.applies and all(layer.applies for layer in plan.layers)
    assert plan.note() == "linear layers 8/8 in gdtool's matrix-vector kernel"
    assert not linear.plan(model, 5).applies and linear.plan(model, 5).note() == ""
    # the output embedding stays HF's, tied or not; a MoE block's own linear layers are left to the experts plan
    untied = gdtool.load_model("tiny-llama", seed=0)
    assert untied.lm_head not in [layer.module for layer in linear.plan(untied, 1).layers]
    qwen = moe.build("qwen2_moe")   # its shared expert's projections and gate are nn.Linear modules
    blocks = tuple(layer.mlp for layer in qwen.model.layers)
    kept = [layer.name for layer in linear.plan(qwen, 1, skip=blocks).layers]
    assert kept and not any(".mlp." in name for name in kept), kept
    assert any(".mlp.shared_expert_gate" in layer.name for layer in linear.plan(qwen, 1).layers)
    # a module whose forward is already replaced on the instance (a hook) keeps it, with the reason
    model.model.layers[0].self_attn.q_proj.forward = lambda x: x
    hooked = linear.plan(model, 1)
    assert hooked.note() == ("linear layers 7/8 in gdtool's matrix-vector kernel (the others HF's: a forward set on "
                             "the module itself (a hook, e.g. accelerate's offload))"), hooked.note()


def test_scope_swaps_the_forward_and_restores_it():
    model = _gpt_oss()
    plan = linear.plan(model, 1)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 1, q.in_features)
    with linear.scope(plan):
        assert "forward" in vars(q)
        inside = q(x)
    assert "forward" not in vars(q)
    assert torch.equal(inside, torch.nn.functional.linear(x, q.weight, q.bias))
    with pytest.raises(RuntimeError, match="boom"), linear.scope(plan):
        raise RuntimeError("boom")
    assert "forward" not in vars(q)


@pytest.mark.slow  # ~24 s on 2 cores (inductor compiles, cold cache)
def test_fast_step_on_cpu_calls_the_linear_operator(monkeypatch):
    """gpt-oss (attention projections with biases): the compiled HF forward calls the operator for every attention
    projection at each step, captured equals uncaptured, HF's tokens (on a CPU the operator is F.linear); the
    step's note says so; a batch over four rows keeps HF's products."""
    model = _gpt_oss()
    prompt = gdtool.random_prompts(model, batch=3, lengths=(4, 11), seed=0)   # past the window of 8
    calls = []
    usable = linear.usable
    monkeypatch.setattr(linear, "usable", lambda *t: calls.append(tuple(t[0].shape)) or usable(*t))
    hf = _decode(model, prompt)
    mine = _decode(model, prompt, kernels="fast")
    again = _decode(model, prompt, kernels="fast", capture=False)
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    assert calls and set(calls) == {(3, 64)}   # x [3 rows, hidden 64]: q, k, v; o reads [3, 4 heads x 16] too
    table = fast.compiles(model)
    row = table[table.step.str.contains("_fast")]
    assert len(row) == 1 and "linear layers 8/8 in gdtool's matrix-vector kernel" in row.kernels.iloc[0], table
    wide = gdtool.random_prompts(model, batch=5, lengths=(4, 6), seed=1)
    calls.clear()
    _decode(model, wide, kernels="fast", max_new_tokens=4)
    assert not calls


@pytest.mark.slow  # ~35 s on 2 cores (inductor compiles)
def test_fused_projections_run_as_one_product_per_group(monkeypatch):
    """After fuse_projections the q/k/v group of each layer is one call of the operator over the group's buffer
    while the step compiles (k and v take their slices); HF's tokens, captured equal to uncaptured; outside the
    step each module is HF's again, its weight a view of the buffer."""
    import random

    model = _gpt_oss()
    attn = model.model.layers[0].self_attn
    sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    rng = random.Random(31)   # seeded draws: 1-4 rows, left padding, prompts inside and past the window of 8
    cases = [(rng.randint(1, 4), (rng.randint(1, 6), rng.randint(7, 14))) for _ in range(2)]
    prompts = [gdtool.random_prompts(model, batch=b, lengths=lengths, seed=j) for j, (b, lengths) in enumerate(cases)]
    hf = [_decode(model, prompt) for prompt in prompts]
    assert gdtool.kernels.fuse.fuse_projections(model) == 2
    plan = linear.plan(model, 2)
    assert all(layer.applies for layer in plan.layers)
    assert plan.note() == "linear layers 8/8 in gdtool's matrix-vector kernel, 2 fused groups as one product each"
    weights = []
    usable = linear.usable
    monkeypatch.setattr(linear, "usable", lambda *t: weights.append(t[1].shape[0]) or usable(*t))
    for prompt, theirs in zip(prompts, hf):
        mine = _decode(model, prompt, kernels="fast")
        again = _decode(model, prompt, kernels="fast", capture=False)
        assert torch.equal(theirs.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens), prompt.input_ids.shape
    assert sum(sizes) in weights and sizes[1] not in weights and sizes[2] not in weights, (weights, sizes)
    assert attn.k_proj._gdtool_pending is None and "forward" in vars(attn.q_proj)   # fuse's forward is back
    x = torch.randn(1, 1, attn.k_proj.in_features)
    assert torch.equal(attn.k_proj(x), torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias))


def test_plan_leaves_linear_subclasses_with_their_own_forward():
    """A subclass of nn.Linear that computes something else keeps its forward (the swap would be F.linear's)."""
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)
    model = _gpt_oss()
    attn = model.model.layers[1].self_attn
    scaled = Scaled(attn.o_proj.in_features, attn.o_proj.out_features)
    attn.o_proj = scaled
    layer = next(x for x in linear.plan(model, 1).layers if x.module is scaled)
    assert not layer.applies and layer.reason == "Scaled, a subclass with a forward of its own"


@pytest.mark.slow  # ~45 s on 2 cores (Triton's interpreter)
def test_linear_kernel_under_the_interpreter_decodes_hf_tokens():
    """The operator's Triton kernel itself (Triton's interpreter): a float32 gpt-oss decodes HF's tokens with
    kernels="fast", its attention projections in the kernel, captured (on a CPU: called) equal to uncaptured."""
    code = (
        "import torch, gdtool\n"
        "from gdtool.kernels import gemv, linear\n"
        "import test_linear as t\n"
        "model = t._gpt_oss()\n"
        "prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 10), seed=2)\n"
        "calls = []\n"
        "kernel = gemv.rms_gemv\n"
        "gemv.rms_gemv = lambda *a, **k: calls.append(k.get('bias') is not None) or kernel(*a, **k)\n"
        "hf = t._decode(model, prompt, max_new_tokens=5)\n"
        "mine = t._decode(model, prompt, kernels='fast', max_new_tokens=5)\n"
        "again = t._decode(model, prompt, kernels='fast', capture=False, max_new_tokens=5)\n"
        "assert calls and all(calls), calls\n"
        "assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)\n"
        "# the operator on a seeded sweep of shapes (rows 1-4, K and N not powers of two, with and without a bias)\n"
        "import random\n"
        "from gdtool.kernels import testing\n"
        "rng = random.Random(24)\n"
        "for case in range(10):\n"
        "    m, n, k = rng.randint(1, 4), rng.randint(1, 300), rng.randint(1, 300)\n"
        "    dt, bias = rng.choice((torch.float32, torch.float16)), rng.random() < 0.7\n"
        "    r = testing.check_gemv(m, n, k, dt, 'cpu', torch.Generator().manual_seed(case), False, False, False, bias=bias)\n"
        "    assert r.ok, testing.table([r])\n"
        "print('ok')\n")
    run_interpreted(code, timeout=900)


@pytest.mark.cuda
def test_fast_step_on_cuda_linear_layers_captured_equal_uncaptured():
    """bf16 gpt-oss on the GPU at 1 and 4 rows: the attention projections in the kernel (GDTOOL_UNTESTED_KERNELS,
    set by the conftest), captured bit for bit uncaptured; teacher-forced, within rounding of kernels="compiled";
    then with q/k/v fused (one product per layer), captured bit for bit uncaptured again."""
    model = _gpt_oss(torch.bfloat16, "cuda")
    for fused, note in ((False, "linear layers 8/8"), (True, "2 fused groups")):
        if fused:
            gdtool.kernels.fuse.fuse_projections(model)   # q/k/v as one product per layer
        for batch in (1, 4):
            prompt = gdtool.random_prompts(model, batch=batch, lengths=(4, 11), seed=batch)
            captured = _decode(model, prompt, kernels="fast", max_new_tokens=16)
            direct = _decode(model, prompt, kernels="fast", capture=False, max_new_tokens=16)
            assert torch.equal(captured.tokens, direct.tokens), fused
        kernels = fast.compiles(model).query("step.str.contains('_fast')").kernels.str.contains(note)
        assert kernels.any() if fused else kernels.all(), fast.compiles(model)   # fused: the unfused steps' rows too
        if not fused:
            agreement = accuracy.compare_kernels(model, batch=2, prompt_len=8, steps=8, kernels="fast")
            assert (agreement.top1_agreement > 0.4).all(), agreement


def test_batches_the_line_gives_to_the_matmuls_keep_hf_products(monkeypatch):
    """A Llama-family model at a batch its batch line gives to the matmuls (the line moved to 2 rows, batch 3)
    runs the compiled HF forward with its own products: no matrix-vector swap there (cuBLAS measured faster past the
    line), HF's tokens; gpt-oss at the same batch, outside the fast forward's families, still takes the swap."""
    from gdtool.kernels import forward, tuning
    monkeypatch.setattr(tuning, "_override", [forward.batch_line(2)])   # as `tuning.use(...)` for the test
    model = gdtool.load_model("tiny-llama", seed=0)
    assert forward.plan(model, 3, 40).matmuls and not forward.plan(model, 2, 40).matmuls
    calls = []
    usable = linear.usable
    monkeypatch.setattr(linear, "usable", lambda *t: calls.append(tuple(t[0].shape)) or usable(*t))
    prompt = gdtool.random_prompts(model, batch=3, lengths=(4, 9), seed=3)
    assert torch.equal(_decode(model, prompt, kernels="fast").tokens, _decode(model, prompt).tokens)
    note = fast.compiles(model).kernels.iloc[-1]
    assert not calls and "HF forward compiled" in note and "linear layers" not in note, note
    oss = _gpt_oss()
    _decode(oss, gdtool.random_prompts(oss, batch=3, lengths=(4, 6), seed=4), kernels="fast", max_new_tokens=3)
    assert calls and "linear layers 8/8" in fast.compiles(oss).kernels.iloc[-1]
