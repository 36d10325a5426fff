"""The sweeps' side of the kernels' tuning files (gdtool/kernels/configs/, read by gdtool/kernels/tuning.py): write a
sweep's picks into a device's file with their provenance, and check a sweep against a shipped file.

Writing: `moe_sweep.py --write-config PATH` and `decode_kernels_probe.py --write-config PATH` call `update`. A
section a sweep covered gets its picks (exact-shape rows, or the grouped table) and a new provenance (commit from
GDTOOL_COMMIT or git, the sweep, its result files, the date); the others stay as they were. A file that does not exist
yet starts from the one the device reads now (the nearest of its capability, or the defaults).

Checking: per swept shape, whether the file's choice times within 3% of the sweep's fastest there (for the experts,
per model and batch: the switch to the grouped kernels and then the tiles, against the fastest of either path):

    python profiles/tuning_files.py --config gdtool/kernels/configs/FILE.json --gemv OUT/gemv.csv \
        --attention OUT/attention.csv --moe OUT/qwen3-30b-a3b.csv OUT/gpt-oss-20b.csv

prints one line an entry and exits 1 when any is out (or was not timed).

Adopting a GPU run's sweeps: the sweeps' own --write-config copy names the GPU machine's temporary folders and, run a
model a call, holds only its last model's grouped picks. Commit the CSVs (each folder with the env.json of its run),
then write every section they decide into the shipped file from the committed paths, the models' CSVs together:

    python profiles/tuning_files.py --config gdtool/kernels/configs/FILE.json --write \
        --gemv profiles/h100/decode-kernels/sweep-C/gemv.csv --attention profiles/h100/.../attention.csv \
        --moe profiles/h100/moe-sweep-C/qwen3-30b-a3b.csv profiles/h100/moe-sweep-C/gpt-oss-20b.csv
"""
from __future__ import annotations

import argparse
import ast
import csv
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gdtool.kernels import experts, gemv, tuning  # noqa: E402

TOLERANCE = 0.03
MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768), "gpt-oss-20b": (2880, 2880)}   # hidden, intermediate (moe_sweep's models)
GEMV_HEAD_DIMS = {"llama-1b": 64, "llama-8b": 128, "qwen3-8b": 128, "gemma-3-1b": 256}   # decode_kernels_probe.SHAPES


# -- writing --------------------------------------------------------------------------------------------------------

def commit() -> str:
    if os.environ.get("GDTOOL_COMMIT"):
        return os.environ["GDTOOL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no GDTOOL_COMMIT, no git)"


def device_path(directory: str = tuning.CONFIG_DIR) -> str:
    """The file name of this CUDA device's own tuning: name, capability, Triton version."""
    import torch
    from gdtool.kernels import triton as fast_triton
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    slug = "-".join(props.name.lower().replace("_", " ").split())
    return os.path.join(directory, f"{slug}_sm{props.major}{props.minor}_triton-{fast_triton.version()}.json")


def update(path: str, sections: dict, sweep: str, files: list[str], made_at: str | None = None) -> dict:
    """Write `sections` ({section: {field: value}}) into the tuning file at `path` with this sweep's provenance (its
    commit: `made_at`, else this checkout's); a new file starts from the device's current tuning, under the
    device's name, capability and Triton version."""
    if os.path.exists(path):
        data = tuning.read(path).data
    else:
        import torch
        from gdtool.kernels import triton as fast_triton
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        data = json.loads(json.dumps(tuning.current(device).data))
        data.update(device=props.name, capability=[props.major, props.minor], triton=fast_triton.version(),
                    note=f"Started from {os.path.basename(tuning.current(device).source)}; each section's provenance "
                         "says which sweep wrote it.")
    stamp = {"commit": made_at or commit(), "sweep": sweep, "files": [str(f) for f in files],
             "date": datetime.date.today().isoformat()}
    for section, values in sections.items():
        data[section].update(values, provenance=stamp)
    tuning.validate(data, path)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def gemv_timings(path, head_dims: dict = GEMV_HEAD_DIMS) -> dict:
    """{(section, shape): {config: us}} of a decode_kernels_probe gemv.csv at one row, PDL off, the Triton tiles:
    section "gemv" with shape (n, k, tiles), "qkv_rope" with (k, head dim). A config timed more than once at a shape
    (two models of one shape, the default's row beside the sweep's) gets the mean of its times."""
    times: dict = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kernel = row["kernel"]
            if row["pdl"] != "False" or row.get("rows", "1") != "1" or not kernel.startswith("triton") \
                    or "whole-head" in kernel or "(" not in kernel or not row.get("us"):
                continue
            config = ast.literal_eval("(" + kernel.split("(", 1)[1])
            n, k = int(row["n"]), int(row["k"])
            key = ("qkv_rope", (k, head_dims[row["model"]])) if row["proj"] == "qkv" else \
                ("gemv", (n, k, 2 if row["proj"] == "gate_up" else 1))
            times.setdefault(key, {}).setdefault(config, []).append(float(row["us"]))
    return {key: {config: sum(us) / len(us) for config, us in configs.items()} for key, configs in times.items()}


def gemv_sections(timed: dict) -> dict:
    """The fastest tiles of each swept shape as exact-shape rows of sections gemv and qkv_rope."""
    names = {"gemv": (("n", "k", "tiles"), ("block_n", "warps", "per_sm")),
             "qkv_rope": (("k", "d"), ("hb", "warps", "per_sm"))}
    out: dict = {}
    for (section, shape), times in sorted(timed.items()):
        over, values = names[section]
        best = min(times, key=times.get)
        out.setdefault(section, {"shapes": []})["shapes"].append(
            {"when": dict(zip(over, shape)), **dict(zip(values, best[:3]))})
    return out


def moe_sections(rows: list[dict]) -> dict:
    """The grouped table, grouped_from, gpt-oss's tiles and the small kernels' exact-shape rows that
    profiles/moe_sweep.py's rules read off these sweep rows (the models' CSVs together)."""
    import moe_sweep
    out: dict = {}
    picks = moe_sweep.grouped_picks(rows)
    if picks:
        table = []
        for batch, pick in sorted(picks.items()):
            if table and {k: v for k, v in table[-1].items() if k != "when"} == pick:
                table[-1]["when"]["tokens_max"] = batch
            else:
                table.append({"when": {"tokens_max": batch}, **pick})
        del table[-1]["when"]   # the last row covers every larger batch
        out["experts_grouped"] = {"tiles": table}
        if any(r["variant"] == "small" for r in rows):
            out["experts_grouped"]["from_tokens"] = moe_sweep.grouped_from(rows, "small")
    oss = moe_sweep.small_picks(rows, "oss")
    if 1 in oss:
        out["experts_oss"] = dict(oss[1], grouped_from=moe_sweep.grouped_from(rows, "oss"))
    shapes = []
    for model, (hidden, intermediate) in MOE_SHAPES.items():
        for batch, pick in sorted(moe_sweep.small_picks([r for r in rows if r["model"] == model]).items()):
            shapes.append({"when": {"hidden": hidden, "intermediate": intermediate, "tokens": batch}, **pick})
    if shapes:
        out["experts_small"] = {"shapes": shapes}
    return out


def attention_rows(files) -> list[dict]:
    """The rows of decode_kernels_probe attention.csv files, read together."""
    import pandas as pd
    return [r for path in files for r in pd.read_csv(path).to_dict("records")]


def attention_means(rows: list[dict]) -> dict:
    """Per split target (programs): the mean over the live lengths timed of its time (the faster of the combine's two
    forms at each), from decode_kernels_probe's --attention-targets rows."""
    best: dict = {}
    for row in rows:
        target = row.get("target")
        if target is None or target != target or row.get("us") is None:   # NaN: a row of the default plan
            continue
        key = (float(target), row["live"])
        best[key] = min(best.get(key, float("inf")), float(row["us"]))
    means: dict = {}
    for (target, _), us in best.items():
        means.setdefault(target, []).append(us)
    return {target: sum(us) / len(us) for target, us in means.items()}


def attention_section(rows: list[dict], multiprocessors: int) -> dict:
    """programs_per_sm of the split target whose mean time over the live lengths timed is the least."""
    means = attention_means(rows)
    return {"attention": {"programs_per_sm": min(means, key=means.get) / multiprocessors}}


def adopted(gemv_files, attention_files, moe_files, multiprocessors: int) -> list[tuple[str, dict, list[str]]]:
    """(sweep, sections, files) per kind of sweep given: what --write writes, each with its own provenance."""
    import moe_sweep
    out = []
    for path in gemv_files:
        out.append(("decode_kernels_probe.py --parts gemv --sweep full (gpu_run.sh kernels-sweep): each shape's "
                    "fastest tiles at one row", gemv_sections(gemv_timings(path)), [str(path)]))
    if attention_files:
        rows = attention_rows(attention_files)
        out.append(("decode_kernels_probe.py --parts attention --attention-targets (gpu_run.sh attention-plan): the "
                    f"split target with the least mean time, over {multiprocessors} multiprocessors",
                    attention_section(rows, multiprocessors), [str(p) for p in attention_files]))
    if moe_files:
        rows = [r for path in moe_files for r in moe_sweep.load(path)]
        out.append(("moe_sweep.py (gpu_run.sh moe-sweep): the models' CSVs together, moe_sweep's rules",
                    moe_sections(rows), [str(p) for p in moe_files]))
    return out


def sweep_commit(files) -> str | None:
    """The commit the sweeps ran at: git_commit of the env.json (or env-*.json) beside each file, joined; None where
    none says."""
    found = []
    for path in files:
        folder = Path(path).parent
        for env in [folder / "env.json", *sorted(folder.glob("env-*.json"))]:
            if env.exists():
                made = json.loads(env.read_text()).get("git_commit")
                if made and made not in found:
                    found.append(made)
                break
    return ", ".join(found) or None


# -- checking -------------------------------------------------------------------------------------------------------

def agreement(entries, tolerance: float = TOLERANCE) -> list[dict]:
    """Per (name, shipped µs or None, fastest µs): whether the shipped choice is within `tolerance` of the fastest
    (None: the sweep did not time the shipped choice, which fails)."""
    out = []
    for name, shipped, best in entries:
        ratio = None if shipped is None else shipped / best
        out.append(dict(entry=name, shipped_us=shipped, best_us=best, ratio=ratio,
                        ok=ratio is not None and ratio <= 1 + tolerance))
    return out


def gemv_entries(timed: dict, tune: tuning.Tuning) -> list[tuple]:
    entries = []
    for (section, shape), times in sorted(timed.items()):
        if section == "gemv":
            n, k, tiles = shape
            choice = gemv.gemv_config(1, n, k, tiles, tune)
        else:
            k, d = shape
            choice = gemv.qkv_rope_config(k, d, tune=tune)[:3]
        entries.append((f"{section} {shape} {choice}", times.get(choice), min(times.values())))
    return entries


def attention_entries(rows: list[dict], tune: tuning.Tuning, multiprocessors: int) -> list[tuple]:
    """The file's split target (programs_per_sm x the multiprocessors) against the target of least mean time."""
    means = attention_means(rows)
    if not means:
        return []
    target = tune["attention"]["programs_per_sm"] * multiprocessors
    shipped = next((us for t, us in means.items() if abs(t - target) < 0.5), None)
    return [(f"attention split target {target:g} programs (mean over the live lengths)", shipped,
             min(means.values()))]


def moe_entries(rows: list[dict], tune: tuning.Tuning) -> list[tuple]:
    """Per (model, batch) swept: the kernels the file runs there (its switch to the grouped ones, then the tiles it
    picks: the fastest row matching them) against the fastest of gdtool's kernels there, the other path included.
    Tiles the file never runs at that batch (the grouped ones below the switch) are not judged themselves; a row of
    them faster than the kernels that run there is (the switch comes late)."""
    groups: dict = {}
    for row in rows:
        if row["ok"] and row["config"] and row["variant"] in ("grouped", "small", "oss"):
            groups.setdefault((row["model"], row["batch"]), []).append(row)
    entries = []
    for (model, batch), group in sorted(groups.items()):
        own = "oss" if model.startswith("gpt-oss") else "small"
        variant = "grouped" if batch >= experts.grouped_from(tune, oss=own == "oss") else own
        if variant == "grouped":
            shipped = vars(experts.grouped_config(batch, tune))
        elif variant == "oss":
            shipped = vars(experts.oss_config(tune))
        else:
            shipped = vars(experts.experts_config(*MOE_SHAPES[model], batch, tune))
            shipped["chunk"] = shipped["chunk"] or experts.MAX_CHUNK
        matching = [r["us_per_block"] for r in group
                    if r["variant"] == variant and all(shipped.get(k) == v for k, v in r["config"].items())]
        entries.append((f"{model} batch {batch} {variant}", min(matching, default=None),
                        min(r["us_per_block"] for r in group)))
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True,
                   help="the tuning file to check or write; `device`: the file of this CUDA device's name, capability "
                        "and Triton version (gpu_run.sh tuning-check)")
    p.add_argument("--gemv", nargs="*", default=[], help="decode_kernels_probe gemv.csv files (one row, every tile)")
    p.add_argument("--moe", nargs="*", default=[], help="moe_sweep CSVs")
    p.add_argument("--attention", nargs="*", default=[],
                   help="decode_kernels_probe attention.csv files (--attention-targets rows)")
    p.add_argument("--multiprocessors", type=int, default=tuning.DEFAULT_MULTIPROCESSORS,
                   help="the swept device's multiprocessor count: the attention target is written per multiprocessor "
                        "(132 on the H100 SXM and the H200)")
    p.add_argument("--write", action="store_true",
                   help="write the sections these files decide into --config, their paths as provenance, instead "
                        "of checking")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    args = p.parse_args(argv)
    import moe_sweep
    if args.config == "device":
        import torch
        if not torch.cuda.is_available():
            p.error("--config device: the file of this machine's CUDA GPU, and it has none; name the file instead")
        args.config = device_path()
        args.multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    if args.write:
        if not (args.gemv or args.attention or args.moe):
            p.error("--write writes what sweeps decide: give their files (--gemv, --attention, --moe)")
        unknown = [f for f in args.gemv + args.attention + args.moe if sweep_commit([f]) is None]
        if unknown:
            p.error(f"no env.json (or env-*.json) naming a git_commit beside {', '.join(unknown)}: the commit the "
                    "sweep ran at is its provenance; commit the run's env.json beside each file (gpu_run.sh writes one)")
        for label, sections, files in adopted(args.gemv, args.attention, args.moe, args.multiprocessors):
            update(args.config, sections, label, files, made_at=sweep_commit(files))
            print(f"wrote {', '.join(sections)} into {args.config} from {', '.join(files)}")
        return 0
    tune = tuning.read(args.config)
    entries = []
    for path in args.gemv:
        entries += gemv_entries(gemv_timings(path), tune)
    entries += moe_entries([r for path in args.moe for r in moe_sweep.load(path)], tune)
    if args.attention:
        entries += attention_entries(attention_rows(args.attention), tune, args.multiprocessors)
    report = agreement(entries, args.tolerance)
    for r in report:
        shipped = "not timed" if r["shipped_us"] is None else f"{r['shipped_us']:.2f} us ({r['ratio']:.3f}x)"
        print(f"{'ok ' if r['ok'] else 'OUT'} {r['entry']}: shipped {shipped}, fastest {r['best_us']:.2f} us")
    bad = sum(not r["ok"] for r in report)
    print(f"{len(report) - bad} of {len(report)} within {args.tolerance:.0%} of the sweep's fastest")
    return 1 if bad or not report else 0


if __name__ == "__main__":
    sys.exit(main())
