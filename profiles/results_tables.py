"""Markdown tables of the committed H200 results of the early sessions, as `docs/history.md` quotes them.

    python profiles/results_tables.py [eos-off] [devloop-host] [fast-decode] [sampling] [cost-model] [launch]

Each table is computed from the files under `profiles/` (nothing typed in): the sweep's EOS-off mode
comparison, device-loop host time per token, sampling against greedy in the compiled step (per run
and sampler), the cost model's check against the sweep, and the
host cost of one graph launch (the launch probe's files; its command: `docs/history.md`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from gdtool.frontends.sweep import load, summarize  # noqa: E402

H200 = ROOT / "h200"


def markdown(df: pd.DataFrame, floatfmt: str = "{:.1f}") -> str:
    cols = list(df.columns)
    rows = ["| " + " | ".join(str(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for values in df.itertuples(index=False):
        rows.append("| " + " | ".join(floatfmt.format(v) if isinstance(v, float) else str(v) for v in values) + " |")
    return "\n".join(rows)


def eos_off() -> str:
    df = load(ROOT / "sweeps" / "llama-1b_geom128.csv")
    stats = summarize(df[df["lengths"] == "eos-off"])
    table = stats.pivot_table(index="batch", columns="mode", values="tokens_per_s").reset_index()
    return "tokens/s, EOS off, 128 tokens per row (medians)\n\n" + markdown(table)


def devloop_host() -> str:
    df = pd.read_csv(H200 / "devloop-host" / "llama-1b_geom128_devloop_host.csv")
    table = df.groupby("batch").agg(runs=("repeat", "size"), tokens_per_s=("tokens_per_s", "median"),
                                    host_us_per_token=("host_us_per_token", "first"),
                                    wall_us_per_token=("wall_us_per_token", "first"),
                                    profile_runs=("profile_runs", "first")).reset_index()
    return markdown(table, "{:.3f}")


def fast_decode() -> str:
    # decode.csv ran batch 1 then 64 on one model, fused at batch 1 (the probe's old order): its batch-64
    # "compiled" row ran with fused projections. decode-64.csv ran batch 64 alone.
    frames = []
    for name, run in (("decode.csv", "fast-decode"), ("decode-64.csv", "fast-decode-64")):
        df = pd.read_csv(H200 / "fast-decode" / name).assign(part=run)
        if name == "decode.csv":
            df.loc[(df["batch"] == 64) & (df["kernels"] == "compiled"), "kernels"] = "compiled (fused: see README)"
        frames.append(df)
    table = pd.concat(frames)[["part", "batch", "kernels", "case", "ms_per_step", "tok_s", "pct_over_greedy"]]
    return markdown(table, "{:.3f}")


# Runs of the compiled step with greedy and sampling cases, in the order they ran: (file, commit,
# {case in the file: sampler it ran}). sample-cost ran the two-stage top-k as "sample".
SAMPLING_RUNS = [
    ("fast-decode/decode.csv", "8c2255e", {"sample": "two sorts"}),
    ("fast-decode/decode-64.csv", "d95b9d7", {"sample": "counting"}),
    ("sample-cost/decode.csv", "093fb01", {"sample": "counting, two-stage top-k", "sample-one-stage-topk": "counting"}),
    ("fast-decode/decode-64-run2.csv", "36ec5ad", {"sample": "counting"}),
    ("fast-decode/decode-64-run3.csv", "5275834", {"sample": "counting, unsorted topk"}),
]


def sampling() -> str:
    rows = []
    for name, commit, samplers in SAMPLING_RUNS:
        path = H200 / name
        if not path.exists():
            continue
        df = pd.read_csv(path)
        df = df[df["status"] == "ok"]
        if name == "fast-decode/decode.csv":  # its batch-64 compiled rows ran fused (see fast_decode)
            df = df[~((df["batch"] == 64) & (df["kernels"] == "compiled"))]
        greedy = df[df["case"] == "greedy"].set_index(["batch", "kernels"])["ms_per_step"]
        for r in df[df["case"].isin(list(samplers))].itertuples():
            base = greedy.get((r.batch, r.kernels), float("nan"))
            rows.append(dict(file=name, commit=commit, batch=r.batch, kernels=r.kernels, sampler=samplers[r.case],
                             greedy_ms=base, sample_ms=r.ms_per_step, pct_over_greedy=100 * (r.ms_per_step / base - 1)))
    return markdown(pd.DataFrame(rows), "{:.3f}")


def cost_model() -> str:
    """`costmodel.check` on the committed sweep: step-graph, geometric lengths, the issue's policies."""
    from gdtool.measure import costmodel
    df = load(ROOT / "sweeps" / "llama-1b_geom128.csv")
    graph = df[df["mode"] == "step-graph"]
    table = costmodel.check(graph, costmodel.fit(graph), "geom:128:512", polls=[1, 4, 16, 64, "never", "async"])
    table["tied"] = table["tied"].map(" ".join)
    cols = ["batch", "measured_poll", "tied", "recommended_poll", "recommended_factor", "recommended_factor_to_tied",
            "recommended_vs_best", "on_runs_poll", "max_error"]
    return markdown(table[cols], "{:.4f}")


def launch() -> str:
    out = []
    for name in ("launch-probe", "launch-timing", "launch-profiler"):
        doc = json.loads((H200 / name / "launch.json").read_text())
        rows = []
        for r in doc["rows"]:
            if "what" not in r:
                rows.append({"what": f"error: {r.get('error', '')[:80]}"})
                continue
            rows.append({"what": r["what"], "kernels": r.get("kernels", ""), "nodes": r.get("nodes", ""),
                         "variant": r.get("variant", "") + (" after-profiler" if r.get("after_profiler") else ""),
                         "blocking_sync": r.get("blocking_sync", ""),
                         "idle cpu µs": r.get("idle_cpu_us", float("nan")),
                         "queued cpu µs": r.get("queued_cpu_us", float("nan")),
                         "profile host µs/step": r.get("host_us_median", float("nan"))})
        out.append(f"`{name}/launch.json`\n\n" + markdown(pd.DataFrame(rows)).replace(" nan ", " "))
    return "\n\n".join(out)


TABLES = {"eos-off": eos_off, "devloop-host": devloop_host, "fast-decode": fast_decode, "sampling": sampling,
          "cost-model": cost_model, "launch": launch}


def main(argv=None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise SystemExit(f"unknown table(s) {unknown}; choose from {list(TABLES)}")
    print("\n\n".join(f"### {name}\n\n{TABLES[name]()}" for name in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
