"""The tensor-core probe's configs: the tiles `decode_kernels_probe.py --parts gemv --dot` (gpu_run.sh's `kernels-dot`)
times gdtool's split-K dot kernel at (`gdtool/kernels/dot.py`), beside cuBLAS and the matrix-vector kernel.

At 2-4 rows gdtool's matrix-vector kernels hold whole rows of x in registers and lose to cuBLAS (llama-8b's step:
6.03-6.12 ms against 4.79-4.90 at 3-4 rows, H200, profiles/h200/bench/batches/curves.md); reading K in chunks on the
CUDA cores cut the registers but ran 1.6-2.6x slower still (its loop of loads and sums, not pipelined). A `tl.dot`
loop over K is what Triton software-pipelines (`num_stages`): the weights stream through shared memory in flight
while the previous chunk multiplies, x's 16 padded rows cost one small tile a chunk, and the rows past the batch's
are free on the tensor cores. At 64 rows (past the matrix-vector kernels, where the fast step runs cuBLAS's products)
the question is whether it reaches cuBLAS on the narrow products (llama-1b's o and q/k/v read at 43-57% of the copy
bandwidth in the H100's 64-row trace, `profiles/h100/nsys-fast/`), as a kernel whose prologue could later take the
RMSNorm and epilogue the residual add. The kernel itself, its split-K slices added in one launch, is gdtool's
(`dot.dot_linear`, swapped into the step with GDTOOL_DOT_LINEAR=1); this module only lists the configs to time.
"""
from __future__ import annotations

from gdtool.kernels import dot, tuning


def default_config(m: int, n: int, k: int, tune: tuning.Tuning | None = None) -> tuple:
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages): the tuning's (`dot.config_for`; the defaults without one)."""
    return tuple(dot.config_for(m, n, k, tune or tuning.defaults()))


def sweep_configs(m: int, n: int, k: int, tune: tuning.Tuning | None = None) -> list[tuple]:
    """The default and its neighbours: half and twice the columns, 64- and 256-wide chunks, half and twice the split,
    3 stages."""
    bn, bk, split, warps, stages = default_config(m, n, k, tune)
    out = [(bn, bk, split, warps, stages), (bn // 2, bk, split, warps, stages), (bn * 2, bk, split, 8, stages),
           (bn, bk // 2, split, warps, stages), (bn, bk * 2, split, warps, 3),
           (bn, bk, max(1, split // 2), warps, stages), (bn, bk, split * 2, warps, stages), (bn, bk, split, warps, 3)]
    return [c for i, c in enumerate(out) if c not in out[:i] and c[0] >= 16 and c[1] >= 16]
