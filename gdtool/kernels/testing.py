"""A test harness (as `torch.testing` is torch's): each decode kernel against a float64 computation of the same
function, on fresh random inputs. The suite's kernel tests and the GPU probes (`profiles/decode_kernels_probe.py`,
`profiles/cuda_compile.py`) import it; its old name, `gdtool.kernels.check`, is this module for one more release.

    from gdtool.kernels import testing
    results = testing.check_all("cuda")        # or "cpu" under TRITON_INTERPRET=1 (Triton's interpreter)
    [r for r in results if not r.ok]           # testing.check_experts_all: the mixture-of-experts blocks

For every kernel and shape: ||out - exact|| / ||exact|| where `exact` is the function in float64
with no intermediate rounding, for the kernel and for its torch reference (HF's eager arithmetic in
the model dtype); the kernel passes when its error is under the dtype's tolerance and under twice
the reference's own error plus a rounding unit (it may differ from the reference by rounding, not
by more than the reference differs from the exact result). Outputs are poisoned (NaN) before each
call, so an unwritten element fails. Exact equalities where the function is discrete (argmax, the
cache slots that must stay untouched).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import attention, dot, gemv, sampling, tuning, window

# ||out - exact|| / ||exact|| for one product-and-round chain, by the precision of the operands
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
UNIT = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


@dataclass
class Result:
    name: str
    shape: str
    dtype: str
    error: float           # kernel vs float64
    reference_error: float  # torch reference vs float64
    tolerance: float
    ok: bool
    note: str = ""


class _Impl:
    """The kernels under test: Triton's, or (impl="reference", where there is no Triton) the torch
    references themselves, which then are checked against float64 alone."""
    triton = True

    def gemv(self, x, g, eps, w, w2, r, out_f32, config=None, plus_one=False, act="silu", bias=None):
        if self.triton:
            return gemv.rms_gemv(x, g, eps, w, w2, r, out_f32, config=config, plus_one=plus_one, act=act, bias=bias)
        if w2 is not None:
            return gemv.gate_up_reference(x, g, eps, w, w2, plus_one, act)
        return gemv.rms_gemv_reference(x, g, eps, w, r, out_f32, plus_one, bias)

    def rms_add(self, *args):
        return (gemv.rms_add if self.triton else gemv.rms_add_reference)(*args)

    def qkv_rope(self, *args, config=None):
        if self.triton:
            return gemv.qkv_rope(*args, config=config)
        return gemv.qkv_rope_reference(*args)

    def roll_window(self, keys, values, config=None):
        if self.triton:
            return window.roll_left(keys, values, config)
        return window.roll_left_reference(keys, values)

    def attention(self, *args):
        return (attention.split_kv if self.triton else attention.split_kv_reference)(*args)


    def argmax(self, x):
        return (sampling.argmax if self.triton else sampling.argmax_reference)(x)

    def dot(self, x, w, bias, config=None):
        return dot.dot_linear(x, w, bias, config) if self.triton else dot.reference(x, w, bias)


_impl = _Impl()


def _rel(out, exact) -> float:
    out = out.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - exact).norm() / exact.norm().clamp_min(1e-30))


def judge(name, shape, dtype, out, ref, exact, note="") -> Result:
    e, r = _rel(out, exact), _rel(ref, exact)
    tol = TOLERANCE[dtype]
    ok = e == e and e < tol and e <= 2 * r + UNIT[dtype]
    return Result(name, shape, str(dtype).replace("torch.", ""), e, r, tol, ok, note)


def _exact_norm(x, g, eps, plus_one=False):
    x = x.double()
    return (1 + g.double() if plus_one else g.double()) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _norm_weight(k, dtype, device, gen, plus_one):
    """Llama's weights sit near 1; Gemma's (1 + w) weights near 0."""
    return ((0.0 if plus_one else 1.0) + 0.1 * torch.randn(k, generator=gen, device=device)).to(dtype)


def check_gemv(m, n, k, dtype, device, gen, norm=True, residual=False, out_f32=False, config=None,
               plus_one=False, bias=False) -> Result:
    """bias: F.linear's (`linear.py`, any model's linear layers outside the fast forward)."""
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    g = _norm_weight(k, dtype, device, gen, plus_one) if norm else None
    r = torch.randn(m, n, generator=gen, device=device).to(dtype) if residual else None
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    out = _impl.gemv(x, g, 1e-5, w, None, r, out_f32, config=config, plus_one=plus_one, bias=b)
    ref = gemv.rms_gemv_reference(x, g, 1e-5, w, r, out_f32, plus_one, b)
    xn = _exact_norm(x, g, 1e-5, plus_one) if norm else x.double()
    exact = xn @ w.double().T + (b.double() if bias else 0) + (r.double() if residual else 0)
    flags = "".join(f for f, on in (("+bias", bias), ("+norm", norm), ("(1+w)", norm and plus_one),
                                    ("+res", residual), ("->f32", out_f32)) if on)
    return judge("rms_gemv" + flags, f"{m}x{k} @ {k}x{n}", dtype, out, ref, exact,
                  "" if config is None else f"config {config}")


def check_gate_up(m, n, k, dtype, device, gen, config=None, plus_one=False, act="silu") -> Result:
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    wg = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    wu = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    g = _norm_weight(k, dtype, device, gen, plus_one)
    out = _impl.gemv(x, g, 1e-5, wg, wu, None, False, config=config, plus_one=plus_one, act=act)
    ref = gemv.gate_up_reference(x, g, 1e-5, wg, wu, plus_one, act)
    xn = _exact_norm(x, g, 1e-5, plus_one)
    exact = gemv.activation_reference(xn @ wg.double().T, act) * (xn @ wu.double().T)
    name = "gate_up" + ("" if act == "silu" else f"+{act}") + ("+(1+w)" if plus_one else "")
    return judge(name, f"{m}x{k} @ {k}x{n} (x2)", dtype, out, ref, exact)


def check_rms_add(m, n, dtype, device, gen, plus_one=True) -> Result:
    """residual + RMSNorm(y): Gemma's norms after attention and after the MLP."""
    y = torch.randn(m, n, generator=gen, device=device).to(dtype)
    r = torch.randn(m, n, generator=gen, device=device).to(dtype)
    g = _norm_weight(n, dtype, device, gen, plus_one)
    out = _impl.rms_add(y, g, 1e-6, r, plus_one)
    ref = gemv.rms_add_reference(y, g, 1e-6, r, plus_one)
    exact = r.double() + _exact_norm(y, g, 1e-6, plus_one)
    return judge("rms_add" + ("(1+w)" if plus_one else ""), f"{m}x{n}", dtype, out, ref, exact)


def check_folded_add(m, k, dtype, device, gen, kind, n=96, config=None) -> list[Result]:
    """Gemma's post norm and residual add folded into the next kernel (`add=`): its input h = x + RMSNorm(a) and
    its output, bit for bit those of `rms_add` then the kernel alone (the same arithmetic, one kernel fewer).
    kind: gate_up, lm_head (float32 out, h not kept) or qkv (Gemma's q/k norm). Triton only: the references
    compose the two calls."""
    if not _impl.triton:
        return []
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)        # the residual stream
    a = torch.randn(m, k, generator=gen, device=device).to(dtype)        # the block's output, before its norm
    ga, g = (_norm_weight(k, dtype, device, gen, True) for _ in range(2))
    add = (a, ga, 1e-6)
    h_apart = gemv.rms_add(a, ga, 1e-6, x, True)
    if kind == "qkv":
        h, outs = _qkv_folded_and_apart(x, h_apart, g, k, 1, dtype, device, gen, True, True, config, add=add)
    else:
        ws = [(torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
              for _ in range(2 if kind == "gate_up" else 1)]
        w2 = ws[1] if kind == "gate_up" else None
        out_f32 = kind == "lm_head"
        keep = kind != "lm_head"
        y = gemv.rms_gemv(x, g, 1e-5, ws[0], w2, None, out_f32, config=config, plus_one=True,
                          act="gelu_tanh", add=add, keep=keep)
        y, h = y if keep else (y, h_apart)
        y_apart = gemv.rms_gemv(h_apart, g, 1e-5, ws[0], w2, None, out_f32, config=config, plus_one=True,
                                act="gelu_tanh")
        outs = [(y, y_apart)]
    outs.append((h, h_apart))
    return _bitwise(f"{kind} with rms_add folded in", f"{m}x{k}", dtype, outs, "rms_add, then the kernel")


def _qkv_folded_and_apart(x, h_apart, g, k, hkv, dtype, device, gen, plus_one, qk_norm, config, **fold):
    """qkv_rope with `fold` (add= or embed=) on x, and alone on h_apart (the folded input computed apart), with one
    set of weights (4 query heads and hkv key/value heads of 32), rotary inputs and caches: (the folded call's h,
    [(folded, apart) pairs of q and the caches])."""
    m, hq, d, cache_len = h_apart.shape[0], 4, 32, 9
    ws = [(torch.randn(hh * d, k, generator=gen, device=device) / k ** 0.5).to(dtype) for hh in (hq, hkv, hkv)]
    norms = tuple(_norm_weight(d, dtype, device, gen, plus_one) for _ in range(2)) + (1e-6,) if qk_norm else None
    positions = torch.randint(0, 5000, (m, 1), generator=gen, device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    slot = torch.randint(0, cache_len, (), generator=gen, device=device)
    caches = [torch.randn(m, hkv, cache_len, d, generator=gen, device=device).to(dtype) for _ in range(2)]
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    args = (g, 1e-5, *ws, positions, inv_freq, 1.0)
    q, h = gemv.qkv_rope(x, *args, *mine, slot, None, norms, plus_one, config=config, **fold)
    q_apart = gemv.qkv_rope(h_apart, *args, *theirs, slot, None, norms, plus_one, config=config)
    return h, [(q, q_apart), (mine[0], theirs[0]), (mine[1], theirs[1])]


def _bitwise(name, shape, dtype, outs, apart: str) -> list[Result]:
    """One Result: every (folded, apart) pair in outs the same bits (its error: the largest relative difference)."""
    same = all(torch.equal(o, p) for o, p in outs)
    error = max(_rel(o, p.double()) if p.abs().sum() > 0 else 0.0 for o, p in outs)
    return [Result(name, shape, str(dtype).replace("torch.", ""), error, 0.0, 0.0, same,
                   f"bit for bit {apart}" if same else f"DIFFERS from {apart}")]


def check_folded_embedding(m, k, dtype, device, gen, scaled, qk_norm=False, config=None, vocab=50) -> list[Result]:
    """The embedding lookup folded into the first qkv_rope (`embed=`): its input h, q and the cache's k and v, bit
    for bit those of the lookup (`embedding_reference`), then the kernel alone. scaled: Gemma's embed_scale (a
    float32 buffer, rounded to the table's dtype as HF's module rounds it). Triton only, as `check_folded_add`."""
    if not _impl.triton:
        return []
    table = torch.randn(vocab, k, generator=gen, device=device).to(dtype)
    tokens = torch.randint(0, vocab, (m, 1), generator=gen, device=device)[:, 0]   # a column's view, as the step's
    scale = torch.tensor(k ** 0.5, device=device) if scaled else None
    g = _norm_weight(k, dtype, device, gen, scaled)
    h_apart = gemv.embedding_reference(table, tokens, scale)
    h, outs = _qkv_folded_and_apart(table, h_apart, g, k, 2, dtype, device, gen, scaled, qk_norm, config,
                                    embed=(tokens, scale))
    outs.append((h, h_apart))
    name = "qkv_rope with the" + (" scaled" if scaled else "") + " embedding folded in" + (" +qk_norm" if qk_norm else "")
    return _bitwise(name, f"{m}x{k}", dtype, outs, "the lookup, then the kernel")


def _rope_exact(t, cos, sin):
    return t * cos + gemv.rotate_half(t) * sin


def check_qkv_rope(m, k, hq, hkv, d, cache_len, dtype, device, gen, config=None, bias=False,
                   qk_norm=False, plus_one=False) -> list[Result]:
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    ws = [(torch.randn(h * d, k, generator=gen, device=device) / k ** 0.5).to(dtype) for h in (hq, hkv, hkv)]
    g = _norm_weight(k, dtype, device, gen, plus_one)
    biases = tuple(torch.randn(h * d, generator=gen, device=device).to(dtype) for h in (hq, hkv, hkv)) if bias else None
    norms = (tuple(_norm_weight(d, dtype, device, gen, plus_one) for _ in range(2)) + (1e-6,)
             if qk_norm else None)
    positions = torch.randint(0, 5000, (m, 1), generator=gen, device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    scaling = 1.0 + 0.25 * float(torch.rand(1, generator=gen, device=device))
    slot = torch.randint(0, cache_len, (), generator=gen, device=device)
    caches = [torch.randn(m, hkv, cache_len, d, generator=gen, device=device).to(dtype) for _ in range(2)]
    mine = [c.clone() for c in caches]
    theirs = [c.clone() for c in caches]
    rope = (positions, inv_freq, scaling)
    q = _impl.qkv_rope(x, g, 1e-5, *ws, *rope, *mine, slot, biases, norms, plus_one, config=config)
    q_ref = gemv.qkv_rope_reference(x, g, 1e-5, *ws, *rope, *theirs, slot, biases, norms, plus_one)
    xn = _exact_norm(x, g, 1e-5, plus_one)
    qe, ke, ve = (xn @ w.double().T for w in ws)
    if bias:
        qe, ke, ve = (e + b.double() for e, b in zip((qe, ke, ve), biases))
    qe, ke, ve = qe.view(m, hq, d), ke.view(m, hkv, d), ve.view(m, hkv, d)
    if qk_norm:
        qe, ke = _exact_norm(qe, norms[0], norms[2], plus_one), _exact_norm(ke, norms[1], norms[2], plus_one)
    freqs = (positions.float() * inv_freq[None, :]).double()  # the angle is defined in float32 (HF's)
    emb = torch.cat((freqs, freqs), -1)
    c, s = (emb.cos() * scaling)[:, None], (emb.sin() * scaling)[:, None]
    qe = _rope_exact(qe, c, s)
    ke = _rope_exact(ke, c, s)
    i = int(slot)
    others = torch.ones(cache_len, dtype=torch.bool, device=device)
    others[i] = False
    untouched = all(torch.equal(a[:, :, others], b[:, :, others]) for a, b in zip(mine, caches))
    name = "qkv_rope" + ("+bias" if bias else "") + ("+qk_norm" if qk_norm else "") + ("(1+w)" if plus_one else "")
    shape = f"{m}x{k}, heads {hq}/{hkv}x{d}, cache {cache_len}"
    results = [judge(f"{name}: q", shape, dtype, q, q_ref, qe),
               judge(f"{name}: k at slot", shape, dtype, mine[0][:, :, i], theirs[0][:, :, i], ke),
               judge(f"{name}: v at slot", shape, dtype, mine[1][:, :, i], theirs[1][:, :, i], ve)]
    results[-1].ok = results[-1].ok and untouched
    results[-1].note = "other slots untouched" if untouched else "OTHER SLOTS CHANGED"
    return results


def exact_attention(q, kc, vc, mask, scale, sink=None) -> torch.Tensor:
    """One-token attention in float64: q [M, Hq, D] over the caches [M, Hkv, C, D], the slots where mask [M, C]
    is nonzero (a softmax joined by one logit a query head if `sink` [Hq]) -> [M, Hq * D]."""
    m, hq, d = q.shape
    hkv = kc.shape[1]
    keep = (mask != 0)[:, None, None, :]
    qd = q.double().view(m, hkv, hq // hkv, d)
    scores = ((qd @ kc.double().transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))
    if sink is not None:
        extra = sink.double().view(1, hkv, hq // hkv, 1).expand(m, -1, -1, -1)
        p = torch.cat([scores, extra], -1).softmax(-1)[..., :-1]
    else:
        p = scores.softmax(-1)
    return (p @ vc.double()).reshape(m, hq * d)


def check_attention(m, hq, hkv, d, cache_len, live, dtype, device, gen, pad=0, sinks=False) -> Result:
    q = torch.randn(m, hq, d, generator=gen, device=device).to(dtype)
    kc = torch.randn(m, hkv, cache_len, d, generator=gen, device=device).to(dtype)
    vc = torch.randn(m, hkv, cache_len, d, generator=gen, device=device).to(dtype)
    mask = torch.ones(m, cache_len, dtype=torch.long, device=device)
    mask[:, live:] = 0
    if pad:  # left padding: row r masks its first r * pad slots
        for r in range(m):
            mask[r, : min(r * pad, live - 1)] = 0
    slot = torch.tensor(live - 1, device=device)
    scale = d ** -0.5
    # gpt-oss's sinks: learned logits near the scores' range (some heads' sink dominating, some not)
    sink = (2.0 * torch.randn(hq, generator=gen, device=device)).to(dtype) if sinks else None
    out = _impl.attention(q, kc, vc, mask, slot, scale, sink)
    ref = attention.split_kv_reference(q, kc, vc, mask, slot, scale, sink)
    exact = exact_attention(q, kc, vc, mask, scale, sink)
    chunk, splits, fused = attention.attention_plan(m, hkv, hq // hkv, cache_len, d, q.device)
    return judge("decode_attention" + ("+sinks" if sinks else ""), f"{m} rows, heads {hq}/{hkv}x{d}, live {live} of "
                  f"{cache_len}" + (f", left pad {pad}/row" if pad else ""), dtype, out, ref, exact,
                  f"{splits} chunks of {chunk}" + (", combined in the split kernel" if fused or splits == 1 else ""))


def check_window_roll(b, hkv, w, d, dtype, device, gen, config=None) -> Result:
    """A full sliding window's update for one token: `roll_window`, then the new key and value at slot W - 1 (the
    write qkv_rope does), against HF's `StaticSlidingWindowLayer.update` itself (filled by one update of W
    tokens, then one more token): bit for bit, keys and values."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float64).to(dtype)
    keys, values, new_k, new_v = rand(b, hkv, w, d), rand(b, hkv, w, d), rand(b, hkv, 1, d), rand(b, hkv, 1, d)
    layer = StaticSlidingWindowLayer(max_cache_len=w, sliding_window=w)
    layer.update(keys, values)           # the window full, as a prefill of W tokens leaves it
    layer.update(new_k, new_v)           # HF's roll and write
    mine_k, mine_v = keys.clone(), values.clone()
    _impl.roll_window(mine_k, mine_v, config)
    mine_k[:, :, w - 1:] = new_k
    mine_v[:, :, w - 1:] = new_v
    ok = torch.equal(mine_k, layer.keys) and torch.equal(mine_v, layer.values)
    wrong = int((mine_k != layer.keys).sum() + (mine_v != layer.values).sum())
    return Result("window_roll", f"{b} rows, {hkv} heads x {d}, window {w}" + (f", config {config}" if config else ""),
                  str(dtype).replace("torch.", ""), 0.0 if ok else 1.0, 0.0, 0.0, ok,
                  "exact (HF's update)" if ok else f"{wrong} elements differ from HF's update")


def check_dot(m, n, k, dtype, device, gen, bias=False, config=None) -> Result:
    """The split-K tensor-core product (`dot.py`, the linear layers at up to 64 rows), with F.linear's bias."""
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    out = _impl.dot(x, w, b, config)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    config = tuple(config or dot.config_for(m, n, k, tuning.current(x.device)))
    return judge("dot_linear" + ("+bias" if bias else ""), f"{m}x{k} @ {k}x{n}", dtype, out, dot.reference(x, w, b),
                 exact, f"config {config}")


def check_argmax(m, v, device, gen) -> Result:
    x = torch.randn(m, v, generator=gen, device=device).to(torch.bfloat16).float()  # bf16 logits: ties
    x[0, : v // 3] = x[0].max()          # a tie across blocks: the first index wins
    if m > 1:
        x[1, 5] = float("nan")           # NaN wins, as in torch.argmax
    if m > 2:
        x[2] = float("-inf")
    out = _impl.argmax(x)
    ref = sampling.argmax_reference(x)
    ok = torch.equal(out, ref)
    return Result("argmax", f"{m}x{v}", "float32", 0.0 if ok else 1.0, 0.0, 0.0, ok,
                  "exact" if ok else f"got {out.tolist()} want {ref.tolist()}")


def _begin(device, large, seed: int, impl: str):
    """What every check_*_all starts with: which implementation runs, the device, whether the large
    (real-model) shapes run (on CUDA by default), and the seeded generator."""
    if impl not in ("triton", "reference"):
        raise ValueError(f"impl={impl!r}: 'triton' or 'reference'")
    _impl.triton = impl == "triton"
    device = torch.device(device)
    large = device.type == "cuda" if large is None else large
    return device, large, torch.Generator(device=device).manual_seed(seed)


def check_all(device="cuda", dtype=torch.bfloat16, large: bool | None = None, seed: int = 0,
              impl: str = "triton") -> list[Result]:
    """Every kernel on small shapes (interpreter-sized) and, on CUDA, the Llama 1B / 8B, Qwen3-8B and
    Qwen2.5-0.5B shapes, 1 to 16 rows.
    impl="reference" checks the torch references instead (what runs without Triton)."""
    device, large, gen = _begin(device, large, seed, impl)
    results = []
    small = [(1, 96, 128), (3, 40, 64), (4, 64, 256)]
    for m, n, k in small:
        for norm, res, f32 in ((True, False, False), (False, True, False), (True, False, True)):
            results.append(check_gemv(m, n, k, dtype, device, gen, norm, res, f32, config=(4, 4, 2)))
        results.append(check_gemv(m, n, k, dtype, device, gen, False, True, False))  # default config
        results.append(check_gate_up(m, n, k, dtype, device, gen, config=(4, 4, 2)))
    results.append(check_gemv(2, 200, 128, dtype, device, gen, True, False, True, config=(8, 8, 2)))  # lm_head's
    # any linear layer with its bias (`linear.py`): K not a power of two, one and several tiles per program
    for m, n, k, config in ((1, 96, 72, None), (3, 40, 64, (4, 4, 2)), (4, 130, 96, None), (2, 64, 256, (4, 4, 2))):
        results.append(check_gemv(m, n, k, dtype, device, gen, False, False, False, config=config, bias=True))
    results += check_qkv_rope(2, 64, 4, 2, 16, 9, dtype, device, gen)
    results += check_qkv_rope(1, 128, 8, 2, 32, 20, dtype, device, gen, config=(4, 4, 2, 128))
    results += check_qkv_rope(3, 96, 4, 2, 16, 9, dtype, device, gen, bias=True)            # Qwen2: q/k/v biases
    results += check_qkv_rope(2, 128, 4, 2, 32, 9, dtype, device, gen, qk_norm=True)        # Qwen3: per-head norm
    results += check_qkv_rope(3, 128, 4, 2, 32, 9, dtype, device, gen, qk_norm=True, bias=True,
                              config=(16, 4, 2, 32))                                         # 4 chunks of K
    # tiles smaller than a head (the default at real sizes): the products, then the norm and RoPE per head
    results += check_qkv_rope(1, 128, 4, 2, 32, 9, dtype, device, gen, qk_norm=True, config=(4, 4, 2))
    results += check_qkv_rope(6, 96, 4, 2, 32, 9, dtype, device, gen, qk_norm=True, bias=True, config=(2, 4, 2))
    # more rows than one pass: the weight tile serves several passes of ROWS_PER_PASS rows
    for m in (5, 8, 16):
        results.append(check_gemv(m, 40, 64, dtype, device, gen, True, False, True, config=(4, 4, 2)))
        results.append(check_gemv(m, 40, 64, dtype, device, gen, False, True, False, config=(4, 4, 2)))
        results.append(check_gate_up(m, 40, 64, dtype, device, gen, config=(4, 4, 2)))
        results += check_qkv_rope(m, 64, 4, 2, 16, 9, dtype, device, gen)
    results += check_qkv_rope(16, 64, 4, 2, 16, 9, dtype, device, gen, qk_norm=True)
    results += check_qkv_rope(16, 64, 4, 2, 16, 9, dtype, device, gen, qk_norm=True, config=(2, 4, 2))
    # Gemma 3: the (1 + w) norms (input, per-head q/k, the post norms + residual), GELU-tanh gate/up
    for m in (1, 3, 6):
        results.append(check_gemv(m, 96, 128, dtype, device, gen, True, False, True, config=(4, 4, 2), plus_one=True))
        results.append(check_gate_up(m, 40, 64, dtype, device, gen, config=(4, 4, 2), plus_one=True, act="gelu_tanh"))
        results.append(check_rms_add(m, 96, dtype, device, gen))
    results.append(check_gate_up(2, 40, 64, dtype, device, gen, config=(4, 4, 2), act="gelu_tanh"))
    results += check_qkv_rope(2, 64, 4, 2, 16, 9, dtype, device, gen, qk_norm=True, plus_one=True)
    results += check_qkv_rope(3, 128, 4, 1, 32, 9, dtype, device, gen, qk_norm=True, plus_one=True,
                              config=(16, 4, 2, 32))                                         # chunks of K
    results += check_qkv_rope(3, 128, 4, 1, 32, 9, dtype, device, gen, qk_norm=True, plus_one=True,
                              config=(4, 4, 2))                                              # two kernels
    # its post norms and residual adds folded into the next kernel (one and several passes of rows)
    for m in (1, 3, 6):
        for kind in ("gate_up", "lm_head", "qkv"):
            results += check_folded_add(m, 64, dtype, device, gen, kind, config=(4, 4, 2) if kind == "qkv" else None)
    results += check_folded_add(2, 128, dtype, device, gen, "qkv", config=(16, 4, 2, 32))      # K in chunks: apart
    # the embedding lookup folded into the first qkv_rope (one and several passes; Gemma's scale; two kernels)
    for m, scaled, qk_norm, config in ((1, False, False, None), (3, True, True, (4, 4, 2)), (6, False, False, (4, 4, 2)),
                                       (6, True, True, None), (2, True, True, (16, 4, 2, 32))):   # K in chunks: apart
        results += check_folded_embedding(m, 64 if config != (16, 4, 2, 32) else 128, dtype, device, gen, scaled,
                                          qk_norm, config)
    # Gemma 3's full sliding windows: the roll (one chunk, several chunks, a window of 1 and 2)
    for b, hkv, w, d, config in ((2, 2, 8, 16, None), (3, 1, 9, 32, (4, 2)), (1, 2, 1, 16, None), (2, 1, 2, 16, None)):
        results.append(check_window_roll(b, hkv, w, d, dtype, device, gen, config))
    for m, live, cache, pad in ((1, 1, 40, 0), (2, 37, 40, 0), (3, 70, 90, 5), (4, 17, 17, 3)):
        results.append(check_attention(m, 8, 2, 32, cache, live, dtype, device, gen, pad))
        results.append(check_attention(m, 8, 2, 32, cache, live, dtype, device, gen, pad, sinks=True))  # gpt-oss
    results.append(check_argmax(3, 5000, device, gen))
    # the split-K tensor-core products (linear layers at up to 64 rows): K off the chunks, one and several slices
    for m, n, k, bias, config in ((5, 40, 64, False, None), (16, 96, 100, True, (32, 32, 2, 4, 2)),
                                  (33, 130, 256, False, (64, 64, 4, 4, 2)), (64, 40, 96, True, (16, 16, 4, 4, 3)),
                                  (64, 64, 256, True, None)):   # the 64-row tile of the tuning: 64 x 128 chunks
        results.append(check_dot(m, n, k, dtype, device, gen, bias, config))
    if large:
        for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1152, 1024), (1152, 6912)):
            results.append(check_dot(64, n, k, dtype, device, gen))   # Llama-1B's and Gemma-3-1B's at 64 rows
        for m in (1, 4):
            for n, k in ((2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336)):
                results.append(check_gemv(m, n, k, dtype, device, gen, False, True, False))
            results.append(check_gemv(m, 128256, 2048, dtype, device, gen, True, False, True))
            results.append(check_gate_up(m, 8192, 2048, dtype, device, gen))
            results.append(check_gate_up(m, 14336, 4096, dtype, device, gen))
            results += check_qkv_rope(m, 2048, 32, 8, 64, 384, dtype, device, gen)
            results += check_qkv_rope(m, 4096, 32, 8, 128, 384, dtype, device, gen)
            for live in (1, 129, 383, 4000):
                cache = 384 if live < 384 else 4096
                results.append(check_attention(m, 32, 8, 64, cache, live, dtype, device, gen, pad=7 * (m > 1)))
            results.append(check_attention(m, 32, 8, 128, 384, 200, dtype, device, gen))
            results += check_qkv_rope(m, 4096, 32, 8, 128, 384, dtype, device, gen, qk_norm=True)  # Qwen3-8B
            results += check_qkv_rope(m, 4096, 32, 8, 128, 384, dtype, device, gen, qk_norm=True,
                                      config=gemv.whole_head_config(4096, 128, m))              # in one kernel
            results += check_qkv_rope(m, 896, 14, 2, 64, 384, dtype, device, gen, bias=True)       # Qwen2.5-0.5B
            # Gemma-3-1B: hidden 1152 (not a power of two), 4/1 heads x 256, GELU-tanh MLP 6912, tied 262k lm_head
            results += check_qkv_rope(m, 1152, 4, 1, 256, 512, dtype, device, gen, qk_norm=True, plus_one=True)
            results += check_qkv_rope(m, 1152, 4, 1, 256, 512, dtype, device, gen, qk_norm=True, plus_one=True,
                                      config=gemv.whole_head_config(1152, 256, m))
            results.append(check_gemv(m, 1152, 1024, dtype, device, gen, False, False, False))   # o
            results.append(check_rms_add(m, 1152, dtype, device, gen))
            for kind in ("gate_up", "lm_head", "qkv"):
                results += check_folded_add(m, 1152, dtype, device, gen, kind, n=6912)
            results += check_folded_embedding(m, 1152, dtype, device, gen, True, True, vocab=262144)   # its table
            results += check_folded_embedding(m, 2048, dtype, device, gen, False, vocab=128256)       # Llama 3's
            results.append(check_gate_up(m, 6912, 1152, dtype, device, gen, plus_one=True, act="gelu_tanh"))
            results.append(check_gemv(m, 1152, 6912, dtype, device, gen, False, False, False))   # down
            results.append(check_gemv(m, 262144, 1152, dtype, device, gen, True, False, True, plus_one=True))
            results.append(check_attention(m, 4, 1, 256, 512, 300, dtype, device, gen, pad=7 * (m > 1)))
            # its full layers past prompt 4096: ~260 chunks, combined a block of chunks at a time
            results.append(check_attention(m, 4, 1, 256, 4200, 4150, dtype, device, gen, pad=7 * (m > 1)))
            # gpt-oss-20b: 64 query over 8 key/value heads of 64, sinks; a 128-slot window and a full layer
            results.append(check_attention(m, 64, 8, 64, 128, 128, dtype, device, gen, sinks=True))
            results.append(check_attention(m, 64, 8, 64, 384, 200, dtype, device, gen, pad=7 * (m > 1), sinks=True))
            for n, k in ((4096, 2880), (512, 2880), (2880, 4096)):                              # its q, k/v, o
                results.append(check_gemv(m, n, k, dtype, device, gen, False, False, False, bias=True))
            results.append(check_window_roll(m, 1, 512, 256, dtype, device, gen))               # its 512-token windows
            results.append(check_window_roll(m, 2, 1024, 256, dtype, device, gen))              # gemma-3-4b's
        for m in (8, 16):
            results.append(check_gemv(m, 4096, 4096, dtype, device, gen, False, True, False))
            results.append(check_gemv(m, 151936, 4096, dtype, device, gen, True, False, True))
            results.append(check_gate_up(m, 12288, 4096, dtype, device, gen))
            results += check_qkv_rope(m, 4096, 32, 8, 128, 384, dtype, device, gen)
            results += check_qkv_rope(m, 4096, 32, 8, 128, 384, dtype, device, gen, qk_norm=True)
        results.append(check_argmax(64, 128256, device, gen))
    return results


def table(results) -> str:
    lines = ["| kernel | shape | dtype | err vs float64 | torch ref err | tol | ok | note |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.shape} | {r.dtype} | {r.error:.2e} | {r.reference_error:.2e} | {r.tolerance:g} | "
                     f"{'yes' if r.ok else 'NO'} | {r.note} |")
    return "\n".join(lines)


# -- mixture-of-experts blocks (kernels/experts/) ------------------------------------------------
# Shapes: (name, tokens, experts, hidden, intermediate, top_k, norm_topk, weights_f32, shared intermediate)
EXPERTS_SMALL = [("qwen3-moe", 1, 8, 64, 32, 2, True, False, 0), ("qwen3-moe", 3, 16, 96, 40, 4, True, False, 0),
                 ("olmoe", 4, 8, 64, 48, 2, False, False, 0), ("mixtral", 2, 8, 64, 48, 2, True, True, 0),
                 ("qwen2-moe", 3, 16, 64, 40, 4, False, False, 56)]
EXPERTS_LARGE = [("qwen3-30b-a3b", m, 128, 2048, 768, 8, True, False, 0) for m in (1, 4, 16)] + [
    ("qwen2-moe-a2.7b", 1, 60, 2048, 1408, 4, False, False, 5632), ("olmoe-1b-7b", 2, 64, 2048, 1024, 8, False, False, 0),
    ("mixtral-8x7b", 1, 8, 4096, 14336, 2, True, True, 0)]


REFERENCE_GATHER_BYTES = 2 << 30   # the most expert weights the torch reference gathers at once


def _reference_by_rows(x, router, gate_up, down, top_k, *rest):
    """experts.block_reference with at most REFERENCE_GATHER_BYTES of expert weights gathered at once: HF's
    batched_mm gathers each (token, k) pair's weights (Mixtral's 24 tokens at top-2: 10.5 GiB), more than a GPU
    shared by 8 test workers may have free."""
    from . import experts
    pair_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    rows = max(1, REFERENCE_GATHER_BYTES // (pair_bytes * top_k))
    return experts.block_reference(x, router, gate_up, down, top_k, *rest, rows=rows)


def check_experts(name, m, e, h, i, top_k, norm_topk, weights_f32, shared, dtype, device, gen,
                  config=None, grouped: bool = False) -> list[Result]:
    """See below; grouped=True runs the grouped kernels (else the small ones)."""
    return _check_experts(name, m, e, h, i, top_k, norm_topk, weights_f32, shared, dtype, device, gen, config,
                          grouped)


def _check_experts(name, m, e, h, i, top_k, norm_topk, weights_f32, shared, dtype, device, gen,
                   config=None, grouped: bool = False) -> list[Result]:
    """One MoE block: the routing (exact equality of the expert ids with torch's, routing weights against
    float64) and the output against float64 on the kernel's own routing (no intermediate rounding)."""
    from . import experts

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    x = rand(m, h)
    router = rand(e, h, scale=h ** -0.5)
    gate_up = rand(e, 2 * i, h, scale=h ** -0.5)
    down = rand(e, h, i, scale=i ** -0.5)
    extra = (rand(shared, h, scale=h ** -0.5), rand(shared, h, scale=h ** -0.5), rand(h, shared, scale=shared ** -0.5),
             rand(1, h, scale=h ** -0.5)) if shared else ()
    args = (x, router, gate_up, down, top_k, norm_topk, weights_f32, *extra)
    seen = {}
    if _impl.triton and grouped:
        assert not shared, "the grouped kernels take no shared expert"
        out = experts.block_grouped(*args, config=config, intermediates=seen)
    elif _impl.triton:
        out = experts.block_triton(*args, config=config, intermediates=seen)
    else:
        out = _reference_by_rows(*args)
    ref = _reference_by_rows(*args)
    logits_ref, weights_ref, ids_ref = experts.route_reference(x, router, top_k, norm_topk, weights_f32)
    ids = seen["ids"].long() if seen else ids_ref
    # float64 on the kernel's routing
    xd = x.double()
    probs = torch.softmax(xd @ router.double().T, -1)
    w = probs.gather(1, ids)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    exact = torch.zeros(m, h, dtype=torch.float64, device=device)
    for r in range(m):
        for j in range(top_k):
            gu = gate_up[ids[r, j]].double() @ xd[r]
            act = F.silu(gu[:i]) * gu[i:]
            exact[r] += w[r, j] * (down[ids[r, j]].double() @ act)
    if shared:
        sg, su, sd, sr = (t.double() for t in extra)
        exact += torch.sigmoid(xd @ sr.T) * ((F.silu(xd @ sg.T) * (xd @ su.T)) @ sd.T)
    shape = f"{m} tokens, top-{top_k} of {e}, {h}x{i}" + (f", shared {shared}" if shared else "")
    # the same experts, or the same up to ties (torch.topk orders ties as it likes; the kernel: lower id first)
    probs_ref = torch.softmax(logits_ref, -1, dtype=torch.float)
    same_ids = torch.equal(ids, ids_ref) or torch.equal(probs_ref.gather(1, ids), probs_ref.gather(1, ids_ref))
    result = judge(f"moe_block ({name})", shape, dtype, out, ref, exact,
                    "" if config is None else f"config {config}")
    results = [result]
    if seen:
        weights = seen["weights"]
        weights_exact = w
        routing = judge(f"moe routing weights ({name})", shape, dtype, weights, weights_ref.float(), weights_exact,
                         "ids equal torch.topk's (up to ties)" if same_ids else "IDS DIFFER from torch.topk's")
        routing.ok = routing.ok and same_ids
        results.append(routing)
    if "order" in seen:
        results.append(_check_grouped_order(name, shape, dtype, ids, seen["order"], seen["tile_expert"]))
    return results


# the grouped kernels (from experts.grouped_from() tokens; no shared expert)
EXPERTS_GROUPED_SMALL = [("qwen3-moe", 2, 8, 64, 32, 2, True, False, 0), ("mixtral", 5, 8, 64, 48, 2, True, True, 0),
                         ("qwen3-moe", 17, 8, 64, 32, 2, True, False, 0), ("olmoe", 24, 16, 64, 48, 4, False, False, 0),
                         ("mixtral", 40, 8, 64, 48, 2, True, True, 0), ("qwen3-moe", 64, 16, 96, 40, 4, True, False, 0)]
EXPERTS_GROUPED_LARGE = [("qwen3-30b-a3b", m, 128, 2048, 768, 8, True, False, 0) for m in (2, 4, 17, 32, 64)] + [
    ("olmoe-1b-7b", 48, 64, 2048, 1024, 8, False, False, 0), ("mixtral-8x7b", 24, 8, 4096, 14336, 2, True, True, 0)]

# gpt-oss: (name, tokens, experts, hidden, intermediate, top_k), its small kernels and its grouped ones
EXPERTS_OSS_SMALL = [("gpt-oss", 1, 8, 64, 32, 2), ("gpt-oss", 5, 16, 96, 40, 4)]
EXPERTS_OSS_GROUPED_SMALL = [("gpt-oss", 3, 16, 96, 40, 4), ("gpt-oss", 20, 8, 64, 48, 2)]
EXPERTS_OSS_LARGE = [("gpt-oss-20b", m, 32, 2880, 2880, 4) for m in (1, 4)] + [("gpt-oss-120b", 2, 128, 2880, 2880, 4)]
EXPERTS_OSS_GROUPED_LARGE = [("gpt-oss-20b", m, 32, 2880, 2880, 4) for m in (2, 4, 16, 32, 64)] + [
    ("gpt-oss-120b", 2, 128, 2880, 2880, 4)]
OSS_ALPHA, OSS_LIMIT = 1.702, 7.0


def check_experts_oss(name, m, e, h, i, top_k, dtype, device, gen, config=None, grouped: bool = False) -> list[Result]:
    """One gpt-oss block (transposed, interleaved, biased experts; clamped SwiGLU; top-k then softmax),
    as `check_experts` (grouped=True: the grouped kernels; config: an OssConfig for the small ones). The
    gate/up products are drawn wide (std ~4) so that the clamps at +-7 act."""
    from . import experts

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    x = rand(m, h)
    router, router_bias = rand(e, h, scale=h ** -0.5), rand(e, scale=0.5)
    gate_up, gate_up_bias = rand(e, h, 2 * i, scale=4 * h ** -0.5), rand(e, 2 * i, scale=0.5)
    down, down_bias = rand(e, i, h, scale=i ** -0.5 / 4), rand(e, h, scale=0.5)
    oss = (router_bias, gate_up_bias, down_bias, OSS_ALPHA, OSS_LIMIT)
    args = (x, router, gate_up, down, top_k, False, False, None, None, None, None, oss)
    seen = {}
    if _impl.triton and grouped:
        out = experts.block_grouped(x, router, gate_up, down, top_k, False, False, intermediates=seen, oss=oss)
    elif _impl.triton:
        out = experts.block_triton(*args, config=config, intermediates=seen)
    else:
        out = _reference_by_rows(*args)
    ref = _reference_by_rows(*args)
    logits_ref, weights_ref, ids_ref = experts.route_reference_oss(x, router, router_bias, top_k)
    ids = seen["ids"].long() if seen else ids_ref
    # float64 on the kernel's routing
    xd = x.double()
    w = torch.softmax((xd @ router.double().T + router_bias.double()).gather(1, ids), -1)
    exact = torch.zeros(m, h, dtype=torch.float64, device=device)
    for r in range(m):
        for j in range(top_k):
            expert = ids[r, j]
            gu = xd[r] @ gate_up[expert].double() + gate_up_bias[expert].double()
            gate, up = gu[::2].clamp(max=OSS_LIMIT), gu[1::2].clamp(-OSS_LIMIT, OSS_LIMIT)
            act = (up + 1) * gate * torch.sigmoid(OSS_ALPHA * gate)
            exact[r] += w[r, j] * (act @ down[expert].double() + down_bias[expert].double())
    shape = f"{m} tokens, top-{top_k} of {e}, {h}x{i}"
    same_ids = torch.equal(ids, ids_ref) or torch.equal(logits_ref.gather(1, ids), logits_ref.gather(1, ids_ref))
    results = [judge(f"moe_block ({name})", shape, dtype, out, ref, exact, "" if config is None else f"config {config}")]
    if seen:
        routing = judge(f"moe routing weights ({name})", shape, dtype, seen["weights"], weights_ref.float(), w,
                         "ids equal torch.topk's (up to ties)" if same_ids else "IDS DIFFER from torch.topk's")
        routing.ok = routing.ok and same_ids
        results.append(routing)
        if "order" in seen:
            results.append(_check_grouped_order(name, shape, dtype, ids, seen["order"], seen["tile_expert"]))
    return results


def _check_grouped_order(name, shape, dtype, ids, order, tile_expert) -> Result:
    """The grouped kernels' sorted buffer, exactly: every (token, k) pair once, by expert then pair index,
    each tile's slots all of the tile's expert, padding (-1) only at the end of an expert's run."""
    flat = ids.reshape(-1).cpu().tolist()
    order, tile_expert = order.cpu().tolist(), tile_expert.cpu().tolist()
    block_m = len(order) // len(tile_expert)
    real = [p for p in order if p >= 0]
    ok = real == sorted(range(len(flat)), key=lambda p: (flat[p], p))
    for t, expert in enumerate(tile_expert):
        slots = order[t * block_m:(t + 1) * block_m]
        filled = [p for p in slots if p >= 0]
        ok = ok and slots == filled + [-1] * (block_m - len(filled))
        ok = ok and (all(flat[p] == expert for p in filled) and (expert >= 0) == bool(filled))
    return Result(f"moe grouped order ({name})", shape, str(dtype).replace("torch.", ""), 0.0 if ok else 1.0, 0.0, 0.0,
                  ok, "exact" if ok else f"order {order} tiles {tile_expert} ids {flat}")


def check_experts_all(device="cuda", dtype=torch.bfloat16, large: bool | None = None, seed: int = 0,
                      impl: str = "triton", oss_config=None, routed: bool = False) -> list[Result]:
    """The MoE block kernels on small shapes (interpreter-sized), and on CUDA at Qwen3-30B-A3B, Qwen1.5-MoE,
    OLMoE, Mixtral 8x7B and gpt-oss-20b/120b shapes; impl="reference" checks the torch reference against
    float64 alone. routed: the small kernels with their routing in the router kernel at every token count
    (`Config.routed`, and `Config.stacked`; experts_config does so at one token); gpt-oss's and the grouped ones as
    they are."""
    from dataclasses import replace

    from . import experts
    device, large, gen = _begin(device, large, seed, impl)
    results = []
    for shape in EXPERTS_SMALL + (EXPERTS_LARGE if large else []):
        _, m, _, h, i = shape[:5]
        config = replace(experts.experts_config(h, i, m), routed=True, stacked=True) if routed else None
        results += check_experts(*shape, dtype, device, gen, config=config)
    for shape in EXPERTS_GROUPED_SMALL + (EXPERTS_GROUPED_LARGE if large else []):
        results += check_experts(*shape, dtype, device, gen, grouped=True)
    for shape in EXPERTS_OSS_SMALL + (EXPERTS_OSS_LARGE if large else []):
        results += check_experts_oss(*shape, dtype, device, gen, config=oss_config)
    for shape in EXPERTS_OSS_GROUPED_SMALL + (EXPERTS_OSS_GROUPED_LARGE if large else []):
        results += check_experts_oss(*shape, dtype, device, gen, grouped=True)
    return results
