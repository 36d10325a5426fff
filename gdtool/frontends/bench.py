"""Decode speed of gdtool's modes against what a user would run instead, side by side in one process.

The physics. A decode step turns one token per row into the next one. It must read every weight
once and the key/value cache of every row up to its current length; at batch 1 that is all the
work there is (a 1B model in bf16: ~2.5 GB per step, ~0.6 ms at ~4.3 TB/s of copy bandwidth). That
read time is the *bandwidth floor*: no step runs faster. Two things keep a step above it:

- **host-bound**: an eager step launches hundreds of small kernels from Python, each costing several
  microseconds of host time, and syncs with the host to decide whether to stop. The GPU idles
  between launches; the step costs what the host costs. `model.generate()` at batch 1 lives here.
- **device-bound**: once launches are gone (a CUDA graph replays the whole step in one call), the
  step costs what its kernels cost: how many there are, and how close each comes to the bandwidth
  (GEMVs at batch 1; attention over the cache at large batch). Fusing kernels (torch.compile) and
  reading only the live cache move it toward the floor.

The table reports, per runner: decode tokens/s (batch x decode steps / decode wall time, the
prefill and any warm-up, compile or capture excluded), milliseconds per step, the achieved GB/s
(bytes one step must read / step time) and that as a % of the copy bandwidth measured in the same
run (100% = the floor), compile counts (a compiled peer that silently ran eager is no peer), and the
ratio of each gdtool mode to each peer. Bytes one step must read: all weights once (an untied input
embedding only for the rows looked up) plus the live KV cache at its mean length over the run,
2 x layers x kv_heads x head_dim x (prompt + new_tokens / 2) x batch x dtype size.

Peers: HF `generate()` eager (dynamic cache); `generate(cache_implementation="static")`, which
compiles the decode forward by itself (torch.compile, mode "reduce-overhead"); and a gpt-fast-style
step: forward + argmax under `torch.compile(mode="reduce-overhead", fullgraph=True)` over a static
cache, position advanced on the device, no EOS check. Compiled peers need CUDA; on CPU they are
reported n/a. Every run is greedy with EOS off, so every row emits exactly `max_new_tokens` tokens
(asserted). Each runner gets a warm-up run (compile and capture happen there; runners that compile
nothing are warmed with 16 tokens), then `--repeats` timed runs; the table shows medians, the
p20-p80 band of ms/step, and `agree`: the share of tokens equal to those of gdtool's eager mode (HF's
kernels over a static cache, what `generate(cache_implementation="static")` emits), or of `generate()`
when eager is not measured. Read it with care on random weights in bf16: logits are nearly tied, so
a rounding difference changes a token within a few steps and the rows diverge from there. Dynamic-
cache `generate()` attends over a different key length than a static cache (different kernels and
rounding), and on a GPU PyTorch's default kernels are not run-to-run reproducible over long decodes
(`--deterministic` in `python -m gdtool run`); the bitwise claims are tested, not read from this column.

    python -m gdtool bench --model tiny-llama --batch 2 --prompt-len 8 --max-new-tokens 8   # CPU, seconds
    python -m gdtool bench --model llama-1b --batch 1,64                    # GPU: table + results/bench/
    python -m gdtool bench --model llama-8b --batch 1 --modes step-graph --peers gpt-fast --kernels hf,compiled
    python -m gdtool bench --workload rollout --model llama-1b --slots 64 --prompts 1024 --prompt-len 128 --lengths geom:128:512

`--workload rollout` measures another workload with options of its own (gdtool.frontends.rollout_bench; its
--help lists them): many prompts with ragged response lengths through `--slots` rows, useful tokens per second
of gdtool.rollout's static batches, host and device refills against transformers' continuous batching.

Results go to `<out>/<config name>.csv` (one row per runner x timed repeat, every config field a
column) and `<config name>.json` (environment: GPU, driver, torch, transformers, git commit, date;
the config; the summary), written after every config. The last stdout line is one JSON document.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import estimate, options
from ..measure import record
from ..core.deprecation import renamed
from ..core.models import load_model, random_prompts
from ..core.modes import DEFAULT_KERNELS
from ..loops.decoder import Decoder
# the roofline helpers' home is measure/roofline.py; expert_hit_share stays importable from here for one release
from ..measure.roofline import copy_bandwidth, expert_hit_share, step_bytes

PEERS = ("generate", "generate-static", "gpt-fast")
COMPILED_PEERS = ("generate-static", "gpt-fast")
PEER_LABELS = {
    "generate": "HF generate (eager)",
    "generate-static": "HF generate static+compile",
    "gpt-fast": "gpt-fast-style step",
}
# Runners that compile and capture nothing are warmed with a short run: it loads the same kernels.
SHORT_WARMUP_TOKENS = 16
# gpt-fast-style warm-up: three steps let cudagraph trees warm up, record, then replay.
GPTFAST_WARMUP_STEPS = 3


@dataclass(frozen=True)
class BenchConfig(record.Config):
    """One benchmark point; every runner is measured on it in the same process. ``name`` and ``hash``
    (also ``config_hash``) as every run config has them (`gdtool.measure.record.Config`)."""

    model: str
    batch: int
    prompt_len: int = 128
    max_new_tokens: int = 256
    repeats: int = 3
    modes: tuple[str, ...] = ("eager", "forward-graph", "step-graph")
    peers: tuple[str, ...] = PEERS
    kernels: tuple[str, ...] = (DEFAULT_KERNELS,)
    seed: int = 0
    fused_projections: bool = False   # gdtool.kernels.fuse.fuse_projections(model) before anything runs

    def name_parts(self) -> list:
        parts = [Path(self.model).name or self.model, f"b{self.batch}", f"p{self.prompt_len}",
                 f"n{self.max_new_tokens}"]
        kernels = list(dict.fromkeys(k for _, k in runners(self.modes, self.kernels)))
        if kernels and kernels != [DEFAULT_KERNELS]:
            parts.append("k" + "+".join(kernels))
        if self.fused_projections:
            parts.append("fused")
        return parts

    @property
    def steps(self) -> int:
        """Decode forwards after the prefill (the prefill yields the first token)."""
        return self.max_new_tokens - 1


@dataclass
class Sample:
    """One timed run of one runner."""

    decode_s: float        # wall time of the decode steps after the prefill, final sync included
    prefill_s: float       # prompt forward + first token (for gdtool: its own timings["prefill_s"])
    steps: int             # decode forwards timed in decode_s
    tokens: torch.Tensor   # [B, max_new_tokens] generated tokens, on CPU


@dataclass
class RunnerResult:
    runner: str
    family: str                      # "gdtool" or "peer"
    label: str
    kernels: str = ""
    status: str = "ok"               # ok | n/a (...) | eager-fallback | error: ...
    note: str = ""
    warmup_s: float = float("nan")   # warm-up run wall time, compile and capture included
    samples: list[Sample] = field(default_factory=list)
    compile: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- measurement helpers

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)




def _dynamo_fresh() -> None:
    """Forget every compiled graph and counter, as a fresh process would start."""
    import torch._dynamo
    from torch._dynamo import utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    if hasattr(dynamo_utils, "clear_compilation_metrics"):
        dynamo_utils.clear_compilation_metrics()


def _dynamo_stats() -> dict:
    from torch._dynamo import utils as dynamo_utils

    counters = dynamo_utils.counters
    metrics = dynamo_utils.get_compilation_metrics() if hasattr(dynamo_utils, "get_compilation_metrics") else []
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(1 for m in metrics if getattr(m, "recompile_reason", None)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


# ----------------------------------------------------------------------------- runners
# Each factory returns once(new_tokens) -> Sample. The driver calls it for the warm-up, then
# `repeats` times with cfg.max_new_tokens, then once.close() where it has one.

class _GdtoolRunner:
    """once(new_tokens) for one of gdtool's modes: a Decoder keeps its engine (graphs, cache, buffers) while the
    length stays, so the timed runs replay the graph the last run of that length captured, as a serving loop or
    an RL rollout would."""

    def __init__(self, model, prompt, mode: str, kernels: str):
        self.model, self.prompt, self.mode, self.kernels = model, prompt, mode, kernels
        self.decoder = None

    def __call__(self, new_tokens: int) -> Sample:
        if self.decoder is None:
            self.decoder = Decoder(self.model, self.mode, max_graphs=1, kernels=self.kernels, do_sample=False,
                                   eos_token_id=None, max_new_tokens=new_tokens)
        elif self.decoder.settings.max_new_tokens != new_tokens:
            self.decoder.configure(max_new_tokens=new_tokens)
        out = self.decoder.generate(self.prompt.input_ids, self.prompt.attention_mask)
        return Sample(decode_s=out.timings["decode_s"], prefill_s=out.timings["prefill_s"],
                      steps=out.steps, tokens=out.tokens)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()


def _generate_runner(model, prompt, static: bool):
    from transformers import LogitsProcessor, LogitsProcessorList

    device = prompt.input_ids.device

    class FirstTokenClock(LogitsProcessor):
        """Stamps the time when the prefill logits exist (one sync, first call only)."""

        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                _sync(device)
                self.at = time.perf_counter()
            return scores

    def once(new_tokens: int) -> Sample:
        clock = FirstTokenClock()
        t0 = time.perf_counter()
        out = model.generate(
            prompt.input_ids, attention_mask=prompt.attention_mask, max_new_tokens=new_tokens,
            do_sample=False, eos_token_id=None,  # an explicit None overrides the model's EOS
            pad_token_id=0, cache_implementation="static" if static else "dynamic",
            logits_processor=LogitsProcessorList([clock]))
        _sync(device)
        t1 = time.perf_counter()
        return Sample(decode_s=t1 - clock.at, prefill_s=clock.at - t0, steps=new_tokens - 1,
                      tokens=out[:, prompt.input_ids.shape[1]:].cpu())

    return once


def _gptfast_runner(model, prompt, max_new_tokens: int, compile_kwargs: dict | None):
    """gpt-fast's decode on an HF model: one compiled function (forward + argmax) per step, a
    static cache, the position a device tensor advanced in place, no EOS check, no host sync."""
    from ..core import compat

    input_ids = prompt.input_ids
    if not bool(prompt.attention_mask.all()):
        raise ValueError("the gpt-fast-style peer takes unpadded prompts; use equal prompt lengths")
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    cache_kw, has_logits_to_keep = compat.forward_kwargs(model)
    # the size generate(cache_implementation="static") allocates: the last decode step writes slot P + N - 2
    cache = compat.static_cache(model, prompt_len + max_new_tokens - 1)
    prefill_extra = {"logits_to_keep": 1} if has_logits_to_keep else {}

    def step(token, position):
        logits = model(input_ids=token, position_ids=position, use_cache=True, **{cache_kw: cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step_fn = torch.compile(step, **compile_kwargs) if compile_kwargs is not None else step

    @torch.inference_mode()
    def once(new_tokens: int) -> Sample:
        cache.reset()  # zeroes K/V in place and rewinds the cache's write counter
        t0 = time.perf_counter()
        logits = model(input_ids=input_ids, position_ids=torch.arange(prompt_len, device=device)[None],
                       use_cache=True, **{cache_kw: cache}, **prefill_extra).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.full((1, 1), prompt_len, dtype=torch.long, device=device)
        tokens = [token]
        _sync(device)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = step_fn(token, position).clone()  # the compiled graph reuses its output buffer
            position += 1
            tokens.append(token)
        _sync(device)
        t2 = time.perf_counter()
        return Sample(decode_s=t2 - t1, prefill_s=t1 - t0, steps=new_tokens - 1, tokens=torch.cat(tokens, 1).cpu())

    return once


def _measure(result: RunnerResult, once, cfg: BenchConfig, warmup_tokens: int, compiled) -> RunnerResult:
    """Warm-up run, then cfg.repeats timed runs; checks token counts and compile counters."""
    _dynamo_fresh()
    t0 = time.perf_counter()
    once(warmup_tokens)
    result.warmup_s = time.perf_counter() - t0
    after_warmup = _dynamo_stats()
    for _ in range(cfg.repeats):
        sample = once(cfg.max_new_tokens)
        expected = (cfg.batch, cfg.max_new_tokens)
        if tuple(sample.tokens.shape) != expected:
            raise AssertionError(f"{result.runner} generated tokens of shape {tuple(sample.tokens.shape)}, "
                                 f"expected {expected}: EOS must be off and every row run to the end")
        if sample.steps != cfg.steps:
            raise AssertionError(f"{result.runner} ran {sample.steps} decode steps, expected {cfg.steps}")
        result.samples.append(sample)
    stats = _dynamo_stats()
    stats["graphs_in_timed_runs"] = stats["graphs"] - after_warmup["graphs"]
    result.compile = stats
    notes = []
    if (compiled() if callable(compiled) else compiled) and stats["graphs"] == 0:
        result.status = "eager-fallback"
        notes.append("torch.compile produced no graph: this peer ran eager")
    if stats["graphs_in_timed_runs"]:
        notes.append(f"{stats['graphs_in_timed_runs']} graph(s) compiled during timed runs")
    if compiled and result.family == "peer" and stats["cudagraph_skips"]:
        notes.append(f"cudagraphs skipped {stats['cudagraph_skips']}x")
    if stats["graph_breaks"]:
        notes.append(f"{stats['graph_breaks']} graph break(s)")
    result.note = "; ".join(filter(None, [result.note, *notes]))
    return result


def _cleanup(model, attrs_before: set) -> None:
    # generate() leaves its compiled forward, cache and cache length on the model; drop them so
    # the next runner starts from the model as loaded
    for name in set(vars(model)) - attrs_before:
        delattr(model, name)
    _dynamo_fresh()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class _Planned:
    result: RunnerResult
    make_once: object = None        # () -> once(new_tokens) -> Sample; None: not run (n/a)
    warmup_tokens: int = 0
    expects_graphs: object = False  # torch.compile must have produced graphs, else "eager-fallback" (a callable:
                                    # asked after the runs)


def _expects_graphs(model):
    """kernels other than HF's: graphs are expected unless the step compiled nothing by design (`compiled_nothing`)."""
    def expects() -> bool:
        from ..kernels.step import compiled_nothing
        return not compiled_nothing(model)
    return expects


def runners(modes: tuple[str, ...], kernels: tuple[str, ...]) -> list[tuple[str, str]]:
    """(mode, kernels) pairs in run order: each plain mode once per kernels option, kernels-major; an
    entry written ``mode+kernels`` (``step-graph+compiled``) runs once, with those kernels only."""
    pinned = [tuple(m.split("+", 1)) for m in modes if "+" in m]
    plain = [m for m in modes if "+" not in m]
    pairs = [(m, k) for k in kernels for m in plain]
    return pairs + [p for p in pinned if p not in pairs]


def _plan(model, prompt, cfg: BenchConfig, device: torch.device) -> list[_Planned]:
    """The runners of one config, in run order: gdtool's modes (per kernels), then the peers."""
    plan = []
    for mode, kernels in runners(cfg.modes, cfg.kernels):
        runner = mode if kernels == DEFAULT_KERNELS else f"{mode}+{kernels}"
        plan.append(_Planned(
            RunnerResult(runner, "gdtool", f"gdtool {runner}", kernels=kernels),
            lambda mode=mode, kernels=kernels: _GdtoolRunner(model, prompt, mode, kernels),
            # compiled kernels key on the cache length: warm them with the timed length
            min(cfg.max_new_tokens, SHORT_WARMUP_TOKENS) if mode == "eager" and kernels == DEFAULT_KERNELS
            else cfg.max_new_tokens,
            expects_graphs=_expects_graphs(model) if kernels != DEFAULT_KERNELS and device.type == "cuda" else False))
    for peer in cfg.peers:
        result = RunnerResult(peer, "peer", PEER_LABELS[peer])
        if peer in COMPILED_PEERS and device.type != "cuda":
            result.status, result.note = "n/a (cpu)", "compiled peers run on CUDA only"
            plan.append(_Planned(result))
        elif peer == "generate":
            plan.append(_Planned(result, lambda: _generate_runner(model, prompt, static=False),
                                 min(cfg.max_new_tokens, SHORT_WARMUP_TOKENS)))
        elif peer == "generate-static":
            # warmed with the timed length: a longer static cache later would recompile
            plan.append(_Planned(result, lambda: _generate_runner(model, prompt, static=True),
                                 cfg.max_new_tokens, expects_graphs=True))
        else:
            plan.append(_Planned(result, lambda: _gptfast_runner(model, prompt, cfg.max_new_tokens,
                                                                 dict(mode="reduce-overhead", fullgraph=True)),
                                 GPTFAST_WARMUP_STEPS + 1, expects_graphs=True))
    return plan


def run_config(model, cfg: BenchConfig, log=print, on_runner=None) -> list[RunnerResult]:
    """Run every gdtool mode and peer of one config on `model`; returns one result per runner
    (`on_runner(result)` is called after each)."""
    device = next(model.parameters()).device
    prompt = random_prompts(model, batch=cfg.batch, lengths=(cfg.prompt_len, cfg.prompt_len), seed=cfg.seed)
    results = []
    for planned in _plan(model, prompt, cfg, device):
        result = planned.result
        if planned.make_once is not None:
            attrs_before = set(vars(model))
            once = None
            try:
                once = planned.make_once()
                _measure(result, once, cfg, planned.warmup_tokens, planned.expects_graphs)
                if result.kernels == "fast":  # which of gdtool's kernels ran (and where HF's stayed, why)
                    from ..kernels.step import compiles
                    used = compiles(model)
                    if len(used):
                        result.note = "; ".join(filter(None, [result.note, used.kernels.iloc[-1]]))
            except Exception as error:  # keep measuring the others; the row says what broke
                traceback.print_exc(limit=8, file=sys.stderr)
                message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
                result.status = f"error: {type(error).__name__}: {message}"
                result.samples.clear()
            finally:
                getattr(once, "close", lambda: None)()
                _cleanup(model, attrs_before)
        results.append(result)
        timing = ""
        if result.samples:
            ms = _median([s.decode_s for s in result.samples]) * 1e3 / cfg.steps
            timing = f", median {ms:.3f} ms/step, warm-up {result.warmup_s:.1f} s, {result.compile['graphs']} graph(s)"
        log(f"[bench] {cfg.name} {result.label}: {result.status}{timing}")
        if on_runner is not None:
            on_runner(result)
    return results


# ----------------------------------------------------------------------------- tables and files

def _median(values):
    values = sorted(values)
    n = len(values)
    return float("nan") if n == 0 else (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2)


def _percentile(values, q):
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def tidy_rows(cfg: BenchConfig, results: list[RunnerResult], bytes_info: dict, copy_bytes_s: float,
              device_name: str) -> "pandas.DataFrame":
    """One row per runner x timed repeat (a runner with no sample gets one row of NaNs)."""
    import pandas as pd

    # gdtool eager (HF's kernels over a static cache: generate(cache_implementation="static")'s tokens)
    reference = next((r for r in results if r.runner in ("eager", "generate") and r.samples), None)
    reference = reference or next((r for r in results if r.samples), None)
    config = {k: (",".join(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}
    rows = []
    for r in results:
        agree = float("nan")
        if r.samples and reference is not None:
            agree = float((r.samples[-1].tokens == reference.samples[-1].tokens).float().mean())
        base = {**config, "config": cfg.name, "config_hash": cfg.config_hash, "device": device_name,
                "runner": r.runner, "family": r.family, "label": r.label, "kernels_used": r.kernels,
                "status": r.status, "note": r.note, "warmup_s": r.warmup_s, **bytes_info,
                "copy_gb_s": copy_bytes_s / 1e9, "agree_with": reference.runner if reference else "",
                "token_agreement": agree,
                **{f"dynamo_{k}": v for k, v in r.compile.items()}}
        for i, s in enumerate(r.samples or [None]):
            step_s = s.decode_s / s.steps if s else float("nan")
            rows.append({**base, "repeat": i if s else -1,
                         "decode_s": s.decode_s if s else float("nan"),
                         "prefill_s": s.prefill_s if s else float("nan"),
                         "steps": s.steps if s else 0,
                         "ms_per_step": step_s * 1e3,
                         "tok_s": cfg.batch / step_s,
                         "gb_s": bytes_info["bytes_per_step"] / step_s / 1e9,
                         "floor_pct": 100 * bytes_info["bytes_per_step"] / step_s / copy_bytes_s})
    return pd.DataFrame(rows)


def summarize(df) -> "pandas.DataFrame":
    """Medians per (config, runner), with the p20-p80 band of ms/step and ratios of gdtool to peers."""
    import pandas as pd

    keys = ["config", "batch", "runner"]
    first = ["family", "label", "status", "note", "warmup_s", "token_agreement", "bytes_per_step",
             "dynamo_graphs", "dynamo_recompiles"]
    rows = []
    for (config, batch, runner), g in df.groupby(keys, sort=False):
        ms = g["ms_per_step"].dropna().tolist()
        row = {"config": config, "batch": batch, "runner": runner,
               **{c: g[c].iloc[0] if c in g else float("nan") for c in first}}
        med = _median(ms)
        row.update(ms_per_step=med, ms_p20=_percentile(ms, 20), ms_p80=_percentile(ms, 80),
                   tok_s=batch * 1e3 / med if ms else float("nan"),
                   gb_s=row["bytes_per_step"] / med / 1e6 if ms else float("nan"))
        row["floor_pct"] = 100 * row["gb_s"] / g["copy_gb_s"].iloc[0]
        rows.append(row)
    summary = pd.DataFrame(rows)
    peers = [p for p in PEERS if p in set(df.loc[df.family == "peer", "runner"])]
    for peer in peers:
        summary[f"x_{peer}"] = float("nan")
    for config, g in summary.groupby("config", sort=False):
        for _, peer in g[(g.family == "peer") & g.tok_s.notna()].iterrows():
            mask = (summary.config == config) & (summary.family == "gdtool")
            summary.loc[mask, f"x_{peer.runner}"] = summary.loc[mask, "tok_s"] / peer.tok_s
    for column in ("dynamo_graphs", "dynamo_recompiles"):
        summary[column] = summary[column].astype("Int64")
    return summary


def format_table(summary, header: str) -> str:
    import pandas as pd

    def num(value, fmt):
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    ratio_cols = [c for c in summary.columns if c.startswith("x_")]
    cols = [("runner", 30, "s"), ("tok/s", 9, ".1f"), ("ms/step", 8, ".3f"), ("p20-p80", 15, ""),
            ("GB/s", 7, ".1f"), ("%floor", 6, ".1f"), ("warm-up s", 9, ".1f"), ("graphs", 6, "d"),
            ("recomp", 6, "d"), ("agree", 5, ".2f")]
    cols += [(c.replace("x_", "x "), max(9, len(c)), ".2f") for c in ratio_cols]
    lines = [header]
    for batch, g in summary.groupby("batch", sort=False):
        lines.append("  ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(cols)))
        for _, r in g.iterrows():
            band = f"{num(r.ms_p20, '.3f')}-{num(r.ms_p80, '.3f')}" if r.tok_s == r.tok_s else "-"
            values = [r.label, r.tok_s, r.ms_per_step, band, r.gb_s, r.floor_pct, r.warmup_s,
                      r.dynamo_graphs, r.dynamo_recompiles, r.token_agreement] + [r[c] for c in ratio_cols]
            cells = []
            for i, ((name, width, fmt), v) in enumerate(zip(cols, values)):
                if i == 0:
                    cells.append(f"{v:<{width}}")
                elif fmt == "d":
                    cells.append(f"{'-' if pd.isna(v) else int(v):>{width}}")
                elif fmt:
                    cells.append(f"{num(v, fmt):>{width}}")
                else:
                    cells.append(f"{v:>{width}}")
            line = "  ".join(cells)
            if r.status != "ok" or r.note:
                line += "  " + "; ".join(filter(None, [r.status if r.status != "ok" else "", r.note]))
            lines.append(line)
    return "\n".join(lines)


environment = renamed(record.environment, "gdtool.frontends.bench.environment")


def save(df, summary, cfg: BenchConfig, env: dict, out_dir: Path) -> list[str]:
    """<out>/<config name>.csv (the tidy rows) and .json (name, hash, config, environment, summary)."""
    out_dir = Path(out_dir)
    csv_path, json_path = out_dir / f"{cfg.name}.csv", out_dir / f"{cfg.name}.json"
    record.save_csv(df, csv_path, first=("config", "config_hash", "runner", "repeat"))
    record.write_sidecar(json_path, env, name=cfg.name, config_hash=cfg.config_hash, config=dataclasses.asdict(cfg),
                         summary=json.loads(summary.to_json(orient="records")))
    return [str(csv_path), str(json_path)]


def saved(cfg: BenchConfig, out_dir: Path):
    """(rows, summary) of `cfg` from an earlier run into `out_dir`, or None: resuming skips a config
    whose files hold the same config hash and no runner that failed."""
    import pandas as pd
    out_dir = Path(out_dir)
    meta = record.read_sidecar(out_dir / f"{cfg.name}.json")
    csv_path = out_dir / f"{cfg.name}.csv"
    if meta.get("config_hash") != cfg.config_hash or not csv_path.exists():
        return None
    summary = pd.DataFrame(meta.get("summary", []))
    if summary.empty or summary["status"].astype(str).str.startswith("error").any():
        return None
    for column in ("dynamo_graphs", "dynamo_recompiles"):
        if column in summary:
            summary[column] = summary[column].astype("Int64")
    return pd.read_csv(csv_path), summary


# ----------------------------------------------------------------------------- command line

def _mode_item(value: str) -> str:
    from ..core.modes import KERNELS, MODES
    if value in ("none", "all"):
        return value
    mode, plus, kernels = value.partition("+")
    if mode not in MODES:
        raise ValueError(f"unknown mode {value!r}; choose from {', '.join(MODES)}, each optionally as mode+kernels "
                         f"(step-graph+compiled), or all, or none")
    if plus and kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r} in {value!r}; choose from {', '.join(KERNELS)}")
    return value


def _peer_item(value: str) -> str:
    if value != "none" and value not in PEERS:
        raise ValueError(f"unknown peer {value!r}; choose from {', '.join(PEERS)}, or none")
    return value


def _none_or_list(values) -> tuple[str, ...]:
    return () if list(values) == ["none"] else tuple(v for v in values if v != "none")


WORKLOADS = ("decode", "rollout")
# options of the rollout workload, refused under --workload decode
ROLLOUT_ONLY = ("--slots", "--prompts", "--lengths", "--cb-cuda-graphs")


def parser() -> options.Parser:
    p = options.Parser("python -m gdtool bench", __doc__.split("\n\n")[0] + "\n\n" + _EXAMPLES)
    p.add_argument("--workload", choices=WORKLOADS, default="decode",
                   help="decode: gdtool's modes against generate() and a gpt-fast-style step (the options below); "
                        "rollout: gdtool.rollout against HF continuous batching, with options of its own "
                        "(python -m gdtool bench --workload rollout --help)")
    p.add_model()
    p.add_batch([1])
    p.add_prompt_len(128)
    p.add_max_new_tokens(256, minimum=2, help="tokens per row (the first comes from the prefill: 2 or more)")
    p.add_int("--repeats", default=3, minimum=1, help="timed runs per runner after one warm-up run")
    p.list_option("--mode", "--modes", item=_mode_item, default=["all"],
                  help="gdtool modes, all, or none; an entry mode+kernels (step-graph+compiled) runs with those "
                       "kernels only")
    p.list_option("--peers", item=_peer_item, default=list(PEERS), help=f"peers: {', '.join(PEERS)}, or none")
    p.add_kernels()
    p.add_argument("--fuse-projections", action="store_true",
                   help="fuse each layer's q/k/v and gate/up weights first (gdtool.kernels.fuse): the compiled "
                        "step then runs one matmul per group; HF's kernels and the peers are unchanged")
    p.add_device()
    p.add_seed()
    p.add_out("results/bench", "folder for <config>.csv and <config>.json, made if missing")
    p.add_common()
    return p


def _announce(model, name, configs, todo, out, device) -> str:
    """The line said before a model's first config runs: its configs to run and an estimate, from the decodes
    `run_config` runs (per runner a warm-up, then `repeats`; EOS off, so every step) at the rates of a short decode
    timed here, `generate()` timed as eager and a compiled peer as step-graph."""
    works = []
    for cfg in todo:
        for planned in _plan(model, None, cfg, device):
            if planned.make_once is None:  # n/a here
                continue
            runner = planned.result
            mode = runner.runner.split("+")[0] if runner.family == "gdtool" else \
                "eager" if runner.runner == "generate" else "step-graph"
            works += [estimate.Work(mode, cfg.batch, 1, planned.warmup_tokens - 1),
                      estimate.Work(mode, cfg.batch, cfg.repeats, cfg.steps)]
    left_out = "model loads, captures" + (" and torch.compile" if device.type == "cuda" else "") + " not counted"
    if not works:
        return estimate.announce("bench", len(todo), len(configs), out, model=name)
    try:
        clock = estimate.probe(model, [w.mode for w in works], [cfg.batch for cfg in todo], todo[0].prompt_len,
                               todo[0].max_new_tokens)
    except Exception as err:  # no estimate is no reason to stop: the runners report their own errors
        reason = traceback.format_exception_only(type(err), err)[-1].strip()[:200]
        return (estimate.announce("bench", len(todo), len(configs), out, model=name)
                + f"; no estimate (the timed probe decode failed: {reason})")
    return estimate.announce("bench", len(todo), len(configs), out, clock, works, left_out, model=name)


def _workload(argv: list[str]) -> str:
    """The --workload argv asks for ("decode" when absent or not one of WORKLOADS: the full parser then says why)."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--workload")
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:   # --workload without a value: the full parser says so
        return "decode"
    return known.workload if known.workload in WORKLOADS else "decode"


_EXAMPLES = "\n".join(line for line in __doc__.splitlines() if line.startswith("    python -m gdtool bench"))


def parse_args(argv):
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _workload(argv) == "rollout":
        from . import rollout_bench
        return rollout_bench.main(argv)
    p = parser()
    misplaced = options.given(argv, ROLLOUT_ONLY)
    if misplaced:
        p.error(f"{misplaced[0]} is an option of --workload rollout; add --workload rollout (the decode workload "
                "takes --batch and --max-new-tokens)")
    args = p.parse_args(argv)
    modes = tuple(options.expand_modes(_none_or_list(args.mode)))
    peers = _none_or_list(args.peers)
    if not modes and not peers:
        p.error("--mode none with --peers none leaves nothing to measure; name a mode or a peer")
    args.out = p.out_path(args.out)  # before loading anything: a path it cannot write fails now, not at the end
    return options.run(p, lambda a: _main(a, modes, peers), args)


def _main(args, modes, peers) -> int:
    import pandas as pd
    import transformers

    transformers.logging.set_verbosity_error()  # generate()'s per-call advice would drown the table
    out = options.Output(args.json)
    kernels = tuple(dict.fromkeys(args.kernels))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = args.model or options.default_models(device.type == "cuda")
    n_runners = len(runners(modes, kernels)) + len(peers)
    bar = options.progress(len(names) * len(args.batch), "bench", not args.no_progress)

    def log(message):
        bar.write(message, file=sys.stderr)

    files, summaries, failed = [], [], False
    env, copy_bytes_s = None, None
    try:
        for model_name in names:
            configs = [BenchConfig(model=model_name, batch=batch, prompt_len=args.prompt_len,
                                   max_new_tokens=args.max_new_tokens, repeats=args.repeats, modes=modes,
                                   peers=peers, kernels=kernels, seed=args.seed,
                                   fused_projections=args.fuse_projections) for batch in args.batch]
            previous = {cfg.name: None if args.redo else saved(cfg, Path(args.out)) for cfg in configs}
            todo = [cfg for cfg in configs if previous[cfg.name] is None]
            several = len(names) > 1
            if not todo:
                out.say(estimate.announce("bench", 0, len(configs), args.out, model=model_name if several else None),
                        above=bar)
            model = None
            for cfg in configs:
                if previous[cfg.name] is not None:
                    df, summary = previous[cfg.name]
                    log(f"[bench] {cfg.name}: already in {args.out} (same config hash), skipped; --redo measures "
                        "it again")
                    bar.update(1)
                    files += [str(Path(args.out) / f"{cfg.name}.csv"), str(Path(args.out) / f"{cfg.name}.json")]
                    out.say(format_table(summary, f"\n{cfg.name} (from {args.out})"))
                    if device.type != "cuda" and modes:
                        out.say(options.UNCAPTURED)
                    summaries.append(summary)
                    continue
                if model is None:
                    t0 = time.perf_counter()
                    model = load_model(model_name, seed=args.seed, device=device)
                    log(f"[bench] loaded {model_name} in {time.perf_counter() - t0:.1f} s")
                    if args.fuse_projections:
                        from ..kernels.fuse import fuse_projections
                        fused = fuse_projections(model)
                        if not fused:
                            raise ValueError(f"--fuse-projections found no q/k/v or gate/up nn.Linear groups in "
                                             f"{model_name}; drop the flag for this model")
                        log(f"[bench] fused {fused} projection groups (q/k/v, gate/up)")
                    out.say(_announce(model, model_name if several else None, configs, todo, args.out, device),
                            above=bar)
                if env is None:
                    copy_bytes_s = copy_bandwidth(device)
                    env = record.environment(device)
                    env["copy_gb_s"] = copy_bytes_s / 1e9
                    log(f"[bench] {env['device_name']}: copy bandwidth {copy_bytes_s / 1e9:.0f} GB/s (read + write)")
                count = iter(range(1, n_runners + 1))  # the bar counts configs; its label, the runners of this one
                results = run_config(model, cfg, log=log, on_runner=lambda result: bar.set_postfix_str(
                    f"{cfg.name}: {next(count)} of {n_runners} runners"))
                bar.update(1)
                failed |= any(r.status.startswith("error") for r in results)
                bytes_info = step_bytes(model, cfg.batch, cfg.prompt_len, cfg.max_new_tokens)
                df = tidy_rows(cfg, results, bytes_info, copy_bytes_s, env["device_name"])
                summary = summarize(df)
                files += save(df, summary, cfg, env, Path(args.out))
                floor_ms = bytes_info["bytes_per_step"] / copy_bytes_s * 1e3
                header = (f"\n{cfg.name}: {env['device_name']}, {env['torch']}, copy {copy_bytes_s / 1e9:.0f} GB/s, "
                          f"{bytes_info['bytes_per_step'] / 1e9:.3f} GB/step -> floor {floor_ms:.3f} ms/step "
                          f"({cfg.batch * 1e3 / floor_ms:.0f} tok/s); greedy, EOS off, median of {cfg.repeats}; "
                          f"agree = share of tokens equal to {df.agree_with.iloc[0] or '-'}'s")
                out.say(format_table(summary, header))
                if device.type != "cuda" and modes:
                    out.say(options.UNCAPTURED)
                summaries.append(summary)
            del model
            gc.collect()
    finally:
        bar.close()
    everything = pd.concat(summaries, ignore_index=True)
    keep = [c for c in ["config", "batch", "runner", "status", "tok_s", "ms_per_step", "gb_s", "floor_pct", "warmup_s",
                        "dynamo_graphs", "dynamo_recompiles"] if c in everything.columns]
    keep += [c for c in everything.columns if c.startswith("x_")]
    env = env or record.environment(device)
    out.say(f"results in {args.out}")
    out.document({
        "bench": names, "device": env["device_name"], "captured": device.type == "cuda",
        "copy_gb_s": round(copy_bytes_s / 1e9, 1) if copy_bytes_s else None,
        "torch": env["torch"], "transformers": env["transformers"], "files": files,
        "results": json.loads(everything[keep].to_json(orient="records", double_precision=6)),
        "environment": env,
    })
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
