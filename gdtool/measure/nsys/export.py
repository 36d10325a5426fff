"""Read an Nsight Systems sqlite export as one row per decode step (`read`), and check it (`check_totals`).

The columns and how each is measured are in the package docstring (`gdtool.measure.nsys`). Besides `read`:
`totals` (the export's own sums, for `check_totals`), `timeline` (the intervals of a few steps, for a
picture), `parse_name` (the config an export's file name gives) and `slim` (a small copy for tests/data/).

    from gdtool.measure.nsys import export
    df = export.read("my-session/llama-1b_b1_eager_graph_noeos.sqlite.gz")
    export.check_totals(df, "my-session/llama-1b_b1_eager_graph_noeos.sqlite.gz")
"""
from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from ...core import ranges
from ...core.modes import HOST_STEPPED_MODES

# the modes an export has one row per step of: those whose steps the host runs (the device loop runs its steps
# in one launch, no range per step)
MODES = HOST_STEPPED_MODES
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


def parse_name(name: str) -> dict:
    """Inverse of `TraceConfig.name` for its leading fields: model, batch, mode, trace."""
    stem = Path(name).name.split(".sqlite")[0]
    m = re.match(r"^(?P<model>[^_]+)_b(?P<batch>\d+)_(?P<mode>[a-z-]+)_(?P<trace>graph|node)(?:_|$)", stem)
    if not m:
        raise ValueError(f"{name!r} is not named <model>_b<batch>_<mode>_<trace>[...]; name exports as "
                         f"TraceConfig.name does")
    return dict(m.groupdict(), batch=int(m["batch"]))


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
