"""Markdown tables of the committed `kernels="fast"` results (profiles/h200/decode-kernels/).

    python profiles/decode_kernels_tables.py                # every table, as docs/history.md quotes them
    python profiles/decode_kernels_tables.py account        # one of: step, gemv, attention, account

`account` adds up the batch-1 step of llama-1b from the per-kernel timings (each kernel timed alone,
back to back in a captured graph, so each figure includes one in-graph launch gap) times how often
the step runs it, beside the whole step measured end to end. The same functions feed
notebooks/03_fast_step_vs_megakernel.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent / "h200" / "decode-kernels"
# per-step call counts of each kernel in the fast decode forward (gdtool/kernels/forward.py), 16 layers
LAYERS = {"llama-1b": 16, "llama-8b": 32}
# the megakernel anchor (msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md, H200, Llama-3.2-1B,
# bf16, batch 1), as quoted in the project's peer notes: not measured here
ANCHOR_US = {"CUDA graphs + PDL, ~100 hand-written kernels": 794.7, "Hazy Research megakernel": 759.8}


def load(folder: Path = ROOT):
    run = folder / "run2"
    return {name: pd.read_csv(run / f"{name}.csv") for name in ("step", "gemv", "attention")}


def _md(df: pd.DataFrame, floatfmt: str = ".2f") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            cells.append(format(v, floatfmt) if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def step_table(data) -> pd.DataFrame:
    df = data["step"]
    timed = df[df.ms_per_step.notna()]
    out = timed[["model", "batch", "kernels", "mode", "pdl", "ms_per_step", "tok_s"]].copy()
    out["captured = uncaptured"] = timed.get("captured_equals_uncaptured")
    out["same tokens as PDL off"] = timed.get("same_tokens_as_first_case_of_these_kernels")
    return out.fillna("")


def agreement_table(data) -> pd.DataFrame:
    df = data["step"]
    rows = df[df.kernels.str.contains("teacher")]
    return rows[["model", "batch", "top1_agreement", "min_top1_agreement", "max_abs_logit_diff", "max_abs_logit",
                 "hf_step_ms", "fast_step_ms"]]


def gemv_table(data) -> pd.DataFrame:
    """Per projection, batch 1: cuBLAS (the matmul alone), the Triton kernel as the step runs it (default
    config), PDL off and on, µs and TB/s over the weight bytes."""
    df = data["gemv"]
    rows = []
    for (model, proj), g in df.groupby(["model", "proj"], sort=False):
        cub = g[g.kernel.str.startswith("cublas")].iloc[0]
        default = g[g.kernel.str.contains("default")]
        off, on = default[~default.pdl].iloc[0], default[default.pdl].iloc[0]
        best = g[~g.kernel.str.startswith("cublas") & ~g.pdl].sort_values("us").iloc[0]
        rows.append({"model": model, "projection": proj, "N x K": f"{int(cub.n)} x {int(cub.k)}",
                     "cuBLAS us": cub.us, "cuBLAS TB/s": cub.tb_s, "triton us": off.us, "triton TB/s": off.tb_s,
                     "+PDL us": on.us, "+PDL TB/s": on.tb_s, "best config": best.kernel.replace("triton ", ""),
                     "best us": best.us})
    return pd.DataFrame(rows)


def attention_table(data) -> pd.DataFrame:
    df = data["attention"]
    att = df[df.kernel.isin(["sdpa packed, all slots", "split-kv"])]
    rows = []
    for (m, heads, cache, live), g in att.groupby(["rows", "heads", "cache", "live"], sort=False):
        sdpa = g[g.kernel.str.startswith("sdpa")].us.iloc[0]
        split = g[(g.kernel == "split-kv") & ~g.pdl.astype(bool)].us.iloc[0]
        split_pdl = g[(g.kernel == "split-kv") & g.pdl.astype(bool)].us.iloc[0]
        rows.append({"rows": int(m), "heads": heads, "cache": int(cache), "live": int(live),
                     "SDPA packed, all slots (us)": sdpa, "split-KV (us)": split, "split-KV + PDL (us)": split_pdl})
    arg = df[df.kernel.str.contains("argmax")]
    for m, g in arg.groupby("rows", sort=False):
        rows.append({"rows": int(m), "heads": "argmax", "cache": int(g.cache.iloc[0]), "live": "",
                     "SDPA packed, all slots (us)": g[g.kernel == "torch.argmax"].us.iloc[0],
                     "split-KV (us)": g[g.kernel == "two-stage argmax"].us.iloc[0], "split-KV + PDL (us)": ""})
    return pd.DataFrame(rows).rename(columns={"SDPA packed, all slots (us)": "SDPA packed / torch.argmax (us)",
                                              "split-KV (us)": "split-KV / two-stage (us)"})


def account(data, model: str = "llama-1b", pdl: bool = False) -> pd.DataFrame:
    """The batch-1 step from its kernels: µs per call (timed alone) x calls per step, against the step."""
    gemv, att, step = data["gemv"], data["attention"], data["step"]
    layers = LAYERS[model]
    g = gemv[(gemv.model == model) & gemv.kernel.str.contains("default") & (gemv.pdl == pdl)]
    rows = []
    for proj in ("qkv", "o", "gate_up", "down", "lm_head"):
        r = g[g.proj == proj].iloc[0]
        calls = 1 if proj == "lm_head" else layers
        rows.append({"kernel": f"{proj} GEMV" + (" + RMSNorm + RoPE + cache write" if proj == "qkv" else ""),
                     "calls": str(calls), "us per call": r.us, "us per step": r.us * calls, "TB/s": r.tb_s})
    a = att[(att.rows == 1) & (att.heads == "32/8x64") & (att.cache == 384) & (att.live == 256)
            & (att.kernel == "split-kv") & (att.pdl.astype(bool) == pdl)]
    if len(a):
        rows.append({"kernel": "split-KV attention (split + combine), live 256 of 384", "calls": str(layers),
                     "us per call": a.us.iloc[0], "us per step": a.us.iloc[0] * layers, "TB/s": float("nan")})
    am = att[(att.rows == 1) & (att.kernel == "two-stage argmax")]
    if len(am):
        rows.append({"kernel": "two-stage argmax", "calls": "1", "us per call": am.us.iloc[0],
                     "us per step": am.us.iloc[0], "TB/s": float("nan")})
    total = sum(r["us per step"] for r in rows)
    timed = step[step.ms_per_step.notna()]
    measured = timed[(timed.model == model) & (timed.batch == 1) & (timed.kernels == "fast")
                     & (timed["mode"] == "step-graph") & (timed.pdl == pdl)].ms_per_step
    rows.append({"kernel": "sum of the above", "us per step": total})
    if len(measured):
        us = float(measured.iloc[0]) * 1e3
        rows.append({"kernel": "whole step, measured (decode_s / steps)", "us per step": us})
        rows.append({"kernel": "rest: embedding, counters, update, host, overlap", "us per step": us - total})
    return pd.DataFrame(rows, columns=["kernel", "calls", "us per call", "us per step", "TB/s"]).astype(object).fillna("")


def main(argv) -> int:
    data = load()
    which = argv[1:] or ["step", "agreement", "gemv", "attention", "account"]
    for name in which:
        print(f"### {name}\n")
        if name == "account":
            for pdl in (False, True):
                print(f"PDL {'on' if pdl else 'off'}:\n")
                print(_md(account(data, pdl=pdl), ".1f") + "\n")
        else:
            table = {"step": step_table, "agreement": agreement_table, "gemv": gemv_table,
                     "attention": attention_table}[name](data)
            print(_md(table, ".3f" if name in ("step", "agreement") else ".2f") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
