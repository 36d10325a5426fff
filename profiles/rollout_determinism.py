"""Is a bf16 rollout reproducible on this GPU, run to run and between refill policies and modes?

On llama-1b (random weights, real shapes), 48 prompts of 128 tokens through 16 slots, 48 new tokens at forced
lengths: the same forward three times at the rollout's shapes; then rollouts, each a digest of its tokens:
static and host refill eager twice each; host eager after the allocator's free memory was filled with 0, NaN and
1e4 (a read of memory nothing wrote would change the digest or make NaN); and host eager, host step-graph and the
device loop under sdpa's math kernel. Measured on an H100 (profiles/h100/README.md, 2026-12-06): with the default
kernels every run differs from every other, static ones included; under the math kernel all agree.

    python profiles/rollout_determinism.py llama-1b
"""
import hashlib
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import gdtool
from gdtool.measure import workloads

name = sys.argv[1]
count, slots, n = 48, 16, 48
model = gdtool.load_model(name, device="cuda", dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(0)
prompts = torch.randint(3, 1000, (count, 128), generator=gen).tolist()
targets = workloads.geometric(mean=n // 2, cap=n).draw(batch=count, seed=0).tolist()
common = dict(max_new_tokens=n, eos_token_id=2, pad_token_id=0, target_lengths=targets)


def digest(out):
    h = hashlib.sha1()
    for s in out.sequences:
        h.update(s.tokens.numpy().tobytes())
    return h.hexdigest()[:10]


def poison(value):
    torch.cuda.synchronize()
    big = [torch.full((1 << 28,), value, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    small = [torch.full((1 << 17,), value, dtype=torch.bfloat16, device="cuda") for _ in range(4000)]
    del big, small


def kernels():
    """The same forward twice, at the rollout's shapes: bitwise equal?"""
    ids = torch.tensor(prompts[:1], device="cuda")
    rows = {}
    with torch.inference_mode():
        a = [model(input_ids=ids).logits for _ in range(3)]
        rows["prefill_1x128"] = all(torch.equal(a[0], x) for x in a[1:])
        ids16 = torch.tensor([p[:1] for p in prompts[:16]], device="cuda")
        b = [model(input_ids=ids16).logits for _ in range(3)]
        rows["decode_16x1"] = all(torch.equal(b[0], x) for x in b[1:])
        w = model.lm_head.weight
        h = torch.randn(16, w.shape[1], device="cuda", dtype=w.dtype)
        c = [h @ w.T for _ in range(5)]
        rows["lm_head_16"] = all(torch.equal(c[0], x) for x in c[1:])
    print(json.dumps(dict(check="kernels", **rows)), flush=True)


kernels()
runs = [("off", "eager", None, None), ("off", "eager", None, None),
        ("host", "eager", None, None), ("host", "eager", None, None), ("host", "eager", None, 0.0),
        ("host", "eager", None, float("nan")), ("host", "eager", None, 1e4),
        ("host", "eager", "math", None), ("host", "eager", "math", None),
        ("host", "step-graph", None, None), ("host", "step-graph", None, float("nan")),
        ("host", "step-graph", "math", None), ("host", "step-graph", "math", None),
        ("device", "device-loop", "math", None), ("device", "device-loop", "math", None)]
for refill, mode, backend, fill in runs:
    if fill is not None:
        poison(fill)
    ctx = sdpa_kernel([SDPBackend.MATH]) if backend == "math" else sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])
    with ctx:
        out = gdtool.rollout(model, prompts, slots=slots, refill=refill, mode=mode, **common)
    nan = sum(int(torch.isnan(s.logprobs).sum()) for s in out.sequences if s.logprobs is not None)
    print(json.dumps(dict(refill=refill, mode=mode, sdpa=backend or "default", poison=str(fill), digest=digest(out),
                          nan_logprobs=nan, lengths_ok=[s.length for s in out.sequences] == targets)), flush=True)
