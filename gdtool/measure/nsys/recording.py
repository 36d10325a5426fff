"""Record decodes under Nsight Systems: one fresh process per config (`target`), profiled and exported
(`record`), a list of configs written after each one (`session`).

The command is `python -m gdtool profile --nsys` (gdtool.frontends.profile); this module runs nsys and
knows no command line but the target's own few flags.

    from gdtool.measure.nsys import recording
    steps, table = recording.session([recording.TraceConfig("tiny-llama", 1, "eager", "graph")], "my-session")
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pandas as pd

from ...core import ranges
from ...core.deprecation import renamed
from .. import record as results  # `record` is this module's recording function
from .export import MODES, TRACES, check_totals, read, slim
from .tables import summary


@dataclasses.dataclass(frozen=True)
class TraceConfig(results.Config):
    """One decode recorded under nsys (`RunConfig` until this release: that name was also the sweep's). Its name
    (``llama-1b_b1_eager_graph``) names the files it writes; ``hash`` as every run config has it
    (`gdtool.measure.record.Config`)."""
    model: str
    batch: int
    mode: str
    trace: str
    max_new_tokens: int = 48
    prompt_len: int = 128
    repeat: int = 2
    seed: int = 0
    eos: bool = True  # False: eos_token_id=None, every decode runs max_new_tokens - 1 steps (polls still happen)
    settings: tuple = ()  # (("eos_poll_interval", 16), ...): extra gdtool.decode arguments

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.trace not in TRACES:
            raise ValueError(f"trace={self.trace!r}; use 'graph' (host time) or 'node' (kernel detail)")
        if self.batch < 1 or self.max_new_tokens < 2 or self.repeat < 1:
            raise ValueError(f"batch={self.batch}, max_new_tokens={self.max_new_tokens}, repeat={self.repeat}: need "
                             f"batch >= 1, max_new_tokens >= 2 (one decode step at least) and repeat >= 1")

    def name_parts(self) -> list:
        model = re.sub(r"[^A-Za-z0-9.-]+", "-", Path(self.model).name or self.model)
        return [model, f"b{self.batch}", self.mode, self.trace, "" if self.eos else "noeos",
                *(f"{k}{v}" for k, v in self.settings)]

    @property
    def settings_label(self) -> str:
        return ",".join(([] if self.eos else ["eos_token_id=None"]) + [f"{k}={v}" for k, v in self.settings])


def find_nsys() -> str:
    """Path of the nsys executable: $GDTOOL_NSYS, then PATH, then the usual install folders."""
    candidates = [os.environ.get("GDTOOL_NSYS"), shutil.which("nsys")]
    for pattern in ("/opt/nvidia/nsight-systems/*/bin/nsys", "/opt/nvidia/nsight-systems/*/target-linux-x64/nsys",
                    "/opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys", "/usr/local/cuda*/bin/nsys",
                    "/usr/local/cuda*/nsight-systems*/bin/nsys"):
        candidates += sorted(glob.glob(pattern), reverse=True)
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("nsys (Nsight Systems) not found on PATH, in $GDTOOL_NSYS or under /opt/nvidia; install "
                            "Nsight Systems (or the CUDA toolkit) and put nsys on PATH, or set "
                            "GDTOOL_NSYS=/path/to/nsys")


def _nsys_env(nsys: str) -> dict:
    """Environment for nsys: an nsys inside Nsight Compute's install needs its host libraries on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    host = Path(nsys).resolve().parent.parent  # .../host/target-linux-x64/nsys -> .../host
    extra = [str(p) for p in sorted(host.glob("linux-desktop-glibc_*-x64"))]
    if extra:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(extra + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        env["PATH"] = os.pathsep.join([str(Path(nsys).parent), env.get("PATH", "")])
    return env



def __getattr__(name):
    if name == "RunConfig":  # the old name, kept for one release
        warnings.warn("gdtool.measure.nsys.RunConfig is deprecated and goes in the next release: use TraceConfig "
                      "(gdtool.frontends.sweep.RunConfig is the sweep's)", DeprecationWarning, stacklevel=2)
        return TraceConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

def target_command(cfg: TraceConfig) -> list[str]:
    """The profiled program: `repeat` decodes of one config in a fresh Python (the last is the one to read)."""
    args = ["--model", cfg.model, "--mode", cfg.mode, "--batch", str(cfg.batch), "--max-new-tokens",
            str(cfg.max_new_tokens), "--prompt-len", str(cfg.prompt_len), "--repeat", str(cfg.repeat),
            "--seed", str(cfg.seed)] + ([] if cfg.eos else ["--no-eos"])
    for k, v in cfg.settings:
        args += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    program = "import sys, gdtool.measure.nsys.recording as n; sys.exit(n.target(sys.argv[1:]))"
    return [sys.executable, "-c", program, *args]


def profile_command(nsys: str, cfg: TraceConfig, report: Path) -> list[str]:
    # --sample/--cpuctxsw off: with them a short decode writes gigabytes of raw data.
    return [nsys, "profile", "-t", "cuda,nvtx", "--sample=none", "--cpuctxsw=none",
            f"--cuda-graph-trace={cfg.trace}", "-o", str(report), "--force-overwrite", "true", *target_command(cfg)]


def export_command(nsys: str, report: Path, sqlite_path: Path) -> list[str]:
    return [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", str(sqlite_path), str(report)]


def target(argv: list[str]) -> int:
    """The program nsys profiles: load a model, run `repeat` decodes with gdtool's ranges on, print a JSON line."""
    p = argparse.ArgumentParser(prog="gdtool.measure.nsys.recording target")
    p.add_argument("--model", required=True)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--prompt-len", "--prompt-length", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eos", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    import torch

    from ...core.models import load_model, random_prompts
    from ...kernels.fuse import fuse_projections
    from ...loops.decode import decode
    settings = _parse_settings(a.set)
    if a.no_eos:
        settings["eos_token_id"] = None
    model = load_model(a.model, seed=0)
    if settings.pop("fuse_projections", False) and not fuse_projections(model):
        # not a decode argument: the bench's --fuse-projections
        raise SystemExit(f"fuse_projections=true: {a.model} has no q/k/v or gate/up projections to fuse; drop it")
    prompt = random_prompts(model, batch=a.batch, lengths=(a.prompt_len, a.prompt_len), seed=a.seed)
    results = []
    for r in range(a.repeat):
        out = decode(model, prompt.input_ids, prompt.attention_mask, mode=a.mode,
                            max_new_tokens=a.max_new_tokens, seed=a.seed + r, **settings)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        results.append(dict(steps=out.steps, replays=out.replays, host_syncs=out.host_syncs, polls=out.polls,
                            new_tokens=out.new_tokens, timings=out.timings))
    print(json.dumps(dict(model=a.model, mode=a.mode, batch=a.batch, ranges=ranges.enabled(), decodes=results)))
    return 0


def _parse_settings(pairs) -> dict:
    settings = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--set {pair!r} is not KEY=VALUE; e.g. --set eos_poll_interval=16")
        k, v = pair.split("=", 1)
        try:
            settings[k] = json.loads(v)
        except json.JSONDecodeError:
            settings[k] = v
    return settings


environment = renamed(results.environment, "gdtool.measure.nsys.environment")


def _run_text(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def record(cfg: TraceConfig, out: Path, nsys: str | None = None, keep_report: bool = False, fixture: bool = False,
           timeout: float = 1800) -> tuple[pd.DataFrame, dict]:
    """Profile one config under nsys, export sqlite, gzip it into `out`, and read it. Returns (steps, target JSON)."""
    nsys = nsys or find_nsys()
    out.mkdir(parents=True, exist_ok=True)
    env = _nsys_env(nsys)
    with tempfile.TemporaryDirectory(prefix="gdtool-nsys-") as tmp:
        report = Path(tmp) / "report"  # no dots: nsys appends .nsys-rep (names like qwen2.5-0.5b_... have dots)
        proc = subprocess.run(profile_command(nsys, cfg, report), env=env, capture_output=True, text=True,
                              timeout=timeout)
        rep = Path(tmp) / "report.nsys-rep"
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not rep.exists() or not lines:
            raise RuntimeError(f"nsys profile of {cfg.name} failed (exit {proc.returncode}):\n"
                               f"{shlex.join(profile_command(nsys, cfg, report))}\n{_tail(proc)}\n"
                               f"If the importer lacks a library (e.g. libdw.so.1), install it or add it to "
                               f"LD_LIBRARY_PATH.")
        ran = json.loads(lines[-1])
        sqlite_path = Path(tmp) / "report.sqlite"
        proc = subprocess.run(export_command(nsys, rep, sqlite_path), env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not sqlite_path.exists():
            raise RuntimeError(f"nsys export of {cfg.name} failed (exit {proc.returncode}):\n{_tail(proc)}")
        gz = out / f"{cfg.name}.sqlite.gz"
        if fixture:
            slim(sqlite_path, gz)
        else:
            with open(sqlite_path, "rb") as f, gzip.open(gz, "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
        if keep_report:
            shutil.copy(rep, out / f"{cfg.name}.nsys-rep")
    if not ran.get("ranges"):
        raise RuntimeError(f"{cfg.name}: gdtool's ranges were off in the profiled process (nvtx missing or "
                           f"NVTX_DISABLE set); install nvtx and unset NVTX_DISABLE")
    df = read(gz, trace=cfg.trace)
    check_totals(df, gz)
    want = [d["steps"] for d in ran["decodes"]]
    got = df.groupby("decode").size().tolist()
    if got != want:
        raise AssertionError(f"{cfg.name}: the decodes ran {want} steps but the export holds {got} step ranges")
    for k, v in (("model", cfg.model), ("settings", cfg.settings_label), ("config", cfg.name),
                 ("config_hash", cfg.hash), ("file", gz.name)):
        df[k] = v
    return df, ran


def _tail(proc, n: int = 30) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-n:])


def session(configs, out, nsys: str | None = None, keep_report: bool = False, fixture: bool = False,
            echo=print, redo: bool = False, progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Record every config, writing after each one: steps.csv (one row per step), summary.csv, env.json.

    A config whose export is in `out` and whose steps are in its steps.csv (same config hash) is not
    recorded again unless `redo`: rerun a session to finish it."""
    configs = list(configs)
    if not configs:
        raise ValueError("no configs to record; give at least one batch, mode and trace")
    out = Path(out)
    nsys = nsys or find_nsys()
    out.mkdir(parents=True, exist_ok=True)
    results.write_sidecar(out / "env.json", results.environment(nsys=nsys), session=dict(configs=[c.name for c in configs]))
    steps_file = results.Results(out / "steps.csv", dtype={"model": str, "mode": str, "trace": str, "settings": str},
                                 first=())
    def recorded(cfg) -> bool:
        return not redo and bool(steps_file.count(cfg)[0]) and (out / f"{cfg.name}.sqlite.gz").exists()

    todo = [cfg for cfg in configs if not recorded(cfg)]
    held = f"{len(configs) - len(todo)} of {len(configs)} already in {out}: skipped" if len(todo) < len(configs) else \
        f"none in {out} yet"
    echo(f"nsys: {len(todo)} config{'s' if len(todo) != 1 else ''} to record ({held}), one process each under "
         "Nsight Systems; no estimate before the first ends (a process start, a model load and an export each, "
         "besides its decodes): the bar counts configs, its rate after the first is the estimate")
    from tqdm.auto import tqdm  # the commands' bar (options.progress), without importing the command line
    bar = tqdm(total=len(configs), desc="nsys", unit="config", disable=not progress, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5)
    try:
        for cfg in configs:
            if recorded(cfg):
                echo(f"# {cfg.name}: already in {out} (same config hash), skipped")
                bar.update(1)
                continue
            echo(f"# {cfg.name}: nsys profile --cuda-graph-trace={cfg.trace} ...")
            df, _ = record(cfg, out, nsys=nsys, keep_report=keep_report, fixture=fixture)
            steps_file.replace(cfg, df)
            steps_file.save()
            summary(steps_file.df).to_csv(out / "summary.csv", index=False)
            bar.update(1)
    finally:
        bar.close()
    mine = steps_file.df[steps_file.df["config_hash"].isin({c.hash for c in configs})].reset_index(drop=True)
    return mine, summary(mine)
