"""The linear layers at up to 64 rows on the tensor cores: gdtool's split-K `tl.dot` kernel.

Past the matrix-vector kernels' rows (or where the batch line gave the batch to the matmuls), the fast step's
products are cuBLAS's. At 64 rows its kernels read the narrow projections far from the copy bandwidth: on the H100's
64-row trace of Llama-1B (`profiles/h100/nsys-fast/`) o read at 43% of it, q/k/v at 57%, down at 67% with its split-K
reduction a kernel of its own, while gate/up and the lm_head reached 88-95%. A 2048 x 2048 product in 128-column
tiles is 16 programs on 132 multiprocessors; its bytes are 8 MB, 2.7 us at 3 TB/s.

`dot_linear(x, w, bias)` = F.linear for x [M <= 64, K]: each program multiplies all M rows (padded to a tile of 16, 32
or 64) by BLOCK_N columns of w over one slice of K, in BLOCK_K chunks that Triton pipelines through shared memory
(`num_stages`); SPLIT slices of K spread the columns' tiles over the GPU. The sums are float32, bf16/fp16 operands
(float32 ones at torch's matmul precision, `dot_precision`). With SPLIT > 1 each program stores its slice's sums to a
float32 workspace [SPLIT, M, N]; the last of a column tile's programs to finish (an acq_rel count, as the fused
attention combine's) adds the slices in slice order, adds the bias, rounds once and stores: one launch, no
reduction kernel, and the same bits whichever program finishes last. Another order of additions than cuBLAS's, so
close to it, not its bits; captured, the same bits as uncaptured.

Its tiles are the tuning's section `dot` (`config_for`): BLOCK_N columns a program, BLOCK_K a chunk (halved until it
divides K), warps, stages, and SPLIT doubled while the programs stay under `programs_per_sm` a multiprocessor and
each slice keeps at least `min_chunks` chunks. `profiles/decode_kernels_probe.py --parts gemv --dot` (gpu_run.sh's
`kernels-dot`) times it beside cuBLAS per projection; `linear.py` swaps it into the compiled HF forward
(GDTOOL_DOT_LINEAR, off by default until a bench shows it ahead of cuBLAS's products).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import tuning
from .triton import HAVE_TRITON, cdiv, dot_precision, interpreting, next_pow2, tl, triton, usable, zero_counts

BLOCK_M = 16    # the smallest tile of rows Triton's dot takes: rows are padded to 16, 32 or 64
MAX_ROWS = 64   # rows one program holds: one tile of rows
PATH = f"linear, split-K dot, <= {MAX_ROWS} rows"   # the kernel path's names (CUDA_TESTED)
PATH_BIAS = f"linear, bias, split-K dot, <= {MAX_ROWS} rows"


class Config(NamedTuple):
    """One launch's tiles: columns a program, K a chunk, slices of K, warps, pipeline stages."""
    block_n: int
    block_k: int
    split: int
    warps: int
    stages: int


def block_m(m: int) -> int:
    """The tile of rows: at least BLOCK_M, the next power of two of m."""
    return max(BLOCK_M, next_pow2(m))


def config_for(m: int, n: int, k: int, tune: tuning.Tuning | None = None) -> Config:
    """The tuning's tiles for an [m, k] x [k, n] product (section `dot`, the module's doc)."""
    tune = tune or tuning.current()
    section = tune["dot"]
    block_k = section["block_k"]
    while block_k > 16 and k % block_k:
        block_k //= 2
    tiles = cdiv(n, section["block_n"])
    programs = section["programs_per_sm"] * tune.multiprocessors
    split = 1
    while tiles * split * 2 <= programs and k // (2 * split) >= section["min_chunks"] * block_k:
        split *= 2
    return Config(section["block_n"], block_k, split, section["warps"], section["stages"])


if HAVE_TRITON:
    @triton.jit
    def _dot_kernel(x_ptr, w_ptr, b_ptr, out_ptr, work_ptr, count_ptr, M, N, K, k_slice,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    BIAS: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
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
            if UPCAST:   # Triton's interpreter: its bf16 dot is wrong (3.9: sums off by 1e11); bf16 x bf16 is exact in
                x, w = x.to(tl.float32), w.to(tl.float32)   # float32, whose dot it gets right ("ieee")
            acc += tl.dot(x, w, input_precision=DOT)
        keep = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            _finish(acc, b_ptr, out_ptr, rm, rn, keep, N, BIAS)
        else:
            tl.store(work_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=keep)
            # the last of the column tile's SPLIT programs to finish: every thread's stores done (the barrier), then
            # one acq_rel count; it sets the count back to 0 for the next call (the next kernel to use it waits for
            # this one's end), and adds the slices in slice order (past L1: other programs stored them just before)
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.store(count_ptr + pid_n, 0)
                total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(work_ptr + s * M * N + rm[:, None] * N + rn[None, :], mask=keep, other=0.0,
                                     cache_modifier=".cg")
                _finish(total, b_ptr, out_ptr, rm, rn, keep, N, BIAS)

    @triton.jit
    def _finish(total, b_ptr, out_ptr, rm, rn, keep, N, BIAS: tl.constexpr):
        """The float32 sums plus the bias (float32), rounded once to the output's dtype, stored."""
        if BIAS:
            total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], total.to(out_ptr.dtype.element_ty), mask=keep)


def check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """ValueError naming the problem where the kernel does not take these operands."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: give x [M, K] and w [N, K]")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{x.shape[0]} rows: the dot kernel holds the rows in one tile and takes at most {MAX_ROWS}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: give contiguous x [M, K] and w [N, K]")
    if x.dtype != w.dtype or (bias is not None and (bias.dtype != w.dtype or bias.shape != (w.shape[0],))):
        raise ValueError(f"x {x.dtype}, w {w.dtype}, bias {None if bias is None else (bias.dtype, tuple(bias.shape))}: "
                         "give operands of one dtype and a bias [N]")


def dot_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               config: Config | tuple | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [M <= 64, K], w [N, K] contiguous, on the tensor cores (the module's doc);
    `config`: a Config or its tuple (the probe's sweep), else the device's tuning's."""
    check(x, w, bias)
    m, k = x.shape
    n = w.shape[0]
    c = Config(*config) if config is not None else config_for(m, n, k, tuning.current(x.device))
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    k_slice = cdiv(cdiv(k, c.split), c.block_k) * c.block_k   # whole chunks a slice; the last slice masked past K
    tiles = cdiv(n, c.block_n)
    work = torch.empty(c.split, m, n, device=x.device, dtype=torch.float32) if c.split > 1 else out
    counts = zero_counts("dot", tiles, x.device) if c.split > 1 else out
    upcast = interpreting() and x.dtype == torch.bfloat16
    _dot_kernel[(tiles, c.split)](x, w, bias if bias is not None else out, out, work, counts, m, n, k, k_slice,
                                  BLOCK_M=block_m(m), BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT=c.split,
                                  BIAS=bias is not None, DOT="ieee" if upcast else dot_precision(x.dtype),
                                  UPCAST=upcast, num_warps=c.warps,
                                  num_stages=c.stages)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in torch: float32 sums, the bias added in float32, one rounding."""
    out = F.linear(x.float(), w.float())
    return (out + bias.float() if bias is not None else out).to(x.dtype)


@torch.library.custom_op("gdtool::dot_linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS: the kernel where Triton runs on these tensors, F.linear
    elsewhere (`linear.py` swaps it into the compiled HF forward: opaque to dynamo and inductor)."""
    if usable(x, weight):
        return dot_linear(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])
