"""profiles/cuda_compile.py: gdtool's Triton kernels compiled for Hopper (sm_90a) on a CPU, no GPU needed.

The interpreter tests run the kernels' arithmetic; they do not compile them, and a GPU compiles more strictly
than the interpreter runs. These hold the compile check to the failures it exists for (each of them runs
under the interpreter and fails on a GPU), then run it over every kernel of gdtool."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (a CPU build of torch has none)")

KERNELS = '''
import triton
import triton.language as tl

SCALE = 3   # a plain int, not tl.constexpr(3)


def double(x):   # a helper without @triton.jit
    return x * 2


@triton.jit
def fine(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2)


@triton.jit
def calls_a_plain_function(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, double(tl.load(x_ptr + offs)))


@triton.jit
def reads_a_plain_global(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * SCALE)


@triton.jit
def tiles_past_shared_memory(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + k + cols[None, :])
        b = tl.load(b_ptr + (k + cols[:, None]) * BLOCK + rows[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * BLOCK + rows[None, :], acc)
'''

WORKLOAD = '''
import torch
import compile_me as k
x = torch.ones(8)
k.fine[(1,)](x, BLOCK=8)
k.calls_a_plain_function[(1,)](x, BLOCK=8)
k.reads_a_plain_global[(1,)](x, BLOCK=8)
assert torch.equal(x, torch.full((8,), 12.0)), x   # every kernel ran under the interpreter
for block, block_k, stages in ((32, 32, 3), (256, 128, 4)):
    a, b, c = torch.ones(block, 2 * block_k), torch.ones(2 * block_k, block), torch.empty(block, block)
    k.tiles_past_shared_memory[(1,)](a, b, c, 2 * block_k, BLOCK=block, BLOCK_K=block_k, num_stages=stages)
    assert torch.equal(c, torch.full_like(c, 2.0 * block_k))
'''


def _run(*args, timeout=900):
    run = subprocess.run([sys.executable, str(ROOT / "profiles" / "cuda_compile.py"), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    return run, json.loads(run.stdout.strip().splitlines()[-1]) if run.stdout.strip() else None


def test_the_compile_check_fails_what_the_interpreter_runs_but_a_gpu_cannot(tmp_path):
    """A helper without @triton.jit, a global that is not a constexpr, tiles past Hopper's shared memory: each
    runs under the interpreter (the workload asserts its numbers), each fails here, named; the kernel beside
    them and the smaller tiles compile."""
    (tmp_path / "compile_me.py").write_text(KERNELS)
    (tmp_path / "workload.py").write_text(WORKLOAD)
    run, summary = _run("--code", str(tmp_path / "workload.py"), timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert summary["compiled"] == 5 and summary["not_launched"] == [], summary
    failed = {f["kernel"]: f["error"] for f in summary["failed"]}
    assert set(failed) == {"compile_me.calls_a_plain_function", "compile_me.reads_a_plain_global",
                           "compile_me.tiles_past_shared_memory"}, failed
    assert "double" in failed["compile_me.calls_a_plain_function"]
    assert "SCALE" in failed["compile_me.reads_a_plain_global"]
    assert "bytes of shared memory; sm_90 allows 232448" in failed["compile_me.tiles_past_shared_memory"]
    assert [f["constexprs"] for f in summary["failed"] if "tiles" in f["kernel"]] == ["BLOCK=256 BLOCK_K=128"]


def test_every_kernel_of_gdtool_compiles_for_hopper():
    """Every launch of gdtool.kernels.check's kernel and experts checks (bf16 and fp16, every kernel, its
    configs and switches, PDL off and on) compiles for sm_90a and fits its shared memory; no kernel of the
    package goes unlaunched."""
    run, summary = _run("--workload", "checks", "--require-all", "--jobs", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert summary["failed"] == [] and summary["not_launched"] == [] and summary["compiled"] > 400, summary
