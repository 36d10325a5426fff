"""What a rollout's decode step costs against the static decode step, on this machine (compiled kernels).

A 2-layer Llama of 1,024 hidden (16 query heads over 4 key/value heads, random weights), `--slots` rows, prompts of
64 tokens, 256 new tokens with EOS off: `gdtool.rollout(refill="host")` over twice as many prompts as slots (every
slot refilled once), against `Decoder` on one static batch. Prints ms a decode step of each (the second call's
decode time over its steps) and ms a refill. Before the per-row cache write was one in-place `index_put_`, the
rollout's step compiled to a copy of the whole cache per layer and step (`tests/test_rollout.py::
test_compiled_row_write_stays_in_place`).

    python profiles/row_step_probe.py                   # cpu, 32 slots
    python profiles/row_step_probe.py --device cuda --slots 64 --kernels fast
"""
import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gdtool

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--device", default="cpu")
p.add_argument("--slots", type=int, default=32)
p.add_argument("--kernels", default="compiled")
args = p.parse_args()
torch.manual_seed(0)
config = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64, vocab_size=1000, max_position_embeddings=4096)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config).eval().to(args.device)
slots, new = args.slots, 256
prompts = torch.randint(3, 1000, (2 * slots, 64), generator=torch.Generator().manual_seed(0)).tolist()
common = dict(eos_token_id=None, pad_token_id=0, max_new_tokens=new, kernels=args.kernels)
gdtool.rollout(model, prompts[:slots], slots=slots, refill="host", **common)   # compiles
out = gdtool.rollout(model, prompts, slots=slots, refill="host", **common)
decoder = gdtool.Decoder(model, "eager", **common)
ids = torch.tensor(prompts[:slots], device=args.device)
decoder.generate(ids, torch.ones_like(ids))   # compiles
static = decoder.generate(ids, torch.ones_like(ids))
print(json.dumps(dict(device=args.device, kernels=args.kernels, slots=slots, torch=torch.__version__,
                      rollout_step_ms=round(1e3 * out.decode_s / out.decode_steps, 2),
                      static_step_ms=round(1e3 * static.timings["decode_s"] / static.steps, 2),
                      refill_ms=round(1e3 * out.prefill_s / out.prefills, 2))))
