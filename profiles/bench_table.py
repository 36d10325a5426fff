"""Markdown table of `python -m gdtool bench` results, from the JSON files it writes.

    python profiles/bench_table.py profiles/h200/bench/llama-1b/*.json profiles/h200/bench/llama-8b/*.json
    python profiles/bench_table.py --curve FILES...   # tok/s against batch per runner, and where it falls
    python profiles/bench_table.py --paths FILES...   # ms/step of each path the step took at each batch
    python profiles/bench_table.py --curve @profiles/h200/bench/batches/default-line.txt:llama-8b   # a list's files

Given the runs of two settings (one folder each), `--curve` keeps the faster at each batch: the curve the better
choice per batch would give, its file naming the setting that won.
"""
import json
import re
import sys
from pathlib import Path


def rows(path):
    doc = json.load(open(path))
    for r in doc["summary"]:
        yield doc["config"]["model"], r


def frame(paths):
    """One row per runner of every bench JSON in `paths`: model, batch, runner (its label), family (gdtool or a
    peer), status, tok/s, ms/step, % of floor, the floor itself (ms a step must take to read its bytes at the
    run's copy bandwidth) and the commit and GPU it ran on."""
    import pandas as pd
    out = []
    for path in paths:
        doc = json.load(open(path))
        env = doc.get("environment", {})
        for r in doc["summary"]:
            pct = r.get("floor_pct")
            floor = r["ms_per_step"] * pct / 100 if r.get("ms_per_step") is not None and pct else None
            out.append(dict(model=doc["config"]["model"], batch=r["batch"], runner=r["label"],
                            family=r.get("family"), status=r["status"], tok_s=r.get("tok_s"),
                            ms_per_step=r.get("ms_per_step"), floor_pct=pct, floor_ms=floor,
                            commit=env.get("git_commit"), gpu=env.get("device_name"), note=r.get("note"),
                            file=str(path)))
    return pd.DataFrame(out)


def command(config: dict, out: str) -> list[str]:
    """The `python -m gdtool bench` arguments that measure `config` (a bench JSON's "config") again into `out`: the same
    runners, peers, kernels and sizes, so the same file name (another GPU's run of a committed one)."""
    args = ["--model", config["model"], "--batch", str(config["batch"]), "--prompt-len", str(config["prompt_len"]),
            "--max-new-tokens", str(config["max_new_tokens"]), "--repeats", str(config["repeats"]),
            "--modes", *(config["modes"] or ["none"]), "--peers", *(config["peers"] or ["none"]),
            "--kernels", *config["kernels"], "--seed", str(config["seed"])]
    return args + (["--fuse-projections"] if config.get("fused_projections") else []) + ["--out", out]


def listed(path) -> dict:
    """{preset: [bench JSON paths]} from a list file of "preset<TAB>glob" lines (globs relative to the file's folder,
    '#' lines skipped; e.g. profiles/h200/bench/batches/default-line.txt), each glob's matches sorted, in file order."""
    path = Path(path)
    out: dict = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: {line!r} is not 'preset<TAB>glob'; write one tab between them")
            out.setdefault(fields[0], []).extend(sorted(path.parent.glob(fields[1])))
    return out


def _expand(args):
    """Arguments as given, with each "@LIST:PRESET" replaced by that preset's files in LIST (`listed`)."""
    out = []
    for arg in args:
        if not arg.startswith("@"):
            out.append(arg)
            continue
        name, _, preset = arg[1:].rpartition(":")
        if not name or not Path(name).is_file():
            raise SystemExit(f"{arg}: give @LIST:PRESET, LIST a file of 'preset<TAB>glob' lines "
                             "(e.g. @profiles/h200/bench/batches/default-line.txt:llama-8b)")
        try:
            files = listed(name).get(preset, [])
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if not files:
            raise SystemExit(f"{arg}: {name} lists no existing files for {preset!r}; its presets: "
                             f"{', '.join(listed(name)) or 'none'}")
        out += [str(p) for p in files]
    return out


def fastest(runs):
    """Per model, batch and GPU of `frame(...)`'s rows that ran: gdtool's fastest runner, and the fastest peer of
    the same run (the same JSON file: ratios only between what one process measured), with the floor and the
    commit. Peers of other runs are not compared; a run without a peer shows none. Indexed by (model, batch, gpu):
    runs on an H100 and an H200 side by side, never one GPU's runner against the other's."""
    import pandas as pd
    ok = runs[runs.status == "ok"].sort_values("ms_per_step")
    if "gpu" not in ok.columns:
        ok = ok.assign(gpu=None)
    ok = ok.assign(gpu=ok["gpu"].fillna("?"))
    out = []
    for (name, batch, gpu), group in ok.groupby(["model", "batch", "gpu"], sort=False):
        mine = group[group.family == "gdtool"]
        if not len(mine):
            continue
        best = mine.iloc[0]
        peers = group[(group.family == "peer") & (group.file == best.file)]
        out.append({"model": name, "batch": batch, "gpu": gpu, "gdtool, fastest": best.runner,
                    "ms/step": best.ms_per_step, "peer, fastest": peers.runner.iloc[0] if len(peers) else None,
                    "peer ms/step": peers.ms_per_step.iloc[0] if len(peers) else float("nan"),
                    "floor ms/step": best.floor_ms, "commit": str(best.commit)[:7]})
    summary = pd.DataFrame(out).sort_values(["model", "batch", "gpu"]).set_index(["model", "batch", "gpu"])
    summary["% of floor"] = 100 * summary["floor ms/step"] / summary["ms/step"]
    return summary


def path_of(note):
    """The step's path from a runner's note, its first clause ("fast: fast decode forward", "fast: HF forward
    compiled"): which code ran at that batch."""
    return re.split(r"[,(]", note or "")[0].strip()


def curve(runs):
    """Per model and runner of `frame(...)`'s rows that ran, ordered by batch: tok/s, its ratio to the batch
    before (`ratio`), and `cliff` where tokens per second fall as the batch grows (a larger batch must never decode
    fewer tokens a second: where it does, the path chosen at that batch is the wrong one). Two runs of one
    runner at one batch (a setting tried apart, in its own file) keep the faster."""
    import pandas as pd
    ok = runs[runs.status == "ok"].sort_values("tok_s", ascending=False)
    ok = ok.drop_duplicates(["model", "runner", "batch"]).sort_values(["model", "runner", "batch"])
    out = []
    for (model, runner), group in ok.groupby(["model", "runner"], sort=False):
        before = None
        for r in group.itertuples():
            ratio = r.tok_s / before if before else float("nan")
            out.append({"model": model, "runner": runner, "batch": r.batch, "path": path_of(getattr(r, "note", "")),
                        "tok_s": r.tok_s, "ms_per_step": r.ms_per_step, "ratio": ratio,
                        "cliff": bool(before) and r.tok_s < before, "file": r.file})
            before = r.tok_s
    return pd.DataFrame(out)


def paths(runs):
    """Per model and batch of `frame(...)`'s gdtool rows that ran: ms/step of each path the step took (`path_of`;
    two settings tried apart, e.g. `plan_bench.py --gemv-rows`), the fastest of each, and which path was faster."""
    ok = runs[(runs.status == "ok") & (runs.family == "gdtool")].copy()
    ok["path"] = [path_of(note) for note in ok.note]
    table = ok.pivot_table(index=["model", "batch"], columns="path", values="ms_per_step", aggfunc="min")
    table["faster"] = table.idxmin(axis=1)
    return table


def print_paths(files):
    table = paths(frame(files))
    names = [c for c in table.columns if c != "faster"]
    print("| model | batch | " + " | ".join(f"{n} ms/step" for n in names) + " | faster |")
    print("|---|---:|" + "---:|" * len(names) + "---|")
    for (model, batch), r in table.iterrows():
        print(f"| {model} | {batch} | " + " | ".join(fmt(r[n], ".3f") for n in names) + f" | {r.faster} |")


def fmt(value, spec):
    return "-" if value is None or value != value else format(value, spec)


def print_curve(paths):
    table = curve(frame(paths))
    print("| model | runner | batch | path | tok/s | ms/step | x batch before | file |")
    print("|---|---|---:|---|---:|---:|---:|---|")
    for r in table.itertuples():
        where = "/".join(Path(r.file).parts[-2:])  # the setting's folder and the file
        print(f"| {r.model} | {r.runner} | {r.batch} | {r.path} | {r.tok_s:.1f} | {r.ms_per_step:.3f} "
              f"| {fmt(r.ratio, '.2f')}{' **cliff**' if r.cliff else ''} | {where} |")
    falls = table[table.cliff]
    print(f"\n{len(falls)} cliff(s)" + "".join(f"; {r.model} {r.runner} at batch {r.batch}" for r in falls.itertuples()))
    return len(falls)


def main(paths):
    paths = _expand(paths)
    if not [p for p in paths if p not in ("--curve", "--paths")]:
        raise SystemExit("give the bench's JSON files: python profiles/bench_table.py [--curve | --paths] "
                         "profiles/h200/bench/<preset>/*.json")
    if paths[:1] == ["--curve"]:
        print_curve(paths[1:])
        return
    if paths[:1] == ["--paths"]:
        print_paths(paths[1:])
        return
    print("| model | batch | runner | tok/s | ms/step | % of floor | x gpt-fast | x generate static | status |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    everything = [row for path in paths for row in rows(path)]
    models = list(dict.fromkeys(model for model, _ in everything))
    for model, r in sorted(everything, key=lambda mr: (models.index(mr[0]), mr[1]["batch"])):  # stable: run order
        print(f"| {model} | {r['batch']} | {r['label']} | {fmt(r['tok_s'], '.1f')} | {fmt(r['ms_per_step'], '.3f')} "
              f"| {fmt(r['floor_pct'], '.1f')} | {fmt(r.get('x_gpt-fast'), '.2f')} "
              f"| {fmt(r.get('x_generate-static'), '.2f')} | {r['status']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
