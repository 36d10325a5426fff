"""Plots (DataFrame in, (fig, ax) out, house style) and the ipywidgets explorer."""
from __future__ import annotations

import matplotlib
import matplotlib.colors

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from gdtool.measure import costmodel, workloads
from gdtool.frontends import plot
from gdtool.measure.costmodel import CostParams, steps_and_polls
from gdtool.frontends.sweep import RunConfig


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
    _legend_clear_of_the_axes(ax)
    assert _caption(ax.figure), "every figure says what its lines are"


def _legend_clear_of_the_axes(ax):
    fig = ax.figure
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1, "the legend sits right of the axes, off the data"


def _caption(fig) -> str:
    return fig._supxlabel.get_text() if fig._supxlabel is not None else ""


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
    fig, ax = plot.per_token_vs_batch(df, stat="mean")
    assert ax.get_xscale() == "log" and len(ax.get_lines()) == 6
    with pytest.raises(ValueError, match="host_us_median_per_token"):
        plot.per_token_vs_batch(df)  # the typical step needs the median columns
    with pytest.raises(ValueError, match="device_busy_us_per_token"):
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
    from gdtool.frontends import widgets
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


def test_explorer_shows_its_plot_as_widget_state(monkeypatch):
    """The explorer sets its output area's `outputs` and never captures `display()` into it: a headless client
    answers a capture on the shell socket while it waits there for the cell's reply (widgets.py docstring)."""
    ipywidgets = pytest.importorskip("ipywidgets")
    from gdtool.frontends import widgets
    captured = []
    enter = ipywidgets.Output.__enter__
    monkeypatch.setattr(ipywidgets.Output, "__enter__", lambda self: captured.append(self) or enter(self))
    ex = widgets.explorer(sweep_like(), allow_runs=False)
    [shown] = ex.output.outputs
    assert shown["output_type"] == "display_data" and shown["data"]["image/png"]
    ex.view.value = "table"
    assert "text/html" in ex.output.outputs[0]["data"]
    ex.filters["poll"].value = ()
    assert ex.output.outputs == ()
    assert captured == []


def test_explorer_runs_the_selected_config(load):
    pytest.importorskip("ipywidgets")
    from gdtool.frontends import widgets
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


# ---------------------------------------------------------------------------------------------
# one style in every figure


def test_each_mode_has_one_colour_and_marker_everywhere():
    modes = ("device-loop", "eager", "step-graph", "forward-graph")
    df = sweep_like(polls=("1",), modes=modes)
    fig, ax = plot.throughput_vs_batch(df, hue="mode")
    for line in ax.get_lines():
        style = plot.MODE_STYLE[line.get_label()]
        assert line.get_color() == style["color"] and line.get_marker() == style["marker"]
    # the same colours with fewer modes, in another order, in another plot
    fig, ax = plot.throughput_vs_batch(df[df["mode"].isin(["step-graph", "eager"])], hue="mode")
    assert {line.get_label(): line.get_color() for line in ax.get_lines()} == {
        "eager": plot.MODE_STYLE["eager"]["color"], "step-graph": plot.MODE_STYLE["step-graph"]["color"]}
    timing = pd.DataFrame(dict(mode=["step-graph", "eager"], batch=[1, 1], host_us_per_token=[10.0, 900.0],
                               device_us_per_token=[300.0, 310.0]))
    fig, ax = plot.per_token_vs_batch(timing, stat="mean")
    for line in ax.get_lines():
        assert line.get_color() == plot.MODE_STYLE[line.get_label().split(":")[0]]["color"]
    fig, ax = plot.host_device_bars(timing)
    assert ax.patches[0].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb(plot.MODE_STYLE["step-graph"]["color"]))


def test_a_batch_size_has_one_colour_in_every_figure():
    one = plot.throughput_vs_interval(sweep_like(batches=(1, 16)))[1]
    two = plot.throughput_vs_interval(sweep_like(batches=(4, 16, 64)))[1]
    colour = {ax: {line.get_label(): line.get_color() for line in ax.get_lines()} for ax in (one, two)}
    assert colour[one]["16"] == colour[two]["16"] and colour[one]["1"] != colour[two]["4"]


def test_zeros_never_on_a_log_axis():
    df = sweep_like()
    assert (df["wasted_steps"] == 0).any()
    fig, ax = plot.throughput_vs_interval(df, metric="wasted_steps")
    assert ax.get_yscale() in ("linear", "symlog") and ax.get_ylim()[0] <= 0   # the zeros are drawn, at 0
    spread = df.assign(wasted_steps=np.where(df["poll"] == "never", 400, df["wasted_steps"]))
    fig, ax = plot.throughput_vs_interval(spread, metric="wasted_steps")
    assert ax.get_yscale() == "symlog" and "linear from 0 to 1" in _caption(fig)
    wide = sweep_like(batches=(1, 64))
    wide.loc[wide["batch"] == 64, "tokens_per_s"] *= 40   # all positive, spanning more than 8x
    assert plot.throughput_vs_interval(wide)[1].get_yscale() == "log"


def test_lines_on_top_of_each_other_are_named_in_the_caption():
    df = sweep_like(polls=("1",), modes=("eager", "forward-graph", "step-graph"))
    same = df["mode"] != "eager"
    df.loc[same, "tokens_per_s"] = df.loc[same].groupby(["batch", "repeat"])["tokens_per_s"].transform("first")
    fig, ax = plot.throughput_vs_batch(df, hue="mode")
    text = _caption(fig).replace("\n", " ")
    assert "forward-graph and step-graph" in text and "eager" not in text.split("other")[-1]
    assert plot.overlapping({"a": ([1, 2], [1.0, 2.0]), "b": ([1, 2], [1.01, 2.0]), "c": ([1, 2], [1.5, 2])}) == \
        [("a", "b")]


def test_captions_explain_the_bands():
    fig, ax = plot.throughput_vs_interval(sweep_like())
    assert "median of 3 repetitions" in _caption(fig) and "p20-p80" in _caption(fig)
    sizes = [line.get_markersize() for line in ax.get_lines()]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)   # markers nest, none hidden
    fig, ax = plot.throughput_vs_interval(sweep_like(), normalize=True)
    assert "pass 1.0" in _caption(fig).replace("\n", " ")
    fig, ax = plot.throughput_vs_interval(sweep_like(repeats=1))
    assert "no band" in _caption(fig)


def _per_token(mode, batch, host, busy):
    return dict(model="llama-1b", mode=mode, batch=batch, host_us_median_per_token=host / batch,
                device_busy_us_per_token=busy / batch)


def test_agreement_pairs_in_process_with_nsys():
    inproc = pd.DataFrame([_per_token("eager", 1, 23600, 2190), _per_token("step-graph", 1, 14.6, 2256),
                           _per_token("step-graph", 16, 12.8, 3110)])
    traced = pd.DataFrame([dict(_per_token("eager", 1, 34700, 2185), trace="graph"),
                           dict(_per_token("step-graph", 1, 174, 2456), trace="graph"),
                           dict(_per_token("step-graph", 1, 1500, 2242), trace="node"),
                           dict(_per_token("step-graph", 16, 127, 3349), trace="graph")])
    fig, axes = plot.agreement(inproc, traced)
    table = fig.gdtool_table.set_index(["mode", "batch"])
    assert table.loc[("eager", 1), "busy_trace"] == "graph" and table.loc[("step-graph", 1), "busy_trace"] == "node"
    assert table.loc[("step-graph", 1), "busy_ratio"] == pytest.approx(2256 / 2242)
    assert table.loc[("step-graph", 16), "busy_trace"] == "graph"   # no node trace at batch 16: the graph one
    assert table.loc[("step-graph", 1), "host_ratio"] == pytest.approx(14.6 / 174)
    assert len(axes) == 2 and "Nsight Systems" in _caption(fig) and len(axes[0].patches) == 6
    with pytest.raises(ValueError, match="no model is in both"):
        plot.agreement(inproc.assign(model="tiny-llama"), traced)


def test_a_speed_figure_made_without_a_cuda_device_says_the_graph_modes_ran_uncaptured():
    rows = sweep_like(modes=("eager", "step-graph"))
    for device, said in (("cpu", True), ("cuda:0", False)):
        df = rows.assign(device=device)
        for fig, _ in (plot.throughput_vs_batch(df, hue="mode"), plot.throughput_vs_interval(df)):
            assert ("ran their step uncaptured" in _caption(fig).replace("\n", " ")) is said, device
    fig, _ = plot.throughput_vs_batch(rows.assign(device="cpu")[lambda d: d["mode"] == "eager"], hue="mode")
    assert "ran their step uncaptured" not in _caption(fig)   # eager alone captures nothing anywhere
    timing = pd.DataFrame([_per_token(mode, batch, 100.0, float("nan")) for mode in ("eager", "step-graph")
                           for batch in (1, 4)])
    fig, _ = plot.per_token_vs_batch(timing)   # no device clock on a CPU: device time NaN
    assert "ran their step uncaptured" in _caption(fig).replace("\n", " ")
    fig, _ = plot.per_token_vs_batch(timing.assign(device_busy_us_per_token=50.0))
    assert "uncaptured" not in _caption(fig)   # no record of the device, and a device clock: nothing says CPU


def test_notebook_03_captions_every_figure():
    from pathlib import Path
    source = (Path(__file__).resolve().parent.parent / "notebooks" / "03_fast_step_vs_megakernel.py").read_text()
    assert source.count("plt.subplots(") == source.count("plot.caption(fig,") > 0


def test_the_explorer_leaves_no_thread_or_open_figure_behind():
    """A notebook ending in widgets.explorer(...) must let its kernel go idle and shut down: building and
    redrawing the explorer in every view starts no thread and keeps no pyplot figure open."""
    pytest.importorskip("ipywidgets")
    import threading

    from gdtool.frontends import widgets
    plt.close("all")
    before = set(threading.enumerate())
    ex = widgets.explorer(sweep_like(), allow_runs=False)
    for view in widgets._VIEWS:
        ex.view.value = view
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []
    assert plt.get_fignums() == []


# ---------------------------------------------------------------------------------------------
# every figure says where its numbers came from

GPU_ENV = dict(date="2026-12-01T21:40:06+00:00", device="cuda", device_name="NVIDIA H200", gpu="NVIDIA H200",
               git_commit="04f3054" + "ab" * 16, git_dirty=False, git_commit_source="git")
CPU_ENV = dict(date="2026-12-06T10:38:22+00:00", device="cpu", device_name="x86_64", gpu=None,
               git_commit="829123a" + "cd" * 16, git_dirty=True, git_commit_source="git")
SAID = {"gpu": ("NVIDIA H200", "commit 04f3054"), "cpu": ("CPU, uncaptured", "commit 829123a (local changes)")}


def _figure_text(fig) -> str:
    """Every title, the suptitle and the caption, one line: what a reader sees said about the figure."""
    texts = [fig._suptitle, fig._supxlabel, *(ax.title for ax in fig.axes)]
    return " ".join(t.get_text() for t in texts if t is not None).replace("\n", " ")


def _timing():
    return pd.DataFrame([_per_token(mode, batch, 900.0 / batch, 400.0) for mode in ("eager", "step-graph")
                         for batch in (1, 4)]).assign(host_us_per_token=lambda d: d["host_us_median_per_token"])


def _agreement(env):
    inproc = pd.DataFrame([_per_token("eager", 1, 23600, 2190), _per_token("step-graph", 1, 14.6, 2256)])
    traced = pd.DataFrame([dict(_per_token("eager", 1, 34700, 2185), trace="graph"),
                           dict(_per_token("step-graph", 1, 174, 2456), trace="graph")])
    return plot.agreement(inproc, traced, env=env, traced_env=env)


FIGURES = {   # name: (draw it with env, the model it must name)
    "throughput_vs_interval": (lambda env: plot.throughput_vs_interval(sweep_like(), env=env), "tiny-llama"),
    "throughput_vs_batch": (lambda env: plot.throughput_vs_batch(
        sweep_like(polls=("1",), modes=("eager", "step-graph")), env=env), "tiny-llama"),
    "host_device_bars": (lambda env: plot.host_device_bars(_timing(), env=env), "llama-1b"),
    "per_token_vs_batch": (lambda env: plot.per_token_vs_batch(_timing(), stat="mean", env=env), "llama-1b"),
    "agreement": (_agreement, "llama-1b"),
    "prediction_vs_measurement": (lambda env: plot.prediction_vs_measurement(
        costmodel.predict_runs(sweep_like(), costmodel.fit(sweep_like())), env=env), "tiny-llama"),
}


@pytest.mark.parametrize("where", ["gpu", "cpu"])
@pytest.mark.parametrize("name", FIGURES)
def test_every_plot_names_the_model_the_device_and_the_commit(name, where):
    """Drawn on this machine (no GPU) from rows measured elsewhere: the figure names the given environment's GPU
    (or "CPU, uncaptured") and commit, and the rows' model."""
    draw, model = FIGURES[name]
    fig, _ = draw(GPU_ENV if where == "gpu" else CPU_ENV)
    text = _figure_text(fig)
    device, commit = SAID[where]
    assert model in text and device in text and commit in text, text
    other = SAID["cpu" if where == "gpu" else "gpu"]
    assert other[0] not in text and other[1] not in text, text
    assert name in plot.__all__


def test_where_says_it_in_one_form():
    assert plot.where(GPU_ENV, "llama-1b") == "llama-1b, NVIDIA H200, commit 04f3054"
    assert plot.where(CPU_ENV, "tiny-llama") == "tiny-llama, CPU, uncaptured, commit 829123a (local changes)"
    assert plot.where(CPU_ENV) == "computed, no model, commit 829123a (local changes)"
    assert plot.where(None) == "computed, no model, commit not recorded"
    assert plot.where([GPU_ENV, dict(GPU_ENV, git_commit="e34d967")], ["gemma-3-1b", "qwen3-30b-a3b"]) == \
        "gemma-3-1b and qwen3-30b-a3b, NVIDIA H200, commits 04f3054 and e34d967"
    assert plot.where([GPU_ENV, GPU_ENV], "llama-1b") == plot.where(GPU_ENV, "llama-1b")   # each named once
    # the forms committed sidecars take: a whole sidecar document; one from before "device" (the GPU only) and
    # without a hash ("HEAD"); an early bench's "+dirty"; a setting tagged on with $GDTOOL_COMMIT; a probe's own
    # "commit" over a copied git folder's
    assert plot.where({"environment": GPU_ENV, "sessions": []}, "x") == "x, NVIDIA H200, commit 04f3054"
    assert plot.where({"gpu": "NVIDIA H200", "git_commit": "HEAD"}, "x") == "x, NVIDIA H200, commit not recorded"
    assert plot.where(dict(device="cuda", device_name="NVIDIA H200", git_commit="bbb08543ec+dirty"), "x") == \
        "x, NVIDIA H200, commit bbb0854 (local changes)"
    assert plot.where(dict(GPU_ENV, git_commit="5a2de9b+line4"), "x") == "x, NVIDIA H200, commit 5a2de9b+line4"
    assert plot.where(dict(GPU_ENV, commit="7ced66b", git_dirty=True), "x") == "x, NVIDIA H200, commit 7ced66b"
    assert plot.where(pd.Series(dict(device="cuda", device_name="NVIDIA H200", commit="7ced66b")), "x") == \
        "x, NVIDIA H200, commit 7ced66b"
    assert plot.where({}, "x") == "x, device not recorded, commit not recorded"


def test_rows_that_ran_on_a_cpu_say_so_whatever_the_record_says():
    """A sweep run with device="cpu" on a GPU machine: its rows say cpu, the environment names the GPU."""
    fig, _ = plot.throughput_vs_batch(sweep_like(modes=("eager", "step-graph")).assign(device="cpu"), env=GPU_ENV)
    assert "tiny-llama, CPU, uncaptured, commit 04f3054" in _figure_text(fig)
    fig, _ = plot.throughput_vs_batch(sweep_like(modes=("eager", "step-graph")).assign(device="cuda:0"))
    assert "tiny-llama, a CUDA GPU (name not recorded), commit not recorded" in _figure_text(fig)


def test_a_loaded_sweep_names_its_sidecars_environment(tmp_path):
    """`sweep.load` keeps the sidecar's environment with the rows (df.attrs), through filtering, into the caption;
    the machine drawing the figure (this CPU) is not what it names."""
    from gdtool.frontends.sweep import load
    from gdtool.measure import record
    sweep_like().to_csv(tmp_path / "s.csv", index=False)
    record.write_sidecar(tmp_path / "s.json", GPU_ENV)
    df = load(tmp_path / "s.csv")
    fig, _ = plot.throughput_vs_interval(df[df["batch"] > 1], hue="batch")
    assert "tiny-llama, NVIDIA H200, commit 04f3054" in _figure_text(fig)
    (tmp_path / "s.json").unlink()
    fig, _ = plot.throughput_vs_interval(load(tmp_path / "s.csv"))
    assert "device not recorded, commit not recorded" in _figure_text(fig)


def test_the_explorer_names_where_its_rows_came_from():
    pytest.importorskip("ipywidgets")
    from gdtool.frontends import widgets
    ex = widgets.explorer(sweep_like(), allow_runs=False, env=GPU_ENV)
    assert "tiny-llama, NVIDIA H200, commit 04f3054" in _figure_text(ex.last_figure)
    ex.view.value = "tokens/s vs batch size"
    assert "NVIDIA H200" in _figure_text(ex.last_figure)


NOTEBOOK_PLOTS = {"throughput_vs_interval", "throughput_vs_batch", "host_device_bars", "per_token_vs_batch",
                  "agreement", "prediction_vs_measurement"}


def test_every_notebook_figure_is_told_where_its_numbers_came_from():
    """In each notebook, every gdtool plot and the explorer get ``env=`` (the results' environment), and every
    caption of a figure drawn in the notebook opens with `plot.where` (called there, or a name bound to it)."""
    import ast
    from pathlib import Path
    for path in sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.py")):
        tree = ast.parse(path.read_text())

        def is_call(node, module, names):
            return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == module)
        bound = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and is_call(node.value, "plot",
                 {"where"}) for target in node.targets if isinstance(target, ast.Name)}
        calls = [node for node in ast.walk(tree) if is_call(node, "plot", NOTEBOOK_PLOTS | {"caption"})
                 or is_call(node, "widgets", {"explorer"})]
        for call in calls:
            line = f"{path.name}:{call.lineno}"
            if call.func.attr != "caption":
                assert "env" in {k.arg for k in call.keywords}, f"{line}: {call.func.attr}(...) without env="
                continue
            text = call.args[1]
            first = text.values[0] if isinstance(text, ast.JoinedStr) and text.values else None
            opens = first.value if isinstance(first, ast.FormattedValue) else None
            assert opens is not None and (is_call(opens, "plot", {"where"}) or
                                          (isinstance(opens, ast.Name) and opens.id in bound)), \
                f"{line}: the caption does not open with plot.where(...)"
