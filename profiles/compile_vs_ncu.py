"""The compile for sm_90 on a CPU (`cuda_compile`) against what Nsight Compute read on the H200.

`profiles/h200/ncu-experts-<commit>/` holds Nsight Compute's details of gdtool's experts kernels as
`profiles/moe_block.py` launched them on the H200 at that commit (Qwen3-30B-A3B's block, bf16: one token through the
small kernels, 64 through the grouped ones). This makes the same launches here, no GPU: that commit's gdtool (a git
worktree, removed after), each launch caught before it runs, compiled through `cuda_compile.compile_launch` with
the Triton given (the H200's was 3.6.0: another version compiles other code), and prints per kernel its registers
a thread, grid and dynamic shared memory beside ncu's. A last column compiles each launch as
`kernel_registers.py` did until 9773f3c (`--hand-typed`: the signature typed by hand from the CPU values, every
integer i32, no divisibility hints; that file as it was at 2c219be): what its tables under profiles/cpu/ up to
3a2d041 measured.

    pip install --target /tmp/triton-3.6 triton==3.6.0
    python profiles/compile_vs_ncu.py --triton /tmp/triton-3.6 --hand-typed

The exit status is 1 when a kernel's registers, grid or shared memory differ from ncu's.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAND_TYPED_AT = "2c219be"   # kernel_registers.py's last commit with the signature typed by hand
SHAPES = dict(experts=128, top_k=8, hidden=2048, intermediate=768)   # Qwen3-30B-A3B, as moe_block.py builds it


def ncu_rows(folder: Path) -> list[dict]:
    """Per profiled kernel (in launch order, ncu's ID), its name, registers, grid and dynamic shared bytes."""
    found: dict = {}
    for name in ("small-b1-details.csv", "grouped-b64-details.csv"):
        for row in csv.DictReader(open(folder / name)):
            key = (name, int(row["ID"]))
            entry = found.setdefault(key, {"batch": 1 if "b1" in name else 64, "kernel": row["Kernel Name"]})
            value = row["Metric Value"].replace(",", "")
            if row["Metric Name"] == "Registers Per Thread":
                entry["registers"] = int(value)
            elif row["Metric Name"] == "Grid Size":
                entry["grid"] = int(float(value))
            elif row["Metric Name"] == "Dynamic Shared Memory Per Block":
                scale = {"byte/block": 1, "Kbyte/block": 1000, "Mbyte/block": 1000 ** 2}[row["Metric Unit"]]
                entry["shared"] = round(float(value) * scale)
                entry["shared_unit"] = scale / 100 if scale > 1 else 0   # ncu prints 2 decimals of KB or MB
    return [found[key] for key in sorted(found, key=lambda key: (found[key]["batch"], key[1]))]


def agree(mine: dict, theirs: dict) -> bool:
    """The same kernel, registers and grid, and dynamic shared memory within ncu's rounding of it."""
    return mine["kernel"] == theirs["kernel"] and mine["registers"] == theirs.get("registers") and \
        mine["grid"] == theirs.get("grid") and abs(mine["shared"] - theirs.get("shared", -1)) <= theirs.get(
            "shared_unit", 0) / 2


def compile_here(worktree: str, hand_typed: bool) -> list[dict]:
    """In the worktree's process: moe_block.py's launches, each compiled for sm_90 (and by hand, if asked)."""
    import torch
    from triton.runtime.jit import JITFunction

    import cuda_compile
    import gdtool
    from gdtool.kernels import experts
    from gdtool.kernels import triton as fast_triton
    if not Path(gdtool.__file__).resolve().is_relative_to(Path(worktree).resolve()):
        raise RuntimeError(f"gdtool imported from {gdtool.__file__}, not from the worktree {worktree}")
    hand = None
    if hand_typed:
        source = subprocess.run(["git", "show", f"{HAND_TYPED_AT}:profiles/kernel_registers.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        hand = {"__name__": "kernel_registers_hand_typed", "__file__": str(Path(worktree) / "profiles" / "x.py")}
        exec(compile(source, "kernel_registers.py@" + HAND_TYPED_AT, "exec"), hand)
    cuda_compile.use_target(90)
    fast_triton.pdl_supported = lambda device: True   # as on the H200
    bf, s = torch.bfloat16, SHAPES
    torch.manual_seed(0)
    weights = (torch.randn(s["experts"], s["hidden"], dtype=bf),
               torch.randn(s["experts"], 2 * s["intermediate"], s["hidden"], dtype=bf),
               torch.randn(s["experts"], s["hidden"], s["intermediate"], dtype=bf), s["top_k"], True, False)
    out = []
    for batch, block in ((1, experts.block_triton), (64, experts.block_grouped)):
        x = torch.randn(batch, s["hidden"], dtype=bf)
        caught, run = [], JITFunction.run
        JITFunction.run = lambda self, *args, grid, warmup, **kwargs: caught.append((self, args, kwargs, grid))
        try:
            block(x, *weights)
        finally:
            JITFunction.run = run
        for kernel, args, kwargs, grid in caught:
            grid = grid(dict(zip(kernel.arg_names, args))) if callable(grid) else grid
            compiled = cuda_compile.compile_launch(kernel, args, kwargs)
            row = dict(batch=batch, kernel=kernel.__name__, registers=cuda_compile.resources(compiled)["registers"],
                       grid=int(torch.tensor(grid).prod()), shared=int(compiled.metadata.shared))
            if hand:
                row["hand_typed"] = hand["_usage"](kernel, list(args), kwargs)["registers"]
            out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", default=None, help="a folder holding the Triton to compile with (pip --target)")
    parser.add_argument("--hand-typed", action="store_true", help="also compile as kernel_registers.py did before")
    parser.add_argument("--worktree", default=None, help=argparse.SUPPRESS)   # the child: compile in that checkout
    args = parser.parse_args(argv)
    if args.worktree:
        sys.path[:0] = ([args.triton] if args.triton else []) + [args.worktree, str(ROOT / "profiles")]
        print(json.dumps(compile_here(args.worktree, args.hand_typed)))
        return 0
    if args.triton and not (Path(args.triton) / "triton" / "__init__.py").exists():
        parser.error(f"--triton {args.triton}: no triton package there (pip install --target {args.triton} triton==X)")
    folders = sorted((ROOT / "profiles" / "h200").glob("ncu-experts-*"))
    apart = 0
    for folder in folders:
        commit = folder.name.rsplit("-", 1)[1]
        with tempfile.TemporaryDirectory() as tmp:
            tree = str(Path(tmp) / commit)
            subprocess.run(["git", "worktree", "add", "--detach", "-q", tree, commit], cwd=ROOT, check=True)
            try:
                child = subprocess.run([sys.executable, __file__, "--worktree", tree]
                                       + (["--triton", args.triton] if args.triton else [])
                                       + (["--hand-typed"] if args.hand_typed else []),
                                       capture_output=True, text=True, cwd=ROOT)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, check=True)
        if child.returncode != 0:
            print(child.stdout[-2000:] + child.stderr[-4000:], file=sys.stderr)
            return 1
        here, there = json.loads(child.stdout.strip().splitlines()[-1]), ncu_rows(folder)
        print(f"\n{folder.relative_to(ROOT)} (gdtool at {commit}): compiled here | ncu on the H200"
              + (" | hand-typed" if args.hand_typed else ""))
        print(f"{'batch':>5} {'kernel':<26} {'registers':>13} {'grid':>13} {'dynamic shared':>17}")
        for mine, theirs in zip(here, there):
            same = agree(mine, theirs)
            apart += not same
            print(f"{mine['batch']:>5} {mine['kernel']:<26} {mine['registers']:>5} | {theirs.get('registers', '-'):>5} "
                  f"{mine['grid']:>6} | {theirs.get('grid', '-'):>4} {mine['shared']:>8} | {theirs.get('shared', '-'):>6}"
                  + (f"   {mine['hand_typed']:>3}" if args.hand_typed else "") + ("" if same else "   APART"))
        if len(here) != len(there):
            apart += 1
            print(f"{len(here)} launches here, {len(there)} profiled there")
    print(f"\n{apart} kernels apart from ncu's")
    return 1 if apart else 0


if __name__ == "__main__":
    sys.exit(main())
