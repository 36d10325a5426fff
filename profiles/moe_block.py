"""One MoE block in isolation: gdtool's experts kernels against HF's experts implementations, per batch.

A decode step of a mixture of experts at small batch must read the router and the routed experts'
weights once; the block's floor is those bytes at the copy bandwidth. This times one Qwen3-30B-A3B
block (128 experts, 8 active, hidden 2048, expert width 768; random weights in bf16) each way, every
variant captured in a CUDA graph (what a decode step replays) and timed over 200 replays:

    gdtool      torch.ops.gdtool.moe_block as plan() sends it (the small kernels up to 16 tokens, the
                grouped ones up to 64; HF's block where the plan refuses, e.g. an untested path on CUDA
                without GDTOOL_UNTESTED_KERNELS=1)
    small       the small-batch kernels called directly (3 kernels: router, routing + gate/up, down)
    grouped     the grouped kernels called directly (router, route, align, gate/up, down, combine)
    batched_mm  HF's block with experts_implementation='batched_mm' (what generate() decodes with)
    grouped_mm  HF's block with experts_implementation='grouped_mm' (the default)

and prints µs per block, GB/s against the bytes that must be read, and the largest difference
from batched_mm. The last stdout line is one JSON document.

    python profiles/moe_block.py                         # batch 1, 4, 16 on the GPU
    python profiles/moe_block.py --batch 1 --layers 4    # 4 blocks in a row (less launch gap per block)
    GDTOOL_UNTESTED_KERNELS=1 python profiles/moe_block.py --batch 8,16,17,24,32,48,64   # small vs grouped crossover
"""
from __future__ import annotations

import argparse
import json

import torch


def build_block(batch_tokens: int, dtype=torch.bfloat16, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(config).to(dtype)
        torch.nn.init.normal_(block.gate.weight, std=0.05)
        torch.nn.init.normal_(block.experts.gate_up_proj, std=2048 ** -0.5)
        torch.nn.init.normal_(block.experts.down_proj, std=768 ** -0.5)
    return config, block.eval()


def must_read(batch: int, e=128, k=8, h=2048, i=768, dtype_bytes=2) -> float:
    hit = e * (1 - (1 - k / e) ** batch)   # experts hit, on average, by uniform routing
    return (e * h + hit * 3 * h * i) * dtype_bytes


def time_graph(fn, replays: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main(argv=None):
    import gdtool.kernels.experts as experts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--layers", type=int, default=1, help="blocks run back to back per replay")
    args = p.parse_args(argv)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        config, block = build_block(batch)
        blocks = [block] * args.layers
        x = torch.randn(batch, 1, 2048, device="cuda", dtype=torch.bfloat16)
        plan = experts.plan(torch.nn.ModuleList([block]), batch)
        out = {}

        def ours():
            with experts.scope(plan):
                for b in blocks:
                    out["gdtool"] = b(x)
        variants = {"gdtool": ours}
        weights = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, 8, True, False)
        flat = x.view(batch, -1)
        for name, kernels in (("small", experts.block_triton), ("grouped", experts.block_grouped)):
            def direct(name=name, kernels=kernels):
                for _ in blocks:
                    out[name] = kernels(flat, *weights).view_as(x)
            variants[name] = direct
        for impl in ("batched_mm", "grouped_mm"):
            def hf(impl=impl):
                config._experts_implementation = impl
                for b in blocks:
                    out[impl] = b(x)
            variants[impl] = hf
        with torch.inference_mode():
            timed = {name: time_graph(fn) / args.layers for name, fn in variants.items()}
            for fn in variants.values():
                fn()
        for name, us in timed.items():
            diff = float((out[name].float() - out["batched_mm"].float()).abs().max())
            rows.append(dict(batch=batch, variant=name, us_per_block=us, gb_s=must_read(batch) / us / 1e3,
                             max_abs_diff_vs_batched_mm=diff))
            print(f"batch {batch:3d}  {name:11s} {us:8.1f} us/block  {rows[-1]['gb_s']:7.0f} GB/s  "
                  f"max |diff| vs batched_mm {diff:.3g}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
