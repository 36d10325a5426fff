# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How often should the host look at the EOS flag?
#
# With the whole decode step in a CUDA graph, the host's only remaining job is to decide when to
# stop: a flag on the device says "every row has finished", and reading it is a sync. The two ways
# to get it wrong:
#
# - **poll every step**: each read makes the host wait for the queue to drain, then the GPU idles
#   while the host launches the next step: a bubble per token;
# - **poll rarely**: after the batch's last row has finished, the GPU keeps decoding until the next
#   read, up to k - 1 wasted steps for an interval of k.
#
# In between sit intervals k = 2 ... 64 and an **async** poll (after launching step t, read the
# flag of step t - 1 from pinned memory: the read waits on a step that has already finished, at
# the price of one step past the end). Which wins depends on the step time (model, batch size), the
# sync cost and how long and spread the responses are. The longest row decides when a batch ends,
# so a larger batch runs longer and wastes less, relatively, per late poll.
#
# **Workload.** The models have random weights, so their responses end where the harness says:
# `gdtool.workloads` draws a length per row (here geometric: each token ends the row with
# probability 1/mean, capped), and the decode forces EOS at that length inside the captured step,
# so the device-side EOS bookkeeping runs exactly as with a real model's EOS.
#
# The results below come from `profiles/sweeps/` (measured on the GPU named under "Results measured on",
# which every caption names with the model and commit; see `profiles/regenerate.sh`); with `live=True` the
# notebook sweeps on your machine instead.

# %% tags=["parameters"]
results = "sweeps/llama-1b_geom128.csv"   # under profiles/: committed GPU sweep
live = None                 # None: sweep live only if `results` is missing; True: always sweep live here
model_name = "llama-1b"     # live sweep only
batches = [1, 4, 16, 64]
polls = [1, 4, 16, 64, "never", "async"]
lengths = "geom:128:512"    # the measured distribution
other_lengths = ["geom:32:512", "uniform:1:256", "fixed:128"]   # predicted by the cost model only
eos_off_tokens = 128        # tokens per row in the EOS-off mode comparison (live sweep)
repeats = 3
warmup = 1
prompt_len = 128
live_out = None             # where a live sweep writes its CSV (None: a temporary folder)
cpu = dict(model_name="tiny-llama", batches=[1, 2], polls=[1, 2, "never", "async"], lengths="geom:3:6",
           other_lengths=["fixed:4"], eos_off_tokens=4, repeats=2, warmup=0, prompt_len=8)   # a live sweep on a CPU
cpu_fallback = True         # False: a live sweep on a CPU runs the parameters above (slow)

# %%
import json
import tempfile
from pathlib import Path

import pandas as pd
from IPython.display import display

import gdtool
from gdtool.measure import costmodel, record, workloads
from gdtool.frontends import notebook, plot, widgets
from gdtool.frontends.sweep import load, summarize, sweep

root = Path(gdtool.__file__).resolve().parent.parent
path = root / "profiles" / results
if live is None:
    live = not path.exists()
given = dict(model_name=model_name, batches=batches, polls=polls, lengths=lengths, other_lengths=other_lengths,
             eos_off_tokens=eos_off_tokens, repeats=repeats, warmup=warmup, prompt_len=prompt_len)
# Reading committed results runs nothing: the CPU-sized parameters only stand in for a live sweep.
p = notebook.setup(given, cpu=cpu if live else {}, cpu_fallback=cpu_fallback)
if live:
    path = Path(live_out) if live_out else Path(tempfile.mkdtemp()) / "live.csv"
    model = gdtool.load_model(p.model_name, seed=0)
    common = dict(prompt_len=p.prompt_len, warmup=p.warmup, out=path)
    sweep([model], ["step-graph"], p.batches, p.polls, [p.lengths], repeats=p.repeats, **common)
    sweep([model], ["eager", "forward-graph"], p.batches, [1], [p.lengths], repeats=1, **common)
    sweep([model], list(gdtool.MODES), p.batches, ["never"], ["eos-off"], max_new_tokens=p.eos_off_tokens,
          repeats=1, **common)
df = load(path)
dist = workloads.parse(p.lengths)
sidecar = record.read_sidecar(path.with_suffix(".json"))
env = sidecar.get("environment")   # where the rows were measured: each figure's caption names it
print(f"{len(df)} runs from {'a live sweep' if live else path.relative_to(root)}; failed configs: "
      f"{(df['error'] != '').sum()}")
if sidecar.get("environment"):
    print(f"Results measured on: {record.describe(sidecar['environment'])}")

# %% [markdown]
# ## Throughput against the polling interval
# One line per batch size: median useful tokens/s (tokens up to and including each row's EOS, over
# the decode's wall time) with the p20-p80 band over repetitions. Each repetition draws new lengths,
# the same draw for every policy, so policies are compared on the same batches. Look for the
# shape: a rise from k = 1 while syncs get rarer, a peak, then a fall as wasted steps grow; `never`
# runs to `max_new_tokens` every time.

# %%
graph = df[(df["mode"] == "step-graph") & (df["lengths"] == dist.name)]
table = summarize(graph)
pd.pivot_table(table, index="batch", columns="poll", values="tokens_per_s", sort=False).round(0)

# %%
fig, ax = plot.throughput_vs_interval(graph, hue="batch", title=f"step-graph, {dist.name}", env=env)

# %% [markdown]
# The same curves, each divided by its best median, so batch sizes can be compared by shape: how
# much does a bad interval cost at each batch size?

# %%
fig, ax = plot.throughput_vs_interval(graph, hue="batch", normalize=True, title=f"step-graph, {dist.name}",
                                      env=env)

# %% [markdown]
# What the longer intervals pay for: steps run after the last row had finished (per decode).
# At batch 64 the longest of 64 geometric rows is usually near the cap, so a late poll wastes few
# steps relative to the whole; at batch 1 a late poll can double a short response's cost.

# %%
fig, ax = plot.throughput_vs_interval(graph, hue="batch", metric="wasted_steps", title="wasted steps per decode",
                                      env=env)

# %% [markdown]
# ## A cost model
# `gdtool.costmodel` predicts a run from three numbers per batch size: the step time `t_step`
# (from runs that never poll), the cost of one blocking poll `t_sync` (from `poll=1` runs against
# that), and, for async, no extra cost (assumption: the read hides behind the next step). With the
# length distribution it gives the expected steps and polls of every policy exactly (the max of B
# independent rows). Every interval other than 1 and `never` is therefore an out-of-sample
# prediction. The assumptions are spelled out in `help(costmodel)`.

# %%
params = costmodel.fit(graph)
params.round(2)

# %%
prediction = costmodel.predict(params, dist, polls=p.polls)
fig, ax = plot.throughput_vs_interval(graph, hue="batch", prediction=prediction,
                                      title=f"measured (solid) vs cost model (dashed), {dist.name}", env=env)

# %% [markdown]
# Each run against its own prediction (from the lengths drawn for it). Hollow markers are the
# calibration runs the fit used; filled ones are predictions. The band is ±15 %.

# %%
runs = costmodel.predict_runs(graph, params)
fig, ax = plot.prediction_vs_measurement(runs, env=env)

# %% [markdown]
# **The checks.** Per batch size, the policy the model recommends for the distribution against the
# measured best, as a factor of intervals (async counts as 1: the host looks every step). Measured
# tokens/s are pooled over the repetitions (all tokens over all time), the quantity the model
# predicts, not medians of single runs. Where the curve is flat, several policies lie within the
# run-to-run noise of identical work (the spread of the EOS-off repetitions, `tolerance`): `tied`
# lists them, and the factor is taken to the nearest of them. `on_runs_poll` is the model's pick for
# the lengths the sweep actually drew, `recommended_vs_best` what the recommendation measured
# against the best, and `max_error` the model's largest error on an out-of-sample policy.
# Targets: within a factor of 2, within 15 %.

# %%
check = costmodel.check(df[df["mode"] == "step-graph"], params, dist, polls=p.polls)  # EOS-off repeats give the noise
check.drop(columns=[c for c in ("model", "mode", "lengths") if c in check.columns]).round(4)

# %% [markdown]
# ## The device loop: poll never, stop exactly
# `device-loop` runs the whole rollout in one launch of a CUDA-graph WHILE node and stops on the
# device right after the last row finishes: no polls, no wasted steps. It is the end of the polling
# axis that "never" cannot reach. Compare its useful tokens/s with the best polling interval's
# (medians): a WHILE iteration costs a few µs more on the device than a replay, so expect just under 1.

# %%
loop = summarize(df[(df["mode"] == "device-loop") & (df["lengths"] == dist.name)])
if len(loop):
    best_poll = summarize(graph).sort_values("tokens_per_s").groupby("batch").tail(1).set_index("batch")
    loop = loop.set_index("batch")
    display(pd.DataFrame({"device-loop tokens/s": loop["tokens_per_s"],
                          "best step-graph tokens/s": best_poll["tokens_per_s"],
                          "best interval": best_poll["poll"],
                          "ratio": loop["tokens_per_s"] / best_poll["tokens_per_s"],
                          "device-loop wasted steps": loop["wasted_steps"]}).round(3))

# %% [markdown]
# ## Other length distributions (predicted)
# The fitted step and sync costs do not depend on the lengths, so the model can answer for
# distributions that were not measured: short responses (geometric, mean 32), a flat spread
# (uniform 1-256), and no spread at all (every row 128 tokens). Short or even lengths favour
# frequent polls (little to amortize the bubbles against, or nothing to wait for); long, spread
# lengths favour rarer ones.

# %%
dists = [dist] + [workloads.parse(d) for d in p.other_lengths]
predicted = pd.concat([costmodel.predict(params, d, polls=costmodel.INTERVALS) for d in dists], ignore_index=True)
best_by_dist = pd.concat([costmodel.best_interval(params, d).assign(lengths=d.name) for d in dists], ignore_index=True)
pd.pivot_table(best_by_dist, index="batch", columns="lengths", values="best_poll", aggfunc="first", sort=False)

# %%
middle = sorted(graph["batch"].unique())[len(graph["batch"].unique()) // 2]
fitted = "cost model fitted to " + ", ".join(map(str, graph["model"].unique()))   # no run: a prediction
fig, ax = plot.throughput_vs_interval(predicted[predicted["batch"] == middle], hue="lengths", normalize=True,
                                      title=f"cost model, batch {middle}: tokens/s relative to each best",
                                      env=env, model=fitted)

# %% [markdown]
# ## The modes side by side
# With EOS off (every row runs to the end, nothing to poll for), tokens/s per mode and batch size:
# the gain of capturing the forward, then the whole step. With EOS on, eager and forward-graph check the flag every step
# (poll 1), as `generate()` does; the step-graph row is its best measured interval.

# %%
eos_off = df[df["lengths"] == "eos-off"]
if len(eos_off):
    fig, ax = plot.throughput_vs_batch(eos_off, hue="mode", title="EOS off: every row runs to the end", env=env)

# %%
eos_on = summarize(df[df["lengths"] == dist.name])
best_graph = eos_on[eos_on["mode"] == "step-graph"].sort_values("tokens_per_s").groupby("batch").tail(1)
others = eos_on[(eos_on["mode"] != "step-graph") & ((eos_on["poll"] == "1") | (eos_on["mode"] == "device-loop"))]
side = pd.concat([others, best_graph])
pd.pivot_table(side.assign(label=side["mode"] + " poll " + side["poll"]), index="batch", columns="label",
               values="tokens_per_s", sort=False).round(0)

# %% [markdown]
# ## Explore
# Filter by mode, batch size, polling interval and distribution. On a GPU, "run this config now"
# reruns the selected configuration on your machine and adds it to the plot.

# %%
widgets.explorer(df, env=env)
