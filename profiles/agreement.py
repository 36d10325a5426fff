"""Do the in-process figures (gdtool.profile) and Nsight Systems (gdtool.nsys) agree?

Per mode and batch size, per generated token: device busy time (in-process: torch.profiler kernel
records; nsys: kernel records of a node-trace session, or of a graph-trace session for eager, which
has no graphs) and device span (in-process: CUDA events around each step; nsys: first kernel start to
last kernel end of the step, plus the gap to the next step), and host time per step. Busy time is
also compared as the median step (per step), which a few steps with outlying kernel records do not
move. Writes a markdown table.

    python profiles/agreement.py --profile profiles/h200/profile/summary.csv \
        --nsys profiles/h200/nsys-graph/summary.csv profiles/h200/nsys-node1/summary.csv --out profiles/h200/agreement.md
"""
import argparse

import pandas as pd


def in_process(path) -> pd.DataFrame:
    df = pd.read_csv(path)
    per_token = df.pivot_table(index=["batch", "mode"], columns="metric", values="per_token").add_suffix("_per_token")
    median = df.pivot_table(index=["batch", "mode"], columns="metric", values="median").add_suffix("_median")
    return per_token.join(median)


def nsys(paths) -> pd.DataFrame:
    df = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    return df.set_index(["batch", "mode", "trace"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", required=True)
    p.add_argument("--nsys", nargs="+", required=True)
    p.add_argument("--out")
    a = p.parse_args()
    mine, theirs = in_process(a.profile), nsys(a.nsys)
    rows = []
    for (batch, mode), r in mine.iterrows():
        def pick(trace, column):
            key = (batch, mode, trace)
            return theirs.loc[key, column] if key in theirs.index and column in theirs.columns else float("nan")
        busy_trace = "graph" if mode == "eager" else "node"
        row = {"batch": batch, "mode": mode,
               "busy/token in-process": r.get("device_busy_us_per_token"),
               "busy/token nsys": pick(busy_trace, "device_busy_us_per_token"), "busy trace": busy_trace,
               "span/token in-process": r.get("device_span_us_per_token"),
               "span/token nsys (graph)": pick("graph", "device_span_us_per_token"),
               "host/step in-process": r.get("host_us_median"), "host/step nsys (graph)": pick("graph", "host_us"),
               # medians per step: a few steps with outlying kernel records move a mean, not a median
               "busy/step median in-process": r.get("device_busy_us_median"),
               "busy/step median nsys": pick(busy_trace, "device_busy_us")}
        for what, a_key, b_key in (("busy", "busy/token in-process", "busy/token nsys"),
                                   ("busy median", "busy/step median in-process", "busy/step median nsys"),
                                   ("span", "span/token in-process", "span/token nsys (graph)")):
            row[f"{what} ratio"] = row[a_key] / row[b_key] if row[b_key] == row[b_key] and row[b_key] else float("nan")
            row[f"{what} within 10%"] = abs(row[f"{what} ratio"] - 1) <= 0.10 if row[f"{what} ratio"] == row[
                f"{what} ratio"] else None
        rows.append(row)
    table = pd.DataFrame(rows)
    text = table.to_markdown(index=False, floatfmt=".3g") if hasattr(table, "to_markdown") else table.to_string()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# In-process vs Nsight Systems, per token (µs)\n\n"
                    f"From `{a.profile}` and {', '.join(f'`{x}`' for x in a.nsys)}; "
                    "regenerate with the command in this script's docstring.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
