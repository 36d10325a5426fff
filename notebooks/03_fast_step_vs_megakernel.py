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
# # One captured step against a hand-written megakernel
#
# At batch 1 a decode step of Llama-3.2-1B reads 2.47 GB of bf16 weights once; at the H200's
# ~4.2 TB/s copy bandwidth that is ~0.58 ms. A public H200 measurement puts plain CUDA graphs with
# programmatic dependent launch (PDL) over ~100 hand-written kernels at 794.7 µs per step and
# Hazy Research's single persistent megakernel at 759.8 µs (msaroufim/megakernels-vs-cuda-graphs,
# `llama/docs/RESULTS.md`; quoted, not measured here). How close does gdtool's captured step come
# with its own kernels (`kernels="fast"`: RMSNorm-fused persistent GEMVs, q/k/v + RoPE + cache write
# in one kernel, split-KV attention, two-stage argmax; `docs/fast.md`)?
#
# Everything below is read from `profiles/h200/decode-kernels/` (measured on one H200; commands and
# commits in its README) through `profiles/decode_kernels_tables.py`, which renders the same tables
# for `docs/fast.md`. Each caption opens with the models, the GPU and the commits of the files it draws.

# %% tags=["parameters"]
results = "h200/decode-kernels"   # under profiles/: the committed H200 results
model = "llama-1b"
# folders of profiles/h200/bench/ for the last sections (gemma-3-1b's others: its batch-1 run at 69c20df with the
# fused attention combine on, and its batch-64 run at c6bba88 with fused projections, each the fastest of that
# batch with peers in the same run; llama-1b/pdl-auto: its fast step at batch 1 with PDL per kernel at 69c20df,
# the fastest measured, a run without peers; llama-1b, llama-8b and qwen3-8b hold their fast step at batch 1 at
# a7748ba beside the gpt-fast-style step (llama-1b's at a74fd82, llama-8b's at 79cb9d0), and at batch 64 at 5260519
# (the split-KV runs: llama-1b's at 98b1af8, llama-8b's at fa2489e); qwen3-30b-a3b's batch 1 at 75ec5b5, no peer)
bench_presets = ["llama-1b", "llama-1b/pdl-auto", "llama-8b", "qwen3-8b", "gemma-3-1b",
                 "gemma-3-1b/fused-combine/pdl-auto-peers", "gemma-3-1b/fused-projections", "qwen3-30b-a3b",
                 "gpt-oss-20b", "gpt-oss-20b/fused-projections"]
# the GPUs whose committed bench runs (profiles/<gpu>/bench/<preset>/) and node traces (profiles/<gpu>/nsys-fast/)
# the last sections read, side by side
gpus = ["h200", "h100"]
# mixture-of-experts presets whose node traces (profiles/<gpu>/nsys-fast/<preset>-b<batch>-<commit>/fast/) the MoE
# section reads
moe_presets = ["qwen3-30b-a3b", "gpt-oss-20b"]
# node traces (folders under profiles/ holding fast/) held kernel by kernel to their floors: the newest of llama-1b,
# gemma-3-1b (prompt 4096: every window full) and qwen3-30b-a3b at batch 1 on the H200, llama-1b and gemma-3-1b at
# batch 64 (the compiled HF forward with cuBLAS's products) on the H100
floor_traces = ["h200/nsys-fast/llama-1b-b1-e4c1eba", "h200/nsys-fast/gemma-3-1b-b1-p4096-a7748ba",
                "h200/nsys-fast/qwen3-30b-a3b-b1-4d5ca74", "h100/nsys-fast/llama-1b-b64-fused-4bc4f5c",
                "h100/nsys-fast/gemma-3-1b-b64-fused-4bc4f5c"]
cpu = {}                           # nothing here runs a model: the same on a CPU
cpu_fallback = True

# %%
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

import gdtool
from gdtool.frontends import notebook, plot
from gdtool.measure import record

notebook.setup(dict(results=results, model=model, bench_presets=bench_presets, gpus=gpus, moe_presets=moe_presets,
                    floor_traces=floor_traces), cpu=cpu, cpu_fallback=cpu_fallback)
root = Path(gdtool.__file__).resolve().parent.parent
sys.path.insert(0, str(root / "profiles"))
import decode_kernels_tables as tables  # noqa: E402

data = tables.load(root / "profiles" / results)
env = pd.read_json(root / "profiles" / results / "run2" / "env.json", typ="series")
print("Measured on:", {k: env.get(k) for k in ("device_name", "driver", "torch", "transformers", "triton", "commit",
                                                "date", "copy_gb_s")})
where = plot.where(env, model)   # each caption opens with it: the model, the GPU and the commit of the run

# %% [markdown]
# ## The whole step
# ms per step of a 256-token greedy decode (prompt 128, EOS off), captured (step-graph) or inside
# one CUDA-graph WHILE node (device-loop), PDL off and on; beside it the anchor's two figures.

# %%
step = tables.step_table(data)
display(step)
fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
labels = [f"gdtool fast, {r['mode']}, PDL {'on' if r['pdl'] else 'off'}" for _, r in step.iterrows()]
values = list(step["ms_per_step"] * 1e3)
for name, us in tables.ANCHOR_US.items():
    labels.append(f"anchor: {name}")
    values.append(us)
ax.barh(labels, values, color=["tab:blue"] * len(step) + ["tab:gray"] * len(tables.ANCHOR_US))
ax.axvline(800, color="tab:red", linestyle="--", label="target 0.80 ms")
ax.set_xlabel("µs per step, llama-1b, batch 1")
ax.legend(loc="lower right")
ax.invert_yaxis()
plot.caption(fig, f"{where}. Blue: gdtool's kernels=\"fast\" step, one 256-token greedy decode of {model} at "
                  "batch 1 (prompt 128, EOS off), captured (step-graph) or in a WHILE node (device-loop), PDL off and "
                  "on. Grey: the anchor's published H200 figures, quoted, not measured here. Dashed red: the 0.80 ms "
                  "target.")
plt.show()

# %% [markdown]
# ## Per kernel, and the gaps between them
# Each kernel timed alone (a captured graph of back-to-back calls, so each figure includes one
# in-graph launch gap), times its calls per step; the last rows compare that sum with the whole
# step. PDL lets a kernel issue its weight loads before the previous kernel has finished: the
# difference between the two columns is what it wins back, per kernel.

# %%
off, on = tables.account(data, model, pdl=False), tables.account(data, model, pdl=True)
merged = off[["kernel", "calls", "us per step"]].merge(on[["kernel", "us per step"]], on="kernel",
                                                       suffixes=(" PDL off", " PDL on"))
display(merged)
parts = merged[merged["calls"] != ""]
fig, ax = plt.subplots(figsize=(8, 3.9), layout="constrained")
y = range(len(parts))
ax.barh([i - 0.2 for i in y], parts["us per step PDL off"], height=0.4, label="PDL off")
ax.barh([i + 0.2 for i in y], parts["us per step PDL on"], height=0.4, label="PDL on")
ax.set_yticks(list(y), parts["kernel"])
ax.invert_yaxis()
ax.set_xlabel("µs per step")
ax.legend()
plot.caption(fig, f"{where}. Each kernel of the {model} batch-1 step, timed alone (back to back in a captured graph, "
                  "so each figure includes one in-graph launch gap), times its calls per step; PDL off and on.")
plt.show()

# %% [markdown]
# ## Bandwidth per GEMV
# Batch 1, each projection alone: TB/s over its weight bytes, cuBLAS (`F.linear`, the matmul alone)
# against the Triton kernel as the step runs it (which also does the fused norm, RoPE, residual or
# SiLU), PDL off and on. The dashed line is the copy bandwidth measured in the same run.

# %%
gemv = tables.gemv_table(data)
display(gemv)
fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
names = [f"{m.replace('llama-', '')} {p}" for m, p in zip(gemv["model"], gemv["projection"])]
x = range(len(gemv))
for offset, column, label in ((-0.27, "cuBLAS TB/s", "cuBLAS"), (0.0, "triton TB/s", "Triton"),
                              (0.27, "+PDL TB/s", "Triton + PDL")):
    ax.bar([i + offset for i in x], gemv[column], width=0.27, label=label)
ax.axhline(float(env["copy_gb_s"]) / 1e3, color="k", linestyle="--", label="copy")
ax.set_xticks(list(x), names, rotation=30, ha="right")
ax.set_ylabel("TB/s")
ax.legend(ncol=4, fontsize=8)
plot.caption(fig, f"{plot.where(env, list(gemv['model'].unique()))}. "
                  "TB/s over each projection's weight bytes at batch 1: cuBLAS (F.linear, the matmul alone), "
                  "gdtool's Triton GEMV as the step runs it (with its fused norm, RoPE, residual or SiLU), and the "
                  "same with PDL. Dashed: the copy bandwidth measured in the same run.")
plt.show()

# %% [markdown]
# ## Attention over the live slots
# One layer's attention at batch 1: the packed SDPA `kernels="compiled"` runs (over all static slots,
# masked) against split-KV over the live ones only; and the argmax over the vocabulary.

# %%
display(tables.attention_table(data))

# %% [markdown]
# ## Reading
# The best step against the anchor's graph of hand-written kernels, and the projections' bandwidth
# (from the tables above):

# %%
best = step.sort_values("ms_per_step").iloc[0]
graph_anchor = tables.ANCHOR_US["CUDA graphs + PDL, ~100 hand-written kernels"]
print(f"best gdtool step: {best.ms_per_step * 1e3:.0f} µs ({best['mode']}, PDL {'on' if best.pdl else 'off'}), "
      f"{best.ms_per_step * 1e3 / graph_anchor:.2f}x the anchor's {graph_anchor} µs; target 800 µs")
mine = gemv[gemv.model == model].set_index("projection")["+PDL TB/s" if best.pdl else "triton TB/s"]
print("TB/s per projection as the best step runs them:", mine.round(2).to_dict())
# %% [markdown]
# The small projections (q/k/v and o, 8-13 MB each) stay far under the copy bandwidth while the
# large ones come near it: `docs/fast.md` lists the levers measured so far and the next ones.

# %% [markdown]
# ## Every preset beside its floor
# `python -m gdtool bench` (prompt 128, 256 new tokens, greedy, EOS off) against its peers in the same
# process, read from the committed runs under `profiles/<gpu>/bench/<preset>/` for each of `gpus`
# (`profiles/bench_table.py`). The floor is the bytes a step must read (weights once, the live KV cache) over the
# copy bandwidth measured in the same run. Per preset, batch and GPU: gdtool's fastest runner, the fastest peer
# measured in the same run (none where that run had no peer), and the floor; a preset run on two GPUs has a row
# for each, side by side.

# %%
import bench_table  # noqa: E402

paths = sorted(p for gpu in gpus for preset in bench_presets
               for p in (root / "profiles" / gpu / "bench" / preset).glob("*.json"))
runs = bench_table.frame(paths).assign(gpu=lambda d: d["gpu"].fillna("?"))
summary = bench_table.fastest(runs)   # the peer of the same run (JSON file) as gdtool's fastest runner
display(summary.round(3))
shown = runs.merge(summary.reset_index(), left_on=["model", "batch", "gpu", "runner", "ms_per_step"],
                   right_on=["model", "batch", "gpu", "gdtool, fastest", "ms/step"])   # the files of the bars drawn
bench_where = plot.where([record.read_sidecar(f) for f in dict.fromkeys(shown["file"])],
                         list(dict.fromkeys(summary.index.get_level_values("model"))))
print("GPUs with committed bench runs:", ", ".join(summary.index.get_level_values("gpu").unique()),
      f"(of the folders {', '.join(gpus)})")
fig, ax = plt.subplots(figsize=(8, 0.55 * len(summary) + 1.2), layout="constrained")
names = [f"{m}, batch {b}, {g.replace('NVIDIA ', '')} ({c})" for (m, b, g), c in zip(summary.index, summary["commit"])]
y = range(len(summary))
ax.barh([i - 0.2 for i in y], summary["ms/step"], height=0.4, color="tab:blue", label="gdtool, fastest runner")
ax.barh([i + 0.2 for i in y], summary["peer ms/step"], height=0.4, color="tab:gray",
        label="fastest peer (same run)")
ax.scatter(summary["floor ms/step"], list(y), color="tab:red", marker="|", s=400, zorder=3, label="floor")
ax.set_yticks(list(y), names)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlabel("ms per decode step (log scale)")
ax.legend(loc="lower right", fontsize="small")
plot.caption(fig, f"{bench_where}. Per preset, batch size and GPU, from the committed bench runs (commit in the label): "
                  "blue, gdtool's fastest runner (mode and kernels in the table); grey, the fastest peer measured in "
                  "the same process (generate() with a static cache and torch.compile, or the gpt-fast-style step); "
                  "red tick, the bytes-over-bandwidth floor of that step. Lower is faster.")
plt.show()

# %% [markdown]
# ## The batch curve, 1 to 64 rows
# The fast step (step-graph, fused projections, the same decode) of llama-1b, llama-8b and qwen3-8b at every batch
# measured, as the default line runs it: gdtool's matrix-vector kernels at one row (1-2 for llama-1b, hidden size
# 2048), past that the compiled HF forward with cuBLAS's products and gdtool's split-KV attention
# (`forward.MEASURED_LINES`; the files are listed in `profiles/h200/bench/batches/default-line.txt`, rendered with
# the runs behind the line in its `curves.md`). Tokens per second must rise with the batch: a fall is a cliff, the
# wrong path chosen at that batch.

# %%
curve_list = root / "profiles" / "h200" / "bench" / "batches" / "default-line.txt"
curves = pd.concat([bench_table.curve(bench_table.frame(files)) for files in bench_table.listed(curve_list).values()])
curves = curves[curves.runner == "gdtool step-graph+fast"]
display(curves[["model", "batch", "path", "tok_s", "ms_per_step", "ratio", "cliff"]].round(3))
fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
for name, g in curves.groupby("model", sort=False):
    line, = ax.plot(g.batch, g.tok_s, label=name)
    on_kernels = g.path == "fast: fast decode forward"
    ax.scatter(g.batch[on_kernels], g.tok_s[on_kernels], color=line.get_color(), marker="o", zorder=3)
    ax.scatter(g.batch[~on_kernels], g.tok_s[~on_kernels], color=line.get_color(), marker="s", zorder=3)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("batch (rows decoded per step)")
ax.set_ylabel("tokens per second")
ax.legend()
curve_where = plot.where([record.read_sidecar(f) for f in dict.fromkeys(curves["file"])], list(curves.model.unique()))
plot.caption(fig, f"{curve_where}. The fast step's tokens per second against the batch (committed bench runs): "
                  "circles, gdtool's matrix-vector kernels; squares, the compiled HF forward with cuBLAS's products. "
                  "Each curve should rise at every batch.")
plt.show()
print(f"{int(curves.cliff.sum())} cliff(s) in {len(curves)} points")

# %% [markdown]
# ## Each kernel against its own floor
# A node trace of the fast step, kernel by kernel (`profiles/kernel_breakdown.py`'s `floor_account`): each product
# matched to the weights it reads by its place in the launch, attention by the kind of layer with the live cache it
# reads, the experts kernels with the experts a step hits. A kernel's floor is its bytes over the copy bandwidth;
# what it takes above that ("over") is where the step's distance from its own floor goes. The bandwidth is the one
# measured beside the trace (`copy_gb_s.txt`, written by `gpu_run.sh OUT nsys-fast`) or, for a trace older than
# that, the one the bench run of the same preset, batch and GPU above measured (its floor tick).

# %%
import re  # noqa: E402

import kernel_breakdown  # noqa: E402

bench_file = {(r.model, r.batch, r.gpu): r.file for r in shown.itertuples()}
accounts, floor_env = [], []
for trace in floor_traces:
    folder = root / "profiles" / trace / "fast"
    export = next(folder.glob("*.sqlite.gz"))
    preset, batch, prompt, commit = kernel_breakdown.trace_folder(folder.parent)
    floor_env.append(record.read_sidecar(folder / "env.json"))
    gpu = floor_env[-1]["environment"]["device_name"]
    copy, bench = kernel_breakdown.trace_copy_gb_s(folder, bench_file.get((preset, batch, gpu)))
    source = f"the bench run {Path(bench).relative_to(root / 'profiles')}" if bench else "beside the trace"
    kernels, launches = kernel_breakdown.launch_kernels(export)
    account = kernel_breakdown.floor_account(kernels, launches, preset, batch, copy, prompt_len=prompt)
    print(f"{preset}, batch {batch}, {gpu.replace('NVIDIA ', '')}, commit {commit}: copy bandwidth "
          f"{copy:.0f} GB/s ({source}); kernels {account['own'].sum():.1f} µs a step, their floors "
          f"{account['floor'].sum():.1f} µs ({account['floor'].sum() / account['own'].sum():.0%}); most above their "
          "floors: " + ", ".join(f"{str(role).strip('`')} {over:.0f} µs"
                                 for role, over in account["over"].nlargest(3).items()))
    accounts.append(account.assign(trace=f"{preset}, batch {batch}, {gpu.replace('NVIDIA ', '')} ({commit})"))
if accounts:
    every = pd.concat(accounts).reset_index().set_index(["trace", "role"])
    display(every[["calls", "own", "mb", "floor", "over"]].round(1))
    across = min(3, len(accounts))
    down = -(-len(accounts) // across)
    fig, axes = plt.subplots(down, across, figsize=(5.5 * across, 4.2 * down), layout="constrained", squeeze=False)
    for ax in axes.flat[len(accounts):]:
        ax.set_visible(False)
    for ax, account in zip(axes.flat, accounts):
        top = account.head(8).iloc[::-1]
        labels = [str(role).strip("`") for role in top.index]
        within = top["floor"].clip(upper=top["own"]).fillna(0.0)   # faster than its floor: all green; none: 0
        ax.barh(labels, within, color="tab:green", label="up to its floor")
        ax.barh(labels, top["over"].clip(lower=0), left=within, color="tab:orange", label="above its floor")
        ax.set_title(account["trace"].iloc[0], fontsize="small")
        ax.set_xlabel("µs per decode step (own time)")
        ax.tick_params(axis="y", labelsize="small")
    axes[0][0].legend(loc="lower right", fontsize="small")
    plot.caption(fig, f"{plot.where(floor_env, [a['trace'].iloc[0].split(',')[0] for a in accounts])}. The eight "
                      "largest kernel roles of each traced step (node-level nsys trace, own time: each kernel from "
                      "where the ones before it ended), a bar its own time: green up to the role's floor (its bytes over "
                      "the copy bandwidth), orange above it. A role without bytes (norms, sampling, bookkeeping) is "
                      "all orange; one faster than the copy (a read counts once, a copy's bytes twice) all green.")
    plt.show()
else:
    print("no node traces listed in floor_traces")

# %% [markdown]
# ## Mixture of experts: where the step goes, per kernel class
# The fast step of each MoE preset, traced node by node (`gpu_run.sh OUT nsys-fast` with `NSYS_MODEL`,
# `NSYS_BATCH`), read through `profiles/kernel_breakdown.py`. With PDL a kernel starts, and waits, while the one
# before it runs, so durations overlap: each kernel counts from where the kernels before it ended ("own" time),
# and the classes sum to the time some kernel runs. The black tick is the floor of the bench run of the same preset
# and batch above (the bytes the step must read: of the experts, those its tokens hit on average).

# %%
traced, per_kernel, moe_env = [], [], []
for preset in moe_presets:
    for export in sorted(e for gpu in gpus
                         for e in (root / "profiles" / gpu / "nsys-fast").glob(f"{preset}-b*-*/fast/*.sqlite.gz")):
        moe_env.append(record.read_sidecar(export.parent / "env.json"))
        gpu = moe_env[-1].get("environment", {}).get("device_name", "?")
        kernels, launches = kernel_breakdown.launch_kernels(export)
        batch = kernel_breakdown.export_batch(export)
        experts_table = kernel_breakdown.experts_by_kernel(kernels, launches, preset, batch)
        commit = export.parent.parent.name.rsplit("-", 1)[-1]
        if experts_table is not None:
            per_kernel.append(experts_table.assign(preset=preset, batch=batch, gpu=gpu.replace("NVIDIA ", ""),
                                                   commit=commit).set_index(["preset", "batch", "gpu", "commit"],
                                                                            append=True))
        own = kernels.groupby("class")["own_us"].sum() / launches
        floor = summary["floor ms/step"].get((preset, batch, gpu), float("nan")) * 1e3
        traced.append(dict(preset=preset, batch=batch, gpu=gpu.replace("NVIDIA ", ""), commit=commit,
                           floor_us=floor, **{f"{cls} µs": us for cls, us in own.items()}))
moe = pd.DataFrame(traced)
if moe.empty:
    print(f"no MoE node traces committed under profiles/<gpu>/nsys-fast/ for the GPUs {', '.join(gpus)}")
else:
    moe = moe.set_index(["preset", "batch", "gpu"]).fillna(0.0)
    classes = [c for c in moe.columns if c.endswith(" µs")]
    moe["step µs"] = moe[classes].sum(axis=1)
    moe["x floor"] = moe["step µs"] / moe["floor_us"]
    display(moe.round(1))
    fig, ax = plt.subplots(figsize=(9, 0.7 * len(moe) + 1.8), layout="constrained")
    left = [0.0] * len(moe)
    for cls in classes:
        ax.barh(range(len(moe)), moe[cls], left=left, label=cls.removesuffix(" µs"))
        left = [a + b for a, b in zip(left, moe[cls])]
    ax.scatter(moe["floor_us"], range(len(moe)), color="black", marker="|", s=400, zorder=3, label="floor")
    ax.set_yticks(range(len(moe)), [f"{p}, batch {b}, {g} ({c})" for (p, b, g), c in zip(moe.index, moe["commit"])])
    ax.invert_yaxis()
    ax.set_xlabel("µs per decode step (own time per kernel class)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    plot.caption(fig, f"{plot.where(moe_env, list(moe.index.get_level_values('preset').unique()))}. "
                      "Per MoE preset, batch and GPU, the fast step's GPU time by kernel class from a node-level nsys trace "
                      "(commit in the label): each kernel from where the ones before it ended, so the bars sum to the "
                      "time some kernel runs. Black tick: the bytes-over-bandwidth floor of that preset's bench run.")
    plt.show()

# %% [markdown]
# The experts kernels of the same traces one by one: own time per call, and for the two that stream expert
# weights (gate/up, down) the bytes a call reads (of the stacked tensor, the experts a step of that batch hits on
# average, as the floor counts them) over that time, beside the H200's ~4.3 TB/s copy bandwidth.

# %%
if per_kernel:
    display(pd.concat(per_kernel).reorder_levels(["preset", "batch", "gpu", "commit", "name"])
            [["calls", "own", "us_per_call", "mb_per_call", "tb_s"]].round(2))

# %% [markdown]
# Per kernel, one qwen3-30b-a3b MoE block alone under Nsight Compute (`gpu_run.sh OUT ncu-experts`: the small
# kernels at 1 token, the grouped ones at 64; each kernel serialized, its caches flushed, so durations are
# longer than inside the step): the DRAM throughput each reaches against the H200's peak, and the occupancy
# that bounds how many loads an SM keeps in flight.

# %%
ncu_rows = []
for details in sorted((root / "profiles" / "h200").glob("ncu-experts-*/*-details.csv")):
    raw = pd.read_csv(details)
    wanted = {"Duration": "µs", "DRAM Throughput": "DRAM % of peak", "Memory Throughput": "memory",
              "Achieved Occupancy": "occupancy %", "Registers Per Thread": "registers", "Grid Size": "programs"}
    raw = raw[raw["Metric Name"].isin(wanted)]
    for (kid, name), metrics in raw.groupby(["ID", "Kernel Name"], sort=False):
        row = {"run": details.name.removesuffix("-details.csv"), "commit": details.parent.name.rsplit("-", 1)[-1],
               "kernel": name}
        for _, m in metrics.iterrows():
            value = str(m["Metric Value"]).replace(",", "")
            row[wanted[m["Metric Name"]]] = (f"{value} {m['Metric Unit']}" if m["Metric Name"] == "Memory Throughput"
                                             else float(value))
        ncu_rows.append(row)
if ncu_rows:
    ncu = pd.DataFrame(ncu_rows).drop_duplicates(["run", "commit", "kernel"]).set_index(["run", "commit", "kernel"])
    display(ncu)
else:
    print("no Nsight Compute details committed under profiles/h200/ncu-experts-*/")

# %% [markdown]
# ## Sliding windows: attention per kind of layer, by prompt length
# Gemma 3's fast step traced node by node (`gpu_run.sh OUT nsys-fast`; `NSYS_PROMPT=1024` or 4096 for a prompt whose
# sliding windows are all full), its attention kernels split by the kind of layer each served
# (`kernel_breakdown.attention_by_layer_type`: 22 sliding-window layers, 4 full ones). A sliding layer attends over
# its window only, so its time should stay flat as the prompt grows; a full layer's grows with the live length.
# Once a window is full, HF's cache layout rolls it left by one each step (`gdtool/kernels/window.py`): the roll
# column is that kernel's own time per sliding layer (none at prompt 128, where no window fills). The row marked
# "fused combine" ran with GDTOOL_FUSED_COMBINE=1 at 39ace1a (the combine in the split kernel's last program, its
# G heads one after another): slower. Its one-load form is the default since 48ede74 (`docs/fast.md`).
# At prompt 4096 the full layers' combine read 259 chunks' partials as one tile and spilled (14cc799: 92 µs a
# full layer); since 8104acb it reads them a block of chunks at a time, 64 outputs a program (12ffb80).

# %%
exports = [e for gpu in gpus for e in sorted((root / "profiles" / gpu).glob("nsys-gemma-fast-*/fast/*.sqlite.gz"))
           + sorted((root / "profiles" / gpu).glob("nsys-fast/gemma-3-1b-b*-*/fast/*.sqlite.gz"))]
types = kernel_breakdown.layer_types("gemma-3-1b")
per_kind, window_env = [], []
for export in exports:
    kernels, launches = kernel_breakdown.launch_kernels(export)
    table = kernel_breakdown.attention_by_layer_type(kernels, launches, types)
    if table is None:
        continue
    window_env.append(record.read_sidecar(export.parent / "env.json"))
    folder = export.parent.parent.name
    prompt = re.search(r"-p(\d+)-", folder)
    sliding = int((pd.Series(types) == "sliding_attention").sum())
    roll = kernels.loc[kernels["name"].fillna("").str.contains("roll_left"), "own_us"].sum() / launches
    gpu = window_env[-1].get("environment", {}).get("device_name", "?").replace("NVIDIA ", "")
    per_kind.append(dict(gpu=gpu, batch=kernel_breakdown.export_batch(export),
                         prompt=int(prompt.group(1)) if prompt else 128,
                         commit=folder.rsplit("-", 1)[-1] + (", fused combine" if "fused-combine" in folder else ""),
                         step_us=kernels["own_us"].sum() / launches,
                         **{f"{kind} µs/layer": row["per_layer"] for kind, row in table.iterrows()},
                         **{"roll µs/sliding layer": roll / sliding}))
windows = pd.DataFrame(per_kind)
if windows.empty:
    print(f"no Gemma 3 node traces committed under profiles/<gpu>/ for the GPUs {', '.join(gpus)}")
else:
    windows = windows.set_index(["gpu", "batch", "prompt", "commit"]).sort_index()
    display(windows.round(2))
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(windows) + 1.5), layout="constrained")
    kinds = [c for c in windows.columns if c.endswith("attention µs/layer")]
    y = range(len(windows))
    for j, kind in enumerate(kinds):
        ax.barh([i + 0.4 * j - 0.2 for i in y], windows[kind], height=0.4, label=kind.removesuffix(" µs/layer"))
        if kind.startswith("sliding"):  # the roll stacked on the sliding layers' attention
            ax.barh([i + 0.4 * j - 0.2 for i in y], windows["roll µs/sliding layer"], left=windows[kind], height=0.4,
                    color="tab:red", label="roll of a full window")
    ax.set_yticks(list(y), [f"{g}, batch {b}, prompt {p} ({c})" for g, b, p, c in windows.index])
    ax.invert_yaxis()
    ax.set_xlabel("attention µs per layer (own time)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    plot.caption(fig, f"{plot.where(window_env, 'gemma-3-1b')}. Gemma 3's fast step from node-level nsys traces "
                      "(commit in the label): the attention kernels' time per layer, sliding-window layers apart from "
                      "full ones, at each committed prompt length; red, the roll of a full window per sliding layer.")
    plt.show()
