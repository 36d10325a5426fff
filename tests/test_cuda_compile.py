"""profiles/cuda_compile.py: gdtool's Triton kernels compiled for Hopper (sm_90a) on a CPU, no GPU needed.

The interpreter tests run the kernels' arithmetic; they do not compile them, and a GPU compiles more strictly
than the interpreter runs. These hold the compile check to the failures it exists for (each of them runs
under the interpreter and fails on a GPU), then run it over every kernel of gdtool."""
import importlib.util
import json
import os
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


@pytest.mark.slow  # ~400 s on 2 cores: every kernel compiled for sm_90
def test_every_kernel_of_gdtool_compiles_for_hopper():
    """Every launch of gdtool.kernels.testing's kernel and experts checks (bf16 and fp16, every kernel, its
    configs and switches, PDL off and on) compiles for sm_90a and fits its shared memory; no kernel of the
    package goes unlaunched."""
    run, summary = _run("--workload", "checks", "--require-all", "--jobs", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert summary["failed"] == [] and summary["not_launched"] == [] and summary["compiled"] > 400, summary


def _layer_launches(dev):
    """The (kernel, args, kwargs) of a Llama layer's products, the q/k/v kernel and an MoE block on `dev`, caught
    before they run (profiles/kernel_registers.py)."""
    import torch
    sys.path.insert(0, str(ROOT / "profiles"))
    import kernel_registers
    from gdtool.kernels import experts, gemv
    bf = torch.bfloat16
    x, g = torch.randn(3, 256, dtype=bf, device=dev), torch.ones(256, dtype=bf, device=dev)
    w, wk = torch.randn(512, 256, dtype=bf, device=dev), torch.randn(64, 256, dtype=bf, device=dev)
    caches = [torch.zeros(3, 2, 16, 32, dtype=bf, device=dev) for _ in range(2)]
    e, i = 8, 96
    calls = [lambda: gemv.rms_gemv(x, g, 1e-5, w, w, None, False),
             lambda: gemv.rms_gemv(x, None, 1e-5, w[:256], None, x, False),
             lambda: gemv.qkv_rope(x, g, 1e-5, w[:256], wk, wk, torch.zeros(3, 1, dtype=torch.long, device=dev),
                                   torch.ones(16, device=dev), 1.0, *caches, torch.tensor(3, device=dev)),
             lambda: experts.block_triton(x, torch.randn(e, 256, dtype=bf, device=dev),
                                          torch.randn(e, 2 * i, 256, dtype=bf, device=dev),
                                          torch.randn(e, 256, i, dtype=bf, device=dev), 2, True, False)]
    caught = [launch for call in calls for launch in kernel_registers.launches(call)]
    assert len(caught) >= 5, [fn.__name__ for fn, _, _ in caught]
    return caught


def _compile(fn, args, kwargs, arch, recorded=True):
    """cuda_compile's compile of one launch for `arch`, its tensors replaced by the `Pointer`s a recording holds
    (recorded) or as they are, through a binder made anew under the stand-in driver (the function's own caches
    put back after)."""
    import cuda_compile
    if recorded:
        args, kwargs = [cuda_compile._spec(a) for a in args], {k: cuda_compile._spec(v) for k, v in kwargs.items()}
    saved = dict(fn.device_caches)
    fn.device_caches.clear()
    try:
        with cuda_compile.targeting(arch):
            return cuda_compile.compile_launch(fn, args, kwargs)
    finally:
        fn.device_caches.clear()
        fn.device_caches.update(saved)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="the interpreter defines the kernels")
def test_a_recorded_launch_compiles_as_its_tensors_do():
    """A recording keeps each tensor as a `Pointer` (its dtype and address modulo 16): compiled from those, a
    launch has the key (Triton's hash of source, specialization, options and target) and PTX it has compiled from
    the tensors themselves; an input 2 bytes past an aligned address among them, whose key differs from the
    aligned one's (the alignment is kept, not assumed)."""
    import torch
    sys.path.insert(0, str(ROOT / "profiles"))
    import cuda_compile
    import kernel_registers
    from gdtool.kernels import gemv
    caught = _layer_launches("cpu")
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    odd, even = (kernel_registers.launches(lambda x=x: gemv.rms_gemv(x, None, 1e-5, w, None, None, False))[0]
                 for x in (torch.randn(3, 257, dtype=torch.bfloat16)[:, 1:], torch.randn(3, 256, dtype=torch.bfloat16)))
    assert cuda_compile._spec(odd[1][0]).offset == 2 and cuda_compile._spec(even[1][0]).offset == 0
    for fn, args, kwargs in caught + [odd]:
        offline, direct = (_compile(fn, args, kwargs, 90, recorded) for recorded in (True, False))
        assert offline.hash == direct.hash and offline.asm["ptx"] == direct.asm["ptx"], fn.__name__
    assert _compile(*odd, 90).hash != _compile(*even, 90).hash


def test_the_stand_in_target_leaves_the_compile_key_as_a_launch_has_it():
    """Triton's key of a compile holds the environment variables it lists (`get_cache_invalidating_env_vars`); a
    variable set by the stand-in target (TRITON_DEFAULT_FP_FUSION, once, to silence Triton 3.9's warning) made every
    key differ from the GPU launch's, the code the same (the cuda test below, on an H100 at 5e87ec2)."""
    sys.path.insert(0, str(ROOT / "profiles"))
    import cuda_compile
    from triton._C.libtriton import get_cache_invalidating_env_vars
    before = get_cache_invalidating_env_vars()
    with cuda_compile.targeting(90):
        assert get_cache_invalidating_env_vars() == before


@pytest.mark.cuda
def test_the_compile_on_a_cpu_is_the_gpus():
    """What cuda_compile compiles for a launch (its arguments as `Pointer` stand-ins, the stand-in driver naming
    this GPU's capability) is what the launch compiles to on the GPU: the same key (Triton's hash of the source,
    the arguments' specialization, the options and the target) and the same PTX, for each kernel of a Llama layer
    product, the q/k/v kernel and the MoE block."""
    import torch
    major, minor = torch.cuda.get_device_capability()
    for fn, args, kwargs in _layer_launches("cuda"):
        real = fn.run(*args, grid=(1,), warmup=True, **kwargs)
        offline = _compile(fn, args, kwargs, 10 * major + minor)
        assert offline.hash == real.hash and offline.asm["ptx"] == real.asm["ptx"], fn.__name__


def test_ncu_details_read_as_compile_vs_ncu_compares_them():
    """profiles/compile_vs_ncu.py reads Nsight Compute's committed details per kernel in launch order (one token's
    small kernels, then 64 tokens' grouped ones), and holds shared memory to ncu's rounding (two decimals of KB)."""
    sys.path.insert(0, str(ROOT / "profiles"))
    import compile_vs_ncu
    rows = compile_vs_ncu.ncu_rows(ROOT / "profiles" / "h200" / "ncu-experts-41fab16")
    assert [(r["batch"], r["kernel"], r["registers"], r["grid"]) for r in rows] == [
        (1, "_router_kernel", 30, 64), (1, "_gate_up_kernel", 80, 768), (1, "_down_kernel", 48, 512),
        (64, "_router_kernel", 30, 4096), (64, "_route_kernel", 32, 64), (64, "_align_kernel", 42, 129),
        (64, "_grouped_gate_up_kernel", 120, 912), (64, "_grouped_down_kernel", 74, 2432), (64, "_combine_kernel", 20, 1024)]
    gate_up = rows[6]   # 139.26 Kbyte/block
    mine = dict(kernel="_grouped_gate_up_kernel", registers=120, grid=912)
    assert compile_vs_ncu.agree(dict(mine, shared=139264), gate_up)
    assert not compile_vs_ncu.agree(dict(mine, shared=139300), gate_up)
    assert not compile_vs_ncu.agree(dict(mine, shared=139264, registers=128), gate_up)
    assert compile_vs_ncu.agree(dict(kernel="_router_kernel", registers=30, grid=64, shared=64), rows[0])
    assert not compile_vs_ncu.agree(dict(kernel="_router_kernel", registers=30, grid=64, shared=65), rows[0])


def test_cuda_compile_refuses_bad_arguments_by_name(tmp_path, capsys):
    """A Triton folder without Triton, a workload file that is not there, an unknown capability, no jobs: each
    refused before anything runs, naming the argument and what to give."""
    sys.path.insert(0, str(ROOT / "profiles"))
    import cuda_compile
    for argv, message in ((["--triton", str(tmp_path)], "no triton package there (pip install --target"),
                          (["--code", str(tmp_path / "none.py")], "no such file"),
                          (["--arch", "75"], "--arch 75: give one of"),
                          (["--jobs", "0"], "--jobs: give 1 or more")):
        with pytest.raises(SystemExit) as exit_:
            cuda_compile.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv
