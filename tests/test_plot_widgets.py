"""Plots (DataFrame in, (fig, ax) out, house style) and the ipywidgets explorer."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from gdtool import costmodel, plot, workloads
from gdtool.costmodel import CostParams, steps_and_polls
from gdtool.sweep import RunConfig


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def sweep_like(batches=(1, 4, 16), polls=("1", "4", "16", "never", "async"), modes=("step-graph",), repeats=3):
    """Rows shaped like gdtool.sweep's, with times from the cost model and a little jitter."""
    rng = np.random.default_rng(0)
    dist = workloads.geometric(8, 32)
    rows = []
    for mode in modes:
        for batch in batches:
            p = CostParams(t_step=1e-3 * (1 + batch / 16), t_sync=2e-4)
            for poll in polls:
                cfg = RunConfig("tiny-llama", mode, batch, poll, dist.name, 32, prompt_len=4)
                for repeat in range(repeats):
                    targets = cfg.lengths_for(repeat)
                    s, n = steps_and_polls([int(targets.max())], poll, 32)
                    t = (float(costmodel._time(s, n, poll, p)[0]) + 5e-5) * (1 + 0.02 * rng.standard_normal())
                    rows.append(dict(model=cfg.model, mode=mode, batch=batch, poll=cfg.poll, lengths=cfg.lengths,
                                     max_new_tokens=32, prompt_len=4, sample=False, seed=0, name=cfg.name,
                                     config_hash=cfg.hash, repeat=repeat, tokens=int(targets.sum()),
                                     tokens_per_s=int(targets.sum()) / t, steps=int(s[0]), polls=int(n[0]),
                                     wasted_steps=int(s[0]) - (int(targets.max()) - 1), decode_s=t,
                                     target_max=int(targets.max()), target_sum=int(targets.sum()), error=""))
    return pd.DataFrame(rows)


def _house_style(ax, legend_title):
    assert ax.xaxis.get_gridlines()[0].get_alpha() == pytest.approx(0.3)
    assert ax.get_legend() is not None and ax.get_legend().get_title().get_text() == legend_title
    assert ax.get_xlabel() and ax.get_ylabel()


def test_throughput_vs_interval_one_line_per_batch_with_prediction():
    df = sweep_like()
    params = costmodel.fit(df)
    pred = costmodel.predict(params, "geom:8:32", polls=["1", "4", "16", "never", "async"])
    fig, ax = plot.throughput_vs_interval(df, prediction=pred)
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["async", "1", "4", "16", "never"]
    solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(solid) == 3 and len(dashed) == 3
    # the drawn medians are the data's medians
    b4 = df[df["batch"] == 4].groupby("poll")["tokens_per_s"].median()
    line = next(line for line in solid if line.get_label() == "4")
    assert np.allclose(sorted(line.get_ydata()), sorted(b4.to_numpy()))
    assert "tokens/s" in ax.get_ylabel()
    _house_style(ax, "batch")


def test_normalized_curves_peak_at_one():
    fig, ax = plot.throughput_vs_interval(sweep_like(), normalize=True)
    for line in ax.get_lines():
        assert max(line.get_ydata()) == pytest.approx(1.0)


def test_throughput_vs_batch_log2_axis():
    df = sweep_like(polls=("1",), modes=("eager", "step-graph"))
    fig, ax = plot.throughput_vs_batch(df, hue="mode")
    assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
    assert len(ax.get_lines()) == 2
    _house_style(ax, "mode")


def test_host_device_plots():
    df = pd.DataFrame(dict(mode=["eager", "forward-graph", "step-graph"] * 2, batch=[1] * 3 + [8] * 3,
                           host_us_per_token=[900.0, 300, 20, 120, 40, 3],
                           device_us_per_token=[400.0, 380, 370, 60, 55, 50]))
    fig, ax = plot.host_device_bars(df)
    assert len(ax.patches) == 6 and "µs/token" in ax.get_ylabel()
    assert ax.patches[0].get_height() == 900.0  # eager host at the smallest batch
    _house_style(ax, "time spent on")
    fig, ax = plot.per_token_vs_batch(df)
    assert ax.get_xscale() == "log" and len(ax.get_lines()) == 6
    with pytest.raises(ValueError, match="device_us_per_token"):
        plot.host_device_bars(df.drop(columns="device_us_per_token"))


def test_prediction_vs_measurement():
    df = sweep_like()
    runs = costmodel.predict_runs(df, costmodel.fit(df))
    fig, ax = plot.prediction_vs_measurement(runs)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "median |error|" in ax.get_title()
    _house_style(ax, "batch")


def test_plots_refuse_empty_or_failed_results():
    df = sweep_like().assign(error="RuntimeError: boom")
    with pytest.raises(ValueError, match="error"):
        plot.throughput_vs_interval(df)
    with pytest.raises(ValueError, match="empty"):
        plot.throughput_vs_batch(pd.DataFrame())


# ---------------------------------------------------------------------------------------------
# widgets

def test_explorer_filters_and_redraws():
    pytest.importorskip("ipywidgets")
    from gdtool import widgets
    ex = widgets.explorer(sweep_like(), allow_runs=False)
    assert set(ex.filters) == {"model", "mode", "lengths", "batch", "poll"}
    assert len([line for line in ex.last_figure.axes[0].get_lines()]) == 3
    ex.filters["batch"].value = (1, 16)  # the observer redraws
    assert len(ex.last_figure.axes[0].get_lines()) == 2
    assert set(ex.filtered()["batch"]) == {1, 16}
    ex.view.value = "table"
    assert ex.last_figure is None
    ex.filters["poll"].value = ()
    assert "no successful runs" in ex.status.value
    # on CPU the run button is off and says why
    assert ex.run_button.disabled and "GPU" in ex.run_note.value
    with pytest.raises(ValueError, match="exactly one"):
        ex.selected_config()
    assert "application/vnd.jupyter.widget-view+json" in ex._repr_mimebundle_()


def test_explorer_runs_the_selected_config(load):
    pytest.importorskip("ipywidgets")
    from gdtool import widgets
    model = load("tiny-llama")
    df = sweep_like(batches=(1, 2), polls=("1", "async"))
    ex = widgets.explorer(df, models={"tiny-llama": model}, allow_runs=True)
    assert not ex.run_button.disabled
    ex.filters["batch"].value = (2,)
    ex.filters["poll"].value = ("async",)
    before = len(ex.df)
    ex._run()
    assert "ran tiny-llama_b2_pollasync" in ex.status.value, ex.status.value
    assert len(ex.df) == before + 1
    new = ex.df.iloc[-1]
    assert new["repeat"] == 3 and new["source"] == "explorer" and new["tokens"] == new["target_sum"]
