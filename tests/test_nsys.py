"""gdtool.measure.nsys: reading Nsight Systems sqlite exports into one row per decode step.

Synthetic exports use the table and column names of real ones (Nsight Systems' SQLite schema
reference) with hand-computed answers; real exports from a GPU, committed under tests/data/ as
<model>_b<batch>_<mode>_<trace>.sqlite.gz, are checked against their own totals.
"""
from __future__ import annotations

import gzip
import json
import random
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gdtool.measure import nsys
from gdtool.measure.nsys import export, recording

DATA = Path(__file__).parent / "data"
# node-trace fixtures (tiny-llama) and the graph-trace sessions of profiles/h200 (llama-1b), all from the H200
REAL_EXPORTS = sorted(DATA.glob("*.sqlite.gz")) + sorted((DATA.parent.parent / "profiles" / "h200" / "nsys-graph")
                                                          .glob("*.sqlite.gz"))

# Real column lists (nsys export --type sqlite); the reader must cope with any subset.
SCHEMA = {
    "StringIds": "id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL",
    "ENUM_NSYS_EVENT_TYPE": "id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT",
    "META_DATA_CAPTURE": "name TEXT NOT NULL, value TEXT",
    "NVTX_EVENTS": "start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER, "
                   "category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, "
                   "textId INTEGER, domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, "
                   "uint32Value INTEGER, int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL, "
                                   "globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, "
                                   "returnValue INTEGER NOT NULL, callchainId INTEGER",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, "
                                  "mangledName INTEGER, launchType INTEGER, cacheConfig INTEGER, "
                                  "registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, "
                                  "gridY INTEGER NOT NULL, "
                                  "gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, "
                                  "blockZ INTEGER NOT NULL, staticSharedMemory INTEGER NOT NULL, "
                                  "dynamicSharedMemory INTEGER NOT NULL, localMemoryPerThread INTEGER NOT NULL, "
                                  "localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL, "
                                  "sharedMemoryExecuted INTEGER, graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER",
    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                       "contextId INTEGER NOT NULL, greenContextId INTEGER, streamId INTEGER NOT NULL, "
                                       "correlationId INTEGER, globalPid INTEGER, graphId INTEGER NOT NULL, "
                                       "graphExecId INTEGER NOT NULL",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL, "
                                  "deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER, srcDeviceId INTEGER, "
                                  "srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, "
                                  "migrationCause INTEGER, graphNodeId INTEGER, virtualAddress INTEGER",
    "CUPTI_ACTIVITY_KIND_MEMSET": "start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL, "
                                  "contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, "
                                  "globalPid INTEGER, value INTEGER NOT NULL, bytes INTEGER NOT NULL, "
                                  "graphNodeId INTEGER, memKind INTEGER",
}
EVENT_TYPES = [(33, "NvtxCategory"), (34, "NvtxMark"), (39, "NvtxThread"), (59, "NvtxPushPopRange"),
               (60, "NvtxStartEndRange"), (75, "NvtxDomainCreate"), (76, "NvtxDomainDestroy")]

# A serialized GlobalId: high bits (hardware/VM), then pid << 24, then tid.
HIGH = 1 << 48
PID = 4242
MAIN = HIGH | (PID << 24) | PID
WORKER = MAIN + 1
GPID = HIGH | (PID << 24)
GDTOOL_DOMAIN, OTHER_DOMAIN = 1, 2


class Export:
    """Writes a synthetic nsys export: the gdtool domain, ranges, CUDA calls and the device work they launch."""

    def __init__(self, path: Path, trace: str | None = "node", drop: dict | None = None):
        self.path = path
        self.con = sqlite3.connect(path)
        self.drop = drop or {}  # table -> columns to leave out (older/newer nsys)
        self.cols = {}
        for table, spec in SCHEMA.items():
            if self.drop.get(table) == "*":
                continue
            parts = [p.strip() for p in spec.split(", ")]
            parts = [p for p in parts if p.split()[0] not in self.drop.get(table, ())]
            self.cols[table] = [p.split()[0] for p in parts]
            self.con.execute(f"create table {table} ({', '.join(parts)})")
        self.strings = {}
        self.corr = 1000
        if "ENUM_NSYS_EVENT_TYPE" in self.cols:
            self.con.executemany("insert into ENUM_NSYS_EVENT_TYPE values (?, ?, ?)",
                                 [(i, n, n) for i, n in EVENT_TYPES])
        if trace and "META_DATA_CAPTURE" in self.cols:
            self.insert("META_DATA_CAPTURE", name="CUDA_GRAPH_TRACE_OPTIONS:MODE", value=trace)
        self.insert("NVTX_EVENTS", start=1, eventType=75, text="gdtool", globalTid=MAIN, domainId=GDTOOL_DOMAIN)
        self.insert("NVTX_EVENTS", start=2, eventType=75, text="other", globalTid=MAIN, domainId=OTHER_DOMAIN)

    def insert(self, table, **values):
        if table not in self.cols:
            return
        cols = [c for c in values if c in self.cols[table]]
        self.con.execute(f"insert into {table} ({', '.join(cols)}) values ({', '.join('?' * len(cols))})",
                         [values[c] for c in cols])

    def string(self, value: str) -> int:
        if value not in self.strings:
            self.strings[value] = len(self.strings) + 1
            self.insert("StringIds", id=self.strings[value], value=value)
        return self.strings[value]

    def range(self, name, start, end, payload=None, tid=MAIN, domain=GDTOOL_DOMAIN, registered=True):
        registered = registered and "textId" in self.cols["NVTX_EVENTS"]
        self.insert("NVTX_EVENTS", start=start, end=end, eventType=59, globalTid=tid, endGlobalTid=tid,
                    domainId=domain, text=None if registered else name,
                    textId=self.string(name) if registered else None, int64Value=payload)

    def call(self, name, start, end, tid=MAIN, corr=None) -> int:
        if corr is None:
            self.corr += 1
            corr = self.corr
        self.insert("CUPTI_ACTIVITY_KIND_RUNTIME", start=start, end=end, eventClass=1, globalTid=tid,
                    correlationId=corr, nameId=self.string(name), returnValue=0)
        return corr

    def kernel(self, corr, start, end, node=None, gpid=GPID):
        name = self.string("kernel")
        self.insert("CUPTI_ACTIVITY_KIND_KERNEL", start=start, end=end, deviceId=0, contextId=1, streamId=7,
                    correlationId=corr, globalPid=gpid, demangledName=name, shortName=name, registersPerThread=32,
                    gridX=1, gridY=1, gridZ=1, blockX=128, blockY=1, blockZ=1, staticSharedMemory=0,
                    dynamicSharedMemory=0, localMemoryPerThread=0, localMemoryTotal=0, gridId=corr,
                    graphNodeId=node)

    def graph(self, corr, start, end):
        self.insert("CUPTI_ACTIVITY_KIND_GRAPH_TRACE", start=start, end=end, deviceId=0, contextId=1, streamId=7,
                    correlationId=corr, globalPid=GPID, graphId=1, graphExecId=1)

    def memcpy(self, corr, start, end, kind, dst=None):
        self.insert("CUPTI_ACTIVITY_KIND_MEMCPY", start=start, end=end, deviceId=0, contextId=1, streamId=7,
                    correlationId=corr, globalPid=GPID, bytes=8, copyKind=kind, dstKind=dst)

    def launch(self, start, kernel_start, kernel_end, tid=MAIN):
        self.kernel(self.call("cudaLaunchKernel_v7000", start, start + 5, tid), kernel_start, kernel_end)

    def close(self) -> Path:
        self.con.commit()
        self.con.close()
        return self.path


def eager(ex: Export, t0: int = 0) -> None:
    """An eager decode at batch 2, two steps; expected numbers in EAGER."""
    ex.range("decode", t0, t0 + 10_000, payload=2)
    ex.range("prefill", t0 + 100, t0 + 1000)
    ex.launch(t0 + 200, t0 + 300, t0 + 900)  # prefill work: in no step
    ex.range("step", t0 + 1000, t0 + 2000, payload=1)
    ex.range("forward", t0 + 1010, t0 + 1500)
    ex.launch(t0 + 1020, t0 + 1100, t0 + 1300)
    ex.launch(t0 + 1200, t0 + 1350, t0 + 1400)
    ex.range("select", t0 + 1500, t0 + 1700)
    ex.launch(t0 + 1510, t0 + 1420, t0 + 1480)
    ex.range("update", t0 + 1700, t0 + 1800)
    ex.memcpy(ex.call("cudaMemcpyAsync_v3020", t0 + 1710, t0 + 1715), t0 + 1720, t0 + 1730, kind=1)
    ex.range("eos-check", t0 + 1800, t0 + 1990)
    # .item(): a copy to pageable memory (blocks), then a stream synchronize: one wait
    ex.memcpy(ex.call("cudaMemcpyAsync_v3020", t0 + 1810, t0 + 1815), t0 + 1820, t0 + 1825, kind=2, dst=1)
    ex.call("cudaStreamSynchronize_v3020", t0 + 1830, t0 + 1980)
    ex.range("step", t0 + 2000, t0 + 3000, payload=2)
    ex.range("forward", t0 + 2010, t0 + 2500)
    ex.range("step", t0 + 2050, t0 + 2060, payload=99, domain=OTHER_DOMAIN, registered=False)  # not ours
    ex.launch(t0 + 2020, t0 + 2100, t0 + 2400)
    ex.launch(t0 + 2100, t0 + 2410, t0 + 2420, tid=WORKER)  # another thread: not this step's
    ex.range("select", t0 + 2500, t0 + 2700)
    ex.launch(t0 + 2510, t0 + 2600, t0 + 3200)  # runs past the step's end: still the step's
    ex.range("update", t0 + 2700, t0 + 2800)


EAGER = pd.DataFrame({
    "step": [1, 2], "batch": [2, 2], "mode": ["eager", "eager"], "polled": [True, False],
    "wall_us": [1.0, 1.0], "sync_us": [0.155, 0.0], "host_us": [0.845, 1.0], "syncs": [1, 0],
    "forward_us": [0.49, 0.49], "select_us": [0.2, 0.2], "update_us": [0.1, 0.1], "eos_check_us": [0.19, np.nan],
    "graph_launches": [0, 0], "kernels": [3, 2], "graphs": [0, 0], "device_busy_us": [0.31, 0.9],
    "kernel_span_us": [0.38, 1.1], "device_span_us": [0.825, 1.2], "gpu_idle_us": [0.515, 0.3],
    "gpu_gap_us": [np.nan, 0.275], "copies": [2, 0], "copy_us": [0.015, 0.0], "d2h": [1, 0],
    "step_start_us": [1.0, 2.0]})


def forward_graph(ex: Export, t0: int = 0) -> None:
    """A forward-graph decode traced per node, batch 1; expected numbers in FORWARD_GRAPH."""
    ex.range("decode", t0, t0 + 5000, payload=1)
    ex.range("warm-up", t0 + 100, t0 + 300)
    ex.range("capture", t0 + 300, t0 + 900)
    ex.range("select", t0 + 400, t0 + 500)  # opened inside the capture: recorded once, in no step
    ex.range("step", t0 + 1000, t0 + 1400, payload=1)
    ex.range("replay", t0 + 1010, t0 + 1100)
    corr = ex.call("cudaGraphLaunch_v10000", t0 + 1020, t0 + 1090)
    for node, (s, e) in enumerate([(1100, 1200), (1210, 1300), (1305, 1400)], start=11):
        ex.kernel(corr, t0 + s, t0 + e, node=node)
    ex.range("select", t0 + 1100, t0 + 1300)
    ex.launch(t0 + 1150, t0 + 1410, t0 + 1420)
    ex.range("eos-check", t0 + 1300, t0 + 1390)
    ex.call("cudaStreamSynchronize_v3020", t0 + 1310, t0 + 1380)
    ex.range("step", t0 + 1500, t0 + 1600, payload=2)
    ex.range("replay", t0 + 1510, t0 + 1590)
    corr = ex.call("cudaGraphLaunch_v10000", t0 + 1520, t0 + 1580)
    for node, (s, e) in enumerate([(1600, 1700), (1700, 1800), (1800, 1900)], start=11):
        ex.kernel(corr, t0 + s, t0 + e, node=node)
    ex.range("select", t0 + 1590, t0 + 1599)
    ex.launch(t0 + 1595, t0 + 1900, t0 + 1910)


FORWARD_GRAPH = pd.DataFrame({
    "step": [1, 2], "batch": [1, 1], "mode": ["forward-graph"] * 2, "polled": [True, False],
    "wall_us": [0.4, 0.1], "sync_us": [0.07, 0.0], "host_us": [0.33, 0.1], "replay_us": [0.09, 0.08],
    "syncs": [1, 0], "graph_launches": [1, 1], "kernels": [4, 4], "graphs": [0, 0],
    "device_busy_us": [0.295, 0.31], "kernel_span_us": [0.32, 0.31], "device_span_us": [0.42, 0.41],
    "gpu_idle_us": [0.125, 0.1], "gpu_gap_us": [np.nan, 0.18]})


def step_graph(ex: Export, t0: int = 0) -> None:
    """A step-graph decode traced per graph, batch 16, polling at step 3; expected numbers in STEP_GRAPH."""
    ex.range("decode", t0, t0 + 5000, payload=16)
    ex.range("capture", t0 + 300, t0 + 900)
    steps = [(1000, 1050), (1060, 1100), (1110, 3600), (3600, 3650)]
    graphs = [(1040, 1900), (1900, 2700), (2700, 3500), (3660, 4460)]
    for j, ((s, e), (gs, ge)) in enumerate(zip(steps, graphs), start=1):
        ex.range("step", t0 + s, t0 + e, payload=j)
        ex.range("replay", t0 + s + 2, t0 + s + 40)
        ex.graph(ex.call("cudaGraphLaunch_v10000", t0 + s + 5, t0 + s + 30), t0 + gs, t0 + ge)
    ex.range("eos-poll", t0 + 1150, t0 + 3590)
    # the done flag into pinned memory: the copy call returns at once, the synchronize waits
    ex.memcpy(ex.call("cudaMemcpyAsync_v3020", t0 + 1160, t0 + 1170), t0 + 3500, t0 + 3505, kind=2, dst=2)
    ex.call("cudaStreamSynchronize_v3020", t0 + 1180, t0 + 3510)


STEP_GRAPH = pd.DataFrame({
    "step": [1, 2, 3, 4], "batch": [16] * 4, "mode": ["step-graph"] * 4, "polled": [False, False, True, False],
    "wall_us": [0.05, 0.04, 2.49, 0.05], "sync_us": [0.0, 0.0, 2.33, 0.0], "host_us": [0.05, 0.04, 0.16, 0.05],
    "replay_us": [0.038] * 4, "eos_poll_us": [np.nan, np.nan, 2.44, np.nan], "syncs": [0, 0, 1, 0],
    "d2h": [0, 0, 1, 0], "graph_launches": [1] * 4, "kernels": [0] * 4, "graphs": [1] * 4,
    "device_busy_us": [0.86, 0.8, 0.8, 0.8], "kernel_span_us": [0.86, 0.8, 0.8, 0.8],
    "device_span_us": [0.9, 0.8, 0.805, 0.86], "gpu_idle_us": [0.04, 0.0, 0.005, 0.06],
    "gpu_gap_us": [np.nan, 0.0, 0.0, 0.155]})


def build(tmp_path, name, *writers, trace="node", drop=None) -> Path:
    ex = Export(tmp_path / name, trace=trace, drop=drop)
    for i, w in enumerate(writers):
        w(ex, t0=i * 100_000)
    return ex.close()


def assert_matches(df: pd.DataFrame, expected: pd.DataFrame):
    got = df[expected.columns].reset_index(drop=True)
    pd.testing.assert_frame_equal(got, expected, check_dtype=False, check_exact=False, atol=1e-9)


def test_eager_steps_by_hand(tmp_path):
    df = nsys.read(build(tmp_path, "eager.sqlite", eager, trace=None))
    assert_matches(df, EAGER)
    assert list(df.columns) == list(nsys.STEP_COLUMNS)
    assert (df["trace"] == "none").all()  # no graph ran and the export does not say


def test_forward_graph_node_trace_joins_replay_kernels_by_correlation_id(tmp_path):
    df = nsys.read(build(tmp_path, "fg.sqlite", forward_graph, trace=None))
    assert_matches(df, FORWARD_GRAPH)
    assert (df["trace"] == "node").all()  # detected from the kernels' graph node ids


def test_step_graph_graph_trace_counts_graph_executions(tmp_path):
    df = nsys.read(build(tmp_path, "sg.sqlite", step_graph, trace=None))
    assert_matches(df, STEP_GRAPH)
    assert (df["trace"] == "graph").all()  # detected from the graph-level records


def test_modes_inferred_per_decode_and_trace_from_capture_metadata(tmp_path):
    path = build(tmp_path, "all.sqlite", eager, forward_graph, step_graph, trace="graph")
    df = nsys.read(path)
    assert df.groupby("decode")["mode"].first().tolist() == ["eager", "forward-graph", "step-graph"]
    assert (df["trace"] == "graph").all()
    for d, expected in enumerate((EAGER, FORWARD_GRAPH, STEP_GRAPH)):
        assert_matches(df[df["decode"] == d], expected)
    assert nsys.read(path, trace="node")["trace"].eq("node").all()


def test_mode_argument_is_checked_against_the_phases(tmp_path):
    path = build(tmp_path, "eager.sqlite", eager)
    assert nsys.read(path, mode="eager")["mode"].eq("eager").all()
    with pytest.raises(ValueError, match="make it 'eager'"):
        nsys.read(path, mode="step-graph")


def test_gzipped_export_reads_the_same(tmp_path):
    path = build(tmp_path, "sg.sqlite", step_graph)
    gz = tmp_path / "sg.sqlite.gz"
    with open(path, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    pd.testing.assert_frame_equal(nsys.read(path), nsys.read(gz))


def test_older_schema_without_optional_columns_and_tables(tmp_path):
    drop = {"NVTX_EVENTS": ("domainId", "textId", "endGlobalTid", "uint64Value", "jsonText", "jsonTextId"),
            "CUPTI_ACTIVITY_KIND_KERNEL": ("globalPid", "graphNodeId", "mangledName"),
            "CUPTI_ACTIVITY_KIND_RUNTIME": ("callchainId",),
            "CUPTI_ACTIVITY_KIND_MEMSET": "*", "CUPTI_ACTIVITY_KIND_GRAPH_TRACE": "*", "META_DATA_CAPTURE": "*"}
    path = build(tmp_path, "old.sqlite", eager, drop=drop)
    df = nsys.read(path)
    # Without domain ids the other library's "step" range (nested in step 2) is told apart by nesting only.
    assert_matches(df, EAGER)
    nsys.check_totals(df, path)


def test_totals_add_up_and_catch_a_mismatch(tmp_path):
    path = build(tmp_path, "all.sqlite", eager, forward_graph, step_graph)
    df = nsys.read(path)
    t = nsys.check_totals(df, path)
    assert t["step_ranges"] == 8
    assert t["step_kernel_us"] == pytest.approx(EAGER.device_busy_us.sum() + FORWARD_GRAPH.device_busy_us.sum()
                                                + STEP_GRAPH.device_busy_us.sum())
    assert t["all_kernel_us"] == pytest.approx(t["step_kernel_us"] + 0.6 + 0.01)  # + prefill + worker thread
    bad = df.copy()
    bad.loc[0, "device_busy_us"] += 0.001
    with pytest.raises(AssertionError, match="device_busy_us sums to"):
        nsys.check_totals(bad, path)
    with pytest.raises(AssertionError, match="step rows"):
        nsys.check_totals(df.iloc[1:], path)


def test_random_decodes_against_a_direct_computation(tmp_path):
    """Many steps, two threads, kernels that outlive their step: read() against sums made while generating."""
    rng = random.Random(7)
    ex = Export(tmp_path / "random.sqlite")
    expected = {}
    t = 0
    ex.range("decode", 0, 10**9, payload=4)
    for j in range(1, 61):
        start = t
        busy, count, first, last = 0, 0, None, None
        gpu = start + rng.randint(0, 3000)
        for _ in range(rng.randint(0, 12)):
            t += rng.randint(5, 200)
            dur = rng.randint(1, 500)
            gpu = max(gpu, t + 10) + rng.randint(0, 100)
            ex.launch(t, gpu, gpu + dur)
            busy, count = busy + dur, count + 1
            first, last = first if first is not None else gpu, gpu + dur
            gpu += dur
            if rng.random() < 0.3:  # a launch from another thread at the same time: never this step's
                ex.launch(t + 1, gpu + 1, gpu + 50, tid=WORKER)
        t += rng.randint(10, 300)
        ex.range("step", start, t, payload=j)
        expected[j] = (count, busy / 1e3, None if first is None else (last - first) / 1e3, (t - start) / 1e3)
        t += rng.randint(1, 500)
    df = nsys.read(ex.close()).set_index("step")
    for j, (count, busy, span, host) in expected.items():
        assert df.loc[j, "kernels"] == count
        assert df.loc[j, "device_busy_us"] == pytest.approx(busy)
        assert df.loc[j, "wall_us"] == pytest.approx(host)
        if span is None:
            assert np.isnan(df.loc[j, "kernel_span_us"])
        else:
            assert df.loc[j, "kernel_span_us"] == pytest.approx(span)
    nsys.check_totals(df.reset_index(), tmp_path / "random.sqlite")


def test_nested_driver_records_count_once(tmp_path):
    """A driver call recorded inside the runtime call that made it (same correlation id) is one launch, one wait."""
    ex = Export(tmp_path / "nested.sqlite")
    ex.range("decode", 0, 10_000, payload=1)
    ex.range("step", 100, 1000, payload=1)
    ex.range("forward", 110, 990)
    corr = ex.call("cudaLaunchKernel_v7000", 200, 260)
    ex.call("cuLaunchKernel", 210, 250, corr=corr)
    ex.kernel(corr, 300, 500)
    ex.call("cudaStreamSynchronize_v3020", 600, 900)
    ex.call("cuStreamSynchronize", 610, 890)
    path = ex.close()
    row = nsys.read(path).iloc[0]
    assert (row["kernels"], row["device_busy_us"], row["syncs"], row["sync_us"]) == (1, 0.2, 1, 0.3)
    assert nsys.check_totals(nsys.read(path), path)["step_kernel_us"] == pytest.approx(0.2)


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nsys export --type sqlite"):
        nsys.read(tmp_path / "missing.sqlite")
    (tmp_path / "junk.sqlite").write_text("not a database" * 100)
    with pytest.raises(ValueError, match="not an sqlite file"):
        nsys.read(tmp_path / "junk.sqlite")
    empty = Export(tmp_path / "nosteps.sqlite").close()
    with pytest.raises(ValueError, match="no 'step' ranges"):
        nsys.read(empty)
    no_cuda = build(tmp_path, "nocuda.sqlite", eager, drop={"CUPTI_ACTIVITY_KIND_RUNTIME": "*"})
    with pytest.raises(ValueError, match="-t cuda,nvtx"):
        nsys.read(no_cuda)


def test_summary_uses_the_last_decode_and_reports_per_token(tmp_path):
    df = nsys.read(build(tmp_path, "two.sqlite", eager, eager))
    s = nsys.summary(df)
    assert len(s) == 1 and s.loc[0, "steps"] == 2 and s.loc[0, "polls"] == 1 and s.loc[0, "syncs"] == 1
    assert s.loc[0, "host_us"] == pytest.approx((0.845 + 1.0) / 2)
    assert s.loc[0, "device_busy_us"] == pytest.approx((0.31 + 0.9) / 2)
    assert s.loc[0, "host_us_per_token"] == pytest.approx((0.845 + 1.0) / (2 * 2))  # 2 steps x batch 2
    assert s.loc[0, "bound"] == "host"  # host 0.9225 > busy 0.605
    pooled = nsys.summary(df, decode="all")
    assert pooled.loc[0, "steps"] == 4
    sg = nsys.summary(nsys.read(build(tmp_path, "sg.sqlite", step_graph)))
    assert sg.loc[0, "bound"] == "device" and sg.loc[0, "host_us"] == pytest.approx(0.05)


def test_plots_return_figure_and_axes(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    path = build(tmp_path, "fg.sqlite", forward_graph)
    fig, axes = nsys.plot_steps(nsys.read(path))
    assert len(axes) == 1 and axes[0].get_ylabel() == "µs / step"
    tl = nsys.timeline(path, first_step=1, steps=2)
    assert set(tl["lane"]) == {"host", "gpu"} and tl.loc[tl["lane"] == "gpu", "step"].tolist().count(1) == 4
    fig, ax = nsys.plot_timeline(tl, title="forward-graph")
    assert ax.get_xlabel().startswith("µs")
    with pytest.raises(ValueError, match="one batch and trace"):
        nsys.plot_steps(nsys.read(build(tmp_path, "all.sqlite", eager, step_graph)))
    sg = build(tmp_path, "sg.sqlite", step_graph)
    fig, axes = nsys.plot_timelines([path, sg], first_step=1, steps=2)
    assert len(axes) == 2 and "step-graph" in axes[1].get_title()


def test_cli_reads_exports_and_prints_json(tmp_path, capsys):
    from gdtool.frontends import profile as profile_cli
    path = build(tmp_path, "sg.sqlite", step_graph)
    assert profile_cli.main(["--read", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["rows"][0]["mode"] == "step-graph" and doc["rows"][0]["steps"] == 4
    assert "device_busy_us" in captured.err.splitlines()[0]  # the readable table, on stderr with --json
    assert profile_cli.main(["--read", str(path)]) == 0
    assert "device_busy_us" in capsys.readouterr().out.splitlines()[0]


def test_run_config_names_and_commands(tmp_path):
    cfg = nsys.TraceConfig("llama-1b", 16, "step-graph", "graph", eos=False, settings=(("eos_poll_interval", 16),))
    assert cfg.name == "llama-1b_b16_step-graph_graph_noeos_eos_poll_interval16"
    assert nsys.parse_name(cfg.name + ".sqlite.gz") == dict(model="llama-1b", batch=16, mode="step-graph",
                                                              trace="graph")
    cmd = nsys.profile_command("nsys", cfg, tmp_path / "r")
    for flag in ("-t", "cuda,nvtx", "--sample=none", "--cpuctxsw=none", "--cuda-graph-trace=graph"):
        assert flag in cmd
    assert cmd[cmd.index("--set") + 1] == "eos_poll_interval=16" and "--no-eos" in cmd
    with pytest.raises(ValueError, match="trace="):
        nsys.TraceConfig("llama-1b", 1, "eager", "kernel")
    with pytest.raises(ValueError, match="mode="):
        nsys.TraceConfig("llama-1b", 1, "graph", "node")


def test_session_plumbing_with_a_stand_in_for_nsys(tmp_path, monkeypatch, capsys):
    """record/session/main on CPU: subprocess.run plays nsys (profile writes a report and prints the program's
    JSON line; export writes a synthetic export of the same decode)."""
    source = build(tmp_path, "sg.sqlite", step_graph)  # (model names may hold dots: qwen2.5-0.5b)
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[1] == "profile":
            Path(cmd[cmd.index("-o") + 1] + ".nsys-rep").write_bytes(b"report")  # as nsys names it
            doc = {"ranges": True, "decodes": [{"steps": 4}]}
            return recording.subprocess.CompletedProcess(cmd, 0, stdout="nsys says hi\n" + json.dumps(doc) + "\n",
                                                         stderr="")
        shutil.copy(source, cmd[cmd.index("-o") + 1])
        return recording.subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    from gdtool.frontends import profile as profile_cli
    from gdtool.measure import record
    env = record.environment()  # before subprocess.run plays nsys: it runs git and nvidia-smi
    monkeypatch.setattr(recording.subprocess, "run", fake_run)
    monkeypatch.setattr(record, "environment", lambda device=None, nsys=None: env)
    monkeypatch.setenv("GDTOOL_NSYS", str(tmp_path / "nsys"))
    (tmp_path / "nsys").write_text("#!/bin/sh\n")
    (tmp_path / "nsys").chmod(0o755)
    out = tmp_path / "out"
    argv = ["--nsys", "--model", "qwen2.5-0.5b", "--batch", "16", "--modes", "step-graph", "--trace", "graph",
            "--repeat", "1", "--out", str(out), "--json", "--no-progress"]
    assert profile_cli.main(argv) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert captured.err.startswith(f"nsys: 1 config to record (none in {out} yet), one process each under Nsight "
                                   "Systems; no estimate before the first ends")
    assert doc["rows"][0]["mode"] == "step-graph" and doc["rows"][0]["steps"] == 4
    assert sorted(p.name for p in out.iterdir()) == ["env.json", "qwen2.5-0.5b_b16_step-graph_graph.sqlite.gz",
                                                      "steps.csv", "summary.csv"]
    steps = pd.read_csv(out / "steps.csv")
    assert steps["model"].eq("qwen2.5-0.5b").all() and len(steps) == 4
    assert "--cuda-graph-trace=graph" in calls[0] and calls[1][1:4] == ["export", "--type", "sqlite"]
    # the same session again resumes: nothing is recorded, the rows stay
    calls.clear()
    assert profile_cli.main(argv) == 0
    err = capsys.readouterr().err
    assert calls == [] and err.startswith(f"nsys: 0 configs to record (1 of 1 already in {out}: skipped)")
    assert len(pd.read_csv(out / "steps.csv")) == 4

    def short_run(cmd, **kwargs):  # the program ran fewer steps than the export holds
        result = fake_run(cmd, **kwargs)
        result.stdout = result.stdout.replace('"steps": 4', '"steps": 3')
        return result
    monkeypatch.setattr(recording.subprocess, "run", short_run)
    with pytest.raises(AssertionError, match=r"ran \[3\] steps but the export holds \[4\]"):
        nsys.record(nsys.TraceConfig("tiny-llama", 16, "step-graph", "graph", repeat=1), out)


def test_missing_nsys_is_a_clear_error(monkeypatch, tmp_path, capsys):
    from gdtool.frontends import profile as profile_cli
    monkeypatch.delenv("GDTOOL_NSYS", raising=False)
    monkeypatch.setattr(recording.shutil, "which", lambda name: None)
    monkeypatch.setattr(recording.glob, "glob", lambda pattern: [])
    with pytest.raises(FileNotFoundError, match="GDTOOL_NSYS"):
        nsys.find_nsys()
    with pytest.raises(SystemExit) as exit_info:  # the command: one line, exit 2
        profile_cli.main(["--nsys", "--model", "tiny-llama", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GDTOOL_NSYS" in err and "Traceback" not in err


def test_slim_keeps_what_read_needs(tmp_path):
    path = build(tmp_path, "fg.sqlite", forward_graph)
    con = sqlite3.connect(path)
    con.execute("create table OSRT_API (start INTEGER, end INTEGER)")
    con.commit()
    con.close()
    gz = nsys.slim(path, tmp_path / "fg.slim.sqlite.gz")
    pd.testing.assert_frame_equal(nsys.read(gz), nsys.read(path))
    with export._connect(gz) as c:
        assert "OSRT_API" not in export._tables(c)


# ---------------------------------------------------------------------------------------------
# Real exports (recorded on a GPU by `python -m gdtool profile --nsys --fixture`)


@pytest.mark.parametrize("path", REAL_EXPORTS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no real exports under tests/data/ yet"))], ids=lambda p: p.name if p else "none")
def test_real_export_adds_up(path):
    expected = nsys.parse_name(path.name)
    df = nsys.read(path)
    nsys.check_totals(df, path)
    assert (df["mode"] == expected["mode"]).all()
    assert (df["batch"] == expected["batch"]).all()
    if expected["mode"] != "eager":
        assert (df["trace"] == expected["trace"]).all()
        assert (df["graph_launches"] >= 1).all()
    for _, g in df.groupby("decode"):
        assert g["step"].tolist() == list(range(1, len(g) + 1))
    assert (df["wall_us"] > 0).all() and (df["host_us"] > 0).all()
    assert (df["device_busy_us"] > 0).all()  # every step launches device work
    assert (df["gpu_idle_us"] >= -1e-3).all()  # one stream: the step's work cannot overlap itself
    if expected["trace"] == "node" or expected["mode"] == "eager":
        assert (df["graphs"] == 0).all() and (df["kernels"] > 0).all()
    else:
        assert (df["graphs"] >= 1).all()


# ---------------------------------------------------------------------------------------------
# On a GPU with nsys: a real session end to end.


def _have_nsys():
    try:
        nsys.find_nsys()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _have_nsys(), reason="nsys not found")
@pytest.mark.parametrize("mode", nsys.MODES)
def test_session_on_gpu(tmp_path, mode):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = nsys.TraceConfig("tiny-llama", 2, mode, "node", max_new_tokens=6, prompt_len=8, repeat=1, eos=False)
    df, ran = nsys.record(cfg, tmp_path, fixture=True)  # record() checks steps and totals itself
    assert len(df) == ran["decodes"][0]["steps"] == 5
    assert (df["mode"] == mode).all() and (df["device_busy_us"] > 0).all()


def test_target_fuses_projections_when_asked(monkeypatch, capsys):
    """--set fuse_projections=true fuses the model before decoding (not passed to decode), and is refused
    where there is nothing to fuse."""
    import gdtool
    fused = []
    real = gdtool.kernels.fuse.fuse_projections
    monkeypatch.setattr(gdtool.kernels.fuse, "fuse_projections", lambda model: fused.append(real(model)) or fused[-1])
    args = ["--model", "tiny-llama", "--mode", "step-graph", "--batch", "1", "--max-new-tokens", "3", "--repeat", "1",
            "--no-eos"]
    assert nsys.target(args + ["--set", "fuse_projections=true"]) == 0
    assert fused == [4]  # q/k/v and gate/up in each of tiny-llama's two layers
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decodes"][0]["steps"] == 2
    monkeypatch.setattr(gdtool.kernels.fuse, "fuse_projections", lambda model: 0)
    with pytest.raises(SystemExit, match="nothing to fuse|no q/k/v"):
        nsys.target(args + ["--set", "fuse_projections=true"])
