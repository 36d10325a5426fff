"""Compile every Triton kernel a workload launches for a CUDA GPU, on a machine without one.

Triton's interpreter runs gdtool's kernels on a CPU (the tests), but it does not compile them. A kernel the
interpreter runs may still fail to compile for a GPU (a helper or constant its module no longer defines, an
operation the compiler refuses on a type, a value used where a `tl.constexpr` is needed), or ask for more
shared memory than the GPU has, which fails at launch. Triton's compiler needs no GPU, only the target: its
NVIDIA backend lowers a kernel to PTX and the ptxas shipped with Triton assembles it. So this:

1. runs a workload under the interpreter and records each launch: the kernel, its arguments' types, pointer
   alignment, the integers Triton specializes on (1, multiples of 16), the constexprs and launch options;
2. in a second process, compiles each distinct launch for the target (Hopper, sm_90a, by default), the way
   `kernel[grid](...)` would on that GPU, without launching it. A kernel with a `PDL` switch, which the
   interpreter always runs off, is compiled off and on (with `launch_pdl`), as a Hopper GPU launches it;
3. holds each compiled kernel's shared memory against the target's limit, and reads its registers and stack
   (spills) from the binary.

    python profiles/cuda_compile.py --jobs 2                      # kernel checks and tiny fast decodes (~10 min, 2 cores)
    python profiles/cuda_compile.py --workload checks --jobs 2    # the kernel checks alone (~3.5 min)
    python profiles/cuda_compile.py --triton /tmp/triton-3.6      # compile with another Triton (the GPU machine's)

Workloads (`--workload`, several allowed): `checks`, gdtool.kernels.testing's kernel and experts checks on their
small shapes, bf16 and fp16 (every kernel, its configs and switches); `decode`, a few greedy and sampled steps
of `kernels="fast"` on each tiny family of tests/fastcases.py, gpt-oss and OLMoE (step-graph: the launches the
fast forward and step make, batch 1 and 6), bf16. The interpreter's numbers are not checked here (the tests do
that): only what each launch compiles to, in the default tuning's tiles (a GPU's, `configs/defaults.json`, not the
interpreter's larger ones). Shapes are tiny, so the real presets' tile sizes are not among the launches.

It prints a line per compiled launch (kernel, constexprs, warps, stages, PDL; shared bytes, registers, stack)
and the kernels of gdtool that no launch compiled; the last line is one JSON document. The exit status is 1
when a launch failed to compile or needs more shared memory than the target has, or, with --require-all, when
one of gdtool's kernels was not launched.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the recorded launches name this module's Pointer as cuda_compile.Pointer, whichever name it runs under
sys.modules.setdefault("cuda_compile", sys.modules[__name__])
PACKAGE = "gdtool.kernels"
# the most shared memory a block may ask for (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}

WORKLOADS = {
    "checks": """
import torch, test_fast_tail
from gdtool.kernels import testing, triton as fast_triton
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    testing.check_all("cpu", dtype)
    testing.check_experts_all("cpu", dtype)
    testing.check_experts_all("cpu", dtype, routed=True)
    with fast_triton.switches(fused_combine=False):   # the combine in a kernel of its own (GDTOOL_FUSED_COMBINE=0)
        for sinks in (False, True):
            testing.check_attention(3, 8, 2, 32, 90, 70, dtype, "cpu", gen, 5, sinks=sinks)
test_fast_tail.check(range(4))   # the greedy tail (its buffers are integers)
""",
    "decode": """
import torch, fastcases, moe
import gdtool
models = [(name, fastcases.build(name, dtype=torch.bfloat16)) for name in fastcases.MODELS if name != "mistral-narrow"]
models += [(name, moe.build(name, dtype=torch.bfloat16)) for name in ("gpt_oss", "olmoe")]
for name, model in models:
    for batch, sampling in ((1, False), (6, True)):
        prompt = gdtool.random_prompts(model, batch=batch, lengths=(3, 6), seed=batch)
        settings = dict(fastcases.SAMPLING) if sampling else dict(do_sample=False)
        gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode="step-graph", max_new_tokens=3, seed=0,
                      kernels="fast", eos_token_id=None, pad_token_id=0, **settings)
""",
}


# ---- 1. the workload under the interpreter, every launch recorded --------------------------------------------

@dataclass(frozen=True)
class Pointer:
    """A tensor argument as Triton's specialization sees it: its element type and how its address is aligned."""
    dtype: object
    offset: int   # data_ptr() % 16: 0 is what Triton marks divisible by 16

    def data_ptr(self):
        return self.offset

    def ptr_range(self):  # read by Triton's AMD backend alone
        return 0

    def stride(self):
        return (1,)

    @property
    def shape(self):
        return [1]


def _spec(value):
    import torch
    if isinstance(value, torch.Tensor):
        return Pointer(value.dtype, value.data_ptr() % 16)
    return value


def record(workload: str, path: str) -> None:
    """Run `workload` (Python source) with every Triton launch recorded to `path` (pickle), the kernels
    interpreted. Called in a process whose TRITON_INTERPRET=1 was set before Triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction

    from gdtool.kernels import tuning
    launches: dict = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__module__, self.fn.__qualname__, tuple(_spec(a) for a in args),
               tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
        launches[key] = launches.get(key, 0) + 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        # a GPU's tiles, not the interpreter's larger ones (tuning.interpreter): the launches a GPU would make
        with tuning.use(tuning.defaults()):
            exec(compile(workload, "<workload>", "exec"), {"__name__": "__workload__"})
    finally:
        InterpretedFunction.run = run
        with open(path, "wb") as f:
            pickle.dump(launches, f)


# ---- 2. each launch compiled for the target -------------------------------------------------------------------

class _Target:
    """The stand-in for Triton's driver on a machine without a GPU: the device, stream and target a launch reads."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@dataclass
class Compiled:
    kernel: str
    dtypes: str            # the element types of its pointer arguments
    constexprs: str
    num_warps: int
    num_stages: int
    pdl: bool
    launches: int          # how many times the workload launched it (PDL on: the same launches, compiled on)
    ok: bool
    shared: int = 0        # bytes
    registers: int = 0     # per thread
    stack: int = 0         # bytes per thread
    local: int = 0         # bytes per thread (spills)
    seconds: float = 0.0
    error: str = ""


_arch = 90


def use_target(arch: int = 90):
    """From now on, a Triton launch in this process compiles for compute capability `arch` (no GPU needed) and
    `compile_launch` can run; returns the driver it replaced (`targeting` puts it back). Triton 3.9 warns that its
    default (fused multiply-adds on) changes in 3.10; the warning is silenced, not answered by setting
    TRITON_DEFAULT_FP_FUSION, which enters Triton's key of every compile: the key would differ from a launch's on
    the GPU (seen on an H100 at 5e87ec2), though the code is the same."""
    global _arch
    _arch = arch
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
    from triton.runtime.driver import driver
    before = driver._active   # None until something asked for the driver (asking creates it: no GPU, it raises)
    driver.set_active(_Target(arch))
    return before


@contextmanager
def targeting(arch: int = 90):
    """`use_target(arch)` within it, Triton's driver as it was after (the tests)."""
    from triton.runtime.driver import driver
    before = use_target(arch)
    try:
        yield
    finally:
        driver._active = before


def compile_launch(kernel, args, kwargs):
    """Triton's compiled kernel (`.asm["cubin"]`, `.metadata`) for the launch `kernel[grid](*args, **kwargs)`,
    compiled as that launch compiles it on the target GPU (`use_target`): Triton's own specialization of the
    arguments (tensors, or `Pointer`s standing in for them), constexprs and options, `launch_pdl` among them;
    nothing runs."""
    return kernel.run(*args, grid=(1,), warmup=True, **kwargs)


def resources(compiled) -> dict:
    """A compiled kernel's registers and stack bytes a thread and local bytes (spills), as ptxas wrote them into its
    cubin (read with the cuobjdump shipped with Triton), and the dynamic shared memory its launch asks for (Triton's
    metadata: what Triton holds against the GPU's limit, and what Nsight Compute reports)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    registers, stack, local = map(int, found.groups())
    return dict(registers=registers, stack=stack, local=local, shared=int(compiled.metadata.shared))


def _init(arch: int, triton_path: str | None, folders: list[str]) -> None:
    """Set up a compiling process: the Triton to compile with, the folders the workloads' kernels are imported
    from, the target."""
    sys.path[:0] = ([triton_path] if triton_path else []) + folders
    use_target(arch)


def _describe(kwargs: dict, params: list[str]) -> str:
    shown = {k: v for k, v in kwargs.items() if k in params and k != "PDL"}
    return " ".join(f"{k}={getattr(v, 'name', v)}" for k, v in shown.items())


def compile_one(job) -> Compiled:
    """Compile one recorded launch (module, name, args, kwargs, launches, pdl) for the target, as `kernel[grid]`
    compiles it before launching."""
    module, name, args, kwargs, launches, pdl = job
    kwargs = dict(kwargs)
    if pdl:
        kwargs.update(PDL=True, launch_pdl=True)
    kernel = getattr(importlib.import_module(module), name)
    params = [p.name for p in kernel.params]
    constexprs = {p.name: v for p, v in zip(kernel.params, args) if p.is_constexpr}
    constexprs.update({k: v for k, v in kwargs.items() if k in params})
    dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, Pointer)})
    result = Compiled(f"{module.removeprefix(PACKAGE + '.')}.{name}", ",".join(dtypes), _describe(constexprs, params),
                      kwargs.get("num_warps", 4), kwargs.get("num_stages", 3), bool(kwargs.get("PDL")), launches, False)
    start = time.perf_counter()
    try:
        compiled = compile_launch(kernel, args, kwargs)
    except Exception as error:  # noqa: BLE001 - every failure is the finding, reported by name
        result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    used = resources(compiled)
    result.shared, result.registers, result.stack, result.local = used["shared"], used["registers"], used["stack"], \
        used["local"]
    limit = MAX_SHARED.get(_arch)
    result.ok = limit is None or result.shared <= limit
    if not result.ok:
        result.error = f"asks for {result.shared} bytes of shared memory; sm_{_arch} allows {limit}"
    return result


def jobs_of(launches: dict) -> list[tuple]:
    jobs = []
    for (module, name, args, kwargs), count in sorted(launches.items(), key=lambda item: repr(item[0][:2])):
        kwargs = dict(kwargs)
        jobs.append((module, name, args, kwargs, count, False))
        if "PDL" in kwargs and not kwargs["PDL"]:
            jobs.append((module, name, args, kwargs, count, True))
    return jobs


def kernels_of_package() -> dict[str, bool]:
    """gdtool's Triton kernels, '<module>.<name>' -> whether it is a kernel a launch starts (not a helper that
    another of the package's kernels calls)."""
    import pkgutil

    import triton
    package = importlib.import_module(PACKAGE)
    found = {}
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and value.fn.__module__ == info.name:
                found[f"{info.name.removeprefix(PACKAGE + '.')}.{name}"] = value
    sources = {key: fn.src for key, fn in found.items()}
    return {key: not any(re.search(rf"\b{re.escape(key.rsplit('.', 1)[1])}\s*\(", src)
                         for other, src in sources.items() if other != key)
            for key in found}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=None,
                        help="gdtool's workloads (default: all of them, unless --code is given)")
    parser.add_argument("--code", action="append", default=[], metavar="FILE",
                        help="a workload of your own, run under the interpreter: a Python file whose kernels live in "
                             "modules importable from its folder (repeat for several)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 10 x major + minor (90: Hopper)")
    parser.add_argument("--triton", default=None,
                        help="a folder holding another Triton package to compile with (pip install --target)")
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes")
    parser.add_argument("--require-all", action="store_true",
                        help="exit 1 when one of gdtool's kernels was not launched by the workloads")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs: give 1 or more")
    if args.triton and not (Path(args.triton) / "triton" / "__init__.py").exists():
        parser.error(f"--triton {args.triton}: no triton package there (pip install --target {args.triton} triton==X)")
    if args.arch not in MAX_SHARED:
        parser.error(f"--arch {args.arch}: give one of {sorted(MAX_SHARED)}")
    for file in args.code:
        if not os.path.isfile(file):
            parser.error(f"--code {file}: no such file")
    names = args.workload if args.workload is not None else ([] if args.code else sorted(WORKLOADS))
    workloads = [(name, WORKLOADS[name]) for name in names] + [(file, Path(file).read_text()) for file in args.code]
    folders = sorted({str(Path(file).resolve().parent) for file in args.code})
    _init(args.arch, args.triton, folders)   # before anything imports Triton here
    args.folders = folders
    with tempfile.TemporaryDirectory() as tmp:
        # every launch compiled anew: none read from Triton's cache, none left there
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        launches = _record_all(workloads, folders, tmp)
        if launches is None:
            return 1
        results = _compile_all(launches, args)
    return _report(results, args, names, [w for w, _ in workloads])


def _record_all(workloads, folders, tmp) -> dict | None:
    """Each workload run under the interpreter in a process of its own; their launches, counted (None: one failed)."""
    launches: dict = {}
    for index, (workload, source) in enumerate(workloads):
        path = os.path.join(tmp, f"{index}.pkl")
        where = [str(ROOT), str(ROOT / "tests"), str(ROOT / "profiles")] + folders
        code = f"import sys\nsys.path[:0] = {where!r}\nimport cuda_compile\ncuda_compile.record({source!r}, {path!r})\n"
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"), cwd=ROOT,
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stdout[-2000:] + run.stderr[-4000:], file=sys.stderr)
            print(f"workload {workload}: exit {run.returncode} under the interpreter", file=sys.stderr)
            return None
        with open(path, "rb") as f:
            recorded = pickle.load(f)
        for key, count in recorded.items():
            launches[key] = launches.get(key, 0) + count
        print(f"workload {workload}: {len(recorded)} distinct launches recorded in {time.perf_counter() - start:.0f} s",
              flush=True)
    return launches


def _compile_all(launches: dict, args) -> list[Compiled]:
    import triton
    jobs = jobs_of(launches)
    print(f"compiling {len(jobs)} launches for sm_{args.arch} with Triton {triton.__version__} "
          f"({Path(triton.__file__).parent})", flush=True)
    start = time.perf_counter()
    if args.jobs == 1:
        results = [compile_one(job) for job in jobs]
    else:
        with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(args.arch, args.triton, args.folders)) as pool:
            results = list(pool.map(compile_one, jobs))
    print(f"{len(results)} launches compiled for sm_{args.arch} in {time.perf_counter() - start:.0f} s, "
          f"{sum(not r.ok for r in results)} failed", flush=True)
    return results


def _report(results: list[Compiled], args, names: list[str], workloads: list[str]) -> int:
    """The table, the kernels of gdtool no workload launched (where one of gdtool's workloads ran), the JSON line;
    the exit status."""
    print(f"{'kernel':<40} {'warps':>5} {'stages':>6} {'PDL':>4} {'shared':>7} {'regs':>4} {'stack':>5} {'local':>5}  "
          f"{'pointers':<22} constexprs")
    for r in results:
        line = (f"{r.kernel:<40} {r.num_warps:>5} {r.num_stages:>6} {'on' if r.pdl else 'off':>4} {r.shared:>7} "
                f"{r.registers:>4} {r.stack:>5} {r.local:>5}  {r.dtypes:<22} {r.constexprs}")
        print(line + ("" if r.ok else f"\n    FAILED: {r.error}"))
    failed = [r for r in results if not r.ok]
    missing = []
    if names:   # gdtool's own workloads: which of its kernels they reached
        package = kernels_of_package()
        kernels = {k for k, launched in package.items() if launched}
        missing = sorted(kernels - {r.kernel for r in results})
        print(f"{len(kernels & {r.kernel for r in results if r.ok})} of gdtool's {len(kernels)} kernels compiled, "
              f"with the {len(package) - len(kernels)} helpers they call")
        if missing:
            print("not launched by the workloads: " + ", ".join(missing))
    import triton
    print(json.dumps(dict(arch=args.arch, triton=triton.__version__, workloads=workloads, compiled=len(results),
                          failed=[asdict(r) for r in failed], not_launched=missing,
                          with_stack=sorted({r.kernel for r in results if r.stack or r.local}))))
    return 1 if failed or (args.require_all and missing) else 0


if __name__ == "__main__":
    sys.exit(main())
