"""Tile configs of gdtool's experts kernels, swept on the GPU: what the device's tuning file (sections experts_grouped,
experts_oss, experts_small; `--write-config` writes them) should hold.

One block at real shapes, random bf16 weights, each variant captured in a CUDA graph and timed over 200
replays (`moe_block.time_graph`), per batch:

    qwen3-30b-a3b   the grouped kernels (`block_grouped`) over GROUPED_GRID at 1, 2, 4, ..., 64 tokens, beside
                    the small kernels (`block_triton`, up to 16 tokens: their default config, config {}, and
                    SMALL_GRID) and HF's batched_mm / grouped_mm
    gpt-oss-20b     gpt-oss's small kernels (`block_oss`) over OSS_GRID at 1, 4 and 16 tokens, and its grouped
                    kernels (`block_grouped(..., oss=...)`) over GROUPED_GRID at 1-64, beside HF's batched_mm

Each row: the variant, its config, µs per block, GB/s over the bytes the block must read, and its largest
difference from HF's batched_mm (a config that computes wrongly shows there). The CSV goes to --out; the
fastest config per batch is printed last.

    python profiles/moe_sweep.py --model qwen3-30b-a3b --out OUT/moe-sweep
    python profiles/moe_sweep.py --model gpt-oss-20b --batch 1,4 --out OUT/moe-sweep

One model per device call: each sweeps 300-400 configs (each compiled once, then timed per batch).
"""
from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import itertools
import sys
import time
from pathlib import Path

# the grouped kernels' configs: slots per tile (tl.dot's rows), output columns, reduction step, warps, stages
GROUPED_GRID = dict(block_m=(16, 32, 64), block_n=(64, 128), block_k=(64, 128), warps=(4, 8), stages=(3, 4))
# the small kernels' configs (`experts.Config`; the router keeps its default): weight rows per program of
# gate/up and of down, warps, and the elements of a weight row one load covers (the rest in static chunks; 4096:
# a whole row of Qwen3-30B-A3B's hidden 2048 or intermediate 768 at once, as at 0f91d78). At 0f91d78 the grid had
# gate/up rows 1-8 (8 won at one token) and no chunk: the gate/up kernel read 50 MB in 33.5 µs (1.5 TB/s) inside
# qwen3-30b-a3b's step, gpt-oss's small kernels (128-row K steps) 3.2 TB/s
SMALL_GRID = dict(gate_up_rows=(2, 4, 8, 16), down_rows=(2, 4, 8), warps=(4, 8), chunk=(512, 1024, 4096))
# the small kernels with the routing done once per row in the router kernel (`Config.routed`: gate/up loads its
# expert id and the row's rstd) and down's k experts as one stacked load (`Config.stacked`), down to 256-element
# loads (a warp's 32 x 8 bf16: the sum over a chunk stays in the warp). Nsight Compute at 41fab16 counted 7.8 M
# warp instructions in gate/up for 50 MB (~1.3 M would be the products alone): each of its 768 programs routes its
# row before its first load
ROUTED_GRID = dict(gate_up_rows=(4, 8, 16), down_rows=(2, 4), warps=(4, 8), chunk=(256, 512, 1024),
                   routed=(True,), stacked=(False, True))
# the routed small kernels with the router's top-k one reduction a round over packed (probability, id) keys
# (`Config.packed`) instead of a max and a min: the router's routing is on the step's path at one token (6.15 us a
# layer at eb913f2, qwen3-30b-a3b); the tiles around experts_config's one-token default, beside ROUTED_GRID's rows
PACKED_GRID = dict(gate_up_rows=(8, 16), down_rows=(2, 4), warps=(4, 8), chunk=(256,), routed=(True,), stacked=(True,),
                   packed=(True,))
# the packed one-token kernels with the router's and down's own warps (`Config.router_warps`, `down_warps`): Nsight
# Compute at fa2489e (one token, qwen3-30b-a3b) found the router 8.0 us for 64 programs, the last program's routing
# (softmax, 8 rounds of a max over 128 experts) across 8 warps' shared memory, and down at 0.97 waves of 512
# programs, 4 an SM by its 54 registers (50% occupancy), the DRAM at 39% of its peak
WARPS_GRID = dict(router_rows=(1, 2), gate_up_rows=(8,), down_rows=(2, 4, 8), warps=(8,), chunk=(256,), routed=(True,),
                  stacked=(True,), packed=(True,), router_warps=(1, 2, 4, 8), down_warps=(4, 8))
# the one-token default with the router's weight rows and down's routing and weight tiles loaded before their PDL wait
# (`Config.router_early`, `down_early`), each variant timed as a chain of CHAIN blocks in one graph (variant "early",
# µs per block), so that each router follows a down kernel as in the step (one block a graph starts its router
# at the graph's launch). Down's early loads lost at 41fab16 ("early" in moe-sweep-41fab16/), when each down program
# still routed its row from the logits; the router routes the row since. At 75ec5b5 (moe-sweep-75ec5b5/) both early:
# 26.74 us a block against 27.75 late. EARLY_TILES_GRID ("early-tiles"; "early" at a74fd82, moe-sweep-a74fd82/): the
# tiles around the default, both early loads on
EARLY_GRID = dict(down_rows=(2, 4), router_early=(False, True), down_early=(False, True))
EARLY_TILES_GRID = dict(gate_up_rows=(4, 8, 16), warps=(4, 8), down_rows=(2, 4), router_early=(True,),
                        down_early=(True,))
CHAIN = 4
GRIDS = ("grouped", "small", "routed", "packed", "warps", "early", "early-tiles")
# (RANKED_GRID, the routing's top-k by ranks (`Config.ranked`), was slower on the H200 at 14cc799: qwen3-30b-a3b at
# one token, one block captured, gate/up 8 rows, chunk 256, us a block with k rounds against ranked: 30.83 / 32.58
# (down 4 rows, 8 warps), 30.97 / 34.04 (2, 4), 32.63 / 34.27 (2, 8), 33.73 / 36.94 (4, 4); removed from experts.py
# with OSS_RANKED_GRID)
# (variants "stream" in profiles/h200/moe-sweep-9e35b5d/ and "early" in profiles/h200/moe-sweep-41fab16/: two
# candidates of the small kernels, slower or no faster than SMALL_GRID's best, since removed from experts.py;
# "grouped-routed" in profiles/h200/moe-sweep-39ace1a/: the grouped path routed in the router kernel, no faster)
# gpt-oss's kernels: gate/up and down output columns per program, reduction rows per step, warps (with routed=(False,
# True) in profiles/h200/moe-sweep-a7748ba/: gpt-oss's small kernels routed in the router kernel, no faster at the
# default tiles, 64.50 against 62.96 us a block, since removed from experts.py)
OSS_GRID = dict(gate_up_cols=(16, 32, 64), down_cols=(16, 32, 64), block_k=(64, 128, 256), warps=(4, 8))
MODELS = {"qwen3-30b-a3b": "1,2,4,8,16,32,64", "gpt-oss-20b": "1,4,16,32,64"}


def chained(fn):
    """fn(x) run CHAIN times in a row, each call on the one before's output; returns the first output."""
    def run(x):
        first = y = fn(x)
        for _ in range(CHAIN - 1):
            y = fn(y)
        return first
    return run


def grid(space: dict) -> list[dict]:
    """Every combination of the space's values, in a fixed order."""
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def fastest(rows: list[dict]) -> dict:
    """Per batch, the fastest row whose output stayed within `ok` (the sweep marks each row)."""
    best = {}
    for row in rows:
        if row["ok"] and (row["batch"] not in best or row["us_per_block"] < best[row["batch"]]["us_per_block"]):
            best[row["batch"]] = row
    return best


def load(path) -> list[dict]:
    """A sweep's CSV, typed: batch int, us_per_block float, ok bool, config a dict ({} for a peer or a default)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(dict(row, batch=int(row["batch"]), us_per_block=float(row["us_per_block"] or "nan"),
                             ok=row["ok"] == "True", config=ast.literal_eval(row["config"]) if row["config"] else {}))
    return rows


def steadiest(tables: list[dict]) -> dict:
    """Among the configs every table ({repr(config): µs}) timed, the one whose worst ratio to each table's fastest
    is smallest (one config for several models: none of them far from its own best)."""
    common = set.intersection(*(set(t) for t in tables))
    worst = {c: max(t[c] / min(t.values()) for t in tables) for c in common}
    return ast.literal_eval(min(sorted(worst), key=worst.get))


def _tables(rows: list[dict], variant: str) -> dict:
    """{batch: [per model: {repr(config): µs}]} of the variant's rows whose output stayed within `ok`."""
    out: dict = {}
    for row in rows:
        if row["variant"] == variant and row["ok"] and row["config"]:
            out.setdefault(row["batch"], {}).setdefault(row["model"], {})[repr(row["config"])] = row["us_per_block"]
    return {b: list(models.values()) for b, models in sorted(out.items())}


def grouped_picks(rows: list[dict]) -> dict:
    """Per swept batch, the grouped kernels' steadiest config over the models swept there."""
    return {b: steadiest(tables) for b, tables in _tables(rows, "grouped").items()}


def small_picks(rows: list[dict], variant: str = "small") -> dict:
    """Per swept batch, the fastest config of the small kernels ("small", or gpt-oss's "oss"; one model each)."""
    return {b: steadiest(tables) for b, tables in _tables(rows, variant).items()}


def grouped_from(rows: list[dict], variant: str = "small") -> int:
    """One past the largest swept batch at which `variant`'s kernels (the small ones, or gpt-oss's "oss") beat the
    grouped ones in any model that ran them: from there on the grouped kernels run in their place."""
    best: dict = {}
    for row in rows:
        if row["ok"] and row["variant"] in ("grouped", variant):
            key = (row["model"], row["batch"], row["variant"])
            best[key] = min(best.get(key, float("inf")), row["us_per_block"])
    losses = [b for (model, b, kind), us in best.items()
              if kind == variant and us < best.get((model, b, "grouped"), float("inf"))]
    return max(losses, default=0) + 1


def build_oss_block(dtype=None, seed: int = 0):
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = GptOssMLP(config).to(dtype or torch.bfloat16)
        experts = block.experts
        for param, std in ((block.router.weight, 0.05), (block.router.bias, 0.1), (experts.gate_up_proj, 2880 ** -0.5),
                           (experts.gate_up_proj_bias, 0.1), (experts.down_proj, 2880 ** -0.5),
                           (experts.down_proj_bias, 0.1)):
            torch.nn.init.normal_(param, std=std)
    return config, block.eval()


def oss_must_read(batch: int, e=32, k=4, h=2880, i=2880, dtype_bytes=2) -> float:
    hit = e * (1 - (1 - k / e) ** batch)
    return (e * h + hit * 3 * h * i) * dtype_bytes


FIELDS = ("model", "batch", "variant", "config", "us_per_block", "gb_s", "max_abs_diff", "ok", "seconds", "error")


def sweep(model: str, batches: list[int], done=lambda rows: None, grids=GRIDS) -> list[dict]:
    """Every variant of the named grids (GRIDS; gpt-oss's small kernels: "small") at each batch; `done(rows)` gets
    each batch's rows as soon as they are measured (the CSV keeps what a cut run measured)."""
    import torch

    import gdtool.kernels.experts as experts
    from moe_block import build_block, must_read, time_graph

    rows = []
    for batch in batches:
        if model == "qwen3-30b-a3b":
            config, block = build_block(batch)
            args = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, 8, True, False)
            floor = must_read(batch)
            variants = [("grouped", cfg, lambda x, cfg=cfg: experts.block_grouped(x, *args, config=experts.GroupedConfig(
                **cfg))) for cfg in grid(GROUPED_GRID) if "grouped" in grids]
            if batch <= experts.MAX_TOKENS:
                default = experts.experts_config(2048, 768)
                variants.append(("small", {}, lambda x: experts.block_triton(x, *args)))
                spaces = [grid(space) for name, space in (("small", SMALL_GRID), ("routed", ROUTED_GRID),
                                                          ("packed", PACKED_GRID), ("warps", WARPS_GRID)) if name in grids]
                variants += [("small", cfg, lambda x, cfg=cfg: experts.block_triton(x, *args, config=experts.Config(
                    **{"router_rows": default.router_rows, **cfg}))) for space in spaces for cfg in space]
                one = experts.experts_config(2048, 768, 1)
                chains = [cfg for name, space in (("early", EARLY_GRID), ("early-tiles", EARLY_TILES_GRID))
                          if name in grids for cfg in grid(space)]
                variants += [("early", cfg, chained(lambda x, cfg=cfg: experts.block_triton(
                    x, *args, config=dataclasses.replace(one, **cfg)))) for cfg in chains]
        else:
            config, block = build_oss_block()
            e = block.experts
            args = (block.router.weight, e.gate_up_proj, e.down_proj, 4, block.router.bias, e.gate_up_proj_bias,
                    e.down_proj_bias, float(e.alpha), float(e.limit))
            floor = oss_must_read(batch)
            plain, oss = args[:4] + (False, False), args[4:]
            variants = [("grouped", cfg, lambda x, cfg=cfg: experts.block_grouped(
                x, *plain, config=experts.GroupedConfig(**cfg), oss=oss)) for cfg in grid(GROUPED_GRID)
                if "grouped" in grids]
            if batch <= experts.MAX_TOKENS and "small" in grids:
                variants += [("oss", cfg, lambda x, cfg=cfg: experts.block_oss(x, *args, config=experts.OssConfig(**cfg)))
                             for cfg in grid(OSS_GRID)]
        hidden = config.hidden_size
        x = torch.randn(batch, 1, hidden, device="cuda", dtype=torch.bfloat16)
        flat = x.view(batch, hidden)
        outputs = {}

        def hf(impl):
            config._experts_implementation = impl
            out = block(x)
            return out[0] if isinstance(out, tuple) else out
        with torch.inference_mode():
            reference = hf("batched_mm").view(batch, hidden).float()
            scale = float(reference.abs().max())
            for impl in ("batched_mm", "grouped_mm") if model == "qwen3-30b-a3b" else ("batched_mm",):
                us = time_graph(lambda impl=impl: outputs.__setitem__(impl, hf(impl)))
                rows.append(dict(model=model, batch=batch, variant=impl, config="", us_per_block=us,
                                 gb_s=floor / us / 1e3, max_abs_diff=0.0, ok=False))  # a peer, not a candidate
            for name, cfg, fn in variants:
                start = time.perf_counter()
                try:
                    us = time_graph(lambda fn=fn: outputs.__setitem__(name, fn(flat)))
                    us /= CHAIN if name == "early" else 1
                    diff = float((outputs[name].float() - reference).abs().max())
                except Exception as error:  # a config the GPU cannot run (shared memory, registers): its row says so
                    rows.append(dict(model=model, batch=batch, variant=name, config=repr(cfg), us_per_block=float("nan"),
                                     gb_s=float("nan"), max_abs_diff=float("nan"), ok=False,
                                     error=str(error).splitlines()[0][:200]))
                    continue
                rows.append(dict(model=model, batch=batch, variant=name, config=repr(cfg), us_per_block=us,
                                 gb_s=floor / us / 1e3, max_abs_diff=diff, ok=diff <= 2e-2 * scale,
                                 seconds=time.perf_counter() - start))
        done([r for r in rows if r["batch"] == batch])
        best = fastest([r for r in rows if r["batch"] == batch])
        for r in [r for r in rows if r["batch"] == batch and not r["config"]] + list(best.values()):
            print(f"{model} batch {batch:3d}  {r['variant']:10s} {r['us_per_block']:8.1f} us  {r['gb_s']:6.0f} GB/s  "
                  f"{r['config']}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--batch", default=None, help="comma-separated tokens per step (default: the model's list)")
    p.add_argument("--out", required=True, help="folder for sweep.csv")
    p.add_argument("--grids", default=",".join(GRIDS), help=f"comma-separated grids to sweep, of {', '.join(GRIDS)}")
    p.add_argument("--write-config", default=None, metavar="PATH",
                   help="then write the picks of every model's CSV in --out (this run's and the others') into this "
                        "tuning file (gdtool/kernels/configs/; created from the device's current one): the grouped "
                        "table, grouped_from, gpt-oss's tiles, the small kernels' rows per swept shape")
    args = p.parse_args(argv)
    grids = tuple(g for g in args.grids.split(",") if g)
    unknown = set(grids) - set(GRIDS)
    if unknown:
        p.error(f"--grids: unknown {', '.join(sorted(unknown))}; the grids are {', '.join(GRIDS)}")
    batches = [int(b) for b in (args.batch or MODELS[args.model]).split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.model}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()

        def done(rows):
            writer.writerows(rows)
            f.flush()
        sweep(args.model, batches, done, grids)
    print(f"wrote {path}")
    if args.write_config:
        import tuning_files
        paths = sorted(out / f"{model}.csv" for model in MODELS if (out / f"{model}.csv").exists())
        rows = [row for csv_path in paths for row in load(csv_path)]
        tuning_files.update(args.write_config, tuning_files.moe_sections(rows), "moe_sweep.py " + " ".join(
            sys.argv[1:] if argv is None else argv), [str(p) for p in paths])
        print(f"wrote the experts' picks of {', '.join(p.name for p in paths)} into {args.write_config}")


if __name__ == "__main__":
    main()
