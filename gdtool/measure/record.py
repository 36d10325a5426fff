"""One result record: the environment sidecar, and how a run config is named, hashed, saved and resumed.

Every command that writes results (`bench`, `sweep`, `profile`, `profile --nsys`) writes them the same
way: tidy rows (one per config x repetition or step, every config field a column, plus ``name`` and
``config_hash``) in a CSV rewritten after every config, and a JSON sidecar whose ``environment``
has the keys of `environment`, the same everywhere. Rerunning a command with the same output skips
the configs already there (``--redo`` measures them again), so a run cut short goes on where it stopped.

    from gdtool.measure import record
    env = record.environment()            # GPU, driver, torch, transformers, gdtool commit, date, ...
    print(record.describe(env))           # the same, in one line (each notebook's first output)

    @dataclass(frozen=True)
    class MyConfig(record.Config):
        model: str
        batch: int
        def name_parts(self):
            return [self.model, f"b{self.batch}"]
    MyConfig("llama-1b", 16).name         # 'llama-1b_b16'; .hash: 12 hex digits, stable across machines

    results = record.Results("out/x.csv")     # what an earlier run left there, if anything
    results.count(cfg)                        # (rows without error, any failed row)
    results.replace(cfg, rows); results.save()

The git commit comes from ``$GDTOOL_COMMIT`` where it is set (a copy of a checkout may carry a git
folder of another commit), else from ``git`` in the checkout (``git_commit_source`` says which).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import pandas as pd

__all__ = ["Config", "ENV_KEYS", "Results", "config_hash", "describe", "environment", "now", "read_sidecar",
           "save_csv", "write_sidecar"]

# The keys of every environment sidecar, in this order (values None where they do not apply).
ENV_KEYS = ("date", "python", "os", "cpu", "cpu_count", "torch", "transformers", "nvtx", "cuda", "device",
            "device_name", "gpu", "gpu_count", "driver", "gdtool", "git_commit", "git_dirty", "git_commit_source",
            "nsys")

_ROOT = Path(__file__).resolve().parent.parent


def now() -> str:
    """UTC time to the second, ISO 8601: the ``date`` of a sidecar and the ``timestamp`` of a row."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _run(cmd, cwd=None) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
        return done.returncode, done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return -1, ""


def git_commit() -> tuple[str | None, bool | None, str | None]:
    """(commit, dirty, source) of the gdtool checkout: source is 'GDTOOL_COMMIT', 'git' or None.
    An explicit $GDTOOL_COMMIT wins: a copy of a checkout can carry a git folder of another commit."""
    given = os.environ.get("GDTOOL_COMMIT", "").strip()
    if given:
        return given, None, "GDTOOL_COMMIT"
    code, commit = _run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=_ROOT)
    if code == 0 and re.fullmatch(r"[0-9a-f]{40}", commit):
        _, status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT)
        return commit, bool(status), "git"
    return None, None, None


def _version(package: str) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device=None, nsys: str | None = None) -> dict:
    """Where results came from, with the keys of `ENV_KEYS`.

    ``device``: what the results ran on (default: CUDA where available, else the CPU);
    ``device_name``: that device's name (the GPU's, or the CPU's); ``gpu``: the GPU's name or None;
    ``nsys``: the Nsight Systems version when `nsys` (its path) is given."""
    import torch

    from .. import __version__  # metadata of the package face, not a dependency on it
    cuda = torch.cuda.is_available()
    device = str(device) if device is not None else ("cuda" if cuda else "cpu")
    cpu = platform.processor() or platform.machine() or "cpu"
    gpu = torch.cuda.get_device_name(0) if cuda else None
    driver = None
    if cuda:
        _, text = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = text.splitlines()[0].strip() if text else None
    commit, dirty, source = git_commit()
    env = {"date": now(), "python": platform.python_version(), "os": platform.platform(terse=True), "cpu": cpu,
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": _version("transformers"),
           "nvtx": _version("nvtx"), "cuda": torch.version.cuda, "device": device,
           "device_name": gpu if device.startswith("cuda") and gpu else cpu, "gpu": gpu,
           "gpu_count": torch.cuda.device_count() if cuda else 0, "driver": driver,
           "gdtool": __version__, "git_commit": commit, "git_dirty": dirty,
           "git_commit_source": source, "nsys": None}
    if nsys:
        _, env["nsys"] = _run([nsys, "--version"])
    return env


def describe(env: dict | None = None) -> str:
    """One line: the GPU (or that there is none), driver, torch, transformers and the gdtool commit."""
    env = env or environment()
    if env.get("gpu"):
        where = f"{env['gpu']} (driver {env.get('driver') or '?'}, CUDA {env.get('cuda') or '?'})"
    else:
        where = f"no CUDA GPU (CPU {env.get('cpu')}, {env.get('cpu_count')} cores)"
    commit = env.get("git_commit")
    at = f"commit {commit[:10]}" if commit else "commit unknown (no git; set GDTOOL_COMMIT)"
    if env.get("git_dirty"):
        at += " with local changes"
    return (f"{where}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"gdtool {env.get('gdtool') or ''} at {at}; {env.get('date')}".replace("gdtool  at", "gdtool at"))


# ---------------------------------------------------------------------------------------------
# run configs

def config_hash(cfg) -> str:
    """12 hex digits of the SHA-1 of the config's fields as sorted JSON: the same fields give the same
    hash on every machine and in every run."""
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _clean(part) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(part)).strip("-")


class Config:
    """Mixin for a frozen dataclass of one run config: ``name`` joins `name_parts` with '_' (the
    parts that are at their usual values left out, so names stay short), ``hash`` is `config_hash`.
    Result files and rows are named after ``name``; resuming keys on ``hash``."""

    def name_parts(self) -> list:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return "_".join(p for p in (_clean(x) for x in self.name_parts() if x not in (None, "")) if p)

    @property
    def hash(self) -> str:
        return config_hash(self)

    @property
    def config_hash(self) -> str:
        return config_hash(self)

    def columns(self) -> dict:
        """The config as row columns: every field (tuples joined with ','), its name and hash."""
        fields = {k: (",".join(map(str, v)) if isinstance(v, tuple) and all(not isinstance(x, tuple) for x in v)
                      else json.dumps(v) if isinstance(v, tuple) else v)
                  for k, v in dataclasses.asdict(self).items()}
        return {**fields, "name": self.name, "config_hash": self.hash}


# ---------------------------------------------------------------------------------------------
# saving and resuming

def save_csv(df: pd.DataFrame, path, first=("name", "config_hash")) -> Path:
    """Write `df` to `path` atomically (a crash leaves the old file or the new one), the `first` columns first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lead = [c for c in first if c in df.columns]
    df = df[lead + [c for c in df.columns if c not in lead]]
    tmp = path.with_name(path.name + ".tmp")
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)
    return path


def read_sidecar(path) -> dict:
    """The JSON document at `path`, or {} when there is none (or it is unreadable)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_sidecar(path, env: dict | None = None, **doc) -> dict:
    """Write `path` (JSON): ``environment`` (this run's), ``sessions`` (one entry per run that wrote
    here: date, commit and `doc`'s ``session``), ``earlier_environments`` (when the machine or the
    libraries changed between runs), and the other keys of `doc`. Returns the document."""
    path = Path(path)
    env = env or environment()
    previous = read_sidecar(path)
    session = {"date": env["date"], "git_commit": env["git_commit"], **doc.pop("session", {})}
    out = {"environment": env, "sessions": previous.get("sessions", []) + [session], **doc}

    def machine(e):
        return {k: v for k, v in e.items() if k not in ("date", "git_commit", "git_dirty", "git_commit_source")}
    earlier = previous.get("earlier_environments", [])
    if previous.get("environment") and machine(previous["environment"]) != machine(env):
        earlier = earlier + [previous["environment"]]
    if earlier:
        out["earlier_environments"] = earlier
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return out


class Results:
    """The rows of one results CSV, keyed by ``config_hash``: what an earlier run left at `path`,
    which configs are done, and an atomic save after every config.

    `dtype`: column types to read with (labels such as polling policies stay strings)."""

    def __init__(self, path, dtype: dict | None = None, first=("name", "config_hash")):
        self.path = Path(path) if path is not None else None
        self.first = tuple(first)
        self.df = pd.DataFrame()
        if self.path is not None and self.path.exists() and self.path.stat().st_size > 0:
            self.df = pd.read_csv(self.path, dtype=dtype, keep_default_na=False, na_values=[""])
            if "error" in self.df.columns:
                self.df["error"] = self.df["error"].fillna("")

    def rows(self, cfg) -> pd.DataFrame:
        if self.df.empty or "config_hash" not in self.df.columns:
            return self.df.iloc[0:0]
        return self.df[self.df["config_hash"] == cfg.hash]

    def count(self, cfg) -> tuple[int, bool]:
        """(rows of `cfg` without an error, whether any row of it has one)."""
        mine = self.rows(cfg)
        if mine.empty:
            return 0, False
        errors = mine["error"].fillna("") != "" if "error" in mine.columns else pd.Series(False, index=mine.index)
        return int((~errors).sum()), bool(errors.any())

    def drop(self, cfg, errors_only: bool = False) -> None:
        if self.df.empty or "config_hash" not in self.df.columns:
            return
        mine = self.df["config_hash"] == cfg.hash
        if errors_only and "error" in self.df.columns:
            mine &= self.df["error"].fillna("") != ""
        self.df = self.df[~mine].reset_index(drop=True)

    def add(self, rows) -> None:
        new = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
        if new.empty:
            return
        self.df = new.reset_index(drop=True) if self.df.empty else pd.concat([self.df, new], ignore_index=True)
        if "error" in self.df.columns:
            self.df["error"] = self.df["error"].fillna("")

    def replace(self, cfg, rows) -> None:
        self.drop(cfg)
        self.add(rows)

    def save(self) -> None:
        if self.path is not None and not self.df.empty:
            save_csv(self.df, self.path, self.first)
