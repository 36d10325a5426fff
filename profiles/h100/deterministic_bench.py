"""`python -m gdtool bench` with inductor's `deterministic` option on (1) or as gdtool runs it (0), in one process.

    python profiles/h100/deterministic_bench.py 1 OUT --model llama-1b --batch 64 --modes step-graph+compiled ...

Fresh compiles of one case gave two results over 8 processes with gdtool's inductor options and one with
`deterministic` on (`fresh-compiles/`); this asks what the option costs in speed. It sets
`gdtool.kernels.step.INDUCTOR_OPTIONS` as `profiles/fresh_compiles.py` does, then runs the bench in the same process.
"""
import sys

import gdtool.kernels.step as step

deterministic, out = sys.argv[1] == "1", sys.argv[2]
if deterministic:
    step.INDUCTOR_OPTIONS = dict(step.INDUCTOR_OPTIONS, deterministic=True)
print("inductor options:", step.INDUCTOR_OPTIONS, flush=True)
from gdtool.__main__ import main  # noqa: E402

sys.exit(main(["bench"] + sys.argv[3:] + ["--out", out]))
