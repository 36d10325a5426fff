"""Mixture-of-experts blocks in gdtool's kernels (gdtool/kernels/experts.py; kernels="fast").

On a CPU: the torch reference (what runs without Triton) against float64 and against HF's blocks of
each family; the Triton kernels themselves under Triton's CPU interpreter (float32, float16), against
float64 and against HF's blocks (the grouped kernels at 2-64 tokens too, their sorted buffer exactly, over a
seeded sweep of experts, top-k, tokens, tile heights and skewed routing); the tile tables held to the H200
sweeps they were read from;
the plan (which blocks, which path, why not); a tiny Qwen3-MoE (batch 3, and 24 for the grouped path)
and a tiny gpt-oss decoding with kernels="fast" (the operator inside the compiled HF forward), equal to
themselves uncaptured and to HF's tokens, the blocks left unpatched afterwards, and an in-place weight
update seen by the next decode.
On CUDA: the kernels in bf16/fp16 at real shapes, and the fast step captured against uncaptured
(bitwise) on each family in bf16, with its agreement with HF's kernels.
"""
import os
import random
import sys

import pytest
import torch

import gdtool
import gdtool.loops.devloop
from gdtool.kernels import experts, forward as fast_forward, step as fast, testing, triton as fast_triton
from gdtool.measure import accuracy
from interpreter import run_interpreted

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402  (tests/moe.py: tiny models of each family)

pytestmark = pytest.mark.xdist_group("dynamo")  # compile counts: see tests/test_fast.py
FAMILIES = list(moe.FIELDS)


def _decode(model, prompt, **kw):
    kw = dict(dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, mode="step-graph", do_sample=False), **kw)
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, **kw)


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (hidden states, router scores)


def _against_hf_blocks(dtype=torch.float32, tokens=(1, 3), grouped_tokens=(24,)) -> list[str]:
    """Each family's HF block against the same block through gdtool's operator (and, for the families the
    grouped kernels take, at `grouped_tokens` too); returns the failures."""
    bad = []
    for family in FAMILIES:
        model = moe.build(family, dtype=dtype)
        for m in tokens + (grouped_tokens if family in experts.GROUPED_FAMILIES else ()):
            plan = experts.plan(model, m)
            block = model.model.layers[0].mlp
            x = torch.randn(m, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(m)).to(dtype)
            with torch.no_grad():
                hf = _hidden(block(x))
                with experts.scope(plan):
                    mine = _hidden(block(x))
            err = float((hf.float() - mine.float()).abs().max() / hf.float().abs().max())
            if not plan.applies or not err < {torch.float32: 1e-5, torch.float16: 4e-3}[dtype] or "forward" in vars(block):
                bad.append(f"{family} x{m} {dtype}: relative error {err:.2e}")
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_experts_torch_reference_against_float64(dtype):
    results = testing.check_experts_all("cpu", dtype, impl="reference")
    bad = [r for r in results if not r.ok or not r.reference_error <= r.tolerance]
    assert not bad, testing.table(bad)


@pytest.mark.parametrize("oss", [False, True], ids=["qwen3-mixtral-qwen2", "gpt-oss"])
def test_the_reference_a_few_tokens_at_a_time_is_the_reference(oss, monkeypatch):
    """The checks run HF's batched_mm reference a few tokens at a time (its gather of each pair's expert weights
    took 10.5 GiB at Mixtral's 24 tokens, out of memory on an H100 shared by 8 test workers). The routing runs over
    all tokens at once, the experts chunk by chunk: exactly the experts forward of each chunk on the whole batch's
    routing (routing per chunk changed the router product's bits). Not always the whole batch's bits: bmm's
    blocking can depend on the batch (7 tokens at top-1 in float32 differ at 6 + 1), so against the one-go output
    only up to rounding, which is all the checks need (the reference sets the rounding the kernels are held to).
    A seeded sweep over tokens, top-k, tokens a chunk, dtype and the routing's forms (normed top-k, float32
    weights, a shared expert)."""
    rng = random.Random(11 + oss)
    for case in range(12):
        gen = torch.Generator().manual_seed(case)
        m, e, h, i = rng.randint(1, 11), rng.choice([4, 8]), rng.choice([32, 64]), rng.choice([16, 48])
        k, dtype = rng.randint(1, 3), rng.choice([torch.float32, torch.bfloat16])

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)
        x, router = rand(m, h), rand(e, h)
        gate_up, down = rand(e, 2 * i, h), rand(e, h, i)
        if oss:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
            rest = (False, False, None, None, None, None, (rand(e), rand(e, 2 * i), rand(e, h), 1.702, 7.0))
        else:
            shared = (rand(24, h), rand(24, h), rand(h, 24), rand(1, h)) if rng.random() < 0.5 else ()
            rest = (rng.random() < 0.5, rng.random() < 0.5, *shared)
        whole = experts.block_reference(x, router, gate_up, down, k, *rest)
        pair = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
        rows = rng.randint(1, m)
        monkeypatch.setattr(testing, "REFERENCE_GATHER_BYTES", pair * k * rows)
        chunked = testing._reference_by_rows(x, router, gate_up, down, k, *rest)
        if oss:
            _, weights, ids = experts.reference.route_reference_oss(x, router, rest[-1][0], k)
            forward, params = experts.reference.experts_reference_oss, (gate_up, rest[-1][1], down, *rest[-1][2:])
        else:
            _, weights, ids = experts.route_reference(x, router, k, rest[0], rest[1])
            forward, params = experts.reference.experts_reference, (gate_up, down)
        each = torch.cat([forward(x[r:r + rows], ids[r:r + rows], weights[r:r + rows], *params)
                          for r in range(0, m, rows)])
        if not oss and rest[2:]:
            each = each + experts.reference.shared_reference(x, *rest[2:])
        assert torch.equal(chunked, each), (case, m, k, rows)
        scale = whole.float().abs().max()
        assert (chunked.float() - whole.float()).abs().max() <= scale * (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_package_refuses_a_setting_it_only_copies():
    """gdtool.kernels.experts re-exports its modules' names; a test or probe that sets one on the package would
    change nothing the kernels read (silently), so the package refuses it and names the module(s) to set."""
    with pytest.raises(AttributeError, match=r"experts\.MAX_CHUNK is a copy of experts\.tiles\.MAX_CHUNK: set it there"):
        experts.MAX_CHUNK = 32
    with pytest.raises(AttributeError, match=r"experts\.block_reference is a copy of experts\.reference\.block_reference:"):
        experts.block_reference = None
    assert experts.MAX_CHUNK == experts.tiles.MAX_CHUNK == 4096 and experts.tiles._chunks(8192) == (4096, 2)
    experts._not_a_copy = 1   # a name of its own is the package's to hold
    assert experts._not_a_copy == 1
    del experts._not_a_copy


def test_experts_reference_equals_hf_blocks():
    """The operator's torch path (HF's batched_mm arithmetic) against HF's own blocks, each family."""
    assert not _against_hf_blocks()


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~170 s on 2 cores (Triton's interpreter)
def test_experts_triton_kernels_under_the_interpreter():
    code = ("import sys, torch\nsys.path.insert(0, 'tests')\n"
            "from gdtool.kernels import experts, testing\nimport test_experts as t\n"
            "for dt in (torch.float32, torch.float16):\n"
            "    bad = [r for r in testing.check_experts_all('cpu', dt) if not r.ok]\n"
            "    assert not bad, testing.table(bad)\n"
            "experts.tiles.MAX_CHUNK = 32  # weight rows read in several chunks; gpt-oss's in several steps and tiles\n"
            "assert experts.tiles._chunks(64) == (32, 2)\n"
            "oss = experts.OssConfig(gate_up_cols=16, down_cols=16, block_k=32, warps=4)\n"
            "bad = [r for r in testing.check_experts_all('cpu', torch.float32, seed=1, oss_config=oss) if not r.ok]\n"
            "assert not bad, testing.table(bad)\n"
            "experts.tiles.MAX_CHUNK = 4096\n"
            "g = torch.Generator().manual_seed(5)\n"
            "x, r = torch.randn(40, 64, generator=g), torch.randn(8, 64, generator=g)\n"
            "gu, d = torch.randn(8, 64, 64, generator=g) / 8, torch.randn(8, 64, 32, generator=g) / 6\n"
            "runs = [experts.block_grouped(x, r, gu, d, 2, True, False, config=c) for c in\n"
            "        (None, None, experts.GroupedConfig(block_m=32, block_n=32, block_k=32))]\n"
            "assert torch.equal(runs[0], runs[1])  # deterministic: no atomics, fixed sums\n"
            "ref = experts.block_reference(x, r, gu, d, 2, True, False)\n"
            "assert all(float((y - ref).abs().max()) < 1e-5 for y in runs), [float((y - ref).abs().max()) for y in runs]\n"
            "bad = t._against_hf_blocks(torch.float32) + t._against_hf_blocks(torch.float16)\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    run_interpreted(code, timeout=900)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
@pytest.mark.slow  # ~240 s on 2 cores (Triton's interpreter)
def test_routed_and_stacked_small_kernels_under_the_interpreter():
    """`Config.routed` (the router kernel's last program per row routes it and stores its rstd; gate/up reads
    them) and `Config.stacked` (down's k experts as one load), over a seeded sweep (six draws: each routed and
    stacked pair twice, float16 and float32; ten took 530 s on 2 cores, one draw of 8-element chunks alone 160 s,
    past the suite's budget) of tokens, experts, top-k,
    shared expert, float32 routing weights, rows per program, load chunks and the folded norm and residual:
    against float64 (`check_experts`); the routed ids and weights equal the unrouted kernels' exactly; with the
    norm folded, close to the unrouted block; a second call bitwise equal to the first, the router's counts
    back at zero; with the router's and (routed and stacked) down's early loads (`Config.router_early`,
    `down_early`: one to five chunks), bitwise equal to it."""
    code = ("import dataclasses, random, torch\nfrom gdtool.kernels import experts, testing, triton as fast_triton\n"
            "rng = random.Random(3)\n"
            "for trial in range(6):\n"
            "    e = rng.choice([4, 8, 16, 32]); k = rng.choice([1, 2, 4]); m = rng.randint(1, 6)\n"
            "    h = rng.choice([32, 64, 96]); i = rng.choice([24, 32, 40]); wf = rng.random() < 0.3\n"
            "    shared = rng.choice([0, 0, 48]); norm_topk = rng.random() < 0.5\n"
            "    cfg = experts.Config(router_rows=rng.choice([2, 4, 8]), gate_up_rows=rng.choice([2, 4, 8]),\n"
            "                         down_rows=rng.choice([1, 2, 4]), chunk=rng.choice([8, 16, 32, None]),\n"
            "                         routed=trial % 3 != 1, stacked=trial % 3 != 0)\n"
            "    plain = experts.Config(cfg.router_rows, cfg.gate_up_rows, cfg.down_rows, chunk=cfg.chunk)\n"
            "    dt = torch.float32 if trial % 2 else torch.float16\n"
            "    shape = ('sweep', m, e, h, i, k, norm_topk, wf, shared)\n"
            "    bad = [r for r in testing.check_experts(*shape, dt, 'cpu', torch.Generator().manual_seed(trial),\n"
            "                                          config=cfg) if not r.ok]\n"
            "    assert not bad, (cfg, testing.table(bad))\n"
            "    g = torch.Generator().manual_seed(100 + trial)\n"
            "    x = torch.randn(m, h, generator=g).to(dt); res = torch.randn(m, h, generator=g).to(dt)\n"
            "    args = (x, torch.randn(e, h, generator=g).to(dt) / 8, torch.randn(e, 2 * i, h, generator=g).to(dt) / 8,\n"
            "            torch.randn(e, h, i, generator=g).to(dt) / 6, k, norm_topk, wf)\n"
            "    extra = dict(shared_gate=torch.randn(shared, h, generator=g).to(dt) / 8,\n"
            "                 shared_up=torch.randn(shared, h, generator=g).to(dt) / 8,\n"
            "                 shared_down=torch.randn(h, shared, generator=g).to(dt) / 7,\n"
            "                 shared_router=torch.randn(1, h, generator=g).to(dt) / 8) if shared else {}\n"
            "    norm = (torch.rand(h, generator=g).to(dt) + 0.5, 1e-6)\n"
            "    seen, base = {}, {}\n"
            "    one = experts.block_triton(*args, config=cfg, intermediates=seen, residual=res, norm=norm, **extra)\n"
            "    two = experts.block_triton(*args, config=cfg, residual=res, norm=norm, **extra)\n"
            "    ref = experts.block_triton(*args, config=plain, intermediates=base, residual=res, norm=norm, **extra)\n"
            "    assert torch.equal(one, two), cfg\n"
            "    early = dataclasses.replace(cfg, router_early=True, down_early=cfg.routed and cfg.stacked)\n"
            "    assert torch.equal(one, experts.block_triton(*args, config=early, residual=res, norm=norm, **extra)), early\n"
            "    assert torch.equal(seen['ids'], base['ids']) and torch.equal(seen['weights'], base['weights']), cfg\n"
            "    tol = 1e-5 if dt == torch.float32 else 4e-3\n"
            "    assert float((one.float() - ref.float()).abs().max()) <= tol * float(ref.float().abs().max()), cfg\n"
            "    assert not fast_triton._COUNTS.get(('router', 'cpu'), torch.zeros(1)).any()\n"
            "# down's early tiles held in 1 to 5 chunks (4 held before the wait, the fifth loaded after it)\n"
            "for trial, (i, chunk) in enumerate(((40, 8), (32, 8), (24, 8), (16, 8), (8, 8))):\n"
            "    g = torch.Generator().manual_seed(200 + trial)\n"
            "    args = (torch.randn(2, 32, generator=g), torch.randn(8, 32, generator=g) / 8,\n"
            "            torch.randn(8, 2 * i, 32, generator=g) / 8, torch.randn(8, 32, i, generator=g) / 6, 2, True, False)\n"
            "    cfg = experts.Config(router_rows=2, gate_up_rows=4, down_rows=2, chunk=chunk, routed=True, stacked=True)\n"
            "    late = experts.block_triton(*args, config=cfg)\n"
            "    early = experts.block_triton(*args, config=dataclasses.replace(cfg, router_early=True, down_early=True))\n"
            "    assert torch.equal(late, early), (i, chunk)\n"
            "# the small kernels routed in the router (and stacked down) at every token count\n"
            "bad = [r for r in testing.check_experts_all('cpu', torch.float32, routed=True) if not r.ok]\n"
            "assert not bad, testing.table(bad)\n"
            "assert not fast_triton._COUNTS[('router', 'cpu')].any()\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_packed_top_k_picks_what_the_rounds_pick():
    """`Config.packed` (the router kernel's top-k, one max a round over (probability bits, complemented id) keys):
    over a seeded sweep of experts (4-128), top-k, tokens, dtypes and routing weights, with tied logits (experts
    sharing a router row) in half the trials, the same ids, weights and block output, bit for bit, as k rounds of
    a max and a lowest-id min. Without routed=True it is refused by name."""
    with pytest.raises(ValueError, match="routed=True"):
        experts.Config(4, 4, 2, packed=True)
    code = ("import random, torch\nfrom dataclasses import replace\nfrom gdtool.kernels import experts\n"
            "rng = random.Random(5)\n"
            "for trial in range(8):\n"
            "    e = rng.choice([4, 8, 16, 60, 128]); k = min(e, rng.choice([1, 2, 4, 8])); m = rng.randint(1, 4)\n"
            "    h, i = rng.choice([32, 64]), rng.choice([24, 32]); wf = rng.random() < 0.3\n"
            "    norm_topk = rng.random() < 0.5; dt = torch.float32 if trial % 2 else torch.float16\n"
            "    g = torch.Generator().manual_seed(trial)\n"
            "    rw = torch.randn(e, h, generator=g).to(dt) / 8\n"
            "    if trial % 2 == 0:  # tied logits: pairs of experts with the same router row\n"
            "        for a in range(0, e - 1, 3):\n"
            "            rw[a + 1] = rw[a]\n"
            "    args = (torch.randn(m, h, generator=g).to(dt), rw, torch.randn(e, 2 * i, h, generator=g).to(dt) / 8,\n"
            "            torch.randn(e, h, i, generator=g).to(dt) / 6, k, norm_topk, wf)\n"
            "    base = experts.Config(4, 4, 2, chunk=None, routed=True, stacked=True)\n"
            "    seen, ref = {}, {}\n"
            "    out = experts.block_triton(*args, config=replace(base, packed=True), intermediates=seen)\n"
            "    want = experts.block_triton(*args, config=base, intermediates=ref)\n"
            "    assert torch.equal(seen['ids'], ref['ids']), (trial, seen['ids'], ref['ids'])\n"
            "    assert torch.equal(seen['weights'], ref['weights']) and torch.equal(out, want), trial\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


@pytest.mark.skipif(not fast_triton.HAVE_TRITON, reason="Triton is not installed (a CPU build of torch has none)")
def test_grouped_align_kernel_over_a_seeded_sweep():
    """The align kernel's sorted buffer and tile owners, exactly, over drawn expert counts (up to 128, the
    chunk of pairs counted at a time shrinking with them), top-k, 1-64 tokens and tile heights 16-64, with
    routing uniform or piled on the first k experts (every token on the same experts: runs of several
    tiles); slots and tiles are first filled with 7, so any slot the kernel leaves unwritten shows."""
    code = ("import random, sys, torch\nsys.path.insert(0, 'tests')\n"
            "from gdtool.kernels import experts, testing\nfrom gdtool.kernels.triton import next_pow2, triton\n"
            "rng = random.Random(11)\n"
            "for trial in range(16):\n"
            "    e = rng.choice([2, 8, 16, 32, 60, 128]); k = min(e, rng.choice([1, 2, 4, 8])); m = rng.randint(1, 64)\n"
            "    bm = rng.choice([16, 32, 64]); gen = torch.Generator().manual_seed(trial)\n"
            "    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).int()\n"
            "    if trial % 4 == 0:\n"
            "        ids = torch.arange(k, dtype=torch.int32).repeat(m, 1)\n"
            "    slots = experts.grouped_slots(m * k, e, bm)\n"
            "    order, tiles = torch.full((slots,), 7, dtype=torch.int32), torch.full((slots // bm,), 7, dtype=torch.int32)\n"
            "    experts.align(ids, order, tiles, e, bm)\n"
            "    r = testing._check_grouped_order('sweep', f'e={e} k={k} m={m} bm={bm}', torch.float32, ids.long(), order, tiles)\n"
            "    assert r.ok, (e, k, m, bm, r.note)\n"
            "print('ok')\n")
    run_interpreted(code, timeout=600)


def test_experts_tiles_are_those_of_the_h200_sweeps():
    """The H200 file's grouped tiles, small kernels' experts_config, gpt-oss's tiles and grouped_from are what
    profiles/moe_sweep.py's rules read off the committed sweeps its provenance names: a re-sweep that moves a pick
    fails here until the file follows it (`moe_sweep.py --write-config` writes it)."""
    from gdtool.kernels import tuning
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles"))
    import moe_sweep
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h200 = tuning.read(os.path.join(tuning.CONFIG_DIR, "nvidia-h200_sm90_triton-3.6.0.json"))
    tuned_from = h200.provenance("experts_grouped")["files"]
    paths = [os.path.join(root, path) for path in tuned_from]
    assert sorted(os.path.basename(p) for p in paths) == ["gpt-oss-20b.csv", "qwen3-30b-a3b.csv"]
    rows = [row for path in paths for row in moe_sweep.load(path)]
    picks = moe_sweep.grouped_picks(rows)
    assert set(picks) == {1, 2, 4, 8, 16, 32, 64}
    for batch, pick in picks.items():
        assert experts.grouped_config(batch, h200) == experts.GroupedConfig(**pick), batch
        # float32 operands: the reduction step halved, each pipeline stage the bytes of the bf16 tile swept
        wide = experts.grouped_config(batch, h200, itemsize=4)
        assert wide == experts.GroupedConfig(**dict(pick, block_k=max(16, pick["block_k"] // 2))), batch
    small_from = [p for p in h200.provenance("experts_small")["files"] if p not in tuned_from]
    assert small_from == ["profiles/h200/moe-sweep-79cb9d0/qwen3-30b-a3b.csv"]
    newer = moe_sweep.small_picks(moe_sweep.load(os.path.join(root, small_from[0])))
    assert newer[1] == dict(router_rows=1, gate_up_rows=8, down_rows=2, warps=8, chunk=256, routed=True, stacked=True,
                            packed=True, router_warps=1, down_warps=4)
    for batch, pick in moe_sweep.small_picks([r for r in rows if r["model"] == "qwen3-30b-a3b"]).items():
        pick = newer[1] if batch == 1 else pick   # one token: the newer sweep, with the routed candidates
        config = vars(experts.experts_config(2048, 768, batch, h200))
        config["chunk"] = config["chunk"] or experts.MAX_CHUNK   # None: MAX_CHUNK
        assert {key: config[key] for key in pick} == pick, batch
    assert experts.oss_config(h200) == experts.OssConfig(**moe_sweep.small_picks(rows, "oss")[1])
    assert experts.grouped_from(h200) == moe_sweep.grouped_from(rows) == 2
    assert experts.grouped_from(h200, oss=True) == moe_sweep.grouped_from(rows, "oss") == 2


def test_each_kind_of_small_kernels_gives_way_to_the_grouped_ones_where_its_own_sweep_says():
    """The H100 sweeps: Qwen3-30B-A3B's small kernels beat the grouped ones up to 4 tokens, gpt-oss-20b's own
    kernels only at 1 (at 4: 241 against 199 us a block). The H100 file starts each where its sweep says, and the
    plan runs each family's blocks so."""
    from gdtool.kernels import tuning
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles"))
    import moe_sweep
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h100 = tuning.read(os.path.join(tuning.CONFIG_DIR, "nvidia-h100-80gb-hbm3_sm90_triton-3.6.0.json"))
    rows = [row for path in h100.provenance("experts_grouped")["files"] for row in moe_sweep.load(os.path.join(root, path))]
    assert experts.grouped_from(h100) == moe_sweep.grouped_from(rows, "small") == 5
    assert experts.grouped_from(h100, oss=True) == moe_sweep.grouped_from(rows, "oss") == 2
    assert [experts.runs_grouped("qwen3_moe", t, h100) for t in (1, 4, 5)] == [False, False, True]
    assert [experts.runs_grouped("gpt_oss", t, h100) for t in (1, 2, 4)] == [False, True, True]
    assert not experts.runs_grouped("qwen2_moe", 64, h100)   # a shared expert: the small kernels throughout


def test_experts_config_refuses_a_chunk_that_is_not_a_power_of_two():
    for chunk in (0, 1000, -512):
        with pytest.raises(ValueError, match=r"Config\(chunk=.*power of two.*None for MAX_CHUNK"):
            experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, chunk=chunk)
    assert experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, chunk=512).chunk == 512


def test_experts_config_refuses_warps_that_are_not_a_power_of_two():
    for field, value in (("warps", 3), ("router_warps", 0), ("down_warps", 64)):
        with pytest.raises(ValueError, match=rf"Config\({field}={value}\): a kernel runs a power of two of warps"):
            experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, **{field: value})
    config = experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, router_warps=1, down_warps=None)
    assert (config.router_warps, config.down_warps) == (1, None)


def test_experts_config_refuses_early_down_loads_without_the_router_s_routing():
    """Down may read the routing before its PDL wait only where the router kernel wrote it (two kernels back), into
    its stacked tiles: down_early without routed or stacked is refused, naming both."""
    for routed, stacked in ((False, True), (True, False), (False, False)):
        with pytest.raises(ValueError, match=r"down_early=True.*routed=True.*stacked=True"):
            experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, routed=routed, stacked=stacked, down_early=True)
    assert experts.Config(router_rows=1, gate_up_rows=4, down_rows=4, routed=True, stacked=True, down_early=True)


def test_plan_names_the_blocks_and_why_not():
    model = moe.build("qwen3_moe")
    plan = experts.plan(model, 3)
    assert plan.applies and plan.key() == (0, 1)
    assert plan.note().startswith("MoE blocks 2/2: layers 0-1 in gdtool's kernels (qwen3_moe, top-2 of 8, grouped")
    assert "grouped" not in experts.plan(model, 1).note()   # one token: the small kernels (grouped_from)
    table = plan.table()
    assert list(table.layer) == [0, 1] and set(table.path) == {"gdtool experts kernels"}
    for tokens in (32, experts.MAX_GROUPED_TOKENS):
        grouped = experts.plan(model, tokens)
        assert grouped.key() == (0, 1) and "(qwen3_moe, top-2 of 8, grouped, torch reference" in grouped.note()
        assert set(grouped.table().path) == {"gdtool experts kernels"}
    wide = experts.plan(model, experts.MAX_GROUPED_TOKENS + 1)
    assert not wide.applies and f"> {experts.MAX_GROUPED_TOKENS}" in wide.note() and "HF's" in wide.note()
    shared = experts.plan(moe.build("qwen2_moe"), 32)
    assert not shared.applies and "grouped kernels (up to 64) take qwen3_moe, mixtral, olmoe, gpt_oss only" in shared.note()
    model.model.layers[1].mlp.experts.has_bias = True
    mixed = experts.plan(model, 1)
    assert mixed.key() == (0,) and "layers 1 HF's (experts with has_bias=True" in mixed.note()
    assert experts.plan(gdtool.load_model("tiny-llama", seed=0), 1).note() == ""
    oss_model = gdtool.load_model("tiny-gpt-oss", seed=0)
    oss = experts.plan(oss_model, 1)
    assert oss.key() == (0, 1) and "layers 0-1 in gdtool's kernels (gpt_oss, top-2 of 8" in oss.note()
    oss_model.model.layers[0].mlp.experts.is_transposed = False
    assert "layers 0 HF's (experts with is_transposed=False" in experts.plan(oss_model, 1).note()


@pytest.mark.slow  # ~27 s on 2 cores (inductor compiles, cold cache)
def test_fast_step_on_cpu_qwen3_moe_runs_the_experts_operator(monkeypatch):
    """float32 on a CPU, batch 12 (past the fast forward's 8 rows): the compiled HF forward calls gdtool's
    operator for both MoE blocks (its torch path here), gives HF's tokens and logits within rounding, equals
    itself uncaptured, compiles once, and leaves the blocks as HF made them."""
    model = gdtool.load_model("tiny-qwen3-moe", seed=0)
    prompt = gdtool.random_prompts(model, batch=12, lengths=(4, 9), seed=0)
    calls = []
    reference = experts.block_reference
    monkeypatch.setattr(experts.reference, "block_reference", lambda *a: calls.append(a[0].shape) or reference(*a))
    hf = _decode(model, prompt)
    mine = _decode(model, prompt, kernels="fast")
    again = _decode(model, prompt, kernels="fast", capture=False)
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    assert calls and set(calls) == {(12, 64)}  # one [batch, hidden] call per block and step, nothing else
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)
    table = fast.compiles(model)
    row = table[table.step.str.endswith("_fast")]
    assert len(row) == 1 and row.compiles.iloc[0] == 1, table
    assert "MoE blocks 2/2: layers 0-1 in gdtool's kernels" in row.kernels.iloc[0]
    assert "batch 12: matrix products" in row.kernels.iloc[0]   # why the fast forward did not take it
    agreement = accuracy.compare_kernels(model, batch=2, prompt_len=6, steps=6, kernels="fast")
    assert (agreement.top1_agreement == 1.0).all() and (agreement.max_abs_logit_diff < 1e-4).all(), agreement


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fast_forward_on_cpu_runs_the_moe_families(family, monkeypatch):
    """float32 on a CPU, batch 1 and seeded draws of 2-4 and 5-8 rows and prompt lengths: the fast decode forward takes Qwen3-MoE (q/k norm), Mixtral and
    Qwen2-MoE (q/k/v biases, the shared expert): each MoE layer is RMSNorm, gdtool's experts operator and the
    residual add, HF's tokens greedy and sampled, equal uncaptured; a block the experts kernels refuse sends
    the whole model to the compiled HF forward with the layer and the reason."""
    model = moe.build(family)
    calls = []
    reference = experts.block_reference
    monkeypatch.setattr(experts.reference, "block_reference", lambda *a: calls.append(a[0].shape) or reference(*a))
    # seeded draws, per family: batch 1, one of the one-pass batches (2-4), one of two passes (5-8), each with
    # its own prompt-length range (left padding up to its spread)
    rng = random.Random(f"moe-fast-{family}")
    for batch in (1, rng.randint(2, 4), rng.randint(5, 8)):
        low = rng.randint(1, 6)
        prompt = gdtool.random_prompts(model, batch=batch, lengths=(low, low + rng.randint(0, 8)), seed=rng.randrange(99))
        calls.clear()
        mine = _decode(model, prompt, kernels="fast")
        assert calls and set(calls) == {(batch, 64)}, calls
        assert torch.equal(mine.tokens, _decode(model, prompt).tokens), batch
        assert torch.equal(mine.tokens, _decode(model, prompt, kernels="fast", capture=False).tokens), batch
        note = fast.compiles(model).kernels.iloc[-1]
        assert note.startswith("fast: fast decode forward, 2 layers") and "experts" in note, note
    sampled = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    prompt = gdtool.random_prompts(model, batch=4, lengths=(2, 11), seed=9)
    assert torch.equal(_decode(model, prompt, kernels="fast", **sampled).tokens, _decode(model, prompt, **sampled).tokens)
    if family == "qwen3_moe":   # gpt-oss's kernels fold no norm or residual in: asking is refused, not ignored
        x = torch.zeros(2, 64)
        args = experts.block_args(moe.build("gpt_oss").model.layers[0].mlp)
        with pytest.raises(ValueError, match="block_oss takes no residual or norm"):
            experts.block_triton(x, *args, residual=x)
    layer = model.model.layers[0]
    layer.pre_feedforward_layernorm = type(layer.post_attention_layernorm)(64)
    layer.post_feedforward_layernorm = type(layer.post_attention_layernorm)(64)
    assert "layer 0: an MoE block with norms around it" in fast_forward.plan(model, 1, 40).reason
    del layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
    model.model.layers[1].mlp.experts.has_bias = True
    refused = fast_forward.plan(model, 1, 40)
    assert not refused.applies and "layer 1's MoE block: experts with has_bias=True" in refused.reason


def _teacher_forced_logits(model, kernels, batch=2, steps=6, seed=1):
    prompt = gdtool.random_prompts(model, batch=batch, lengths=(3, 6), seed=seed)
    continuation = torch.randint(3, 4096, (batch, steps), generator=torch.Generator().manual_seed(seed + 1))
    return accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, kernels)["logits"]


@pytest.mark.slow  # ~70 s on 2 cores (inductor compiles, cold cache)
def test_fast_step_on_cpu_gpt_oss_runs_the_experts_operator(monkeypatch):
    """gpt-oss (transposed, interleaved, biased experts; its biases drawn non-zero here): the compiled HF
    forward, attention with sinks and sliding windows HF's own, calls gdtool's operator for both MoE blocks
    and gives HF's tokens, equal captured and uncaptured; its teacher-forced logits equal those of the
    compiled HF forward with HF's blocks (`kernels="compiled"`) within rounding."""
    model = moe.build("gpt_oss")
    prompt = gdtool.random_prompts(model, batch=3, lengths=(4, 11), seed=0)   # past the window of 8
    calls = []
    reference = experts.block_reference
    monkeypatch.setattr(experts.reference, "block_reference", lambda *a: calls.append((a[0].shape, a[-1] is not None))
                        or reference(*a))
    hf = _decode(model, prompt)
    mine = _decode(model, prompt, kernels="fast")
    again = _decode(model, prompt, kernels="fast", capture=False)
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    assert calls and set(calls) == {((3, 64), True)}
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)
    table = fast.compiles(model)
    row = table[table.step.str.contains("_fast")]   # its name goes on with the sliding windows' cache layout
    assert len(row) == 1 and row.compiles.iloc[0] == 1, table
    assert "MoE blocks 2/2: layers 0-1 in gdtool's kernels (gpt_oss" in row.kernels.iloc[0]
    diff = (_teacher_forced_logits(model, "fast") - _teacher_forced_logits(model, "compiled")).abs().max()
    assert diff < 1e-4, diff


def test_fast_step_on_cpu_grouped_batch_runs_the_experts_operator(monkeypatch):
    """Batch 24, above the small-batch kernels: the plan sends the blocks to the grouped path (its torch
    reference on a CPU, HF's arithmetic), the decode gives HF's tokens, equal captured and uncaptured."""
    model = moe.build("qwen3_moe")
    prompt = gdtool.random_prompts(model, batch=24, lengths=(3, 8), seed=4)
    calls = []
    reference = experts.block_reference
    monkeypatch.setattr(experts.reference, "block_reference", lambda *a: calls.append(a[0].shape) or reference(*a))
    hf = _decode(model, prompt, max_new_tokens=6)
    mine = _decode(model, prompt, kernels="fast", max_new_tokens=6)
    again = _decode(model, prompt, kernels="fast", capture=False, max_new_tokens=6)
    assert torch.equal(hf.tokens, mine.tokens) and torch.equal(mine.tokens, again.tokens)
    assert calls and set(calls) == {(24, 64)}
    table = fast.compiles(model)
    row = table[table.step.str.contains("_fast")]
    assert len(row) == 1 and "MoE blocks 2/2: layers 0-1 in gdtool's kernels (qwen3_moe, top-2 of 8, grouped" \
        in row.kernels.iloc[0], table


def test_fast_step_sees_an_in_place_weight_update():
    """The operator reads HF's parameters where they are: `param.data.copy_` before the next decode is what
    that decode computes (same compiled step, no recompile), as HF's own kernels see it."""
    model = moe.build("qwen3_moe")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=1)
    continuation = torch.randint(3, 4096, (2, 5), generator=torch.Generator().manual_seed(2))

    def logits(kernels):
        return accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, kernels)["logits"]
    before = logits("fast")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    after, hf_after = logits("fast"), logits("hf")
    assert (after - before).abs().max() > 1e-2
    assert (after - hf_after).abs().max() < 1e-4
    assert fast.compiles(model).compiles.sum() == 1


# -- CUDA ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_experts_kernels_on_cuda(dtype):
    results = testing.check_experts_all("cuda", dtype, large=dtype == torch.bfloat16)
    bad = [r for r in results if not r.ok]
    assert not bad, testing.table(bad)
    assert not _against_hf_blocks_cuda(dtype)


@pytest.mark.cuda
def test_experts_kernels_routed_in_the_router_on_cuda():
    """The small kernels routed in the router kernel with down stacked (`Config.routed`, `stacked`: experts_config's
    at one token) at every token count, at real shapes in bf16 against float64 (gpt-oss's and the grouped ones as
    they are); Qwen3-30B-A3B's block at one token three times with k rounds of a max and a min: bitwise the same
    (the counts back at zero); and with the packed top-k (`Config.packed`, the default), bitwise the same again."""
    results = testing.check_experts_all("cuda", torch.bfloat16, large=True, routed=True)
    bad = [r for r in results if not r.ok]
    assert not bad, testing.table(bad)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", generator=gen).bfloat16()
    args = (x, torch.randn(128, 2048, device="cuda", generator=gen).bfloat16() / 45,
            torch.randn(128, 1536, 2048, device="cuda", generator=gen).bfloat16() / 45,
            torch.randn(128, 2048, 768, device="cuda", generator=gen).bfloat16() / 28, 8, True, False)
    from dataclasses import replace
    config = replace(experts.experts_config(2048, 768, 1), routed=True, stacked=True, packed=False)
    runs = [experts.block_triton(*args, config=config) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # the packed top-k (`Config.packed`, experts_config's at one token): the same ids, weights and output as k
    # rounds of a max and a min, bit for bit
    seen, ref = {}, {}
    packed = experts.block_triton(*args, config=replace(config, packed=True), intermediates=seen)
    experts.block_triton(*args, config=config, intermediates=ref)
    assert torch.equal(seen["ids"], ref["ids"]) and torch.equal(seen["weights"], ref["weights"])
    assert torch.equal(packed, runs[0])
    assert not fast_triton._COUNTS[("router", "cuda:0")].any()


def _against_hf_blocks_cuda(dtype):
    bad = []
    for family in FAMILIES:
        model = moe.build(family, dtype=dtype, device="cuda")
        model.set_experts_implementation("batched_mm")  # generate()'s decode path
        grouped = (24, experts.MAX_GROUPED_TOKENS) if family in experts.GROUPED_FAMILIES else ()
        for m in (1, 5, experts.MAX_TOKENS) + grouped:
            block = model.model.layers[0].mlp
            x = torch.randn(m, 1, model.config.hidden_size, device="cuda", dtype=dtype)
            with torch.no_grad():
                hf = _hidden(block(x))
                with experts.scope(experts.plan(model, m)):
                    mine = _hidden(block(x))
            err = float((hf.float() - mine.float()).abs().max() / hf.float().abs().max())
            if not err < 2e-2:
                bad.append(f"{family} x{m}: {err:.2e}")
    return bad


# batch 3: the fast decode forward for the families it takes (Qwen3-MoE, Mixtral, Qwen2-MoE), the operator
# inside the compiled HF forward for the others; batch 12: that operator path for Qwen3-MoE too; batch 1: the one-token
# kernels (routed in the router kernel, stacked down) in the fast forward
CUDA_CASES = [(family, 3) for family in FAMILIES] + [("qwen3_moe", 12), ("qwen3_moe", 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("family,batch", CUDA_CASES, ids=[f"{f}-{b}" if b != 3 else f for f, b in CUDA_CASES])
def test_fast_moe_step_on_cuda_captured_equals_uncaptured(family, batch):
    model = moe.build(family, dtype=torch.bfloat16, device="cuda")
    prompt = gdtool.random_prompts(model, batch=batch, lengths=(5, 12), seed=0)
    captured = _decode(model, prompt, kernels="fast", max_new_tokens=24)
    direct = _decode(model, prompt, kernels="fast", max_new_tokens=24, capture=False)
    assert captured.replays == captured.steps > 0
    assert torch.equal(captured.tokens, direct.tokens)
    sampled = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=5)
    assert torch.equal(_decode(model, prompt, kernels="fast", **sampled).tokens,
                       _decode(model, prompt, kernels="fast", capture=False, **sampled).tokens)
    assert not any("forward" in vars(layer.mlp) for layer in model.model.layers)
    table = fast.compiles(model)
    tail = table.kernels.str.contains("argmax, update and counters in one kernel")  # greedy: nothing compiled
    assert (table.compiles == (~tail).astype(int)).all(), table
    assert tail.any() == fast_forward.plan(model, batch, 64).applies, table
    if fast_forward.plan(model, batch, 64).applies:
        assert all(note.startswith("fast: fast decode forward") and "experts" in note and "Triton kernels" in note
                   for note in table.kernels), table
    else:
        assert all("MoE blocks 2/2: layers 0-1 in gdtool's kernels" in note and "Triton" in note
                   for note in table.kernels), table
    if gdtool.loops.devloop.device_loop_support() is None:
        loop = _decode(model, prompt, kernels="fast", max_new_tokens=24, mode="device-loop")
        assert torch.equal(loop.tokens, captured.tokens)
    if family == "gpt_oss":  # against the compiled HF forward with HF's blocks (see the CPU test)
        agreement = accuracy.agreement(_teacher_forced_logits(model, "compiled", steps=8),
                                   _teacher_forced_logits(model, "fast", steps=8))
    else:
        agreement = accuracy.compare_kernels(model, batch=2, prompt_len=8, steps=8, kernels="fast")
    assert (agreement.top1_agreement > 0.4).all(), agreement


@pytest.mark.cuda
def test_fast_moe_step_on_cuda_sees_an_in_place_weight_update():
    """The captured graph reads HF's parameters' storage: an update in place is seen by the next replay."""
    model = gdtool.load_model("tiny-qwen3-moe", seed=0, device="cuda")
    prompt = gdtool.random_prompts(model, batch=2, lengths=(3, 6), seed=1)
    continuation = torch.randint(3, 4096, (2, 6), generator=torch.Generator().manual_seed(2))

    def logits(kernels):
        return accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, kernels)["logits"]
    before = logits("fast")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.data.copy_(torch.randn_like(layer.mlp.experts.down_proj) * 0.2)
    after = logits("fast")
    assert (after - before).abs().max() > 1e-2
    assert (accuracy.compare_kernels(model, batch=2, prompt_len=6, steps=6, kernels="fast").top1_agreement > 0.4).all()


# The zoo's mixture-of-experts architectures with kernels="fast": a known family's blocks in gdtool's kernels,
# any other's kept as HF's inside the compiled forward; either way eager and step-graph decode generate()'s
# tokens (float32, on a CPU; on a GPU step-graph bit for bit eager), or the model is refused with the reason
# and kernels='hf' named (one refused whatever the kernels, as MiniMax for its own cache, is counted apart).
# On a CPU a seeded sample of three architectures beyond tests/moe.py's families (a compile takes ~30 s here);
# `pytest -m cuda` all of them.
def _zoo_moe_model(model_type: str, device: str):
    """The zoo's tiny model of `model_type` if it builds and holds an MoE block (else None: the zoo's own test
    says why one does not build); bf16 on a GPU, where gdtool's experts kernels take bf16 and fp16 only."""
    import zoo
    try:
        model = zoo.build(model_type, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    except Exception:  # noqa: BLE001 - not built: tests/test_zoo.py holds the reason
        return None
    return model if any(experts.is_moe_block(m) for m in model.modules()) else None


def _fast_outcome(model, device: str) -> str:
    """'pass', 'refused: <reason>', 'no reference: <error>' (generate() cannot decode it: tests/test_zoo.py holds
    why), or the mismatches with generate()'s tokens."""
    import zoo
    from gdtool.core.feed import Unsupported
    from reference import decode, generate
    ids, mask = zoo.prompt(model, device)
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        ref, _ = generate(model, ids, mask, 8, seed=0, **settings)
    except Exception as error:  # noqa: BLE001
        return f"no reference: {type(error).__name__}"
    failures, first = [], None
    for mode in ("eager", "step-graph"):
        try:
            out = decode(model, ids, mask, 8, seed=0, mode=mode, kernels="fast", **settings)
        except Unsupported as refused:
            try:   # refused whatever the kernels (a cache of its own, ...): not the option's refusal
                decode(model, ids, mask, 2, seed=0, mode=mode, kernels="hf", **settings)
            except Unsupported:
                return f"refused with any kernels: {refused}"
            assert "kernels='hf'" in str(refused), refused
            return f"refused: {refused}"
        # on a CPU (float32) generate()'s tokens; on a GPU inductor's kernels may round differently from HF's,
        # enough to flip a token: there the modes bit for bit each other, the option's promise
        if device == "cpu" and not torch.equal(out.tokens, ref.cpu()):
            failures.append(f"{type(model).__name__} {mode}: tokens differ from generate()")
        if first is not None and not (torch.equal(out.tokens, first.tokens) and
                                      all(torch.equal(a, b) for a, b in zip(out.scores, first.scores))):
            failures.append(f"{type(model).__name__} {mode}: differs from eager with the same kernels")
        if first is None:
            first = out
    return "; ".join(failures) or "pass"


@pytest.mark.slow  # ~85 s on 2 cores (inductor compiles, cold cache)
def test_zoo_moe_sample_decodes_with_fast_kernels():
    """Seeded order over the zoo: the first three MoE architectures that decode (refusals, with their reason,
    are counted apart and must name kernels='hf')."""
    import zoo
    order = [t for t in zoo.architectures() if t not in FAMILIES]
    random.Random(22).shuffle(order)
    outcomes = {}
    for model_type in order:
        model = _zoo_moe_model(model_type, "cpu")
        if model is None:
            continue
        outcomes[model_type] = _fast_outcome(model, "cpu")
        if sum(not o.startswith(("refused", "no reference")) for o in outcomes.values()) == 3:
            break
    print(outcomes)
    decoded = {t: o for t, o in outcomes.items() if not o.startswith(("refused", "no reference"))}
    assert len(decoded) == 3, outcomes
    assert all(o == "pass" for o in decoded.values()), outcomes


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", sorted(__import__("zoo").architectures()))
def test_zoo_moe_decodes_with_fast_kernels_captured(model_type):
    model = _zoo_moe_model(model_type, "cuda")
    if model is None:
        pytest.skip(f"{model_type}: no MoE block in its tiny model (or it does not build)")
    outcome = _fast_outcome(model, "cuda")
    if outcome.startswith(("refused", "no reference")):
        pytest.skip(outcome)
    assert outcome == "pass", outcome
