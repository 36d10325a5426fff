"""Do the in-process figures (gdtool.profile) and Nsight Systems (gdtool.measure.nsys) agree? A markdown table.

Per mode and batch size (`gdtool.measure.nsys.agreement`): device busy time per token, the mean (in-process:
torch.profiler's kernel records; nsys: kernel records of a node-trace session, or of a graph-trace session
for eager, which has no graphs, or where no node trace was kept), and host work of the median step (nsys:
graph-level trace, whose tracing of every launch call costs the host far more than the launch: a graph
mode's host ratio measures that, not a disagreement).

    python profiles/agreement.py --profile profiles/h200/profile/summary.csv \\
        --nsys profiles/h200/nsys-graph/summary.csv profiles/h200/nsys-node1/summary.csv \\
        profiles/h200/nsys-node16/summary.csv --out profiles/h200/agreement.md
"""
import argparse

import pandas as pd

from gdtool.measure import nsys, timing


def tables(profile_csv, nsys_csvs) -> pd.DataFrame:
    inproc = timing.per_token_table(pd.read_csv(profile_csv))
    traced = pd.concat([pd.read_csv(p) for p in nsys_csvs], ignore_index=True)
    settings = traced["settings"].fillna("") if "settings" in traced.columns else pd.Series("", index=traced.index)
    traced["implementation"] = ["compiled" if "kernels=compiled" in str(s) else "hf" for s in settings]
    return nsys.agreement(inproc, nsys.per_token(traced))


def markdown(df: pd.DataFrame) -> str:
    """A markdown table (no tabulate needed): numbers to 4 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return "" if v != v else f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", required=True, help="summary.csv of `python -m gdtool profile`")
    p.add_argument("--nsys", nargs="+", required=True, help="summary.csv files of nsys sessions")
    p.add_argument("--out", help="markdown file to write (default: print only)")
    a = p.parse_args(argv)
    try:
        table = tables(a.profile, a.nsys)
    except ValueError as err:
        raise SystemExit(f"agreement.py: {err}") from None
    within = table["busy_within_10pct"].dropna()
    text = markdown(table)
    verdict = (f"Device busy per token (mean) within 10% of nsys for {int(within.sum())} of {len(within)} configs"
               f" ({table.attrs['model']}).")
    print(text + "\n\n" + verdict)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# In-process vs Nsight Systems, per token (µs)\n\n"
                    f"From `{a.profile}` and {', '.join(f'`{x}`' for x in a.nsys)}, by `profiles/agreement.py` "
                    "(its docstring gives the command). busy: device busy µs per token, the mean over all steps; "
                    "host: host work of the median step, µs.\n\n" + text + "\n\n" + verdict + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
