"""Tiny mixture-of-experts models of each family the experts kernels know (transformers 5.x layouts)."""
import torch

COMMON = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
FIELDS = {
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=32, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=False),
    "mixtral": dict(intermediate_size=32, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "gpt_oss": dict(intermediate_size=32, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072),
}


def build(family: str, seed: int = 0, dtype=torch.float32, device="cpu", router_std: float = 0.3):
    """The tiny causal LM of `family`, random weights; the routers' weights drawn wider than HF's init
    (0.02) so that routing is decided by clear margins, not near-ties."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING
    config = CONFIG_MAPPING[family](**dict(COMMON, **FIELDS[family]))
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"  # gpt-oss's sinks: eager only
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.router if family == "gpt_oss" else layer.mlp.gate
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * router_std)
            if family == "gpt_oss":  # HF's init leaves the experts' biases zero; the kernels add them
                experts = layer.mlp.experts
                for bias in (router.bias, experts.gate_up_proj_bias, experts.down_proj_bias):
                    bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
    model.gdtool_name = f"tiny-{family}"
    return model.to(device=device, dtype=dtype).eval()
