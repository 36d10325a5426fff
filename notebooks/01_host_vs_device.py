# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
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
# three modes and batch sizes 1 to 64, twice: in-process (`gdtool.timing.profile`, no profiler
# session) and from an Nsight Systems export (`gdtool.nsys.read`), where one is committed.

# %% tags=["parameters"]
models = None              # None: ["llama-1b", "llama-8b"] on a GPU, ["tiny-llama"] on CPU
batches = [1, 4, 16, 64]
max_new_tokens = 32        # 31 decode steps per profile (EOS off: every step makes one token per row)
prompt_len = 128
nsys_exports = None        # None: every *.sqlite / *.sqlite.gz under profiles/ and tests/data/

# %%
import gc
from pathlib import Path

import pandas as pd
import torch
from IPython.display import display

import gdtool
from gdtool import plot

root = Path(gdtool.__file__).resolve().parent.parent
if models is None:
    models = ["llama-1b", "llama-8b"] if torch.cuda.is_available() else ["tiny-llama"]
try:
    from gdtool.timing import profile
except ImportError:  # gdtool.timing is optional in older checkouts
    profile = None
print("models:", models, "| in-process timing:", "yes" if profile else "gdtool.timing not available")

# %% [markdown]
# ## In-process: `gdtool.timing.profile`
# For every step, `host_us` is the CPU time of the decoding thread (blocking waits excluded) and
# `device_busy_us` the summed duration of the kernels the step launched (from CUPTI, in a second,
# identical decode). Per token = total over steps / (steps x batch). On CPU the device columns are
# empty: there is no GPU clock to read. Every config is timed before the first kernel pass: a
# torch.profiler session leaves CUPTI attached, and on an H200 that raised a step-graph replay's host
# cost from ~7-20 µs to ~185 µs for the rest of the process (`profiles/README.md`).

# %%
from gdtool.sweep import profile_per_token

results = []
if profile is not None:
    for name in models:  # kept loaded until the kernel passes are done
        model = gdtool.load_model(name, seed=0)
        for batch in batches:
            prompt = gdtool.random_prompts(model, batch=batch, lengths=prompt_len, seed=0)
            for mode in gdtool.MODES:
                results.append((dict(model=name, mode=mode, batch=batch),
                                profile(model, prompt.input_ids, prompt.attention_mask, mode=mode, kernels=False,
                                        max_new_tokens=max_new_tokens, eos_token_id=None, seed=0)))
    if torch.cuda.is_available():
        for _, result in results:
            gdtool.add_device_busy(result)
rows = [dict(config, steps=len(result.steps), **profile_per_token(result)) for config, result in results]
del results
gc.collect()
timing = pd.DataFrame(rows)
if len(timing):
    timing["bound"] = ["?" if pd.isna(d) else "host" if h > d else "device"   # "?": no GPU clock on CPU
                       for h, d in zip(timing["host_us_per_token"], timing["device_us_per_token"])]
    display(timing.round(2))

# %% [markdown]
# Solid lines are host time per token, dashed lines device busy time. Where a mode's solid line lies
# above its dashed line, the GPU waits for the host. Per token, both fall with batch size: the host
# launches the same kernels for 1 row or 64, and a memory-bound step reads the same weights.
# Expect eager's host line far above its device line at batch 1 and the step-graph's host line
# near zero: one replay per step.

# %%
for name, group in timing.groupby("model", sort=False) if len(timing) else []:
    fig, ax = plot.per_token_vs_batch(group, title=f"{name}: in-process timing")

# %% [markdown]
# ## From an Nsight Systems export
# `python -m gdtool profile --nsys ...` records decodes under nsys and exports sqlite files;
# `gdtool.nsys.read` turns one into a row per decode step, with the same column names as the
# in-process timing. Committed exports are read below; compare their per-token figures with the
# table above (nsys sees device time directly, so the two should agree to within the profiler's
# overhead, which shows up on the host side).

# %%
from gdtool import nsys

if nsys_exports is None:
    nsys_exports = sorted({str(p) for d in (root / "profiles", root / "tests" / "data") if d.exists()
                           for pattern in ("*.sqlite", "*.sqlite.gz") for p in d.rglob(pattern)})
summaries = []
for path in nsys_exports:
    try:
        summaries.append(nsys.summary(nsys.read(path)).assign(file=Path(path).name))
    except Exception as err:  # one unreadable export must not hide the others
        print(f"skipped {Path(path).name}: {type(err).__name__}: {err}")
exported = pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame()
if exported.empty:
    print("no nsys export found under profiles/ or tests/data/; record one with `python -m gdtool profile --nsys`")
else:
    exported = exported.rename(columns={"device_busy_us_per_token": "device_us_per_token"})
    if "trace" not in exported.columns:
        exported["trace"] = "?"
    cols = [c for c in ("file", "model", "mode", "batch", "trace", "steps", "host_us_per_token",
                        "device_us_per_token", "gpu_idle_us_per_token", "bound") if c in exported.columns]
    display(exported[cols].round(2))

# %% [markdown]
# Exports recorded with `--cuda-graph-trace=graph` give host figures without the node-tracing
# overhead; `node` exports show each kernel of a replay but inflate the host cost of the replay call.

# %%
plottable = exported.dropna(subset=["host_us_per_token", "device_us_per_token"]) if len(exported) else exported
if len(plottable) and {"model", "mode", "batch"} <= set(plottable.columns):
    for (name, trace), group in plottable.groupby(["model", "trace"], sort=False):
        if group["batch"].nunique() > 1:
            fig, ax = plot.per_token_vs_batch(group, title=f"{name}: nsys export ({trace} trace)")
        else:
            fig, ax = plot.host_device_bars(group, title=f"{name}, batch {int(group['batch'].iloc[0])}: nsys ({trace} trace)")
