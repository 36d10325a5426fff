"""`python -m gdtool bench` with the split-KV attention's plan set: its target programs (`attention.split_plan`,
which the fused combine's plan starts from) and its loop's keys an iteration (`attention.loop_keys`); the switches
GDTOOL_FUSED_COMBINE, GDTOOL_EARLY_NORM, GDTOOL_ONE_KERNEL_TAIL, GDTOOL_LATE_TRIGGER (the products' PDL trigger in
their last tile round), GDTOOL_FOLD_EMBEDDING (the embedding lookup in the first qkv_rope), GDTOOL_SLIDING_SPLIT (a
sliding layer's calls in the compiled HF forward taken as a full layer's), GDTOOL_COMPILED_ARGMAX (the compiled
greedy step's argmax in gdtool's two stages) and GDTOOL_DOT_LINEAR (the linear layers at up to 64 rows in gdtool's
split-K tensor-core kernel); the largest batch the matrix-vector kernels
take (`forward.batch_line`: one line for every shape), passed as a tuning (`tuning.use`) and switches
(`triton.switches`); and inductor's max-autotune for gdtool's compiled programs (`step.INDUCTOR_OPTIONS`: Triton
matmul templates with their epilogues fused, chosen by timing at compile; the peers' own compiles unchanged), for an
A/B of plans in the step.

    python profiles/plan_bench.py --target 132 [--loop-elements N] [--fused 0|1] [--early-norm 0|1] [--tail 0|1] \
        [--late-trigger 0|1] [--fold-embedding 0|1] [--sliding 0|1] [--argmax 0|1] [--dot 0|1] [--gemv-rows N] \
        [--max-autotune 0|1] \
        -- --model llama-1b ...

Prints the settings, then runs the bench in this process (its log and files as `python -m gdtool bench`'s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdtool import __main__ as cli  # noqa: E402
from gdtool.kernels import attention, forward, gemv, tuning  # noqa: E402
from gdtool.kernels import step as kernel_step  # noqa: E402
from gdtool.kernels import triton as fast_triton  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=None,
                        help="split_plan's target programs (default: the device's tuning, attention.programs_per_sm "
                             "times its multiprocessors)")
    parser.add_argument("--loop-elements", type=int, default=None,
                        help="keys x head size a split program loads per iteration of its loop past its early keys "
                             "(`attention.loop_keys`; default: the device's tuning, attention.loop_elements)")
    parser.add_argument("--fused", type=int, choices=(0, 1), default=None, help="the fused combine off (0) or on (1)")
    parser.add_argument("--early-norm", type=int, choices=(0, 1), default=None,
                        help="the norms' weights loaded before the PDL wait (1) or after it (0)")
    parser.add_argument("--tail", type=int, choices=(0, 1), default=None,
                        help="the greedy step's tail in one kernel (1) or the argmax's two and the compiled update (0)")
    parser.add_argument("--late-trigger", type=int, choices=(0, 1), default=None,
                        help="the matrix-vector products let the next kernel launch after their PDL wait (0) or as "
                             "their last tile round starts (1; untested on CUDA until its cuda tests pass)")
    parser.add_argument("--sliding", type=int, choices=(0, 1), default=None,
                        help="a sliding layer's one-token sdpa calls in the compiled HF forward left to HF's sdpa "
                             "(0) or taken as a full layer's, into the split-KV kernels with kernels='fast' (1)")
    parser.add_argument("--argmax", type=int, choices=(0, 1), default=None,
                        help="the compiled HF forward's greedy argmax left to inductor (0) or in gdtool's two-stage "
                             "kernels over the model's logits (1; untested on CUDA until its cuda tests pass)")
    parser.add_argument("--dot", type=int, choices=(0, 1), default=None,
                        help="the linear layers past the matrix-vector kernels' rows (up to 64) left to cuBLAS (0) or "
                             "in gdtool's split-K tensor-core kernel (1; untested on CUDA until its cuda tests pass)")
    parser.add_argument("--fold-embedding", type=int, choices=(0, 1), default=None,
                        help="the embedding lookup in HF's module first (0) or folded into the first qkv_rope (1; "
                             "untested on CUDA until its cuda tests pass)")
    parser.add_argument("--gemv-rows", type=int, default=None,
                        help=f"the largest batch of the matrix-vector kernels for Llama, Mistral, Qwen2, Qwen3 at "
                             f"every shape (default: the device's tuning, batch_lines per hidden size; 0 to "
                             f"{gemv.MAX_ROWS}, 0: none); past it the compiled matmuls")
    parser.add_argument("--max-autotune", type=int, choices=(0, 1), default=None,
                        help="gdtool's compiled programs (the step past the batch line, kernels='compiled') under "
                             "inductor's max-autotune (1) or its default (0, as without the flag)")
    args = parser.parse_args(ours)
    import torch
    tune = tuning.current(torch.device("cuda") if torch.cuda.is_available() else None)
    if args.gemv_rows is not None:
        try:
            tune = forward.batch_line(args.gemv_rows, tune)
        except ValueError as e:
            parser.error(str(e))
    if args.target is not None:
        tune = tune.with_values("attention", programs_per_sm=args.target / tune.multiprocessors)
    if args.loop_elements is not None:
        if args.loop_elements < 1:
            parser.error(f"--loop-elements {args.loop_elements}: give a positive count of elements (e.g. 4096)")
        tune = tune.with_values("attention", loop_elements=args.loop_elements)
    given = {"fused_combine": args.fused, "early_norm": args.early_norm, "one_kernel_tail": args.tail,
             "late_trigger": args.late_trigger, "fold_embedding": args.fold_embedding, "sliding_split": args.sliding,
             "compiled_argmax": args.argmax, "dot_linear": args.dot}
    with fast_triton.switches(**{name: bool(v) for name, v in given.items() if v is not None}):
        on = {name: fast_triton.asked(name) for name in given}
        print(f"[plan_bench] tuning {tune.source}, target programs {attention.target_programs(tune)}, loop elements "
              f"{tune['attention']['loop_elements']}, fused combine "
              f"{'on' if on['fused_combine'] else 'off'}, early norm {'on' if on['early_norm'] else 'off'}, "
              f"one-kernel tail {'on' if on['one_kernel_tail'] else 'off'}, "
              f"PDL trigger {'late' if on['late_trigger'] else 'early'}, "
              f"embedding {'folded' if on['fold_embedding'] else 'apart'}, "
              f"sliding layers {'split-KV' if on['sliding_split'] else 'HF sdpa'}, "
              f"compiled step's argmax {'two-stage' if on['compiled_argmax'] else 'inductor'}, "
              f"linear layers past the matrix-vector rows {'split-K dot' if on['dot_linear'] else 'cuBLAS'}, "
              f"matrix-vector kernels to batch (per hidden size) {forward.measured_lines(tune)}, "
              f"max-autotune {'on' if args.max_autotune else 'off'}", flush=True)
        tuned = {"max_autotune": True} if args.max_autotune else {}
        with tuning.use(tune), kernel_step.inductor_options(**tuned):   # gdtool's kernels and programs; not the peers'
            return cli.main(["bench", *bench])


if __name__ == "__main__":
    sys.exit(main())
