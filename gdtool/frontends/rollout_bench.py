"""The rollout workload of `python -m gdtool bench`: many prompts with ragged response lengths, a fixed number of
slots, and useful tokens per second of the whole call.

A reinforcement-learning rollout decodes far more prompts than fit in one batch, and its responses end at very
different lengths. This workload measures, on one model in one process, how fast each way of running it turns out
the tokens someone keeps:

    static    gdtool.rollout(refill="off", mode="device-loop"): static batches of `slots` prompts, each running
              until its longest row ends (the device loop, EOS checked on the device), each left-padded to the
              workload's widest prompt (`buckets`: one graph for all batches)
    host      gdtool.rollout(refill="host", mode="step-graph"): a finished slot is refilled from the host between
              captured steps
    device    gdtool.rollout(refill="device", mode="device-loop"): the refills run inside the device loop
    eos-off   one static batch of `slots` prompts through the same device loop (a `Decoder`, kept warm) with EOS
              off: every row runs all max_new_tokens. Its decode time per step (graph replayed, no warm-up or
              capture in it) prices one step of `slots` rows
    hf-cb     transformers' continuous batching (`model.continuous_batching_context_manager`), one `add_request`
              per prompt with its drawn length as max_new_tokens, greedy

`--refill-rows`, `--refill-after` and `--refill-widths` (one config per value): the refill runners' `refill_rows`
(the most prompts one refill prefills together), `refill_after` (refill once this many slots are free) and
`refill_widths` (the most width buckets a refill prefills at); gdtool.rollout's defaults unless given.

`--kernels` (one config per value): every gdtool runner runs those kernels. With "fast" the static runners run
gdtool's own decode forward where it applies, and the refill runners the compiled step over the per-row cache write
with gdtool's split-KV attention (`kernels/rows.py`): gdtool's own forward writes one cache column shared by
every row.

Prompts are `--prompts` rows of `--prompt-len` random tokens (seeded); with `--prompt-len LO,HI` their lengths
are drawn uniformly from [LO, HI] (ragged prompts: what width buckets are for; the eos-off runner's batch is HI
tokens wide). Each prompt's response length is drawn
from `--lengths` (gdtool.measure.workloads; max_new_tokens is the distribution's cap); gdtool's runners force EOS
at that length (`target_lengths`), so random weights give realistic lengths. A sequence that emits EOS by itself
before that ends early: the table counts such sequences (`early`). hf-cb cannot force a token, so its EOS is
switched off in its generation config (eos_token_id=-1: no id ends a request) and each request's max_new_tokens
is its drawn length: it makes the same number of tokens. Every runner is greedy.

Per runner: useful tokens / wall seconds of the whole call (gdtool: the `rollout` call, warm-up and graph
capture included, as every call pays them; hf-cb: from the manager's creation and warm-up to the last result in
hand, its stop and teardown left out), after one untimed warm-up call over the first 2 x slots prompts,
median of `--repeats` timed calls, the device synchronized at the end. For gdtool's rollouts also: the share
of row-steps that made a kept token and `pred`, the share the lengths alone give (gdtool.measure.rollouts; the
two differ only where a sequence ended early), decode steps, host syncs, prefill seconds, and the **ideal**: the
measured prefill seconds plus decode steps x the eos-off seconds per step, what the call would take if each step
cost what a full static step costs and nothing else (no setup, capture, refill bookkeeping or read-back);
`of_ideal` = ideal / wall. Ratios: device/static, device/host, device/hf-cb, host/static, of useful tokens per
second.

hf-cb runs with HF's documented defaults, except `max_requests_per_batch = slots` (the same rows per step as the
others): on CUDA, max_batch_tokens and num_blocks from free GPU memory; on a CPU, where the default would take
60% of the host's free memory, num_blocks sized from the workload (twice what `slots` sequences of the longest
length hold) and max_batch_tokens HF's documented 8192. CUDA graphs and async batching as HF decides for the
attention implementation (`--cb-cuda-graphs` forces them), no compile. The manager switches the model to an
attention implementation that pages while it runs (transformers 5.17: "paged|sdpa"; 5.25: "sdpa" pages by
itself and "paged|" is deprecated except for "paged|eager"; in bf16/fp16, 5.25 first tries flash attention); the
row's note says which ran and the settings it resolved. Where continuous batching cannot run here, hf-cb is
reported n/a with the reason.

    python -m gdtool bench --workload rollout --model tiny-llama --prompts 12 --prompt-len 8 --slots 2,4 --lengths uniform:1:16
    python -m gdtool bench --workload rollout --model llama-1b --slots 64 --prompts 1024 --prompt-len 128 --lengths geom:128:512

Results go to `<out>/<config name>.csv` (one row per runner x timed call, every config field a column) and
`<config name>.json` (environment, config, summary, ratios), one config per slot count and length distribution.
The last stdout line with --json is one JSON document.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import options
from ..core.models import eos_ids, load_model, random_prompts
from ..loops.decoder import Decoder
from ..core.rollout_step import default_refill_after, refill_plan
from ..loops.rollout import REFILL_ROWS, REFILL_WIDTHS, rollout
from ..measure import record, rollouts, workloads

RUNNERS = ("static", "host", "device", "eos-off", "hf-cb")
LABELS = {
    "static": "static (gdtool refill=off, device-loop)",
    "host": "host (gdtool refill=host, step-graph)",
    "device": "device (gdtool refill=device, device-loop)",
    "eos-off": "eos-off (static, one batch, no EOS)",
    "hf-cb": "hf-cb (HF continuous batching)",
}
ROLLOUTS = {"static": ("off", "device-loop"), "host": ("host", "step-graph"), "device": ("device", "device-loop")}
RATIOS = (("device", "static"), ("device", "host"), ("device", "hf-cb"), ("host", "static"))
CB_CUDA_GRAPHS = ("auto", "on", "off")
WARMUP_BATCHES = 2           # the warm-up call decodes this many slots' worth of the prompts
CB_MAX_BATCH_TOKENS = 8192   # transformers' default max_batch_tokens (continuous batching docs)
# options of the decode workload, refused here with the one to use instead
DECODE_ONLY = {"--batch": "--slots (rows decoded at once) and --prompts", "--batches": "--slots and --prompts",
               "--max-new-tokens": "--lengths (max_new_tokens is the distribution's cap)",
               "--mode": "nothing: the runners' modes are fixed", "--modes": "nothing: the runners' modes are fixed",
               "--peers": "nothing: hf-cb is the peer",
               "--fuse-projections": "nothing: rollouts run each kernels option as it comes"}


@dataclass(frozen=True)
class RolloutConfig(record.Config):
    """One rollout benchmark point; every runner is measured on it in the same process."""

    model: str
    slots: int
    prompts: int = 1024
    prompt_len: int = 128
    lengths: str = "geom:128:512"
    repeats: int = 3
    seed: int = 0
    cb_cuda_graphs: str = "auto"
    runners: tuple = RUNNERS     # the runners measured, in RUNNERS' order
    kernels: str = "hf"          # every gdtool runner runs these
    refill_rows: int = REFILL_ROWS   # the refill runners' refill_rows and refill_after (gdtool.rollout)
    refill_after: int | None = None   # None: gdtool.rollout's default for the slots (default_refill_after)
    refill_widths: int = REFILL_WIDTHS   # the refill runners' refill_widths
    prompt_min: int | None = None     # prompts drawn from [prompt_min, prompt_len] tokens; None: all prompt_len

    def name_parts(self) -> list:
        parts = [Path(self.model).name or self.model, "rollout", f"s{self.slots}", f"n{self.prompts}",
                 f"p{self.prompt_len}" if self.prompt_min is None else f"p{self.prompt_min}-{self.prompt_len}",
                 workloads.parse(self.lengths).name]
        if self.seed:
            parts.append(f"seed{self.seed}")
        if self.cb_cuda_graphs != "auto":
            parts.append(f"cbgraphs-{self.cb_cuda_graphs}")
        if tuple(self.runners) != RUNNERS:
            parts.append("-".join(self.runners))
        if self.kernels != "hf":
            parts.append(self.kernels)
        if self.refill_rows != REFILL_ROWS:
            parts.append(f"rows{self.refill_rows}")
        if self.refill_after is not None:
            parts.append(f"after{self.refill_after}")
        if self.refill_widths != REFILL_WIDTHS:
            parts.append(f"widths{self.refill_widths}")
        return parts

    @property
    def max_new_tokens(self) -> int:
        return workloads.parse(self.lengths).max_length


@dataclass
class Workload:
    """What every runner of one config decodes: the prompts, their drawn lengths, and the eos-off batch."""

    prompts: list                 # [prompts] lists of token ids (prompt_len, or prompt_min..prompt_len)
    targets: list                 # drawn response length of each prompt (EOS included)
    slots: int
    max_new_tokens: int
    eos: list                     # EOS ids gdtool forces (the model's own)
    pad: int
    full_batch: torch.Tensor      # [slots, prompt_len] prompts of the eos-off runner, on the model's device

    @property
    def drawn_tokens(self) -> int:
        return sum(self.targets)


@dataclass
class RunnerResult:
    runner: str
    label: str
    status: str = "ok"                 # ok | n/a | error: ...
    note: str = ""
    warmup_s: float = float("nan")     # the untimed warm-up call
    samples: list = field(default_factory=list)   # one dict of figures per timed call


# ----------------------------------------------------------------------------- the workload

def make_workload(model, cfg: RolloutConfig) -> Workload:
    dist = workloads.parse(cfg.lengths)
    drawn = random_prompts(model, batch=cfg.prompts, seed=cfg.seed,
                           lengths=cfg.prompt_len if cfg.prompt_min is None else (cfg.prompt_min, cfg.prompt_len))
    prompts = [row[mask.bool()].tolist() for row, mask in zip(drawn.input_ids.cpu(), drawn.attention_mask.cpu())]
    full = random_prompts(model, batch=cfg.slots, lengths=cfg.prompt_len, seed=cfg.seed).input_ids
    eos = eos_ids(model)
    return Workload(prompts, dist.draw(batch=cfg.prompts, seed=cfg.seed).tolist(), cfg.slots,
                    dist.max_length, eos, eos[0], full)


def warmup_part(work: Workload, refill_rows: int = REFILL_ROWS, refill_widths: int = REFILL_WIDTHS) -> Workload:
    """The warm-up call's workload: the first WARMUP_BATCHES x slots prompts (refills run, the graphs and kernels
    the timed calls use are built once); a gdtool rollout captures its graphs in every call, so a warm-up over
    the whole workload would only double the run. Where those prompts ask for other shapes than the whole queue,
    the whole workload: a part would leave the timed call to compile its programs (a ragged llama-1b run on an
    H100 spent 111 s of its 116 s there). The shapes: the refill runners' plan (W, width buckets, refill
    shapes), and the static runner's batch sizes (each batch left-padded to the whole workload's widest prompt)."""
    k = min(len(work.prompts), WARMUP_BATCHES * work.slots)
    part = dataclasses.replace(work, prompts=work.prompts[:k], targets=work.targets[:k])

    def shapes(w: Workload) -> tuple:
        lengths = [len(p) for p in w.prompts]
        batches = {len(lengths[i:i + w.slots]) for i in range(0, len(lengths), w.slots)}
        return refill_plan(lengths, w.slots, refill_rows, refill_widths), batches
    return part if shapes(part) == shapes(work) else work


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- runners
# Each factory returns once() -> dict of figures (wall_s and useful_tokens at least).

def label(runner: str, kernels: str) -> str:
    """The runner's label, with the kernels it runs where they are not HF's."""
    if runner == "hf-cb" or kernels == "hf":
        return LABELS[runner]
    return f"{LABELS[runner][:-1]}, {kernels})"


def rollout_runner(model, work: Workload, refill: str, mode: str, kernels: str = "hf", refill_rows: int = REFILL_ROWS,
                   refill_after: int | None = None, refill_widths: int = REFILL_WIDTHS):
    """One gdtool.rollout call over the whole workload. Static batches are left-padded to the workload's widest prompt
    (`buckets`): one graph for every batch, as the refill runners prefill at the queue's width, not a capture per
    batch width (16 of them, more time than the decode steps, with ragged prompts on an H100)."""
    device = next(model.parameters()).device
    shape = dict(buckets=(max(map(len, work.prompts)),)) if refill == "off" else \
        dict(refill_rows=refill_rows, refill_after=refill_after, refill_widths=refill_widths)

    def once(part: Workload | None = None) -> dict:
        w = part or work
        t0 = time.perf_counter()
        out = rollout(model, w.prompts, slots=work.slots, max_new_tokens=work.max_new_tokens, refill=refill,
                      mode=mode, kernels=kernels, target_lengths=w.targets, eos_token_id=work.eos, pad_token_id=work.pad,
                      do_sample=False, return_logprobs=True, **shape)
        _sync(device)
        wall = time.perf_counter() - t0
        early = sum(seq.length < target for seq, target in zip(out.sequences, w.targets))
        return dict(wall_s=wall, useful_tokens=out.useful_tokens, early=early,
                    row_step_share=out.row_step_share, decode_steps=out.decode_steps, host_syncs=out.host_syncs,
                    prefill_s=out.prefill_s, decode_s=out.decode_s, setup_s=out.setup_s,
                    launches=out.launches, prefills=out.prefills,
                    refill_sizes=json.dumps(out.refill_sizes) if out.refill_sizes else "",
                    refill_widths=json.dumps(out.refill_widths) if out.refill_widths else "",
                    setup_parts=json.dumps(out.setup_parts) if out.setup_parts else "")

    return once


class EosOffRunner:
    """One static batch of `slots` prompts through the device loop with EOS off. A Decoder keeps its engine, so the
    timed calls replay the graph the warm-up captured and decode_s holds the steps alone."""

    def __init__(self, model, work: Workload, kernels: str = "hf"):
        self.work = work
        self.device = work.full_batch.device
        self.decoder = Decoder(model, "device-loop", max_graphs=1, kernels=kernels, eos_token_id=None, pad_token_id=work.pad,
                               do_sample=False, max_new_tokens=work.max_new_tokens, return_logprobs=True)

    def __call__(self, part: Workload | None = None) -> dict:
        ids = self.work.full_batch   # its one batch, warm-up included
        t0 = time.perf_counter()
        out = self.decoder.generate(ids, torch.ones_like(ids))
        _sync(self.device)
        wall = time.perf_counter() - t0
        expected = self.work.slots * self.work.max_new_tokens
        if out.new_tokens != expected:
            raise AssertionError(f"eos-off made {out.new_tokens} tokens, expected {expected}: every row must run "
                                 "all max_new_tokens")
        decode_s = out.timings["decode_s"]
        return dict(wall_s=wall, useful_tokens=out.new_tokens, early=0, decode_steps=out.steps,
                    host_syncs=out.host_syncs, prefill_s=out.timings["prefill_s"], decode_s=decode_s,
                    step_s=decode_s / out.steps if out.steps else float("nan"))

    def close(self) -> None:
        self.decoder.close()


def cb_available(model) -> str:
    """'' where transformers' continuous batching can be tried on `model`, else why not."""
    import transformers
    if not hasattr(model, "continuous_batching_context_manager"):
        return (f"transformers {transformers.__version__} gives {type(model).__name__} no continuous batching "
                "(model.continuous_batching_context_manager)")
    from transformers import generation
    if not hasattr(generation, "ContinuousBatchingConfig"):
        return f"transformers {transformers.__version__} has no ContinuousBatchingConfig"
    return ""


def cb_config(device: torch.device, slots: int, longest: int, cuda_graphs: str):
    """HF's ContinuousBatchingConfig for this workload: its defaults, `slots` requests per batch (see the module
    docstring), a workload-sized cache off CUDA, CUDA graphs forced only where asked."""
    from transformers.generation import ContinuousBatchingConfig
    fields = {"max_requests_per_batch": slots}
    if device.type != "cuda":
        defaults = ContinuousBatchingConfig()
        page = getattr(defaults, "page_size", None) or getattr(defaults, "block_size", None) or 256  # 5.25 / 5.17
        fields["num_blocks"] = 2 * slots * (math.ceil(longest / page) + 1) + 2
        # HF's documented default; given num_blocks alone, 5.17 would solve it from the host's free memory instead
        fields["max_batch_tokens"] = CB_MAX_BATCH_TOKENS
    if cuda_graphs != "auto":
        fields["use_cuda_graph"] = cuda_graphs == "on"
    return ContinuousBatchingConfig(**fields)


def cb_settings(resolved, attn: str) -> str:
    """The settings a manager ran with, in one line (the fields its version has)."""
    import transformers
    names = ("num_blocks", "max_batch_tokens", "max_requests_per_batch", "page_size", "block_size",
             "use_cuda_graph", "use_async_batching", "default_compile_level", "max_blocks_per_request")
    shown = [f"{n}={getattr(resolved, n)}" for n in names if getattr(resolved, n, None) is not None]
    return f"transformers {transformers.__version__}, attn {attn}, " + ", ".join(shown)


class ContinuousBatchingRunner:
    """transformers' continuous batching over the workload: a manager made, warmed up and started per call (as
    generate_batch does), one add_request per prompt with its drawn length, results gathered until the last."""

    def __init__(self, model, work: Workload, cuda_graphs: str):
        from transformers import GenerationConfig
        self.model, self.work = model, work
        self.device = next(model.parameters()).device
        # eos_token_id=-1: an empty EOS set, so max_new_tokens alone ends each request
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=work.pad,
                                                  max_new_tokens=work.max_new_tokens)
        longest = max(len(p) for p in work.prompts) + work.max_new_tokens
        self.config = cb_config(self.device, work.slots, longest, cuda_graphs)
        self.settings = ""

    def _hints(self, work: Workload):
        from transformers.generation.continuous_batching.utils import WorkloadHints
        return WorkloadHints(max_prompt_length=max(len(p) for p in work.prompts),
                             max_generated_length=work.max_new_tokens, num_requests=len(work.prompts))

    def __call__(self, part: Workload | None = None) -> dict:
        work = part or self.work
        attn_before = self.model.config._attn_implementation
        quiet = _CbLogLevel(logging.ERROR)
        try:
            with quiet:
                t0 = time.perf_counter()
                with self.model.continuous_batching_context_manager(
                        generation_config=self.generation_config, continuous_batching_config=self.config,
                        warmup=True, workload_hints=self._hints(work)) as manager:
                    setup = time.perf_counter() - t0
                    attn = self.model.config._attn_implementation
                    ids = [self._add(manager, i, prompt, n)
                           for i, (prompt, n) in enumerate(zip(work.prompts, work.targets))]
                    results = self._collect(manager, ids)
                    _sync(self.device)
                    wall = time.perf_counter() - t0
                    self.settings = cb_settings(manager.continuous_batching_config, attn)
        finally:
            if self.model.config._attn_implementation != attn_before:  # stop() restores it; make sure
                self.model.set_attn_implementation(attn_before)
        made = [len(results[i].generated_tokens) for i in ids]
        return dict(wall_s=wall, useful_tokens=sum(made), early=sum(n < t for n, t in zip(made, work.targets)),
                    setup_s=setup)

    @staticmethod
    def _add(manager, index: int, prompt: list, new_tokens: int) -> str:
        request_id = manager.add_request(list(prompt), request_id=f"prompt-{index}", max_new_tokens=int(new_tokens))
        if request_id is None:
            raise RuntimeError("HF continuous batching refused a request (the manager does not accept new ones)")
        return request_id

    @staticmethod
    def _collect(manager, ids: list) -> dict:
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    status = getattr(manager, "background_thread_status", None)
                    error = getattr(status, "fatal_error", None)
                    raise RuntimeError(f"HF continuous batching stopped after {len(done)} of {len(ids)} requests"
                                       + (f": {error}" if error else ""))
                continue
            if not result.is_finished():
                continue
            if result.error:
                raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
            done[result.request_id] = result
        return done


class _CbLogLevel:
    """Continuous batching's own logger at `level` for a while (its per-request warnings would drown the table)."""

    def __init__(self, level: int):
        self.logger, self.level, self.before = logging.getLogger("ContinuousBatchingLogger"), level, None

    def __enter__(self):
        self.before = self.logger.level
        self.logger.setLevel(self.level)

    def __exit__(self, *exc):
        self.logger.setLevel(self.before)


# ----------------------------------------------------------------------------- measuring

def _error(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def _make(model, runner: str, work: Workload, cfg: RolloutConfig):
    if runner in ROLLOUTS:
        refill, mode = ROLLOUTS[runner]
        return rollout_runner(model, work, refill, mode, cfg.kernels, cfg.refill_rows, cfg.refill_after,
                              cfg.refill_widths)
    if runner == "eos-off":
        return EosOffRunner(model, work, cfg.kernels)
    return ContinuousBatchingRunner(model, work, cfg.cb_cuda_graphs)


def measure(model, runner: str, work: Workload, cfg: RolloutConfig) -> RunnerResult:
    """One warm-up call, then cfg.repeats timed calls. hf-cb that cannot be made or warmed up here is n/a (the
    reason in the note); a gdtool runner that fails, or hf-cb failing in a timed call, is an error."""
    result = RunnerResult(runner, label(runner, cfg.kernels))
    if runner == "hf-cb" and (reason := cb_available(model)):
        result.status, result.note = "n/a", reason
        return result
    attrs_before = set(vars(model))
    once, timed = None, False
    try:
        once = _make(model, runner, work, cfg)
        t0 = time.perf_counter()
        once(warmup_part(work, cfg.refill_rows, cfg.refill_widths))
        result.warmup_s = time.perf_counter() - t0
        timed = True
        for _ in range(cfg.repeats):
            result.samples.append(once())
    except Exception as error:  # keep measuring the others; the row says what broke
        if runner == "hf-cb" and not timed:
            result.status, result.note = "n/a", f"continuous batching does not run here: {_error(error)}"
        else:
            traceback.print_exc(limit=8, file=sys.stderr)
            result.status = f"error: {_error(error)}"
        result.samples.clear()
    finally:
        getattr(once, "close", lambda: None)()
        _cleanup(model, attrs_before)
    if result.samples and getattr(once, "settings", ""):   # hf-cb: what it ran with
        result.note = once.settings
    early = max((s["early"] for s in result.samples), default=0)
    if early:
        result.note = "; ".join(filter(None, [f"{early} sequence(s) ended before their drawn length (EOS emitted by "
                                              "the weights)", result.note]))
    return result


def _cleanup(model, attrs_before: set) -> None:
    for name in set(vars(model)) - attrs_before:
        delattr(model, name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_config(model, cfg: RolloutConfig, log=print, on_runner=None,
               on_partial=None) -> tuple[Workload, list[RunnerResult]]:
    """Each runner of `cfg` in turn; `on_partial(work, results)` after each but the last (what a run cut there
    keeps)."""
    work = make_workload(model, cfg)
    results = []
    for runner in cfg.runners:
        if runner in ROLLOUTS or runner == "eos-off":   # the warm-up of a compiled runner can take minutes
            part = len(warmup_part(work, cfg.refill_rows, cfg.refill_widths).prompts) if runner in ROLLOUTS else \
                work.slots
            builds = " and ".join(([] if cfg.kernels == "hf" else ["compiles the programs not compiled yet"]) +
                                  (["captures its graphs"] if work.full_batch.device.type == "cuda" else []))
            log(f"[bench] {cfg.name} {label(runner, cfg.kernels)}: a warm-up call over {part} prompts"
                f"{f' (it {builds})' if builds else ''}, then {cfg.repeats} timed")
        result = measure(model, runner, work, cfg)
        results.append(result)
        if on_partial is not None and len(results) < len(cfg.runners):
            on_partial(work, results)
        timing = ""
        if result.samples:
            wall = _median([s["wall_s"] for s in result.samples])
            timing = f", median {wall:.3f} s, {result.samples[0]['useful_tokens'] / wall:.1f} tok/s"
        log(f"[bench] {cfg.name} {result.label}: {result.status}{timing}")
        if on_runner is not None:
            on_runner(result)
    return work, results


# ----------------------------------------------------------------------------- tables and files

def _median(values):
    values = sorted(v for v in values if v is not None and v == v)
    n = len(values)
    return float("nan") if n == 0 else (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2)


COUNTS = ("useful_tokens", "early", "decode_steps", "steps_predicted", "host_syncs", "launches", "prefills")
FIGURES = ("wall_s", "useful_tokens", "early", "row_step_share", "share_predicted", "decode_steps", "steps_predicted",
           "host_syncs", "prefill_s", "decode_s", "setup_s", "step_s", "launches", "prefills")


def tidy_rows(cfg: RolloutConfig, work: Workload, results: list[RunnerResult], device_name: str):
    """One row per runner x timed call (a runner with no call gets one row of NaNs)."""
    import pandas as pd
    base = {**cfg.columns(), "config": cfg.name, "device": device_name, "max_new_tokens": work.max_new_tokens,
            "drawn_tokens": work.drawn_tokens}
    rows = []
    for r in results:
        for i, s in enumerate(r.samples or [None]):
            s = s or {}
            row = {**base, "runner": r.runner, "label": r.label, "status": r.status, "note": r.note,
                   "warmup_s": r.warmup_s, "repeat": i if s else -1,
                   **{k: s.get(k, float("nan")) for k in FIGURES},
                   "refill_sizes": s.get("refill_sizes", ""), "refill_widths": s.get("refill_widths", ""),
                   "setup_parts": s.get("setup_parts", "")}
            if r.runner in ROLLOUTS and s:   # what the lengths alone say the device counts (measure.rollouts)
                plan = rollouts.schedule(work.targets, work.slots, ROLLOUTS[r.runner][0], refill_rows=cfg.refill_rows,
                                         refill_after=cfg.refill_after)
                row["share_predicted"], row["steps_predicted"] = plan.share, plan.steps
            row["tok_s"] = row["useful_tokens"] / row["wall_s"] if s else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def summarize(df):
    """Medians per runner (tok_s: median useful tokens / median wall seconds), and the ideal of gdtool's rollouts
    (measured prefill + decode steps x eos-off's seconds per step)."""
    import pandas as pd
    rows = []
    for runner, g in df.groupby("runner", sort=False):
        row = {"config": g.config.iloc[0], "slots": int(g.slots.iloc[0]), "runner": runner,
               **{c: g[c].iloc[0] for c in ("label", "status", "note", "warmup_s", "drawn_tokens")}}
        for column in FIGURES:
            row[column] = _median(g[column].tolist())
        row["tok_s"] = row["useful_tokens"] / row["wall_s"] if row["wall_s"] > 0 else float("nan")
        row["refill_sizes"] = g.refill_sizes.iloc[-1] if "refill_sizes" in g else ""   # the last call's {rows: refills}
        row["refill_widths"] = g.refill_widths.iloc[-1] if "refill_widths" in g else ""  # ... {columns: refills}
        row["setup_parts"] = g.setup_parts.iloc[-1] if "setup_parts" in g else ""     # ... and its setup_s in parts
        rows.append(row)
    summary = pd.DataFrame(rows)
    for column in COUNTS:   # whole numbers stay whole (NaN where a runner has none)
        values = summary[column]
        if ((values % 1 == 0) | values.isna()).all():
            summary[column] = values.astype("Int64")
    step_s = summary.loc[summary.runner == "eos-off", "step_s"]
    step_s = float(step_s.iloc[0]) if len(step_s) else float("nan")
    rollouts = summary.runner.isin(list(ROLLOUTS))
    summary["ideal_s"] = float("nan")
    steps = summary.loc[rollouts, "decode_steps"].astype(float)
    summary.loc[rollouts, "ideal_s"] = summary.loc[rollouts, "prefill_s"] + steps * step_s
    summary["of_ideal"] = summary["ideal_s"] / summary["wall_s"]
    return summary


def ratios(summary) -> dict:
    """Useful tokens/s of one runner over another's, as printed in the table (NaN where either is missing)."""
    tok = {runner: _float(v) for runner, v in zip(summary.runner, summary.tok_s)}
    out = {}
    for a, b in RATIOS:
        x, y = tok.get(a, float("nan")), tok.get(b, float("nan"))
        out[f"{a}/{b}"] = x / y if y > 0 else float("nan")   # NaN compares False: missing stays NaN
    return out


def _no_nan(values: dict) -> dict:
    """NaN as None (null in JSON)."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in values.items()}


def _float(value) -> float:
    return float("nan") if value is None else float(value)


def format_table(summary) -> str:
    def num(fmt):
        return lambda v: "-" if v is None or v != v else format(v, fmt)

    status = [s if s == "ok" or s.startswith("error") or not n else f"{s}: {n}"
              for s, n in zip(summary.status, summary.note)]
    table = summary.assign(runner=summary.label, useful=summary.useful_tokens, share=summary.row_step_share,
                           pred=summary.share_predicted, steps=summary.decode_steps, syncs=summary.host_syncs,
                           status=status)
    columns = ["runner", "tok_s", "wall_s", "useful", "early", "share", "pred", "steps", "syncs", "prefill_s",
               "setup_s", "ideal_s", "of_ideal", "status"]
    formats = {"tok_s": num(".1f"), "wall_s": num(".3f"), "useful": num(".0f"), "early": num(".0f"),
               "share": num(".3f"), "pred": num(".3f"), "steps": num(".0f"), "syncs": num(".0f"), "prefill_s": num(".3f"),
               "setup_s": num(".3f"), "ideal_s": num(".3f"), "of_ideal": num(".2f")}
    table = table[columns].astype({c: float for c in formats})   # missing figures as NaN, printed as -
    text = table.to_string(index=False, formatters=formats, justify="right", na_rep="-")
    notes = [f"  {label}: {note}" for label, note, state in zip(summary.label, summary.note, summary.status)
             if note and state == "ok"]
    if "setup_parts" in summary:
        notes += [f"  {label}: setup_s in parts: " + ", ".join(f"{k} {v:.3f}" for k, v in json.loads(parts).items())
                  for label, parts in zip(summary.label, summary.setup_parts) if isinstance(parts, str) and parts]
    if "refill_widths" in summary:   # the prefill widths the refills ran at, where a run had more than one
        notes += [f"  {label}: refills by prefill width: " + ", ".join(f"{w} columns {n}" for w, n in
                                                                       json.loads(widths).items())
                  for label, widths in zip(summary.label, summary.refill_widths)
                  if isinstance(widths, str) and widths and len(json.loads(widths)) > 1]
    return "\n".join([text, *notes])


def header(cfg: RolloutConfig, work: Workload, env: dict, summary) -> str:
    step = summary.loc[summary.runner == "eos-off", "step_s"]
    step_ms = f"{float(step.iloc[0]) * 1e3:.3f} ms" if len(step) and step.iloc[0] == step.iloc[0] else "-"
    return (f"\n{cfg.name}: {env['device_name']}, torch {env['torch']}, transformers {env['transformers']}; "
            f"{cfg.prompts} prompts x {_prompt_tokens(cfg)} tokens, {cfg.slots} slots, lengths {cfg.lengths}, "
            f"refill_rows {cfg.refill_rows}, refill_after {_after(cfg)}, refill_widths {cfg.refill_widths} "
            f"(max_new_tokens {work.max_new_tokens}, {work.drawn_tokens} tokens drawn); greedy, median of "
            f"{cfg.repeats}; eos-off step {step_ms}; ideal = prefill_s + steps x eos-off step")


def _prompt_tokens(cfg: RolloutConfig) -> str:
    return str(cfg.prompt_len) if cfg.prompt_min is None else f"{cfg.prompt_min}-{cfg.prompt_len}"


def _after(cfg: RolloutConfig) -> str:
    return f"{default_refill_after(cfg.slots)} (default)" if cfg.refill_after is None else str(cfg.refill_after)


def format_ratios(values: dict) -> str:
    return "ratios (useful tok/s): " + ", ".join(
        f"{name} {'-' if v != v else format(v, '.2f')}" for name, v in values.items())


PARTIAL = ".partial"   # the files of a config whose runners have not all run yet


def save(df, summary, cfg: RolloutConfig, env: dict, out_dir: Path, partial: bool = False) -> list[str]:
    """The config's CSV (every timed call) and JSON (environment, config, summary, ratios). `partial`: the runners
    measured so far, as NAME.partial.csv/.json, which resuming never skips; the whole config's files replace
    them."""
    out_dir = Path(out_dir)
    stem = cfg.name + (PARTIAL if partial else "")
    csv_path, json_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json"
    record.save_csv(df, csv_path, first=("config", "config_hash", "runner", "repeat"))
    record.write_sidecar(json_path, env, name=cfg.name, config_hash=cfg.config_hash, config=dataclasses.asdict(cfg),
                         summary=json.loads(summary.to_json(orient="records", double_precision=15)),
                         ratios=_no_nan(ratios(summary)))
    if not partial:
        for path in (out_dir / f"{cfg.name}{PARTIAL}.csv", out_dir / f"{cfg.name}{PARTIAL}.json"):
            path.unlink(missing_ok=True)
    return [str(csv_path), str(json_path)]


def saved(cfg: RolloutConfig, out_dir: Path):
    """(summary, ratios) of `cfg` from an earlier run into `out_dir`, or None: resuming skips a config whose files
    hold the same config hash and no runner that failed."""
    import pandas as pd
    out_dir = Path(out_dir)
    meta = record.read_sidecar(out_dir / f"{cfg.name}.json")
    if meta.get("config_hash") != cfg.config_hash or not (out_dir / f"{cfg.name}.csv").exists():
        return None
    summary = pd.DataFrame(meta.get("summary", []))
    if summary.empty or summary["status"].astype(str).str.startswith("error").any():
        return None
    numbers = [c for c in (*FIGURES, "tok_s", "ideal_s", "of_ideal", "warmup_s", "drawn_tokens") if c in summary]
    values = {k: _float(v) for k, v in meta.get("ratios", {}).items()}
    return summary.astype({c: float for c in numbers}), values


# ----------------------------------------------------------------------------- command line

def parser() -> options.Parser:
    doc = __doc__.split("\n\n")[0]
    examples = "\n".join(line for line in __doc__.splitlines() if line.startswith("    python -m gdtool bench"))
    p = options.Parser("python -m gdtool bench --workload rollout", doc + "\n\n" + examples)
    p.add_argument("--workload", choices=("decode", "rollout"), default="rollout",
                   help="decode: gdtool's modes against generate() (its own options, see python -m gdtool bench "
                        "--help); rollout: this workload")
    p.add_model()
    p.list_option("--slots", item=options.int_item("slots", 1), default=[64],
                  help="rows decoded at once, one config per value")
    p.add_int("--prompts", default=1024, minimum=1, help="prompts per rollout (random tokens, seeded)")
    p.add_prompt_lengths("128", "(seeded)")
    lengths = p.add_lengths(["geom:128:512"])
    lengths.help = ("response-length distribution(s) (gdtool.measure.workloads), one config per value: fixed:N, "
                    "uniform:LO:HI, geom:MEAN:CAP, list:A,B,C (one per prompt), emp:A,B,C (drawn); max_new_tokens "
                    "is its cap")
    p.add_int("--repeats", default=3, minimum=1, help="timed calls per runner after one warm-up call")
    p.list_option("--runners", item=options.choice_item("runner", RUNNERS), default=list(RUNNERS),
                  help=f"the runners to measure ({', '.join(RUNNERS)}; default all): the ideal needs eos-off, "
                       "a ratio needs both of its runners")
    p.add_kernels()
    p.list_option("--refill-rows", item=options.int_item("refill-rows", 1), default=[REFILL_ROWS],
                  help="the refill runners' refill_rows (the most prompts one refill prefills together), one config "
                       "per value")
    p.list_option("--refill-after", item=options.int_item("refill-after", 1), default=[None],
                  help="the refill runners' refill_after (refill once this many slots are free; default: "
                       "gdtool.rollout's, an eighth of the slots), one config per value")
    p.list_option("--refill-widths", item=options.int_item("refill-widths", 1), default=[REFILL_WIDTHS],
                  help="the refill runners' refill_widths (the most width buckets a refill prefills at: the longest "
                       "prompt and its halvings; for ragged prompts, --prompt-len LO,HI), one config per value")
    p.add_argument("--cb-cuda-graphs", choices=CB_CUDA_GRAPHS, default="auto",
                   help="hf-cb's CUDA graphs (use_cuda_graph): auto leaves HF's choice (on for flash attention, "
                        "off where an attention mask is needed), on or off forces it")
    p.add_device()
    p.add_seed()
    p.add_out("results/bench", "folder for <config>.csv and <config>.json, made if missing")
    p.add_common()
    return p


def check_lengths(p: options.Parser, specs: list[str], prompts: int, seed: int) -> None:
    """Refuse, before any model loads, a length distribution this workload cannot draw."""
    for spec in specs:
        dist = workloads.parse(spec)
        if not dist.eos:
            p.error(f"--lengths {spec}: a rollout needs lengths that end; the eos-off runner already measures a "
                    "batch without EOS (use e.g. geom:128:512)")
        try:
            dist.draw(batch=prompts, seed=seed)
        except ValueError as err:
            p.error(f"--lengths {spec}: {err} (the rollout draws one length per prompt: --prompts {prompts})")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    misplaced = options.given(argv, DECODE_ONLY)
    if misplaced:
        p.error(f"{misplaced[0]} is an option of --workload decode; the rollout workload takes "
                f"{DECODE_ONLY[misplaced[0]]}")
    args = p.parse_args(argv)
    if args.workload != "rollout":
        p.error("--workload decode has options of its own; run python -m gdtool bench --workload decode ...")
    check_lengths(p, args.lengths, args.prompts, args.seed)
    args.out = p.out_path(args.out)  # before loading anything: a path it cannot write fails now
    return options.run(p, _main, args)


def _configs(model_name: str, args) -> list[RolloutConfig]:
    lo, hi = args.prompt_len
    return [RolloutConfig(model=model_name, slots=slots, prompts=args.prompts, prompt_len=hi,
                          prompt_min=None if lo == hi else lo,
                          lengths=workloads.parse(spec).spec, repeats=args.repeats, seed=args.seed,
                          cb_cuda_graphs=args.cb_cuda_graphs,
                          runners=tuple(r for r in RUNNERS if r in args.runners), kernels=kernels,
                          refill_rows=rows, refill_after=after, refill_widths=widths)
            for kernels in dict.fromkeys(args.kernels)
            for rows in dict.fromkeys(args.refill_rows) for after in dict.fromkeys(args.refill_after)
            for widths in dict.fromkeys(args.refill_widths)
            for spec in dict.fromkeys(args.lengths) for slots in dict.fromkeys(args.slots)]


def _main(args) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    out = options.Output(args.json)
    out_dir = Path(args.out)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = args.model or options.default_models(device.type == "cuda")
    plan = {name: _configs(name, args) for name in names}
    bar = options.progress(sum(len(c.runners) for cs in plan.values() for c in cs), "bench rollout", not args.no_progress,
                           unit="runner")

    def log(message):
        bar.write(message, file=sys.stderr)

    files, summaries, all_ratios, failed, env = [], [], [], False, None
    try:
        for model_name, configs in plan.items():
            model = None
            for cfg in configs:
                previous = None if args.redo else saved(cfg, out_dir)
                if previous is not None:
                    log(f"[bench] {cfg.name}: already in {out_dir} (same config hash), skipped; --redo measures it "
                        "again")
                    bar.update(len(cfg.runners))
                    summary, values = previous
                    files += [str(out_dir / f"{cfg.name}.csv"), str(out_dir / f"{cfg.name}.json")]
                    out.say(f"\n{cfg.name} (from {out_dir})\n{format_table(summary)}")
                else:
                    if model is None:
                        model = _load(model_name, args.seed, device, log)
                    env = env or record.environment(device)
                    summary, text, written, broke = _measured(model, cfg, env, out_dir, log, lambda r: bar.update(1))
                    values, files, failed = ratios(summary), files + written, failed or broke
                    out.say(text)
                out.say(format_ratios(values))
                if device.type != "cuda":
                    out.say(options.UNCAPTURED)
                summaries.append(summary)
                all_ratios.append({"config": cfg.name, "slots": cfg.slots, "lengths": cfg.lengths, **values})
            del model
            gc.collect()
    finally:
        bar.close()
    out.say(f"results in {out_dir}")
    out.document(_document(names, env or record.environment(device), device, files, summaries, all_ratios))
    return 1 if failed else 0


def _load(model_name: str, seed: int, device: torch.device, log):
    t0 = time.perf_counter()
    model = load_model(model_name, seed=seed, device=device)
    log(f"[bench] loaded {model_name} in {time.perf_counter() - t0:.1f} s")
    return model


def _measured(model, cfg: RolloutConfig, env: dict, out_dir: Path, log, on_runner):
    """Measure one config and write its files: (summary, the table as text, the files, whether a runner failed)."""
    def keep(work, results):   # a run cut by its time limit keeps the runners it measured
        df = tidy_rows(cfg, work, results, env["device_name"])
        save(df, summarize(df), cfg, env, out_dir, partial=True)

    work, results = run_config(model, cfg, log=log, on_runner=on_runner, on_partial=keep)
    df = tidy_rows(cfg, work, results, env["device_name"])
    summary = summarize(df)
    files = save(df, summary, cfg, env, out_dir)
    text = header(cfg, work, env, summary) + "\n" + format_table(summary)
    return summary, text, files, any(r.status.startswith("error") for r in results)


SUMMARY_KEYS = ("config", "slots", "runner", "status", "note", "tok_s", "wall_s", "useful_tokens", "drawn_tokens",
                "early", "row_step_share", "share_predicted", "decode_steps", "steps_predicted", "host_syncs", "prefill_s", "setup_s", "step_s", "ideal_s",
                "of_ideal", "warmup_s")


def _document(names, env: dict, device: torch.device, files, summaries, all_ratios) -> dict:
    """The one JSON document of --json."""
    import pandas as pd
    everything = pd.concat(summaries, ignore_index=True)
    keep = [c for c in SUMMARY_KEYS if c in everything]
    return {"bench": "rollout", "models": names, "device": env["device_name"], "captured": device.type == "cuda",
            "torch": env["torch"], "transformers": env["transformers"], "files": files,
            "results": json.loads(everything[keep].to_json(orient="records", double_precision=15)),
            "ratios": [_no_nan(r) for r in all_ratios], "environment": env}


if __name__ == "__main__":
    raise SystemExit(main())
