"""Markdown table of `python -m gdtool bench` results, from the JSON files it writes.

    python profiles/bench_table.py profiles/h200/bench/llama-1b/*.json profiles/h200/bench/llama-8b/*.json
"""
import json
import sys


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
                            commit=env.get("git_commit"), gpu=env.get("device_name"), file=str(path)))
    return pd.DataFrame(out)


def fastest(runs):
    """Per model and batch of `frame(...)`'s rows that ran: gdtool's fastest runner, and the fastest peer of
    the same run (the same JSON file: ratios only between what one process measured), with the floor and the
    commit. Peers of other runs are not compared; a run without a peer shows none."""
    import pandas as pd
    ok = runs[runs.status == "ok"].sort_values("ms_per_step")
    out = []
    for (name, batch), group in ok.groupby(["model", "batch"], sort=False):
        mine = group[group.family == "gdtool"]
        if not len(mine):
            continue
        best = mine.iloc[0]
        peers = group[(group.family == "peer") & (group.file == best.file)]
        out.append({"model": name, "batch": batch, "gdtool, fastest": best.runner, "ms/step": best.ms_per_step,
                    "peer, fastest": peers.runner.iloc[0] if len(peers) else None,
                    "peer ms/step": peers.ms_per_step.iloc[0] if len(peers) else float("nan"),
                    "floor ms/step": best.floor_ms, "commit": str(best.commit)[:7]})
    summary = pd.DataFrame(out).sort_values(["model", "batch"]).set_index(["model", "batch"])
    summary["% of floor"] = 100 * summary["floor ms/step"] / summary["ms/step"]
    return summary


def fmt(value, spec):
    return "-" if value is None or value != value else format(value, spec)


def main(paths):
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
