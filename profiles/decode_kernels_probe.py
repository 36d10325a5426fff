"""kernels="fast" on a GPU: each decode kernel checked and timed, then the whole step.

Parts, in the order given (each writes its file as soon as it ends; a part past --budget-s is skipped):

  check      every kernel against float64 on fresh random inputs (`gdtool.kernels.testing`), small shapes
             and the Llama 1B / 8B shapes, bf16            -> check.csv
  gemv       each projection of llama-1b and llama-8b (qkv+RoPE, o, gate/up, down, lm_head), batch 1
             and 4: µs per call and TB/s (weight bytes + activations over time), for cuBLAS
             (F.linear, the matmul alone) and the Triton kernel, PDL off and on, and a sweep of tile
             configs; with --dot also gdtool's split-K tensor-core kernel (dot.py; profiles/dot_gemv.py its
             configs), the matmul alone.
             Timed as one captured graph of calls rotating over enough weight copies
             (>= 512 MB) that no call reads L2-resident weights; median of --reps replays
                                                           -> gemv.csv
  attention  split-KV decode attention against the packed SDPA (`fast_attention`) over the whole
             static cache, at several live lengths         -> attention.csv
  step       gdtool.decode end to end (prompt --prompt-len, --new-tokens, greedy, EOS off), llama-1b
             batch 1 and 64 (--step-batches), kernels compiled vs fast, step-graph and device-loop,
             PDL on and off; ms per step of the second run; fast captured vs uncaptured tokens
                                                           -> step.csv

    python profiles/decode_kernels_probe.py --out $OUT/kernels
    python profiles/decode_kernels_probe.py --parts gemv --models llama-1b
The last stdout lines are a short table of each part.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import gdtool
from gdtool.frontends import bench
from gdtool.kernels import attention as fast_attention, dot as fast_dot, gemv as fast_gemv, testing
from gdtool.kernels import sampling as fast_sampling, step as fast, triton as fast_triton, tuning
from gdtool.measure import accuracy, roofline

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dot_gemv  # noqa: E402  (profiles/dot_gemv.py: the tensor-core kernel's configs to time)

SHAPES = {  # hidden, intermediate, heads, kv heads, head dim, vocab
    "llama-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-8b": (4096, 14336, 32, 8, 128, 128256),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),   # its qkv_rope runs the per-head q/k norm (a second kernel)
    "gemma-3-1b": (1152, 6912, 4, 1, 256, 262144),   # the same, with Gemma's (1 + w) norms and GELU-tanh
    "tiny": (64, 128, 4, 2, 16, 4096),   # --device cpu under TRITON_INTERPRET=1: the probe's own dry run
    "tiny-qk": (512, 256, 4, 2, 32, 4096),  # the same with Gemma's flags, tiles smaller than a head (two kernels)
}
QK_NORM = ("qwen3-8b", "gemma-3-1b", "tiny-qk")   # per-head q/k norm in qkv_rope
PLUS_ONE = ("gemma-3-1b", "tiny-qk")            # Gemma's (1 + w) norms and GELU-tanh gate
DEVICE = "cuda"
DTYPE = torch.bfloat16
START = time.perf_counter()


def log(message):
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def time_calls(calls, reps: int) -> float:
    """µs per call: the calls captured in one graph (each once), median over `reps` replays."""
    if DEVICE != "cuda":  # dry run: the calls once, wall clock
        t0 = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    graph.reset()
    return _median(times) * 1e3 / len(calls)


def _copies(nbytes: int) -> int:
    return max(4, min(64, -(-(512 << 20) // nbytes))) if DEVICE == "cuda" else 2


def _weights(n, k, copies, dtype, gen, count=1):
    return [[(torch.randn(n, k, device=DEVICE, generator=gen) / k ** 0.5).to(dtype) for _ in range(count)]
            for _ in range(copies)]


def gemv_configs(k: int, tiles: int, m: int = 1, n: int = 1, sweep: str = "full"):
    """The default and a sweep of (BLOCK_N, num_warps, programs per SM), tiles of at most 64 KB.
    small: the default's neighbours (half and twice the rows per tile)."""
    if sweep == "none":
        return [None]
    if sweep == "small":
        bn, warps, per_sm = fast_gemv.gemv_config(m, n, k, tiles)
        return [None] + [(b, warps, per_sm) for b in (bn // 2, bn * 2) if b >= 1]
    sweep = [(1, 4, 4), (1, 8, 2), (2, 8, 2), (4, 8, 2), (2, 4, 4), (4, 4, 4), (8, 8, 2), (4, 8, 4), (2, 8, 4),
             (1, 16, 1), (2, 16, 1), (8, 4, 4), (8, 8, 4), (16, 8, 2), (16, 16, 1)]
    return [None] + [c for c in sweep if c[0] * fast_triton.next_pow2(k) * 2 * tiles <= 65536]


def _dot_variants(args, m, n, k, make, suffix=""):
    """--dot: gdtool's split-K tensor-core kernel (`dot.dot_linear`, the matmul alone like cuBLAS's row) at the
    device's tuning's config, and with --sweep full its neighbours too."""
    if not args.dot:
        return []
    configs = dot_gemv.sweep_configs(m, n, k, tuning.current(torch.device(DEVICE)))
    configs = configs if args.sweep == "full" else configs[:1]
    return [(f"triton dot {c}{suffix}", c, False, lambda c=c: make(c)) for c in configs]


def part_gemv(args, rows):
    dtype = DTYPE
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for model in args.models:
        hidden, inter, hq, hkv, d, vocab = SHAPES[model]
        specs = [  # name, N, K, weights per call, norm, residual, out_f32
            ("o", hidden, hq * d, 1, False, True, False),
            ("gate_up", inter, hidden, 2, True, False, False),
            ("down", hidden, inter, 1, False, True, False),
            ("lm_head", vocab, hidden, 1, True, False, True),
        ]
        for m in args.gemv_rows:
            # q/k/v + RoPE + cache write
            nbytes = (hq + 2 * hkv) * d * hidden * 2
            copies = _copies(nbytes)
            ws = [[(torch.randn(h * d, hidden, device=DEVICE, generator=gen) / hidden ** 0.5).to(dtype)
                   for h in (hq, hkv, hkv)] for _ in range(copies)]
            x = torch.randn(m, hidden, device=DEVICE, generator=gen).to(dtype)
            g = torch.ones(hidden, device=DEVICE, dtype=dtype)
            positions = torch.full((m, 1), 200, device=DEVICE)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d))
            kc = torch.zeros(m, hkv, 384, d, device=DEVICE, dtype=dtype)
            vc = torch.zeros_like(kc)
            slot = torch.tensor(200, device=DEVICE)
            qk_norm = (torch.ones(d, device=DEVICE, dtype=dtype),) * 2 + (1e-6,) if model in QK_NORM else None
            plus_one = model in PLUS_ONE
            wcat = [torch.cat(w) for w in ws]
            variants = [("cublas qkv (one matmul, no RoPE)", None, False,
                         lambda w=None: [lambda w=w: F.linear(x, w) for w in wcat])]
            variants += _dot_variants(args, m, wcat[0].shape[0], hidden, lambda config: [
                lambda w=w: fast_dot.dot_linear(x, w, None, config) for w in wcat], " (one matmul, no RoPE)")
            qkv_sweep = {"none": [], "small": [(1, 8, 2), (4, 8, 2)],
                         "full": [(1, 8, 2), (2, 8, 2), (4, 8, 2), (2, 4, 4), (1, 4, 4), (2, 8, 4), (1, 8, 4),
                                  (4, 8, 4), (8, 8, 2), (4, 16, 1), (8, 16, 1), (2, 16, 2), (4, 4, 4)]}
            configs = [None] + (qkv_sweep[args.sweep] if model in args.sweep_models else [])  # (HB, warps, per SM)
            if m > fast_gemv.MAX_ROWS:   # past the matrix-vector kernels' rows: cuBLAS and the tensor-core probe only
                configs = []
            if qk_norm is not None:  # the per-head norm in one kernel: a tile per head (the default before d506703)
                configs.append(fast_gemv.whole_head_config(hidden, d, m))
            for config in configs:
                if config is not None and m > 1 and args.sweep != "full" and not (qk_norm is not None and config[0] == d // 2):
                    continue  # past one row the small sweep times the defaults only; the full one every config
                for pdl in ((False, True) if config is None else (False,)):
                    label = "whole-head, one kernel " + str(config) if config and config[0] == d // 2 else config
                    variants.append((f"triton qkv_rope {label or 'default'}", config, pdl,
                                     lambda config=config: [lambda w=w: fast_gemv.qkv_rope(
                                         x, g, 1e-5, *w, positions, inv_freq, 1.0, kc, vc, slot, qk_norm=qk_norm,
                                         plus_one=plus_one, config=config) for w in ws]))
            for label, config, pdl, make in variants:
                if time.perf_counter() - START > args.budget_s:
                    return
                try:
                    with fast_triton.pdl(pdl):
                        us = time_calls(make(), args.reps)
                    rows.append(dict(model=model, proj="qkv", rows=m, n=(hq + 2 * hkv) * d, k=hidden, kernel=label,
                                     pdl=pdl, us=us, tb_s=nbytes / us / 1e6))
                except Exception as error:  # one failing config does not stop the sweep
                    rows.append(dict(model=model, proj="qkv", rows=m, kernel=label, pdl=pdl, error=repr(error)[:300]))
                log(rows[-1])
            del ws, wcat
            for name, n, k, count, norm, residual, out_f32 in specs:
                nbytes = n * k * 2 * count
                copies = _copies(nbytes)
                weights = _weights(n, k, copies, dtype, gen, count)
                x = torch.randn(m, k, device=DEVICE, generator=gen).to(dtype)
                g = (1 + 0.1 * torch.randn(k, device=DEVICE, generator=gen)).to(dtype) if norm else None
                r = torch.randn(m, n, device=DEVICE, generator=gen).to(dtype) if residual else None
                # the matmul alone, as one weight matrix per call (gate/up concatenated)
                mats = [torch.cat(w) for w in weights] if count == 2 else [w[0] for w in weights]
                base = [lambda w=w: F.linear(x, w) for w in mats]
                variants = [("cublas (matmul alone)", None, False, lambda base=base: base)]
                variants += _dot_variants(args, m, n * count, k, lambda config, mats=mats: [
                    lambda w=w: fast_dot.dot_linear(x, w, None, config) for w in mats])
                for config in (gemv_configs(k, count, m, n, args.sweep if model in args.sweep_models else "none")
                               if m <= fast_gemv.MAX_ROWS else []):
                    if config is not None and m > 1 and args.sweep != "full":
                        continue
                    for pdl in ((False, True) if config is None else (False,)):
                        variants.append((f"triton {config or 'default ' + str(fast_gemv.gemv_config(m, n, k, count))}",
                                         config, pdl,
                                         lambda config=config: [lambda w=w: fast_gemv.rms_gemv(
                                             x, g, 1e-5, w[0], w[1] if count == 2 else None, r, out_f32,
                                             config=config, plus_one=model in PLUS_ONE,
                                             act="gelu_tanh" if model in PLUS_ONE else "silu") for w in weights]))
                for label, config, pdl, make in variants:
                    if time.perf_counter() - START > args.budget_s:
                        return
                    try:
                        with fast_triton.pdl(pdl):
                            us = time_calls(make(), args.reps)
                        rows.append(dict(model=model, proj=name, rows=m, n=n, k=k, kernel=label, pdl=pdl, us=us,
                                         tb_s=nbytes / us / 1e6))
                    except Exception as error:
                        rows.append(dict(model=model, proj=name, rows=m, kernel=label, pdl=pdl,
                                         error=repr(error)[:300]))
                    log(rows[-1])
                del weights
                torch.cuda.empty_cache()


def _attention_plans(args, rows, gen):
    """--attention-targets: llama-1b's attention at one row (32/8 x 64 over 384 slots, the live lengths of a decode)
    with split_plan's target programs set to each target (passed as a tuning, `tuning.use`) (fewer, longer chunks: fewer programs and a shorter
    combine), the combine in its own kernel and in the split kernel's last program (`triton.switches(fused_combine=...)`), PDL on.
    At 175 live slots the default plan (264) cuts 11 chunks of 16 and the step spends ~8 us a layer on attention
    (nsys, a7748ba) for ~0.36 MB of cache: the question is which plan the latency favours."""
    if not args.attention_targets:
        return
    m, hq, hkv, d, cache = (1, 32, 8, 64, 384) if DEVICE == "cuda" else (1, 4, 2, 16, 40)
    lives = (129, 175, 256, 383) if DEVICE == "cuda" else (17,)
    copies = 16 if DEVICE == "cuda" else 1
    q = torch.randn(m, hq, d, device=DEVICE, generator=gen).to(DTYPE)
    caches = [(torch.randn(m, hkv, cache, d, device=DEVICE, generator=gen).to(DTYPE),
               torch.randn(m, hkv, cache, d, device=DEVICE, generator=gen).to(DTYPE)) for _ in range(copies)]
    tune = tuning.current(torch.device(DEVICE))
    for live in lives:
        mask = torch.zeros(m, cache, dtype=torch.long, device=DEVICE)
        mask[:, :live] = 1
        slot = torch.tensor(live - 1, device=DEVICE)
        for target in args.attention_targets:
            for fused in (False, True):
                if time.perf_counter() - START > args.budget_s:
                    return
                plan = tune.with_values("attention", programs_per_sm=target / tune.multiprocessors)
                try:
                    with fast_triton.pdl(True), tuning.use(plan), fast_triton.switches(fused_combine=fused):
                        us = time_calls([lambda kc=kc, vc=vc: fast_attention.split_kv(
                            q, kc, vc, mask, slot, d ** -0.5) for kc, vc in caches], args.reps)
                    rows.append(dict(rows=m, heads=f"{hq}/{hkv}x{d}", cache=cache, live=live,
                                     kernel="split-kv, combine fused" if fused else "split-kv", pdl=True, us=us,
                                     target=target, chunks=str(fast_attention.split_plan(m, hkv, cache, plan))))
                except Exception as error:
                    rows.append(dict(rows=m, cache=cache, live=live, target=target, fused=fused,
                                     error=repr(error)[:300]))
                log(rows[-1])


def part_attention(args, rows):
    dtype = DTYPE
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    cases = ((1, 32, 8, 64, 384, (129, 256, 383)), (4, 32, 8, 64, 384, (256,)), (1, 32, 8, 128, 384, (256,)),
             (1, 32, 8, 64, 4096, (512, 4000)), (64, 32, 8, 64, 384, (256,)))
    if DEVICE != "cuda":
        cases = ((1, 4, 2, 16, 40, (17,)),)
    for m, hq, hkv, d, cache, lives in cases:
        if time.perf_counter() - START > args.budget_s:
            return
        copies = 16 if DEVICE == "cuda" else 1
        q = torch.randn(m, hq, d, device=DEVICE, generator=gen).to(dtype)
        caches = [(torch.randn(m, hkv, cache, d, device=DEVICE, generator=gen).to(dtype),
                   torch.randn(m, hkv, cache, d, device=DEVICE, generator=gen).to(dtype)) for _ in range(copies)]
        for live in lives:
            mask = torch.zeros(m, cache, dtype=torch.long, device=DEVICE)
            mask[:, :live] = 1
            slot = torch.tensor(live - 1, device=DEVICE)
            mask4 = mask.bool()[:, None, None, :]
            kv_bytes = 2 * m * hkv * live * d * 2
            variants = [
                ("sdpa packed, all slots", False, lambda: [lambda kc=kc, vc=vc: fast_attention.decode_attention(
                    q.view(m, hq, 1, d), kc, vc, mask4, d ** -0.5) for kc, vc in caches]),
                ("split-kv", False, lambda: [lambda kc=kc, vc=vc: fast_attention.split_kv(
                    q, kc, vc, mask, slot, d ** -0.5) for kc, vc in caches]),
                ("split-kv", True, lambda: [lambda kc=kc, vc=vc: fast_attention.split_kv(
                    q, kc, vc, mask, slot, d ** -0.5) for kc, vc in caches]),
            ]
            for label, pdl, make in variants:
                try:
                    with fast_triton.pdl(pdl):
                        us = time_calls(make(), args.reps)
                    rows.append(dict(rows=m, heads=f"{hq}/{hkv}x{d}", cache=cache, live=live, kernel=label, pdl=pdl,
                                     us=us, live_kv_tb_s=kv_bytes / us / 1e6,
                                     chunks=str(fast_attention.split_plan(m, hkv, cache))))
                except Exception as error:
                    rows.append(dict(rows=m, cache=cache, live=live, kernel=label, pdl=pdl, error=repr(error)[:300]))
                log(rows[-1])
    _attention_plans(args, rows, gen)
    vocab = 128256 if DEVICE == "cuda" else 4096
    for m in (1, 64):
        xs = [torch.randn(m, vocab, device=DEVICE) for _ in range(8)]
        for label, fn in (("torch.argmax", torch.argmax), ("two-stage argmax", fast_sampling.argmax)):
            us = time_calls([lambda x=x: fn(x, -1) if fn is torch.argmax else fn(x) for x in xs], args.reps)
            rows.append(dict(rows=m, kernel=label, cache=vocab, us=us))
            log(rows[-1])


def _decode(model, prompt, args, **kw):
    return gdtool.decode(model, prompt.input_ids, prompt.attention_mask, max_new_tokens=args.new_tokens,
                         do_sample=False, eos_token_id=None, **kw)


def _accuracy_row(model, model_name, batch, mode, pdl, prompt_len):
    """accuracy.accuracy's per-position table folded into one row: for HF's kernels and kernels="fast", the
    largest and mean |logit - float32 reference| and the share of top-1 tokens equal to the reference's."""
    try:
        if next(model.parameters()).dtype == torch.float32:   # a tiny model on a CPU (the dry run): its bf16 copy
            model = copy.deepcopy(model).to(torch.bfloat16)
        with fast_triton.pdl(pdl):
            df = accuracy.accuracy(model, batch=batch, prompt_len=prompt_len, steps=16, kernels="fast")
        row = dict(model=model_name, batch=batch, kernels="fast and hf vs float32 (teacher-forced)", mode=mode,
                   pdl=pdl, max_abs_logit=float(df.max_abs_logit.max()))
        for name in ("hf", "fast"):
            row.update({f"{name}_max_error": float(df[f"{name}_max_error"].max()),
                        f"{name}_mean_error": float(df[f"{name}_mean_error"].mean()),
                        f"{name}_top1": float(df[f"{name}_top1"].mean())})
        return row
    except Exception as error:
        traceback.print_exc()
        return dict(model=model_name, batch=batch, kernels="accuracy", error=repr(error)[:400])


def part_step(args, rows):
    import gdtool.loops.devloop
    loop_ok = gdtool.loops.devloop.device_loop_support() is None
    for model_name in args.step_models:
        model = gdtool.load_model(model_name, device=DEVICE)
        prompts, tokens = {}, {}
        for batch, kernels, mode, pdl in args.step_cases:
            if mode == "device-loop" and not loop_ok:
                continue
            if kernels == "agree":  # teacher-forced agreement with HF's kernels (compare_kernels)
                try:
                    with fast_triton.pdl(pdl):
                        df = accuracy.compare_kernels(model, batch=batch, prompt_len=args.prompt_len, steps=16,
                                                  kernels="fast")
                    row = dict(model=model_name, batch=batch, kernels="fast vs hf (teacher-forced)", mode=mode,
                               pdl=pdl, top1_agreement=float(df.top1_agreement.mean()),
                               min_top1_agreement=float(df.top1_agreement.min()),
                               max_abs_logit_diff=float(df.max_abs_logit_diff.max()),
                               max_abs_logit=float(df.max_abs_logit.max()),
                               hf_step_ms=float(df.hf_step_ms.iloc[0]), fast_step_ms=float(df.compiled_step_ms.iloc[0]))
                except Exception as error:
                    row = dict(model=model_name, batch=batch, kernels="agree", error=repr(error)[:400])
                    traceback.print_exc()
                rows.append(row)
                log(row)
                continue
            if kernels == "accuracy":  # fast's and HF's bf16 logits each against the model in float32 (accuracy)
                rows.append(_accuracy_row(model, model_name, batch, mode, pdl, args.prompt_len))
                log(rows[-1])
                continue
            if time.perf_counter() - START > args.budget_s:
                log("budget reached: skipping the rest of the step part")
                break
            if batch not in prompts:
                prompts[batch] = gdtool.random_prompts(model, batch=batch, lengths=(args.prompt_len,) * 2, seed=0)
            prompt = prompts[batch]
            row = dict(model=model_name, batch=batch, kernels=kernels, mode=mode, pdl=pdl)
            try:
                with fast_triton.pdl(pdl):
                    t0 = time.perf_counter()
                    first = _decode(model, prompt, args, mode=mode, kernels=kernels)
                    row["first_run_s"] = time.perf_counter() - t0
                    out = _decode(model, prompt, args, mode=mode, kernels=kernels)
                row["ms_per_step"] = out.timings["decode_s"] / out.steps * 1e3
                row["tok_s"] = batch * out.steps / out.timings["decode_s"]
                row["repeat_equal"] = bool(torch.equal(first.tokens, out.tokens))
                if kernels == "fast" and mode == "step-graph" and "captured_equals_uncaptured" not in str(rows):
                    with fast_triton.pdl(pdl):
                        direct = _decode(model, prompt, args, mode=mode, kernels=kernels, capture=False)
                    row["captured_equals_uncaptured"] = bool(torch.equal(direct.tokens, out.tokens))
                ref = tokens.get((batch, "compiled"))
                if ref is not None:
                    row["token_agreement_with_compiled"] = float((ref == out.tokens).float().mean())
                same = tokens.get((batch, kernels))
                if same is not None:
                    row["same_tokens_as_first_case_of_these_kernels"] = bool(torch.equal(same, out.tokens))
                tokens.setdefault((batch, kernels), out.tokens)
                table = fast.compiles(model)
                row["kernels_note"] = table.kernels.iloc[-1] if len(table) else ""
                row["compiles_total"] = int(table.compiles.sum())
            except Exception as error:
                row["error"] = repr(error)[:400]
                traceback.print_exc()
            rows.append(row)
            log(row)
        fast.forget(model)
        del model
        torch.cuda.empty_cache()


def gemv_summary(df):
    """One line per projection: cuBLAS, the default Triton config (PDL off, on), the best config."""
    lines = []
    ok = df[df["us"].notna()] if "us" in df else df.iloc[0:0]
    for (model, proj, m), g in ok.groupby(["model", "proj", "rows"], sort=False):
        cub = g[g.kernel.str.startswith("cublas")]
        default = g[g.kernel.str.contains("default")]
        off, on = default[~default.pdl], default[default.pdl]
        best = g[~g.kernel.str.startswith("cublas") & ~g.pdl].sort_values("us").head(1)

        def cell(x):
            return f"{x.us.iloc[0]:7.2f} us {x.tb_s.iloc[0]:5.2f} TB/s" if len(x) else "-"
        lines.append(f"{model:9s} {proj:8s} M={m} | cublas {cell(cub)} | triton {cell(off)} | +pdl {cell(on)} | "
                     f"best {cell(best)} {best.kernel.iloc[0] if len(best) else ''}")
    return "\n".join(lines)


def _write(out: Path, name: str, rows):
    import pandas as pd
    df = pd.DataFrame(rows)
    df.to_csv(out / f"{name}.csv", index=False)
    return df


def _write_config(args, out: Path, parts: dict) -> None:
    """--write-config: the gemv sweep's fastest tiles per shape and the attention part's fastest target, with
    their provenance (profiles/tuning_files.py)."""
    import tuning_files
    sections, files = {}, []
    if "gemv" in parts:
        sections.update(tuning_files.gemv_sections(tuning_files.gemv_timings(
            out / "gemv.csv", {model: shape[4] for model, shape in SHAPES.items()})))
        files.append(str(out / "gemv.csv"))
    if "attention" in parts and args.attention_targets:
        sections.update(tuning_files.attention_section(parts["attention"].to_dict("records"),
                                                       tuning.current(torch.device(DEVICE)).multiprocessors))
        files.append(str(out / "attention.csv"))
    if sections:
        tuning_files.update(args.write_config, sections, "decode_kernels_probe.py " + " ".join(sys.argv[1:]), files)
        log(f"wrote {', '.join(sections)} into {args.write_config}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="profiles/kernels")
    p.add_argument("--parts", default="check,gemv,attention,step")
    p.add_argument("--models", default="llama-1b,llama-8b", help="shapes for the gemv part")
    p.add_argument("--gemv-rows", default="1,4")
    p.add_argument("--dot", action="store_true", help="gemv part: also gdtool's split-K tensor-core kernel (dot.py) "
                                                      "per projection, the matmul alone as cuBLAS's row")
    p.add_argument("--step-models", default="llama-1b")
    p.add_argument("--cases", default="1:compiled:step-graph:0,1:fast:step-graph:0,1:fast:step-graph:1,"
                                      "1:fast:device-loop:0,64:compiled:step-graph:0,64:fast:step-graph:0,"
                                      "1:fast:device-loop:1",
                   help="step part: batch:kernels:mode:pdl, in order (kernels 'agree': compare_kernels, fast vs hf; "
                        "'accuracy': accuracy.accuracy, fast's and hf's bf16 logits each against float32)")
    p.add_argument("--sweep", default="small", choices=("none", "small", "full"),
                   help="gemv part: tile configs besides the default (small: two neighbours), for --sweep-models")
    p.add_argument("--sweep-models", default="llama-1b", help="the models whose projections --sweep sweeps")
    p.add_argument("--attention-targets", default="", help="attention part: llama-1b's attention at one row also with "
                   "split_plan's TARGET_PROGRAMS at each of these (e.g. 8,16,33,66,132,264), combine fused and not")
    p.add_argument("--write-config", default=None, metavar="PATH",
                   help="write the sweep's picks into this tuning file (gdtool/kernels/configs/; created from the "
                        "device's current one): the gemv part's fastest tiles per shape (--sweep full), the attention "
                        "part's fastest target (--attention-targets); profiles/tuning_files.py")
    p.add_argument("--stack-every", type=float, default=0, help="dump every thread's stack every N s (hangs)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=300.0, help="skip what would start after this many seconds")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the probe's code (tiny shapes, fp16, "
                                                      "TRITON_INTERPRET=1), no figures")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    args.models = args.models.split(",")
    args.sweep_models = args.sweep_models.split(",")
    args.gemv_rows = [int(x) for x in args.gemv_rows.split(",")]
    args.attention_targets = [int(x) for x in args.attention_targets.split(",") if x]
    args.step_models = args.step_models.split(",")
    # the riskiest cases last: a capture that fails can leave the process unusable
    args.step_cases = []
    for case in args.cases.split(","):
        batch, kernels, mode, pdl = case.split(":")
        args.step_cases.append((int(batch), kernels, mode, pdl == "1"))
    unknown = set(args.parts) - {"check", "gemv", "attention", "step"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.stack_every > 0:
        import faulthandler
        faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=sys.stderr)
    import transformers
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global DEVICE, DTYPE
    DEVICE = args.device
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter mishandles bf16
    device = torch.device(DEVICE)
    env = gdtool.measure.record.environment(device)
    env["copy_gb_s"] = roofline.copy_bandwidth(device) / 1e9
    env["triton"] = getattr(fast_triton.triton, "__version__", None)
    env["commit"] = env.get("commit") or os.environ.get("GDTOOL_COMMIT")
    (out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    summaries = []
    for part in args.parts:
        log(f"=== {part}")
        rows = []
        try:
            if part == "check":
                results = testing.check_all(DEVICE, DTYPE)
                rows = [vars(r) for r in results]
            elif part == "gemv":
                part_gemv(args, rows)
            elif part == "attention":
                part_attention(args, rows)
            elif part == "step":
                part_step(args, rows)
        except Exception:
            traceback.print_exc()
        if rows:
            df = _write(out, part, rows)
            summaries.append((part, df))
    if args.write_config:
        _write_config(args, out, dict(summaries))
    print(f"copy bandwidth {env['copy_gb_s']:.0f} GB/s; torch {env['torch']}, triton {env['triton']}")
    for part, df in summaries:
        print(f"== {part}")
        if part == "check":
            bad = df[~df.ok]
            print(f"{len(df) - len(bad)} of {len(df)} checks pass; max err {df.error.max():.2e}")
            if len(bad):
                print(bad[["name", "shape", "error", "reference_error", "note"]].to_string(index=False))
        elif part == "gemv":
            print(gemv_summary(df))
            if "error" in df and df.error.notna().any():
                print(df[df.error.notna()][["model", "proj", "rows", "kernel", "error"]].to_string(index=False))
        elif part in ("attention", "step"):
            cols = [c for c in df.columns if c not in ("kernels_note", "chunks")]
            print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
            if "kernels_note" in df:
                print("\n".join(sorted(set(df.kernels_note.dropna()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
