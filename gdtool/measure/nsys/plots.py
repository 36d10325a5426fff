"""Pictures of read exports: host and GPU time per step (`plot_steps`), mini timelines of a few steps
(`plot_timeline`, `plot_timelines`). Each returns (fig, axes); matplotlib is imported on the first call.

    fig, axes = plots.plot_steps(df[(df.batch == 1) & (df.trace == "graph")])
    fig, axes = plots.plot_timelines(["a_b1_eager_graph.sqlite.gz", "a_b1_step-graph_graph.sqlite.gz"])
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...core import ranges
from .export import MODES, read, timeline


def plot_steps(df: pd.DataFrame, decode: str = "last", axes=None):
    """Per step, one panel per mode: the host's wall time (own work + waits) next to the GPU's device span
    (busy + idle), in µs. `df`: one batch and trace. Returns (fig, axes)."""
    import matplotlib.pyplot as plt
    combos = df[["batch", "trace"]].drop_duplicates()
    if len(combos) > 1:
        raise ValueError(f"plot_steps draws one batch and trace at a time, got {combos.to_dict('records')}; "
                         f"pass e.g. df[(df.batch == 1) & (df.trace == 'graph')]")
    if decode == "last":
        df = df[df["decode"] == df.groupby("mode")["decode"].transform("max")]
    modes = [m for m in MODES if m in set(df["mode"])] or sorted(df["mode"].dropna().unique())
    if axes is None:
        fig, axes = plt.subplots(len(modes), 1, figsize=(10.5, 2.4 * len(modes)), sharex=True, squeeze=False,
                                 layout="constrained")
        axes = axes[:, 0]
    else:
        axes = np.atleast_1d(axes)
        fig = axes[0].figure
    for a, m in zip(axes, modes):
        g = df[df["mode"] == m].sort_values("step")
        x = g["step"].to_numpy(dtype=float)
        a.bar(x - 0.2, g["host_us"], width=0.4, color="tab:blue", label="host work")
        a.bar(x - 0.2, g["sync_us"], width=0.4, bottom=g["host_us"], color="tab:blue", alpha=0.35,
              label="host waits (syncs)")
        a.bar(x + 0.2, g["device_busy_us"], width=0.4, color="tab:green", label="GPU busy")
        a.bar(x + 0.2, g["gpu_idle_us"].fillna(0).clip(lower=0), width=0.4, bottom=g["device_busy_us"],
              color="tab:red", alpha=0.6, label="GPU idle (device span - busy)")
        for s in g.loc[g["polled"], "step"]:
            a.axvline(s, color="0.5", lw=0.6, ls=":")
        a.set_ylabel("µs / step")
        a.set_title(f"{m} (batch {g['batch'].iloc[0]}, --cuda-graph-trace={g['trace'].iloc[0]})", fontsize=9)
        a.grid(alpha=0.3)
    # outside the axes, clear of the bars
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="per decode step",
                   title_fontsize=8, borderaxespad=0.0)
    axes[-1].set_xlabel("decode step (dotted: the host polls EOS)")
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    return fig, axes


def plot_timeline(intervals: pd.DataFrame, ax=None, title: str | None = None):
    """A mini timeline from `timeline(...)`: host ranges above, device work below. Returns (fig, ax)."""
    import matplotlib.pyplot as plt
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 2.2))
    else:
        fig = ax.figure
    colors = {ranges.STEP: "0.85", ranges.FORWARD: "tab:blue", ranges.SELECT: "tab:orange",
              ranges.UPDATE: "tab:purple", ranges.EOS_CHECK: "tab:red", ranges.REPLAY: "tab:cyan",
              ranges.EOS_POLL: "tab:red", "kernel": "tab:green", "graph": "darkgreen", "memcpy": "tab:olive",
              "memset": "tab:olive"}
    # (y, height, z): step ranges behind the phases inside them; device work on its own lane.
    lanes = {("host", True): (2.0, 0.8, 1), ("host", False): (2.1, 0.6, 2), ("gpu", False): (0.5, 0.8, 2)}
    for (lane, is_step), g in intervals.groupby([intervals["lane"], intervals["name"] == ranges.STEP]):
        y, h, z = lanes[(lane, is_step)]
        for name, gg in g.groupby("name"):
            ax.broken_barh(list(zip(gg["start_us"], gg["end_us"] - gg["start_us"])), (y, h), zorder=z,
                           facecolors=colors.get(name, "0.5"), edgecolor="white", linewidth=0.3, label=name)
    ax.set_yticks([0.9, 2.4], ["GPU", "host"])
    ax.set_xlabel("µs from the first step's start")
    _legend(ax, [ax])
    ax.grid(alpha=0.3, axis="x")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, ax


def _legend(ax, axes):
    """One legend, below `ax`, for the labels of all `axes`."""
    unique = {}
    for a in axes:
        for handle, label in zip(*a.get_legend_handles_labels()):
            unique.setdefault(label, handle)
    ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=min(len(unique), 8), loc="upper center",
              bbox_to_anchor=(0.5, -0.35), title="range / device work", title_fontsize=7)


def plot_timelines(paths, first_step: int = 20, steps: int = 3):
    """Mini timelines of the same steps from several exports (one mode each), stacked on one time axis.
    Returns (fig, axes)."""
    import matplotlib.pyplot as plt
    paths = list(paths)
    fig, axes = plt.subplots(len(paths), 1, figsize=(10, 1.9 * len(paths) + 0.8), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, path in zip(axes, paths):
        df = read(path)
        last = df[df["decode"] == df["decode"].max()]
        label = f"{last['mode'].iloc[0]}, batch {last['batch'].iloc[0]}, trace={last['trace'].iloc[0]}"
        plot_timeline(timeline(path, first_step=first_step, steps=steps), ax=ax, title=label)
        if ax is not axes[-1]:
            ax.get_legend().remove()
            ax.set_xlabel("")
    _legend(axes[-1], axes)
    fig.tight_layout()
    return fig, axes
