"""Smoke test and timing of the device loop (gdtool.loops.devloop) on a GPU, before it drives real decoding.

What it checks, in order, each stage reported even if an earlier one failed:
1. versions: torch, cuda-python, driver, NVRTC, device and compute capability; `device_loop_support()`;
2. NVRTC compiles the condition kernel for this device (time to compile, CUBIN or PTX);
3. a toy step (x += 1; step += 1; done = x >= target) run as a WHILE node body: exact iteration
   counts in one launch, the limit, chunked launches, a done flag set before the launch;
4. cost per iteration: the toy step run 10000 times in one launch against 10000 `replay()` calls of
   the same captured graph (host-driven), and the host time of one `launch()`;
5. sampling: an MLP "decoder" (cuBLAS GEMMs, softmax, Gumbel-max draw with `exponential_`, token fed
   back through an embedding) run by sequential replays and by the device loop with advance_rng, on
   one and on chunked launches: tokens must be bitwise equal, and the generator offset too;
   without advance_rng the draws repeat (why the option exists).

    python profiles/devloop_probe.py                      # prints a report; last line one JSON document
    python profiles/devloop_probe.py --out $OUT/devloop_probe.json --iterations 10000
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from gdtool.loops import devloop
from gdtool.core import graphs
from gdtool.loops.devloop import DeviceLoop


def capture(fn):
    """Warm `fn` up and capture it keeping the cudaGraph_t, as the device-loop mode does."""
    graphs.warm_up(fn, 1)
    graph = graphs.Captured(fn, keep_graph=True).graph
    torch.cuda.synchronize()
    return graph


def versions() -> dict:
    info = {"torch": torch.__version__, "cuda_runtime_of_torch": torch.version.cuda}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    try:
        import cuda.bindings
        from cuda.bindings import driver, nvrtc
        info["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
        torch.cuda.init()
        err, version = driver.cuDriverGetVersion()
        info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
        err, major, minor = nvrtc.nvrtcVersion()
        info["nvrtc"] = f"{major}.{minor}"
    except Exception as error:
        info["bindings_error"] = f"{type(error).__name__}: {error}"
    info["device_loop_support"] = devloop.device_loop_support() or "ok"
    return info


def compile_kernel() -> dict:
    _, nvrtc = devloop._bindings()
    t0 = time.perf_counter()
    image, target = devloop.compile_kernels(torch.cuda.get_device_capability(), nvrtc)
    return {"compile_ms": round((time.perf_counter() - t0) * 1e3, 1), "target": target, "image_bytes": len(image)}


def toy(target):
    long = dict(dtype=torch.long, device="cuda")
    x, goal, step = torch.zeros((), **long), torch.tensor(target, **long), torch.zeros((), **long)
    done = torch.zeros((), dtype=torch.bool, device="cuda")

    def body():
        x.add_(1)
        step.add_(1)
        torch.ge(x, goal, out=done)

    graph = capture(body)

    def reset(new_target):
        x.zero_(), step.zero_(), done.zero_(), goal.fill_(new_target)

    reset(target)
    return graph, x, step, done, reset


def toy_checks() -> dict:
    graph, x, step, done, reset = toy(1)
    checks = {}
    with DeviceLoop(graph, done, step, 10**7) as loop:
        for target in (1, 5, 7, 1000):
            reset(target)
            loop.launch()
            torch.cuda.synchronize()
            checks[f"exact_{target}"] = int(x) == target and int(step) == target
        reset(5)
        done.fill_(True)
        loop.launch()
        torch.cuda.synchronize()
        checks["done_at_entry_runs_nothing"] = int(x) == 0
        reset(37)
        ran, before = [], 0
        while not bool(done) and len(ran) < 10:
            loop.launch(max_steps=8)
            ran.append(int(step) - before)
            before = int(step)
        checks["chunks_8"] = ran
        checks["chunks_ok"] = ran == [8, 8, 8, 8, 5]
        checks["launches"] = loop.launches
    limit = torch.tensor(20, device="cuda")
    reset(50)
    with DeviceLoop(graph, done, step, limit) as loop:
        loop.launch()
        torch.cuda.synchronize()
        checks["limit_20_of_50"] = int(step) == 20
    return checks


def timing(iterations: int) -> dict:
    graph, x, step, done, reset = toy(iterations)
    graph.replay()  # instantiate torch's own exec for the replay comparison
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {"iterations": iterations, "body_kernels": 3}
    with DeviceLoop(graph, done, step, 10**9) as loop:
        loop.launch()  # warm
        torch.cuda.synchronize()
        device_ms, host_us = [], []
        for _ in range(5):
            reset(iterations)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            loop.launch()
            host_us.append((time.perf_counter() - t0) * 1e6)
            end.record()
            torch.cuda.synchronize()
            assert int(x) == iterations, (int(x), iterations)
            device_ms.append(start.elapsed_time(end))
    replay_ms = []
    for _ in range(3):
        reset(iterations)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iterations):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms.append(start.elapsed_time(end))
    median = lambda values: sorted(values)[len(values) // 2]
    out["device_loop_ms"] = round(median(device_ms), 3)
    out["device_loop_us_per_iteration"] = round(median(device_ms) * 1e3 / iterations, 3)
    out["launch_host_us"] = round(median(host_us), 1)
    out["replays_ms"] = round(median(replay_ms), 3)
    out["replay_us_per_iteration"] = round(median(replay_ms) * 1e3 / iterations, 3)
    return out


def decoder(batch=16, width=1024, vocab=32000, layers=4, steps=64):
    """An MLP stand-in for a decode step: GEMMs, softmax, one Gumbel-max draw, the token fed back."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(width, width, device="cuda", generator=g) / width ** 0.5 for _ in range(layers)]
    head = torch.randn(width, vocab, device="cuda", generator=g) / width ** 0.5
    embed = torch.randn(vocab, width, device="cuda", generator=g)
    token = torch.zeros(batch, dtype=torch.long, device="cuda")
    tokens = torch.zeros(steps, batch, dtype=torch.long, device="cuda")
    step = torch.zeros((), dtype=torch.long, device="cuda")
    done = torch.zeros((), dtype=torch.bool, device="cuda")
    last = torch.tensor(steps, device="cuda")

    def body():
        h = embed.index_select(0, token)
        for w in weights:
            h = torch.tanh(h @ w)
        probs = (h @ head).softmax(-1)
        race = torch.empty_like(probs).exponential_(1)
        token.copy_((probs / race).argmax(-1))
        tokens.index_copy_(0, step.view(1), token[None])
        step.add_(1)
        torch.ge(step, last, out=done)

    def reset():
        token.copy_(torch.arange(batch, device="cuda"))
        tokens.zero_(), step.zero_(), done.zero_()

    return body, tokens, step, done, reset


def sampling() -> dict:
    body, tokens, step, done, reset = decoder()
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    reset()
    before = generator.get_offset()
    body()
    torch.cuda.synchronize()
    increment = generator.get_offset() - before
    graph = capture(body)
    out = {"rng_increment": increment}

    torch.cuda.manual_seed(7)
    reset()
    before = generator.get_offset()
    graph.replay()
    torch.cuda.synchronize()
    out["replay_increment"] = generator.get_offset() - before  # torch's whole-graph increment
    torch.cuda.manual_seed(7)
    reset()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(tokens.shape[0]):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    expected, expected_offset = tokens.clone(), generator.get_offset()
    out["replays_ms"] = round(start.elapsed_time(end), 3)
    out["distinct_rows_replays"] = len({tuple(r) for r in expected.tolist()})

    with DeviceLoop(graph, done, step, 10**6, advance_rng=True, rng_increment=increment) as loop:
        out["body_nodes"], out["rng_kernels"] = loop.body_nodes, loop.rng_kernels
        for chunk in (None, 7):
            torch.cuda.manual_seed(7)
            reset()
            torch.cuda.synchronize()
            start.record()
            loop.start_rollout()
            launches = 0
            while True:
                loop.launch(max_steps=chunk)
                launches += 1
                if chunk is None or bool(done):
                    break
            end.record()
            offset = loop.finish_rollout()
            name = "one_launch" if chunk is None else f"chunks_of_{chunk}"
            out[f"{name}_ms"] = round(start.elapsed_time(end), 3)
            out[f"{name}_launches"] = launches
            out[f"{name}_tokens_equal"] = bool(torch.equal(tokens, expected))
            out[f"{name}_offset_equal"] = offset == expected_offset == generator.get_offset()
    with DeviceLoop(graph, done, step, 10**6) as loop:
        torch.cuda.manual_seed(7)
        reset()
        loop.launch()
        torch.cuda.synchronize()
        out["distinct_rows_without_advance"] = len({tuple(r) for r in tokens.tolist()})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--out", default=None, help="write the JSON report here too")
    args = parser.parse_args(argv)
    report = {"versions": versions()}
    stages = [("compile", compile_kernel), ("toy", toy_checks), ("timing", lambda: timing(args.iterations)),
              ("sampling", sampling)]
    for name, stage in stages:
        if not torch.cuda.is_available():
            report[name] = {"skipped": "no CUDA device"}
            continue
        try:
            report[name] = stage()
        except Exception as error:
            report[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        print(f"== {name}: {json.dumps(report[name])}", flush=True)
    toy_ok = report.get("toy", {})
    sample = report.get("sampling", {})
    report["ok"] = bool(toy_ok.get("chunks_ok") and all(v for k, v in toy_ok.items() if k.startswith("exact_"))
                        and sample.get("one_launch_tokens_equal") and sample.get("chunks_of_7_tokens_equal")
                        and sample.get("one_launch_offset_equal"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0 if report["ok"] or not torch.cuda.is_available() else 1


if __name__ == "__main__":
    raise SystemExit(main())
