"""Decode under Nsight Systems, and read its sqlite export as one row per decode step.

A decode step costs time on two clocks. The host runs Python, launches kernels (or one graph
replay) and sometimes waits; the GPU runs what was launched. When the host takes longer to launch
a step than the GPU takes to run it, the GPU idles between kernels: the decode is host-bound
(eager at small batch). A captured step is one launch: the host is done in tens of microseconds
and the GPU runs back to back, idle only while the host waits on an EOS poll: device-bound.

gdtool's NVTX ranges (domain ``gdtool``, see `gdtool.core.ranges`) mark each step on the host. `read`
projects every ``step`` range onto the GPU: the CUDA API calls made on the step's thread while the
range was open are joined by ``correlationId`` to the kernels, graph executions and copies they
launched, wherever on the GPU timeline those ran. Per step (names and definitions as in
`gdtool.measure.timing`, so the two can be compared column by column):

- ``wall_us``: the step range's duration on the host; ``<phase>_us`` for the ranges inside it
  (``forward_us``, ``select_us``, ``update_us``, ``eos_check_us``, ``replay_us``, ``eos_poll_us``);
- ``sync_us``: host time inside blocking CUDA calls (stream, device or event synchronize, synchronous
  memcpy, and async copies to pageable host memory, which block); ``syncs``: how many waits (torch's
  ``.item()`` is a copy to pageable memory plus a stream synchronize: one wait);
- ``host_us = wall_us - sync_us``: the host's own work in the step, waits excluded;
- ``kernels``, ``graphs``: kernel records and graph-execution records the step launched;
  ``graph_launches``: cudaGraphLaunch calls in the step;
- ``device_busy_us``: the sum of their durations (memcpy and memset left out, as in `gdtool.measure.timing`);
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

    df = nsys.read("my-session/llama-1b_b1_eager_graph_noeos.sqlite.gz")
    nsys.summary(df); fig, axes = nsys.plot_steps(df)

(The command is `gdtool.frontends.profile`; `python -m gdtool profile --help` lists every option.)
"""
from .export import (COPY_DTOH, GRAPH_LAUNCH_CALLS, KEEP_TABLES, MEMORY_PAGEABLE, MODES, NVTX_DOMAIN_CREATE,
                     NVTX_PUSH_POP, NVTX_START_END, PHASES, POLL_PHASES, READ_TABLES, STEP_COLUMNS, SYNC_CALLS,
                     TRACES, check_totals, parse_name, read, slim, timeline, totals)
from . import recording
from .plots import plot_steps, plot_timeline, plot_timelines
from .recording import (TraceConfig, environment, export_command, find_nsys, profile_command, record, session,
                      target, target_command)
from .tables import (SUMMARY_KEYS, TABLE_COLUMNS, agreement, format_table, load_sessions, per_token, summarize_exports,
                     summary)

__all__ = ["COPY_DTOH", "GRAPH_LAUNCH_CALLS", "KEEP_TABLES", "MEMORY_PAGEABLE", "MODES", "NVTX_DOMAIN_CREATE",
           "NVTX_PUSH_POP", "NVTX_START_END", "PHASES", "POLL_PHASES", "READ_TABLES", "STEP_COLUMNS", "SUMMARY_KEYS",
           "SYNC_CALLS", "TABLE_COLUMNS", "TRACES", "TraceConfig", "agreement", "check_totals", "environment",
           "export_command", "find_nsys", "format_table", "load_sessions", "parse_name", "per_token", "plot_steps",
           "plot_timeline", "plot_timelines", "profile_command", "read", "record", "session", "slim",
           "summarize_exports", "summary", "target", "target_command", "timeline", "totals"]


def __getattr__(name):
    if name == "RunConfig":  # the old name of TraceConfig, kept for one release (the warning comes from recording)
        return recording.RunConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
