"""What one graph launch costs the host: gdtool's step graph and device loop, against synthetic graphs.

    python profiles/launch_probe.py --model llama-1b --batch 1 --out OUT/launch.json

A step-graph step costs the host one `replay()`, a device-loop rollout one `cuGraphLaunch`. This probe
times those calls alone (`time.thread_time_ns` of the launching thread and `time.perf_counter_ns`
around the call, medians over many launches) in two situations:

    idle    the device is synchronized before each launch (the device loop's case: after the prefill)
    queued  16 launches back to back, then a sync (step-graph between two polls)

for the real step of `--model` (HF's kernels and `kernels="compiled"`), with the node types of the
captured step, and for synthetic straight-line graphs of N one-element kernels (N = 1 ... 3000),
replayed by torch and wrapped in gdtool's WHILE node, to see how the cost grows with node count.
With --flags it also launches the real step's graph instantiated with other flags (torch instantiates
with auto-free-on-launch); --variants repeats the model's rows with timing events around each launch
and / or the context in blocking-sync scheduling, the two things `gdtool.measure.timing` adds around a step.
Needs a CUDA GPU; writes one JSON file and prints each row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gdtool  # noqa: E402
from gdtool.core import compat  # noqa: E402
from gdtool.loops import devloop
from gdtool.measure import timing
from gdtool.loops.decode import Engine  # noqa: E402
from gdtool.core.settings import resolve  # noqa: E402

QUEUE = 16
FLAGS = {"on": False}


def timed(call, events: bool = False) -> tuple[float, float]:
    """(CPU µs, wall µs) of one call; `events`: record a timing event on the stream just before and
    after it, outside the timed interval, as gdtool.measure.timing does around each step."""
    if events:
        torch.cuda.Event(enable_timing=True).record()
    w0 = time.perf_counter_ns()
    c0 = time.thread_time_ns()
    call()
    c1 = time.thread_time_ns()
    w1 = time.perf_counter_ns()
    if events:
        torch.cuda.Event(enable_timing=True).record()
    return (c1 - c0) / 1e3, (w1 - w0) / 1e3


# set by main() per variant: timing events around each launch (as gdtool.measure.timing records them)
VARIANT = {"events": False}


def measure(launch, reset=lambda: None, idle: int = 30, rounds: int = 4) -> dict:
    """Medians of `launch()` alone: idle (sync before each) and queued (QUEUE back to back per round)."""
    events = VARIANT["events"]

    def timed_(call):
        return timed(call, events)

    reset()
    idle_times = []
    for _ in range(idle):
        torch.cuda.synchronize()
        idle_times.append(timed_(launch))
    torch.cuda.synchronize()
    queued = []
    for _ in range(rounds):
        reset()
        torch.cuda.synchronize()
        queued.append([timed_(launch) for _ in range(QUEUE)])
        torch.cuda.synchronize()
    flat = [t for r in queued for t in r]
    per_position = [statistics.median(r[k][1] for r in queued) for k in range(QUEUE)]
    return {"idle_cpu_us": statistics.median(t[0] for t in idle_times),
            "idle_wall_us": statistics.median(t[1] for t in idle_times),
            "queued_cpu_us": statistics.median(t[0] for t in flat),
            "queued_wall_us": statistics.median(t[1] for t in flat),
            "queued_wall_us_by_position": [round(x, 1) for x in per_position]}


def node_types(raw_graph: int) -> dict:
    cu, _ = devloop._bindings()
    counts: dict[str, int] = {}
    for _, name in devloop._walk(cu, cu.CUgraph(int(raw_graph))):
        counts[name] = counts.get(name, 0) + 1
    return counts


def engine_rows(model, name: str, batch: int, kernels: str, prompt_len: int) -> list[dict]:
    with torch.inference_mode():  # the engine's cache and buffers are written in inference mode
        return _engine_rows(model, name, batch, kernels, prompt_len)


def _engine_rows(model, name: str, batch: int, kernels: str, prompt_len: int) -> list[dict]:
    prompt = gdtool.random_prompts(model, batch=batch, lengths=(prompt_len, prompt_len), seed=0)
    ids, mask = prompt.input_ids, prompt.attention_mask
    settings = resolve(model, 256, dict(do_sample=False, eos_token_id=None, pad_token_id=0), {})
    rows = []
    for mode in ("step-graph", "device-loop"):
        engine = Engine(model, mode, settings, ids, kernels=kernels)
        engine.run(ids, mask)  # warm-up and capture
        # from after a prefill, so the measured steps stay inside the cache
        engine._reset(ids, mask, None)
        engine.step.prefill(ids, mask)
        torch.cuda.synchronize()
        snap = engine.state.snapshot()

        def reset(engine=engine, snap=snap):
            engine.state.restore(snap)
            compat.rewind(engine.cache, engine.width)

        base = dict(model=name, batch=batch, kernels=kernels)
        if mode == "step-graph":
            row = dict(base, what="step-graph replay()", **measure(engine.graph.replay, reset))
        else:
            engine.loop.launch(max_steps=1)  # sets the entry node's max_steps once; every launch runs one step
            torch.cuda.synchronize()
            row = dict(base, what="device-loop cuGraphLaunch (1 step per launch)",
                       **measure(lambda e=engine: e.loop.launch(max_steps=1), reset))
            raw = engine.graph.graph.raw_cuda_graph()
            row["node_types"] = node_types(raw)
            row["nodes"] = sum(row["node_types"].values())
            rows.append(row)
            print(json.dumps(row), flush=True)
            if FLAGS["on"]:
                rows.extend(flag_rows(raw, base, reset))
            engine.close()
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.close()
    return rows


def flag_rows(raw: int, base: dict, reset) -> list[dict]:
    """The captured step instantiated again with other flags, launched with cuGraphLaunch."""
    cu, _ = devloop._bindings()
    flags = {"none": 0,
             "auto-free-on-launch (torch's)": int(cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH),
             "use-node-priority": int(cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)}
    rows = []
    stream = torch.cuda.current_stream()
    for name, value in flags.items():
        what = f"step body, cuGraphLaunch, instantiate flags {name}"
        try:
            exec_ = devloop._check(cu.cuGraphInstantiate(cu.CUgraph(int(raw)), value), "cuGraphInstantiate")
            devloop._check(cu.cuGraphUpload(exec_, cu.CUstream(stream.cuda_stream)), "cuGraphUpload")

            def launch(exec_=exec_):
                devloop._check(cu.cuGraphLaunch(exec_, cu.CUstream(stream.cuda_stream)), "cuGraphLaunch")

            row = dict(base, what=what, **measure(launch, reset))
            torch.cuda.synchronize()
            devloop._check(cu.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
        except Exception as error:
            row = dict(base, what=what, error=f"{type(error).__name__}: {error}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def synthetic_rows(sizes) -> list[dict]:
    rows = []
    for n in sizes:
        x = torch.zeros(1, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1)
        row = dict(what="synthetic straight line, replay()", nodes=n, **measure(graph.replay))
        rows.append(row)
        print(json.dumps(row), flush=True)
        done = torch.ones(1, dtype=torch.bool, device="cuda")  # finished: the WHILE body never runs
        step = torch.zeros((), dtype=torch.int64, device="cuda")
        loop = devloop.DeviceLoop(graph, done, step, 1 << 30)
        row = dict(what="synthetic body in a WHILE node, 0 iterations", nodes=n, **measure(loop.launch))
        rows.append(row)
        print(json.dumps(row), flush=True)
        loop.close()
        graph.reset()
    return rows


def profile_rows(model, name: str, batch: int, prompt_len: int) -> list[dict]:
    prompt = gdtool.random_prompts(model, batch=batch, lengths=(prompt_len, prompt_len), seed=0)
    rows = []
    for mode in ("step-graph", "device-loop"):
        for blocking in (True, False):
            res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=48,
                                 eos_token_id=None, seed=0, busy=False, blocking_sync=blocking)
            host = res.steps["host_us"]
            row = dict(model=name, batch=batch, what=f"gdtool.profile {mode}", blocking_sync=blocking,
                       host_us_median=float(host.median()), host_us=[round(x, 1) for x in host.tolist()[:20]],
                       wall_us_median=float(res.steps["wall_us"].median()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--kernels", default="hf,compiled")
    p.add_argument("--sizes", default="1,100,300,1000,3000")
    p.add_argument("--variants", default="plain",
                   help="comma list of plain, events (timing events around each launch, as gdtool.measure.timing records "
                        "them), blocking (the context in blocking-sync scheduling, as gdtool.measure.timing sets it), "
                        "events+blocking, after-profiler (once a torch.profiler session has run in the process; last); "
                        "applied to the model's rows")
    p.add_argument("--flags", action="store_true", help="also launch the step instantiated with other flags")
    p.add_argument("--profile", action="store_true", help="also gdtool.profile's host_us per step (48 tokens, "
                   "step-graph and device-loop, HF's kernels), with and without blocking-sync scheduling")
    p.add_argument("--profile-after-profiler", action="store_true",
                   help="then run a torch.profiler session and the gdtool.profile rows again (last)")
    p.add_argument("--out", default="launch.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_probe needs a CUDA GPU: it times graph launches")
    rows = synthetic_rows([int(s) for s in args.sizes.split(",") if s])
    model = gdtool.load_model(args.model, seed=0, device="cuda")
    FLAGS["on"] = args.flags
    if args.profile:  # before any torch.profiler session in this process
        rows.extend(profile_rows(model, args.model, args.batch, args.prompt_len))
    for variant in args.variants.split(","):
        VARIANT["events"] = "events" in variant
        if variant == "after-profiler":  # irreversible for this process: put it last
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
                torch.ones(1, device="cuda").add_(1)
                torch.cuda.synchronize()
        with timing._sched_blocking_sync(torch.device("cuda"), "blocking" in variant, []):
            for kernels in args.kernels.split(","):
                try:
                    new = engine_rows(model, args.model, args.batch, kernels, args.prompt_len)
                except Exception as error:  # one failed variant is recorded, not fatal
                    new = [dict(model=args.model, kernels=kernels, error=f"{type(error).__name__}: {error}"[:400])]
                    print(json.dumps(new[-1]), flush=True)
                new = [dict(row, variant=variant) for row in new]
                rows.extend(new)
                print(json.dumps({"variant": variant, "rows": len(new)}), flush=True)
    if args.profile_after_profiler:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device="cuda").add_(1)
            torch.cuda.synchronize()
        rows.extend(dict(row, after_profiler=True)
                    for row in profile_rows(model, args.model, args.batch, args.prompt_len))
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(env=env, model=args.model, batch=args.batch, queue=QUEUE, rows=rows),
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
