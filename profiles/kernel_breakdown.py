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


# the weights each call of gdtool's fast products reads, in launch order (gdtool/kernels/forward.py): per layer
# one qkv_rope (q, k, v), then rms_gemv for o and, with a dense MLP, for gate/up and for down; the lm_head last
QKV, RMS = "_qkv_rope_gemv_kernel", "_rms_gemv_kernel"


def _nbytes(*linears) -> int:
    return sum(p.numel() * 2 for lin in linears for p in (lin.weight, lin.bias) if p is not None)   # bfloat16


def fast_calls(model: str) -> dict[str, list[tuple[str, int]]]:
    """Preset `model`'s fast product kernels: for each kernel name, (role, bytes read) of its calls in a step's
    launch order. An MoE block's experts run in their own kernels (`experts_by_kernel`), not here."""
    m = _meta_model(model)
    calls = {QKV: [], RMS: []}
    for block in m.model.layers:
        attn, mlp = block.self_attn, block.mlp
        calls[QKV].append(("q/k/v + RoPE", _nbytes(attn.q_proj, attn.k_proj, attn.v_proj)))
        calls[RMS].append(("o", _nbytes(attn.o_proj)))
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            calls[RMS] += [("gate/up", _nbytes(mlp.gate_proj, mlp.up_proj)), ("down", _nbytes(mlp.down_proj))]
    calls[RMS].append(("lm_head", _nbytes(m.lm_head)))
    return calls


# cuBLAS kernels of the compiled HF forward that are no weight's product: a split-K product's reduction (counted
# with the product before it) and the RoPE angles (inv_freq times the positions, an outer product of K = 1)
SPLIT_K, NOT_PRODUCTS = "splitKreduce", ("splitKreduce", "gemmk1")


# inductor's fused kernels of the compiled forward, named by what their names say they compute (the first match)
INDUCTOR_ROLES = (("rsqrt", "RMSNorm (inductor)"), ("argmax", "argmax (inductor)"),
                  ("silu", "activation x up (inductor)"), ("gelu", "activation x up (inductor)"),
                  ("cos", "RoPE (inductor)"), ("index_copy", "cache write (inductor)"))


def inductor_role(name: str) -> str | None:
    """What an inductor kernel (`triton_<kind>_fused_<ops>_<n>`) computes, by the ops in its name, or None."""
    if not name.startswith("triton_"):
        return None
    return next((what for op, what in INDUCTOR_ROLES if op in name), None)


def compiled_calls(model: str, fused: bool) -> list[tuple[str, int]]:
    """The weight products of preset `model`'s compiled HF forward (what the fast step runs past its own forward's
    batches: cuBLAS's matmuls), (role, bytes read) in launch order: per layer q/k/v (one product fused, else three),
    o, and with a dense MLP gate/up (one fused, else two) and down; the lm_head last."""
    m = _meta_model(model)
    calls = []
    for block in m.model.layers:
        attn, mlp = block.self_attn, block.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        calls += [("q/k/v", _nbytes(*qkv))] if fused else [(n, _nbytes(lin)) for n, lin in zip("qkv", qkv)]
        calls.append(("o", _nbytes(attn.o_proj)))
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            calls += ([("gate/up", _nbytes(mlp.gate_proj, mlp.up_proj))] if fused else
                      [("gate", _nbytes(mlp.gate_proj)), ("up", _nbytes(mlp.up_proj))])
            calls.append(("down", _nbytes(mlp.down_proj)))
    calls.append(("lm_head", _nbytes(m.lm_head)))
    return calls


def _match_compiled(kernels: pd.DataFrame, model: str, role: pd.Series, mb: pd.Series) -> pd.Series | None:
    """Where the matmul kernels are the compiled forward's products (`compiled_calls`, fused or not: the plan whose
    length a launch's product count matches, in every launch), give each its role and bytes in `role` and `mb`, a
    split-K reduction its product's role and no bytes of its own; return each kernel's layer (-1 before the first
    q/k/v product), else None. `kernels` sorted by launch and start."""
    mm = kernels[(kernels["class"] == "matmul") & (role == kernels["name"])]
    products = mm[~mm["name"].str.contains("|".join(NOT_PRODUCTS))]
    counts = products.groupby("corr").size()
    if products.empty or counts.nunique() != 1:
        return None
    plan = next((p for p in (compiled_calls(model, True), compiled_calls(model, False)) if len(p) == counts.iloc[0]),
                None)
    if plan is None:
        return None
    index = products.groupby("corr").cumcount().to_numpy()
    role[products.index] = [plan[i][0] for i in index]
    mb[products.index] = [plan[i][1] / 1e6 for i in index]
    first = plan[0][0]
    starts = pd.Series(0, index=kernels.index)
    starts[products.index[role[products.index] == first]] = 1
    layer = starts.groupby(kernels["corr"]).cumsum() - 1
    last = role.where(kernels.index.isin(products.index)).groupby(kernels["corr"]).ffill()
    split = kernels["name"].str.contains(SPLIT_K) & last.notna()
    role[split], mb[split] = last[split], 0.0
    return layer


def attention_bytes(model: str, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Key/value bytes (bf16) the attention of each kind of layer reads per step, summed over its layers, on average
    over a decode of `new_tokens` after a `prompt_len` prompt: step j (1..new_tokens-1) reads prompt_len + j slots, a
    sliding layer at most its window (as `roofline.step_bytes` counts the cache, windows apart)."""
    from gdtool.core.models import preset_config
    cfg = preset_config(model).get_text_config()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    steps = range(1, max(2, new_tokens))
    out: dict[str, float] = {}
    for kind in types:
        window = getattr(cfg, "sliding_window", None) if kind == "sliding_attention" else None
        live = sum(min(window or prompt_len + j, prompt_len + j) for j in steps) / len(steps)
        out[kind] = out.get(kind, 0.0) + 2 * kv_heads * head_dim * live * batch * 2
    return out


def floor_account(kernels: pd.DataFrame, launches: int, model: str, batch: int, copy_gb_s: float,
                  prompt_len: int | None = None, new_tokens: int = 48) -> pd.DataFrame:
    """Each kernel's own time per step against its own floor: the bytes it must read (weights once, the live
    cache for attention, of the experts those a step hits on average) over the copy bandwidth. One row a role:
    the fast products by the weight each call reads (`fast_calls`; where a launch's calls of a kernel do not
    match the plan, that kernel is one row without bytes), past gdtool's forward cuBLAS's products by the same
    (`compiled_calls`), attention by the kind of layer (with `prompt_len`),
    the experts kernels by name, every other kernel by name without bytes. Columns: calls, own (µs per step),
    mb (per step), floor (µs), over (own - floor); sorted by own time, largest first."""
    kernels = kernels.sort_values(["corr", "start"])
    role = kernels["name"].fillna("?").astype(object).copy()
    mb = pd.Series(float("nan"), index=kernels.index)
    for name, plan in fast_calls(model).items():
        mine = kernels[kernels["name"] == name]
        if mine.empty or not (mine.groupby("corr").size() == len(plan)).all():
            continue
        index = mine.groupby("corr").cumcount().to_numpy()
        role[mine.index] = [plan[i][0] for i in index]
        mb[mine.index] = [plan[i][1] / 1e6 for i in index]
    layer = _match_compiled(kernels, model, role, mb)
    attn = kernels[kernels["class"] == "attention"]
    types = layer_types(model)
    counts = attn.groupby("corr").size()
    if not attn.empty and layer is not None and (layer[attn.index] >= 0).all():
        # past gdtool's own forward: each attention kernel serves the layer of the q/k/v product before it
        kinds = types or ["full_attention"] * (int(layer.max()) + 1)
        names = [kinds[i] for i in layer[attn.index]]
        role[attn.index] = [f"attention, {k.replace('_attention', '')} layers" for k in names]
        if prompt_len is not None:
            total = attention_bytes(model, batch, prompt_len, new_tokens)
            calls = pd.Series(names).value_counts() / launches
            mb[attn.index] = [total[k] / 1e6 / calls[k] for k in names]
    elif not attn.empty and counts.nunique() == 1:
        kinds = types or ["full_attention"]
        if counts.iloc[0] % len(kinds) == 0 or not types:
            per_layer = counts.iloc[0] // len(kinds) if types else counts.iloc[0]
            which = (attn.groupby("corr").cumcount() // per_layer).to_numpy() if types else [0] * len(attn)
            names = [kinds[i] for i in which]
            role[attn.index] = [f"attention, {k.replace('_attention', '')} layers" for k in names]
            if prompt_len is not None:
                total = attention_bytes(model, batch, prompt_len, new_tokens)
                calls = pd.Series(names).value_counts() / launches   # kernels per step serving each kind
                mb[attn.index] = [total[k] / 1e6 / calls[k] for k in names]
    experts = kernels[kernels["class"] == "experts"]
    if not experts.empty:
        table = experts_by_kernel(kernels, launches, model, batch)
        if table is not None:
            mb[experts.index] = experts["name"].map(table["mb_per_call"]).to_numpy()
    named = role == kernels["name"].fillna("?")
    guess = kernels.loc[named, "name"].fillna("?").map(inductor_role).dropna()
    role[guess.index] = guess
    # a role that is still the kernel's own name is shown as code
    role = role.where(role != kernels["name"].fillna("?"), "`" + role.str.slice(0, 60) + "`")
    frame = pd.DataFrame({"role": role, "own": kernels["own_us"], "mb": mb})
    table = frame.groupby("role", sort=False).agg(calls=("own", "size"), own=("own", "sum"),
                                                  mb=("mb", lambda v: v.sum(min_count=len(v))))
    table[["calls", "own", "mb"]] = table[["calls", "own", "mb"]].div(launches)
    table["floor"] = table["mb"] / copy_gb_s * 1e3   # MB / (GB/s) = ms; in µs
    table["over"] = table["own"] - table["floor"].fillna(0.0)
    return table.sort_values("own", ascending=False)


def floor_lines(table: pd.DataFrame, copy_gb_s: float, top: int) -> list[str]:
    def fmt(value) -> str:
        return "-" if pd.isna(value) else f"{value:.1f}"

    own, floor = table["own"].sum(), table["floor"].sum()
    lines = ["", f"Each kernel against its own floor (its bytes over the copy bandwidth, {copy_gb_s:.0f} GB/s): the "
                 f"step's kernels run {own:.1f} µs where their floors sum to {floor:.1f}: {floor / own:.1%} of the floor. "
                 f"'over' (own minus floor) says where the {own - floor:.1f} µs above it go:", "",
             "| kernel's role | calls per launch | own µs per launch | MB per launch | floor µs | of its floor | "
             "over µs |", "|---|---:|---:|---:|---:|---:|---:|"]
    shown = table.head(top)
    for role, row in shown.iterrows():
        known = not pd.isna(row["floor"])
        lines.append(f"| {role} | {row['calls']:.0f} | {row['own']:.1f} | "
                     f"{row['mb']:.1f} | {row['floor']:.1f} | {row['floor'] / row['own']:.0%} | {row['over']:.1f} |"
                     if known else
                     f"| {role} | {row['calls']:.0f} | {row['own']:.1f} | - | - | - | {row['over']:.1f} |")
    rest = table.iloc[top:]
    if len(rest):
        lines.append(f"| {len(rest)} more, each under {rest['own'].max():.1f} µs | {rest['calls'].sum():.0f} | "
                     f"{rest['own'].sum():.1f} | - | {fmt(rest['floor'].sum(min_count=1))} | - | {rest['over'].sum():.1f} |")
    return lines


def trace_folder(folder) -> tuple[str, int, int, str]:
    """(preset, batch, prompt length, commit) of an `nsys-fast` folder's name,
    <preset>-b<batch>[-p<prompt>][-fused]-<commit> (prompt 128 where the name gives none: the part's default; -fused:
    the projections fused, NSYS_FUSED)."""
    import re
    name = Path(folder).name
    found = re.fullmatch(r"(.+)-b(\d+)(?:-p(\d+))?(?:-fused)?-([0-9a-f]{7})", name)
    if not found:
        raise ValueError(f"{name}: not an nsys-fast folder's name (<preset>-b<batch>[-p<prompt>][-fused]-<commit>)")
    return found.group(1), int(found.group(2)), int(found.group(3) or 128), found.group(4)


def trace_copy_gb_s(folder, bench=None) -> tuple[float, str | None]:
    """The copy bandwidth (GB/s) to hold the kernels of the export in `folder` to, and the bench JSON it came from:
    copy_gb_s.txt beside the export (nsys-fast measures it in the same part; None for the file), else `bench`'s, a
    bench run of the same preset, batch and GPU."""
    beside = Path(folder) / "copy_gb_s.txt"
    if beside.exists():
        return float(beside.read_text()), None
    if bench is None:
        raise ValueError(f"{folder}: no copy_gb_s.txt beside the trace; name a bench run of the same preset, batch and "
                         "GPU for its copy bandwidth")
    import json
    return float(json.loads(Path(bench).read_text())["environment"]["copy_gb_s"]), str(bench)


def export_batch(path) -> int | None:
    """The batch in a `gdtool profile --nsys` export's name (`<model>_b<batch>_<mode>_...`), or None."""
    import re
    found = re.search(r"_b(\d+)_", Path(path).name)
    return int(found.group(1)) if found else None


def breakdown(path, model: str | None = None, top: int = 12, copy_gb_s: float | None = None,
              prompt_len: int | None = None, new_tokens: int = 48) -> str:
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
        if batch is not None and copy_gb_s:
            lines += floor_lines(floor_account(kernels, launches, model, batch, copy_gb_s, prompt_len, new_tokens),
                                 copy_gb_s, top)
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
    p.add_argument("--copy-gb-s", type=float, help="the device's copy bandwidth in GB/s, read + written, measured in "
                   "the same session (`gdtool.measure.roofline.copy_bandwidth`): with --model, each kernel against "
                   "its own floor")
    p.add_argument("--prompt-len", type=int, help="the profiled prompt's length: the attention's floor (the live "
                   "cache it reads)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens the profiled decode made (default 48)")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    if args.copy_gb_s and not args.model:
        p.error("--copy-gb-s needs --model: the floors come from the preset's shapes")
    text = "\n".join(breakdown(path, args.model, args.top, args.copy_gb_s, args.prompt_len, args.new_tokens)
                     for path in args.exports)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
