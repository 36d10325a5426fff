"""A probe, not a gdtool kernel: the decode products at 2-64 rows on the tensor cores (`tl.dot`, rows padded to 16 or
the next power of two).

At 2-4 rows gdtool's matrix-vector kernels hold whole rows of x in registers and lose to cuBLAS (llama-8b's step:
6.03-6.12 ms against 4.79-4.90 at 3-4 rows, H200, profiles/h200/bench/batches/curves.md); reading K in chunks on the
CUDA cores cut the registers but ran 1.6-2.6x slower still (its loop of loads and sums, not pipelined). A `tl.dot`
loop over K is what Triton software-pipelines (`num_stages`): the weights stream through shared memory in flight
while the previous chunk multiplies, x's 16 padded rows cost one small tile a chunk, and the rows past the batch's
are free on the tensor cores. Whether such a kernel reaches cuBLAS's 3.2-4.0 TB/s at these shapes is the question
this probe asks before anything of it goes into gdtool/kernels: `decode_kernels_probe.py --parts gemv --dot`
times it beside cuBLAS and the matrix-vector kernel per projection (gpu_run.sh's `kernels-dot`). At 64 rows (past the
matrix-vector kernels, where the fast step runs cuBLAS's products) it asks whether such a kernel, whose prologue could
take the RMSNorm and epilogue the residual add, reaches cuBLAS on the narrow products (llama-1b's o and q/k/v read at
43-57% of the copy bandwidth in the H100's 64-row trace, `profiles/h100/nsys-fast/`).

`dot_linear(x, w, config)` = F.linear(x, w) for x [M <= 64, K], w [N, K]: float32 sums of the bf16/fp16 products, one
rounding at the end; with SPLIT_K > 1 each program sums a slice of K into a float32 workspace [SPLIT_K, M, N] and
the slices are added in a fixed order (torch.sum over dim 0): deterministic, another order of additions than
cuBLAS's, so close to it, not its bits.
"""
from __future__ import annotations

import torch

from gdtool.kernels.triton import HAVE_TRITON, tl, triton

BLOCK_M = 16   # rows padded to the smallest tensor-core tile Triton's dot takes
MAX_ROWS = 64  # rows the probe takes (one tile of rows: BLOCK_M up to 64)


def block_m(m: int) -> int:
    """The tile of rows: at least BLOCK_M, the next power of two of m."""
    return max(BLOCK_M, 1 << max(0, (m - 1).bit_length()))

if HAVE_TRITON:
    @triton.jit
    def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_slice,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        start = pid_k * k_slice
        for k0 in range(start, start + k_slice, BLOCK_K):
            ks = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + ks[:, None], mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)
            acc += tl.dot(x, w)
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def default_config(m: int, n: int, k: int, sms: int = 132) -> tuple:
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages): 64 output columns a program, K in 128-wide chunks (narrower where
    K is no multiple of 128), split so that the programs fill the multiprocessors about twice."""
    block_n, block_k = 64, next((b for b in (128, 64, 32, 16) if k % b == 0), 16)
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < 2 * sms and k // (2 * split) >= 4 * block_k:
        split *= 2
    return block_n, block_k, split, 4, 4


def sweep_configs(m: int, n: int, k: int) -> list[tuple]:
    """The default and its neighbours: half and twice the columns, 64- and 256-wide chunks, half and twice the split,
    3 stages."""
    bn, bk, split, warps, stages = default_config(m, n, k)
    out = [(bn, bk, split, warps, stages), (bn // 2, bk, split, warps, stages), (bn * 2, bk, split, 8, stages),
           (bn, bk // 2, split, warps, stages), (bn, bk * 2, split, warps, 3), (bn, bk, max(1, split // 2), warps, stages),
           (bn, bk, split * 2, warps, stages), (bn, bk, split, warps, 3)]
    return [c for i, c in enumerate(out) if c not in out[:i] and k % (c[1] * c[2]) == 0]


def dot_linear(x: torch.Tensor, w: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """F.linear(x, w) for x [M, K] (M <= 64), w [N, K] contiguous, on the tensor cores (see the module's doc)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{m} rows: the probe's dot kernel holds the rows in one tile and takes at most {MAX_ROWS}")
    if w.shape[1] != k or not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: give contiguous x [M, K] and w [N, K]")
    block_n, block_k, split, warps, stages = config or default_config(m, n, k)
    if k % (block_k * split):
        raise ValueError(f"K {k} is not a multiple of BLOCK_K {block_k} x SPLIT_K {split}")
    work = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n), split)
    _dot_kernel[grid](x, w, work, m, n, k, k // split, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m(m),
                      num_warps=warps, num_stages=stages)
    return (work[0] if split == 1 else work.sum(0)).to(x.dtype)

