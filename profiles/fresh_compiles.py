"""Does a fresh compile decode the same? One fast-sweep case, each time in a new process with inductor's caches off.

The compiled step is bit for bit itself, captured or not, run after run in one process. A new process compiles
anew, and inductor times some reductions' configs when it compiles and keeps the fastest; a config can change
rounding. On the H200 at 48346b3 one case of the CUDA fast sweep (`tests/fastcases.py`, seed 1, the case seeded
5193) had its step-graph apart from eager in the suite's process and not in another (`profiles/h200/tests/
modes-48346b3.txt`). This runs a case `--processes` times under each setting and says, per mode, how many
different results (tokens and scores, hashed) the processes gave:

    default        inductor as gdtool runs it (`gdtool.kernels.step.INDUCTOR_OPTIONS`)
    deterministic  the same options with inductor's `deterministic` on: only configs that keep the rounding
                   (torch 2.13 has it; a torch without it says so, and the setting runs as the default)

Not TORCHINDUCTOR_DETERMINISTIC=1: dynamo puts `torch.use_deterministic_algorithms` back as it found it after
each compile, and that sets inductor's flag to match (off), so the variable holds for the first compile only.

    python profiles/fresh_compiles.py --case 5193 --processes 4                      # on the GPU, bf16
    python profiles/fresh_compiles.py --case 5193 --processes 8 --jobs 8             # 8 at once, as -n 8 would
    python profiles/fresh_compiles.py --case 5193 --eos-off --modes eager step-graph device-loop

One result per mode and setting means fresh compiles agree there. Exit 0 when every process ran (whatever they
gave), 2 when one failed (its output is printed).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
SETTINGS = ("default", "deterministic")
MODES = ("eager", "forward-graph", "step-graph", "device-loop")


def find_case(sweep_seed: int, per_model: int, seed: int, eos_off: bool):
    """The case of `fastcases.cases(per_model, sweep_seed)` whose own seed is `seed` (EOS off if asked)."""
    import fastcases
    found = [c for c in fastcases.cases(per_model, seed=sweep_seed) if c.seed == seed]
    if not found:
        raise SystemExit(f"fresh_compiles.py: no case seeded {seed} in fastcases.cases({per_model}, seed="
                         f"{sweep_seed}); the case's seed is the number after '-s' at the end of its name")
    return dataclasses.replace(found[0], eos=None) if eos_off else found[0]


def digest(out) -> str:
    """The tokens and scores of one decode, hashed."""
    h = hashlib.sha256(out.tokens.cpu().numpy().tobytes())
    for scores in out.scores:
        h.update(scores.cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def child(case, device: str, modes: list[str], setting: str) -> dict:
    """Decode `case` with kernels="fast" in `modes` (as fastcases.run does, EOS from eager's decode) -> hashes."""
    import torch
    import torch._inductor.config as inductor
    import fastcases
    from gdtool.kernels import step
    from reference import decode
    from windows import prompt
    known = hasattr(inductor, "deterministic")
    asked = {"deterministic": True} if setting == "deterministic" and known else {}
    with step.inductor_options(**asked) as options:   # this child's compiles: one process, one setting
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = fastcases.build(case.model, device, dtype)
        ids, mask = prompt(case, device)
        settings = dict(fastcases.SAMPLING) if case.sampling else dict(do_sample=False)
        settings.update(eos_token_id=None, pad_token_id=0)
        hashes = {}
        with fastcases.line(case.line):
            if case.eos is not None:
                tokens = decode(model, ids, mask, case.new_tokens, seed=case.seed, kernels="fast", **settings).tokens
                settings["eos_token_id"] = int(tokens[case.eos])
            for mode in modes:
                poll = case.poll if mode == "step-graph" else None
                hashes[mode] = digest(decode(model, ids, mask, case.new_tokens, seed=case.seed, mode=mode,
                                             eos_poll_interval=poll, kernels="fast", **settings))
    flag = options.get("deterministic", False) if known else "not in this torch"
    return {"deterministic": flag, "torch": torch.__version__, "hashes": hashes}


def tally(results: dict[str, list[dict]], modes: list[str]) -> list[str]:
    """Per setting and mode: how many different results its processes gave."""
    lines = []
    for setting, runs in results.items():
        flags = sorted({str(r["deterministic"]) for r in runs})
        lines.append(f"{setting} (processes: {len(runs)}; inductor's deterministic option: {', '.join(flags)})")
        for mode in modes:
            seen = defaultdict(int)
            for r in runs:
                seen[r["hashes"][mode]] += 1
            verdict = "fresh compiles agree" if len(seen) == 1 else f"{len(seen)} different results"
            lines.append(f"  {mode:14s} {verdict}: " + ", ".join(f"{h} x{n}" for h, n in seen.items()))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--case", type=int, required=True, help="the case's own seed (its name ends in -sSEED)")
    parser.add_argument("--sweep-seed", type=int, default=1, help="the sweep's seed (the cuda test's is 1)")
    parser.add_argument("--per-model", type=int, default=3, help="the sweep's cases a model (the cuda test's: 3)")
    parser.add_argument("--eos-off", action="store_true", help="the case with EOS off")
    parser.add_argument("--processes", type=int, default=4, help="fresh processes per setting")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--setting", default="default", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=["eager", "step-graph"], choices=MODES)
    parser.add_argument("--jobs", type=int, default=1, help="processes at once (they share the device; inductor "
                        "times its configs under that load, as the suite's workers do)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes: give 1 or more")
    if args.jobs < 1:
        parser.error("--jobs: give 1 or more")
    device = args.device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        parser.error(f"--device {device!r}: give cuda or cpu")
    case = find_case(args.sweep_seed, args.per_model, args.case, args.eos_off)
    if args.child:
        print(json.dumps(child(case, device, args.modes, args.setting)))
        return 0
    print(f"{case.name} on {device}, kernels='fast', modes {' '.join(args.modes)}", flush=True)
    passed = list(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def one(setting: str) -> tuple[float, subprocess.CompletedProcess]:
        """A fresh process decoding the case under `setting` -> (its seconds, what it printed)."""
        start = time.perf_counter()
        command = [sys.executable, __file__, *passed, "--device", device, "--setting", setting, "--child"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        return time.perf_counter() - start, run

    results = {}
    for setting in args.settings:
        results[setting] = []
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = [pool.submit(one, setting) for _ in range(args.processes)]
            for i, future in enumerate(runs):
                seconds, run = future.result()
                last = run.stdout.strip().splitlines()[-1:] if run.stdout else []
                if run.returncode != 0 or not last or not last[0].startswith("{"):
                    print(f"{setting} process {i + 1}: exit {run.returncode}\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
                    return 2
                results[setting].append(json.loads(last[0]))
                print(f"[{setting} {i + 1}/{args.processes}] {seconds:.0f} s (done {time.perf_counter() - started:.0f} s "
                      f"from the start) {results[setting][-1]['hashes']}", flush=True)
    print("\n".join(tally(results, args.modes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
