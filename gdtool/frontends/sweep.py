"""Sweeps: grids of decodes -> one tidy DataFrame -> CSV + JSON sidecar of the environment.

The question a sweep answers: with the whole step in a CUDA graph, how often should the host read
the device-side "all rows finished" flag? Each read is a sync: the host waits for the queue to
drain, then the GPU idles while the host launches the next step (the bubble). Reading rarely costs
wasted steps instead: the batch keeps decoding after its last row ended, up to k - 1 steps for an
interval of k. Which side wins depends on the step time (model, batch size), the sync cost and how
long and how spread the responses are, so a sweep crosses model x mode x batch size x polling policy
x length distribution, with a warm-up and repeats per config.

    import gdtool
    df = gdtool.sweep(["llama-1b"], modes=["step-graph"], batches=[1, 4, 16, 64],
                      polls=[1, 4, 16, 64, "never", "async"], lengths=["geom:128:512"],
                      repeats=3, out="profiles/sweeps/llama-1b_geom128.csv")
    from gdtool.frontends.sweep import summarize
    summarize(df)                         # medians with a p20-p80 band per config

    python -m gdtool sweep --models llama-1b --modes step-graph --batches 1 4 16 64 \\
        --polls 1 4 16 64 never async --lengths geom:128:512 --out profiles/sweeps/x.csv --max-seconds 240

Polling policies (``poll``): an interval k >= 1 (read the flag every k steps), ``never`` (run to
``max_new_tokens``) and ``async`` (after launching step t, read the flag of step t - 1 from pinned
memory: at most one step past the end, and the read waits on a step that is already done).

Each config gets ``warmup`` untimed decodes, then ``repeats`` timed ones. Consecutive configs that
differ only in the polling policy replay one captured graph (one engine, as a server would keep it),
so the warm-up runs once per captured graph. Rows are one config x repetition; every config field
is a column. Lengths are redrawn per
repetition with seed ``seed * 1000 + repeat``, the same draw for every mode and poll of that
repetition, so policies are compared on the same batches (paired). The CSV is rewritten after every
config, and a sweep skips configs already in it: stop it at any time (or give it ``max_seconds``)
and run the same command again to go on. A config that raises is recorded in the ``error`` column
and the sweep moves on.

Metrics: ``tokens`` (useful tokens: each row up to and including its EOS), ``tokens_per_s`` (useful
tokens over the decode wall time, prefill excluded), ``steps_per_s``, ``wasted_steps``,
``host_syncs``, ``polls``, ``us_per_token``, the decode's timings (``prefill_s``, ``warmup_s``,
``capture_s``, ``decode_s``, ``total_s``) and, with ``profile=True`` and `gdtool.profile` present,
``host_us_per_token`` / ``device_us_per_token`` (kernel busy time) from one extra profiled run per
repetition, with that repetition's lengths (`gdtool.measure.timing.profile`; totals over those runs per
step-token, wasted steps included; ``profile_runs`` says how many).
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch

from ..core.models import eos_ids, load_model, random_prompts
from ..core.modes import MODES, SPECS
from ..loops.decoder import Decoder
from ..measure import record, workloads
from ..measure.polls import POLL_ORDER, poll_label, poll_order, poll_value
from . import estimate

__all__ = [
    "POLL_ORDER",
    "RunConfig",
    "grid",
    "load",
    "main",
    "poll_label",
    "poll_value",
    "run_config",
    "summarize",
    "sweep",
]


METRICS = ["tokens", "tokens_per_s", "steps", "steps_per_s", "wasted_steps", "host_syncs", "polls",
           "replays", "us_per_token", "decode_s", "prefill_s", "warmup_s", "capture_s", "total_s"]


# ---------------------------------------------------------------------------------------------
# run configs
@dataclass(frozen=True)
class RunConfig(record.Config):
    """One point of a sweep. Its `name` derives from its fields, its `hash` is stable across runs
    (`gdtool.measure.record.Config`)."""

    model: str
    mode: str
    batch: int
    poll: str                  # poll_label: "1", "16", "never", "async"
    lengths: str               # workloads name: "geom128cap512", "fixed64", "eos-off"
    max_new_tokens: int
    prompt_len: int = 128
    sample: bool = False
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "poll", poll_label(self.poll))
        object.__setattr__(self, "lengths", workloads.parse(self.lengths).name)
        if int(self.batch) < 1:
            raise ValueError(f"batch={self.batch} must be at least 1")
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        object.__setattr__(self, "batch", int(self.batch))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "prompt_len", int(self.prompt_len))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "sample", bool(self.sample))

    @property
    def dist(self) -> workloads.LengthDist:
        return workloads.parse(self.lengths)

    def name_parts(self) -> list:
        """e.g. ``llama-1b_b16_poll16_step-graph_geom128cap512``; fields at their usual values are left out."""
        parts = [self.model, f"b{self.batch}", f"poll{self.poll}", self.mode, self.lengths]
        if self.max_new_tokens != (self.dist.max_length or -1):
            parts.append(f"new{self.max_new_tokens}")
        if self.prompt_len != 128:
            parts.append(f"prompt{self.prompt_len}")
        if self.sample:
            parts.append("sample")
        if self.seed:
            parts.append(f"seed{self.seed}")
        return parts

    def lengths_for(self, repeat: int) -> torch.LongTensor | None:
        """Target lengths of a repetition (None with EOS off), capped at max_new_tokens."""
        targets = self.dist.draw(self.batch, seed=self.seed * 1000 + repeat)
        return None if targets is None else targets.clamp(max=self.max_new_tokens)


CONFIG_FIELDS = [f.name for f in fields(RunConfig)]


def _as_list(x) -> list:
    if x is None:
        return [None]
    if isinstance(x, (str, int, float, workloads.LengthDist, torch.nn.Module)):
        return [x]
    return list(x)


def _model_name(model) -> str:
    if isinstance(model, str):
        return model
    return getattr(model, "gdtool_name", None) or type(model).__name__


def grid(models, modes, batches, polls, lengths, *, max_new_tokens: int | None = None, prompt_len: int = 128,
         sample: bool = False, seed: int = 0) -> list[RunConfig]:
    """The cross product as RunConfigs, model-major (one model load per model).

    ``max_new_tokens`` defaults to the distribution's longest length (its cap), 256 with EOS off."""
    configs = []
    for model in _as_list(models):
        for dist in (workloads.parse(d) for d in _as_list(lengths)):
            new = max_new_tokens or dist.max_length or 256
            for mode in _as_list(modes):
                for batch in _as_list(batches):
                    for poll in _as_list(polls):
                        poll = poll_label(poll) if poll is not None else _default_poll_label(mode)
                        configs.append(RunConfig(_model_name(model), mode, batch, poll, dist.name, new,
                                                 prompt_len, sample, seed))
    return configs


# ---------------------------------------------------------------------------------------------
# running
def _default_poll_label(mode: str) -> str:
    """The poll label of a run that leaves eos_poll_interval unset: the mode's default interval, or "default" where
    the host never polls (device-loop) or the mode is unknown."""
    spec = SPECS.get(mode)
    return str(spec.default_poll) if spec is not None and spec.host_steps else "default"


def _decode_kwargs(model, cfg: RunConfig, repeat: int) -> tuple[dict, torch.LongTensor | None]:
    targets = cfg.lengths_for(repeat)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.sample, seed=cfg.seed * 1000 + repeat,
                  eos_token_id=None if targets is None else eos_ids(model))
    if cfg.sample:
        kwargs.update(temperature=1.0, top_k=50, top_p=1.0)
    return kwargs, targets


def _settings(model, cfg: RunConfig, repeat: int) -> tuple[dict, int, torch.LongTensor | None]:
    """(a Decoder's settings, the repetition's seed, its target lengths) for one decode of `cfg`."""
    kwargs, targets = _decode_kwargs(model, cfg, repeat)
    seed = kwargs.pop("seed")
    return kwargs, seed, targets


class Engines:
    """Decodes for a sweep through one `Decoder` (gdtool/loops/decoder.py) that keeps one engine (one warm-up
    and capture) at a time: consecutive configs with the same model, mode and settings replay it across polling
    policies and repetitions, as a serving loop would; anything else (batch, lengths, EOS on/off, sampling)
    captures anew (capture time is reported apart and excluded from ``decode_s``)."""

    def __init__(self):
        self.key, self.decoder, self.poll = None, None, None

    @staticmethod
    def _key(model, cfg: RunConfig, settings: dict) -> tuple:
        return id(model), cfg.mode, tuple(sorted(settings.items()))

    def _decoder(self, model, cfg: RunConfig, settings: dict) -> Decoder:
        """The Decoder for these settings, made anew where model, mode or settings changed; its polling set."""
        key = self._key(model, cfg, settings)
        if key != self.key:
            self.close()
            self.decoder = Decoder(model, cfg.mode, max_graphs=1, **settings)
            self.key, self.poll = key, None
        if poll_value(cfg.poll) != self.poll:
            self.poll = poll_value(cfg.poll)
            self.decoder.configure(eos_poll_interval=self.poll)
        return self.decoder

    def is_warm(self, model, cfg: RunConfig, prompt, repeat: int = 0) -> bool:
        """True when the next decode of ``cfg`` replays a graph this object already captured and ran."""
        settings, _, targets = _settings(model, cfg, repeat)
        if self.decoder is None or self.key != self._key(model, cfg, settings):
            return False
        return self.decoder.signature(prompt.input_ids, prompt.attention_mask, targets) in self.decoder.engines

    def decode(self, model, cfg: RunConfig, prompt, repeat: int):
        settings, seed, targets = _settings(model, cfg, repeat)
        out = self._decoder(model, cfg, settings).generate(prompt.input_ids, prompt.attention_mask, seed=seed,
                                                           target_lengths=targets)
        return out, targets

    def close(self):
        if self.decoder is not None:
            self.decoder.close()
        self.key, self.decoder = None, None


def _check(cfg: RunConfig, out, targets) -> int:
    """Assert the generated token count; returns how many rows ended before their target (a natural
    EOS drawn by the random weights)."""
    lengths = out.lengths.cpu()
    if int(out.new_tokens) != int(lengths.sum()):
        raise AssertionError(f"out.new_tokens={out.new_tokens} but out.lengths sums to {int(lengths.sum())}")
    if targets is None:
        if int(out.new_tokens) != cfg.batch * cfg.max_new_tokens:
            raise AssertionError(f"EOS off: expected {cfg.batch} x {cfg.max_new_tokens} tokens, got {out.new_tokens}")
        return 0
    if bool((lengths > targets).any()):
        raise AssertionError(f"rows ran past their forced EOS: lengths {lengths.tolist()} vs targets {targets.tolist()}")
    return int((lengths < targets).sum())


def _row(cfg: RunConfig, repeat: int, out, targets, early: int) -> dict:
    t = dict(out.timings)
    decode_s = float(t.get("decode_s", float("nan")))
    tokens = int(out.new_tokens)
    row = asdict(cfg)
    row.update(name=cfg.name, config_hash=cfg.hash, repeat=repeat, tokens=tokens,
               tokens_per_s=tokens / decode_s if decode_s > 0 else float("nan"),
               steps=int(out.steps), steps_per_s=int(out.steps) / decode_s if decode_s > 0 else float("nan"),
               wasted_steps=int(out.wasted_steps), host_syncs=int(out.host_syncs), polls=int(out.polls),
               replays=int(out.replays), us_per_token=decode_s / tokens * 1e6 if tokens else float("nan"),
               target_max=int(targets.max()) if targets is not None else cfg.max_new_tokens,
               target_sum=int(targets.sum()) if targets is not None else cfg.batch * cfg.max_new_tokens,
               early_rows=early, device=str(out.device), error="",
               timestamp=record.now())
    for key in ("decode_s", "prefill_s", "warmup_s", "capture_s", "total_s"):
        row[key] = float(t[key]) if key in t else float("nan")
    for key, value in t.items():           # timings the core adds later still land in the CSV
        if key not in row and isinstance(value, (int, float)):
            row[key] = float(value)
    return row


def _profiled_runs(model, cfg: RunConfig, prompt, repeats, busy: bool, warmup: int = 1):
    """One extra run under `gdtool.measure.timing.profile` per repetition, each with that repetition's lengths."""
    from ..measure.timing import profile
    for repeat in repeats:
        kwargs, targets = _decode_kwargs(model, cfg, repeat)
        if poll_value(cfg.poll) is not None:
            kwargs["eos_poll_interval"] = poll_value(cfg.poll)
        if targets is not None:
            kwargs["target_lengths"] = targets
        yield profile(model, prompt.input_ids, prompt.attention_mask, mode=cfg.mode, busy=busy, warmup=warmup,
                      **kwargs)


def _pooled(results, metrics) -> dict:
    """Totals over the runs / step-tokens over the runs. One run alone would make the figure hang on
    one draw (at batch 1, a 20-token rollout pays the whole launch)."""
    totals: dict[str, float] = {}
    step_tokens = 0
    for result in results:
        for metric, column in metrics.items():
            if metric in result.summary.index:
                totals[column] = totals.get(column, 0.0) + float(result.summary.loc[metric, "total"])
        step_tokens += result.output.steps * result.output.batch
    if not step_tokens:
        return {}
    return {column: total / step_tokens for column, total in totals.items()}


def _profile_columns(model, cfg: RunConfig, prompt, repeats) -> dict:
    """Host time, wall time and device span per token, pooled over one profiled run per repetition. No
    kernel pass here: torch.profiler leaves CUPTI attached, which would tax every later run's launches;
    `_busy_columns` adds device busy time once every config of the sweep has been timed."""
    host = {m: c for m, c in PROFILE_COLUMNS.items() if m not in ("device_busy_us", "gpu_idle_us")}
    runs = list(_profiled_runs(model, cfg, prompt, repeats, busy=False))
    pooled = _pooled(runs, host)
    return {**pooled, "profile_runs": len(runs)} if pooled else {}


def _busy_columns(model, cfg: RunConfig, repeats) -> dict:
    """Device busy time and GPU idle per token from kernel passes (CUDA only), pooled as above."""
    if next(model.parameters()).device.type != "cuda":
        return {}
    prompt = _prompt(model, cfg)
    with warnings.catch_warnings():  # only the kernel pass's figures are used: the timed pass may be tainted
        warnings.simplefilter("ignore")
        # no warm-up decode: the timed pass before each kernel pass already warms it up
        runs = list(_profiled_runs(model, cfg, prompt, repeats, busy=True, warmup=0))
    busy = {m: c for m, c in PROFILE_COLUMNS.items() if m in ("device_busy_us", "gpu_idle_us")}
    return _pooled(runs, busy)


# gdtool.measure.timing summary metric -> sweep column (per generated token: total over steps / (steps x batch))
PROFILE_COLUMNS = {"host_us": "host_us_per_token", "device_busy_us": "device_us_per_token",
                   "wall_us": "wall_us_per_token", "device_span_us": "device_span_us_per_token",
                   "gpu_idle_us": "gpu_idle_us_per_token"}


def profile_per_token(result) -> dict:
    """``host_us_per_token``, ``device_us_per_token`` (busy), ... from a `gdtool.measure.timing.profile`
    result, whose ``summary`` has one row per metric and a ``per_token`` column."""
    summary = getattr(result, "summary", None)
    if summary is None or "per_token" not in getattr(summary, "columns", ()):
        return {}
    return {column: float(summary.loc[metric, "per_token"]) for metric, column in PROFILE_COLUMNS.items()
            if metric in summary.index}


def _prompt(model, cfg: RunConfig):
    return random_prompts(model, batch=cfg.batch, lengths=cfg.prompt_len, seed=cfg.seed)


def run_config(model, cfg: RunConfig, *, repeats: int = 3, warmup: int = 1, start_repeat: int = 0,
               profile: bool = False, engines: Engines | None = None) -> list[dict]:
    """Warm up, then run ``repeats`` timed repetitions of one config; one dict per repetition.

    Raises on the first failure (the caller records it). Pass the same ``engines`` to consecutive
    calls to reuse a captured graph across polling policies; the ``warmup`` decodes then run once
    per captured graph, not again for each policy that replays it."""
    own = engines is None
    engines = engines or Engines()
    try:
        prompt = _prompt(model, cfg)
        for _ in range(0 if engines.is_warm(model, cfg, prompt, start_repeat) else warmup):
            engines.decode(model, cfg, prompt, start_repeat)
        rows = []
        for repeat in range(start_repeat, start_repeat + repeats):
            out, targets = engines.decode(model, cfg, prompt, repeat)
            early = _check(cfg, out, targets)
            rows.append(_row(cfg, repeat, out, targets, early))
    finally:
        if own:
            engines.close()
    if profile and rows:
        extra = _profile_columns(model, cfg, prompt, range(start_repeat, start_repeat + repeats))
        for row in rows:
            row.update(extra)
    return rows


# ---------------------------------------------------------------------------------------------
# results files
_DTYPES = {"poll": str, "lengths": str, "error": str, "model": str, "mode": str}
_FIRST = tuple(CONFIG_FIELDS) + ("name", "config_hash", "repeat")


def load(path) -> pd.DataFrame:
    """A sweep CSV with its column types (polls and length names stay strings); ``df.attrs["environment"]``
    is its sidecar's (where the rows were measured: the plots name it), when the sidecar is there."""
    df = record.Results(path, dtype=_DTYPES).df
    env = record.read_sidecar(Path(path).with_suffix(".json")).get("environment")
    if env:
        df.attrs["environment"] = env
    return df


def _write_sidecar(path: Path, configs: list[RunConfig], repeats: int, warmup: int, env: dict) -> None:
    record.write_sidecar(path.with_suffix(".json"), env,
                         session=dict(configs=len(configs), repeats=repeats, warmup=warmup),
                         columns_doc=__doc__.split("Metrics:")[1].strip())


# ---------------------------------------------------------------------------------------------
# the sweep
def sweep(models, modes=("step-graph",), batches=(1, 4, 16, 64), polls=(1, 4, 16, 64, "never", "async"),
          lengths=("geom:128:512",), *, repeats: int = 3, warmup: int = 1, out: str | os.PathLike | None = None,
          max_new_tokens: int | None = None, prompt_len: int = 128, sample: bool = False, seed: int = 0,
          configs: list[RunConfig] | None = None, max_seconds: float | None = None, retry_failed: bool = False,
          profile: bool = False, progress: bool = True, device=None, dtype=None, redo: bool = False,
          echo=None) -> pd.DataFrame:
    """Run a grid (or the given ``configs``) and return its repetitions as a tidy DataFrame (rows
already in ``out`` for these configs included; the CSV keeps every config it ever held).

    ``models``: preset names / checkpoint paths (loaded one at a time) or loaded models (named by
    ``model.gdtool_name``). With ``out`` the CSV is rewritten after every config, configs already in
    it are skipped (done = ``repeats`` rows without error; failed ones too unless ``retry_failed``;
    ``redo=True`` measures the grid's configs again), and ``<out>.json`` gets the environment
    (`gdtool.measure.record`). ``max_seconds`` stops before starting a config past that
    budget (``df.attrs["complete"]`` says whether the grid is done; ``df.attrs["environment"]`` is where
    it ran, as the sidecar records it, and the plots name it). ``echo`` (a callable, ``print`` say; the
    command passes one) gets one line before a model's first config: how many configs run, how many ``out``
    already holds, and an estimate of how long they take, from a few short decodes timed first
    (`gdtool.frontends.estimate`); without it nothing is timed beyond the configs."""
    loaded = {_model_name(m): m for m in _as_list(models) if not isinstance(m, str)}
    if configs is None:
        configs = grid(models, modes, batches, polls, lengths, max_new_tokens=max_new_tokens,
                       prompt_len=prompt_len, sample=sample, seed=seed)
    for cfg in configs:
        if cfg.mode not in MODES:
            raise ValueError(f"mode {cfg.mode!r} is not one of gdtool.MODES {MODES}")
    path = Path(out) if out is not None else None
    results = record.Results(path, dtype=_DTYPES, first=_FIRST)
    env = record.environment(device=device)
    if path is not None:
        _write_sidecar(path, configs, repeats, warmup, env)
    if redo:
        for cfg in configs:
            results.drop(cfg)

    todo = []
    for cfg in configs:
        n_ok, failed = results.count(cfg)
        if n_ok >= repeats or (failed and not retry_failed):
            continue
        todo.append((cfg, n_ok))

    from tqdm.auto import tqdm
    start = time.perf_counter()
    done = 0
    bar = None
    current = {"name": None, "model": None}
    engines = Engines()
    profiled = []  # (config, repetitions) timed with profile=True: their kernel passes come last
    announced = set()

    def model_for(cfg):
        if cfg.model != current["name"]:
            engines.close()
            current["model"] = None
            _free()
            current["model"] = loaded.get(cfg.model) or load_model(cfg.model, seed=0, device=device,
                                                                            dtype=dtype)
            current["name"] = cfg.model
            if echo is not None and cfg.model not in announced:
                announced.add(cfg.model)
                line = _announce(current["model"], cfg.model, configs, todo, path, repeats, warmup, profile,
                                 max_seconds)
                with bar.external_write_mode(file=sys.stderr) if bar is not None else contextlib.nullcontext():
                    echo(line)
        return current["model"]

    try:
        if todo and echo is not None:
            try:  # the first model loads before the bar, so that its line comes first
                model_for(todo[0][0])
            except Exception:  # the loop loads it again and records the error against its first config
                pass
        elif echo is not None:
            echo(estimate.announce("sweep", 0, len(configs), str(path) if path else None))
        bar = tqdm(total=len(todo), desc="sweep", unit="config", disable=not progress, file=sys.stderr)
        for cfg, n_ok in todo:
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
            bar.set_postfix_str(cfg.name, refresh=False)
            if retry_failed:
                results.drop(cfg, errors_only=True)
            rows = []
            try:
                model = model_for(cfg)
                rows = run_config(model, cfg, repeats=repeats - n_ok, warmup=warmup, start_repeat=n_ok,
                                  profile=profile, engines=engines)
                if profile:
                    profiled.append((cfg, range(n_ok, repeats)))
            except Exception as err:  # one failed config must not end the sweep: record it
                line = traceback.format_exception_only(type(err), err)[-1].strip()
                row = asdict(cfg)
                row.update(name=cfg.name, config_hash=cfg.hash, repeat=n_ok, error=line[:500], timestamp=record.now())
                rows.append(row)
                engines.close()  # a failed run may leave the engine's buffers half-written
                if isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in line:
                    _free()
                if current["name"] == cfg.model and current["model"] is None:
                    current["name"] = None
            results.add(rows)
            results.save()
            done += 1
            bar.update(1)
            ok = [r for r in rows if not r.get("error")]
            if ok:
                bar.set_postfix_str(f"{cfg.name}: {ok[-1]['tokens_per_s']:.0f} tok/s", refresh=True)
        # Device busy time last, once every config has been timed (torch.profiler taxes later launches).
        for cfg, runs in profiled:
            engines.close()
            try:
                busy = _busy_columns(model_for(cfg), cfg, runs)
            except Exception as err:  # the timed rows stand; busy time stays empty, and the sweep says why
                line = traceback.format_exception_only(type(err), err)[-1].strip()
                warnings.warn(f"sweep: the kernel pass of {cfg.name} failed ({line[:300]}); its device_us_per_token "
                              "is left empty", stacklevel=2)
                continue
            df = results.df
            mine = (df["config_hash"] == cfg.hash) & df["repeat"].isin(list(runs))
            for column, value in busy.items():
                df.loc[mine, column] = value
            if busy:
                results.save()
    finally:
        engines.close()
        if bar is not None:
            bar.close()
    df = results.df
    if not df.empty:
        df = df[df["config_hash"].isin({cfg.hash for cfg in configs})].reset_index(drop=True)
    df.attrs.update(complete=done == len(todo), configs=len(configs), ran=done, remaining=len(todo) - done,
                    seconds=time.perf_counter() - start, environment=env)
    return df


def _announce(model, name: str, configs, todo, path, repeats: int, warmup: int, profile: bool, max_seconds) -> str:
    """The line said before the first config of model `name`: its configs to run and an estimate, from its decodes
    (warm-ups once per captured graph, as `run_config` runs them; timed repetitions; with `profile`, the profiled
    runs, each after a warm-up, and on CUDA their kernel passes) at the rates of a short decode timed here."""
    mine = [(cfg, n_ok) for cfg, n_ok in todo if cfg.model == name]
    cuda = next(model.parameters()).device.type == "cuda"
    works, engine = [], None
    for cfg, n_ok in mine:
        key = (cfg.mode, cfg.batch, cfg.prompt_len, cfg.max_new_tokens, cfg.sample, cfg.seed, cfg.dist.eos)
        runs = repeats - n_ok
        decodes = runs + (warmup if key != engine else 0) + (runs * (3 if cuda else 2) if profile else 0)
        engine = key
        works.append(estimate.Work(cfg.mode, cfg.batch, decodes,
                                   estimate.expected_steps(cfg.lengths, cfg.batch, cfg.poll, cfg.max_new_tokens)))
    several = len({cfg.model for cfg in configs}) > 1
    where = str(path) if path else None
    total = sum(cfg.model == name for cfg in configs)
    try:
        clock = estimate.probe(model, [cfg.mode for cfg, _ in mine], [cfg.batch for cfg, _ in mine],
                               max(cfg.prompt_len for cfg, _ in mine), max(cfg.max_new_tokens for cfg, _ in mine))
    except Exception as err:  # no estimate is no reason to stop: the configs record their own errors
        reason = traceback.format_exception_only(type(err), err)[-1].strip()[:200]
        return estimate.announce("sweep", len(mine), total, where, model=name if several else None) + \
            f"; no estimate (the timed probe decode failed: {reason})"
    left_out = "model loads and captures" + (", profiler overhead" if profile else "") + " not counted"
    if max_seconds is not None:
        left_out += f"; --max-seconds {max_seconds:g} stops it sooner (run the command again to go on)"
    if several and name == todo[0][0].model:
        left_out += "; each further model's configs are estimated when it loads"
    return estimate.announce("sweep", len(mine), total, where, clock, works, left_out,
                             model=name if several else None)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# summaries
def summarize(df: pd.DataFrame, by: list[str] | None = None, metrics: list[str] | None = None) -> pd.DataFrame:
    """Median, p20 and p80 of each metric per config (failed rows left out), one row per config.

    Columns ``<metric>`` (the median), ``<metric>_p20``, ``<metric>_p80``, plus ``n`` repetitions."""
    if df.empty:
        return df.copy()
    ok = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    by = by or [c for c in CONFIG_FIELDS + ["name"] if c in ok.columns]
    metrics = metrics or [c for c in METRICS + list(PROFILE_COLUMNS.values()) + ["target_max", "target_sum",
                                                                                "early_rows"] if c in ok.columns]
    groups = ok.groupby(by, dropna=False, sort=False)
    med = groups[metrics].median()
    p20 = groups[metrics].quantile(0.2).add_suffix("_p20")
    p80 = groups[metrics].quantile(0.8).add_suffix("_p80")
    n = groups.size().rename("n")
    result = pd.concat([med, p20, p80, n], axis=1).reset_index()
    if "poll" in result.columns:
        result["_order"] = result["poll"].map(poll_order)
        sort = [c for c in ("model", "lengths", "mode", "batch") if c in result.columns] + ["_order"]
        result = result.sort_values(sort).drop(columns="_order").reset_index(drop=True)
    return result


# ---------------------------------------------------------------------------------------------
# command line
def _split(values, cast=str):
    from .options import split
    return [cast(x) for x in split(values or [])]


def parser():
    from . import options
    examples = __doc__[__doc__.index("    python -m gdtool sweep"):__doc__.index("Polling policies")].rstrip()
    p = options.Parser("python -m gdtool sweep", __doc__.split("\n\n")[0] + "\n\n" + examples)
    p.add_model()
    p.add_mode(["step-graph"])
    p.add_batch([1, 4, 16, 64])
    p.add_poll(["1", "4", "16", "64", "never", "async"])
    p.add_lengths(["geom:128:512"])
    p.add_argument("--max-new-tokens", type=options.int_type("--max-new-tokens", 1), default=None, metavar="N",
                   help="tokens per row at most (default: the distribution's cap, 256 with eos-off)")
    p.add_prompt_len(128)
    p.add_argument("--sample", action="store_true", help="sample (temperature 1, top-k 50) instead of greedy")
    p.add_seed()
    p.add_int("--repeats", default=3, minimum=1, help="timed repetitions per config")
    p.add_int("--warmup", default=1, help="untimed decodes per captured graph")
    p.add_out("results/sweep.csv", "the results CSV (its sidecar: the same name, .json), its folder made if missing")
    p.add_argument("--max-seconds", default=None, metavar="S",
                   type=options.number_type("--max-seconds", lambda v: v > 0, "a number of seconds > 0"),
                   help="start no config after this many seconds; run the command again to resume "
                        "(default: no limit)")
    p.add_argument("--retry-failed", action="store_true", help="run again configs that failed before")
    p.add_argument("--profile", action="store_true",
                   help="add host and device time per token (gdtool.profile), kernel passes last")
    p.add_common()
    return p


def main(argv: list[str] | None = None) -> int:
    from . import options
    p = parser()
    args = p.parse_args(argv)
    args.out = p.out_path(args.out, file=True)  # before any work: a path it cannot write fails now
    return options.run(p, _main, args)


def _main(args) -> int:
    from . import options
    out = options.Output(args.json)
    models = args.model or options.default_models()
    df = sweep(models, options.expand_modes(args.mode), args.batch, args.poll, args.lengths,
               repeats=args.repeats, warmup=args.warmup, out=args.out, max_new_tokens=args.max_new_tokens,
               prompt_len=args.prompt_len, sample=args.sample, seed=args.seed, max_seconds=args.max_seconds,
               retry_failed=args.retry_failed, profile=args.profile, progress=not args.no_progress,
               redo=args.redo, echo=out.say)
    failed = int((df["error"] != "").sum()) if "error" in df.columns and not df.empty else 0
    doc = {"out": str(args.out), "sidecar": str(Path(args.out).with_suffix(".json")), "rows": len(df),
           "failed_rows": failed, **{k: df.attrs.get(k) for k in ("configs", "ran", "remaining", "complete")},
           "seconds": round(df.attrs.get("seconds", 0.0), 1), "captured": bool(torch.cuda.is_available())}
    best = summarize(df)
    if not best.empty and "tokens_per_s" in best.columns:
        top = best.sort_values("tokens_per_s", ascending=False).iloc[0]
        doc["best"] = {"name": top["name"], "tokens_per_s": round(float(top["tokens_per_s"]), 1)}
        cols = [c for c in ("name", "tokens_per_s", "tokens_per_s_p20", "tokens_per_s_p80", "wasted_steps", "polls",
                            "n") if c in best.columns]
        out.say(best[cols].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    out.say(f"{doc['rows']} rows in {args.out} ({failed} failed); {doc['ran']} of {doc['configs']} configs run now"
            + ("" if doc["complete"] else "; not complete: run the same command again to go on"))
    out.say(f"results in {args.out} (environment: {doc['sidecar']})")
    if not torch.cuda.is_available() and any(m != "eager" for m in options.expand_modes(args.mode)):
        out.say(options.UNCAPTURED)
    out.document(doc)
    return 0 if failed == 0 or failed < len(df) else 1


if __name__ == "__main__":
    sys.exit(main())
