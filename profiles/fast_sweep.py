"""The `kernels="fast"` sweep of `tests/test_fast_kernels.py`, deeper than the test suite can afford: many seeds.

Each seed draws `--per-model` cases of each tiny model of the fast forward's families (`tests/fastcases.py`: Llama,
Qwen2, Qwen3, Mistral with a window wider or narrower than the cache, Gemma 3, Qwen3-MoE, Mixtral, Qwen2-MoE),
1-64 rows against the default line or one moved to 0-16 rows, left padding, 2-14 new tokens, greedy or
sampling with a repetition penalty, EOS off or firing in some rows, the split-K dot kernel switched on in half of
them (where the batch runs HF's forward compiled past the matrix-vector rows). Each case decodes in every mode against
generate(): the tokens generate()'s, every mode's tokens and scores bit for bit its uncaptured twin's, and the step's
account naming the path the plan chose (one pass, passes, the compiled matmuls past the line, or refused).
The test suite runs seed 0's sample; this runs the seeds asked for.

    python profiles/fast_sweep.py --seeds 1-20 --jobs 2                   # the torch references, ~8 s a case
    python profiles/fast_sweep.py --seeds 1-5 --models tiny-qwen3 tiny-gemma3 --interpret   # Triton's kernels

A case past the line compiles HF's forward (~10 s on a CPU); `--wide 0` leaves those out. With `--interpret`
the fast forward runs Triton's kernels under its CPU interpreter (Triton installed), not the torch references.

It prints a line per (seed, case) and ends with the count of cases per path and of mismatches; the exit
status is 1 when any case mismatched (each is printed with its case name, which names every draw).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
if "--interpret" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"   # read where Triton's kernels are defined: before gdtool is imported

from window_sweep import span  # noqa: E402
from zoo_table import quiet_worker  # noqa: E402


def _job(case) -> tuple[object, str, list[str], float]:
    import fastcases
    start = time.perf_counter()
    return case, fastcases.path(case), fastcases.run(case), time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=span, default=span("1-5"), help="seeds, N or A-B (the suite runs 0)")
    parser.add_argument("--per-model", type=int, default=2, help="cases per model and seed")
    parser.add_argument("--models", nargs="+", default=None,
                        help="models of tests/fastcases.py's MODELS (default: all)")
    parser.add_argument("--wide", type=float, default=0.15, help="share of batches past 16 rows (0 to 1)")
    parser.add_argument("--interpret", action="store_true", help="Triton's kernels under its CPU interpreter")
    parser.add_argument("--jobs", type=int, default=1, help="processes, one torch thread each")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.per_model < 1:
        parser.error("--jobs and --per-model: give 1 or more")
    if not 0 <= args.wide <= 1:
        parser.error(f"--wide {args.wide}: a share, from 0 to 1")
    import fastcases
    from gdtool.kernels import triton as fast_triton
    from gdtool.measure.record import describe
    unknown = sorted(set(args.models or ()) - set(fastcases.MODELS))
    if unknown:
        parser.error(f"--models {' '.join(unknown)}: not in tests/fastcases.py; "
                     f"these are: {' '.join(fastcases.MODELS)}")
    if args.interpret and not fast_triton.HAVE_TRITON:
        parser.error("--interpret: Triton is not installed (pip install triton; a CPU build of torch has none)")
    models = tuple(args.models or fastcases.MODELS)
    cases = [case for seed in args.seeds for case in fastcases.cases(args.per_model, seed, models, args.wide)]
    print(f"{describe()}\n{len(cases)} cases: seeds {args.seeds.start}-{args.seeds.stop - 1}, {args.per_model} a model "
          f"each; {'Triton kernels, interpreted' if args.interpret else 'torch references'}", flush=True)
    dots = sum(fastcases.dot_swap(case) for case in cases)
    start, paths, failures = time.perf_counter(), Counter(), []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=quiet_worker) if args.jobs > 1 else nullcontext() as pool:
        for case, path, failed, seconds in (pool.map(_job, cases) if pool else map(_job, cases)):
            paths[path] += 1
            failures += failed
            print(f"[{time.perf_counter() - start:7.0f} s] {path:8s} {case.name}: "
                  f"{'ok' if not failed else f'{len(failed)} mismatched'} ({seconds:.1f} s)", flush=True)
            for line in failed:
                print(f"    {line}", flush=True)
    print(f"{len(cases)} cases ({', '.join(f'{paths[p]} {p}' for p in fastcases.PATHS)}; {dots} with the dot swap), "
          f"{len(failures)} mismatched, in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    quiet_worker()
    sys.exit(main())
