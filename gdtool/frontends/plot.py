"""Plots of sweep and profile results, in one style: a DataFrame in, ``(fig, ax)`` out.

The style, the same in every notebook:

- each mode has one colour and one marker everywhere (`MODE_STYLE`: eager orange circles,
  forward-graph green squares, step-graph blue triangles, device-loop purple diamonds); batch sizes
  and other knobs take fixed colours from one sequential map, so batch 16 is the same colour in
  every figure;
- lines that lie on top of each other (within `OVERLAP` of each other at every point) are named in
  the caption, so no line is hidden without a word;
- a log axis only when every value is positive and they span more than 8x: zeros go on a linear axis;
- the legend sits outside the axes, to the right, clear of the data;
- the caption under the figure opens with where its numbers came from (`where`): the model, the GPU
  they ran on or "CPU, uncaptured", and the gdtool commit, "(local changes)" where the checkout had
  some; for committed results that is their sidecar's environment (``env=``), not the machine drawing
  the figure; a figure computed without a model (a schedule from lengths) says so;
- the caption then says what the lines and bands are (median and p20-p80 of how many
  repetitions; for curves divided by their best, why a band can pass 1.0), and, for a speed figure
  measured without a CUDA device, that the graph modes ran uncaptured; `caption` puts one under a
  figure drawn elsewhere (a notebook's own bars), `where` gives its first words.

Raw sweep rows (one per repetition) are reduced here to medians with a p20-p80 band; summaries
that already hold one row per config plot as they are.

    from gdtool.frontends import plot
    from gdtool.measure import record
    env = record.read_sidecar("profiles/sweeps/x.json")["environment"]   # where the rows were measured
    fig, ax = plot.throughput_vs_interval(df, env=env)           # tokens/s vs polling policy, per batch
    fig, ax = plot.throughput_vs_interval(df, prediction=costmodel.predict(params, "geom:128:512"))
    fig, ax = plot.throughput_vs_batch(df, hue="mode")           # modes side by side
    fig, ax = plot.per_token_vs_batch(timing)                    # host vs device µs/token per mode
    fig, axes = plot.agreement(timing, traced)                   # in-process against Nsight Systems
    fig, ax = plot.prediction_vs_measurement(costmodel.predict_runs(df, params))
    plot.caption(fig, f"{plot.where(env, 'llama-1b')}. Bars: ...")  # a figure drawn elsewhere

Without ``env=`` a plot reads ``df.attrs["environment"]`` (`gdtool.frontends.sweep.sweep` and `load` set
it); without either its caption says that the device and commit were not recorded.
"""
from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..measure.polls import poll_label, poll_order

__all__ = [
    "MODE_STYLE",
    "OVERLAP",
    "agreement",
    "caption",
    "hue_style",
    "host_device_bars",
    "median_band",
    "per_token_vs_batch",
    "prediction_vs_measurement",
    "throughput_vs_batch",
    "throughput_vs_interval",
    "where",
]

MODE_STYLE = {
    "eager": dict(color="tab:orange", marker="o"),
    "forward-graph": dict(color="tab:green", marker="s"),
    "step-graph": dict(color="tab:blue", marker="^"),
    "device-loop": dict(color="tab:purple", marker="D"),
}
OVERLAP = 0.02          # lines within 2% of each other at every point are named in the caption
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LABELS = {"tokens_per_s": "useful tokens/s", "steps_per_s": "steps/s", "us_per_token": "µs/token",
           "wasted_steps": "wasted steps per decode", "host_syncs": "host syncs per decode",
           "polls": "EOS polls per decode", "host_us_per_token": "host µs/token",
           "device_us_per_token": "device µs/token"}
_BAND = "bands: p20-p80 (20th to 80th percentile) of the repetitions"


def hue_style(hue: str, value, index: int = 0) -> dict:
    """Colour and marker of one line: a mode's own (`MODE_STYLE`); for a batch size, a colour fixed by
    log2(batch) on one sequential map (batch 16 looks the same in every figure); else by position."""
    if hue == "mode" and str(value).split("+")[0] in MODE_STYLE:
        return dict(MODE_STYLE[str(value).split("+")[0]])
    cmap = plt.get_cmap("viridis")
    if hue == "batch":
        try:
            position = min(math.log2(max(float(value), 1.0)) / 8.0, 1.0)   # batch 1 .. 256
            return dict(color=cmap(0.05 + 0.85 * position), marker=_MARKERS[int(math.log2(max(float(value), 1))) % 8])
        except (TypeError, ValueError):
            pass
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return dict(color=colors[index % len(colors)], marker=_MARKERS[index % len(_MARKERS)])


def _new(ax, figsize=(7.2, 4.0)):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    else:
        fig = ax.figure
    return fig, ax


def _legend(ax, title=None):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title=title, fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _finish(ax, xlabel, ylabel, legend_title=None):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.15, which="minor")
    _legend(ax, legend_title)


def caption(fig, text: str) -> None:
    """Write `text` under the figure (wrapped), where the layout leaves room for it."""
    fig.supxlabel(textwrap.fill(text, 110, break_on_hyphens=False), fontsize="small", x=0.01, ha="left",
                  linespacing=1.2)   # whole names on a line: tiny-llama, step-graph


def _environments(env) -> list[dict]:
    """`env` as a list of environment dicts: one record, a sidecar document holding one under
    "environment", a pandas Series of one (a flat env.json read with pandas), or a list of these."""
    if env is None:
        return []
    if isinstance(env, (list, tuple)):
        return [e for item in env for e in _environments(item)]
    if hasattr(env, "to_dict") and not isinstance(env, Mapping):
        env = env.to_dict()
    if isinstance(env.get("environment"), Mapping):
        env = env["environment"]
    return [dict(env)]


def _device(env: dict) -> str:
    device = str(env.get("device") or "")
    gpu = env.get("gpu") or (env.get("device_name") if device.startswith("cuda") else None)
    if device.startswith("cuda") or (not device and gpu):   # sidecars before "device" name only the GPU
        return str(gpu or "a CUDA GPU (name not recorded)")
    if device:
        # without a CUDA device nothing is captured: the graph modes run their step eagerly
        return f"{'CPU' if device == 'cpu' else device}, uncaptured"
    return "device not recorded"


def _commit(env: dict) -> str | None:
    """The short commit, "(local changes)" after it where git saw some. A probe's own ``commit`` (given to it,
    as $GDTOOL_COMMIT is) wins over ``git_commit``, which a copy of a checkout may have taken from another."""
    given = env.get("commit")
    commit = str(given or env.get("git_commit") or "")
    dirty = env.get("git_dirty") in (True, "true") and not given   # not NaN, not None: unknown is not dirty
    # a hash, perhaps tagged: "+dirty" (early bench sidecars), or a setting given with $GDTOOL_COMMIT ("+line4")
    found = re.fullmatch(r"([0-9a-f]{7,40})(\+[\w.-]+)?", commit)
    if not found:   # missing, or not a hash ("HEAD" in early sidecars)
        return None
    tag = found.group(2) or ""
    if tag == "+dirty":
        tag, dirty = "", True
    return found.group(1)[:7] + tag + (" (local changes)" if dirty else "")


def _join(items) -> str:
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def where(env, model: str | list | None = None) -> str:
    """Where a figure's numbers came from, in the words every caption opens with: the model, the GPU they
    ran on (or "CPU, uncaptured": without a CUDA device the graph modes ran their step uncaptured) and the
    gdtool commit, "(local changes)" where the checkout had uncommitted ones.

        plot.where(env, "llama-1b")        # 'llama-1b, NVIDIA H200, commit 04f3054'
        plot.where(cpu_env, "tiny-llama")  # 'tiny-llama, CPU, uncaptured, commit 04f3054 (local changes)'
        plot.where(env)                    # 'computed, no model, commit 04f3054': a schedule from lengths alone

    ``env``: an environment record (`gdtool.measure.record.environment()` for a run in this process); for
    committed results the files' own (their sidecar's "environment"), never the machine drawing the
    figure; a list of them where a figure draws on several runs (each GPU and commit named once).
    ``model``: a name or a list of names; None for a figure computed without a model."""
    envs = _environments(env)
    commits = [_commit(e) for e in envs]
    known = list(dict.fromkeys(c for c in commits if c))
    if not known:
        at = "commit not recorded"
    else:
        at = ("commit " if len(known) == 1 else "commits ") + _join(known)
        if None in commits:
            at += " (some not recorded)"
    if model is None or (not isinstance(model, str) and not len(model)):
        return f"computed, no model, {at}"
    names = _join([model] if isinstance(model, str) else [str(m) for m in model])
    devices = _join([_device(e) for e in envs]) if envs else "device not recorded"
    return f"{names}, {devices}, {at}"


def _where_of(df: pd.DataFrame, env=None, model=None) -> str:
    """`where` for the rows of `df`: ``env`` as given, else ``df.attrs["environment"]``; the models its
    ``model`` column names (unless ``model`` is given); "CPU, uncaptured" where its rows say they ran on no
    CUDA device (``device`` column, or no device clock for any graph mode), whatever the record says."""
    envs = _environments(env if env is not None else df.attrs.get("environment")) or [{}]
    on_cuda = df["device"].astype(str).str.startswith("cuda") if "device" in df.columns else None
    if uncaptured(df) or (on_cuda is not None and len(on_cuda) and not on_cuda.any()):
        envs = [{**e, "device": "cpu"} for e in envs]
    elif on_cuda is not None and on_cuda.all():
        envs = [e if e.get("device") or e.get("gpu") else {**e, "device": "cuda"} for e in envs]
    if model is None and "model" in df.columns:
        model = [str(m) for m in dict.fromkeys(df["model"])]
    return where(envs, model if model is not None and len(model) else "model not recorded")


def _yscale(ax, values, prefer_log: bool = True) -> str:
    """log only when every value is positive and they span more than 8x; zeros never go on a log axis:
    counts with zeros that span as much get a symlog axis, linear from 0 to 1 and log above."""
    values = np.asarray([v for v in np.ravel(values) if v == v], dtype=float)
    positive = values[values > 0] if len(values) else values
    if prefer_log and len(values) and (values > 0).all() and values.max() > 8 * values.min():
        ax.set_yscale("log")
        return "log"
    if (prefer_log and len(positive) and (values >= 0).all() and (values == 0).any() and positive.min() >= 1
            and values.max() > 8 * positive.min()):
        ax.set_yscale("symlog", linthresh=1.0, linscale=0.5)
        ax.set_ylim(bottom=0)
        return "symlog"
    ax.set_yscale("linear")
    return "linear"


_SYMLOG = " The y axis is linear from 0 to 1 and logarithmic above (zeros stay on the axis)."
UNCAPTURED_NOTE = (" Measured without a CUDA device: forward-graph, step-graph and device-loop ran their step "
                   "uncaptured (no CUDA graph), so their speed here says nothing about what capture wins.")


def uncaptured(df: pd.DataFrame) -> bool:
    """Whether the graph modes' rows of `df` ran without a CUDA device, so nothing was captured and a
    speed figure of them must say so: a sweep row's ``device`` is not CUDA, or (timing rows, which have
    no ``device``) no device time could be read for any of them."""
    if "mode" not in df.columns:
        return False
    graph = df[df["mode"].astype(str).str.split("+").str[0] != "eager"]
    if graph.empty:
        return False
    if "device" in graph.columns:
        return not graph["device"].astype(str).str.startswith("cuda").any()
    device_time = [c for c in graph.columns if c.startswith(("device_busy_us", "device_us", "device_span_us"))]
    return bool(device_time) and bool(graph[device_time].isna().all().all())


def _uncaptured_note(df: pd.DataFrame) -> str:
    return UNCAPTURED_NOTE if uncaptured(df) else ""


def _size(i: int) -> float:
    """Marker size of the i-th line drawn: each smaller than the last, so markers on top of each other nest."""
    return max(9.0 - 1.6 * i, 3.0)


def overlapping(lines: dict, tolerance: float = OVERLAP) -> list[tuple[str, str]]:
    """Pairs of labels whose lines {label: (x, y)} share their x and lie within `tolerance` of each other
    (relative to the larger value) at every point."""
    pairs = []
    labels = list(lines)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            xa, ya = lines[a]
            xb, yb = lines[b]
            if len(xa) != len(xb) or not len(xa) or not np.allclose(np.asarray(xa, float), np.asarray(xb, float)):
                continue
            ya, yb = np.asarray(ya, float), np.asarray(yb, float)
            scale = np.maximum(np.abs(ya), np.abs(yb))
            close = np.abs(ya - yb) <= tolerance * np.where(scale > 0, scale, 1.0)
            if close.all():
                pairs.append((a, b))
    return pairs


def _overlap_note(lines: dict) -> str:
    pairs = overlapping(lines)
    if not pairs:
        return ""
    groups: list[set] = []
    for a, b in pairs:
        for g in groups:
            if a in g or b in g:
                g.update((a, b))
                break
        else:
            groups.append({a, b})
    order = list(lines)
    text = "; ".join(" and ".join(sorted(g, key=order.index)) for g in groups)
    return f" Lines that lie on top of each other (within {OVERLAP:.0%} at every point): {text}."


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


def _repetitions(stats: pd.DataFrame) -> str:
    n = sorted(set(stats["n"]))
    if n == [1]:
        return "One value per point, so no band"
    count = f"{n[0]}" if len(n) == 1 else f"{n[0]}-{n[-1]}"
    return f"Lines: the median of {count} repetitions; {_BAND}"


def _poll_positions(labels) -> tuple[dict, float]:
    """x position of each polling policy on a log2 axis: async left of 1, never right of the largest k."""
    numeric = [int(p) for p in labels if p.isdigit()]
    top = max(numeric) if numeric else 1
    never_x = 2.0 ** (math.ceil(math.log2(top)) + 1)
    return {p: (0.5 if p == "async" else never_x if p == "never" else float(p)) for p in labels}, never_x


def throughput_vs_interval(df: pd.DataFrame, *, prediction: pd.DataFrame | None = None, hue: str = "batch",
                           metric: str = "tokens_per_s", normalize: bool = False, ax=None, title: str | None = None,
                           env=None, model: str | None = None):
    """``metric`` (default useful tokens/s) against the polling policy, one line per ``hue`` value.

    x: the interval k on a log2 axis, ``async`` to the left of 1 and ``never`` to the right of the
    largest k. Line: median over repetitions; band: p20-p80. ``prediction`` (from
    `costmodel.predict`) is drawn dashed in the same colour. ``normalize=True`` divides each line by
    its best median, to compare shapes across batch sizes. ``env`` (and ``model``, where the rows' own
    ``model`` column is not what to name): where the rows came from, for the caption (`where`)."""
    df = _ok(df).assign(poll=lambda d: d["poll"].map(poll_label))
    stats = median_band(df, [hue, "poll"], metric)
    labels = sorted(set(stats["poll"]) | (set(prediction["poll"].map(poll_label)) if prediction is not None
                                          else set()), key=poll_order)
    xpos, _ = _poll_positions(labels)
    fig, ax = _new(ax)
    lines, drawn = {}, []
    for i, (value, g) in enumerate(stats.groupby(hue, sort=True)):
        g = g.assign(x=g["poll"].map(xpos)).sort_values("x")
        scale = g["median"].max() if normalize else 1.0
        style = hue_style(hue, value, i)
        ax.plot(g["x"], g["median"] / scale, "-", label=f"{value}", markersize=_size(i), **style)
        ax.fill_between(g["x"], g["p20"] / scale, g["p80"] / scale, color=style["color"], alpha=0.2, linewidth=0)
        lines[f"{hue} {value}"] = (g["x"].to_numpy(), (g["median"] / scale).to_numpy())
        drawn.append((g["median"] / scale).to_numpy())
        if prediction is not None and hue in prediction.columns:
            p = prediction[prediction[hue] == value].assign(poll=lambda d: d["poll"].map(poll_label))
            p = p.assign(x=p["poll"].map(xpos)).sort_values("x")
            ax.plot(p["x"], p[metric] / scale, "--", color=style["color"], alpha=0.8,
                    label="predicted" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_xticks([xpos[p] for p in labels], labels)
    ax.minorticks_off()
    scale_kind = _yscale(ax, np.concatenate(drawn) if drawn else [], prefer_log=not normalize)
    ylabel = f"{_LABELS.get(metric, metric)} / best median" if normalize else _LABELS.get(metric, metric)
    _finish(ax, "EOS polling interval (steps; async = one step late, never = run to max_new_tokens)", ylabel, hue)
    text = f"{_where_of(df, env, model)}. {_repetitions(stats)}."
    if normalize:
        text += (" Each line is divided by its own best median, so its peak is 1.0; a band can pass 1.0 where "
                 "some repetitions beat that median.")
    if prediction is not None:
        text += " Dashed: the cost model's prediction."
    if scale_kind == "symlog":
        text += _SYMLOG
    caption(fig, text + _overlap_note(lines) + _uncaptured_note(df))
    if title:
        ax.set_title(title)
    return fig, ax


def throughput_vs_batch(df: pd.DataFrame, *, hue: str = "mode", metric: str = "tokens_per_s", ax=None,
                        title: str | None = None, env=None, model: str | None = None):
    """``metric`` against batch size (log2 axis), one line per ``hue`` value, median and p20-p80 band;
    ``env``, ``model``: where the rows came from, for the caption (`where`)."""
    df = _ok(df)
    stats = median_band(df, [hue, "batch"], metric)
    fig, ax = _new(ax)
    lines = {}
    order = list(dict.fromkeys(df[hue]))
    if hue == "mode":
        order = sorted(order, key=lambda m: list(MODE_STYLE).index(m) if m in MODE_STYLE else len(MODE_STYLE))
    for i, value in enumerate(order):
        g = stats[stats[hue] == value].sort_values("batch")
        style = hue_style(hue, value, i)
        ax.plot(g["batch"], g["median"], "-", label=f"{value}", markersize=_size(i), **style)
        ax.fill_between(g["batch"], g["p20"], g["p80"], color=style["color"], alpha=0.2, linewidth=0)
        lines[f"{value}"] = (g["batch"].to_numpy(), g["median"].to_numpy())
    ax.set_xscale("log", base=2)
    batches = sorted(stats["batch"].unique())
    ax.set_xticks(batches, [str(int(b)) for b in batches])
    ax.minorticks_off()
    scale_kind = _yscale(ax, stats["median"])
    _finish(ax, "batch size (rows)", _LABELS.get(metric, metric), hue)
    caption(fig, f"{_where_of(df, env, model)}. {_repetitions(stats)}." + (_SYMLOG if scale_kind == "symlog" else "")
            + _overlap_note(lines) + _uncaptured_note(df))
    if title:
        ax.set_title(title)
    return fig, ax


def host_device_bars(df: pd.DataFrame, *, batch: int | None = None, ax=None, title: str | None = None,
                     host: str = "host_us_per_token", device: str | None = None, env=None, model: str | None = None):
    """Host vs device time per token, two bars per mode, at one batch size (default: the smallest).

    ``df``: rows with ``mode``, `host` and a device column (``device_busy_us_per_token`` or
    ``device_us_per_token``), and ``batch``; several rows per mode are reduced to their median. The
    host bar has the mode's colour, the device bar the same colour hatched. ``env``, ``model``: where the
    rows came from, for the caption (`where`)."""
    df = _ok(df)
    device = device or _device_column(df)
    for col in (host, device):
        if col not in df.columns:
            raise ValueError(f"column {col!r} is missing; it comes from gdtool.measure.timing.per_token(...) or an "
                             "nsys summary")
    if "batch" in df.columns:
        batch = int(df["batch"].min()) if batch is None else batch
        df = df[df["batch"] == batch]
    modes = list(dict.fromkeys(df["mode"]))
    fig, ax = _new(ax)
    x = np.arange(len(modes))
    for i, m in enumerate(modes):
        color = hue_style("mode", m, i)["color"]
        ax.bar(x[i] - 0.2, df.loc[df["mode"] == m, host].median(), width=0.4, color=color,
               label="host" if i == 0 else None)
        ax.bar(x[i] + 0.2, df.loc[df["mode"] == m, device].median(), width=0.4, color=color, alpha=0.45,
               hatch="//", edgecolor="0.3", label="device (busy)" if i == 0 else None)
    ax.set_xticks(x, modes)
    _yscale(ax, df[[host, device]].to_numpy())
    _finish(ax, "mode", "µs/token", "time spent on")
    ax.set_title(title or (f"batch {batch}" if batch is not None else "time per token"))
    caption(fig, f"{_where_of(df, env, model)}. Solid: host time per token; hatched: device busy time per token, "
                 "each mode in its colour." + _uncaptured_note(df))
    return fig, ax


def _device_column(df: pd.DataFrame, stat: str = "") -> str:
    for name in (f"device_busy_us{stat}_per_token", f"device_us{stat}_per_token"):
        if name in df.columns:
            return name
    return f"device_busy_us{stat}_per_token"


def per_token_vs_batch(df: pd.DataFrame, *, stat: str = "median", ax=None, title: str | None = None, env=None,
                       model: str | None = None):
    """Host (solid) and device busy (dashed) µs per token against batch size, one colour per mode.

    ``stat="median"`` plots the typical step (``<metric>_median_per_token``: the median step over the
    batch size) with its p20-p80 band; ``stat="mean"`` plots ``<metric>_per_token`` (the total over
    steps / (steps x batch): first step and polls included). Where the host line lies above the
    device line, the GPU waits for the host (host-bound). ``env``, ``model``: where the rows came from,
    for the caption (`where`)."""
    df = _ok(df)
    suffix = "_median" if stat == "median" else ""
    host, device = f"host_us{suffix}_per_token", _device_column(df, suffix)
    if host not in df.columns:
        raise ValueError(f"column {host!r} is missing; per_token_vs_batch(stat={stat!r}) reads what "
                         "gdtool.measure.timing.per_token gives (or pass stat='mean')")
    fig, ax = _new(ax)
    values, lines = [], {}
    order = sorted(dict.fromkeys(df["mode"]), key=lambda m: list(MODE_STYLE).index(m) if m in MODE_STYLE else 9)
    for i, mode in enumerate(order):
        g = df[df["mode"] == mode]
        bands = [c.replace("median", q) for c in (host, device) for q in ("p20", "p80")] if stat == "median" else []
        cols = list(dict.fromkeys(c for c in (host, device, *bands) if c in g.columns))
        g = g.groupby("batch")[cols].median().reset_index().sort_values("batch")
        style = hue_style("mode", mode, i)
        ax.plot(g["batch"], g[host], "-", label=f"{mode}: host", markersize=_size(i), **style)
        values.append(g[host].to_numpy())
        lines[f"{mode} host"] = (g["batch"].to_numpy(), g[host].to_numpy())
        if stat == "median" and host.replace("median", "p20") in g:
            ax.fill_between(g["batch"], g[host.replace("median", "p20")], g[host.replace("median", "p80")],
                            color=style["color"], alpha=0.15, linewidth=0)
        if device in g and g[device].notna().any():  # NaN on a CPU device: no GPU clock to read
            ax.plot(g["batch"], g[device], "--", label=f"{mode}: device", markerfacecolor="none",
                    markersize=_size(i), **style)
            values.append(g[device].to_numpy())
            lines[f"{mode} device"] = (g["batch"].to_numpy(), g[device].to_numpy())
    ax.set_xscale("log", base=2)
    batches = sorted(df["batch"].unique())
    ax.set_xticks(batches, [str(int(b)) for b in batches])
    ax.minorticks_off()
    _yscale(ax, np.concatenate(values) if values else [])
    _finish(ax, "batch size (rows)", "µs/token", "mode: time on")
    what = ("the median step's time over the batch size; bands: p20-p80 of the steps" if stat == "median" else
            "the total over all steps / (steps x batch), first step and polls included")
    if not any(k.endswith("device") for k in lines):
        what += "; no device line: there was no GPU clock to read"
    caption(fig, f"{_where_of(df, env, model)}. Solid: host work, dashed (hollow markers): device busy time, "
                 f"per token: {what}." + _overlap_note(lines) + _uncaptured_note(df))
    if title:
        ax.set_title(title)
    return fig, ax


def agreement(inproc: pd.DataFrame, traced: pd.DataFrame, *, model: str | None = None, title: str | None = None,
              env=None, traced_env=None):
    """In-process (`gdtool.measure.timing`) against Nsight Systems (`gdtool.measure.nsys`), per mode and batch size.

    Left: device busy time per token (the mean: total / (steps x batch)), in-process against nsys's
    node-level trace (graph-level for eager, which replays no graph), with their ratio. Right: host
    work of the median step, in-process against nsys's graph-level trace (its launch tracing costs the
    host; the ratio says how much). The table is `gdtool.measure.nsys.agreement(inproc, traced)`; it is also
    in ``fig.gdtool_table``. ``env``: where the in-process rows ran; ``traced_env``: the nsys sessions'
    environments (a list where the traces come from several sessions); the caption names both (`where`).
    Returns (fig, axes)."""
    from ..measure.nsys import agreement as compare
    table = compare(_ok(inproc), _ok(traced), model=model)
    model = table.attrs["model"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    x = np.arange(len(table))
    names = [f"{m.replace('-', '-' + chr(10))}\nb{b}" for m, b in zip(table["mode"], table["batch"])]
    for ax, a, b, ratio, ylabel in ((axes[0], "busy_in_process", "busy_nsys", "busy_ratio", "device busy µs/token"),
                                    (axes[1], "host_in_process", "host_nsys", "host_ratio",
                                     "host work, median step (µs)")):
        for i, mode in enumerate(table["mode"]):
            color = MODE_STYLE.get(mode, {}).get("color", "0.5")
            ax.bar(x[i] - 0.2, table[a][i], width=0.4, color=color, label="in-process" if i == 0 else None)
            ax.bar(x[i] + 0.2, table[b][i], width=0.4, color=color, alpha=0.45, hatch="//", edgecolor="0.3",
                   label="nsys" if i == 0 else None)
            if table[ratio][i] == table[ratio][i]:
                top = np.nanmax([table[a][i], table[b][i]])
                ax.annotate(f"{table[ratio][i]:.2f}x", (x[i], top), ha="center", va="bottom", fontsize="x-small",
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(x, names, fontsize="x-small")
        _yscale(ax, table[[a, b]].to_numpy())
        _finish(ax, "mode, batch size", ylabel)
    axes[0].get_legend().remove()   # one legend, right of both panels
    _legend(axes[1], "measured by")
    axes[0].set_title("device busy per token (mean)", fontsize="medium")
    axes[1].set_title("host work per step (median)", fontsize="medium")
    fig.suptitle(title or f"{model}: in-process against Nsight Systems")
    mine = inproc[inproc["model"] == model]
    theirs = traced[traced["model"] == model]
    caption(fig, f"In-process: {_where_of(mine, env, model)}; Nsight Systems: {_where_of(theirs, traced_env, model)}. "
                 "Solid: in-process (gdtool.measure.timing, no profiler attached); hatched: Nsight Systems; labels: "
                 "in-process / nsys. Busy time from nsys's node-level trace (graph-level for eager). Host time from "
                 "nsys's graph-level trace, whose tracing of each launch call costs the host far more than the "
                 "launch itself: a graph mode's host ratio is that cost, not a disagreement.")
    fig.gdtool_table = table
    return fig, axes


def prediction_vs_measurement(runs: pd.DataFrame, *, tolerance: float = 0.15, hue: str = "batch", ax=None,
                              title: str | None = None, env=None, model: str | None = None):
    """Measured against predicted tokens/s, one point per run (from `costmodel.predict_runs`).

    Filled markers: out-of-sample runs (not used by the fit); hollow: calibration runs. The shaded
    band is +-``tolerance`` around y = x. ``env``, ``model``: where the runs came from, for the caption
    (`where`)."""
    runs = _ok(runs)
    fig, ax = _new(ax, figsize=(6.4, 5.0))
    calib = runs["calibration"] if "calibration" in runs.columns else pd.Series(False, index=runs.index)
    for i, (value, g) in enumerate(runs.groupby(hue, sort=True)):
        style = hue_style(hue, value, i)
        c = calib.loc[g.index]
        ax.scatter(g.loc[~c, "pred_tokens_per_s"], g.loc[~c, "tokens_per_s"], color=style["color"],
                   marker=style["marker"], label=f"{value}", s=22)
        ax.scatter(g.loc[c, "pred_tokens_per_s"], g.loc[c, "tokens_per_s"], facecolors="none",
                   edgecolors=style["color"], marker=style["marker"], s=22, label=None if (~c).any() else f"{value}")
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
    caption(fig, f"{_where_of(runs, env, model)}. One point per run. Filled: out-of-sample runs (not used by the "
                 f"fit); hollow: the calibration runs the fit used. Line: y = x; grey band: ±{tolerance:.0%}.")
    return fig, ax
