"""Which rollout runs agree on a real-size model (diagnostic; prints JSON lines)."""
import json
import sys

import torch

import gdtool
from gdtool.measure import workloads

name, dtype = sys.argv[1], {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[2]]
count, slots, n = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = gdtool.load_model(name, device="cuda", dtype=dtype)
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(3, 1000, (count, 128), generator=gen).tolist()
targets = workloads.geometric(mean=n // 2, cap=n).draw(batch=count, seed=0).tolist()
common = dict(max_new_tokens=n, eos_token_id=2, pad_token_id=0, target_lengths=targets)
runs = [("host", "eager", {}), ("host", "step-graph", {}), ("host", "step-graph", {}),
        ("device", "eager", {}), ("device", "step-graph", {}),
        ("device", "step-graph", dict(eos_poll_interval=16)), ("device", "device-loop", {}), ("device", "device-loop", {})]
ref = None
for refill, mode, extra in runs:
    out = gdtool.rollout(model, prompts, slots=slots, refill=refill, mode=mode, **common, **extra)
    lengths_ok = [s.length for s in out.sequences] == targets
    row = dict(model=name, dtype=sys.argv[2], refill=refill, mode=mode, steps=out.decode_steps, lengths_ok=lengths_ok)
    if ref is None:
        ref = out
    else:
        diff = [(i, int((a.tokens != b.tokens).nonzero()[0]) if a.tokens.shape == b.tokens.shape else -1)
                for i, (a, b) in enumerate(zip(ref.sequences, out.sequences))
                if a.tokens.shape != b.tokens.shape or not torch.equal(a.tokens, b.tokens)]
        lp = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(ref.sequences, out.sequences)
                 if a.tokens.shape == b.tokens.shape)
        row.update(differ=len(diff), first=diff[:4], max_logprob_diff=lp)
    print(json.dumps(row), flush=True)
