"""The torch reference: HF's router and batched_mm experts, rounding point for rounding point. The operator runs
it where Triton does not (a CPU build of torch); every kernel is tested against it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_reference(x, router_weight, top_k: int, norm_topk: bool, weights_f32: bool):
    """HF's TopKRouter.forward: (logits [M, E] model dtype, weights [M, k], expert ids [M, k] int64);
    the weights in float32 where the router keeps them so (Mixtral), else rounded to the model dtype."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, (values if weights_f32 else values.to(logits.dtype)), ids


def experts_reference(x, ids, weights, gate_up, down):
    """HF's batched_mm experts forward (generate()'s decode path): [M, H] -> [M, H]."""
    m, k = ids.shape
    e = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    gate, up = torch.bmm(gate_up[e], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    act = F.silu(gate) * up
    y = torch.bmm(down[e], act.unsqueeze(-1)).squeeze(-1)
    y = y * weights.reshape(-1, 1)
    return y.view(m, k, -1).sum(dim=1).to(x.dtype)


def shared_reference(x, gate_w, up_w, down_w, gate_router):
    """Qwen2-MoE's shared expert, times the sigmoid of its gate."""
    shared = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    return torch.sigmoid(F.linear(x, gate_router)) * shared


def route_reference_oss(x, router_weight, router_bias, top_k: int):
    """GptOssTopKRouter.forward: the k largest logits (bias added), then a softmax over those k in float32,
    rounded to the model dtype (`softmax(dtype=logits.dtype)`); (logits, weights [M, k], ids [M, k])."""
    logits = F.linear(x, router_weight, router_bias)
    values, ids = torch.topk(logits, top_k, dim=-1)
    return logits, torch.softmax(values, dim=1, dtype=values.dtype), ids


def experts_reference_oss(x, ids, weights, gate_up, gate_up_bias, down, down_bias, alpha: float, limit: float):
    """HF's batched_mm experts forward for GptOssExperts (is_transposed, has_bias, interleaved [gate, up]
    columns, GptOssExperts._apply_gate): [M, H] -> [M, H]. grouped_mm rounds at the same points."""
    m, k = ids.shape
    e = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)
    gate_up_out = torch.bmm(xs.unsqueeze(1), gate_up[e]).squeeze(1)
    gate_up_out.add_(gate_up_bias[e])
    gate, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    y = torch.bmm(act.unsqueeze(1), down[e]).squeeze(1)
    y.add_(down_bias[e])
    y = y * weights.reshape(-1, 1)
    return y.view(m, k, -1).sum(dim=1).to(x.dtype)


def block_reference(x, router_weight, gate_up, down, top_k, norm_topk, weights_f32,
                    shared_gate=None, shared_up=None, shared_down=None, shared_router=None, oss=None,
                    rows: int | None = None):
    """One block in torch. `oss`, for gpt-oss: (router_bias, gate_up_bias, down_bias, alpha, limit). `rows`: the
    experts at most that many tokens at a time (batched_mm gathers each (token, k) pair's weights: Mixtral's 24
    tokens take 10.5 GiB), the routing over all tokens at once. The bits may differ from one go's where bmm's
    blocking depends on the batch; for the checks, which need HF's rounding and not its exact bits."""
    if oss is not None:
        router_bias, gate_up_bias, down_bias, alpha, limit = oss
        _, weights, ids = route_reference_oss(x, router_weight, router_bias, top_k)
        return _by_rows(experts_reference_oss, rows, x, ids, weights, gate_up, gate_up_bias, down, down_bias,
                        alpha, limit)
    _, weights, ids = route_reference(x, router_weight, top_k, norm_topk, weights_f32)
    out = _by_rows(experts_reference, rows, x, ids, weights, gate_up, down)
    if shared_gate is not None:
        out = out + shared_reference(x, shared_gate, shared_up, shared_down, shared_router)
    return out


def _by_rows(experts_forward, rows, x, ids, weights, *params):
    """experts_forward over the tokens, `rows` at a time (None: all at once); each token's pairs are its own."""
    if rows is None or rows >= x.shape[0]:
        return experts_forward(x, ids, weights, *params)
    return torch.cat([experts_forward(x[r:r + rows], ids[r:r + rows], weights[r:r + rows], *params)
                      for r in range(0, x.shape[0], rows)])
