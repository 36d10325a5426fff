"""kernels="compiled" on a GPU: how close to HF's kernels, how fast, and what sampling costs.

The fast step is gdtool's decode step compiled by inductor and captured in gdtool's graph. It is
not bitwise generate() any more, so the first question is how far its logits move; the second is
what the in-graph sampling costs over greedy (the target: at most 10% per step), and whether
generate()'s full-vocabulary sort is worth avoiding. Parts, run in the order given, each writing
its files as soon as it ends (a part cut short by a time limit leaves the earlier ones):

  select     token selection alone, captured, per batch: greedy argmax; HF's order (penalty,
             temperature, top-k, top-p through a sort of the vocabulary); the sort-free sampler
             (`gdtool.kernels.sampling`); top-p alone (sort). HF's eager kernels and inductor's.
             -> select.csv (µs per call, median of 5 x 200 replays)
  agreement  per model: the same prompt and the same continuation fed token by token through the
             step with HF's kernels and with kernels="compiled" (greedy, captured): top-1 agreement
             and largest logit difference per position, each step's device time; on the HF logits,
             the sort-free sampler against HF's sampler with the same noise, ties beyond the
             sampler's slack, and whether this GPU's torch.sort keeps ties in id order. Models in
             --fused-models run a third time with q/k/v and gate/up fused (`gdtool.kernels.fuse`).
             -> agreement.csv (one row per model x variant x position), agreement_summary.csv
  decode     gdtool.decode(mode="step-graph") end to end, kernels hf and compiled, greedy vs
             sampling (temperature 0.8, top-k 50, top-p 0.9, repetition penalty 1.1), EOS off,
             median of 3 after a warm-up run -> decode.csv (ms per step, tok/s, % over greedy);
             --decode-kernels compiled-fused adds the fused projections

The last stdout line is one JSON document (the summaries and the files written).

    python profiles/fast_probe.py --out $OUT/fast                                   # all parts, default models
    python profiles/fast_probe.py --parts select --batches 1,64                      # seconds
    python profiles/fast_probe.py --parts agreement --models llama-8b --steps 16
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

import gdtool
import gdtool.kernels.fuse
from gdtool.frontends import bench
from gdtool.kernels import step as fast, sampling as fast_sampling
from gdtool.measure import accuracy, roofline
from gdtool.core import sampling
from gdtool.core.settings import Settings

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)
SELECT_VARIANTS = ("greedy", "sample-hf-order", "sample-sort-free", "sample-top-p-only", "part-warp",
                   "part-topk-sorted", "part-topk-unsorted", "part-noise", "part-candidates")
CASES = ("greedy", "sample", "sample-top-p-only")


def log(message):
    print(message, file=sys.stderr, flush=True)


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def _free(model=None):
    if model is not None:
        fast.forget(model)
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _settings(**kw) -> Settings:
    base = dict(max_new_tokens=2, do_sample=False, temperature=None, top_k=None, top_p=None,
                repetition_penalty=None, eos_token_id=(), pad_token_id=0)
    base.update(kw)
    return Settings(**base)


# ------------------------------------------------------------------------------------------ select

def time_captured(fn, device: torch.device, replays: int = 200, rounds: int = 5) -> float:
    """µs per call of `fn` captured in a CUDA graph: median over rounds of `replays` replays (on a CPU,
    for a dry run of this script: wall time of direct calls)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(replays // 20):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / (replays // 20))
        return _median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    graph.reset()
    return _median(times)


def part_select(args, out: Path) -> list[dict]:
    """Selection alone: greedy vs samplers, HF's eager kernels vs inductor's, per batch."""
    import pandas as pd

    device = torch.device(args.device)
    vocab = args.vocab
    variants = {
        "greedy": (_settings(), lambda logits, seen, s: sampling.choose(sampling.process(logits, seen, s), False)),
        "sample-hf-order": (_settings(**SAMPLING),
                            lambda logits, seen, s: sampling.choose(sampling.process(logits, seen, s), True)),
        "sample-sort-free": (_settings(**SAMPLING), lambda logits, seen, s: fast_sampling.choose(logits, seen, s)),
        "sample-top-p-only": (_settings(**dict(SAMPLING, top_k=None)),
                              lambda logits, seen, s: sampling.choose(sampling.process(logits, seen, s), True)),
    }
    sample = _settings(**SAMPLING)
    width = SAMPLING["top_k"] + fast_sampling.TIE_SLACK
    # the sort-free sampler's pieces, alone: where its time goes
    parts = {
        "part-warp": (sample, lambda logits, seen, s: fast_sampling.warp(logits, seen, s)),
        "part-topk-sorted": (sample, lambda logits, seen, s: torch.topk(logits, width, dim=-1)),
        "part-topk-unsorted": (sample, lambda logits, seen, s: torch.topk(logits, width, dim=-1, sorted=False)),
        "part-noise": (sample, lambda logits, seen, s: torch.empty_like(logits).exponential_(1)[:, :width].clone()),
        "part-candidates": (sample, lambda logits, seen, s: fast_sampling.candidates(logits, s.top_k, s.top_p)),
    }
    variants.update(parts)
    assert tuple(variants) == SELECT_VARIANTS, "SELECT_VARIANTS names the variants, for the CLI's check"
    if args.select_variants:
        variants = {k: v for k, v in variants.items() if k in args.select_variants}
    rows = []
    for batch in args.batches:
        gen = torch.Generator(device=device).manual_seed(0)
        # bf16 logits upcast, as the step sees them (ties included)
        logits = (torch.randn(batch, vocab, device=device, generator=gen) * 3).bfloat16().float()
        seen = torch.rand(batch, vocab, device=device, generator=gen) < 0.001
        for name, (settings, select) in variants.items():
            for kernels in args.select_kernels:
                def fn(select=select, settings=settings):
                    return select(logits, seen, settings)
                if kernels == "compiled":
                    torch._dynamo.reset()  # every variant's `fn` shares one code object, and its recompile limit
                    fn = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False,
                                       options=fast.INDUCTOR_OPTIONS)
                t0 = time.perf_counter()
                try:
                    us = time_captured(fn, device)
                    status = "ok"
                except Exception as error:  # a failing variant is a finding, not the end of the probe
                    traceback.print_exc(limit=6)
                    us, status = float("nan"), f"error: {type(error).__name__}: {str(error)[:160]}"
                rows.append(dict(batch=batch, vocab=vocab, variant=name, kernels=kernels, us_per_call=us,
                                 status=status, setup_s=time.perf_counter() - t0))
                log(f"[select] b{batch} {name:18s} {kernels:8s} {us:9.1f} µs  {status}")
        torch._dynamo.reset()
    df = pd.DataFrame(rows)
    greedy = df[df["variant"] == "greedy"].set_index(["batch", "kernels"]).us_per_call
    df["us_over_greedy"] = [r.us_per_call - greedy.get((r.batch, r.kernels), float("nan")) for r in df.itertuples()]
    df.to_csv(out / "select.csv", index=False)
    return df.to_dict("records")


# --------------------------------------------------------------------------------------- agreement

def sampler_checks(logits: torch.Tensor) -> dict:
    """On real logits [T, B, V] (HF kernels): the sort-free sampler against HF's with the same noise."""
    settings = _settings(**dict(SAMPLING, repetition_penalty=None))
    flat = logits[1:].reshape(-1, logits.shape[-1]).float()
    gen = torch.Generator(device=flat.device).manual_seed(0)
    noise = torch.empty_like(flat).exponential_(1, generator=gen)
    fast_tokens = fast_sampling.choose(flat, None, settings, noise)
    hf_tokens = torch.argmax(torch.softmax(sampling.process(flat, None, settings), -1) / noise, -1)
    warped = fast_sampling.warp(flat, None, settings)
    kth = torch.topk(warped, settings.top_k, dim=-1).values[:, -1:]
    tied_beyond = int(((warped >= kth).sum(-1) > settings.top_k + fast_sampling.TIE_SLACK).sum())
    unstable = torch.sort(warped, dim=-1)[1]
    stable = torch.sort(warped, dim=-1, stable=True)[1]
    return {"sampler_rows": int(flat.shape[0]),
            "sampler_token_agreement": float((fast_tokens == hf_tokens).float().mean()),
            "rows_tied_beyond_slack": tied_beyond,
            "rows_with_ties_at_kth": int(((warped >= kth).sum(-1) > settings.top_k).sum()),
            "sort_keeps_ties_in_id_order": bool(torch.equal(unstable, stable))}


def part_agreement(args, out: Path, copy_bytes_s: float) -> list[dict]:
    import pandas as pd

    tables, summaries = [], []
    for name in args.models:
        t0 = time.perf_counter()
        model = None
        try:
            model = gdtool.load_model(name, seed=0, device=args.device)
            prompt = gdtool.random_prompts(model, batch=args.agreement_batch,
                                           lengths=(args.prompt_len, args.prompt_len), seed=0)
            vocab = model.config.get_text_config().vocab_size
            continuation = torch.randint(3, vocab, (args.agreement_batch, args.steps),
                                         generator=torch.Generator().manual_seed(1))
            hf = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, "hf")
            t1 = time.perf_counter()
            compiled = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, "compiled")
            compile_s = time.perf_counter() - t1
            df = accuracy.agreement(hf["logits"], compiled["logits"])
            df.insert(0, "model", name)
            df.insert(1, "variant", "compiled")
            df["batch"], df["prompt_len"] = args.agreement_batch, args.prompt_len
            tables.append(df)
            fused = {}
            if name in args.fused_models:
                gdtool.kernels.fuse.fuse_projections(model)
                t1 = time.perf_counter()
                run = accuracy.teacher_forced(model, prompt.input_ids, prompt.attention_mask, continuation, "compiled")
                fdf = accuracy.agreement(hf["logits"], run["logits"])
                fdf.insert(0, "model", name)
                fdf.insert(1, "variant", "compiled-fused")
                fdf["batch"], fdf["prompt_len"] = args.agreement_batch, args.prompt_len
                tables.append(fdf)
                fused = dict(fused_top1_agreement=float(fdf.top1_agreement.mean()),
                             fused_max_abs_logit_diff=float(fdf.max_abs_logit_diff.max()),
                             fused_step_ms=run["step_ms"], fused_compile_and_capture_s=time.perf_counter() - t1)
            pd.concat(tables).to_csv(out / "agreement.csv", index=False)
            nbytes = roofline.step_bytes(model, args.agreement_batch, args.prompt_len, args.steps)["bytes_per_step"]
            summary = dict(model=name, batch=args.agreement_batch, prompt_len=args.prompt_len, positions=len(df),
                           top1_agreement=float(df.top1_agreement.mean()),
                           min_top1_agreement=float(df.top1_agreement.min()),
                           max_abs_logit_diff=float(df.max_abs_logit_diff.max()),
                           max_abs_logit=float(df.max_abs_logit.max()),
                           hf_step_ms=hf["step_ms"], compiled_step_ms=compiled["step_ms"],
                           speedup=hf["step_ms"] / compiled["step_ms"],
                           compiled_floor_pct=100 * nbytes / (compiled["step_ms"] / 1e3) / copy_bytes_s,
                           compile_and_capture_s=compile_s, compiles=int(fast.compiles(model).compiles.sum()),
                           **fused, **sampler_checks(hf["logits"]), status="ok")
        except Exception as error:
            traceback.print_exc(limit=8)
            summary = dict(model=name, status=f"error: {type(error).__name__}: {str(error)[:200]}")
        summary["wall_s"] = time.perf_counter() - t0
        summaries.append(summary)
        pd.DataFrame(summaries).to_csv(out / "agreement_summary.csv", index=False)
        log(f"[agreement] {json.dumps(summary)}")
        _free(model)
        del model
        _free()
    return summaries


# ------------------------------------------------------------------------------------------ decode

def part_decode(args, out: Path) -> list[dict]:
    import pandas as pd

    model = gdtool.load_model(args.decode_model, seed=0, device=args.device)
    cases = {"greedy": dict(do_sample=False), "sample": SAMPLING,
             "sample-top-p-only": dict(SAMPLING, top_k=None)}
    assert tuple(cases) == CASES, "CASES names the cases, for the CLI's check"
    rows = []
    # fusing is permanent for the loaded model: the fused runs come last, after every batch size's others
    order = sorted(args.decode_kernels, key=lambda k: k == "compiled-fused")
    for kernels, batch in [(k, b) for k in order for b in args.decode_batches]:
        prompt = gdtool.random_prompts(model, batch=batch, lengths=(args.prompt_len, args.prompt_len), seed=0)
        if kernels == "compiled-fused":
            gdtool.kernels.fuse.fuse_projections(model)
        for case in args.cases:
            settings = dict(cases[case], eos_token_id=None, pad_token_id=0, max_new_tokens=args.max_new_tokens)
            t0 = time.perf_counter()
            try:
                kernels_arg = "compiled" if kernels == "compiled-fused" else kernels
                gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", seed=0,
                              kernels=kernels_arg, **settings)
                warm_s = time.perf_counter() - t0
                ms = []
                for repeat in range(3):
                    o = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="step-graph",
                                      seed=repeat, kernels=kernels_arg, **settings)
                    assert o.tokens.shape == (batch, args.max_new_tokens), o.tokens.shape
                    ms.append(o.timings["decode_s"] * 1e3 / o.steps)
                row = dict(model=args.decode_model, batch=batch, kernels=kernels, case=case,
                           ms_per_step=_median(ms), tok_s=batch * 1e3 / _median(ms), warmup_s=warm_s, status="ok")
            except Exception as error:
                traceback.print_exc(limit=8)
                row = dict(model=args.decode_model, batch=batch, kernels=kernels, case=case,
                           status=f"error: {type(error).__name__}: {str(error)[:200]}")
            rows.append(row)
            log(f"[decode] {json.dumps(row)}")
            df = pd.DataFrame(rows)
            if "ms_per_step" in df:
                greedy = df[df.case == "greedy"].set_index(["batch", "kernels"]).ms_per_step
                df["pct_over_greedy"] = [100 * (r.ms_per_step / greedy.get((r.batch, r.kernels), float("nan")) - 1)
                                         for r in df.itertuples()]
            df.to_csv(out / "decode.csv", index=False)
    rows = pd.read_csv(out / "decode.csv").to_dict("records")
    del model
    _free()
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda kind: (lambda text: [kind(x) for x in text.split(",") if x])  # noqa: E731
    p.add_argument("--parts", type=csv(str), default=["select", "agreement", "decode"])
    p.add_argument("--models", type=csv(str), default=["llama-1b", "qwen2.5-0.5b", "llama-8b"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="teacher-forced positions per model")
    p.add_argument("--agreement-batch", type=int, default=4)
    p.add_argument("--batches", type=csv(int), default=[1, 64], help="select part")
    p.add_argument("--vocab", type=int, default=128256, help="select part (Llama 3's vocabulary)")
    p.add_argument("--select-variants", type=csv(str), default=[],
                   help="select part: only these variants (greedy, sample-hf-order, sample-sort-free, "
                        "sample-top-p-only, and the sort-free sampler's parts part-warp, part-topk-sorted, "
                        "part-topk-unsorted, part-noise, part-candidates); default all")
    p.add_argument("--select-kernels", type=csv(str), default=["hf", "compiled"])
    p.add_argument("--decode-model", default="llama-1b")
    p.add_argument("--decode-batches", type=csv(int), default=[1, 64])
    p.add_argument("--decode-kernels", type=csv(str), default=["compiled", "hf"],
                   help="hf, compiled, compiled-fused (q/k/v and gate/up fused; runs last)")
    p.add_argument("--fused-models", type=csv(str), default=["llama-1b"],
                   help="agreement part: also run these models with fused projections")
    p.add_argument("--cases", type=csv(str), default=["greedy", "sample"],
                   help="decode part: greedy, sample, sample-top-p-only")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="profiles/fast")
    p.add_argument("--device", default="cuda",
                   help="cpu: a dry run of the code paths with tiny models (its times mean nothing)")
    p.add_argument("--stack-every", type=float, default=0,
                   help="print every thread's Python stack to stderr every this many seconds (0: never): shows "
                        "where a run that never finishes waits (compiling, capturing or in a CUDA sync)")
    args = p.parse_args(argv)
    for flag, given, known in (("--select-variants", args.select_variants, SELECT_VARIANTS),
                               ("--cases", args.cases, CASES),
                               ("--select-kernels", args.select_kernels, ("hf", "compiled")),
                               ("--decode-kernels", args.decode_kernels, ("hf", "compiled", "compiled-fused"))):
        unknown = [x for x in given if x not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fast_probe needs a CUDA GPU; --device cpu --models tiny-llama runs its code paths on a CPU")
    import transformers
    transformers.logging.set_verbosity_error()
    if args.stack_every > 0:
        faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    env = gdtool.measure.record.environment(device)
    copy_bytes_s = roofline.copy_bandwidth(device)
    env["copy_gb_s"] = copy_bytes_s / 1e9
    (out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    result = {"probe": "fast", "device": env["device_name"], "torch": env["torch"],
              "transformers": env["transformers"], "copy_gb_s": round(copy_bytes_s / 1e9, 1)}
    for part in args.parts:
        t0 = time.perf_counter()
        log(f"=== {part}")
        try:
            if part == "select":
                result["select"] = part_select(args, out)
            elif part == "agreement":
                result["agreement"] = part_agreement(args, out, copy_bytes_s)
            elif part == "decode":
                result["decode"] = part_decode(args, out)
            else:
                raise ValueError(f"unknown part {part!r}; parts are select, agreement, decode")
        except Exception as error:
            traceback.print_exc(limit=8)
            result[part] = f"error: {type(error).__name__}: {str(error)[:200]}"
        log(f"=== {part} done in {time.perf_counter() - t0:.1f} s")
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    result["files"] = sorted(str(p) for p in out.iterdir())
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
