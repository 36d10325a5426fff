"""HF's MoE blocks and gdtool's kernels: which blocks they take and why not (`plan`, `refusal`), the
`gdtool::moe_block` operator the compiled HF forward calls in their place, and the swap for the duration of
a compiled call (`scope`)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .. import swap
from ..triton import HAVE_TRITON, untested_on_cuda, usable
from . import reference
from .grouped import block_grouped
from .small import block_triton
from .. import tuning
from .tiles import GROUPED_FAMILIES, MAX_EXPERTS, MAX_GROUPED_TOKENS, MAX_TOKENS, grouped_from, runs_grouped

# (block class, experts class, router class) per family, by module name in transformers.models
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeSparseMoeBlock", "Qwen3MoeExperts", "Qwen3MoeTopKRouter"),
    "qwen2_moe": ("Qwen2MoeSparseMoeBlock", "Qwen2MoeExperts", "Qwen2MoeTopKRouter"),
    "mixtral": ("MixtralSparseMoeBlock", "MixtralExperts", "MixtralTopKRouter"),
    "olmoe": ("OlmoeSparseMoeBlock", "OlmoeExperts", "OlmoeTopKRouter"),
    "gpt_oss": ("GptOssMLP", "GptOssExperts", "GptOssTopKRouter"),
}
# gpt-oss's experts differ from the others in every place the kernels see (`block_oss`, `OSS` in the routing): transposed
# weights (gate_up_proj [E, H, 2I] with gate and up interleaved by column, down_proj [E, I, H]), biases on
# both products and on the router, the clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`
# with g = clamp(gate, max=limit), and the router's top-k taken over the logits before a softmax over the k.


@torch.library.custom_op("gdtool::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, norm_topk: bool, weights_f32: bool, shared_gate: torch.Tensor | None = None,
              shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
              shared_router: torch.Tensor | None = None, router_bias: torch.Tensor | None = None,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """One MoE block, x [M, H] -> [M, H]: the Triton kernels where they run (CUDA, or Triton's interpreter;
    the grouped ones from `grouped_from` (the device's tuning) to MAX_GROUPED_TOKENS rows where there is no shared expert, else the
    small-batch kernels up to MAX_TOKENS rows), HF's
    batched_mm arithmetic in torch elsewhere. The biases (all three) and alpha, limit are gpt-oss's:
    given, the weights are in its layout and routing."""
    oss = None if gate_up_bias is None else (router_bias, gate_up_bias, down_bias, alpha, limit)
    args = (x, router_weight, gate_up, down, top_k, norm_topk, weights_f32,
            shared_gate, shared_up, shared_down, shared_router, oss)
    if usable(x, gate_up, down):
        if shared_gate is None and x.shape[0] >= grouped_from(tuning.current(x.device), oss=oss is not None):
            return block_grouped(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32, oss=oss)
        return block_triton(*args)
    return reference.block_reference(*args)   # read here at each call: a test may count them


@moe_block.register_fake
def _(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32, shared_gate=None, shared_up=None,
      shared_down=None, shared_router=None, router_bias=None, gate_up_bias=None, down_bias=None, alpha=0.0, limit=0.0):
    return torch.empty_like(x)


# -- which blocks run it: the plan, and the swap for the duration of a compiled call -------------

@dataclass
class Layer:
    index: int            # decoder layer (order of the blocks in the model)
    name: str             # module path
    block: object
    family: str           # transformers model type, or "" where unknown
    applies: bool
    reason: str
    forward: object = None  # the block's forward while the scope is entered

    @property
    def path(self) -> str:
        return "gdtool experts kernels" if self.applies else "HF block"


@dataclass
class Plan:
    """The MoE blocks of a model at one batch size: which run gdtool's kernels, and why not."""
    layers: list = field(default_factory=list)
    backend: str = ""

    @property
    def applies(self) -> bool:
        return any(layer.applies for layer in self.layers)

    def key(self) -> tuple:
        return tuple(layer.index for layer in self.layers if layer.applies)

    def note(self) -> str:
        """One line for the kernels note: layer ranges per path, with the reason where HF's block stays."""
        if not self.layers:
            return ""
        groups: dict = {}
        for layer in self.layers:
            groups.setdefault((layer.applies, layer.reason), []).append(layer.index)
        parts = []
        for (applies, reason), indices in groups.items():
            where = f"layers {_ranges(indices)}"
            parts.append(f"{where} in gdtool's kernels ({reason})" if applies else f"{where} HF's ({reason})")
        return f"MoE blocks {len([x for x in self.layers if x.applies])}/{len(self.layers)}: " + "; ".join(parts)

    def table(self) -> "pandas.DataFrame":
        import pandas as pd
        return pd.DataFrame([dict(layer=x.index, module=x.name, block=type(x.block).__name__, family=x.family,
                                  path=x.path, reason=x.reason) for x in self.layers],
                            columns=["layer", "module", "block", "family", "path", "reason"])


def _ranges(indices: list) -> str:
    out, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def _family(block) -> str:
    for family, (block_name, _, _) in FAMILIES.items():
        if type(block).__name__ == block_name and type(block).__module__.endswith(f"modeling_{family}"):
            return family
    return ""


def is_moe_block(module) -> bool:
    """A sparse-MoE block: a known family's, or any module holding transformers' experts (with its router)."""
    if _family(module):
        return True
    experts = getattr(module, "experts", None)
    return isinstance(experts, torch.nn.Module) and hasattr(experts, "is_concatenated")


def refusal(block, tokens: int, small: bool = False) -> str:
    """'' when gdtool's kernels run this MoE block at `tokens` rows exactly as its HF forward (up to rounding
    order), else why not. small=True: the small kernels at any token count (the fast forward's MoE layers)."""
    return _why_not(block, _family(block), tokens, small)


def _why_not(block, family: str, tokens: int, small: bool = False) -> str:
    """'' when the kernels compute this block exactly as its HF forward does (up to rounding order)."""
    if not family:
        return f"{type(block).__name__} is not a known family ({', '.join(FAMILIES)})"
    _, experts_name, router_name = FAMILIES[family]
    experts, router = block.experts, _router(block)
    if type(experts).__name__ != experts_name or type(router).__name__ != router_name:
        return f"experts or router other than transformers' {experts_name} / {router_name}"
    if tokens > MAX_GROUPED_TOKENS:
        return f"{tokens} tokens per step > {MAX_GROUPED_TOKENS}: many tokens per expert, HF's grouped_mm"
    if tokens > MAX_TOKENS and family not in GROUPED_FAMILIES:
        return (f"{tokens} tokens per step > {MAX_TOKENS} and the grouped kernels (up to {MAX_GROUPED_TOKENS}) "
                f"take {', '.join(GROUPED_FAMILIES)} only")
    oss = family == "gpt_oss"
    flags = dict(has_gate=True, is_concatenated=not oss, is_transposed=oss, has_bias=oss,
                 has_post_expert_norm=False, _is_expert_parallel=False)
    off = [name for name, want in flags.items() if getattr(experts, name, want) != want]
    if off:
        return (f"experts with {off[0]}={getattr(experts, off[0])!r} (the kernels read "
                + ("gpt-oss's transposed, interleaved, biased layout)" if oss else "[gate; up] rows, no bias)"))
    gate_up, down, router_weight = experts.gate_up_proj, experts.down_proj, router.weight
    if oss:
        # GptOssExperts._apply_gate, the clamped SwiGLU, is what the kernels compute; a subclass's other one is not
        if type(experts)._apply_gate is not _oss_apply_gate() or not all(
                isinstance(getattr(experts, name, None), (int, float)) for name in ("alpha", "limit")):
            return "gpt-oss experts with a gate other than GptOssExperts._apply_gate (alpha, limit)"
        e, h, two_i = gate_up.shape
        layout = down.shape == (e, two_i // 2, h) and experts.gate_up_proj_bias.shape == (e, two_i) and \
            experts.down_proj_bias.shape == (e, h) and router.bias is not None and router.bias.shape == (e,)
        if not layout or router_weight.shape != (e, h):
            return "expert weights not in gpt-oss's [E, H, 2I] / [E, I, H] layout with biases"
    else:
        if type(experts.act_fn).__name__ not in ("SiLU", "SiLUActivation") or \
                getattr(experts.config, "hidden_act", "silu") != "silu":
            return f"experts activation {type(experts.act_fn).__name__}, not SiLU"
        e, two_i, h = gate_up.shape
        if down.shape != (e, h, two_i // 2) or router_weight.shape != (e, h):
            return "expert weights not in [E, 2I, H] / [E, H, I] layout"
    if e > MAX_EXPERTS or router.top_k > e:
        return f"{e} experts (at most {MAX_EXPERTS}) or top-k {router.top_k} over them"
    tensors = [gate_up, down, router_weight]
    if oss:
        tensors += [experts.gate_up_proj_bias, experts.down_proj_bias, router.bias]
    if family == "qwen2_moe":
        mlp, gate = block.shared_expert, block.shared_expert_gate
        if getattr(mlp.config, "hidden_act", "silu") != "silu" or any(
                getattr(lin, "bias", None) is not None for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, gate)):
            return "a shared expert with biases or an activation other than SiLU"
        tensors += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.weight]
    if any(not t.is_contiguous() for t in tensors):
        return "expert weights that are not contiguous"
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return "expert weights of mixed dtypes or devices"
    if gate_up.device.type == "cuda":
        if not HAVE_TRITON:
            return "no Triton"
        if gate_up.dtype not in (torch.bfloat16, torch.float16):
            return f"{gate_up.dtype} weights on CUDA (bf16 or fp16 only)"
    grouped = runs_grouped(family, tokens, tuning.current(gate_up.device)) and not small
    return untested_on_cuda(f"{family} experts" + (", grouped" if grouped else ""), gate_up.device)


def _router(block):
    """The block's router module (gpt-oss calls it `router`, the others `gate`)."""
    return block.router if _family(block) == "gpt_oss" else block.gate


def _oss_apply_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    return GptOssExperts._apply_gate


def _router_args(block, family: str) -> tuple:
    router = _router(block)
    if family == "gpt_oss":   # top-k of the logits, softmax over the k (no renormalization), rounded
        return int(router.top_k), False, False
    # Mixtral's router always renormalizes and keeps its weights in float32; the others round them
    norm = True if family == "mixtral" else bool(router.norm_topk_prob)
    return int(router.top_k), norm, family == "mixtral"


def block_args(block) -> tuple:
    """What `block_reference` and `block_triton` take after x, read off a known family's block: router weight,
    gate_up, down, top_k, norm_topk, weights_f32, the shared expert's four weights (Qwen2-MoE; else None) and
    gpt-oss's (router_bias, gate_up_bias, down_bias, alpha, limit) (else None)."""
    family = _family(block)
    top_k, norm, weights_f32 = _router_args(block, family)
    experts, router = block.experts, _router(block)
    shared = (None,) * 4
    if family == "qwen2_moe":
        mlp = block.shared_expert
        shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, block.shared_expert_gate.weight)
    oss = None
    if family == "gpt_oss":
        oss = (router.bias, experts.gate_up_proj_bias, experts.down_proj_bias, float(experts.alpha),
               float(experts.limit))
    return (router.weight, experts.gate_up_proj, experts.down_proj, top_k, norm, weights_f32, *shared, oss)


def make_forward(block, family: str):
    """The block's forward through `moe_block`: HF's arguments, HF's result ([B, S, H])."""
    original = type(block).forward
    oss = family == "gpt_oss"
    limit = MAX_GROUPED_TOKENS if family in GROUPED_FAMILIES else MAX_TOKENS

    def forward(hidden_states):
        b, s, h = hidden_states.shape
        if b * s > limit:  # a shape the step never has (decode is one token per row); HF's block
            return original(block, hidden_states)
        (router_weight, gate_up, down, top_k, norm, weights_f32, shared_gate, shared_up, shared_down, shared_router,
         oss_args) = block_args(block)
        extra = {}
        if shared_gate is not None:
            extra = dict(shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down,
                         shared_router=shared_router)
        if oss_args is not None:
            extra = dict(zip(("router_bias", "gate_up_bias", "down_bias", "alpha", "limit"), oss_args))
        out = torch.ops.gdtool.moe_block(hidden_states.reshape(b * s, h), router_weight, gate_up, down, top_k, norm,
                                         weights_f32, **extra).reshape(b, s, h)
        # GptOssMLP returns (hidden states, router scores); its decoder layer drops the scores
        return (out, None) if oss else out
    return forward


def plan(model, batch: int) -> Plan:
    """The model's MoE blocks at `batch` rows of one decode token each: which run gdtool's kernels."""
    result = Plan()
    blocks = [(name, module) for name, module in model.named_modules() if is_moe_block(module)]
    param = next(model.parameters())
    result.backend = "Triton" if usable(param) else "torch reference (no Triton on this device)"
    for index, (name, block) in enumerate(blocks):
        family = _family(block)
        why = _why_not(block, family, batch)
        layer = Layer(_layer_index(name, index), name, block, family, not why,
                      why or f"{family}, top-{_router(block).top_k} of {block.experts.gate_up_proj.shape[0]}, "
                             + ("grouped, " if runs_grouped(family, batch, tuning.current(param.device)) else "")
                             + result.backend)
        if layer.applies:
            layer.forward = make_forward(block, family)
        result.layers.append(layer)
    return result


def _layer_index(name: str, default: int) -> int:
    for part in reversed(name.split(".")):
        if part.isdigit():
            return int(part)
    return default


@contextmanager
def scope(moe_plan: Plan | None):
    """The planned blocks run gdtool's kernels inside this scope; each block's own forward is back on exit
    (whatever happens inside: `swap.forwards`)."""
    layers = moe_plan.layers if moe_plan is not None else []
    with swap.forwards((layer.block, layer.forward) for layer in layers if layer.applies):
        yield
