"""Where a captured step's GPU time goes, kernel by kernel, from an nsys node-trace export.

    python profiles/kernel_breakdown.py EXPORT.sqlite.gz --model llama-1b [--out breakdown.md]

Reads the last `decode` range of the export, the kernels of every graph launch made inside it (joined
to the launch by correlation id, so it needs `--cuda-graph-trace=node`), and prints per decode step:
time and count per kernel class (matmul: cuBLAS/CUTLASS GEMM and GEMV; attention; Triton (inductor's
fused kernels); gdtool's MoE experts kernels; other) and the kernels that take the most time. With `--model`
(a preset), the matmul class's bandwidth: the bytes of the model's linear weights in bfloat16 over its matmul
time per step; and the bytes a step must read at the export's batch (`roofline.step_bytes`: of a mixture of
experts, the stacked expert tensors its tokens hit on average) over the whole busy time, and each experts kernel's
time per call and bandwidth over the expert bytes it reads; of a model whose layers differ in their attention
(sliding window or full), the attention's time per kind of layer.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdtool.core import ranges  # noqa: E402
from gdtool.measure.nsys import export  # noqa: E402

CLASSES = (("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
           ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
           ("triton", ("triton",)))


# gdtool's MoE kernels (gdtool/kernels/experts/), by their exact names: "_combine_kernel" is also the tail of
# the attention's combine, and none of them says gemm or gemv
EXPERTS = ("_router_kernel", "_gate_up_kernel", "_down_kernel", "_route_kernel", "_align_kernel",
           "_grouped_gate_up_kernel", "_grouped_down_kernel", "_combine_kernel", "_oss_gate_up_kernel",
           "_oss_down_kernel")


def kernel_class(name: str) -> str:
    if name in EXPERTS:
        return "experts"
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def launch_kernels(path) -> tuple[pd.DataFrame, int]:
    """Kernels of the graph launches inside the last `decode` range, and how many launches that was."""
    with export._connect(path) as con:
        spans = export._ranges(con, ranges.DOMAIN)
        decode = spans[spans["name"] == ranges.DECODE]
        if decode.empty:
            raise ValueError(f"{path} has no '{ranges.DECODE}' range: record with gdtool's NVTX ranges on")
        last = decode.sort_values("start").iloc[-1]
        runtime = export._runtime(con)
        launches = runtime[runtime["name"].str.startswith("cudaGraphLaunch") & (runtime["start"] >= last["start"])
                           & (runtime["end"] <= last["end"]) & (runtime["tid"] == last["tid"])]
        cols = export._columns(con, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_col = "shortName" if "shortName" in cols else "demangledName"
        kernels = pd.read_sql_query(
            f"select k.start as start, k.\"end\" as end, k.correlationId as corr, s.value as name "
            f"from CUPTI_ACTIVITY_KIND_KERNEL k left join StringIds s on s.id = k.{name_col}", con)
    kernels = kernels[kernels["corr"].isin(set(launches["corr"]))].copy()
    if kernels.empty:
        raise ValueError(f"{path}: no kernel records of the last decode's graph launches; record with "
                         "--cuda-graph-trace=node (a graph-level trace has one record per launch)")
    kernels["us"] = (kernels["end"] - kernels["start"]) / 1e3
    kernels["class"] = kernels["name"].fillna("?").map(kernel_class)
    kernels = kernels.sort_values(["corr", "start"])
    # a kernel's own time: from where the kernels before it in the launch have all ended (PDL lets a kernel
    # start, and wait, while the one before runs: its whole duration counts that wait) to its end
    ended = kernels.groupby("corr")["end"].transform(lambda e: e.cummax().shift(1))
    kernels["own_us"] = ((kernels["end"] - kernels["start"].where(ended.isna() | (kernels["start"] >= ended), ended))
                         .clip(lower=0) / 1e3)
    return kernels, len(launches)


@functools.lru_cache(maxsize=None)
def _meta_model(model: str):
    """Preset `model` built on the meta device in bfloat16: shapes, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from gdtool.core.models import preset_config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(preset_config(model)).to(torch.bfloat16)


def linear_weight_bytes(model: str, itemsize: int = 2) -> int:
    import torch
    m = _meta_model(model)
    seen = set()
    total = 0
    for module in m.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * itemsize
    return total


def step_weight_bytes(model: str, batch: int) -> int:
    """The weight bytes one decode step of preset `model` at `batch` rows reads (bf16), as the bench counts
    them (`gdtool.measure.roofline.step_bytes`): built on the meta device."""
    from gdtool.measure.roofline import step_bytes
    return step_bytes(_meta_model(model), batch, 0, 0)["weight_bytes"]


# the stacked expert tensor each of gdtool's experts kernels streams (the others read no expert weights)
EXPERT_TENSORS = {"_gate_up_kernel": "gate_up_proj", "_grouped_gate_up_kernel": "gate_up_proj",
                  "_oss_gate_up_kernel": "gate_up_proj", "_down_kernel": "down_proj",
                  "_grouped_down_kernel": "down_proj", "_oss_down_kernel": "down_proj"}


def experts_by_kernel(kernels: pd.DataFrame, launches: int, model: str, batch: int) -> pd.DataFrame | None:
    """gdtool's experts kernels, one row each: calls and own µs per launch, µs per call, and for the gate/up and
    down kernels the bytes a call reads (bf16; of the stacked tensor, the share of experts a step of `batch`
    tokens hits on average, `roofline.expert_hit_share`, as the bench's floor counts them) and the bandwidth that
    makes over the call's own time. None without experts kernels or an experts module in the preset."""
    from gdtool.core.feed import experts_modules
    from gdtool.measure.roofline import expert_hit_share
    experts = kernels[kernels["class"] == "experts"]
    modules = experts_modules(_meta_model(model))
    if experts.empty or not modules:
        return None
    hit = expert_hit_share(modules[0], batch)
    table = experts.groupby("name").agg(own=("own_us", "sum"), calls=("us", "count")).div(launches)
    table["us_per_call"] = table["own"] / table["calls"]
    tensors = dict(modules[0].named_parameters())
    table["mb_per_call"] = [tensors[EXPERT_TENSORS[n]].numel() * 2 * hit / 1e6 if n in EXPERT_TENSORS and hit
                            else float("nan") for n in table.index]
    table["tb_s"] = table["mb_per_call"] / table["us_per_call"]   # MB / µs = TB/s
    return table.sort_values("own", ascending=False)


def layer_types(model: str) -> list[str] | None:
    """Preset `model`'s attention kind per decoder layer (its config's `layer_types`), or None without one."""
    from gdtool.core.models import preset_config
    return getattr(preset_config(model).get_text_config(), "layer_types", None)


def attention_by_layer_type(kernels: pd.DataFrame, launches: int, types: list[str]) -> pd.DataFrame | None:
    """Own time of the attention class per launch, split by the kind of layer each kernel served.

    Within a launch the attention kernels run layer by layer, the same number per layer: kernel i serves
    layer i // (count / layers). None where a launch's count is not a multiple of the layers (the kernels
    cannot be assigned) or the launches differ in their counts."""
    attn = kernels[kernels["class"] == "attention"].sort_values(["corr", "start"])
    counts = attn.groupby("corr").size()
    if attn.empty or counts.nunique() != 1 or counts.iloc[0] % len(types):
        return None
    per_layer = counts.iloc[0] // len(types)
    index = attn.groupby("corr").cumcount() // per_layer
    kinds = pd.Series(types).reindex(index.to_numpy()).to_numpy()
    table = attn.assign(kind=kinds).groupby("kind")["own_us"].sum().div(launches).to_frame("own")
    table["layers"] = pd.Series(types).value_counts()
    table["per_layer"] = table["own"] / table["layers"]
    return table


def export_batch(path) -> int | None:
    """The batch in a `gdtool profile --nsys` export's name (`<model>_b<batch>_<mode>_...`), or None."""
    import re
    found = re.search(r"_b(\d+)_", Path(path).name)
    return int(found.group(1)) if found else None


def breakdown(path, model: str | None = None, top: int = 12) -> str:
    kernels, launches = launch_kernels(path)
    per_step = kernels.groupby("class")["us"].agg(["sum", "count"]) / launches
    per_step["own"] = kernels.groupby("class")["own_us"].sum() / launches
    total, own = per_step["sum"].sum(), per_step["own"].sum()
    per_step["share"] = per_step["own"] / own
    span = float((kernels.groupby("corr")["end"].max() - kernels.groupby("corr")["start"].min()).mean() / 1e3)
    lines = [f"## {Path(path).name}", "",
             f"{launches} graph launches in the last decode; GPU busy {total:.1f} µs per launch, "
             f"{kernels.groupby('corr').size().median():.0f} kernels per launch; first kernel's start to last one's "
             f"end {span:.1f} µs, of which some kernel runs {own:.1f}."]
    if total > 1.02 * own:
        lines.append(f"Kernels overlap (PDL: a kernel starts, and waits, while the one before runs): their durations "
                     f"sum to {total / own:.2f}x the time some kernel runs. The 'own' columns count each kernel from "
                     "where the kernels before it have ended, and sum to that time.")
    lines += ["", "| class | own µs per launch | µs per launch (durations) | kernels per launch | share (own) |",
              "|---|---:|---:|---:|---:|"]
    for cls, row in per_step.sort_values("own", ascending=False).iterrows():
        lines.append(f"| {cls} | {row['own']:.1f} | {row['sum']:.1f} | {row['count']:.0f} | {row['share']:.1%} |")
    if model:
        nbytes = linear_weight_bytes(model)
        mm = per_step["own"].get("matmul", float("nan"))
        lines += ["", f"{model}: linear weights {nbytes / 1e9:.3f} GB (bfloat16) read by the matmul class in "
                      f"{mm:.1f} µs (own) per launch: {nbytes / (mm * 1e-6) / 1e12:.2f} TB/s."]
        batch = export_batch(path)
        if batch is not None:
            step = step_weight_bytes(model, batch)
            lines.append(f"Weights a step reads at batch {batch} (the bench's count: of the experts, those its tokens "
                         f"hit on average): {step / 1e9:.3f} GB, over the time some kernel runs: "
                         f"{step / (own * 1e-6) / 1e12:.2f} TB/s.")
            table = experts_by_kernel(kernels, launches, model, batch)
            if table is not None:
                lines += ["", f"Experts kernels (bytes: of each stacked tensor, the experts a step of batch {batch} hits on "
                              "average):", "",
                          "| kernel | calls per launch | own µs per launch | µs per call | MB per call | TB/s |",
                          "|---|---:|---:|---:|---:|---:|"]
                for name, row in table.iterrows():
                    mb, tbs = (("-", "-") if pd.isna(row["mb_per_call"])
                               else (f"{row['mb_per_call']:.1f}", f"{row['tb_s']:.2f}"))
                    lines.append(f"| `{name}` | {row['calls']:.0f} | {row['own']:.1f} | {row['us_per_call']:.2f} | "
                                 f"{mb} | {tbs} |")
        types = layer_types(model)
        table = attention_by_layer_type(kernels, launches, types) if types else None
        if table is not None and len(table) > 1:
            lines += ["", "Attention by the kind of layer it served (own µs per launch):", "",
                      "| layers | count | own µs per launch | per layer |", "|---|---:|---:|---:|"]
            for kind, row in table.iterrows():
                lines.append(f"| {kind} | {row['layers']:.0f} | {row['own']:.1f} | {row['per_layer']:.2f} |")
    by_name = kernels.groupby(["class", "name"]).agg(sum=("own_us", "sum"), count=("us", "count"),
                                                     mean=("us", "mean")).reset_index()
    by_name["sum"] /= launches
    by_name["count"] /= launches
    lines += ["", f"Top {top} kernels by own time per launch:", "",
              "| class | kernel | own µs per launch | per launch | mean µs (duration) |", "|---|---|---:|---:|---:|"]
    for row in by_name.sort_values("sum", ascending=False).head(top).itertuples():
        lines.append(f"| {row[1]} | `{str(row.name)[:70]}` | {row.sum:.1f} | {row.count:.0f} | {row.mean:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exports", nargs="+")
    p.add_argument("--model", help="preset whose linear weights the matmuls read (for the bandwidth line)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    text = "\n".join(breakdown(path, args.model, args.top) for path in args.exports)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
