"""An ipywidgets explorer over sweep results: filter by model, mode, batch, polling policy and length
distribution, pick a view, and the plot redraws.

    from gdtool.frontends import widgets
    widgets.explorer(df)                        # df: gdtool.sweep(...) or gdtool.sweep.load("x.csv")
    widgets.explorer(df, models={"llama-1b": model})   # reuse a loaded model for "run this config now"
    widgets.explorer(df, env=sidecar["environment"])   # where the rows were measured (default: df.attrs)

On a GPU the explorer also has a "run this config now" button: with exactly one value chosen in each
filter it runs that config (one warm-up, one repetition), appends the row and redraws, so a reader can
check a committed figure on their own GPU. Without a GPU the button is disabled and says why (CPU
timings of a captured step say nothing about a GPU's).

The plot goes into the output area as widget state (`Output.outputs`), never by capturing `display()`
into it (`with output:`): a headless run (nbconvert, papermill: nbclient) mimics the front end's capture
by sending the widget's outputs back to the kernel on the shell socket while it waits there for the
cell's execute reply, and jupyter_client sends through a blocking shadow of the asyncio socket, which can
swallow the wake-up for a reply that already arrived: the run then sat out its whole cell timeout after
the explorer's cell (nbclient issue 312). Set as state, nothing goes back to the kernel.
"""
from __future__ import annotations

import base64
import io

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from . import plot
from ..core.models import load_model
from ..measure import record
from .sweep import RunConfig, poll_label, poll_order, run_config

__all__ = ["Explorer", "explorer"]

_FILTERS = ("model", "mode", "lengths", "batch", "poll")
_VIEWS = {"tokens/s vs polling interval": "interval", "tokens/s vs batch size": "batch",
          "wasted steps vs polling interval": "wasted", "table": "table"}


class Explorer:
    """Filters, a view selector, an output area and (on a GPU) a run button; ``.widget`` is the box.

    ``env``: where the rows of `df` were measured (default ``df.attrs["environment"]``, which
    `gdtool.frontends.sweep.sweep` and `load` set); each figure's caption names it, and this machine's
    too once the explorer has run a config here."""

    def __init__(self, df: pd.DataFrame, *, view: str = "interval", models: dict | None = None,
                 allow_runs: bool | None = None, repeats: int = 1, env: dict | None = None):
        import ipywidgets as w
        import torch
        if df is None or df.empty:
            raise ValueError("explorer() needs a non-empty results DataFrame; run gdtool.sweep(...) or load a CSV")
        self.df = df.assign(poll=df["poll"].map(poll_label)) if "poll" in df.columns else df.copy()
        self.env = env if env is not None else df.attrs.get("environment")
        self.ran_env = None   # this machine's, once a config ran here
        self.models = dict(models or {})
        self.repeats = repeats
        self.last_figure = None
        self.filters = {}
        for col in _FILTERS:
            if col not in self.df.columns:
                continue
            values = sorted(self.df[col].dropna().unique(), key=poll_order if col == "poll" else None)
            options = [str(v) if col == "poll" else v for v in values]
            sel = w.SelectMultiple(options=options, value=tuple(options), description=col,
                                   rows=min(max(len(options), 2), 6), layout=w.Layout(width="220px"))
            sel.observe(self._changed, names="value")
            self.filters[col] = sel
        views = {v: k for k, v in _VIEWS.items()}
        self.view = w.Dropdown(options=list(_VIEWS), value=views.get(view, next(iter(_VIEWS))), description="view")
        self.view.observe(self._changed, names="value")
        self.output = w.Output()
        self.status = w.HTML()
        gpu = torch.cuda.is_available()
        allow = gpu if allow_runs is None else allow_runs
        self.run_button = w.Button(description="run this config now", icon="play", disabled=not allow,
                                   tooltip="one warm-up + one timed decode of the selected config",
                                   layout=w.Layout(width="220px"))
        self.run_button.on_click(self._run)
        note = "" if allow else ("runs need a GPU: torch sees none, so this explorer only filters the "
                                 "results it was given")
        self.run_note = w.HTML(f"<i>{note}</i>" if note else "")
        self.widget = w.VBox([w.HBox(list(self.filters.values())), w.HBox([self.view, self.run_button]),
                              self.run_note, self.status, self.output])
        self.redraw()

    # -- state ----------------------------------------------------------------------------------
    def selection(self) -> dict:
        return {col: list(sel.value) for col, sel in self.filters.items()}

    def filtered(self) -> pd.DataFrame:
        mask = pd.Series(True, index=self.df.index)
        for col, values in self.selection().items():
            mask &= self.df[col].isin(values)
        return self.df[mask]

    def _changed(self, _change=None):
        self.redraw()

    # -- drawing --------------------------------------------------------------------------------
    def redraw(self):
        data = self.filtered()
        view = _VIEWS[self.view.value]
        ok = data[data["error"].fillna("") == ""] if "error" in data.columns else data
        if ok.empty:
            self.status.value = "<b>no successful runs match this selection</b>"
            self.last_figure = None
            self._show(None)
            return
        self.status.value = f"{len(ok)} runs, {ok['name'].nunique() if 'name' in ok else len(ok)} configs"
        if view == "table":
            from .sweep import summarize
            self.last_figure = None
            self._show(summarize(ok))
            return
        ran_here = "source" in ok.columns and (ok["source"] == "explorer").any()
        given = "source" not in ok.columns or (ok["source"] != "explorer").any()
        env = ([self.env or {}] if given else []) + ([self.ran_env] if ran_here else [])   # {}: not recorded
        if view == "interval":
            hue = "batch" if ok["batch"].nunique() > 1 or ok["mode"].nunique() == 1 else "mode"
            fig, ax = plot.throughput_vs_interval(ok, hue=hue, env=env)
        elif view == "wasted":
            fig, ax = plot.throughput_vs_interval(ok, hue="batch", metric="wasted_steps", env=env)
        else:
            fig, ax = plot.throughput_vs_batch(ok, hue="mode" if ok["mode"].nunique() > 1 else "poll", env=env)
        self.last_figure = fig
        self._show(fig)
        plt.close(fig)

    def _show(self, obj):
        """Replace what the output area shows by `obj` (None: nothing), as widget state (module docstring)."""
        self.output.outputs = () if obj is None else (_display_data(obj),)

    # -- running --------------------------------------------------------------------------------
    def selected_config(self) -> RunConfig:
        sel = self.selection()
        many = [col for col, v in sel.items() if len(v) != 1]
        if many:
            raise ValueError(f"choose exactly one value in: {', '.join(many)} (a run needs one config)")
        match = self.filtered()
        template = match.iloc[0]
        return RunConfig(model=sel["model"][0], mode=sel["mode"][0], batch=int(sel["batch"][0]),
                         poll=sel["poll"][0], lengths=sel["lengths"][0],
                         max_new_tokens=int(template["max_new_tokens"]),
                         prompt_len=int(template.get("prompt_len", 128)),
                         sample=bool(template.get("sample", False)), seed=int(template.get("seed", 0)))

    def run_selected(self) -> list[dict]:
        """Run the selected config now (one warm-up, ``repeats`` timed), append its rows, redraw."""
        cfg = self.selected_config()
        model = self.models.get(cfg.model)
        if model is None:
            model = self.models[cfg.model] = load_model(cfg.model)
        done = self.df[self.df["config_hash"] == cfg.hash]["repeat"] if "config_hash" in self.df else []
        start = int(max(done) + 1) if len(done) else 0
        rows = run_config(model, cfg, repeats=self.repeats, warmup=1, start_repeat=start)
        self.ran_env = record.environment(device=next(model.parameters()).device)
        for row in rows:
            row["source"] = "explorer"
        self.df = pd.concat([self.df, pd.DataFrame(rows)], ignore_index=True)
        self.redraw()
        return rows

    def _run(self, _button=None):
        self.run_button.disabled = True
        try:
            self.status.value = "running ..."
            rows = self.run_selected()
            self.status.value = f"ran {rows[-1]['name']}: {rows[-1]['tokens_per_s']:.0f} tokens/s"
        except Exception as err:  # shown to the reader; the explorer stays usable
            self.status.value = f"<b>run failed:</b> {type(err).__name__}: {err}"
        finally:
            self.run_button.disabled = False

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _display_data(obj) -> dict:
    """`obj` as one display_data output: a figure as PNG, anything else as IPython's `display` formats it."""
    if isinstance(obj, Figure):
        png = io.BytesIO()
        obj.savefig(png, format="png", bbox_inches="tight")
        data, metadata = {"image/png": base64.b64encode(png.getvalue()).decode("ascii"), "text/plain": repr(obj)}, {}
    else:
        from IPython import get_ipython
        from IPython.core.formatters import DisplayFormatter
        shell = get_ipython()
        data, metadata = (shell.display_formatter if shell is not None else DisplayFormatter()).format(obj)
    return {"output_type": "display_data", "data": data, "metadata": metadata}


def explorer(df: pd.DataFrame, **kwargs) -> Explorer:
    """Build an `Explorer` (display it as the last expression of a cell)."""
    return Explorer(df, **kwargs)
