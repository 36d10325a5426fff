"""Decode under Nsight Systems, and read its sqlite export as one row per decode step.

A decode step costs time on two clocks. The host runs Python, launches kernels (or one graph
replay) and sometimes waits; the GPU runs what was launched. When the host takes longer to launch
a step than the GPU takes to run it, the GPU idles between kernels: the decode is host-bound
(eager at small batch). A captured step is one launch: the host is done in tens of microseconds
and the GPU runs back to back, idle only while the host waits on an EOS poll: device-bound.

gdtool's NVTX ranges (domain ``gdtool``, see `gdtool.ranges`) mark each step on the host. `read`
projects every ``step`` range onto the GPU: the CUDA API calls made on the step's thread while the
range was open are joined by ``correlationId`` to the kernels, graph executions and copies they
launched, wherever on the GPU timeline those ran. Per step (names and definitions as in
`gdtool.timing`, so the two can be compared column by column):

- ``wall_us``: the step range's duration on the host; ``<phase>_us`` for the ranges inside it
  (``forward_us``, ``select_us``, ``update_us``, ``eos_check_us``, ``replay_us``, ``eos_poll_us``);
- ``sync_us``: host time inside blocking CUDA calls (stream, device or event synchronize, synchronous
  memcpy, and async copies to pageable host memory, which block); ``syncs``: how many waits (torch's
  ``.item()`` is a copy to pageable memory plus a stream synchronize: one wait);
- ``host_us = wall_us - sync_us``: the host's own work in the step, waits excluded;
- ``kernels``, ``graphs``: kernel records and graph-execution records the step launched;
  ``graph_launches``: cudaGraphLaunch calls in the step;
- ``device_busy_us``: the sum of their durations (memcpy and memset left out, as in `gdtool.timing`);
  ``kernel_span_us``: the first one's start to the last one's end;
- ``device_span_us``: what CUDA events recorded at the step's start and end would measure: from
  max(step start on the host, previous step's last device end) to the step's last device end;
- ``gpu_idle_us = device_span_us - device_busy_us``: the GPU waiting inside the step;
- ``gpu_gap_us``: GPU idle from the previous step's last device work to this step's first, which
  also covers host time between step ranges (where a polling step-graph decode loses its time);
- ``copies``/``copy_us``/``d2h``: memcpy and memset records the step launched, device-to-host copies;
- ``polled``: the step has an ``eos-check`` or ``eos-poll`` range; ``step_start_us``: from the
  decode range's start.

Two granularities, recorded in the ``trace`` column. ``--cuda-graph-trace=graph`` records one
execution per replay: its duration counts as busy, node gaps included, and the host cost of a
replay is what it is without a profiler: use it for host time. ``--cuda-graph-trace=node``
records every kernel of a replay (with the replay's correlation id) but inflates the host cost of
the replay call: use it for kernel-level busy time and idle gaps.

What nsys cannot see: Python time outside any range, and device work launched from another
thread (it is not attributed to a step).

    python -m gdtool profile --nsys --model llama-1b --batch 1,16 --modes eager,forward-graph,step-graph \\
        --trace graph --max-new-tokens 48 --no-eos --out my-session
    python -m gdtool profile --read my-session/llama-1b_b1_step-graph_graph_noeos.sqlite.gz

    df = gdtool.nsys.read("my-session/llama-1b_b1_eager_graph_noeos.sqlite.gz")
    gdtool.nsys.summary(df); fig, axes = gdtool.nsys.plot_steps(df)

(The command is `gdtool.profile_cli`; `python -m gdtool profile --help` lists every option.)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from . import ranges
from . import record as results  # `record` is this module's recording function

MODES = ("eager", "forward-graph", "step-graph")  # gdtool.MODES, without importing torch to read an export
TRACES = ("graph", "node")

# NVTX_EVENTS.eventType values (ENUM_NSYS_EVENT_TYPE): push/pop and start/end ranges, domain creation.
NVTX_PUSH_POP, NVTX_START_END, NVTX_DOMAIN_CREATE = 59, 60, 75
# CUPTI memcpy kind device-to-host (ENUM_CUDA_MEMCPY_OPER) and memory kind pageable (ENUM_CUDA_MEM_KIND).
COPY_DTOH = 2
MEMORY_PAGEABLE = 1

# Host calls that block until the device catches up (version suffixes such as _v3020 stripped).
SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMemcpyFromSymbol", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
    "cuMemcpy",
})
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})

PHASES = (ranges.FORWARD, ranges.SELECT, ranges.UPDATE, ranges.EOS_CHECK, ranges.REPLAY, ranges.EOS_POLL)
POLL_PHASES = (ranges.EOS_CHECK, ranges.EOS_POLL)

# Tables `read` uses; `slim` keeps these (plus a few that describe the capture) for committed fixtures.
READ_TABLES = ("StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
               "CUPTI_ACTIVITY_KIND_GRAPH_TRACE", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
               "META_DATA_CAPTURE")
KEEP_TABLES = READ_TABLES + ("META_DATA_EXPORT", "TARGET_INFO_GPU", "TARGET_INFO_SESSION_START_TIME",
                             "ENUM_NSYS_EVENT_TYPE", "ENUM_NSYS_EVENT_CLASS", "ENUM_CUDA_MEMCPY_OPER",
                             "ThreadNames", "PROCESSES", "CUDA_GRAPH_NODE_EVENTS", "CUDA_GRAPH_EVENTS")

STEP_COLUMNS = ("decode", "batch", "mode", "trace", "step", "polled", "wall_us", "host_us", "sync_us", "syncs",
                *(f"{p.replace('-', '_')}_us" for p in PHASES), "graph_launches", "kernels", "graphs",
                "device_busy_us", "kernel_span_us", "device_span_us", "gpu_idle_us", "gpu_gap_us", "copies",
                "copy_us", "d2h", "step_start_us")


# --------------------------------------------------------------------------------------------
# Reading an export


@contextlib.contextmanager
def _connect(path):
    """sqlite3 connection to an export, read-only; a .gz is decompressed to a temporary file first."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no nsys export at {path}; make one with `nsys export --type sqlite -o {path} "
                                f"report.nsys-rep`")
    tmp = None
    try:
        if path.suffix == ".gz":
            fd, tmp = tempfile.mkstemp(suffix=".sqlite")
            with os.fdopen(fd, "wb") as out, gzip.open(path, "rb") as src:
                shutil.copyfileobj(src, out)
            target = tmp
        else:
            target = str(path)
        con = sqlite3.connect(Path(target).resolve().as_uri() + "?mode=ro", uri=True)
        try:
            con.execute("select count(*) from sqlite_master").fetchone()
        except sqlite3.DatabaseError as e:
            con.close()
            raise ValueError(f"{path} is not an sqlite file ({e}); pass the output of `nsys export --type sqlite`, "
                             f"plain or gzipped") from None
        try:
            yield con
        finally:
            con.close()
    finally:
        if tmp is not None:
            os.unlink(tmp)


def _tables(con) -> set[str]:
    return {r[0] for r in con.execute("select name from sqlite_master where type in ('table', 'view')")}


def _columns(con, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"pragma table_info({table})")}


def _col(cols: set[str], name: str, default: str = "NULL") -> str:
    """`name` if the table has it (nsys versions add and drop columns), else a constant."""
    return f'"{name}"' if name in cols else default


def _strip_version(name: str) -> str:
    return re.sub(r"_v\d+$", "", name or "")


def _domain_ids(con, domain: str):
    """{process key: domainId} of the NVTX domain named `domain`, or None when the export has no domain records."""
    cols = _columns(con, "NVTX_EVENTS")
    if "domainId" not in cols or "eventType" not in cols:
        return None
    text = "coalesce(text, (select value from StringIds where id = textId))" if "textId" in cols else "text"
    rows = con.execute(f"select coalesce(globalTid / 16777216, 0), domainId, {text} from NVTX_EVENTS "
                       f"where eventType = ?", (NVTX_DOMAIN_CREATE,)).fetchall()
    if not rows:
        return None
    return {pid: dom for pid, dom, text in rows if text == domain}


def _ranges(con, domain: str) -> pd.DataFrame:
    """gdtool's NVTX ranges: start, end (ns), tid (globalTid), pid key, name, payload."""
    cols = _columns(con, "NVTX_EVENTS")
    text = "coalesce(n.text, s.value)" if "textId" in cols else "n.text"
    join = "left join StringIds s on s.id = n.textId" if "textId" in cols else ""
    payload_cols = [c for c in ("int64Value", "uint64Value", "int32Value", "uint32Value") if c in cols]
    payload = f"coalesce({', '.join('n.' + c for c in payload_cols)})" if payload_cols else "NULL"
    types = f"n.eventType in ({NVTX_PUSH_POP}, {NVTX_START_END})" if "eventType" in cols else "1"
    domain_col = "n.domainId" if "domainId" in cols else "NULL"
    names = ", ".join(f"'{n}'" for n in ranges.NAMES)
    df = pd.read_sql_query(
        f"select n.start as start, n.\"end\" as end, n.globalTid as tid, n.globalTid / 16777216 as pid, "
        f"{domain_col} as domain, "
        f"{text} as name, {payload} as payload from NVTX_EVENTS n {join} "
        f"where {types} and n.\"end\" is not null and {text} in ({names})", con)
    df["tid"] = df["tid"].fillna(0).astype("int64")
    df["pid"] = df["pid"].fillna(0).astype("int64")
    ids = _domain_ids(con, domain)
    if ids is not None:  # keep only our domain: another library may also name a range "step"
        wanted = df["pid"].map(ids)
        df = df[wanted.notna() & (df["domain"] == wanted)]
    return df.sort_values(["tid", "start", "end"], ascending=[True, True, False]).reset_index(drop=True)


def _runtime(con) -> pd.DataFrame:
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in _tables(con):
        raise ValueError("the export has no CUPTI_ACTIVITY_KIND_RUNTIME table: no CUDA API calls were traced; "
                         "record with `nsys profile -t cuda,nvtx ...`")
    cols = _columns(con, "CUPTI_ACTIVITY_KIND_RUNTIME")
    name = "s.value" if "nameId" in cols else "NULL"
    join = "left join StringIds s on s.id = r.nameId" if "nameId" in cols else ""
    df = pd.read_sql_query(f"select r.start as start, r.\"end\" as end, r.globalTid as tid, "
                           f"r.globalTid / 16777216 as pid, r.correlationId as corr, {name} as name "
                           f"from CUPTI_ACTIVITY_KIND_RUNTIME r {join}", con)
    df["tid"] = df["tid"].fillna(0).astype("int64")
    df["pid"] = df["pid"].astype("float64")
    df["corr"] = df["corr"].astype("float64")
    df["name"] = df["name"].fillna("").map(_strip_version)
    return df


def _device(con) -> pd.DataFrame:
    """Device activity records: kind (kernel, graph, memcpy, memset), start, end, corr, pid key, copy kind."""
    tables = _tables(con)
    parts = []
    sources = (("kernel", "CUPTI_ACTIVITY_KIND_KERNEL"), ("graph", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"),
               ("memcpy", "CUPTI_ACTIVITY_KIND_MEMCPY"), ("memset", "CUPTI_ACTIVITY_KIND_MEMSET"))
    for kind, table in sources:
        if table not in tables:
            continue
        cols = _columns(con, table)
        parts.append(pd.read_sql_query(
            f"select '{kind}' as kind, start, \"end\" as end, correlationId as corr, "
            f"{_col(cols, 'globalPid')} / 16777216 as pid, {_col(cols, 'graphNodeId')} as node, "
            f"{_col(cols, 'copyKind')} as copy_kind, {_col(cols, 'dstKind')} as dst_kind from {table}", con))
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in
                             (("kind", object), ("start", "int64"), ("end", "int64"), ("corr", "float64"),
                              ("pid", "float64"), ("node", "float64"), ("copy_kind", "float64"),
                              ("dst_kind", "float64"))})
    df = pd.concat([p for p in parts if len(p)] or parts[:1], ignore_index=True)
    df["pid"] = df["pid"].astype("float64")
    df["corr"] = df["corr"].astype("float64")
    # A replay recorded both ways would count twice: kernels win over the graph-level record.
    graph = df["kind"] == "graph"
    if graph.any():
        kernel_corr = set(df.loc[df["kind"] == "kernel", "corr"].dropna())
        df = df[~(graph & df["corr"].isin(kernel_corr))].reset_index(drop=True)
    return df


def _detect_trace(con, device: pd.DataFrame) -> str:
    """'graph' or 'node' (the --cuda-graph-trace of the recording), or 'none' when no graph ran and the export
    does not say. The records decide; the capture's metadata only when they cannot (no graph launched)."""
    if (device["kind"] == "graph").any():
        return "graph"
    if (device.loc[device["kind"] == "kernel", "node"].fillna(0) != 0).any():
        return "node"
    if "META_DATA_CAPTURE" in _tables(con) and {"name", "value"} <= _columns(con, "META_DATA_CAPTURE"):
        values = [str(v).lower() for (v,) in con.execute(
            "select value from META_DATA_CAPTURE where name like '%GRAPH_TRACE%MODE%'")]
        found = {t for t in TRACES for v in values if re.search(rf"\b{t}\b", v)}
        if len(found) == 1:
            return found.pop()
    return "none"


def _enclosing(inner: pd.DataFrame, outer: pd.DataFrame, at: str = "start") -> np.ndarray:
    """For each row of `inner`, the index label in `outer` of the range on the same thread that holds inner[at]
    (outer ranges of one thread must not overlap), or -1."""
    result = np.full(len(inner), -1, dtype="int64")
    if not len(inner) or not len(outer):
        return result
    times = inner[at].to_numpy()
    tids = inner["tid"].to_numpy()
    for tid, group in outer.groupby("tid", sort=False):
        group = group.sort_values("start")
        mask = tids == tid
        if not mask.any():
            continue
        t = times[mask]
        i = np.searchsorted(group["start"].to_numpy(), t, side="right") - 1
        safe = np.clip(i, 0, None)
        inside = (i >= 0) & (t <= group["end"].to_numpy()[safe])
        result[mask] = np.where(inside, group.index.to_numpy()[safe], -1)
    return result


def _outermost(df: pd.DataFrame) -> pd.DataFrame:
    """Drop ranges nested inside another of `df` on the same thread (gdtool never nests a step in a step; without
    NVTX domain ids in the export, another library's range of the same name could be nested in ours)."""
    df = df.sort_values(["tid", "start", "end"], ascending=[True, True, False])
    reach = df.groupby("tid")["end"].transform(lambda e: e.cummax().shift(1))
    return df[~(reach >= df["end"])]


def _phase_column(phase: str) -> str:
    return f"{phase.replace('-', '_')}_us"


def _mode_of(phases: set[str]) -> str | None:
    if ranges.FORWARD in phases:
        return "eager"
    if ranges.REPLAY in phases:
        return "forward-graph" if ranges.SELECT in phases else "step-graph"
    return None


def read(path, *, mode: str | None = None, trace: str | None = None, domain: str = ranges.DOMAIN) -> pd.DataFrame:
    """One row per decode step of an nsys sqlite export (plain or .gz); columns: see the module docstring.

    `mode` is inferred per decode from the phases its steps contain (eager: forward; forward-graph:
    replay + select; step-graph: replay only); pass it only for exports whose steps have no phases.
    `trace` ('graph' or 'node') is read from the export; pass it to override. Times in µs.
    ``df.attrs`` holds the path and the trace.
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if trace is not None and trace not in TRACES + ("none",):
        raise ValueError(f"trace={trace!r} is not one of {TRACES}")
    with _connect(path) as con:
        if "NVTX_EVENTS" not in _tables(con):
            raise ValueError(f"{path} has no NVTX_EVENTS table: record with `nsys profile -t cuda,nvtx`, with the "
                             f"nvtx package installed and NVTX_DISABLE unset")
        nvtx = _ranges(con, domain)
        runtime = _runtime(con)
        device = _device(con)
        detected = _detect_trace(con, device)
    trace = trace or detected
    steps = _outermost(nvtx[nvtx["name"] == ranges.STEP]).copy()
    if steps.empty:
        raise ValueError(f"{path} has no '{ranges.STEP}' ranges in NVTX domain {domain!r}: was the decode run with "
                         f"gdtool's ranges on (nvtx installed, NVTX_DISABLE unset) and traced with -t nvtx?")
    decodes = _outermost(nvtx[nvtx["name"] == ranges.DECODE]).sort_values("start").reset_index(drop=True)
    steps["decode_row"] = _enclosing(steps, decodes)
    phases = nvtx[nvtx["name"].isin(PHASES)].copy()
    phases["step_row"] = _enclosing(phases, steps)
    phases = phases[phases["step_row"] >= 0]
    index = steps.index

    def per_step(values: pd.Series, rows: pd.Series, fill=0):
        return values.groupby(rows).sum().reindex(index, fill_value=fill)

    out = pd.DataFrame(index=index)
    out["decode"] = steps["decode_row"]
    out["batch"] = steps["decode_row"].map(decodes["payload"]).astype("Int64")
    out["step"] = steps["payload"].astype("Int64")
    out["wall_us"] = (steps["end"] - steps["start"]) / 1e3
    phase_us = (phases.assign(us=(phases["end"] - phases["start"]) / 1e3)
                .pivot_table(index="step_row", columns="name", values="us", aggfunc="sum"))
    for p in PHASES:
        out[_phase_column(p)] = phase_us[p].reindex(index) if p in phase_us else np.nan
    seen = phases.groupby("step_row")["name"].agg(set)
    out["polled"] = [bool(seen.get(i, set()) & set(POLL_PHASES)) for i in index]

    # Mode per decode, from the phases of all its steps.
    modes = {}
    for d, rows in out.groupby("decode").groups.items():
        names = set().union(*[seen.get(i, set()) for i in rows])
        inferred = _mode_of(names)
        if mode is not None and inferred is not None and inferred != mode:
            raise ValueError(f"{path}: decode {d} has phases {sorted(names)}, which make it {inferred!r}, not the "
                             f"mode={mode!r} passed; drop mode= to use the inferred one")
        modes[d] = inferred or mode
    out["mode"] = out["decode"].map(modes)
    out["trace"] = trace

    # CUDA calls made on the step's thread while the step was open, and the device work they launched.
    runtime["step_row"] = _enclosing(runtime, steps)
    in_steps = runtime[runtime["step_row"] >= 0]
    # A launch recorded twice (a driver call inside the runtime call, same correlation id) joins once.
    launched = in_steps[["corr", "pid", "step_row"]].dropna(subset=["corr"]).drop_duplicates(["corr", "pid"])
    if device["pid"].notna().all() and len(device):
        work = device.merge(launched, on=["corr", "pid"])
    else:  # exports without globalPid on device records: correlation ids alone
        work = device.drop(columns="pid").merge(launched.drop(columns="pid").drop_duplicates("corr"), on="corr")
    # Waits and launches are counted on outermost calls: a driver call inside a runtime call is the same wait.
    calls = _outermost(in_steps).sort_values(["tid", "start"])
    work["us"] = (work["end"] - work["start"]) / 1e3

    # Blocking waits: synchronize calls, and copies to pageable host memory (torch's .item() waits inside
    # cudaMemcpyAsync, then calls cudaStreamSynchronize: one wait, counted once).
    to_pageable = work[(work["kind"] == "memcpy") & (work["copy_kind"] == COPY_DTOH)
                       & work["dst_kind"].isin([MEMORY_PAGEABLE, np.nan])]["corr"]
    copy_wait = calls["corr"].isin(set(to_pageable))
    sync = calls["name"].isin(SYNC_CALLS)
    blocking = sync | copy_wait
    follows_copy = copy_wait.groupby(calls["tid"]).shift(1, fill_value=False).astype(bool)
    out["sync_us"] = per_step((calls["end"] - calls["start"]).where(blocking, 0), calls["step_row"]) / 1e3
    out["syncs"] = per_step(copy_wait | (sync & ~follows_copy), calls["step_row"]).astype(int)
    out["host_us"] = out["wall_us"] - out["sync_us"]
    out["graph_launches"] = per_step(calls["name"].isin(GRAPH_LAUNCH_CALLS), calls["step_row"]).astype(int)

    compute = work[work["kind"].isin(("kernel", "graph"))]
    copies = work[work["kind"].isin(("memcpy", "memset"))]
    out["kernels"] = per_step(compute["kind"] == "kernel", compute["step_row"]).astype(int)
    out["graphs"] = per_step(compute["kind"] == "graph", compute["step_row"]).astype(int)
    out["device_busy_us"] = per_step(compute["us"], compute["step_row"], 0.0)
    by = compute.groupby("step_row")
    out["kernel_span_us"] = (by["end"].max() - by["start"].min()).reindex(index) / 1e3
    out["copies"] = copies.groupby("step_row").size().reindex(index, fill_value=0).astype(int)
    out["copy_us"] = per_step(copies["us"], copies["step_row"], 0.0)
    out["d2h"] = per_step(copies["copy_kind"] == COPY_DTOH, copies["step_row"]).astype(int)

    # The device timeline across steps, copies included, in step order within a decode: the last device end
    # among the earlier steps (steps without device work carry it over).
    dev_first = work.groupby("step_row")["start"].min().reindex(index)
    dev_last = work.groupby("step_row")["end"].max().reindex(index)
    ordered = pd.DataFrame({"decode": out["decode"], "start": steps["start"], "last": dev_last}).sort_values(
        ["decode", "start"])
    prev_last = ordered.groupby("decode")["last"].transform(lambda v: v.cummax().ffill().shift(1)).reindex(index)
    # CUDA events recorded at the step's start and end: the GPU reaches the first one when the host records it
    # or when earlier work drains, whichever is later.
    begin = np.fmax(steps["start"].astype("float64"), prev_last)
    out["device_span_us"] = (dev_last - begin) / 1e3
    out["gpu_idle_us"] = out["device_span_us"] - out["device_busy_us"]
    out["gpu_gap_us"] = (dev_first - prev_last) / 1e3
    out["step_start_us"] = (steps["start"] - out["decode"].map(decodes["start"])) / 1e3

    out = out[list(STEP_COLUMNS)].sort_values(["decode", "step"]).reset_index(drop=True)
    out.attrs.update(path=str(path), trace=trace)
    return out


def totals(path, domain: str = ranges.DOMAIN) -> dict:
    """The export's totals by direct SQL, independent of `read`: host time in step and decode ranges (outermost
    per thread), and device time (kernels + graph executions) of work launched inside step ranges and in the
    whole export. µs."""
    with _connect(path) as con:
        tables = _tables(con)
        cols = _columns(con, "NVTX_EVENTS")
        text = "coalesce(n.text, (select value from StringIds where id = n.textId))" if "textId" in cols else "n.text"
        dom = ""
        if "domainId" in cols and "eventType" in cols and con.execute(
                "select 1 from NVTX_EVENTS where eventType = ? limit 1", (NVTX_DOMAIN_CREATE,)).fetchone():
            name = ("coalesce(d.text, (select value from StringIds where id = d.textId))" if "textId" in cols
                    else "d.text")
            dom = (f"and exists (select 1 from NVTX_EVENTS d where d.eventType = {NVTX_DOMAIN_CREATE} "
                   f"and {name} = '{domain}' and d.domainId = n.domainId "
                   f"and d.globalTid / 16777216 = n.globalTid / 16777216)")
        kinds = f"n.eventType in ({NVTX_PUSH_POP}, {NVTX_START_END})" if "eventType" in cols else "1"

        def outermost(name):
            return (f"named as (select n.start, n.\"end\", n.globalTid from NVTX_EVENTS n where {kinds} "
                    f"and n.\"end\" is not null and {text} = '{name}' {dom}), "
                    f"outer_ranges as (select * from named a where not exists (select 1 from named b where "
                    f"b.globalTid = a.globalTid and b.start <= a.start and b.\"end\" >= a.\"end\" "
                    f"and (b.start < a.start or b.\"end\" > a.\"end\")))")

        result = {}
        for key, name in (("step", ranges.STEP), ("decode", ranges.DECODE)):
            n, ns = con.execute(f"with {outermost(name)} select count(*), coalesce(sum(\"end\" - start), 0) "
                                f"from outer_ranges").fetchone()
            result[f"{key}_ranges"], result[f"{key}_host_us"] = n, ns / 1e3
        step_kernel_us, all_kernel_us, step_kernels = 0.0, 0.0, 0
        launches = (f"with {outermost(ranges.STEP)}, launches as (select distinct r.correlationId as corr, "
                    f"r.globalTid / 16777216 as pid from CUPTI_ACTIVITY_KIND_RUNTIME r join outer_ranges s "
                    f"on s.globalTid = r.globalTid and r.start between s.start and s.\"end\")")
        for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE"):
            if table not in tables:
                continue
            pid = "and l.pid = k.globalPid / 16777216" if "globalPid" in _columns(con, table) else ""
            skip = ""
            if table.endswith("GRAPH_TRACE") and "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
                skip = "and k.correlationId not in (select correlationId from CUPTI_ACTIVITY_KIND_KERNEL)"
            n, ns = con.execute(f"{launches} select count(*), coalesce(sum(k.\"end\" - k.start), 0) from {table} k "
                                f"join launches l on l.corr = k.correlationId {pid} where 1 {skip}").fetchone()
            step_kernel_us += ns / 1e3
            if table.endswith("KERNEL"):
                step_kernels += n
            (ns,) = con.execute(f"select coalesce(sum(k.\"end\" - k.start), 0) from {table} k "
                                f"where 1 {skip}").fetchone()
            all_kernel_us += ns / 1e3
        result.update(step_kernel_us=step_kernel_us, step_kernels=step_kernels, all_kernel_us=all_kernel_us)
    return result


def check_totals(df: pd.DataFrame, path, rel: float = 1e-9) -> dict:
    """Assert that `df` (from `read(path)`) adds up to the export's totals (see `totals`); returns the totals.

    Per-step host time sums to the step ranges' total and fits inside the decode ranges; per-step
    busy time sums to the device time of work launched inside step ranges, which fits inside all
    the device time in the export."""
    t = totals(path)

    def close(a, b):
        return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)

    problems = []
    if len(df) != t["step_ranges"]:
        problems.append(f"{len(df)} step rows but {t['step_ranges']} step ranges")
    if not close(df["wall_us"].sum(), t["step_host_us"]):
        problems.append(f"wall_us sums to {df['wall_us'].sum():.3f} but step ranges total {t['step_host_us']:.3f}")
    if t["decode_ranges"] and df["wall_us"].sum() > t["decode_host_us"] * (1 + rel):
        problems.append(f"steps take {df['wall_us'].sum():.3f} µs, more than their decode ranges "
                        f"({t['decode_host_us']:.3f} µs)")
    if not close(df["device_busy_us"].sum(), t["step_kernel_us"]):
        problems.append(f"device_busy_us sums to {df['device_busy_us'].sum():.3f} but kernels launched in step "
                        f"ranges total {t['step_kernel_us']:.3f}")
    if int(df["kernels"].sum()) != t["step_kernels"]:
        problems.append(f"{int(df['kernels'].sum())} kernels counted but {t['step_kernels']} launched in steps")
    if t["step_kernel_us"] > t["all_kernel_us"] * (1 + rel):
        problems.append("device time inside steps exceeds the export's total")
    if ((df["host_us"] < -rel) | (df["sync_us"] > df["wall_us"] * (1 + rel))).any():
        problems.append("blocking calls take longer than their step")
    if problems:
        raise AssertionError(f"{path}: per-step figures do not add up: " + "; ".join(problems))
    return t


# --------------------------------------------------------------------------------------------
# Summaries and pictures

SUMMARY_KEYS = ("model", "batch", "mode", "trace", "settings")
_MEDIANS = ("wall_us", "host_us", "sync_us", "device_busy_us", "device_span_us", "gpu_idle_us", "gpu_gap_us",
            "kernel_span_us", "copy_us", "kernels", "graphs")
_BANDS = ("wall_us", "host_us", "device_busy_us", "device_span_us")
_PER_TOKEN = ("wall_us", "host_us", "device_busy_us", "device_span_us", "gpu_idle_us")


def summary(df: pd.DataFrame, decode: str = "last") -> pd.DataFrame:
    """One row per model x batch x mode x trace: medians per step, a p20-p80 band for the main times, and
    per-token figures (total over steps / (steps x batch), as in `gdtool.timing`; each step makes one token
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
    """`summary` rows with the per-token columns `gdtool.timing.per_token` gives, so the two plot and
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

    ``inproc``: rows of `gdtool.timing.per_token` (or `timing.per_token_table`) with model, mode, batch;
    ``traced``: rows of `per_token` (or `load_sessions`) with model, mode, batch, trace. Modes and batch
    sizes nsys did not record are left out."""
    for what, table, need in (("in-process", inproc, {"model", "mode", "batch"}),
                              ("nsys", traced, {"model", "mode", "batch", "trace"})):
        if not need <= set(table.columns):
            raise ValueError(f"the {what} table lacks {sorted(need - set(table.columns))}: pass "
                             + ("rows of gdtool.timing.per_token" if what == "in-process" else
                                "an nsys session's summary.csv, or gdtool.nsys.load_sessions(...)"))
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
    order = list(MODES) + ["device-loop"]
    table = table.sort_values(["batch", "mode"], key=lambda c: c.map(order.index) if c.name == "mode" else c)
    table = table.reset_index(drop=True)
    table.attrs["model"] = model
    return table


def timeline(path, decode: int = -1, first_step: int = 1, steps: int = 4, domain: str = ranges.DOMAIN) -> pd.DataFrame:
    """Intervals of a few steps for a picture: lane ('host' for ranges, 'gpu' for device work), name, step,
    start_us and end_us relative to the first step's start."""
    df = read(path, domain=domain)
    decodes = sorted(df["decode"].unique())
    d = decodes[decode]
    with _connect(path) as con:
        nvtx = _ranges(con, domain)
        runtime = _runtime(con)
        device = _device(con)
    step_rows = _outermost(nvtx[nvtx["name"] == ranges.STEP])
    dec = _outermost(nvtx[nvtx["name"] == ranges.DECODE]).sort_values("start").reset_index(drop=True)
    step_rows = step_rows[_enclosing(step_rows, dec) == d]
    step_rows = step_rows[(step_rows["payload"] >= first_step) & (step_rows["payload"] < first_step + steps)]
    if step_rows.empty:
        raise ValueError(f"{path}: decode {d} has no steps {first_step}..{first_step + steps - 1}")
    inner = nvtx[nvtx["name"].isin(PHASES)].copy()
    inner["row"] = _enclosing(inner, step_rows)
    inner = inner[inner["row"] >= 0]
    inner["step"] = inner["row"].map(step_rows["payload"])
    runtime["row"] = _enclosing(runtime, step_rows)
    launched = runtime.loc[runtime["row"] >= 0, ["corr", "pid", "row"]]
    work = device.merge(launched, on=["corr", "pid"], how="inner") if device["pid"].notna().all() \
        else device.drop(columns="pid").merge(launched.drop(columns="pid"), on="corr")
    work["step"] = work["row"].map(step_rows["payload"])
    t0 = step_rows["start"].min()
    parts = [pd.DataFrame({"lane": "host", "name": ranges.STEP, "step": step_rows["payload"],
                           "start_us": (step_rows["start"] - t0) / 1e3, "end_us": (step_rows["end"] - t0) / 1e3}),
             pd.DataFrame({"lane": "host", "name": inner["name"], "step": inner["step"],
                           "start_us": (inner["start"] - t0) / 1e3, "end_us": (inner["end"] - t0) / 1e3}),
             pd.DataFrame({"lane": "gpu", "name": work["kind"], "step": work["step"],
                           "start_us": (work["start"] - t0) / 1e3, "end_us": (work["end"] - t0) / 1e3})]
    return pd.concat(parts, ignore_index=True).sort_values(["lane", "start_us"]).reset_index(drop=True)


def plot_steps(df: pd.DataFrame, decode: str = "last", axes=None):
    """Per step, one panel per mode: the host's wall time (own work + waits) next to the GPU's device span
    (busy + idle), in µs. `df`: one batch and trace. Returns (fig, axes)."""
    import matplotlib.pyplot as plt
    combos = df[["batch", "trace"]].drop_duplicates()
    if len(combos) > 1:
        raise ValueError(f"plot_steps draws one batch and trace at a time, got {combos.to_dict('records')}; "
                         f"pass e.g. df[(df.batch == 1) & (df.trace == 'graph')]")
    if decode == "last":
        df = df[df["decode"] == df.groupby("mode")["decode"].transform("max")]
    modes = [m for m in MODES if m in set(df["mode"])] or sorted(df["mode"].dropna().unique())
    if axes is None:
        fig, axes = plt.subplots(len(modes), 1, figsize=(10.5, 2.4 * len(modes)), sharex=True, squeeze=False,
                                 layout="constrained")
        axes = axes[:, 0]
    else:
        axes = np.atleast_1d(axes)
        fig = axes[0].figure
    for a, m in zip(axes, modes):
        g = df[df["mode"] == m].sort_values("step")
        x = g["step"].to_numpy(dtype=float)
        a.bar(x - 0.2, g["host_us"], width=0.4, color="tab:blue", label="host work")
        a.bar(x - 0.2, g["sync_us"], width=0.4, bottom=g["host_us"], color="tab:blue", alpha=0.35,
              label="host waits (syncs)")
        a.bar(x + 0.2, g["device_busy_us"], width=0.4, color="tab:green", label="GPU busy")
        a.bar(x + 0.2, g["gpu_idle_us"].fillna(0).clip(lower=0), width=0.4, bottom=g["device_busy_us"],
              color="tab:red", alpha=0.6, label="GPU idle (device span - busy)")
        for s in g.loc[g["polled"], "step"]:
            a.axvline(s, color="0.5", lw=0.6, ls=":")
        a.set_ylabel("µs / step")
        a.set_title(f"{m} (batch {g['batch'].iloc[0]}, --cuda-graph-trace={g['trace'].iloc[0]})", fontsize=9)
        a.grid(alpha=0.3)
    # outside the axes, clear of the bars
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="per decode step",
                   title_fontsize=8, borderaxespad=0.0)
    axes[-1].set_xlabel("decode step (dotted: the host polls EOS)")
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    return fig, axes


def plot_timeline(intervals: pd.DataFrame, ax=None, title: str | None = None):
    """A mini timeline from `timeline(...)`: host ranges above, device work below. Returns (fig, ax)."""
    import matplotlib.pyplot as plt
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 2.2))
    else:
        fig = ax.figure
    colors = {ranges.STEP: "0.85", ranges.FORWARD: "tab:blue", ranges.SELECT: "tab:orange",
              ranges.UPDATE: "tab:purple", ranges.EOS_CHECK: "tab:red", ranges.REPLAY: "tab:cyan",
              ranges.EOS_POLL: "tab:red", "kernel": "tab:green", "graph": "darkgreen", "memcpy": "tab:olive",
              "memset": "tab:olive"}
    # (y, height, z): step ranges behind the phases inside them; device work on its own lane.
    lanes = {("host", True): (2.0, 0.8, 1), ("host", False): (2.1, 0.6, 2), ("gpu", False): (0.5, 0.8, 2)}
    for (lane, is_step), g in intervals.groupby([intervals["lane"], intervals["name"] == ranges.STEP]):
        y, h, z = lanes[(lane, is_step)]
        for name, gg in g.groupby("name"):
            ax.broken_barh(list(zip(gg["start_us"], gg["end_us"] - gg["start_us"])), (y, h), zorder=z,
                           facecolors=colors.get(name, "0.5"), edgecolor="white", linewidth=0.3, label=name)
    ax.set_yticks([0.9, 2.4], ["GPU", "host"])
    ax.set_xlabel("µs from the first step's start")
    _legend(ax, [ax])
    ax.grid(alpha=0.3, axis="x")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, ax


def _legend(ax, axes):
    """One legend, below `ax`, for the labels of all `axes`."""
    unique = {}
    for a in axes:
        for handle, label in zip(*a.get_legend_handles_labels()):
            unique.setdefault(label, handle)
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=min(len(unique), 8), loc="upper center",
              bbox_to_anchor=(0.5, -0.35), title="range / device work", title_fontsize=7)


def plot_timelines(paths, first_step: int = 20, steps: int = 3):
    """Mini timelines of the same steps from several exports (one mode each), stacked on one time axis.
    Returns (fig, axes)."""
    import matplotlib.pyplot as plt
    paths = list(paths)
    fig, axes = plt.subplots(len(paths), 1, figsize=(10, 1.9 * len(paths) + 0.8), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, path in zip(axes, paths):
        df = read(path)
        last = df[df["decode"] == df["decode"].max()]
        label = f"{last['mode'].iloc[0]}, batch {last['batch'].iloc[0]}, trace={last['trace'].iloc[0]}"
        plot_timeline(timeline(path, first_step=first_step, steps=steps), ax=ax, title=label)
        if ax is not axes[-1]:
            ax.get_legend().remove()
            ax.set_xlabel("")
    _legend(axes[-1], axes)
    fig.tight_layout()
    return fig, axes


# --------------------------------------------------------------------------------------------
# Recording sessions


@dataclasses.dataclass(frozen=True)
class RunConfig(results.Config):
    """One profiled decode: its name (``llama-1b_b1_eager_graph``) names the files it writes; ``hash``
    as every run config has it (`gdtool.record.Config`)."""
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


def parse_name(name: str) -> dict:
    """Inverse of `RunConfig.name` for its leading fields: model, batch, mode, trace."""
    stem = Path(name).name.split(".sqlite")[0]
    m = re.match(r"^(?P<model>[^_]+)_b(?P<batch>\d+)_(?P<mode>[a-z-]+)_(?P<trace>graph|node)(?:_|$)", stem)
    if not m:
        raise ValueError(f"{name!r} is not named <model>_b<batch>_<mode>_<trace>[...]; name exports as "
                         f"RunConfig.name does")
    return dict(m.groupdict(), batch=int(m["batch"]))


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


def target_command(cfg: RunConfig) -> list[str]:
    """The profiled program: `repeat` decodes of one config in a fresh Python (the last is the one to read)."""
    args = ["--model", cfg.model, "--mode", cfg.mode, "--batch", str(cfg.batch), "--max-new-tokens",
            str(cfg.max_new_tokens), "--prompt-len", str(cfg.prompt_len), "--repeat", str(cfg.repeat),
            "--seed", str(cfg.seed)] + ([] if cfg.eos else ["--no-eos"])
    for k, v in cfg.settings:
        args += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return [sys.executable, "-c", "import sys, gdtool.nsys as n; sys.exit(n.target(sys.argv[1:]))", *args]


def profile_command(nsys: str, cfg: RunConfig, report: Path) -> list[str]:
    # --sample/--cpuctxsw off: with them a short decode writes gigabytes of raw data.
    return [nsys, "profile", "-t", "cuda,nvtx", "--sample=none", "--cpuctxsw=none",
            f"--cuda-graph-trace={cfg.trace}", "-o", str(report), "--force-overwrite", "true", *target_command(cfg)]


def export_command(nsys: str, report: Path, sqlite_path: Path) -> list[str]:
    return [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "-o", str(sqlite_path), str(report)]


def target(argv: list[str]) -> int:
    """The program nsys profiles: load a model, run `repeat` decodes with gdtool's ranges on, print a JSON line."""
    p = argparse.ArgumentParser(prog="gdtool.nsys target")
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

    import gdtool
    settings = _parse_settings(a.set)
    if a.no_eos:
        settings["eos_token_id"] = None
    model = gdtool.load_model(a.model, seed=0)
    if settings.pop("fuse_projections", False) and not gdtool.fast_fuse.fuse_projections(model):
        # not a decode argument: the bench's --fuse-projections
        raise SystemExit(f"fuse_projections=true: {a.model} has no q/k/v or gate/up projections to fuse; drop it")
    prompt = gdtool.random_prompts(model, batch=a.batch, lengths=(a.prompt_len, a.prompt_len), seed=a.seed)
    results = []
    for r in range(a.repeat):
        out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=a.mode,
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


def environment(nsys: str | None = None) -> dict:
    """The sidecar of every result file: the environment record of `gdtool.record`, with nsys's version."""
    return results.environment(nsys=nsys)


def _run_text(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def slim(src, dst) -> Path:
    """Copy an export keeping only the tables `read` and its tests use, vacuumed and gzipped: a test fixture."""
    dst = Path(dst)
    with _connect(src) as con, tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "slim.sqlite"
        out = sqlite3.connect(plain)
        for table, sql in con.execute("select name, sql from sqlite_master where type = 'table'").fetchall():
            if table not in KEEP_TABLES or sql is None:
                continue
            out.execute(sql)
            rows = con.execute(f"select * from {table}").fetchall()
            if rows:
                out.executemany(f"insert into {table} values ({','.join('?' * len(rows[0]))})", rows)
        out.commit()
        out.execute("vacuum")
        out.close()
        with open(plain, "rb") as f, gzip.open(dst, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
    return dst


def record(cfg: RunConfig, out: Path, nsys: str | None = None, keep_report: bool = False, fixture: bool = False,
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
    results.write_sidecar(out / "env.json", environment(nsys), session=dict(configs=[c.name for c in configs]))
    steps_file = results.Results(out / "steps.csv", dtype={"model": str, "mode": str, "trace": str, "settings": str},
                                 first=())
    from .options import progress as bar_for
    bar = bar_for(len(configs), "nsys", progress, unit="config")
    try:
        for cfg in configs:
            if not redo and steps_file.count(cfg)[0] and (out / f"{cfg.name}.sqlite.gz").exists():
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


def summarize_exports(paths) -> pd.DataFrame:
    """`summary` of each export, one row per export, with the columns its name gives (``file``, ``config``,
    ``model``, ``batch``, ``mode``, ``trace``, and ``implementation``: decode's kernels, 'compiled' where the
    recording's settings said so, else 'hf'); an export not named as `RunConfig.name` names them gets
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
