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
# # Rollouts that keep the batch full
#
# An RL rollout decodes far more prompts than fit in one batch, and its responses end at very different
# lengths. A static batch of `slots` prompts runs until its longest row ends: every row that finished
# earlier decodes pads until then. `gdtool.rollout(..., refill=...)` gives each slot its own sequence and
# starts the next prompt in a slot as soon as its sequence ends:
#
# - `refill="off"`: static batches through the device loop;
# - `refill="host"`: the host reads the flags after each captured step and replays the refill;
# - `refill="device"`: the refills run inside the device loop, in WHILE nodes (one per refill size) between
#   the steps: one launch for the whole rollout, a handful of host reads.
#
# Everything measured below is read from `profiles/h100/rollout-bench/`: `python -m gdtool bench --workload
# rollout` on one H100 (random weights with real shapes, bf16, HF's kernels, greedy, each prompt's response
# length drawn and EOS forced there). The occupancy picture and the predictions come from
# `gdtool.measure.rollouts`, which computes a rollout's schedule from its lengths alone; it matches the
# figures the device counted (checked below).

# %% tags=["parameters"]
results = "h100/rollout-bench"   # under profiles/: committed runs of `python -m gdtool bench --workload rollout`
model = "llama-1b"
lengths = "geom:128:512"         # the measured distribution
kernels = "hf"                   # the kernels option of the runs shown (docs/rollout.md has the others' table)
picture_slots = 64               # the occupancy picture: this slot count's run, its first prompts
picture_prompts = 256
other_lengths = ["geom:32:512", "uniform:1:256", "fixed:128"]   # predicted only
slot_counts = [8, 16, 32, 64, 128, 256]
prompts = 1024                   # prompts per predicted rollout
refill_after = 1                 # the runs shown refill as soon as a slot is free (1 or 8 prompts a prefill)
cpu = {}                         # nothing here runs a model: the same on a CPU
cpu_fallback = True

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

import gdtool
from gdtool.core.rollout_step import default_refill_after
from gdtool.frontends import notebook, plot
from gdtool.measure import record, rollouts, workloads

p = notebook.setup(dict(results=results, model=model, lengths=lengths), cpu=cpu, cpu_fallback=cpu_fallback)
root = Path(gdtool.__file__).resolve().parent.parent
folder = root / "profiles" / results
runs = [json.loads(f.read_text()) for f in sorted(folder.glob(f"{model}_rollout_*.json"))]


def shape(cfg, refill="device"):
    """A run's refill_rows and refill_after, as gdtool.rollout and rollouts.schedule take them (runs from before
    refill_rows refilled one prompt at a time; refill_after None: the library's default for the slots)."""
    after = cfg.get("refill_after", 1)
    return {} if refill == "off" else dict(refill_rows=cfg.get("refill_rows", 1),
                                           refill_after=default_refill_after(cfg["slots"]) if after is None else after)


runs = [r for r in runs if r["config"]["lengths"] == lengths and r["config"].get("kernels", "hf") == kernels
        and shape(r["config"])["refill_after"] == refill_after]


rows = [{**s, "prompts": r["config"]["prompts"], "seed": r["config"]["seed"]} for r in runs for s in r["summary"]]
summary = pd.DataFrame(rows).sort_values(["slots", "runner"], kind="stable")
env = runs[0]["environment"]
where = plot.where([r["environment"] for r in runs], model)   # the measured figures' captions open with it
computed = plot.where(p.environment)   # the pictures computed here from lengths alone: no model, this commit
print(f"{len(runs)} configs from profiles/{results}; measured on: {record.describe(env)}")

# %% [markdown]
# ## Useful tokens per second
# Per slot count: useful tokens (up to and including each EOS) over the wall time of the whole call, capture
# and prefills included, one timed call after a short warm-up. `eos-off` is one static batch whose every
# row runs all 512 tokens: a ceiling no rollout with these lengths reaches. HF's continuous batching ran at
# 64 slots only.

# %%
order = ["static", "host", "device", "hf-cb", "eos-off"]
table = summary.pivot_table(index=["slots", "prompts"], columns="runner", values="tok_s", sort=False)
display(table[[c for c in order if c in table]].round(0))
fig, ax = plt.subplots(figsize=(7.2, 4.0), layout="constrained")
styles = {"static": ("tab:gray", "o"), "host": ("tab:orange", "s"), "device": ("tab:blue", "D"),
          "hf-cb": ("tab:red", "X"), "eos-off": ("black", "^")}
for runner in order:
    part = summary[(summary.runner == runner) & summary.tok_s.notna()]
    if len(part):
        color, marker = styles[runner]
        ax.plot(part.slots, part.tok_s, marker=marker, color=color, linestyle=":" if runner == "eos-off" else "-",
                label=runner)
ax.set_xscale("log", base=2)
ax.set_xticks(sorted(summary.slots.unique()), [str(s) for s in sorted(summary.slots.unique())])
ax.set_xlabel("slots (rows decoded at once)")
ax.set_ylabel("useful tokens / s")
ax.legend()
plot.caption(fig, f"{where}. Prompts of 128 tokens, lengths {lengths}; 1,024 prompts at 64 slots, 256 at the "
                  "others (the 128-slot run drains its queue after two batches' worth); refills of one prompt a "
                  "prefill, of up to 8 at 8 slots (the later default). eos-off: one static batch "
                  "with every row running to the cap (all its tokens counted).")
plt.show()

# %% [markdown]
# ## Where the static batch's time goes: slot occupancy
# Each cell is one slot at one decode step: coloured where the slot made a token someone keeps (one colour per
# sequence), white where it decoded for a sequence that had already ended, or for none. The schedules are
# computed from the run's drawn lengths by `gdtool.measure.rollouts.schedule`, the same admission rule the
# device runs: after each step, while a slot is free and the queue is not empty, the next sequences take the
# first free slots (several in one prefill where several are free; docs/rollout.md).

# %%
picture = next(r for r in runs if r["config"]["slots"] == picture_slots)
drawn = workloads.parse(lengths).draw(batch=picture["config"]["prompts"], seed=picture["config"]["seed"])
first = drawn[:picture_prompts]
plans = {refill: rollouts.schedule(first, picture_slots, refill, occupancy=True, **shape(picture["config"], refill))
         for refill in ("off", "device")}
fig, axes = plt.subplots(2, 1, figsize=(9, 5.2), layout="constrained", sharex=True)
longest = max(p.steps for p in plans.values())
for ax, (refill, plan) in zip(axes, plans.items()):
    grid = np.ma.masked_less(plan.occupancy.T.astype(float), 0)
    shown = np.ma.masked_array(np.asarray(grid.filled(0)) % 20, mask=grid.mask)
    ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="tab20", extent=(0, plan.steps, plan.slots, 0))
    ax.set_xlim(0, longest)
    name = "static batches" if refill == "off" else "refill (host or device: one rule)"
    ax.set_title(f"{name}: {plan.steps:,} steps, {plan.share:.0%} of row-steps kept", fontsize="medium")
    ax.set_ylabel("slot")
axes[-1].set_xlabel("decode step")
plot.caption(fig, f"{computed}. The first {picture_prompts} prompts of the {picture_slots}-slot run's draw ({lengths}, "
                  f"seed {picture['config']['seed']}), {picture_slots} slots, scheduled from the lengths alone by "
                  "gdtool.measure.rollouts.schedule, equal to what the device counts (table below).")
plt.show()

# %% [markdown]
# ## The share of row-steps that made a kept token: counted against computed
# `share` is counted on the device during the run (`RolloutOutput.row_steps`); `pred` is the schedule's, from
# the drawn lengths alone. They differ only where a sequence emitted EOS by itself before its drawn length
# (`early`: random weights, bf16).

# %%
counted = []
for r in runs:
    cfg = r["config"]
    draw = workloads.parse(cfg["lengths"]).draw(batch=cfg["prompts"], seed=cfg["seed"])
    for s in r["summary"]:
        refill = {"static": "off", "host": "host", "device": "device"}.get(s["runner"])
        if refill and s["status"] == "ok":
            plan = rollouts.schedule(draw, cfg["slots"], refill, **shape(cfg, refill))
            counted.append(dict(slots=cfg["slots"], prompts=cfg["prompts"], runner=s["runner"],
                                share=s["row_step_share"], pred=plan.share, steps=s["decode_steps"],
                                steps_pred=plan.steps, early=s["early"]))
display(pd.DataFrame(counted).sort_values("slots", kind="stable").round(4).reset_index(drop=True))

# %% [markdown]
# ## Predicted across distributions and slot counts
# The schedule's share of kept row-steps for `prompts` prompts per rollout, static against refill, for the
# measured distribution and others. Shorter and more spread responses leave a static batch emptier; refill
# keeps the slots busy until the queue runs dry, then the rollout's own tail remains.

# %%
shares = []
for spec in [lengths, *other_lengths]:
    draw = workloads.parse(spec).draw(batch=prompts, seed=0)
    for slots in slot_counts:
        off, on = (rollouts.schedule(draw, slots, r) for r in ("off", "device"))
        shares.append(dict(lengths=spec, slots=slots, static=off.share, refill=on.share,
                           steps_ratio=off.steps / on.steps))
shares = pd.DataFrame(shares)
display(shares.pivot_table(index="slots", columns="lengths", values=["static", "refill"], sort=False).round(3))
fig, ax = plt.subplots(figsize=(7.2, 4.0), layout="constrained")
for i, spec in enumerate(shares.lengths.unique()):
    part = shares[shares.lengths == spec]
    ax.plot(part.slots, part.refill, marker="o", color=f"C{i}", label=f"{spec} refill")
    ax.plot(part.slots, part.static, marker="o", color=f"C{i}", linestyle="--", label=f"{spec} static")
ax.set_xscale("log", base=2)
ax.set_xticks(slot_counts, [str(s) for s in slot_counts])
ax.set_ylim(0, 1.02)
ax.set_xlabel("slots")
ax.set_ylabel("share of row-steps kept")
ax.legend(fontsize="x-small", ncol=2)
plot.caption(fig, f"{computed}. {prompts} prompts per rollout, lengths drawn with seed 0; solid refill, dashed "
                  "static batches.")
plt.show()

# %% [markdown]
# ## Predicted against measured time
# With the step's time at that slot count (the eos-off runner's seconds per step) and each run's measured
# prefill time per prefill, the schedule prices a rollout: steps x step + prefills x prefill. What it leaves
# out (setup, capture, the refill bookkeeping between steps, reading results back) is the gap to the wall time.

# %%
priced = []
for r in runs:
    cfg, by = r["config"], {s["runner"]: s for s in r["summary"]}
    if "eos-off" not in by:
        continue
    draw = workloads.parse(cfg["lengths"]).draw(batch=cfg["prompts"], seed=cfg["seed"])
    for runner, refill in (("static", "off"), ("host", "host"), ("device", "device")):
        s = by.get(runner)
        if not s or s["status"] != "ok":
            continue
        plan = rollouts.schedule(draw, cfg["slots"], refill, **shape(cfg, refill))
        seconds = rollouts.predict_s(plan, by["eos-off"]["step_s"], s["prefill_s"] / plan.prefills)
        priced.append(dict(slots=cfg["slots"], runner=runner, predicted_tok_s=plan.useful / seconds,
                           measured_tok_s=s["tok_s"], measured_over_predicted=s["tok_s"] * seconds / plan.useful))
display(pd.DataFrame(priced).sort_values("slots", kind="stable").round(3).reset_index(drop=True))
