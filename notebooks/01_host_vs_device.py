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
# # Host or device: where a decode step's time goes
#
# A decode step costs time on two clocks. The **host** runs Python, dispatches ops and launches
# kernels (or one graph replay); the **device** runs them. Whichever is slower sets the pace:
#
# - host time per token above device time: the GPU idles between kernels, waiting for launches
#   (**host-bound**; eager decode at small batch);
# - device time above host time: the GPU runs back to back and the host waits (**device-bound**).
#
# Capturing the step in a CUDA graph removes most of the host's work (hundreds of launches become
# one), so it only pays where the decode is host-bound. This notebook measures both clocks for the
# four modes at several batch sizes, in-process (`gdtool.measure.timing`, no profiler attached), then sets
# the figures beside the Nsight Systems sessions committed under `profiles/h200/` (`gdtool.measure.nsys`).
#
# Three models, three kinds of step (on a GPU; tiny stand-ins of the same architectures on a CPU):
# - **llama-1b**: dense, every layer attends over the whole cache;
# - **gemma-3-1b**: sliding-window attention (five of every six layers attend over the last 512 tokens,
#   the sixth over all) with four norms per layer and a 262k-token vocabulary: more kernels per step;
# - **qwen3-30b-a3b**: mixture of experts, 128 experts per layer of which the router picks 8 per token,
#   so the weights a step reads grow with the batch (more rows route to more experts).

# %% tags=["parameters"]
models = None              # None: ["llama-1b", "gemma-3-1b", "qwen3-30b-a3b"] on a GPU
batches = [1, 16]         # [1, 16, 64] takes about twice as long on an H200 (qwen3-30b-a3b eager at 64 rows)
max_new_tokens = 32        # 31 decode steps per profile (EOS off: every step makes one token per row)
prompt_len = 128
cpu = dict(models=["tiny-llama", "tiny-gemma3", "tiny-qwen3-moe"], batches=[1, 2], max_new_tokens=6,
           prompt_len=8)   # what runs without a GPU
cpu_fallback = True        # False: run the parameters above even on a CPU (slow)
sessions = None            # None: the nsys session folders under profiles/h200/

# %%
from pathlib import Path

import pandas as pd
from IPython.display import display

import gdtool
from gdtool.frontends import notebook, options, plot
from gdtool.measure import nsys, record, timing

p = notebook.setup(dict(models=models, batches=batches, max_new_tokens=max_new_tokens, prompt_len=prompt_len),
                   cpu=cpu, gpu=dict(models=["llama-1b", "gemma-3-1b", "qwen3-30b-a3b"]), cpu_fallback=cpu_fallback)
root = Path(gdtool.__file__).resolve().parent.parent
pd.set_option("display.max_colwidth", None)   # config names tell HF rows from compiled ones: never cut them

# %% [markdown]
# ## In-process: `gdtool.measure.timing.profile`
# For every step, `host_us` is the CPU time of the decoding thread (blocking waits excluded) and
# `device_busy_us` the summed duration of the kernels the step launched (from CUPTI, in a second,
# identical decode). Every config is timed before the first kernel pass: a torch.profiler session
# leaves CUPTI attached, and on an H200 that raised a step-graph replay's host cost from ~7-20 µs to
# ~185 µs for the rest of the process (`profiles/README.md`). On a CPU the device columns are empty:
# there is no GPU clock to read.

# %%
configs = [(name, batch, mode) for name in p.models for batch in p.batches for mode in gdtool.MODES]
bar = options.progress(len(configs) * (2 if p.cuda else 1), "profile", unit="pass")
results, loaded = [], {}
for name, batch, mode in configs:  # models stay loaded until their kernel passes are done
    if name not in loaded:
        loaded[name] = gdtool.load_model(name, seed=0)
    model = loaded[name]
    prompt = gdtool.random_prompts(model, batch=batch, lengths=p.prompt_len, seed=0)
    results.append((dict(model=name, mode=mode, batch=batch),
                    gdtool.profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, busy=False,
                                   max_new_tokens=p.max_new_tokens, eos_token_id=None, seed=0)))
    bar.update(1)
if p.cuda:
    for _, result in results:
        gdtool.add_device_busy(result)
        bar.update(1)
bar.close()
rows = [dict(config, steps=len(result.steps), **timing.per_token(result)) for config, result in results]
del results, loaded
measured = pd.DataFrame(rows)
measured["bound"] = ["?" if pd.isna(d) else "host" if h > d else "device"   # "?": no GPU clock on a CPU
                     for h, d in zip(measured["host_us_median_per_token"], measured["device_busy_us_per_token"])]
shown = {"host_us_median_per_token": "host µs/token (median step)", "host_us_per_token": "host µs/token (mean)",
         "device_busy_us_median_per_token": "busy µs/token (median step)",
         "device_busy_us_per_token": "busy µs/token (mean)", "device_span_us_per_token": "span µs/token (mean)"}
display(measured[["model", "mode", "batch", "steps", *shown, "bound"]].rename(columns=shown).round(2))

# %% [markdown]
# Solid lines are host time per token, dashed lines device busy time, each mode in its own colour.
# Where a mode's solid line lies above its dashed line, the GPU waits for the host. Per token, both
# fall with batch size: the host launches the same kernels for 1 row or 16, and a memory-bound step
# reads the same weights (the MoE model's less so: more rows route to more experts, so its step reads
# more of its weights as the batch grows, until every expert is read). Expect eager's host line far above its device line at batch 1 and the
# step-graph's host line near the bottom: one replay per step.
#
# The lines are the **typical step** (the median step over the batch size, with its p20-p80 band).
# The table's "mean" columns divide the total over all steps instead, and for a graph mode the two
# differ: the first step replays a graph fresh from capture, which costs the host about 1.2 ms for
# llama-1b's 837-node step on an H200 (nsys sees the same, 1.3 ms) against 13-15 µs for every later
# replay, and the two poll steps wake from a wait. Over 31 steps that makes step-graph's mean host
# time 47 µs per token at batch 1 against a median step of 14.6 µs: both are right, they answer
# different questions (what a whole short decode costs, what a step costs once running).

# %%
for name, group in measured.groupby("model", sort=False):
    fig, ax = plot.per_token_vs_batch(group, stat="median", title=f"{name}: in-process timing, typical step",
                                      env=p.environment)

# %% [markdown]
# ## Against Nsight Systems
# `python -m gdtool profile --nsys ...` records decodes under nsys; `gdtool.measure.nsys.read` turns an export
# into a row per decode step with the same column names as the in-process timing. The committed
# sessions (`profiles/h200/nsys-*`) are read below: each kept export is read again by this code, and
# configs whose export was not kept (eager's, 4.7 MB each) come from the session's own summary.csv.
# `--cuda-graph-trace=node` records every kernel of a replay (busy time), `graph` one record per
# replay and far less tracing cost on the host (host time); `implementation` tells HF's kernels from
# `kernels="compiled"`.

# %%
if sessions is None:
    sessions = sorted(d for d in (root / "profiles" / "h200").glob("nsys-*") if d.is_dir())
traced = nsys.load_sessions(sessions)
session_env = {Path(d).name: record.read_sidecar(Path(d) / "env.json") for d in sessions}   # where each ran
if traced.empty:
    print("no nsys session found; record one with `python -m gdtool profile --nsys`")
else:
    cols = ["config", "source", "batch", "mode", "trace", "implementation", "steps", "host_us_median_per_token",
            "device_busy_us_per_token", "gpu_idle_us_per_token", "bound"]
    display(traced[cols].round(2))

# %% [markdown]
# The comparison, per mode and batch size. Device busy time per token should agree within a few
# percent (the same kernels, timed by CUPTI either way), the mean included. Host time cannot agree
# for the graph modes: under nsys's graph-level trace the launch call itself costs 98-174 µs where
# it costs 6-34 µs untraced (`profiles/h200/README.md`), and eager's host runs slower under API
# tracing too. Where this machine measured no device time (no GPU), the in-process side is the
# committed H200 profile, `profiles/h200/profile/summary.csv`. The caption names where each side ran: the
# in-process one's GPU and commit, and the nsys sessions' (their `env.json`).

# %%
compare, compare_env = measured, p.environment
if not p.cuda or compare["device_busy_us_per_token"].isna().all():
    committed = root / "profiles" / "h200" / "profile" / "summary.csv"
    compare = timing.per_token_table(pd.read_csv(committed)) if committed.exists() else pd.DataFrame()
    compare_env = record.read_sidecar(committed.with_name("env.json"))
    print(f"in-process side: {committed.relative_to(root)} (this machine measured no device time)")
both = [m for m in dict.fromkeys(compare["model"]) if m in set(traced["model"])] if len(compare) and len(traced) else []
print(f"models in both: {both or 'none'}")
for name in both:
    hf = traced[(traced["model"] == name) & (traced["implementation"] == "hf")]   # the traces compared
    fig, axes = plot.agreement(compare, traced, model=name, env=compare_env,
                               traced_env=[session_env[folder] for folder in dict.fromkeys(hf["folder"])])
    table = fig.gdtool_table
    display(table.round(3))
    busy = table.dropna(subset=["busy_ratio"])
    off = busy[(busy["busy_ratio"] - 1).abs() > 0.10]
    print(f"device busy per token (mean) of {name} within 10% of nsys for {len(busy) - len(off)} of {len(busy)} configs"
          + ("" if off.empty else f"; not for {', '.join(f'{m} b{b}' for m, b in zip(off['mode'], off['batch']))}"))
