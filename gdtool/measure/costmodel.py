"""A cost model for EOS polling: predict useful tokens/s per polling interval and batch size.

Three measured numbers and the length distribution predict a whole sweep:

- ``t_step``: wall time of one decode step at this batch size when nothing waits on the host
  (from runs that never poll: ``poll="never"`` or EOS off);
- ``t_sync``: what one blocking EOS read adds: the host waits for the queue to drain, reads the
  flag, and the GPU idles until the next step is launched (from ``poll=1`` runs against the above);
- ``t_async``: what an asynchronous poll adds per step; assumed 0 (the read waits on a step that has
  already finished while the next one runs) unless fitted.

For a batch of B rows with per-row lengths L_b (tokens up to and including EOS, capped at
N = max_new_tokens) and M = max_b L_b, the prefill yields the first token, so the last row ends at
step M - 1. The loop then runs

    interval k:  S = min(ceil((M - 1) / k) * k, N - 1) steps and P = S // k blocking polls
                 (plus one right after the prefill, when the queue is already drained: free)
    async:       S = min(M, N - 1) steps (one late), S reads that stall nothing
    never:       S = N - 1 steps, no poll

and takes ``T = S * t_step + P * t_sync (+ S * t_async for async)``. Useful tokens are
``U = sum_b L_b``; predicted throughput is ``E[U] / E[T]`` (tokens per second over many batches).
E[.] over the lengths is exact: rows are independent, so P(M <= m) = F(m)^B (`workloads.max_pmf`).
Balancing the two costs, wasted steps (about (k - 1) / 2 per batch) against syncs (about M / k),
gives a rule of thumb ``k* ~ sqrt(2 E[M] t_sync / t_step)``.

Assumptions, each of which can fail (the notebook checks them against measurements):
1. the step time does not depend on how many rows are still running (finished rows are computed
   anyway in a static batch) nor on the step index (the static cache has a fixed length, so the
   attention cost is the same at every step); it does depend on batch size, model, mode, and on
   N and the prompt length through the cache length, so parameters are fitted per
   (model, mode, batch, max_new_tokens, prompt_len);
2. every blocking poll costs the same ``t_sync`` whatever the interval; the final sync at the end
   of a decode is part of the fixed cost, folded into ``t_step`` over N - 1 steps;
3. an asynchronous read is hidden behind the next step (``t_async = 0``) as long as the host's
   time per step stays below the device's; host-bound modes (eager) break this;
4. rows' lengths are independent draws of the distribution; natural EOS from the random weights
   (rare) is ignored.

    from gdtool.measure import costmodel, workloads
    params = costmodel.fit(df)                             # one row per (model, mode, batch, ...)
    costmodel.predict(params, workloads.geometric(128, 512), polls=[1, 4, 16, 64, "never", "async"])
    costmodel.best_interval(params, "geom:128:512", batch=16)
    costmodel.predict_runs(df, params)                     # each measured run against its prediction
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import workloads
from .polls import poll_label, poll_order

__all__ = [
    "INTERVALS",
    "KEY",
    "CostParams",
    "best_interval",
    "blocking_polls",
    "fit",
    "interval_factor",
    "k_star",
    "check",
    "measured_best",
    "pooled",
    "predicted_best_on_runs",
    "predict",
    "predict_runs",
    "repeat_noise",
    "steps_and_polls",
]

INTERVALS = ("1", "2", "4", "8", "16", "32", "64", "never", "async")
KEY = ["model", "mode", "batch", "max_new_tokens", "prompt_len"]


@dataclass
class CostParams:
    """Per-step and per-sync costs of one (model, mode, batch, max_new_tokens, prompt_len), in seconds."""

    t_step: float
    t_sync: float = 0.0
    t_async: float = 0.0
    batch: int | None = None
    max_new_tokens: int | None = None


def steps_and_polls(max_len, poll, max_new_tokens: int):
    """Steps run and polls made (counted as ``out.polls`` counts them) when the batch's longest row
    has ``max_len`` tokens; arrays welcome."""
    m = np.asarray(max_len, dtype=np.int64)
    label = poll_label(poll)
    last = max(int(max_new_tokens) - 1, 0)
    need = np.maximum(m - 1, 0)
    if label == "never":
        steps = np.full_like(m, last)
        polls = np.zeros_like(m)
    elif label == "async":
        steps = np.minimum(m, last)          # the flag of step t - 1 is read after launching step t
        polls = steps.copy()
    elif label == "default":
        raise ValueError("poll='default' depends on the mode; give the interval (1, 16, ...), 'never' or 'async'")
    else:
        k = int(label)
        steps = np.minimum(-(-need // k) * k, last)
        polls = steps // k + (last > 0)      # + the check right after the prefill
    return steps, polls


def blocking_polls(polls, poll):
    """Polls that stall the pipeline: every blocking poll but the one after the prefill."""
    label = poll_label(poll)
    polls = np.asarray(polls)
    if label in ("never", "async"):
        return np.zeros_like(polls)
    return np.maximum(polls - 1, 0)


def _time(steps, polls, poll, params: CostParams):
    label = poll_label(poll)
    t = steps * params.t_step
    if label == "async":
        return t + steps * params.t_async
    return t + blocking_polls(polls, label) * params.t_sync


def k_star(expected_max: float, t_step: float, t_sync: float) -> float:
    """Interval that balances wasted steps against syncs: sqrt(2 E[M] t_sync / t_step)."""
    if t_step <= 0:
        return float("nan")
    return math.sqrt(max(2.0 * expected_max * t_sync / t_step, 0.0))


# ---------------------------------------------------------------------------------------------
# fitting
def fit(df: pd.DataFrame, *, use: str = "calibration") -> pd.DataFrame:
    """Estimate t_step, t_sync, t_async per (model, mode, batch, max_new_tokens, prompt_len).

    ``use="calibration"`` (default) fits only on the runs that isolate each cost, so every other
    interval is an out-of-sample prediction: ``t_step`` = sum(decode_s) / sum(steps) over runs with
    no poll (``never`` or EOS off); ``t_sync`` = the extra time of ``poll=1`` runs per poll; ``t_async``
    = 0 (assumption 3). Where a group has no poll-free run, ``t_step`` and ``t_sync`` come from a least-
    squares fit over all its blocking-poll runs (``source="lstsq"``); where it has only ``poll=1`` runs
    the sync cost cannot be told apart from the step and is folded into ``t_step`` (``source="folded"``).
    ``use="all"`` also fits ``t_async`` from the async runs.
    Returns one row per group with ``t_step_us``, ``t_sync_us``, ``t_async_us``, ``source``, ``n``."""
    if df.empty:
        raise ValueError("fit() got an empty DataFrame; run gdtool.sweep first")
    ok = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    ok = ok[ok["decode_s"].notna() & (ok["steps"] > 0)].copy()
    if ok.empty:
        raise ValueError("no successful runs with decode steps to fit; check the 'error' column of the sweep")
    ok["poll"] = ok["poll"].map(poll_label)
    ok["stalls"] = [int(blocking_polls(p, label)) for p, label in zip(ok["polls"], ok["poll"])]
    key = [k for k in KEY if k in ok.columns]
    rows = []
    for values, g in ok.groupby(key, sort=True):
        values = values if isinstance(values, tuple) else (values,)
        rows.append(dict(zip(key, values)) | _fit_group(g, use))
    return pd.DataFrame(rows)


def _fit_group(g: pd.DataFrame, use: str) -> dict:
    free = g[(g["stalls"] == 0) & (g["poll"] != "async")]
    blocking = g[(g["poll"] != "async") & (g["stalls"] > 0)]
    asyncs = g[g["poll"] == "async"]
    t_async = 0.0
    if len(free):
        t_step = free["decode_s"].sum() / free["steps"].sum()
        source = "never"
        calib = blocking[blocking["poll"] == "1"] if use == "calibration" else blocking
        if len(calib):
            extra = (calib["decode_s"] - calib["steps"] * t_step).sum()
            t_sync = max(extra / calib["stalls"].sum(), 0.0)
            source += "+poll1" if use == "calibration" else "+polls"
        else:
            t_sync = 0.0
    else:
        design = blocking[["steps", "stalls"]].to_numpy(dtype=float)
        target = blocking["decode_s"].to_numpy(dtype=float)
        if len(blocking) and np.linalg.matrix_rank(design) == 2:
            (t_step, t_sync), *_ = np.linalg.lstsq(design, target, rcond=None)
            t_sync = max(float(t_sync), 0.0)
            t_step = float(((target - design[:, 1] * t_sync).sum()) / design[:, 0].sum())
            source = "lstsq"
        else:
            base = blocking if len(blocking) else g
            t_step = base["decode_s"].sum() / base["steps"].sum()
            t_sync = 0.0
            source = "folded"
    if use == "all" and len(asyncs):
        t_async = max((asyncs["decode_s"] - asyncs["steps"] * t_step).sum() / asyncs["steps"].sum(), 0.0)
    return dict(t_step_us=t_step * 1e6, t_sync_us=t_sync * 1e6, t_async_us=t_async * 1e6, source=source, n=len(g))


def _params(p) -> CostParams:
    if isinstance(p, CostParams):
        return p
    if isinstance(p, dict):
        p = pd.Series(p)
    return CostParams(t_step=float(p["t_step_us"]) * 1e-6, t_sync=float(p.get("t_sync_us", 0.0)) * 1e-6,
                      t_async=float(p.get("t_async_us", 0.0)) * 1e-6,
                      batch=int(p["batch"]) if "batch" in p else None,
                      max_new_tokens=int(p["max_new_tokens"]) if "max_new_tokens" in p else None)


# ---------------------------------------------------------------------------------------------
# predicting
def predict(params, lengths, polls=INTERVALS, batches=None, max_new_tokens: int | None = None) -> pd.DataFrame:
    """Predicted useful tokens/s for each polling policy and batch size under a length distribution.

    ``params``: the DataFrame of `fit` (one row per batch, and per model / mode when present) or a
    `CostParams` (then give ``batches``). ``max_new_tokens`` defaults to the fitted groups' (else the
    distribution's cap). Returns rows with ``expected_max``, ``steps``, ``polls``, ``wasted_steps``,
    ``tokens`` (expected per batch), ``decode_s`` and ``tokens_per_s``."""
    dist = workloads.parse(lengths)
    groups = _param_groups(params, dist, batches, max_new_tokens)
    rows = []
    for ident, p in groups:
        n_new = max_new_tokens or p.max_new_tokens or dist.max_length
        if n_new is None:
            raise ValueError("EOS off has no natural length: pass max_new_tokens")
        batch = int(ident["batch"])
        # EOS off: no row ever finishes, as if every row were max_new_tokens long
        values, probs = workloads.max_pmf(dist, batch, n_new) if dist.eos else (np.array([n_new]), np.array([1.0]))
        tokens = batch * dist.mean(n_new)
        for poll in polls:
            label = poll_label(poll)
            steps, npolls = steps_and_polls(values, label, n_new)
            e_steps = float((steps * probs).sum())
            e_polls = float((npolls * probs).sum())
            e_time = float((_time(steps, npolls, label, p) * probs).sum())
            need = float((np.maximum(values - 1, 0) * probs).sum())
            rows.append(dict(ident, lengths=dist.name, poll=label, max_new_tokens=n_new,
                             expected_max=float((values * probs).sum()), steps=e_steps, polls=e_polls,
                             wasted_steps=e_steps - need, tokens=tokens, decode_s=e_time,
                             tokens_per_s=tokens / e_time if e_time > 0 else float("nan")))
    out = pd.DataFrame(rows)
    if not out.empty:
        out["_o"] = out["poll"].map(poll_order)
        out = out.sort_values([c for c in ("model", "mode", "batch") if c in out.columns] + ["_o"])
        out = out.drop(columns="_o").reset_index(drop=True)
    return out


def _select(params, dist, batches, max_new_tokens) -> pd.DataFrame:
    """The fitted rows that apply: the asked batches, and the asked ``max_new_tokens``, by default the
    distribution's cap where such rows exist (a fit may hold EOS-off groups of another length)."""
    frame = params if isinstance(params, pd.DataFrame) else pd.DataFrame(params)
    if batches is not None:
        frame = frame[frame["batch"].isin(list(batches))]
    if "max_new_tokens" in frame.columns:
        wanted = max_new_tokens if max_new_tokens is not None else dist.max_length
        if max_new_tokens is not None or (wanted is not None and (frame["max_new_tokens"] == wanted).any()):
            frame = frame[frame["max_new_tokens"] == wanted]
    if frame.empty:
        raise ValueError("no fitted parameters match these batches / max_new_tokens; fit() a sweep that has them")
    return frame


def _param_groups(params, dist, batches, max_new_tokens):
    if isinstance(params, CostParams):
        bs = list(batches) if batches is not None else ([params.batch] if params.batch else None)
        if not bs:
            raise ValueError("a single CostParams needs batches=[...] (or CostParams.batch)")
        return [({"batch": b}, params) for b in bs]
    frame = _select(params, dist, batches, max_new_tokens)
    ident_cols = [c for c in ("model", "mode", "batch", "prompt_len") if c in frame.columns]
    return [({c: r[c] for c in ident_cols}, _params(r)) for _, r in frame.iterrows()]


def predict_runs(df: pd.DataFrame, params: pd.DataFrame) -> pd.DataFrame:
    """Each measured run next to its prediction from its own drawn lengths (``target_max``,
    ``target_sum``): columns ``pred_steps``, ``pred_polls``, ``pred_decode_s``, ``pred_tokens_per_s``
    and ``ratio`` = measured / predicted tokens/s. ``calibration`` marks the runs the fit used."""
    ok = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    ok = ok[ok["decode_s"].notna()].copy()
    ok["poll"] = ok["poll"].map(poll_label)
    key = [k for k in KEY if k in ok.columns and k in params.columns]
    merged = ok.merge(params, on=key, how="inner")
    if merged.empty:
        return merged
    preds = []
    for _, r in merged.iterrows():
        p = _params(r)
        n_new = int(r["max_new_tokens"])
        longest = n_new if r.get("lengths") == "eos-off" else int(r["target_max"])
        steps, npolls = steps_and_polls([longest], r["poll"], n_new)
        t = float(_time(steps, npolls, r["poll"], p)[0])
        preds.append((int(steps[0]), int(npolls[0]), t, float(r["target_sum"]) / t if t > 0 else float("nan")))
    merged[["pred_steps", "pred_polls", "pred_decode_s", "pred_tokens_per_s"]] = pd.DataFrame(preds, index=merged.index)
    merged["ratio"] = merged["tokens_per_s"] / merged["pred_tokens_per_s"]
    stalls = np.array([int(blocking_polls(p, label)) for p, label in zip(merged["polls"], merged["poll"])])
    merged["calibration"] = ((stalls == 0) & (merged["poll"] != "async")).to_numpy() | (merged["poll"] == "1").to_numpy()
    return merged


def best_interval(params, lengths, batch: int | None = None, polls=INTERVALS,
                  max_new_tokens: int | None = None) -> pd.DataFrame:
    """The predicted best polling policy per (model, mode, batch): rows with ``best_poll``,
    ``tokens_per_s``, the runner-up figures and ``k_star`` (the rule of thumb)."""
    table = predict(params, lengths, polls=polls, batches=None if batch is None else [batch],
                    max_new_tokens=max_new_tokens)
    group = [c for c in ("model", "mode", "batch") if c in table.columns]
    rows = []
    frame = _select(params, workloads.parse(lengths), None if batch is None else [batch], max_new_tokens) \
        if isinstance(params, pd.DataFrame) else None
    for ident, g in table.groupby(group, sort=True):
        ident = ident if isinstance(ident, tuple) else (ident,)
        top = g.sort_values("tokens_per_s", ascending=False).iloc[0]
        row = dict(zip(group, ident), best_poll=top["poll"], tokens_per_s=top["tokens_per_s"],
                   worst_poll=g.sort_values("tokens_per_s").iloc[0]["poll"],
                   worst_tokens_per_s=g["tokens_per_s"].min(), expected_max=top["expected_max"])
        if frame is not None:
            sel = frame
            for c, v in row.items():
                if c in group and c in sel.columns:
                    sel = sel[sel[c] == v]
            if len(sel):
                p = _params(sel.iloc[0])
                row["k_star"] = k_star(top["expected_max"], p.t_step, p.t_sync)
        elif isinstance(params, CostParams):
            row["k_star"] = k_star(top["expected_max"], params.t_step, params.t_sync)
        rows.append(row)
    return pd.DataFrame(rows)


def pooled(df: pd.DataFrame) -> pd.DataFrame:
    """Measured useful tokens/s per (model, mode, batch, lengths, poll), pooled over the repetitions:
    sum of useful tokens over sum of decode time, the quantity `predict` estimates (E[U] / E[T]).
    A median of per-run tokens/s would rank the policies by one repetition's draw of lengths."""
    ok = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    ok = ok[ok["decode_s"].notna() & (ok["decode_s"] > 0)].assign(poll=lambda d: d["poll"].map(poll_label))
    group = [c for c in ("model", "mode", "batch", "lengths") if c in ok.columns]
    sums = ok.groupby(group + ["poll"], sort=True).agg(tokens=("tokens", "sum"), decode_s=("decode_s", "sum"),
                                                       runs=("decode_s", "size")).reset_index()
    return sums.assign(tokens_per_s=sums["tokens"] / sums["decode_s"])


def repeat_noise(df: pd.DataFrame) -> pd.DataFrame:
    """Run-to-run noise of identical work, per (model, mode): the largest relative spread
    (max / min - 1) of tokens/s among repetitions of one config with the same drawn lengths
    (EOS-off runs, or any config repeated with the same lengths). NaN where nothing was repeated."""
    ok = df[df["error"].fillna("") == ""] if "error" in df.columns else df
    ok = ok.assign(poll=ok["poll"].map(poll_label))
    same = [c for c in ("model", "mode", "batch", "lengths", "poll", "max_new_tokens", "target_sum", "target_max")
            if c in ok.columns]
    spread = ok.groupby(same)["tokens_per_s"].agg(lambda s: s.max() / s.min() - 1 if len(s) > 1 else np.nan)
    by = [c for c in ("model", "mode") if c in ok.columns]
    return spread.groupby(level=by).max().rename("noise").reset_index()


def measured_best(df: pd.DataFrame, tolerance: float | None = None, noise: pd.DataFrame | None = None) -> pd.DataFrame:
    """The measured best polling policy per (model, mode, batch, lengths), from `pooled` tokens/s, and
    ``tied``: every policy within ``tolerance`` of it (relative; default: the mode's run-to-run noise,
    ``noise`` as `repeat_noise` returns it, by default of ``df``), i.e. policies the measurement cannot
    tell from the best."""
    table = pooled(df)
    noise = repeat_noise(df) if noise is None else noise
    group = [c for c in ("model", "mode", "batch", "lengths") if c in table.columns]
    rows = []
    for ident, g in table.groupby(group, sort=True):
        ident = dict(zip(group, ident if isinstance(ident, tuple) else (ident,)))
        top = g.loc[g["tokens_per_s"].idxmax()]
        tol = tolerance
        if tol is None:
            match = noise
            for c in ("model", "mode"):
                if c in match.columns:
                    match = match[match[c] == ident[c]]
            tol = float(match["noise"].iloc[0]) if len(match) and pd.notna(match["noise"].iloc[0]) else 0.0
        tied = g[g["tokens_per_s"] >= top["tokens_per_s"] * (1 - tol)].sort_values("poll", key=lambda p: p.map(poll_order))
        rows.append(ident | dict(best_poll=top["poll"], tokens_per_s=top["tokens_per_s"], tolerance=tol,
                                 tied=list(tied["poll"]), runs=int(top["runs"])))
    return pd.DataFrame(rows)


def predicted_best_on_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The model's best policy for the lengths the sweep actually drew (from `predict_runs`): predicted
    tokens pooled over predicted time per poll, so model and measurement rank the same workload."""
    group = [c for c in ("model", "mode", "batch", "lengths") if c in runs.columns]
    sums = runs.groupby(group + ["poll"], sort=True)[["target_sum", "pred_decode_s"]].sum().reset_index()
    sums["tokens_per_s"] = sums["target_sum"] / sums["pred_decode_s"]
    best = sums.loc[sums.groupby(group)["tokens_per_s"].idxmax()]
    return best[group + ["poll", "tokens_per_s"]].rename(columns={"poll": "best_poll"}).reset_index(drop=True)


def check(df: pd.DataFrame, params: pd.DataFrame, lengths, polls=INTERVALS) -> pd.DataFrame:
    """The cost model against a sweep, one row per (model, mode, batch) of the distribution ``lengths``.

    ``measured_poll`` is the best policy by pooled tokens/s (`measured_best`); ``tied`` holds every
    policy within ``tolerance`` of it, the run-to-run noise of identical work in ``df`` (such as its
    EOS-off repetitions): policies the measurement cannot tell apart. Two model picks are compared:

    - ``recommended_poll``: the model's best for the distribution, what a user is told. Against the
      measurement: ``recommended_factor`` (to ``measured_poll``, `interval_factor`), the smallest
      factor to any tied policy ``recommended_factor_to_tied`` (``within_2x`` when <= 2), and what it
      measured, ``recommended_vs_best`` = pooled tokens/s at it over the best's;
    - ``on_runs_poll``: the model's best for the lengths the sweep actually drew (a few draws of a
      random distribution can favour another policy than its expectation), with the same factors.

    ``max_error`` is the largest |measured / predicted - 1| of pooled tokens/s over the out-of-sample
    policies (``within_15pct`` when <= 0.15).
    """
    dist = workloads.parse(lengths)
    sweep = df[df["lengths"] == dist.name] if "lengths" in df.columns else df
    runs = predict_runs(sweep, params)
    measured = measured_best(sweep, noise=repeat_noise(df))
    on_runs = predicted_best_on_runs(runs).rename(columns={"best_poll": "on_runs_poll"})
    recommended = best_interval(params, dist, polls=polls).rename(columns={"best_poll": "recommended_poll"})
    key = [c for c in ("model", "mode", "batch") if c in measured.columns and c in on_runs.columns]
    table = measured.rename(columns={"best_poll": "measured_poll", "tokens_per_s": "measured_tokens_per_s"})
    table = table.merge(on_runs[key + ["on_runs_poll"]], on=key).merge(
        recommended[[c for c in key if c in recommended.columns] + ["recommended_poll"]], on=key)
    for pick in ("recommended", "on_runs"):
        table[f"{pick}_factor"] = [interval_factor(a, b) for a, b in zip(table[f"{pick}_poll"], table["measured_poll"])]
        table[f"{pick}_factor_to_tied"] = [min(interval_factor(a, t) for t in tied)
                                           for a, tied in zip(table[f"{pick}_poll"], table["tied"])]
    rates = pooled(sweep).set_index(key + ["poll"])["tokens_per_s"]
    table["recommended_vs_best"] = [rates.get(tuple(r[c] for c in key) + (r["recommended_poll"],), np.nan)
                                    / r["measured_tokens_per_s"] for _, r in table.iterrows()]
    out = runs[~runs["calibration"]]
    per = out.groupby(key + ["poll"])[["tokens", "decode_s", "target_sum", "pred_decode_s"]].sum()
    error = ((per["tokens"] / per["decode_s"]) / (per["target_sum"] / per["pred_decode_s"]) - 1).abs()
    table["max_error"] = [error.xs(tuple(r[c] for c in key), level=key).max() if len(error) else np.nan
                          for _, r in table.iterrows()]
    table["within_2x"] = table["recommended_factor_to_tied"] <= 2
    table["within_15pct"] = table["max_error"] <= 0.15
    return table


def interval_factor(a, b) -> float:
    """How far apart two polling policies are, as a factor of their intervals (async counts as 1,
    never as max_new_tokens is not comparable: inf unless both are never)."""
    la, lb = poll_label(a), poll_label(b)
    if la == lb:
        return 1.0
    va = {"async": 1.0}.get(la, float(la) if la.isdigit() else float("inf"))
    vb = {"async": 1.0}.get(lb, float(lb) if lb.isdigit() else float("inf"))
    if math.isinf(va) or math.isinf(vb):
        return float("inf")
    return max(va, vb) / min(va, vb)

