"""The sliding-window sweep of `tests/test_windows.py`, deeper than the test suite can afford: many seeds.

Each (architecture, seed) draws `--per-fill` cases for every place the window can fill (`tests/windows.py`:
during the prefill, at decode step 1 or 2, later, never), random in window, prompt width, left padding,
new tokens, greedy or sampling with a repetition penalty, all-sliding or mixed layers and the EOS polling
interval, and decodes each in every mode against generate(), tokens and processed scores bit for bit. The
test suite runs seed 0 of every architecture; this runs the seeds asked for, over wider ranges if asked.

    python profiles/window_sweep.py --seeds 1-40 --jobs 2          # every sliding-window architecture
    python profiles/window_sweep.py --seeds 1-200 --arch gemma3_text mistral --windows 3-20 --widths 2-24
    python profiles/window_sweep.py --seeds 1-20 --arch gemma3_text gpt_oss --kernels fast   # Triton's interpreter

With `--kernels compiled` or `fast` each case decodes greedily with those kernels, eager and step-graph, as
`test_sliding_windows_with_gdtool_kernels` does: the two modes bit for bit alike and the tokens generate()'s.

It prints a line per (architecture, seed) and ends with the count of cases and mismatches; the exit status
is 1 when any case mismatched (each is printed with its case name, which `windows.Case` rebuilds).
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gdtool.measure.record import describe  # noqa: E402
from zoo_table import quiet_worker  # noqa: E402


def span(text: str) -> range:
    """'A-B' (inclusive) or 'A' as a range."""
    low, _, high = text.partition("-")
    try:
        return range(int(low), int(high or low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or A-B (inclusive), e.g. 1-40") from None


def _job(job) -> tuple[str, int, int, list[str], float]:
    arch, seed, per_fill, ranges, kernels = job
    import windows
    start = time.perf_counter()
    patterns = windows.patterns_of(arch)
    if not patterns:
        return arch, seed, 0, [], 0.0
    cases = windows.cases(arch, patterns, per_fill=per_fill, seed=seed, **ranges)
    failures = [f for case in cases
                for f in (windows.run_kernels(case, kernels) if kernels else windows.run(case))]
    return arch, seed, len(cases), failures, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=span, default=span("1-10"), help="seeds, N or A-B (the suite runs 0)")
    parser.add_argument("--per-fill", type=int, default=1, help="cases per place the window fills, per seed")
    parser.add_argument("--arch", nargs="+", default=None, help="architectures (default: every one with a window)")
    parser.add_argument("--windows", type=span, default=span("3-8"), help="sliding windows drawn from")
    parser.add_argument("--widths", type=span, default=span("2-10"), help="padded prompt widths drawn from")
    parser.add_argument("--new-tokens", type=span, default=span("2-12"), help="new tokens drawn from")
    parser.add_argument("--kernels", choices=("compiled", "fast"), default=None,
                        help="decode with these kernels (greedy, eager and step-graph) instead of every mode")
    parser.add_argument("--jobs", type=int, default=1, help="processes, one torch thread each")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.per_fill < 1:
        parser.error("--jobs and --per-fill: give 1 or more")
    if min(args.windows) < 2:
        parser.error(f"--windows {args.windows.start}-{args.windows.stop - 1}: a window of fewer than 2 slots")
    import windows
    known = windows.architectures()
    archs = args.arch or known
    unknown = sorted(set(archs) - set(known))
    if unknown:
        parser.error(f"--arch {' '.join(unknown)}: no sliding window in the installed transformers; "
                     f"these have one: {' '.join(known)}")
    ranges = dict(windows=args.windows, widths=args.widths, new_tokens=args.new_tokens)
    jobs = [(arch, seed, args.per_fill, ranges, args.kernels) for arch in archs for seed in args.seeds]
    print(f"{describe()}\n{len(archs)} architectures x "
          f"seeds {args.seeds.start}-{args.seeds.stop - 1}, {args.per_fill} case(s) per fill place; windows "
          f"{args.windows.start}-{args.windows.stop - 1}, widths {args.widths.start}-{args.widths.stop - 1}, "
          f"new tokens {args.new_tokens.start}-{args.new_tokens.stop - 1}"
          + (f"; kernels={args.kernels}" if args.kernels else ""), flush=True)
    start, total, failures, skipped = time.perf_counter(), 0, [], set()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=quiet_worker) if args.jobs > 1 else nullcontext() as pool:
        for arch, seed, n, failed, seconds in (pool.map(_job, jobs) if pool else map(_job, jobs)):
            if n == 0:
                skipped.add(arch)
                continue
            total += n
            failures += failed
            print(f"[{time.perf_counter() - start:7.0f} s] {arch} seed {seed}: {n} cases, {len(failed)} mismatched "
                  f"({seconds:.1f} s)", flush=True)
            for line in failed:
                print(f"    {line}", flush=True)
    if skipped:
        print(f"not built with a window at tiny size (the zoo says why): {' '.join(sorted(skipped))}")
    print(f"{total} cases, {len(failures)} mismatched, in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    quiet_worker()
    sys.exit(main())
