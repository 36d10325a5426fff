"""Tables from read exports: one row per config (`summary`), per token (`per_token`), whole session folders
(`load_sessions`, `summarize_exports`), and in-process figures beside nsys's (`agreement`).

    from gdtool.measure.nsys import export, tables
    tables.summary(export.read("my-session/llama-1b_b1_eager_graph_noeos.sqlite.gz"))
    tables.load_sessions(["profiles/h200/nsys"])
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ...core.modes import MODES
from .export import parse_name, read

SUMMARY_KEYS = ("model", "batch", "mode", "trace", "settings")
_MEDIANS = ("wall_us", "host_us", "sync_us", "device_busy_us", "device_span_us", "gpu_idle_us", "gpu_gap_us",
            "kernel_span_us", "copy_us", "kernels", "graphs")
_BANDS = ("wall_us", "host_us", "device_busy_us", "device_span_us")
_PER_TOKEN = ("wall_us", "host_us", "device_busy_us", "device_span_us", "gpu_idle_us")


def summary(df: pd.DataFrame, decode: str = "last") -> pd.DataFrame:
    """One row per model x batch x mode x trace: medians per step, a p20-p80 band for the main times, and
    per-token figures (total over steps / (steps x batch), as in `gdtool.measure.timing`; each step makes one token
    per row). `decode`: 'last' keeps the last decode of each export (earlier ones warm up), 'all' pools them.
    ``bound`` is 'host' when the host's own work per step exceeds the GPU's busy time."""
    if decode not in ("last", "all"):
        raise ValueError(f"decode={decode!r}; use 'last' (skip warm-up decodes) or 'all'")
    keys = [k for k in SUMMARY_KEYS if k in df.columns]
    if decode == "last":
        file_key = ["file"] if "file" in df.columns else []
        df = df[df["decode"] == df.groupby(file_key + keys, dropna=False)["decode"].transform("max")]
    rows = []
    for key, g in df.groupby(keys, dropna=False, sort=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row["steps"] = len(g)
        row["polls"] = int(g["polled"].sum())
        row["syncs"] = int(g["syncs"].sum())
        for c in _MEDIANS:
            row[c] = g[c].median()
        for c in _BANDS:
            row[f"{c}_p20"], row[f"{c}_p80"] = g[c].quantile(0.2), g[c].quantile(0.8)
        batch = row.get("batch")
        tokens = len(g) * batch if batch is not None and not pd.isna(batch) else np.nan
        for c in _PER_TOKEN:
            row[f"{c}_per_token"] = g[c].sum(min_count=1) / tokens if tokens else np.nan
        row["bound"] = "host" if row["host_us"] > row["device_busy_us"] else "device"
        rows.append(row)
    return pd.DataFrame(rows)


def per_token(table: pd.DataFrame) -> pd.DataFrame:
    """`summary` rows with the per-token columns `gdtool.measure.timing.per_token` gives, so the two plot and
    compare alike: ``<metric>_per_token`` (the total over steps / (steps x batch), as in the summary) and
    ``<metric>_median_per_token``, ``_p20_per_token``, ``_p80_per_token`` (a step's median and band / batch)."""
    out = table.copy()
    for metric in _BANDS:
        for stat, column in (("median", metric), ("p20", f"{metric}_p20"), ("p80", f"{metric}_p80")):
            if column in out.columns:
                out[f"{metric}_{stat}_per_token"] = out[column] / out["batch"]
    return out


def load_sessions(folders) -> pd.DataFrame:
    """The per-token table (`per_token`) of every config in the session folders (as `session` writes
    them): an export in the folder is read again here (``source`` 'export'); a config whose export was
    not kept keeps the row of the folder's summary.csv (``source`` 'summary.csv'). Columns ``folder``,
    ``config``, ``implementation`` ('hf' or 'compiled') come first."""
    frames = []
    for folder in map(Path, folders):
        exports = sorted(folder.glob("*.sqlite.gz")) + sorted(folder.glob("*.sqlite"))
        fresh = summarize_exports(exports).assign(source="export") if exports else pd.DataFrame()
        frames.append(fresh.assign(folder=folder.name) if len(fresh) else fresh)
        table = folder / "summary.csv"
        if not table.exists():
            continue
        kept = pd.read_csv(table)
        if not {"batch", "mode", "trace"} <= set(kept.columns):
            continue  # not an nsys session's summary
        settings = kept["settings"].fillna("") if "settings" in kept.columns else pd.Series("", index=kept.index)
        kept["implementation"] = ["compiled" if "kernels=compiled" in str(x) else "hf" for x in settings]
        have = set(zip(fresh["batch"], fresh["mode"], fresh["trace"], fresh["implementation"])) if len(fresh) else set()
        missing = [(b, m, t, i) not in have for b, m, t, i in
                   zip(kept["batch"], kept["mode"], kept["trace"], kept["implementation"])]
        kept = kept[missing]
        if len(kept):
            name = [f"{m}_b{b}_{mode}_{t}" + ("_noeos" if "eos_token_id=None" in str(x) else "")
                    for m, b, mode, t, x in zip(kept.get("model", "?"), kept["batch"], kept["mode"], kept["trace"],
                                                settings[missing])]
            frames.append(kept.assign(source="summary.csv", folder=folder.name, config=name))
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame()
    out = per_token(pd.concat(frames, ignore_index=True))
    first = ["folder", "config", "source", "model", "batch", "mode", "trace", "implementation"]
    return out[[c for c in first if c in out.columns] + [c for c in out.columns if c not in first + ["settings"]]]


def agreement(inproc: pd.DataFrame, traced: pd.DataFrame, model: str | None = None) -> pd.DataFrame:
    """In-process figures against Nsight Systems', per mode and batch size of one model (default: the first
    in both), HF's kernels: device busy per token (the mean: total / (steps x batch)) against the node-level
    trace (graph-level for eager, which replays no graph, or where no node trace was kept), host work of
    the median step against the graph-level trace, and both ratios (in-process / nsys).

    ``inproc``: rows of `gdtool.measure.timing.per_token` (or `timing.per_token_table`) with model, mode, batch;
    ``traced``: rows of `per_token` (or `load_sessions`) with model, mode, batch, trace. Modes and batch
    sizes nsys did not record are left out."""
    for what, table, need in (("in-process", inproc, {"model", "mode", "batch"}),
                              ("nsys", traced, {"model", "mode", "batch", "trace"})):
        if not need <= set(table.columns):
            raise ValueError(f"the {what} table lacks {sorted(need - set(table.columns))}: pass "
                             + ("rows of gdtool.measure.timing.per_token" if what == "in-process" else
                                "an nsys session's summary.csv, or gdtool.measure.nsys.load_sessions(...)"))
    model = model or next((m for m in dict.fromkeys(inproc["model"]) if m in set(traced["model"])), None)
    if model is None:
        raise ValueError("no model is in both tables: the comparison needs an in-process profile of a model that "
                         f"an nsys session recorded ({sorted(set(traced['model']))})")
    mine = inproc[inproc["model"] == model]
    theirs = traced[traced["model"] == model]
    if "implementation" in theirs.columns:
        theirs = theirs[theirs["implementation"] == "hf"]
    busy_column = next((c for c in ("device_busy_us_per_token", "device_us_per_token") if c in mine.columns), None)
    rows = []
    for (mode, batch), g in mine.groupby(["mode", "batch"], sort=False):
        if mode not in set(theirs["mode"]):
            continue  # a mode nsys did not record (device-loop): nothing to set beside it

        def pick(trace, column):
            t = theirs[(theirs["mode"] == mode) & (theirs["batch"] == batch) & (theirs["trace"] == trace)]
            return float(t[column].iloc[-1]) if len(t) and column in t else np.nan
        busy_trace = "graph" if mode == "eager" else "node"
        busy_nsys = pick(busy_trace, "device_busy_us_per_token")
        if busy_nsys != busy_nsys and mode != "eager":
            busy_trace, busy_nsys = "graph", pick("graph", "device_busy_us_per_token")
        host = g["host_us_median_per_token"] if "host_us_median_per_token" in g else pd.Series([np.nan])
        rows.append(dict(mode=mode, batch=int(batch),
                         busy_in_process=float(g[busy_column].iloc[0]) if busy_column else np.nan,
                         busy_nsys=busy_nsys, busy_trace=busy_trace, host_in_process=float(host.iloc[0]) * batch,
                         host_nsys=pick("graph", "host_us_median_per_token") * batch))
    table = pd.DataFrame(rows)
    if len(table):   # a batch size nsys did not record: nothing to set beside it
        table = table.dropna(subset=["busy_nsys", "host_nsys"], how="all").reset_index(drop=True)
    if table.empty:
        raise ValueError(f"nsys recorded none of the modes and batch sizes profiled in-process for {model}")
    table["busy_ratio"] = table["busy_in_process"] / table["busy_nsys"]
    table["host_ratio"] = table["host_in_process"] / table["host_nsys"]
    table["busy_within_10pct"] = [abs(r - 1) <= 0.10 if r == r else None for r in table["busy_ratio"]]
    order = list(MODES)
    table = table.sort_values(["batch", "mode"], key=lambda c: c.map(order.index) if c.name == "mode" else c)
    table = table.reset_index(drop=True)
    table.attrs["model"] = model
    return table


def summarize_exports(paths) -> pd.DataFrame:
    """`summary` of each export, one row per export, with the columns its name gives (``file``, ``config``,
    ``model``, ``batch``, ``mode``, ``trace``, and ``implementation``: decode's kernels, 'compiled' where the
    recording's settings said so, else 'hf'); an export not named as `TraceConfig.name` names them gets
    ``model`` '?'."""
    rows = []
    for path in paths:
        path = Path(path)
        df = read(path)
        try:
            named = parse_name(path.name)
        except ValueError:
            named = {}
        config = path.name.split(".sqlite")[0]
        df = df.assign(file=path.name, model=named.get("model", "?"), settings=config)
        rows.append(summary(df).assign(file=path.name, config=config,
                                       implementation="compiled" if "kernelscompiled" in config else "hf"))
    if not rows:
        return pd.DataFrame()
    out = pd.concat(rows, ignore_index=True)
    first = ["config", "model", "batch", "mode", "trace", "implementation"]
    return out[first + [c for c in out.columns if c not in first + ["settings"]]]


TABLE_COLUMNS = ("model", "batch", "mode", "trace", "steps", "wall_us", "host_us", "sync_us", "device_busy_us",
                 "device_span_us", "gpu_idle_us", "gpu_gap_us", "kernels", "graphs", "syncs", "polls", "bound")


def format_table(table: pd.DataFrame) -> str:
    cols = [c for c in TABLE_COLUMNS if c in table.columns]
    return table[cols].to_string(index=False, float_format=lambda x: f"{x:.1f}")
