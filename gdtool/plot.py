"""Plots of sweep and profile results: a DataFrame in, ``(fig, ax)`` out.

Raw sweep rows (one per repetition) are reduced here to medians with a p20-p80 band; summaries
that already hold one row per config plot as they are.

    from gdtool import plot
    fig, ax = plot.throughput_vs_interval(df)                    # tokens/s vs polling policy, per batch
    fig, ax = plot.throughput_vs_interval(df, prediction=costmodel.predict(params, "geom:128:512"))
    fig, ax = plot.throughput_vs_batch(df, hue="mode")           # modes side by side
    fig, ax = plot.per_token_vs_batch(summary)                   # host vs device µs/token per mode
    fig, ax = plot.prediction_vs_measurement(costmodel.predict_runs(df, params))
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .sweep import poll_label, poll_order

__all__ = [
    "host_device_bars",
    "median_band",
    "per_token_vs_batch",
    "prediction_vs_measurement",
    "throughput_vs_batch",
    "throughput_vs_interval",
]

_LABELS = {"tokens_per_s": "useful tokens/s", "steps_per_s": "steps/s", "us_per_token": "µs/token",
           "wasted_steps": "wasted steps per batch", "host_syncs": "host syncs per decode",
           "polls": "EOS polls per decode", "host_us_per_token": "host µs/token",
           "device_us_per_token": "device µs/token"}


def _new(ax, figsize=(6.4, 4.0)):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    else:
        fig = ax.figure
    return fig, ax


def _finish(ax, xlabel, ylabel, legend_title=None):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.15, which="minor")
    if legend_title is not None and ax.get_legend_handles_labels()[0]:
        ax.legend(title=legend_title, fontsize="small")


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    if df is None or df.empty:
        raise ValueError("nothing to plot: the DataFrame is empty (did the sweep run, or did every config fail?)")
    if "error" in df.columns:
        df = df[df["error"].fillna("") == ""]
        if df.empty:
            raise ValueError("nothing to plot: every row has an error; see the 'error' column")
    return df


def median_band(df: pd.DataFrame, by: list[str], metric: str) -> pd.DataFrame:
    """Median, p20 and p80 of ``metric`` per group: columns ``by + [median, p20, p80, n]``."""
    df = _ok(df)
    if metric not in df.columns:
        raise ValueError(f"column {metric!r} is not in the DataFrame; it has {list(df.columns)}")
    g = df.groupby(by, sort=True, dropna=False)[metric]
    return pd.DataFrame({"median": g.median(), "p20": g.quantile(0.2), "p80": g.quantile(0.8),
                         "n": g.size()}).reset_index()


def _poll_positions(labels) -> tuple[dict, float]:
    """x position of each polling policy on a log2 axis: async left of 1, never right of the largest k."""
    numeric = [int(p) for p in labels if p.isdigit()]
    top = max(numeric) if numeric else 1
    never_x = 2.0 ** (math.ceil(math.log2(top)) + 1)
    return {p: (0.5 if p == "async" else never_x if p == "never" else float(p)) for p in labels}, never_x


def throughput_vs_interval(df: pd.DataFrame, *, prediction: pd.DataFrame | None = None, hue: str = "batch",
                           metric: str = "tokens_per_s", normalize: bool = False, ax=None, title: str | None = None):
    """``metric`` (default useful tokens/s) against the polling policy, one line per ``hue`` value.

    x: the interval k on a log2 axis, ``async`` to the left of 1 and ``never`` to the right of the
    largest k. Line: median over repetitions; band: p20-p80. ``prediction`` (from
    `costmodel.predict`) is drawn dashed in the same colour. ``normalize=True`` divides each line by
    its best median, to compare shapes across batch sizes."""
    df = _ok(df).assign(poll=lambda d: d["poll"].map(poll_label))
    stats = median_band(df, [hue, "poll"], metric)
    labels = sorted(set(stats["poll"]) | (set(prediction["poll"].map(poll_label)) if prediction is not None
                                          else set()), key=poll_order)
    xpos, _ = _poll_positions(labels)
    fig, ax = _new(ax)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (value, g) in enumerate(stats.groupby(hue, sort=True)):
        g = g.assign(x=g["poll"].map(xpos)).sort_values("x")
        scale = g["median"].max() if normalize else 1.0
        color = colors[i % len(colors)]
        ax.plot(g["x"], g["median"] / scale, "o-", color=color, label=f"{value}")
        ax.fill_between(g["x"], g["p20"] / scale, g["p80"] / scale, color=color, alpha=0.2, linewidth=0)
        if prediction is not None and hue in prediction.columns:
            p = prediction[prediction[hue] == value].assign(poll=lambda d: d["poll"].map(poll_label))
            p = p.assign(x=p["poll"].map(xpos)).sort_values("x")
            ax.plot(p["x"], p[metric] / scale, "--", color=color, alpha=0.8,
                    label="predicted" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_xticks([xpos[p] for p in labels], labels)
    ax.minorticks_off()
    if not normalize and stats["median"].max() > 8 * max(stats["median"].min(), 1e-12):
        ax.set_yscale("log")
    ylabel = f"{_LABELS.get(metric, metric)} / best" if normalize else _LABELS.get(metric, metric)
    _finish(ax, "EOS polling interval (steps; async = one step late, never = run to max_new_tokens)", ylabel, hue)
    if title:
        ax.set_title(title)
    return fig, ax


def throughput_vs_batch(df: pd.DataFrame, *, hue: str = "mode", metric: str = "tokens_per_s", ax=None,
                        title: str | None = None):
    """``metric`` against batch size (log2 axis), one line per ``hue`` value, median and p20-p80 band."""
    df = _ok(df)
    stats = median_band(df, [hue, "batch"], metric)
    fig, ax = _new(ax)
    for value, g in stats.groupby(hue, sort=False):
        g = g.sort_values("batch")
        (line,) = ax.plot(g["batch"], g["median"], "o-", label=f"{value}")
        ax.fill_between(g["batch"], g["p20"], g["p80"], color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xscale("log", base=2)
    batches = sorted(stats["batch"].unique())
    ax.set_xticks(batches, [str(int(b)) for b in batches])
    ax.minorticks_off()
    if stats["median"].max() > 8 * max(stats["median"].min(), 1e-12):
        ax.set_yscale("log")
    _finish(ax, "batch size (rows)", _LABELS.get(metric, metric), hue)
    if title:
        ax.set_title(title)
    return fig, ax


def host_device_bars(df: pd.DataFrame, *, batch: int | None = None, ax=None, title: str | None = None):
    """Host vs device time per token, two bars per mode, at one batch size (default: the smallest).

    ``df``: rows with ``mode``, ``host_us_per_token``, ``device_us_per_token`` (and ``batch``); several
    rows per mode are reduced to their median."""
    df = _ok(df)
    for col in ("host_us_per_token", "device_us_per_token"):
        if col not in df.columns:
            raise ValueError(f"column {col!r} is missing; it comes from gdtool.profile(...).summary or an nsys export")
    if "batch" in df.columns:
        batch = int(df["batch"].min()) if batch is None else batch
        df = df[df["batch"] == batch]
    modes = list(dict.fromkeys(df["mode"]))
    host = [df.loc[df["mode"] == m, "host_us_per_token"].median() for m in modes]
    device = [df.loc[df["mode"] == m, "device_us_per_token"].median() for m in modes]
    fig, ax = _new(ax)
    x = np.arange(len(modes))
    ax.bar(x - 0.2, host, width=0.4, label="host")
    ax.bar(x + 0.2, device, width=0.4, label="device (busy)")
    ax.set_xticks(x, modes)
    _finish(ax, "mode", "µs/token", "time spent on")
    ax.set_title(title or (f"batch {batch}" if batch is not None else "time per token"))
    return fig, ax


def per_token_vs_batch(df: pd.DataFrame, *, ax=None, title: str | None = None):
    """Host (solid) and device busy (dashed) µs per token against batch size, one colour per mode.

    Where the host line lies above the device line, the GPU waits for the host (host-bound)."""
    df = _ok(df)
    fig, ax = _new(ax)
    for mode, g in df.groupby("mode", sort=False):
        g = g.groupby("batch")[["host_us_per_token", "device_us_per_token"]].median().reset_index()
        (line,) = ax.plot(g["batch"], g["host_us_per_token"], "o-", label=f"{mode}: host")
        if g["device_us_per_token"].notna().any():  # NaN on a CPU device: no GPU clock to read
            ax.plot(g["batch"], g["device_us_per_token"], "s--", color=line.get_color(), label=f"{mode}: device")
    ax.set_xscale("log", base=2)
    batches = sorted(df["batch"].unique())
    ax.set_xticks(batches, [str(int(b)) for b in batches])
    ax.minorticks_off()
    ax.set_yscale("log")
    _finish(ax, "batch size (rows)", "µs/token", "mode: time on")
    if title:
        ax.set_title(title)
    return fig, ax


def prediction_vs_measurement(runs: pd.DataFrame, *, tolerance: float = 0.15, hue: str = "batch", ax=None,
                              title: str | None = None):
    """Measured against predicted tokens/s, one point per run (from `costmodel.predict_runs`).

    Filled markers: out-of-sample runs (not used by the fit); hollow: calibration runs. The shaded
    band is +-``tolerance`` around y = x."""
    runs = _ok(runs)
    fig, ax = _new(ax, figsize=(5.2, 5.0))
    calib = runs["calibration"] if "calibration" in runs.columns else pd.Series(False, index=runs.index)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (value, g) in enumerate(runs.groupby(hue, sort=True)):
        color = colors[i % len(colors)]
        c = calib.loc[g.index]
        ax.scatter(g.loc[~c, "pred_tokens_per_s"], g.loc[~c, "tokens_per_s"], color=color, label=f"{value}", s=22)
        ax.scatter(g.loc[c, "pred_tokens_per_s"], g.loc[c, "tokens_per_s"], facecolors="none", edgecolors=color,
                   s=22, label=None if (~c).any() else f"{value}")
    lo = float(np.nanmin(runs[["pred_tokens_per_s", "tokens_per_s"]].to_numpy())) * 0.8
    hi = float(np.nanmax(runs[["pred_tokens_per_s", "tokens_per_s"]].to_numpy())) * 1.25
    line = np.geomspace(max(lo, 1e-9), hi, 50)
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(line, line * (1 - tolerance), line * (1 + tolerance), color="0.5", alpha=0.15, linewidth=0,
                    label=f"±{tolerance:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    out = runs.loc[~calib]
    err = (out["ratio"] - 1).abs() if len(out) else (runs["ratio"] - 1).abs()
    _finish(ax, "predicted useful tokens/s", "measured useful tokens/s", hue)
    ax.set_title(title or f"cost model: median |error| {err.median():.1%}, max {err.max():.1%}"
                 f" ({'out-of-sample' if len(out) else 'all'} runs)")
    return fig, ax
