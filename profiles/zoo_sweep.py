"""The zoo at random shapes, deeper than the test suite can afford: every causal-LM case, many draws.

The zoo test decodes one prompt per architecture (3 rows, 7 wide, 12 new tokens) and a seeded sample of the
architectures at one random shape each (`tests/test_zoo.py::test_zoo_at_random_shapes`). This runs every
causal-LM case of the installed transformers (sliding-window variants among them) at `--shapes` draws of
`zoo.shapes` each (1-6 rows, 1-12 ids, any left padding, 2-16 new tokens), in every case and mode of the
zoo, against generate() bit for bit, as the zoo test does.

    python profiles/zoo_sweep.py --shapes 3 --jobs 2                 # every case, 3 shapes each
    python profiles/zoo_sweep.py --shapes 20 --arch olmo_hybrid qwen3_next --seed 7
    python profiles/zoo_sweep.py --shapes 6 --jobs 2 --skip falcon_h1    # transformers 5.17 (below)

A line per case and shape; a mismatch or a crash is printed with the shape that rebuilds it. A case whose
tiny model does not build or that generate() cannot decode is counted apart (the zoo test says which and why);
so is one whose every mode refuses. The exit status is 1 when any case mismatched or crashed. On transformers
5.17 the tiny Falcon-H1 asks for 24 GiB (the zoo test lists it): with two jobs on a 24 GB machine the kernel
kills its worker, which ends the sweep (it names the cases in flight); `--skip` leaves such types out.
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gdtool.measure.record import describe  # noqa: E402
from zoo_table import quiet_worker  # noqa: E402


def _job(job) -> tuple[str, dict, dict, float]:
    name, model_type, overrides, shape = job
    import zoo
    start = time.perf_counter()
    try:
        found = zoo.outcome(model_type, overrides, shape=shape)
    except Exception as error:  # noqa: BLE001 - a crash in a mode (not a refusal): reported with its shape
        found = {"status": "crashed", "error": f"{type(error).__name__}: {error}"}
    return name, shape, found, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", type=int, default=3, help="random shapes per case")
    parser.add_argument("--seed", type=int, default=0, help="the draws' seed (the test suite's sample uses none)")
    parser.add_argument("--arch", nargs="+", default=None, help="model types (default: every causal LM)")
    parser.add_argument("--skip", nargs="+", default=(), help="model types left out")
    parser.add_argument("--jobs", type=int, default=1, help="processes, one torch thread each")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.shapes < 1:
        parser.error("--jobs and --shapes: give 1 or more")
    import transformers
    import zoo
    known = zoo.architectures()
    unknown = sorted((set(args.arch or ()) | set(args.skip)) - set(known))
    if unknown:
        parser.error(f"--arch/--skip {' '.join(unknown)}: not a causal LM of transformers {transformers.__version__}")
    cases = []
    for model_type in [t for t in args.arch or known if t not in args.skip]:
        try:
            variants = zoo.variants(model_type)
        except Exception:  # noqa: BLE001 - a config class that cannot be built with defaults: the zoo reports it
            variants = [(model_type, {})]
        cases += [(name, model_type, overrides) for name, overrides in variants]
    jobs = [(name, model_type, overrides, dataclasses.asdict(shape)) for name, model_type, overrides in cases
            for shape in zoo.shapes(f"{args.seed}-{name}", args.shapes)]
    print(f"{describe()}\n{len(cases)} cases x {args.shapes} shapes, seed {args.seed}", flush=True)
    start, counts, bad = time.perf_counter(), {"ran": 0, "refused": 0, "not in the zoo": 0}, []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=quiet_worker) if args.jobs > 1 else nullcontext() as pool:
        futures = [pool.submit(_job, job) for job in jobs] if pool else None
        for index, job in enumerate(jobs):
            try:
                name, shape, found, seconds = futures[index].result() if futures else _job(job)
            except BrokenProcessPool:
                flight = sorted({j[1] for j in jobs[index:index + args.jobs + 1]})  # results come in order
                print(f"a worker died (killed for memory?) with one of these in flight: {' '.join(flight)}; "
                      f"run again with --skip <its type>", flush=True)
                return 1
            status = found["status"]
            results = [r for *_, r in found.get("results", [])]
            if status == "ran":
                kind = "refused" if results and all(r.startswith("refused") for r in results) else "ran"
            elif status in ("not built", "generate failed", "small vocabulary"):
                kind = "not in the zoo"
            else:
                kind = status
                bad.append(f"{name} {shape}: {status}: {found.get('error', '')[:300]}")
            counts[kind] = counts.get(kind, 0) + 1
            print(f"[{time.perf_counter() - start:7.0f} s] {name} b{shape['batch']} p{shape['width']} "
                  f"pads{shape['pads']} n{shape['new_tokens']} seed {shape['seed']}: {kind} ({seconds:.1f} s)",
                  flush=True)
            if kind not in ("ran", "refused", "not in the zoo"):
                print(f"    {bad[-1]}", flush=True)
    print(", ".join(f"{v} {k}" for k, v in counts.items()) + f"; {len(bad)} mismatched or crashed, in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    quiet_worker()
    sys.exit(main())
