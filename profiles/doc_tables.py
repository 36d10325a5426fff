"""The measured tables of the docs, rendered from the committed result files they come from.

    python profiles/doc_tables.py                  # every table, printed
    python profiles/doc_tables.py fast-pdl         # some of them (the keys of TABLES)
    python profiles/doc_tables.py --write          # render each doc's tables into it, between their markers
    python profiles/doc_tables.py --check          # exit 1 where a doc's table is not what its files give

A doc holds a rendered table between `<!-- rendered: NAME -->` and `<!-- end rendered -->` (NAME a key of TABLES);
nothing between the markers is typed by hand, and `tests/test_docs.py` renders every one again and compares. Each
table ends with its provenance: the device a row ran on (the result's sidecar) and the commit of the code that ran
(the commit in the file's path, else its sidecar's `git_commit` where GDTOOL_COMMIT set it, else COMMITS). Commit
hashes stand in those columns only: the prose of the docs names none (`docs/history.md` keeps the dated record).

Everything here reads files and runs no model: a CPU with pandas renders it.
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
H200 = PROFILES / "h200"
H100 = PROFILES / "h100"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PROFILES))

import bench_table  # noqa: E402  (profiles/bench_table.py: the bench's JSON files as rows)
from gdtool.core.rollout_step import default_refill_after  # noqa: E402

START = re.compile(r"<!-- rendered: ([\w-]+) -->")
END = "<!-- end rendered -->"

# Where neither the path nor the sidecar names the code that ran (the sidecar's git index was older than the tree
# copied to the GPU machine; profiles/MANIFEST.md names the commit of each): path prefix -> commit.
COMMITS = {
    "profiles/h200/nsys-graph/": "a9a2052",
    "profiles/h200/bench/llama-1b/llama-1b_b1_p128_n256_khf+compiled_fused": "7765f37",
    "profiles/h200/bench/llama-1b/llama-1b_b64_p128_n256_khf+compiled_fused": "7765f37",
    "profiles/h200/bench/llama-8b/llama-8b_b1_p128_n256_khf+compiled_fused": "7765f37",
    "profiles/h200/bench/llama-8b/llama-8b_b64_p128_n256_kcompiled_fused": "7765f37",
    # HF's kernels, run from a tree whose index was a6bf446 with local changes: the code of 7c2fae9
    "profiles/h100/rollout-bench/llama-1b_rollout_s128_n256_p128_geom128cap512_static-host-device-eos-off.": "7c2fae9",
    "profiles/h100/rollout-bench/llama-1b_rollout_s16_n256_p128_geom128cap512_static-host-device-eos-off.": "7c2fae9",
    "profiles/h100/rollout-bench/llama-1b_rollout_s32_n256_p128_geom128cap512_static-host-device-eos-off.": "7c2fae9",
    "profiles/h100/rollout-bench/llama-1b_rollout_s64_n1024_p128_geom128cap512.": "7c2fae9",
}


# -- provenance ------------------------------------------------------------------------------------------------

def _sidecar(path: Path) -> dict:
    """The environment a result file was made in: a bench JSON's own `environment`, else the `env.json` or
    `env-<stem>.json` beside it ({} where there is none)."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "environment" in doc:
            return doc["environment"]
    for name in (f"env-{path.stem}.json", "env.json"):
        if (path.parent / name).exists():
            doc = json.loads((path.parent / name).read_text())
            return doc.get("environment", doc)
    return {}


def device(path: Path) -> str:
    env = _sidecar(path)
    name = env.get("device_name") or env.get("gpu") or "?"
    return name.replace("NVIDIA ", "")


def tuning_of(path: Path):
    """The tuning gdtool reads on the GPU that made `path`: the file of its sidecar's GPU name and Triton version (a
    Hopper, capability 9.0: the sidecars name no capability, and every GPU here has been one)."""
    from types import SimpleNamespace
    from gdtool.kernels import tuning
    env = _sidecar(path)
    props = SimpleNamespace(name=env.get("device_name") or env.get("gpu") or "?", major=9, minor=0,
                            multi_processor_count=tuning.DEFAULT_MULTIPROCESSORS)
    return tuning.for_properties(props, env.get("triton") or "3.6.0")


def commit(path: Path) -> str:
    relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
    for prefix, value in COMMITS.items():
        if relative.startswith(prefix):
            return value
    named = re.findall(r"(?<![0-9a-f])[0-9a-f]{7}(?![0-9a-f])", relative)
    if named:
        return named[-1]
    env = _sidecar(path)
    if env.get("git_commit_source") == "GDTOOL_COMMIT":
        return str(env["git_commit"])[:7]
    raise ValueError(f"{relative}: no commit in its path or its sidecar; add it to COMMITS (profiles/MANIFEST.md "
                     "names the commit of each result file)")


def _joined(values) -> str:
    return " / ".join(dict.fromkeys(values))


# -- formatting ------------------------------------------------------------------------------------------------

def fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def table(header: list[str], rows: list[list], right: set[int] = frozenset()) -> str:
    """A markdown table; the columns whose index is in `right` aligned right (numbers)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _bench(path: Path) -> list[dict]:
    """The summary rows of one bench JSON (`bench_table.frame`: runner, status, tok/s, ms/step, % of floor)."""
    return bench_table.frame([path]).to_dict("records")


def _runner(rows: list[dict], label: str) -> dict | None:
    return next((r for r in rows if r["runner"] == label and r["status"] == "ok"), None)


def _fastest_peer(rows: list[dict]) -> dict | None:
    peers = [r for r in rows if r["family"] != "gdtool" and r["status"] == "ok" and r["ms_per_step"] is not None]
    return min(peers, key=lambda r: r["ms_per_step"], default=None)


# -- docs/results.md -------------------------------------------------------------------------------------------

NSYS_GRAPH = H200 / "nsys-graph" / "summary.csv"


def results_nsys() -> str:
    """Per decode step under Nsight Systems' graph-level trace, llama-1b at batch 1 and 16 (medians)."""
    rows = []
    with open(NSYS_GRAPH) as f:
        for r in csv.DictReader(f):
            rows.append([r["batch"], r["mode"], fmt(float(r["host_us"]), ".0f"), fmt(float(r["device_busy_us"]), ".0f"),
                         fmt(float(r["gpu_idle_us"]), ".1f" if float(r["gpu_idle_us"]) < 10 else ".0f"), r["bound"],
                         device(NSYS_GRAPH), commit(NSYS_GRAPH)])
    return table(["batch", "mode", "host work µs/step", "GPU busy µs/step", "GPU idle µs/step", "bound", "device",
                  "commit"], rows, right={0, 2, 3, 4})


# The compiled step (fused projections) against its peers, each file one process: llama-1b and llama-8b.
PEERS_COMPILED = [H200 / "bench" / "llama-1b" / f"llama-1b_b{b}_p128_n256_khf+compiled_fused.json" for b in (1, 64)] + [
    H200 / "bench" / "llama-8b" / "llama-8b_b1_p128_n256_khf+compiled_fused.json",
    H200 / "bench" / "llama-8b" / "llama-8b_b64_p128_n256_kcompiled_fused.json"]


def peers_compiled() -> str:
    """`kernels="compiled"` with fused projections against what users run instead, in the same process."""
    rows = []
    for path in PEERS_COMPILED:
        runs = _bench(path)
        ours = _runner(runs, "gdtool device-loop+compiled")
        cells = [ours["model"], ours["batch"], fmt(ours["tok_s"], ".1f"), fmt(ours["ms_per_step"])]
        for label in ("gpt-fast-style step", "HF generate static+compile"):
            peer = _runner(runs, label)
            cells.append(f"{peer['tok_s']:.1f} ({peer['ms_per_step'] / ours['ms_per_step']:.2f}x)")
        rows.append(cells + [fmt(ours["floor_pct"], ".1f"), device(path), commit(path)])
    return table(["model", "batch", "gdtool device-loop+compiled tok/s", "ms/step", "gpt-fast-style tok/s (gdtool x)",
                  "generate static+compile tok/s (gdtool x)", "% of floor", "device", "commit"], rows,
                 right={1, 2, 3, 6})


# `kernels="fast"` per preset and batch: the latest bench of each, with the peer that ran in the same process; a
# path under each GPU's bench folder (BENCHES), a row for each GPU that has the file, side by side.
BENCH = H200 / "bench"
BENCHES = [BENCH, PROFILES / "h100" / "bench"]
PEERS_FAST = [
    "llama-1b/llama-1b_b1_p128_n256_kfast.json",
    "llama-1b/llama-1b_b64_p128_n256_kfast_fused.json",
    "llama-8b/llama-8b_b1_p128_n256_kfast.json",
    "llama-8b/llama-8b_b64_p128_n256_kfast_fused.json",
    "qwen3-8b/qwen3-8b_b1_p128_n256_kfast.json",
    "qwen3-8b/qwen3-8b_b64_p128_n256_kfast_fused.json",
    "gemma-3-1b/fused-projections/gemma-3-1b_b1_p128_n256_kcompiled+fast_fused.json",
    "gemma-3-1b/fused-projections/gemma-3-1b_b64_p128_n256_kcompiled+fast_fused.json",
    "qwen3-30b-a3b/qwen3-30b-a3b_b1_p128_n256_kfast.json",
    "qwen3-30b-a3b/qwen3-30b-a3b_b64_p128_n256_kfast.json",
    "gpt-oss-20b/fused-projections/gpt-oss-20b_b1_p128_n256_kfast_fused.json",
    "gpt-oss-20b/gpt-oss-20b_b64_p128_n256_kfast.json",
]


def peers_fast() -> str:
    """`kernels="fast"` (step-graph) per preset and batch, beside the fastest peer of the same run; one row per GPU
    whose bench folder holds the run."""
    rows = []
    for path in (bench / name for name in PEERS_FAST for bench in BENCHES if (bench / name).exists()):
        runs = _bench(path)
        ours = _runner(runs, "gdtool step-graph+fast")
        peer = _fastest_peer(runs)
        against = f"{peer['runner']} {peer['tok_s']:.1f} ({peer['ms_per_step'] / ours['ms_per_step']:.2f}x)" \
            if peer else "none in this run"
        rows.append([ours["model"], ours["batch"], "yes" if path.stem.endswith("_fused") else "no",
                     fmt(ours["tok_s"], ".1f"), fmt(ours["ms_per_step"]), against, fmt(ours["floor_pct"], ".0f"),
                     device(path), commit(path)])
    return table(["model", "batch", "fused projections", "gdtool step-graph+fast tok/s", "ms/step",
                  "peer in the same run: tok/s (gdtool x)", "% of floor", "device", "commit"], rows,
                 right={1, 3, 4, 6})


# The issue's targets for kernels="fast": a share of the floor per batch, and llama-1b's step at batch 1 on an H200.
FLOOR_TARGETS = {1: 80.0, 64: 70.0}
STEP_TARGETS = {("llama-1b", 1, "H200"): 0.75}   # ms a step: past a hand-written megakernel's 759.8 µs on an H200


def fast_targets() -> str:
    """Each run of the fast peers table against its target: the share of its floor at batch 1 and 64, and, where one is
    set, the step's time; met or not, and how far."""
    rows = []
    for path in (bench / name for name in PEERS_FAST for bench in BENCHES if (bench / name).exists()):
        ours = _runner(_bench(path), "gdtool step-graph+fast")
        share, want = ours["floor_pct"], FLOOR_TARGETS[ours["batch"]]
        gpu = device(path)
        step = STEP_TARGETS.get((ours["model"], ours["batch"], gpu))
        met = share >= want and (step is None or ours["ms_per_step"] <= step)
        short = [f"{want - share:.0f} points of the floor" if share < want else "",
                 f"{1e3 * (ours['ms_per_step'] - step):.0f} µs of the step" if step and ours["ms_per_step"] > step else ""]
        rows.append([ours["model"], ours["batch"], fmt(ours["ms_per_step"]), fmt(share, ".1f"),
                     f">= {want:.0f}" + (f", <= {step} ms" if step else ""), "yes" if met else "no",
                     ", ".join(filter(None, short)) or "-", gpu, commit(path)])
    return table(["model", "batch", "ms/step", "% of floor", "target", "met", "short by", "device", "commit"], rows,
                 right={1, 2, 3})


def rerun(gpu: str, into: str = "profiles", again: bool = False) -> list[str]:
    """The bench command lines (`bench_table.command`) that measure each PEERS_FAST run again into INTO/GPU/bench/,
    under the same name, for the runs profiles/GPU/bench/ lacks (`again`: every run): another GPU's rows of the fast
    peers table, or this GPU's at the head."""
    import shlex
    lines = []
    for name in PEERS_FAST:
        if not again and (PROFILES / gpu / "bench" / name).exists():
            continue
        config = json.loads((BENCH / name).read_text())["config"]
        out = (Path(into) / gpu / "bench" / name).parent.as_posix()
        lines.append(shlex.join(["python", "-m", "gdtool", "bench", *bench_table.command(config, out)]))
    return lines


# -- docs/fast.md ----------------------------------------------------------------------------------------------

# The fast step at 1-4 rows, step-graph, fused projections, each run apart: the matrix-vector kernels (the fast
# decode forward) against the compiled HF forward with cuBLAS's products and gdtool's split-KV attention
# (`plan_bench.py --gemv-rows 1`), what the step runs past its line.
BATCHES = BENCH / "batches"
LINE_FILES = [
    *sorted((BATCHES / "llama-1b" / "5a2de9b" / "line-8").glob("*_b[124]_*.json")),
    *sorted((BATCHES / "llama-1b" / "5a2de9b-gemv-line" / "line-8").glob("*_b3_*.json")),
    *sorted((BATCHES / "llama-8b" / "5a2de9b" / "line-8").glob("*_b1_*.json")),
    *sorted((BATCHES / "qwen3-8b" / "5a2de9b-gemv-line" / "line-8").glob("*_b1_*.json")),
    *sorted(BATCHES.glob("*/763504d/chunk-0/*.json")),
    *sorted(BATCHES.glob("*/6a6ed8e/line-1/*.json")),
]
HIDDEN = {"llama-1b": 2048, "llama-8b": 4096, "qwen3-8b": 4096}   # the presets' hidden sizes (gdtool/core/models.py)


def fast_line() -> str:
    """ms a step at 1-4 rows on each path, and the path `forward.MEASURED_LINES` gives that batch."""
    from gdtool.kernels import forward
    found: dict = {}
    for path in LINE_FILES:
        for r in _bench(path):
            if r["status"] == "ok" and r["family"] == "gdtool":
                which = "kernels" if bench_table.path_of(r["note"]) == "fast: fast decode forward" else "matmuls"
                found.setdefault((r["model"], r["batch"]), {})[which] = (r["ms_per_step"], path)
    rows = []
    for (model, batch), got in sorted(found.items(), key=lambda kv: (list(HIDDEN).index(kv[0][0]), kv[0][1])):
        kernels, matmuls = got.get("kernels"), got.get("matmuls")
        faster = "-" if not (kernels and matmuls) else "kernels" if kernels[0] < matmuls[0] else "matmuls"
        default = "kernels" if batch <= forward.gemv_rows(forward.line_paths(HIDDEN[model])) else "matmuls"
        paths = [found_path for _, found_path in filter(None, (kernels, matmuls))]
        rows.append([model, batch, fmt(kernels[0] if kernels else None), fmt(matmuls[0] if matmuls else None), faster,
                     default, _joined(device(p) for p in paths), " / ".join(commit(p) for p in paths)])
    return table(["model", "rows", "matrix-vector kernels ms/step", "compiled forward, cuBLAS ms/step", "faster",
                  "default path", "device", "commit (kernels / matmuls)"], rows, right={1, 2, 3})


PDL_PRESETS = ("gemma-3-1b", "llama-1b")


def fast_pdl() -> str:
    """The fast step at batch 1, step-graph, with PDL off, on every kernel and `auto` (GDTOOL_PDL=0, 1, auto)."""
    rows = []
    for preset in PDL_PRESETS:
        paths = [BENCH / preset / f"pdl-{setting}" / f"{preset}_b1_p128_n256_kfast.json" for setting in ("0", "1", "auto")]
        ms = [_runner(_bench(p), "gdtool step-graph+fast")["ms_per_step"] for p in paths]
        rows.append([preset, 1, *(fmt(v) for v in ms), _joined(device(p) for p in paths), _joined(commit(p) for p in paths)])
    return table(["model", "batch", "PDL off ms/step", "on", "auto", "device", "commit"], rows, right={1, 2, 3, 4})


# The experts sweeps each tuning file's experts tiles were read from (its experts_grouped provenance): one MoE block
# captured, µs a block per tokens a step, the best config of each path beside HF's two implementations.
EXPERTS_SWEEPS = [(H200 / "moe-sweep-c6bba88" / "qwen3-30b-a3b.csv", "qwen3_moe", "small"),
                  (H200 / "moe-sweep-0f91d78" / "gpt-oss-20b.csv", "gpt_oss", "oss"),
                  (H100 / "moe-sweep-1bc10cb" / "qwen3-30b-a3b.csv", "qwen3_moe", "small"),
                  (H100 / "moe-sweep-1bc10cb" / "gpt-oss-20b.csv", "gpt_oss", "oss")]


def fast_experts() -> str:
    """Per tokens a step: the small kernels' best, the grouped kernels' best, HF's batched_mm and grouped_mm, and
    the path gdtool runs there (`experts.runs_grouped`, with the tuning of the sweep's GPU)."""
    from gdtool.kernels.experts import tiles
    rows = []
    for path, family, small in EXPERTS_SWEEPS:
        best: dict = {}
        with open(path) as f:
            for r in csv.DictReader(f):
                ours = r["variant"] in (small, "grouped")
                if ours and (r["ok"] != "True" or r["error"]):
                    continue
                key = (int(r["batch"]), "small" if r["variant"] == small else r["variant"])
                best[key] = min(best.get(key, float("inf")), float(r["us_per_block"]))
        for batch in sorted({b for b, _ in best}):
            rows.append([path.stem, batch, *(fmt(best.get((batch, v)), ".1f")
                                                 for v in ("small", "grouped", "batched_mm", "grouped_mm")),
                         "grouped" if tiles.runs_grouped(family, batch, tuning_of(path)) else "small", device(path),
                         commit(path)])
    return table(["model", "tokens", "small kernels µs", "grouped kernels µs", "HF batched_mm µs", "HF grouped_mm µs",
                  "gdtool runs", "device", "commit"], rows, right={1, 2, 3, 4, 5})


ACCURACY = H200 / "accuracy-a7748ba" / "step.csv"


def fast_accuracy() -> str:
    """`accuracy()`: kernels="fast" and HF's bf16 kernels, each against the model upcast to float32, teacher-forced."""
    rows = []
    with open(ACCURACY) as f:
        for r in csv.DictReader(f):
            rows.append([r["model"], r["batch"], *(fmt(float(r[c]), spec) for c, spec in (
                ("fast_max_error", ".3f"), ("fast_mean_error", ".3f"), ("fast_top1", ".2f"),
                ("hf_max_error", ".3f"), ("hf_mean_error", ".3f"), ("hf_top1", ".2f"), ("max_abs_logit", ".2f"))),
                device(ACCURACY), commit(ACCURACY)])
    return table(["model", "batch", "fast: largest error", "mean error", "top-1 as float32", "HF bf16: largest error",
                  "mean error", "top-1 as float32", "largest logit", "device", "commit"], rows,
                 right=set(range(1, 9)))


# Every tile config of a preset's projections at one row, timed alone, PDL off (`kernels-sweep`): what
# gemv.gemv_config and gemv.qkv_rope_config pick on that GPU (tests/test_fast_kernels.py holds the H200's within 3% and
# 5% of the fastest; tests/test_tuning.py the H100's within 3%).
GEMV_SWEEPS = [("gemma-3-1b", H200 / "decode-kernels" / "sweep-6e765ba" / "gemv.csv", 256),
               ("llama-1b", H200 / "decode-kernels" / "sweep-14cc799" / "gemv.csv", 64),
               ("llama-8b", H200 / "decode-kernels" / "sweep-fa2489e" / "gemv.csv", 128),
               *((model, H100 / "decode-kernels" / "sweep-1bc10cb" / "gemv.csv", head_dim)
                 for model, head_dim in (("gemma-3-1b", 256), ("llama-1b", 64), ("llama-8b", 128), ("qwen3-8b", 128)))]


def fast_tiles() -> str:
    """Per projection at one row: cuBLAS's matmul alone, the tiles gdtool picks today, the fastest tiles swept."""
    from gdtool.kernels import gemv
    rows = []
    for model, path, head_dim in GEMV_SWEEPS:
        tune = tuning_of(path)
        timed: dict = {}
        cublas: dict = {}
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["model"] != model or r["pdl"] != "False":
                    continue
                key = (r["proj"], int(r["n"]), int(r["k"]))
                if r["kernel"].startswith("cublas"):
                    cublas[key] = float(r["us"])
                elif r["kernel"].startswith("triton") and "whole-head" not in r["kernel"] and "(" in r["kernel"]:
                    timed.setdefault(key, {})[ast.literal_eval("(" + r["kernel"].split("(", 1)[1])] = float(r["us"])
        for (proj, n, k), times in timed.items():
            picked = gemv.qkv_rope_config(k, head_dim, tune=tune)[:3] if proj == "qkv" else \
                gemv.gemv_config(1, n, k, 2 if proj == "gate_up" else 1, tune)
            best = min(times, key=times.get)
            rows.append([model, proj, f"{n} x {k}", fmt(cublas.get((proj, n, k)), ".2f"), str(picked),
                         fmt(times.get(picked), ".2f"), str(best), fmt(times[best], ".2f"), device(path), commit(path)])
    return table(["model", "projection", "N x K", "cuBLAS µs", "gdtool's tiles (rows, warps, per SM)", "µs",
                  "fastest swept", "µs", "device", "commit"], rows, right={3, 5, 7})


def rollout_bench() -> str:
    """`bench --workload rollout` per model, kernels and slot count: useful tokens/s of static batches, host and device
    refill, HF's continuous batching where it ran, and the device runner's ratios, share and fraction of its ideal;
    the refill runners' decode step (host: its decode time over its steps) beside the EOS-off step, and the prefill
    time per prompt (host: its prefill time over the prompts). Runs from before refill_rows (no such config field)
    refilled one prompt at a time: 1 / 1; runs from before refill_widths, at one width."""
    rows = []
    for path in sorted((PROFILES / "h100" / "rollout-bench").glob("*.json")):
        doc = json.loads(path.read_text())
        cfg, by = doc["config"], {s["runner"]: s for s in doc["summary"] if s["status"] == "ok"}

        def tok(runner):
            return f"{by[runner]['tok_s']:,.0f}" if runner in by else "-"

        static, host, dev = (by.get(r) for r in ("static", "host", "device"))
        after = cfg.get("refill_after", 1)   # None: the library's default for the slots
        shape = (cfg.get("refill_rows", 1), default_refill_after(cfg["slots"]) if after is None else after,
                 cfg.get("refill_widths", 1))
        lo = cfg.get("prompt_min") or cfg["prompt_len"]   # ragged prompts: LO-HI tokens
        prompt = str(cfg["prompt_len"]) if lo == cfg["prompt_len"] else f"{lo}-{cfg['prompt_len']}"
        rows.append((cfg["model"], cfg.get("kernels", "hf"), cfg["slots"], cfg["prompts"], (lo != cfg["prompt_len"],) + shape, [
            cfg["model"], cfg.get("kernels", "hf"), cfg["slots"], f"{cfg['prompts']:,}", prompt,
            " / ".join(map(str, shape)),
            tok("static"), tok("host"),
            tok("device"), tok("hf-cb"), tok("eos-off"),
            fmt(dev["tok_s"] / static["tok_s"], ".2f") if dev and static else "-",
            fmt(dev["tok_s"] / host["tok_s"], ".2f") if dev and host else "-",
            f"{fmt(static['row_step_share'], '.2f')} / {fmt(dev['row_step_share'], '.2f')}" if dev and static else "-",
            fmt(dev.get("of_ideal"), ".2f") if dev else "-",
            f"{host['host_syncs']:,} / {dev['host_syncs']:,}" if dev and host else "-",
            f"{fmt(1e3 * host['decode_s'] / host['decode_steps'], '.1f')} / {fmt(1e3 * by['eos-off']['step_s'], '.1f')}"
            if host and "eos-off" in by else "-",
            fmt(1e3 * host["prefill_s"] / cfg["prompts"], ".1f") if host else "-",
            device(path), commit(path)]))
    kernels = {"hf": 0, "compiled": 1, "fast": 2}
    rows.sort(key=lambda r: (r[0], kernels.get(r[1], 9), r[2], r[3], r[4]))
    return table(["model", "kernels", "slots", "prompts", "prompt tokens", "refill rows / after / widths", "static", "host", "device", "HF CB",
                  "EOS off", "device / static", "device / host", "share static / device", "device of ideal",
                  "host syncs host / device", "ms a step: refill (host) / EOS off", "ms of prefill a prompt (host)",
                  "device", "commit"], [r[5] for r in rows], right=set(range(2, 18)))


# The embedding lookup apart and folded into the first qkv_rope (`gpu_run.sh OUT bench-fold`): MODEL-fold-F-rR.json,
# the fast step at batch 1 in new processes, the two settings alternating, twice each.
FOLD = PROFILES / "h100" / "bench-fold"


def fast_fold() -> str:
    """Per model: each setting's ms a step (its runs, in order) and the mean change folding makes."""
    runs = {}
    for path in sorted(FOLD.glob("*-fold-*-r*.json")):
        model, fold, _ = re.fullmatch(r"(.+)-fold-([01])-r(\d+)\.json", path.name).groups()
        row = json.loads(path.read_text())["summary"][0]
        runs.setdefault(model, {}).setdefault(fold, []).append((row["ms_per_step"], row["floor_pct"], path))
    rows = []
    for model, by in runs.items():
        apart, folded = ([ms for ms, _, _ in by[f]] for f in ("0", "1"))
        change = 1e3 * (sum(folded) / len(folded) - sum(apart) / len(apart))
        last = by["1"][-1][2]
        rows.append([model, ", ".join(f"{ms:.4f}" for ms in apart), ", ".join(f"{ms:.4f}" for ms in folded),
                     f"{change:+.1f}", f"{by['1'][-1][1]:.1f}", device(last), commit(last)])
    return table(["model (batch 1)", "ms a step, lookup apart", "folded", "change µs (means)", "% of floor (folded)",
                  "device", "commit"], rows, right={1, 2, 3, 4})


# Each kernel of the fast step against its own floor (`kernel_breakdown.floor_account`), per node trace: its bytes over
# the copy bandwidth measured beside the trace (copy_gb_s.txt, which nsys-fast writes), else by the bench run named
# here (the same preset, batch and GPU).
FLOOR_TRACES = [
    (H200 / "nsys-fast" / "llama-1b-b1-e4c1eba", BENCH / "llama-1b" / "llama-1b_b1_p128_n256_kfast.json"),
    (H200 / "nsys-fast" / "gemma-3-1b-b1-p4096-a7748ba",
     BENCH / "gemma-3-1b" / "fused-projections" / "gemma-3-1b_b1_p128_n256_kcompiled+fast_fused.json"),
    (H200 / "nsys-fast" / "qwen3-30b-a3b-b1-4d5ca74", BENCH / "qwen3-30b-a3b" / "qwen3-30b-a3b_b1_p128_n256_kfast.json"),
    (H100 / "nsys-fast" / "llama-1b-b64-fused-4bc4f5c", None),      # 64 rows: the compiled HF forward, cuBLAS's products
    (H100 / "nsys-fast" / "gemma-3-1b-b64-fused-4bc4f5c", None),
]


def fast_floors() -> str:
    """Per traced step: its kernels' own time, the sum of their floors, and the roles furthest above theirs."""
    import kernel_breakdown
    rows = []
    for folder, bench in FLOOR_TRACES:
        export = next((folder / "fast").glob("*.sqlite.gz"))
        preset, batch, prompt, _ = kernel_breakdown.trace_folder(folder)
        copy, source = kernel_breakdown.trace_copy_gb_s(folder / "fast", bench)
        source = f"bench, {commit(bench)}" if source else "the trace's part"
        kernels, launches = kernel_breakdown.launch_kernels(export)
        account = kernel_breakdown.floor_account(kernels, launches, preset, batch, copy, prompt_len=prompt)
        own, floor = account["own"].sum(), account["floor"].sum()
        above = "; ".join(f"{str(role).strip('`')} {over:.0f}" for role, over in account["over"].nlargest(4).items())
        rows.append([preset, batch, prompt, f"{own:.1f}", f"{floor:.1f}", f"{100 * floor / own:.0f}", above,
                     f"{copy:.0f} ({source})", device(export), commit(export)])
    return table(["model", "batch", "prompt", "kernels µs a step", "their floors µs", "% of floor",
                  "furthest above their floors (µs)", "copy GB/s (measured by)", "device", "commit"], rows,
                 right={1, 2, 3, 4, 5})


TABLES = {"results-nsys": results_nsys, "peers-compiled": peers_compiled, "peers-fast": peers_fast,
          "fast-targets": fast_targets,
          "fast-line": fast_line, "fast-pdl": fast_pdl, "fast-experts": fast_experts, "fast-accuracy": fast_accuracy,
          "fast-tiles": fast_tiles, "fast-fold": fast_fold, "fast-floors": fast_floors, "rollout-bench": rollout_bench}
DOCS = [ROOT / "docs" / "results.md", ROOT / "docs" / "fast.md", ROOT / "docs" / "rollout.md"]   # the docs that hold rendered tables


# -- the docs' markers -----------------------------------------------------------------------------------------

def blocks(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of each rendered block: the text between a start marker's line and its end marker."""
    out = []
    for match in START.finditer(text):
        body = match.end() + 1
        end = text.find(END, body)
        if end < 0:
            raise ValueError(f"<!-- rendered: {match.group(1)} --> has no {END} after it")
        out.append((match.group(1), body, end))
    return out


def render(text: str, rendered: dict | None = None) -> str:
    """`text` with each rendered block's body made again from its files."""
    rendered = {} if rendered is None else rendered
    out, last = [], 0
    for name, start, end in blocks(text):
        if name not in TABLES:
            raise ValueError(f"<!-- rendered: {name} -->: no such table (profiles/doc_tables.py TABLES: {list(TABLES)})")
        if name not in rendered:
            rendered[name] = TABLES[name]()
        out += [text[last:start], rendered[name], "\n"]
        last = end
    return "".join(out + [text[last:]])


def stale(docs=DOCS) -> list[str]:
    """The docs whose rendered tables differ from what their files give ([] when none)."""
    rendered: dict = {}
    return [str(doc.relative_to(ROOT)) for doc in docs if render(doc.read_text(), rendered) != doc.read_text()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"tables to print (default: all): {', '.join(TABLES)}")
    p.add_argument("--write", action="store_true", help="render the tables into the docs that hold their markers")
    p.add_argument("--check", action="store_true", help="exit 1 where a doc's tables are not what their files give")
    p.add_argument("--rerun", metavar="GPU", help="print the bench commands that measure every run of the fast peers "
                   "table again for profiles/GPU/bench/ (e.g. h100), where that GPU's row is missing, one a line")
    p.add_argument("--again", action="store_true", help="with --rerun: every run, also those profiles/GPU/bench/ holds "
                   "(that GPU's rows measured again at the head)")
    p.add_argument("--into", default="profiles", metavar="DIR",
                   help="with --rerun: the commands write under DIR/GPU/bench/ (a GPU machine's output folder; "
                        "default profiles)")
    args = p.parse_args(argv)
    if args.rerun:
        print("\n".join(rerun(args.rerun, args.into, args.again)) or
              f"every run of the fast peers table is in profiles/{args.rerun}/bench/")
        return 0
    if args.check:
        out = stale()
        print("\n".join(f"{doc}: its rendered tables differ from their files (python profiles/doc_tables.py --write)"
                        for doc in out) or "ok: every rendered table is what its files give")
        return 1 if out else 0
    if args.write:
        rendered: dict = {}
        for doc in DOCS:
            doc.write_text(render(doc.read_text(), rendered))
        return 0
    unknown = [n for n in args.names if n not in TABLES]
    if unknown:
        p.error(f"unknown table(s) {unknown}; choose from {list(TABLES)}")
    print("\n\n".join(f"### {name}\n\n{TABLES[name]()}" for name in args.names or TABLES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
