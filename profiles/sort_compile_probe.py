"""How long inductor takes to compile the sampler's candidate ordering, with torch.sort and without.

    python profiles/sort_compile_probe.py --batches 1,64 --out OUT/sort_compile.json

The sort-free sampler orders its k + 16 candidates ascending by value, ties by id. It did so with two
torch.sort calls (ids, then values stably); `fast_sampling.ascending` now does it by counting. This
compiles each of the two alone, as the fast step compiles them (inductor, fullgraph, static shapes,
gdtool's inductor options), on [batch, width] inputs, and records the compile time and whether the
outputs agree. Each batch of the sorting variant runs in a child process with a time limit, so one
compile that does not end is recorded as such and the others still run. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch


def two_sorts(values, ids):
    ids, by_id = torch.sort(ids, dim=-1)
    values, by_value = torch.sort(values.gather(-1, by_id), dim=-1, stable=True)
    return values, ids.gather(-1, by_value)


VARIANTS = ("counting", "two-sorts")


def _compile_once(variant: str, batch: int, width: int, queue) -> None:
    from gdtool.kernels import step as fast, sampling as fast_sampling
    fn = {"two-sorts": two_sorts, "counting": fast_sampling.ascending}[variant]
    gen = torch.Generator().manual_seed(batch)
    values = (torch.randint(-40, 40, (batch, width), generator=gen).float() / 8).cuda()
    ids = torch.stack([torch.randperm(128256, generator=gen)[:width] for _ in range(batch)]).cuda()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False, options=fast.INDUCTOR_OPTIONS)
    t0 = time.perf_counter()
    got = compiled(values, ids)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    want = two_sorts(values, ids)
    queue.put(dict(variant=variant, batch=batch, width=width, compile_s=round(compile_s, 2),
                   equal_to_eager_sorts=bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))))


def run(variant: str, batch: int, width: int, limit_s: float) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_compile_once, args=(variant, batch, width, queue))
    t0 = time.perf_counter()
    child.start()
    child.join(limit_s)
    if child.is_alive():
        child.kill()
        child.join()
        return dict(variant=variant, batch=batch, width=width, compile_s=None,
                    status=f"not done after {limit_s:.0f} s (killed)")
    if queue.empty():
        return dict(variant=variant, batch=batch, width=width, compile_s=None,
                    status=f"child exited {child.exitcode} after {time.perf_counter() - t0:.0f} s")
    return queue.get() | dict(status="ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--width", type=int, default=66, help="candidates: top_k 50 + the sampler's tie slack 16")
    p.add_argument("--variants", default="counting,two-sorts")
    p.add_argument("--limit", type=float, default=90.0, help="seconds per compile before it is called not done")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in args.variants.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            rows.append(run(variant, batch, args.width, args.limit))
            print(json.dumps(rows[-1]), flush=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
