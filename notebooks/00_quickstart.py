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
# # gdtool in five minutes: one decode step, four ways to run it
#
# gdtool decodes a Hugging Face model with the same step function in four modes:
#
# - **eager**: the host runs the forward, the token selection and the update op by op, and reads
#   the "all rows finished" flag after every step (what `generate()` does);
# - **forward-graph**: the model forward is one CUDA-graph replay, the rest stays eager;
# - **step-graph**: the whole step (forward, sampling, EOS bookkeeping) is one replay, and the host
#   reads the flag only every `eos_poll_interval` steps;
# - **device-loop**: the step graph runs inside a CUDA-graph WHILE node: one launch per rollout,
#   stopped on the device right after the last row finishes.
#
# All four produce the same tokens, bit for bit. What changes is who waits for whom: at small batch
# an eager step is bound by the host launching hundreds of kernels; a captured step is one launch.
# The models are presets with random weights in real shapes (no download); on a machine without a
# GPU the graph modes run the same step uncaptured, so this notebook runs anywhere.

# %% tags=["parameters"]
model_name = None          # None: "llama-1b" on a GPU
batches = [1, 16]          # batch sizes to compare
max_new_tokens = 128       # tokens per row (EOS is off here: every row runs to the end)
prompt_len = 128
repeats = 3
warmup = 1
deterministic = None       # None: on with a GPU, for the token check (see below)
cpu = dict(model_name="tiny-llama", batches=[1, 2], max_new_tokens=8, prompt_len=8, repeats=1, warmup=0)
cpu_fallback = True        # False: run the parameters above even on a CPU (slow)

# %%
import os

import torch

import gdtool
from gdtool.frontends import notebook, plot, widgets
from gdtool.frontends.sweep import summarize, sweep

p = notebook.setup(dict(model_name=model_name, batches=batches, max_new_tokens=max_new_tokens, prompt_len=prompt_len,
                        repeats=repeats, warmup=warmup), cpu=cpu, gpu=dict(model_name="llama-1b"),
                   cpu_fallback=cpu_fallback)
if deterministic is None:
    deterministic = p.cuda
if deterministic:  # before the first matmul: cuBLAS reads its workspace setting once
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
model = gdtool.load_model(p.model_name, seed=0)
device = next(model.parameters()).device
print(f"{p.model_name}: {sum(q.numel() for q in model.parameters()) / 1e6:.1f} M parameters on {device}, "
      f"{next(model.parameters()).dtype}")

# %% [markdown]
# ## One decode per mode
# `gdtool.decode` returns the tokens and the counters that tell the modes apart: `replays` (graph
# launches), `host_syncs` (every time the host blocked on the device, the ones hidden inside library
# code included) and `polls` (reads of the EOS flag). The token check below is the promise of the
# whole tool: capturing the step changes the timing, never the output.
#
# One caveat on a GPU: some of PyTorch's kernels are not bitwise reproducible run to run. On an H200
# two identical `generate()` calls on llama-1b drifted apart after about 44 greedy tokens, and so did
# two runs of any one mode (`profiles/h200/determinism/`). With
# `torch.use_deterministic_algorithms(True)` the five (generate and the four modes, twice each) gave
# the same 192 tokens. So this check runs with deterministic algorithms on, and switches them off for
# the timing below.

# %%
prompt = gdtool.random_prompts(model, batch=p.batches[-1], lengths=p.prompt_len, seed=0)
outs = {mode: gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=mode,
                            max_new_tokens=p.max_new_tokens, eos_token_id=None, seed=0)
        for mode in gdtool.MODES}
for mode, out in outs.items():
    same = torch.equal(out.tokens, outs["eager"].tokens)
    print(f"{mode:>13}: {out.new_tokens} tokens, {out.steps} steps, {out.replays} replays, "
          f"{out.host_syncs} host syncs, {out.timings['decode_s'] * 1e3:.1f} ms decode, "
          f"tokens equal to eager: {same}")
assert all(torch.equal(out.tokens, outs["eager"].tokens) for out in outs.values())
torch.use_deterministic_algorithms(False)

# %% [markdown]
# ## Throughput, side by side
# `gdtool.sweep` runs each (mode, batch size) with a warm-up and a few repetitions and returns one
# row per repetition. EOS is off, so there is nothing to poll for (`polls=["never"]`): this is the
# pure cost of a step. The table shows medians; the plot draws them with the p20-p80 band (the
# 20th to 80th percentile of the repetitions), each mode in the colour it has in every notebook. Look at
# `us_per_token`: on a GPU the captured step should win most at batch 1, where the eager step is
# host-bound, and the gap should shrink as the batch grows and the device work per step catches up
# with the host's launch cost. (On a CPU nothing is captured: the graph modes run the same step
# uncaptured, and their speed there says nothing about capture.) The caption opens with where the
# numbers came from: the model, the GPU (or "CPU, uncaptured") and the gdtool commit.

# %%
df = sweep([model], modes=gdtool.MODES, batches=p.batches, polls=["never"], lengths=["eos-off"],
           max_new_tokens=p.max_new_tokens, prompt_len=p.prompt_len, repeats=p.repeats, warmup=p.warmup)
table = summarize(df)[["mode", "batch", "tokens_per_s", "tokens_per_s_p20", "tokens_per_s_p80",
                       "us_per_token", "host_syncs", "replays"]]
table.round(1)

# %%
fig, ax = plot.throughput_vs_batch(df, hue="mode", title=f"{p.model_name}, {p.max_new_tokens} tokens per row",
                                   env=p.environment)

# %% [markdown]
# ## Explore
# The explorer filters a results table and redraws. On a GPU its "run this config now" button
# reruns the selected configuration on your machine; pick one value in every filter first.

# %%
widgets.explorer(df, view="batch", models={p.model_name: model}, env=p.environment)
