"""The decode forward of a Llama-family model in gdtool's own kernels (`kernels="fast"`, small batch).

HF's forward at one token per row runs, per layer, ~13 kernels around 7 matrix products. This one
runs six, over HF's own weights and HF's own static cache:

    qkv_rope          RMSNorm + q/k/v products [+ biases] [+ per-head q/k RMSNorm] + RoPE + k/v written
                      at the cache slot
    decode_attention  split-KV attention over the live slots, then its combine (2 kernels)
    rms_gemv          o projection + residual add
    rms_gemv          RMSNorm + gate/up products + SiLU * up
    rms_gemv          down projection + residual add

then RMSNorm + lm_head (float32 logits, as the step reads them) and one update of the layers' cache counters:
98 kernels for a 16-layer model. The embedding lookup is folded into the first layer's `qkv_rope` (its rows
gathered from the table where the kernel reads its input; `gemv.fold_embedding`), else HF's module runs first.
The RoPE angles are computed inside `qkv_rope` from HF's own `inv_freq` buffer and scaling (Llama 3's scaled
RoPE included), as HF's rotary embedding computes them. The forward runs eagerly, outside torch.compile (its calls
are kernels already); select and update around it stay compiled, and gdtool captures the whole
step as usual.

Which models: the families whose decoder layer is Llama's sequence (pre-norm attention and SiLU MLP,
residual adds), `FAMILIES`; what a family adds is read from its modules, not from its name:

    Llama     the sequence itself
    Mistral   a sliding window: exact only while it covers the whole cache (window >= cache length:
              no key ever leaves it), refused otherwise
    Qwen2     q/k/v biases (nn.Linear's own), added to the product before RoPE
    Qwen3     q_norm / k_norm: per-head RMSNorm of q and k before RoPE: qkv_rope's second kernel (the
              products on the usual tiles first; a tile holding a whole head left one program per head)
    Gemma 3   the (1 + w) RMSNorm (a flag of every norm), norms after attention and after the MLP
              (residual + norm, folded into the next kernel that reads the residual: gate/up, then the
              next layer's qkv_rope or the lm_head's norm; no kernel of their own), GELU-tanh gate/up, the scaled
              embedding (the scale in the folded lookup, rounded as HF's module rounds it), per-layer-type
              RoPE (local / global inv_freq), sliding layers whose window rolls (`StaticSlidingWindowLayer`: below)
    Qwen3-MoE, Mixtral, Qwen2-MoE   Llama's sequence (Qwen3's q/k norm, Qwen2's biases) with a mixture of
              experts for the MLP in some or all layers: there the experts kernels (`experts.block_triton`:
              router, gate/up, down; Qwen2-MoE's shared expert), the RMSNorm before the block folded into the
              first two, the residual added in the last; the block must be one the experts kernels take at this
              batch (`experts.refusal`), else the whole model keeps the compiled HF forward, where each block
              still calls those kernels (`experts.scope`)

Sliding-window cache layers (Gemma 3's local layers) hold the last W keys. Until the window is full a
token goes to the slot the layer's tensor counter names, as in a full layer; once full, HF's update
rolls the window left by one and writes the last slot (and leaves the tensor counter alone). The
forward takes the same branch on the same Python counter (`cumulative_length_int`, which gdtool pins per
window phase for a captured graph), shifts both caches left in one kernel (`window.roll_left`: the same
data as HF's roll, in place), writes slot W - 1 in `qkv_rope` and attends over all W slots,
masked by the 2-D mask's columns at the window's positions (`core.feed.Windows.layer_masks`).

`plan(model, batch, cache_len)` says whether it applies, which path runs at this batch (`line_paths`: the
measured line per hidden size) and why not: transformers' own modules of one of those families (RMSNorm, SiLU
MLP, no biases but q/k/v's, a static RoPE), bf16 or fp16 weights on CUDA (any float dtype on a CPU, where the
operators run their torch references). Anything else keeps the compiled HF forward (`kernels="compiled"`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import compat
from . import experts, gemv, ops, tuning
from . import triton as fast_triton  # not the triton package itself

# Causal-LM classes whose decoder layer runs Llama's sequence; the module classes checked are the
# family's own (`<Prefix>DecoderLayer`, `<Prefix>MLP`, `<Prefix>RMSNorm`), found beside the model class.
FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
            "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
# RMSNorm classes that scale by (1 + weight) in float32 and round once (the kernels' `plus_one`)
PLUS_ONE_NORMS = ("Gemma3RMSNorm",)
# the MLP's activation module -> the gate/up kernel's activation
ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "GELUTanh": "gelu_tanh"}
# embedding modules: nn.Embedding's lookup, or Gemma's lookup times its embed_scale (run as HF's module)
EMBEDDINGS = ("Embedding", "Gemma3TextScaledWordEmbedding")

# Which forward runs at which batch, in one place: (largest batch, path, why). Read top to bottom, the
# first row whose batch covers the step's wins. At one row a decode step reads every weight byte for one
# multiply-add per row; the matrix-vector kernels multiply on the CUDA cores. The roofline (~67 TFLOP/s float32,
# ~4.8 TB/s on an H200) put the line at ~8 rows; the H200's batch curve (profiles/h200/bench/batches/curves.md:
# gpu_run.sh's bench-batches, bench-line, bench-cublas) puts it per shape, for the families it measured (MEASURED_LINE):
# - two passes of 4 rows (5-8) ran 2.7-4x slower than the compiled matmuls at 9 (at 5a2de9b);
# - one pass of 3-4 rows costs 24-83% more than one row (x's rows in registers, which spill on the 8B shapes:
#   profiles/cpu/kernel-registers-rows-d163cbd.txt), and the compiled HF forward with cuBLAS's products and
#   gdtool's split-KV attention beat it at 3-4 rows on all three shapes (at 6a6ed8e: Llama 1B 1.196-1.201 ms against
#   1.421-1.433, Llama 8B 4.853-4.902 against 6.030-6.116, Qwen3 8B 5.098-5.142 against 6.137-6.195);
# - at 2 rows the kernels still win at hidden size 2048 (Llama 1B: 0.968 ms against 1.192) and lose at 4096
#   (Llama 8B 5.035 against 4.788, Qwen3 8B 5.222 against 5.080).
# So the H200 file's batch lines (the device's tuning, `tuning.py`, section "batch_lines"): the kernels take 1-2 rows
# up to hidden size 2048 and one row wider; Mistral and Qwen2 go by their hidden size, unmeasured themselves. Gemma 3 and models with experts keep one pass of 4 and passes to 8 rows
# (UNMEASURED_PATHS): their steps past one row have not been measured against the matmuls.
_PASSES = (8, "gemv", f"matrix-vector kernels, passes of {gemv.ROWS_PER_PASS} rows over each weight tile")
_MATMULS = (None, "compiled", "matrix products: past the matrix-vector kernels' line (the tuning's batch_lines; 8 "
                              "rows for Gemma 3 and experts) cuBLAS's / inductor's tensor-core matmuls win")
MEASURED_LINE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _one_pass(rows: int) -> tuple:
    return rows, "gemv", f"matrix-vector kernels, one pass of <= {rows} row{'s' if rows > 1 else ''} per weight tile"


UNMEASURED_PATHS = (_one_pass(gemv.ROWS_PER_PASS), _PASSES, _MATMULS)   # the others of FAMILIES: Gemma 3, MoE


def _check_line(rows: int) -> None:
    if not 0 <= rows <= gemv.MAX_ROWS:
        raise ValueError(f"--gemv-rows {rows}: the matrix-vector kernels take 0 to {gemv.MAX_ROWS} rows "
                         f"(gemv.MAX_ROWS; 0: the compiled forward at every batch); give a number in that range")


def gemv_line(rows: int, why: str | None = None) -> tuple:
    """Batch paths with the fast forward taking every batch up to `rows` (0 to gemv.MAX_ROWS: up to ROWS_PER_PASS
    one pass, past it passes of rows), the compiled HF forward past it (`why`: the reason it gives there): the rows
    of the tuning's batch line at a hidden size (`line_paths`). 0: the compiled forward at every batch. Where the line
    gives a batch to the compiled forward, its linear layers stay cuBLAS's / inductor's (no `linear.py` swap:
    `Plan.matmuls`)."""
    _check_line(rows)
    matmuls = _MATMULS if why is None else (None, "compiled", why)
    if rows == 0:
        return (matmuls,)
    if rows <= gemv.ROWS_PER_PASS:
        return _one_pass(rows), matmuls
    return _one_pass(gemv.ROWS_PER_PASS), (rows, *_PASSES[1:]), matmuls


def line_rows(hidden: int, tune: tuning.Tuning | None = None) -> int:
    """The largest batch the matrix-vector kernels take at this hidden size: the first row of the tuning's
    batch_lines that holds there (`tune`; None: the defaults)."""
    return (tune or tuning.current()).pick("batch_lines", "lines", hidden=hidden)["rows"]


def measured_lines(tune: tuning.Tuning | None = None) -> tuple:
    """((largest hidden size or None, rows), ...): the tuning's batch lines (`tune`; None: the defaults) as the help
    and the docs state them, each row bounded by its hidden_max."""
    lines = (tune or tuning.current())["batch_lines"]["lines"]
    return tuple((row.get("when", {}).get("hidden_max"), row["rows"]) for row in lines)


def line_paths(hidden: int | None, tune: tuning.Tuning | None = None) -> tuple:
    """The batch paths of a family in MEASURED_LINE at this hidden size (`line_rows`), or UNMEASURED_PATHS for the
    others (hidden None)."""
    if hidden is None:
        return UNMEASURED_PATHS
    rows = line_rows(hidden, tune)
    why = f"matrix products: past {rows} row{'s' if rows > 1 else ''} at hidden size {hidden} (the tuning's " \
          "batch_lines) cuBLAS's tensor-core matmuls beat the matrix-vector kernels"
    return gemv_line(rows, why)


def batch_line(rows: int, tune: tuning.Tuning | None = None) -> tuning.Tuning:
    """`tune` (None: the defaults) with one batch line for every hidden size: the matrix-vector kernels up to `rows`
    (what a GPU sweep tries, `profiles/plan_bench.py --gemv-rows`; pass it to `tuning.use`)."""
    _check_line(rows)
    return (tune or tuning.current()).with_values("batch_lines", lines=[{"rows": rows}])


def gemv_rows(paths: tuple) -> int:
    """The largest batch `paths` give the matrix-vector kernels (0: none)."""
    return max((largest for largest, path, _ in paths if path == "gemv"), default=0)


def batch_path(batch: int, paths: tuple) -> tuple[str, str]:
    """("gemv" | "compiled", why) for a decode step of `batch` rows under `paths` (`line_paths`)."""
    for largest, path, why in paths:
        if largest is None or batch <= largest:
            return path, why
    raise AssertionError("the batch paths end with a catch-all row")  # pragma: no cover


@dataclass
class Plan:
    applies: bool
    reason: str           # what runs, or why the fast forward does not apply
    layers: int = 0
    matmuls: bool = False  # the batch line gave this batch to the matmuls (line_paths): no matrix-vector swap there


def _family(model):
    """The modeling module and class prefix of a supported family, or None."""
    name = type(model).__name__
    if name not in FAMILIES:
        return None, ""
    return sys.modules[type(model).__module__], name[: -len("ForCausalLM")]


def _eps(norm) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _activation(mlp):
    """The gate/up kernel's activation for HF's act_fn module, or None."""
    act = getattr(mlp, "act_fn", None)
    name = ACTIVATIONS.get(type(act).__name__)
    if name == "gelu_tanh" and getattr(act, "act", None) is not None and \
            getattr(act.act, "keywords", {}).get("approximate") != "tanh":
        return None  # GELUTanh's Python formula (use_gelu_tanh_python): other roundings
    return name


def _rope(rotary, attn):
    """(inv_freq, attention_scaling, rope type) of the layer: HF's single rotary embedding, or Gemma 3's
    per layer type (`{layer_type}_inv_freq`)."""
    if isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return rotary.inv_freq, getattr(rotary, "attention_scaling", None), getattr(rotary, "rope_type", "default")
    kind = getattr(attn, "layer_type", None)
    types = getattr(rotary, "rope_type", None)
    return (getattr(rotary, f"{kind}_inv_freq", None), getattr(rotary, f"{kind}_attention_scaling", None),
            types.get(kind, "default") if isinstance(types, dict) else "default")


def _rolling(attn) -> bool:
    """A layer whose cache is a rolling window (HF's StaticSlidingWindowLayer for layer_types' sliding layers)."""
    return getattr(attn, "layer_type", None) == "sliding_attention"


def _window(config, attn):
    """The layer's sliding window, or None: the attention's own attribute (Qwen2/3 set it per layer type), else
    None for a layer that `config.layer_types` says is full (Qwen2-MoE sets no attribute there), else the
    config's (Mistral reads it there)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    types, index = getattr(config, "layer_types", None), getattr(attn, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(index, int) and index < len(types) \
            and types[index] == "full_attention":
        return None
    return getattr(config, "sliding_window", None)


def plan(model, batch: int, cache_len: int | None = None) -> Plan:
    """Whether `forward` can run this model's decode step at this batch size (and cache length, for
    sliding windows), which path runs at this batch, and why not."""
    module, prefix = _family(model)
    if module is None:
        return Plan(False, f"{type(model).__name__} is not one of {', '.join(FAMILIES)} (the fast forward's "
                           "families: Llama's decoder layer)")
    layer_cls, mlp_cls, norm_cls = (getattr(module, prefix + s, None) for s in ("DecoderLayer", "MLP", "RMSNorm"))
    config = model.config
    inner = model.model
    param = next(model.parameters())
    path, why = batch_path(batch, line_paths(config.hidden_size if type(model).__name__ in MEASURED_LINE else None,
                                             tuning.current(param.device)))
    if path != "gemv":
        return Plan(False, f"batch {batch}: {why}", matmuls=True)
    if param.device.type == "cuda":
        if not fast_triton.HAVE_TRITON:
            return Plan(False, "no Triton")
        if param.dtype not in (torch.bfloat16, torch.float16):
            return Plan(False, f"{param.dtype} weights on CUDA (bf16 or fp16 only)")
    elif not fast_triton.interpreting() and param.device.type != "cpu":
        return Plan(False, f"device {param.device.type}")
    if getattr(config, "mlp_bias", False) or getattr(config, "pretraining_tp", 1) != 1:
        return Plan(False, "MLP biases or tensor-parallel slicing")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return Plan(False, f"{name}={getattr(config, name)} (the kernels have no soft-capping; Gemma 3 sets none)")
    if getattr(config, "use_bidirectional_attention", False):
        return Plan(False, "bidirectional attention (the kernels attend causally)")
    if type(inner.embed_tokens).__name__ not in EMBEDDINGS:
        return Plan(False, f"embedding {type(inner.embed_tokens).__name__} (the kernels know {', '.join(EMBEDDINGS)})")
    rotary = inner.rotary_emb
    layers = list(inner.layers)
    if len(layers) != config.num_hidden_layers:
        return Plan(False, "the model runs a subset of its layers")
    features, sizes = set(), {}  # sizes: what the reason says beside a feature (the path's name holds none)
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        moe = experts.is_moe_block(mlp)
        if type(layer) is not layer_cls or (not moe and type(mlp) is not mlp_cls) \
                or type(layer.input_layernorm) is not norm_cls or type(layer.post_attention_layernorm) is not norm_cls:
            return Plan(False, f"decoder layers other than transformers' {prefix} layers")
        sandwich = [getattr(layer, n, None) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
        if any(m is not None and type(m) is not norm_cls for m in sandwich) or (sandwich[0] is None) != (sandwich[1] is None):
            return Plan(False, f"norms around the MLP other than two {prefix}RMSNorm")
        if sandwich[0] is not None:
            features.add("post norms")
        if type(layer.input_layernorm).__name__ in PLUS_ONE_NORMS:
            features.add("(1 + w) norms")
        if moe:   # the block in gdtool's experts kernels, its norm before and the residual add in the last
            if sandwich[0] is not None or "(1 + w) norms" in features:
                return Plan(False, f"layer {index}: an MoE block with norms around it or (1 + w) norms (the experts "
                                   "kernels fold in one Llama RMSNorm before the block)")
            refused = experts.refusal(mlp, batch, small=True)   # block_triton: the small kernels at 1-4 rows
            if refused:
                return Plan(False, f"layer {index}'s MoE block: {refused}")
            features.add("experts")
        else:
            act = _activation(mlp)
            if act is None:
                return Plan(False, f"activation {type(getattr(mlp, 'act_fn', None)).__name__} (the kernels have SiLU "
                                   "and GELU's tanh form)")
            if act != "silu":
                features.add(act)
        inv_freq, scaling, rope = _rope(rotary, attn)
        if "dynamic" in rope or "longrope" in rope:
            return Plan(False, f"RoPE type {rope!r} changes with the sequence length")
        if not isinstance(inv_freq, torch.Tensor) or not isinstance(scaling, (int, float)):
            return Plan(False, "a rotary embedding without inv_freq and attention_scaling")
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj) + \
            (() if moe else (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        if any(type(m) is not torch.nn.Linear or not m.weight.is_contiguous() for m in linears):
            return Plan(False, "projections that are not plain, contiguous nn.Linear")
        qkv_bias = [m.bias is not None for m in linears[:3]]
        if any(m.bias is not None for m in linears[3:]) or len(set(qkv_bias)) != 1:
            return Plan(False, "biases other than on all of q/k/v (o, gate, up and down have none in the kernels)")
        if qkv_bias[0]:
            features.add("q/k/v biases")
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None or k_norm is not None:
            if type(q_norm) is not norm_cls or type(k_norm) is not norm_cls or _eps(q_norm) != _eps(k_norm) \
                    or q_norm.weight.shape != (attn.head_dim,) or k_norm.weight.shape != (attn.head_dim,):
                return Plan(False, f"q/k norms other than two per-head {prefix}RMSNorm of one epsilon")
            features.add("q/k norm")
        window = _window(config, attn)
        if window is not None and _rolling(attn):
            features.add("sliding window")
            sizes["sliding window"] = f"sliding window {window}"
        elif window is not None:
            if cache_len is None or window < cache_len:
                return Plan(False, f"sliding window {window} shorter than the cache ({cache_len} slots): the kernels "
                                   "attend over every live slot (a cache no longer than the window runs them)")
            features.add("window >= cache")
            sizes["window >= cache"] = f"window {window} >= cache"
    d = layers[0].self_attn.head_dim
    hidden = config.hidden_size
    if d & (d - 1) or d < 16 or config.num_attention_heads % config.num_key_value_heads:
        return Plan(False, f"head_dim {d} (a power of two >= 16 needed) or uneven head groups")
    if hidden > 8192 or model.lm_head.bias is not None or type(inner.norm) is not norm_cls:
        return Plan(False, "hidden size over 8192 (the norm reads whole rows in one tile) or an lm_head bias")
    # the path's name holds no sizes: one name per code path (CUDA_TESTED lists the names)
    path_name = prefix + "".join(f", {f}" for f in sorted(features)) + \
        (f", <= {gemv.ROWS_PER_PASS} rows" if batch <= gemv.ROWS_PER_PASS else f", passes of {gemv.ROWS_PER_PASS} rows")
    untested = fast_triton.untested_on_cuda(path_name, param.device)
    if untested:
        return Plan(False, untested)
    backend = "Triton kernels" if fast_triton.usable(param) else "their torch references (no Triton here)"
    family = prefix + (f" ({', '.join(sizes.get(f, f) for f in sorted(features))})" if features else "")
    return Plan(True, f"fast decode forward, {len(layers)} layers, {family}, batch {batch}: {why}; {backend}",
                len(layers))


def cache_ready(cache, model=None) -> str:
    """'' when the static cache has the layout the kernels write, else why not (checked at trace time:
    the cache's tensors exist once the prefill has run). With the model: its rolling-window layers have
    rolling cache layers no longer than their window (other layers' windows cover the cache: `plan`)."""
    layers = compat.cache_layers(cache)
    if model is not None:
        for block, layer in zip(model.model.layers, layers):
            if _rolling(block.self_attn) and not (compat.is_sliding(layer) and layer.max_cache_len <= _window(
                    model.config, block.self_attn)):
                return "a sliding layer whose cache layer is not a rolling window of its size"
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        counter = getattr(layer, "cumulative_length", None)
        if keys is None or values is None or keys.dim() != 4 or not keys.is_contiguous() \
                or not values.is_contiguous():
            return "a cache layer without contiguous [B, Hkv, C, D] keys and values"
        if not isinstance(counter, torch.Tensor) or counter.device != keys.device:
            return "a cache layer without a device counter (cumulative_length)"
    return ""


_LAST_SLOTS: dict = {}  # (device, W): a [] tensor W - 1, the slot a full window writes (kept: graphs read it)


def _last_slot(layer) -> torch.Tensor:
    key = (layer.keys.device, layer.max_cache_len)
    if key not in _LAST_SLOTS:
        _LAST_SLOTS[key] = torch.tensor(layer.max_cache_len - 1, device=layer.keys.device)
    return _LAST_SLOTS[key]


def forward(model, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
            window_masks: dict | None = None, advance: bool = True):
    """float32 logits [B, V] of one decode step (tokens, positions [B, 1]; mask [B, C] over the cache slots;
    window_masks {layer index: [B, W]} for the sliding layers, `core.feed.Windows.layer_masks`), writing each
    layer's key and value where HF's update writes them and advancing the counters as it does; advance=False
    returns (logits, the counters to advance by 1) and leaves them to the caller (`tail.update`).
    Runs eagerly: every line below is one kernel (the embedding where it is not folded into the first qkv_rope,
    the counters' update, a full window's roll) or a call of gdtool's kernels."""
    inner = model.model
    rotary = inner.rotary_emb
    embedding = inner.embed_tokens
    # [B, H]: HF's lookup (and Gemma's scale), or None: folded into the first layer's qkv_rope (`gemv.fold_embedding`)
    fold = gemv.fold_embedding(tokens.device) and embedding.max_norm is None
    h = None if fold else embedding(tokens[:, 0])
    layers = compat.cache_layers(cache)
    counters = []
    # Gemma's norm after the MLP and its residual add, h + RMSNorm(down's output), waiting to be folded into the
    # next kernel that reads h (the next layer's qkv_rope, or the lm_head's norm): one kernel fewer per layer
    pending = None
    for i, (block, layer) in enumerate(zip(inner.layers, layers)):
        attn, mlp = block.self_attn, block.mlp
        norm1, norm2 = block.input_layernorm, block.post_attention_layernorm
        plus_one = type(norm1).__name__ in PLUS_ONE_NORMS
        slot, layer_mask = layer.cumulative_length, mask   # this step's slot, before the update adds 1
        if compat.is_sliding(layer):
            full = layer.cumulative_length_int >= layer.max_cache_len
            layer.cumulative_length_int += 1                # HF's update counts every token
            layer_mask = window_masks[i]
            if full:  # HF's full-window update: roll left by one (one kernel), qkv_rope writes the last slot
                ops.roll_window(layer.keys, layer.values)
                slot = _last_slot(layer)
        if slot is layer.cumulative_length:
            counters.append(slot)
        biases = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias) if attn.q_proj.bias is not None else None
        qk_norm = (attn.q_norm.weight, attn.k_norm.weight, _eps(attn.q_norm)) \
            if getattr(attn, "q_norm", None) is not None else None
        inv_freq, scaling, _ = _rope(rotary, attn)
        embed = (tokens[:, 0], getattr(embedding, "embed_scale", None)) if h is None else None
        q = ops.qkv_rope(embedding.weight if h is None else h, norm1.weight, _eps(norm1), attn.q_proj.weight,
                         attn.k_proj.weight, attn.v_proj.weight, positions, inv_freq, scaling,
                         layer.keys, layer.values, slot, biases, qk_norm, plus_one, add=pending, embed=embed)
        if pending is not None or embed is not None:
            q, h = q
        o = ops.decode_attention(q, layer.keys, layer.values, layer_mask, slot, attn.scaling)
        act = _activation(mlp)
        post_mlp = getattr(block, "post_feedforward_layernorm", None)
        if post_mlp is not None:  # Gemma: norm after attention and after the MLP, then the residual add
            pre_mlp = block.pre_feedforward_layernorm
            attended = ops.rms_gemv(o, None, 0.0, attn.o_proj.weight, None, None, False)
            a, h = ops.rms_gemv(h, pre_mlp.weight, _eps(pre_mlp), mlp.gate_proj.weight, mlp.up_proj.weight, None,
                                False, plus_one, act, add=(attended, norm2.weight, _eps(norm2)))
            pending = (ops.rms_gemv(a, None, 0.0, mlp.down_proj.weight, None, None, False), post_mlp.weight,
                       _eps(post_mlp))
        elif experts.is_moe_block(mlp):   # the block's kernels, the norm in the first two, the residual in the last
            h = ops.rms_gemv(o, None, 0.0, attn.o_proj.weight, None, h, False)
            h = ops.moe(h, mlp, norm2.weight, _eps(norm2))
        else:
            h = ops.rms_gemv(o, None, 0.0, attn.o_proj.weight, None, h, False)
            a = ops.rms_gemv(h, norm2.weight, _eps(norm2), mlp.gate_proj.weight, mlp.up_proj.weight, None, False,
                             plus_one, act)
            h = ops.rms_gemv(a, None, 0.0, mlp.down_proj.weight, None, h, False)
    norm = inner.norm
    logits = ops.rms_gemv(h, norm.weight, _eps(norm), model.lm_head.weight, None, None, True,
                          type(norm).__name__ in PLUS_ONE_NORMS, add=pending, keep=False)
    if not advance:
        return logits, counters
    # after the lm_head: between the last layer and it, the add's kernel would cut their PDL link
    if counters:  # none when every layer slides and every window is full
        torch._foreach_add_(counters, 1)  # a full window's counter stays (HF's update leaves it)
    return logits
