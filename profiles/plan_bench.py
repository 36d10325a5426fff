"""`python -m gdtool bench` with the split-KV attention's plan set: TARGET_PROGRAMS (`attention.split_plan`,
which the fused combine's plan starts from), the switches GDTOOL_FUSED_COMBINE, GDTOOL_EARLY_NORM,
GDTOOL_ONE_KERNEL_TAIL and GDTOOL_LATE_TRIGGER (the products' PDL trigger in their last tile round), and the largest
batch the matrix-vector kernels take (`forward.BATCH_PATHS`: one line for every shape), for an A/B of plans in the step.

    python profiles/plan_bench.py --target 132 [--fused 0|1] [--early-norm 0|1] [--tail 0|1] [--late-trigger 0|1] \
        [--gemv-rows N] -- --model llama-1b ...

Prints the settings, then runs the bench in this process (its log and files as `python -m gdtool bench`'s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdtool import __main__ as cli  # noqa: E402
from gdtool.kernels import attention, forward, gemv, tail  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=attention.TARGET_PROGRAMS,
                        help=f"split_plan's TARGET_PROGRAMS (default {attention.TARGET_PROGRAMS})")
    parser.add_argument("--fused", type=int, choices=(0, 1), default=None, help="the fused combine off (0) or on (1)")
    parser.add_argument("--early-norm", type=int, choices=(0, 1), default=None,
                        help="the norms' weights loaded before the PDL wait (1) or after it (0)")
    parser.add_argument("--tail", type=int, choices=(0, 1), default=None,
                        help="the greedy step's tail in one kernel (1) or the argmax's two and the compiled update (0)")
    parser.add_argument("--late-trigger", type=int, choices=(0, 1), default=None,
                        help="the matrix-vector products let the next kernel launch after their PDL wait (0) or as "
                             "their last tile round starts (1; untested on CUDA until its cuda tests pass)")
    parser.add_argument("--gemv-rows", type=int, default=None,
                        help=f"the largest batch of the matrix-vector kernels for Llama, Mistral, Qwen2, Qwen3 at "
                             f"every shape (forward.BATCH_PATHS; default: forward.MEASURED_LINES per hidden size, "
                             f"{forward.MEASURED_LINES}; 0 to {gemv.MAX_ROWS}, 0: none); past it the compiled matmuls")
    args = parser.parse_args(ours)
    if args.gemv_rows is not None:
        try:
            forward.BATCH_PATHS = forward.gemv_line(args.gemv_rows)
        except ValueError as e:
            parser.error(str(e))
    attention.TARGET_PROGRAMS = args.target
    if args.fused is not None:
        attention._FUSED_COMBINE = bool(args.fused)
    if args.early_norm is not None:
        gemv._EARLY_NORM = bool(args.early_norm)
    if args.tail is not None:
        tail._ON = bool(args.tail)
    if args.late_trigger is not None:
        gemv._LATE_TRIGGER = bool(args.late_trigger)
    print(f"[plan_bench] TARGET_PROGRAMS {attention.TARGET_PROGRAMS}, fused combine "
          f"{'on' if attention._FUSED_COMBINE else 'off'}, early norm {'on' if gemv._EARLY_NORM else 'off'}, "
          f"one-kernel tail {'on' if tail._ON else 'off'}, PDL trigger {'late' if gemv._LATE_TRIGGER else 'early'}, "
          "matrix-vector kernels to batch " + (str(forward.gemv_rows(forward.BATCH_PATHS)) if forward.BATCH_PATHS
                                                 else f"per hidden size {forward.MEASURED_LINES}"),
          flush=True)
    return cli.main(["bench", *bench])


if __name__ == "__main__":
    sys.exit(main())
