"""Registers and spills of gdtool's decode kernels compiled for an H100/H200 (sm_90) on any machine, no GPU:
each launch of a kernel call is caught (its arguments, on CPU tensors), compiled by Triton for sm_90 with the
ptxas Triton ships as that launch compiles on the GPU (`cuda_compile.compile_launch`: Triton's own argument
specialization, PDL on), and read back from the cubin (`cuda_compile.resources`).

    python profiles/kernel_registers.py [--early-norm on|off|both] [--fused on|off|both]
    python profiles/kernel_registers.py --rows 1,2,4     # the dense products of llama-1b and llama-8b at those rows
    python profiles/kernel_registers.py --triton /tmp/triton-3.6   # compiled by the H200's Triton (3.6.0)

Compiled by the GPU's Triton, the registers are the GPU's: `profiles/compile_vs_ncu.py` found them equal to Nsight
Compute's on the H200 for every experts kernel it profiled. Another Triton version compiles other code.

Prints one line per (case, kernel): registers a thread, stack and local bytes (spills), shared memory. The
cases are llama-1b's and Qwen3-30B-A3B's batch-1 shapes (random weights; only the launches matter); with --rows,
the matrix-vector products of a Llama layer (q/k/v, o, gate/up, down) at each row count, with their tile constexprs:
what one pass of 2-4 rows costs in registers, where the H200's batch curve found it 24-83% slower than one row.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cuda_compile  # noqa: E402
import torch  # noqa: E402

def _usage(fn, args, kwargs) -> dict:
    return cuda_compile.resources(cuda_compile.compile_launch(fn, args, kwargs)) | {"warps": kwargs.get("num_warps", 4)}


def launches(call) -> list:
    """The (kernel, args, kwargs) of every Triton launch `call` makes, none of them run."""
    from triton.runtime.jit import JITFunction

    caught, run = [], JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: caught.append((self, args, dict(kwargs)))
    try:
        call()
    finally:
        JITFunction.run = run
    return caught


def _step():
    """A greedy step over a batch-1 state (EOS on, the repetition penalty's mask): the tail kernel's arguments."""
    from gdtool.core.settings import Settings
    from gdtool.core.step import Step, new_state
    settings = Settings(max_new_tokens=256, do_sample=False, temperature=None, top_k=None, top_p=None,
                        repetition_penalty=1.1, eos_token_id=(128001, 128009), pad_token_id=0)
    state = new_state(torch.zeros(1, 128, dtype=torch.long), torch.ones(1, 128, dtype=torch.long), settings, 384,
                      128256, return_scores=False, targets=None)
    return Step(None, None, state, settings, 128, feed=object())


def cases():
    from gdtool.kernels import attention, experts, gemv, tail
    bf = torch.bfloat16
    x, g = torch.randn(1, 2048, dtype=bf), torch.ones(2048, dtype=bf)
    pos, slot = torch.zeros(1, 1, dtype=torch.long), torch.tensor(200)
    mask = torch.ones(1, 384, dtype=torch.long)
    w = {n: torch.randn(n, 2048, dtype=bf) for n in (512, 2048, 4096, 8192)}
    yield "llama-1b q/k/v", lambda: gemv.qkv_rope(x, g, 1e-5, w[2048], w[512], w[512], pos, torch.ones(32), 1.0,
                                                  *(torch.zeros(1, 8, 384, 64, dtype=bf) for _ in range(2)), slot)
    yield "llama-1b attention", lambda: attention.split_kv(torch.randn(1, 32, 64, dtype=bf),
                                                           *(torch.randn(1, 8, 384, 64, dtype=bf) for _ in range(2)),
                                                           mask, slot, 0.125)
    yield "llama-1b o", lambda: gemv.rms_gemv(x, None, 1e-5, w[2048], None, x, False)
    yield "llama-1b gate/up", lambda: gemv.rms_gemv(x, g, 1e-5, w[8192], w[8192], None, False)
    yield "qwen3-30b-a3b q/k/v", lambda: gemv.qkv_rope(x, g, 1e-5, w[4096], w[512], w[512], pos, torch.ones(64), 1.0,
                                                       *(torch.zeros(1, 4, 384, 128, dtype=bf) for _ in range(2)), slot,
                                                       None, (torch.ones(128, dtype=bf), torch.ones(128, dtype=bf), 1e-6))
    yield "qwen3-30b-a3b attention", lambda: attention.split_kv(torch.randn(1, 32, 128, dtype=bf),
                                                                *(torch.randn(1, 4, 384, 128, dtype=bf) for _ in range(2)),
                                                                mask, slot, 128 ** -0.5)
    yield "llama-1b greedy tail", lambda: tail.update(torch.randn(1, 128256), _step(), [torch.zeros((), dtype=torch.long)
                                                                                      for _ in range(16)])
    e, i = 128, 768
    yield "qwen3-30b-a3b experts", lambda: experts.block_triton(x, torch.randn(e, 2048, dtype=bf),
                                                                torch.randn(e, 2 * i, 2048, dtype=bf),
                                                                torch.randn(e, 2048, i, dtype=bf), 8, True, False,
                                                                residual=x, norm=(g, 1e-6))


# hidden, intermediate, q heads, kv heads, head dim
LLAMA_SHAPES = {"llama-1b": (2048, 8192, 32, 8, 64), "llama-8b": (4096, 14336, 32, 8, 128)}


def row_cases(rows):
    """(name, call) for each Llama layer product of LLAMA_SHAPES at `rows` rows (the fast forward's calls)."""
    from gdtool.kernels import gemv
    bf = torch.bfloat16
    for model, (hidden, inter, hq, hkv, d) in LLAMA_SHAPES.items():
        x, g, xd = torch.randn(rows, hidden, dtype=bf), torch.ones(hidden, dtype=bf), torch.randn(rows, inter, dtype=bf)
        wq, wkv = torch.randn(hq * d, hidden, dtype=bf), torch.randn(hkv * d, hidden, dtype=bf)
        w_o, w_gu, w_d = torch.randn(hidden, hq * d, dtype=bf), torch.randn(inter, hidden, dtype=bf), \
            torch.randn(hidden, inter, dtype=bf)
        pos, slot = torch.zeros(rows, 1, dtype=torch.long), torch.tensor(200)
        cache = [torch.zeros(rows, hkv, 384, d, dtype=bf) for _ in range(2)]
        yield f"{model} q/k/v, {rows} rows", lambda: gemv.qkv_rope(x, g, 1e-5, wq, wkv, wkv, pos, torch.ones(d // 2),
                                                                  1.0, *cache, slot)
        yield f"{model} o, {rows} rows", lambda: gemv.rms_gemv(x, None, 1e-5, w_o, None, x, False)
        yield f"{model} gate/up, {rows} rows", lambda: gemv.rms_gemv(x, g, 1e-5, w_gu, w_gu, None, False)
        yield f"{model} down, {rows} rows", lambda: gemv.rms_gemv(xd, None, 1e-5, w_d, None, x, False)


def tiles(kwargs) -> str:
    """A launch's tile constexprs, as the --rows table shows them."""
    return " ".join(f"{k}={kwargs[k]}" for k in ("ROWS", "PASSES", "BLOCK_N", "HB", "BLOCK_K") if k in kwargs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--early-norm", choices=("on", "off", "both"), default="both")
    parser.add_argument("--fused", choices=("on", "off", "both"), default="both")
    parser.add_argument("--rows", default="", help="e.g. 1,2,4: the Llama layer products at those rows instead")
    parser.add_argument("--triton", default=None, help="a folder holding the Triton to compile with (pip --target): "
                                                       "the GPU's, for its registers (profiles/compile_vs_ncu.py)")
    args = parser.parse_args(argv)
    if args.triton:
        if not (Path(args.triton) / "triton" / "__init__.py").exists():
            parser.error(f"--triton {args.triton}: no triton package there (pip install --target {args.triton} triton==X)")
        if "triton" in sys.modules:
            parser.error("--triton: Triton is imported already (run this as a script)")
        sys.path.insert(0, args.triton)
    os.environ.pop("TRITON_INTERPRET", None)
    cuda_compile.use_target(90)
    from gdtool.kernels import triton as fast_triton
    fast_triton.pdl_supported = lambda device: True   # the kernels as they run on an H200: PDL on
    if args.rows:
        print("case | kernel | tiles | registers | stack | local | shared | warps")
        for rows in (int(r) for r in args.rows.split(",")):
            for name, call in row_cases(rows):
                for fn, a, kw in launches(call):
                    u = _usage(fn, list(a), kw)
                    print(f"{name} | {fn.__name__} | {tiles(kw)} | {u['registers']} | {u['stack']} | {u['local']} | "
                          f"{u['shared']} | {u['warps']}", flush=True)
        return 0
    pick = {"on": (True,), "off": (False,), "both": (True, False)}
    print("case | kernel | early norm | fused combine | registers | stack | local | shared | warps")
    for early in pick[args.early_norm]:
        for fused in pick[args.fused]:
            with fast_triton.switches(early_norm=early, fused_combine=fused):   # the launches are on the CPU
                for name, call in cases():
                    for fn, a, kw in launches(call):
                        u = _usage(fn, list(a), kw)
                        print(f"{name} | {fn.__name__} | {'on' if early else 'off'} | {'on' if fused else 'off'} | "
                              f"{u['registers']} | {u['stack']} | {u['local']} | {u['shared']} | {u['warps']}",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
