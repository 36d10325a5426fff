"""Every mode against generate(static) on real-shaped presets, bit for bit (tokens and processed scores).

The zoo test (`tests/test_zoo.py`) checks every architecture on tiny shapes; this checks the real
shapes of the MoE and sliding-window presets on a GPU, where kernels, experts implementations and
window phases are the ones a user meets. Deterministic algorithms on (PyTorch's default kernels are
not run-to-run reproducible on a GPU, for generate() itself too).

    python profiles/preset_parity.py --model gpt-oss-20b --out profiles/h200/parity
    python profiles/preset_parity.py --model tiny-gemma3 --new-tokens 24          # CPU, seconds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import gdtool
from gdtool.core import feed

CASES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)}


def reference(model, ids, mask, new_tokens, seed, **settings):
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, cache_implementation="static",
                         disable_compile=True, output_scores=True, return_dict_in_generate=True, **settings)
    return out.sequences[:, ids.shape[1]:].cpu(), out.scores


def compare(model, ids, mask, new_tokens, seed, mode, settings) -> dict:
    ref_tokens, ref_scores = reference(model, ids, mask, new_tokens, seed, **settings)
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    t0 = time.perf_counter()
    out = gdtool.decode(model, ids, mask, mode=mode, max_new_tokens=new_tokens, seed=seed, return_scores=True,
                        **settings)
    seconds = time.perf_counter() - t0
    same_tokens = out.tokens.shape == ref_tokens.shape and torch.equal(out.tokens, ref_tokens)
    first_diff = next((i for i, (a, b) in enumerate(zip(out.scores, ref_scores)) if not torch.equal(a, b)), None)
    return {"mode": mode, "tokens_equal": bool(same_tokens), "scores_equal": same_tokens and first_diff is None
            and len(out.scores) == len(ref_scores), "first_score_diff": first_diff, "steps": out.steps,
            "captures": out.captures, "replays": out.replays, "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", action="append", help="preset (repeatable)")
    parser.add_argument("--batch", type=int, default=4, help="prompts, left-padded to different lengths")
    parser.add_argument("--prompt-len", type=int, default=160, help="longest prompt")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per row")
    parser.add_argument("--out", default=None, help="folder for parity_<model>.json")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True, warn_only=True)
    failed = 0
    for name in args.model or ["tiny-gemma3"]:
        model = gdtool.load_model(name)
        prompt = gdtool.random_prompts(model, batch=args.batch, lengths=(args.prompt_len // 2, args.prompt_len), seed=0)
        rows = []
        for case, settings in CASES.items():
            settings = dict(settings, eos_token_id=None, pad_token_id=0)
            for mode in gdtool.MODES:
                try:
                    row = compare(model, prompt.input_ids, prompt.attention_mask, args.new_tokens, 7, mode, settings)
                except feed.Unsupported as refusal:
                    row = {"mode": mode, "refused": str(refusal)}
                row.update(model=name, case=case, experts=feed.experts_implementation(model))
                rows.append(row)
                failed += not row.get("scores_equal", False)
                print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, f"parity_{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
