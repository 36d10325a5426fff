"""A first look at rollout throughput on a GPU (not a bench: no peers). Prints JSON lines."""
import json
import sys
import time

import torch

import gdtool
from gdtool.measure import workloads

name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
count = int(sys.argv[2]) if len(sys.argv) > 2 else 256
slots = int(sys.argv[3]) if len(sys.argv) > 3 else 64
model = gdtool.load_model(name, device="cuda")
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(3, 1000, (count, 128), generator=gen).tolist()
dist = workloads.geometric(mean=128, cap=512)
targets = dist.draw(batch=count, seed=0).tolist()
common = dict(max_new_tokens=512, eos_token_id=2, pad_token_id=0, target_lengths=targets, return_logprobs=False)
runs = [("off", "device-loop", {}), ("host", "step-graph", {}), ("device", "step-graph", dict(eos_poll_interval=16)),
        ("device", "device-loop", {})]
ref = None
for refill, mode, extra in runs:
    for rep in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = gdtool.rollout(model, prompts, slots=slots, refill=refill, mode=mode, **common, **extra)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    row = dict(model=name, refill=refill, mode=mode, **extra, wall_s=round(wall, 3),
               useful_tok_s=round(out.useful_tokens / wall), share=round(out.row_step_share, 3),
               steps=out.decode_steps, prefill_s=round(out.prefill_s, 3), setup_s=round(getattr(out, "setup_s", 0), 3),
               syncs=out.host_syncs, device=torch.cuda.get_device_name())
    if refill != "off":
        toks = [s.tokens for s in out.sequences]
        if ref is None:
            ref = toks
        row["equal_to_first_refill_run"] = all(torch.equal(a, b) for a, b in zip(ref, toks))
    print(json.dumps(row), flush=True)
# EOS off: the same step with every row running: the full-batch step time
out = gdtool.rollout(model, prompts[:slots], slots=slots, refill="off", mode="device-loop", max_new_tokens=512,
                     eos_token_id=None, pad_token_id=0, return_logprobs=False)
torch.cuda.synchronize()
t0 = time.perf_counter()
out = gdtool.rollout(model, prompts[:slots], slots=slots, refill="off", mode="device-loop", max_new_tokens=512,
                     eos_token_id=None, pad_token_id=0, return_logprobs=False)
torch.cuda.synchronize()
wall = time.perf_counter() - t0
print(json.dumps(dict(eos_off=True, wall_s=round(wall, 3), tok_s=round(out.useful_tokens / wall),
                      decode_s=round(out.decode_s, 3), prefill_s=round(out.prefill_s, 3), steps=out.decode_steps)))
