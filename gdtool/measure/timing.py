"""Host vs device time per decode step, measured in-process: no profiler session needed.

A decode step costs the host some work (Python, dispatch, kernel launches) and the GPU some work
(kernels). Eager decode at small batch is host-bound: the GPU sits idle while Python launches the
next kernel. A CUDA graph of the whole step turns hundreds of launches into one, and the step
becomes device-bound: the GPU idles only when the host waits on it (an EOS poll). `profile` puts
numbers on that story, one row per decode step:

    res = gdtool.profile(model, ids, mask, mode="eager", max_new_tokens=64)
    res.steps                     # DataFrame: one row per step
    res.summary.loc["host_us"]    # median, p20, p80, mean, total, per_token
    steps, summary = gdtool.profile(model, ids, mask, mode="step-graph", max_new_tokens=64, eos_poll_interval=16)

    python -m gdtool profile --model llama-1b --batch 1,16 --max-new-tokens 48 --no-eos --out my-timing

Columns, how each is measured, and what it cannot see:

- ``wall_us``: host wall clock (``time.perf_counter_ns``) from entering to leaving the step's
  ``step`` range. Everything the host did or waited for in the step.
- ``host_us``: CPU time of the decoding thread in the step (``time.thread_time_ns``, Linux
  CLOCK_THREAD_CPUTIME_ID): the Python thread's own work. Blocking waits are excluded because a
  thread that sleeps accrues no CPU time. A CUDA wait does not sleep by default: the driver spins
  while the GPU is busy, which would count the wait as work. So for the timed decode `profile`
  switches the CUDA context to blocking-sync scheduling (``cuCtxSetFlags(CU_CTX_SCHED_BLOCKING_SYNC)``
  through libcuda, restored afterwards); stream, device and copy synchronizations then sleep.
  Blind spots: a wait that spins regardless (e.g. a launch blocking on a full launch queue; the
  GPU tests check that device sync, ``.item()`` and event synchronize do sleep), work done on the
  step's behalf by other threads (CUDA driver threads; on a CPU device, torch's intra-op worker
  threads), and time the thread was descheduled, which is neither work nor a wait. Blocking sync wakes the thread a few
  µs later than spinning would, which can add to ``wall_us`` at syncs (not to ``host_us``).
- ``device_span_us``: GPU time between two CUDA events recorded on the current stream at the
  step's start and end: when the GPU reached the step's first and last piece of work, idle gaps
  included. Work on other streams is not bracketed.
- ``device_busy_us``: sum of the durations of the kernels launched inside the step, from
  torch.profiler's CUDA kernel records (CUPTI). A kernel record carries the correlation id of the
  runtime call that launched it (cudaLaunchKernel; cudaGraphLaunch for every kernel of a replay);
  the kernel belongs to the step whose range was open on the host when that call was made, however
  late the kernel ran. Memcpy and memset are not kernels and are left out. The profiler slows the
  host, so busy time comes from a second, identical decode (same seed, same steps) run under the
  profiler, started at step 1 (after capture); everything else comes from the first.
- ``gpu_idle_us``: ``device_span_us - device_busy_us``: the GPU waiting inside the step, for the
  host or between kernels. As span and busy come from two runs of the same work, a step that keeps
  the GPU busy throughout can show a small negative idle (run-to-run jitter); it is not clamped.
- ``syncs``: blocking host waits in the step as decode counts them in ``host_syncs`` (EOS flag
  reads and waits hidden in library code), reported through `gdtool.core.ranges.count_syncs`. Where
  decode does not report them, only the step's EOS reads are counted (``notes`` says so).

The kernel pass leaves a cost behind: a torch.profiler session keeps CUPTI attached for the rest of
the process (Kineto finalizes it only with ``TEARDOWN_CUPTI=1``), and every later CUDA launch pays for
it on the host (an H200 step-graph replay: ~7-20 µs before, ~185 µs after). So when timing several
configs, run them all with ``busy=False`` first and call `add_device_busy` on each result last, as
``python -m gdtool profile`` and ``sweep(profile=True)`` do; a timed pass that runs after a kernel
pass in the same process says so in ``notes`` and warns. A profiler session started outside gdtool
cannot be seen.

On a CPU device the three device columns are NaN (see ``notes``). The summary's ``per_token`` is
the total over steps divided by steps x batch (each step makes one token per row), as in
`gdtool.measure.nsys`. Figures exclude prefill, warm-up and capture: only the ``step`` ranges are timed.
"""
from __future__ import annotations

import bisect
import ctypes
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import pandas as pd
import torch

from ..core import ranges

COLUMNS = ("step", "wall_us", "host_us", "device_span_us", "device_busy_us", "gpu_idle_us", "syncs")
METRICS = COLUMNS[1:]

_MARK = "gdtool.step#"          # torch.profiler user-annotation name of a step in the kernel pass
_SCHED_MASK = 0x07              # CU_CTX_SCHED_MASK
_SCHED_BLOCKING_SYNC = 0x04     # CU_CTX_SCHED_BLOCKING_SYNC


@dataclass
class ProfileResult:
    """`steps`: one row per decode step (COLUMNS); `summary`: per metric, over steps and per token.

    Unpacks as ``steps, summary = gdtool.profile(...)``.
    """
    steps: pd.DataFrame
    summary: pd.DataFrame
    output: object = None                           # the DecodeOutput of the timed decode
    notes: list = field(default_factory=list)       # how the figures were obtained, and any caveat
    # what add_device_busy needs to repeat the decode (model and inputs); dropped once it has run
    _pass: dict | None = field(default=None, repr=False, compare=False)

    def __iter__(self):
        return iter((self.steps, self.summary))


def profile(model, input_ids, attention_mask=None, mode: str = "step-graph", *, warmup: int = 1,
            busy: bool | None = None, blocking_sync: bool = True, **decode_kwargs) -> ProfileResult:
    """Decode with `gdtool.decode(model, input_ids, attention_mask, mode=mode, **decode_kwargs)` and
    time every decode step; see the module docstring for what each column measures.

    `warmup` untimed decodes run first (lazy initialisation, allocator, cuBLAS). `busy` (default:
    on where CUDA is) runs one more decode under torch.profiler for ``device_busy_us``; when timing
    several configs, pass ``busy=False`` and call `add_device_busy` on each result last.
    `blocking_sync=False` keeps the driver's spin-waits, which then count in ``host_us``.
    ``kernels`` ("hf", "compiled" or "fast": `gdtool.core.modes.KERNELS`), like every other decode argument,
    goes to `gdtool.decode`; a bool ``kernels=`` is the old name of `busy` and is taken as such, with a
    DeprecationWarning.
    """
    from ..loops.decode import decode

    if isinstance(decode_kwargs.get("kernels"), bool):
        warnings.warn("profile(kernels=True/False) is now profile(busy=...): `kernels` is decode's "
                      "'hf' / 'compiled' / 'fast' choice", DeprecationWarning, stacklevel=2)
        old = decode_kwargs.pop("kernels")
        busy = old if busy is None else busy
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0 (untimed decodes before the timed one)")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if busy and not cuda:
        raise ValueError(f"busy=True needs a CUDA device and the model is on {device}: there are no kernel "
                         "records to read; leave busy=None")
    busy = cuda if busy is None else bool(busy)
    notes: list[str] = []

    def run():
        return decode(model, input_ids, attention_mask, mode=mode, **decode_kwargs)

    for _ in range(warmup):
        run()

    # device-loop runs its steps on the device: the unit timed is a graph launch (one per rollout, or per
    # chunk with steps_per_launch), and per-token figures divide by the steps it ran.
    unit = ranges.REPLAY if mode == "device-loop" else ranges.STEP
    clock = _StepClock(cuda, capacity=int(decode_kwargs.get("max_new_tokens") or 0), unit=unit)
    with _sched_blocking_sync(device, blocking_sync, notes):
        ranges.add_listener(clock)
        try:
            out = run()
        finally:
            ranges.remove_listener(clock)
        if cuda:
            torch.cuda.synchronize(device)
    steps = clock.frame()
    # launches, not replays: uncaptured (a CPU) the device loop's launches are no replays, but they are ranges
    expected = out.launches if unit == ranges.REPLAY else out.steps
    if len(steps) != expected:
        raise RuntimeError(f"saw {len(steps)} {unit} ranges but the decode ran {expected}; a range is "
                           "missing or nested (is another listener popping ranges?)")

    steps = _fill_syncs(steps, clock, out, notes)

    if cuda:
        notes.append("device_span_us: CUDA events on the current stream at each step's start and end")
        if _PROFILER_SESSIONS[0]:
            notes.append(TAINTED)
            warnings.warn(TAINTED, stacklevel=2)
    else:
        notes.append(f"device columns are NaN: the model is on {device}, there is no CUDA device to time")
    result = ProfileResult(steps=steps, summary=None, output=out, notes=notes)
    result._pass = dict(run=run, device=device, unit=unit, expected=expected, mode=mode)
    if cuda and not busy:
        notes.append("device_busy_us is NaN: busy=False (add_device_busy(result) runs the kernel pass later)")
    return add_device_busy(result) if busy else _finish(result)


# CUPTI stays attached after a torch.profiler session (Kineto does not finalize it unless TEARDOWN_CUPTI=1):
# on the H200 every later CUDA launch in the process paid for it (launch_probe.py, 2026-11-30).
TAINTED = ("host_us and wall_us were measured after a torch.profiler pass ran in this process: CUPTI stays "
           "attached and taxes every CUDA launch (on an H200 a step-graph replay went from ~7-20 µs to ~185 µs of "
           "host time). Time every config first with busy=False, then call add_device_busy() on each result "
           "(the profile CLI, sweep(profile=True) and notebook 01 do so)")
_PROFILER_SESSIONS = [0]  # torch.profiler passes run by this module in this process


def add_device_busy(result: ProfileResult) -> ProfileResult:
    """Run the kernel pass (a second, identical decode under torch.profiler) for a result timed with
    ``busy=False``, and fill ``device_busy_us`` / ``gpu_idle_us``. Returns the result, updated.

    torch.profiler leaves CUPTI attached for the rest of the process, which slows every later CUDA
    launch on the host: when profiling several configs, time them all first, then add busy time."""
    info = getattr(result, "_pass", None)
    if info is None:
        raise ValueError("this result was not made by gdtool.profile; pass what profile(..., busy=False) "
                         "returned")
    if info.get("run") is None:
        raise ValueError("this result already has its device busy time (add_device_busy ran, or profile was "
                         "called with busy on)")
    steps, notes, device, unit = result.steps, result.notes, info["device"], info["unit"]
    if device.type != "cuda":
        raise ValueError(f"add_device_busy needs a CUDA device and the model is on {device}: there are no kernel "
                         "records to read")
    notes[:] = [n for n in notes if not n.startswith("device_busy_us is NaN: busy=False")]
    if unit == ranges.REPLAY:
        # No kernel pass for device-loop. torch.profiler records no kernel of a WHILE-node launch made through
        # cuda.bindings (H200, torch 2.11), so busy time is unknown, not zero; and on the H200 a device-loop
        # decode at batch 4 under that pass stopped with an illegal memory access (2026-11-30), which the same
        # decode without it never did. nsys node traces do see those kernels.
        steps["device_busy_us"] = math.nan
        notes.append("device_busy_us is NaN for device-loop: torch.profiler sees no kernel inside the WHILE node's "
                     "launch (the kernel pass is skipped); use an nsys node trace for that mode's kernels")
    else:
        busy, outside, kernel_steps = _kernel_pass(info["run"], device, unit)
        steps["device_busy_us"] = steps["step"].map(busy).astype(float)
        inside = sum(busy.values())
        if outside > 0.05 * (inside + outside):
            notes.append(f"{outside:.0f} µs of kernels ran while profiling but were launched outside any step range "
                         f"(vs {inside:.0f} µs inside): check that the step ranges enclose the launches")
        if kernel_steps != info["expected"]:
            notes.append(f"the kernel pass ran {kernel_steps} steps, the timed pass {result.output.steps}: "
                         "device_busy_us is NaN where a step has no counterpart (the two decodes diverged; pass a seed)")
        over = steps["device_busy_us"] > 1.1 * steps["device_span_us"]
        if over.any():
            # Seen on an H200 before busy_per_step left out the GPU copies of user annotations (eager, batch 1:
            # 7 of 47 steps with 30-70 ms of "kernels"); kept as a check that the records can all be right.
            notes.append(f"{int(over.sum())} of {len(steps)} steps record more kernel time than their device span "
                         "(kernel records that cannot all be right: overlapping or mis-attributed); per_token and mean "
                         "busy include them, the median does not")
        notes.append("device_busy_us: kernel records of torch.profiler (CUPTI) from a second identical decode")
    info["run"] = None  # let go of the model and inputs
    return _finish(result)


def _finish(result: ProfileResult) -> ProfileResult:
    info, out = result._pass, result.output
    steps = result.steps
    steps["gpu_idle_us"] = steps["device_span_us"] - steps["device_busy_us"]
    result.steps = steps = steps[list(COLUMNS)]
    notes = result.notes
    if info["unit"] == ranges.REPLAY:
        note = ("device-loop: one row per graph launch (its `step` is the launch index); per_token divides by "
                "the decode steps the launches ran")
        if note not in notes:
            notes.append(note)
    result.summary = summarize(steps, out.batch, mode=info["mode"], notes=notes,
                               decode_steps=out.steps if info["unit"] == ranges.REPLAY else None)
    return result


def summarize(steps: pd.DataFrame, batch: int, decode_steps: int | None = None, **attrs) -> pd.DataFrame:
    """Per metric: median, p20, p80, mean and total over rows, and per_token = total / (steps x batch).

    `decode_steps`: the decode steps the rows ran, when a row is not one step (device-loop launches)."""
    values = steps[list(METRICS)].astype(float)
    total = values.sum(min_count=1)
    count = len(values) if decode_steps is None else decode_steps
    summary = pd.DataFrame({"median": values.median(), "p20": values.quantile(0.2), "p80": values.quantile(0.8),
                            "mean": values.mean(), "total": total,
                            "per_token": total / (count * batch) if count else math.nan})
    summary.index.name = "metric"
    summary.attrs.update(attrs, steps=len(values), batch=batch, decode_steps=count)
    return summary


class _StepClock:
    """Range listener: wall and thread-CPU clocks and CUDA events around each ``step`` range."""

    def __init__(self, cuda: bool, capacity: int, unit: str = ranges.STEP):
        self.cuda = cuda
        self.unit = unit
        # Created up front: making an event inside a step would land in that step's time.
        self.events = [self._pair() for _ in range(capacity)] if cuda else []
        self.rows: list[list] = []
        self.open: list | None = None
        self.syncs_reported = 0
        self.eos_reads = 0

    @staticmethod
    def _pair():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def push(self, name, payload):
        if name == self.unit and self.open is None:
            if payload is None:
                payload = len(self.rows) + 1
            if self.cuda:
                k = len(self.rows)
                if k == len(self.events):
                    self.events.append(self._pair())
                self.events[k][0].record()
            # wall clock first, CPU clock last: the wall interval encloses the CPU interval.
            row = [payload, time.perf_counter_ns(), 0, 0, 0, 0, 0]
            row[3] = time.thread_time_ns()
            self.open = row
        elif self.open is not None and (name == ranges.EOS_CHECK or name == ranges.EOS_POLL):
            self.open[6] += 1

    def pop(self, name):
        if name == self.unit and self.open is not None:
            row = self.open
            row[4] = time.thread_time_ns()
            row[2] = time.perf_counter_ns()
            if self.cuda:
                self.events[len(self.rows)][1].record()
            self.rows.append(row)
            self.open = None

    def syncs(self, n):
        self.syncs_reported += n
        if self.open is not None:
            self.open[5] += n

    def frame(self) -> pd.DataFrame:
        rows = self.rows
        df = pd.DataFrame({
            "step": pd.array([r[0] for r in rows], dtype="int64"),
            "wall_us": [(r[2] - r[1]) / 1e3 for r in rows],
            "host_us": [(r[4] - r[3]) / 1e3 for r in rows],
            "syncs": pd.array([r[5] for r in rows], dtype="int64"),
            "eos_reads": pd.array([r[6] for r in rows], dtype="int64"),
        })
        if self.cuda:
            df["device_span_us"] = [start.elapsed_time(end) * 1e3 for start, end in self.events[:len(rows)]]
        else:
            df["device_span_us"] = math.nan
        df["device_busy_us"] = math.nan
        return df


def _fill_syncs(steps: pd.DataFrame, clock: _StepClock, out, notes: list) -> pd.DataFrame:
    if clock.syncs_reported == 0 and out.host_syncs > 0:
        # decode does not report its waits through ranges.count_syncs: count the EOS reads, the waits
        # gdtool makes inside steps, and say what is missing.
        steps["syncs"] = steps["eos_reads"]
        notes.append("syncs counts EOS flag reads only: waits hidden in library code are not reported per step "
                     "(decode does not call gdtool.core.ranges.count_syncs)")
    else:
        notes.append("syncs: blocking waits reported by decode through gdtool.core.ranges.count_syncs")
    return steps.drop(columns="eos_reads")


class _KernelMarks:
    """Range listener for the kernel pass: starts torch.profiler at the first step (after capture) and
    marks each step with a user annotation, so that kernels can be assigned to steps."""

    def __init__(self, cuda: bool = True, unit: str = ranges.STEP):
        from torch.profiler import ProfilerActivity
        self.unit = unit
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = None
        self.open = None
        self.steps = 0

    def push(self, name, payload):
        if name == self.unit and self.open is None:
            if payload is None:
                payload = self.steps + 1
            if self.profiler is None:
                self.profiler = torch.profiler.profile(activities=self.activities)
                self.profiler.start()
            self.open = torch.autograd.profiler.record_function(f"{_MARK}{payload}")
            self.open.__enter__()
            self.steps += 1

    def pop(self, name):
        if name == self.unit and self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None


def _kernel_pass(run, device, unit: str = ranges.STEP) -> tuple[dict, float, int]:
    cuda = device.type == "cuda"
    marks = _KernelMarks(cuda, unit)
    ranges.add_listener(marks)
    try:
        run()
    finally:
        ranges.remove_listener(marks)
        if marks.profiler is not None:
            _PROFILER_SESSIONS[0] += 1
            if cuda:
                torch.cuda.synchronize(device)
            marks.profiler.stop()
    if marks.profiler is None:
        return {}, 0.0, 0
    busy, outside = busy_per_step(profiler_records(marks.profiler))
    return busy, outside, marks.steps


class _Span(NamedTuple):
    start: float
    end: float


class _Record(NamedTuple):
    """The attributes of torch.profiler's FunctionEvent that busy_per_step reads, taken straight from
    Kineto's records (the same calls torch makes to build a FunctionEvent)."""
    name: str
    device_type: object
    time_range: _Span
    id: int
    activity_type: str | None  # None on torch 2.11, whose Kineto records lack it
    is_user_annotation: bool


def profiler_records(profiler) -> list:
    """The records of a stopped torch.profiler session that busy_per_step reads: step marks, user annotations,
    launch calls and device records (the ops in between are skipped). `profiler.events()` builds a
    FunctionEvent tree of every record (shapes, stacks, parents): 25 s per 500k records on one core of
    this project's CPU machine, and an eager MoE decode makes that many in a few dozen steps. Read from
    Kineto's own records, the same attributes cost a fraction of that; `events()` stays the fallback
    where torch does not expose them. Times are µs from the trace's start, as in FunctionEvent."""
    try:
        from torch.autograd.profiler_util import _filter_name
        results = profiler.profiler.kineto_results
        raw, origin = results.events(), results.trace_start_ns()
        cpu = torch.autograd.DeviceType.CPU
        # Kineto's activity type ("kernel", "cuda_runtime", ...) reached Python after torch 2.11, whose records and
        # FunctionEvents lack it; None there, as FunctionEvent has none, and _is_kernel then reads the name
        activity = (lambda e: e.activity_type()) if raw and hasattr(raw[0], "activity_type") else (lambda e: None)
        out = []
        for e in raw:
            name, device = e.name(), e.device_type()
            if device == cpu and not name.startswith(_MARK) and not _launch(name) and not e.is_user_annotation():
                continue  # an op: busy_per_step reads none
            if _filter_name(name) or getattr(e, "is_hidden_event", lambda: False)():
                continue
            # from the trace's start, in integer ns, before the µs division (as torch does): epoch ns in a float
            # keep only ~0.25 µs, a tenth of a short kernel
            out.append(_Record(name, device, _Span((e.start_ns() - origin) / 1000, (e.end_ns() - origin) / 1000),
                               e.correlation_id(), activity(e), e.is_user_annotation()))
        return out
    except (AttributeError, ImportError):  # pragma: no cover - a torch whose Kineto records lack one of these
        return profiler.events()


def _launch(name: str) -> bool:
    """A CUDA runtime or driver launch call (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, ...)."""
    return name.startswith("cu") and "Launch" in name and "::" not in name


def _is_kernel(e, gpu, annotations: set) -> bool:
    """A device-side record of a kernel (not a copy, a memset, a sync or a user annotation's GPU span);
    `annotations`: the names of the host-side user annotations."""
    if e.device_type != gpu:
        return False
    kind = getattr(e, "activity_type", None)
    if isinstance(kind, str) and kind:          # torch >= 2.x exposes Kineto's activity type
        return kind in ("kernel", "concurrent_kernel")
    if getattr(e, "is_user_annotation", False) or e.name in annotations or e.name.startswith(_MARK):
        return False
    return not e.name.startswith(("Memcpy", "Memset")) and not e.name.endswith(" Sync")


def busy_per_step(events) -> tuple[dict, float]:
    """Kernel time per step (µs) from torch.profiler FunctionEvents with ``gdtool.step#<j>`` marks.

    Each kernel record carries the CUPTI correlation id of the runtime call that launched it
    (cudaLaunchKernel, cudaGraphLaunch for every kernel of a replay, ...); the kernel belongs to the
    step whose mark encloses that call on the host. (torch's own kernel-to-op links skip graph
    replays, which run inside no op.) Returns ({step: busy_us}, kernel µs launched outside any step).

    Only kernel records count, and only host-side marks are marks. Kineto also reports a GPU-side
    copy of every user annotation (``gpu_user_annotation``: the GPU span of the kernels launched
    inside the mark), on the device, under the mark's name; its id is the annotation's, from torch's
    own op counter, not a CUPTI correlation id. Counted as a kernel, such a span lands on whichever
    step made the launch whose CUPTI id happens to equal it: on an H200 (eager, batch 1, the first
    kernel pass of the process, where both counters are small) 6-7 early steps got 30-70 ms each,
    one or more whole step spans, and every config had about a second of them "outside" any step.
    """
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    marks = sorted((e.time_range.start, e.time_range.end, int(e.name[len(_MARK):]))
                   for e in events if e.device_type == cpu and e.name.startswith(_MARK))
    starts = [m[0] for m in marks]
    busy = {m[2]: 0.0 for m in marks}
    # where torch does not say what a device record is: one named as a host-side user annotation is its GPU copy
    # (not every host event: inductor names a host-side range after the kernel it launches)
    annotations = {e.name for e in events if e.device_type == cpu and getattr(e, "is_user_annotation", False)}
    # launch calls (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, ...): their id is the CUPTI correlation
    # id. Only launches: a device-side record correlated with a synchronizing call (CUPTI's synchronization
    # activity lasts as long as the host waited) is not work the step gave the GPU.
    launches = {e.id: e.time_range.start for e in events if e.device_type == cpu and _launch(e.name)}
    outside = 0.0
    for e in events:
        if not _is_kernel(e, gpu, annotations):
            continue
        duration = e.time_range.end - e.time_range.start
        launched = launches.get(e.id)
        i = bisect.bisect_right(starts, launched) - 1 if launched is not None else -1
        if i >= 0 and launched <= marks[i][1]:
            busy[marks[i][2]] += duration
        else:
            outside += duration
    return busy, outside


@contextmanager
def _sched_blocking_sync(device: torch.device, wanted: bool, notes: list):
    """Switch the current CUDA context to blocking-sync scheduling for the block (see module docstring)."""
    if device.type != "cuda":
        notes.append("host_us: thread CPU time of the decoding thread (no CUDA: nothing to spin on)")
        yield
        return
    if not wanted:
        notes.append("host_us: thread CPU time with the driver's default scheduling: spin-waits in syncs count as work")
        yield
        return
    torch.cuda.synchronize(device)  # makes the device's context current on this thread
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        get_flags, set_flags = libcuda.cuCtxGetFlags, libcuda.cuCtxSetFlags  # cuCtxSetFlags: driver >= 12.1
    except (OSError, AttributeError) as err:
        notes.append(f"host_us includes spin-waits: cannot switch to blocking sync ({err}); needs libcuda with "
                     "cuCtxSetFlags (driver for CUDA 12.1 or newer)")
        yield
        return
    flags = ctypes.c_uint()
    status = get_flags(ctypes.byref(flags))
    new = (flags.value & ~_SCHED_MASK) | _SCHED_BLOCKING_SYNC if status == 0 else None
    status = set_flags(ctypes.c_uint(new)) if new is not None else status
    if status != 0:
        notes.append(f"host_us includes spin-waits: cuCtxGetFlags/cuCtxSetFlags failed with CUresult {status}")
        yield
        return
    notes.append("host_us: thread CPU time with the CUDA context in blocking-sync scheduling (waits sleep)")
    try:
        yield
    finally:
        torch.cuda.synchronize(device)
        set_flags(ctypes.c_uint(flags.value))


def per_token(result: ProfileResult) -> dict:
    """Per generated token, for each metric: ``<metric>_per_token`` (the total over steps / (steps x
    batch): the mean, first step and polls included) and ``<metric>_median_per_token`` with its
    ``_p20_per_token`` / ``_p80_per_token`` band (a typical step / batch).

    The two differ where a few steps cost far more than the rest: a step-graph decode's first step
    replays a graph fresh from capture (about 1.2 ms of host time for llama-1b's 837-node step on an
    H200, against 13-15 µs for a later replay), and a poll step wakes from a wait. Over 31 steps that
    first step alone makes the mean per token 3-4x the median (47 against 14.6 µs at batch 1)."""
    summary = result.summary
    batch = summary.attrs.get("batch") or result.output.batch
    # device-loop rows are launches, not steps: a typical launch / (steps per launch x batch)
    rows, steps = summary.attrs.get("steps"), summary.attrs.get("decode_steps")
    scale = rows / steps if rows and steps else 1.0
    out = {}
    for metric in METRICS:
        if metric not in summary.index:
            continue
        name = metric[:-3] if metric.endswith("_us") else metric
        out[f"{name}_us_per_token" if metric.endswith("_us") else f"{name}_per_token"] = float(
            summary.loc[metric, "per_token"])
        for stat in ("median", "p20", "p80"):
            key = f"{name}_us_{stat}_per_token" if metric.endswith("_us") else f"{name}_{stat}_per_token"
            out[key] = float(summary.loc[metric, stat]) * scale / batch
    return out


def per_token_table(summary: pd.DataFrame) -> pd.DataFrame:
    """`per_token`'s columns, one row per config, from a summary.csv of ``python -m gdtool profile`` (one
    row per config x metric; config columns model, batch, mode, ...), e.g. a committed one. For
    device-loop (one row per launch) the typical step is the mean per token."""
    keys = [c for c in summary.columns if c not in ("metric", "median", "p20", "p80", "mean", "total", "per_token",
                                                    "notes")]
    rows = []
    for values, g in summary.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        batch = float(row["batch"])
        for _, m in g.iterrows():
            name = m["metric"]
            row[f"{name}_per_token"] = float(m["per_token"])
            for stat in ("median", "p20", "p80"):
                typical = m["per_token"] if row.get("mode") == "device-loop" else m[stat] / batch
                row[f"{name}_{stat}_per_token"] = float(typical)
        rows.append(row)
    return pd.DataFrame(rows)
