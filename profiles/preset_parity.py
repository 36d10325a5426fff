"""Every mode against generate(static) on real-shaped presets, bit for bit (tokens and processed scores).

The zoo test (`tests/test_zoo.py`) and the window sweep (`tests/test_windows.py`) check every
architecture on tiny shapes; this checks the real shapes of the MoE and sliding-window presets on a
GPU, where kernels, experts implementations and window phases are the ones a user meets:

- prompt widths around the smallest sliding window: shorter, exactly one and two short of it (the
  window fills at the first or second decode step), and longer (full from the prefill);
- greedy and sampling (with a repetition penalty);
- a reference that reproduces itself: generate() runs twice per case, and a case whose reference
  differs from itself is reported as such (no parity claim can be made against it). `--attention`
  picks the SDPA backend for both sides (`math`, `efficient`, `flash`, `cudnn`; `default` lets torch
  choose), and `--reference-only` checks only whether generate() reproduces itself, per backend.

Deterministic algorithms are on (PyTorch's default kernels are not run-to-run reproducible on a GPU).

    python profiles/preset_parity.py --model gemma-3-1b --reference-only --attention default efficient math cudnn
    python profiles/preset_parity.py --model gpt-oss-20b --model gemma-3-1b --attention efficient --out profiles/h200/parity
    python profiles/preset_parity.py --model tiny-gemma3 --new-tokens 12          # CPU, seconds
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import gdtool
from gdtool.core import compat, feed

CASES = {"greedy": dict(do_sample=False),
         "sampling": dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)}
BACKENDS = ("default", "math", "efficient", "flash", "cudnn")


def attention(backend: str):
    """The SDPA backend both sides run under (`default`: torch's choice)."""
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend])


def smallest_window(model) -> int | None:
    cache = compat.static_cache(model, 8)
    config = model.config.get_text_config()
    sliding = any(compat.is_sliding(layer) for layer in compat.cache_layers(cache))
    return getattr(config, "sliding_window", None) if sliding else None


def widths_for(model, longest: int) -> list[int]:
    """Padded prompt widths: around the smallest sliding window where there is one, else `longest`."""
    window = smallest_window(model)
    if not window:
        return [longest]
    return sorted({max(2, window // 2), window - 2, window - 1, window + 32})


def reference(model, ids, mask, new_tokens, seed, **settings):
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, cache_implementation="static",
                         disable_compile=True, output_scores=True, return_dict_in_generate=True, **settings)
    return out.sequences[:, ids.shape[1]:].cpu(), out.scores


def first_difference(scores, ref_scores) -> int | None:
    if len(scores) != len(ref_scores):
        return min(len(scores), len(ref_scores))
    return next((i for i, (a, b) in enumerate(zip(scores, ref_scores)) if not torch.equal(a, b)), None)


def reproducible(model, ids, mask, new_tokens, seed, settings) -> dict:
    """generate() twice: does the reference reproduce itself?"""
    tokens, scores = reference(model, ids, mask, new_tokens, seed, **settings)
    again, again_scores = reference(model, ids, mask, new_tokens, seed, **settings)
    diff = first_difference(again_scores, scores)
    return {"reference_reproducible": diff is None and torch.equal(tokens, again), "reference_self_diff": diff,
            "ref": (tokens, scores)}


def compare(model, ids, mask, new_tokens, seed, mode, settings, ref) -> dict:
    ref_tokens, ref_scores = ref
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    t0 = time.perf_counter()
    out = gdtool.decode(model, ids, mask, mode=mode, max_new_tokens=new_tokens, seed=seed, return_scores=True,
                        **settings)
    seconds = time.perf_counter() - t0
    same_tokens = out.tokens.shape == ref_tokens.shape and torch.equal(out.tokens, ref_tokens)
    diff = first_difference(out.scores, ref_scores)
    return {"mode": mode, "tokens_equal": bool(same_tokens), "scores_equal": bool(same_tokens and diff is None),
            "first_score_diff": diff, "steps": out.steps, "captures": out.captures, "replays": out.replays,
            "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", action="append", help="preset (repeatable; default tiny-gemma3)")
    parser.add_argument("--batch", type=int, default=4, help="prompts, left-padded to different lengths")
    parser.add_argument("--prompt-len", type=int, default=160, help="padded prompt width of a model without windows")
    parser.add_argument("--widths", type=int, nargs="*", help="padded prompt widths (default: around the window)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per row")
    parser.add_argument("--attention", nargs="+", default=["default"], choices=BACKENDS,
                        help="SDPA backends to run both sides under, one pass each")
    parser.add_argument("--reference-only", action="store_true", help="only check that generate() reproduces itself")
    parser.add_argument("--out", default=None, help="folder for parity_<model>.json")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True, warn_only=True)
    failed = 0
    for name in args.model or ["tiny-gemma3"]:
        model = gdtool.load_model(name)
        rows = []
        for width in args.widths or widths_for(model, args.prompt_len):
            prompt = gdtool.random_prompts(model, batch=args.batch, lengths=(max(1, width // 2), width), seed=width)
            for backend in args.attention:
                for case, settings in CASES.items():
                    settings = dict(settings, eos_token_id=None, pad_token_id=0)
                    where = dict(model=name, width=width, window=smallest_window(model), attention=backend, case=case,
                                 attn_implementation=model.config._attn_implementation,
                                 experts=feed.experts_implementation(model))
                    with attention(backend):
                        check = reproducible(model, prompt.input_ids, prompt.attention_mask, args.new_tokens, 7,
                                             settings)
                        ref = check.pop("ref")
                        if args.reference_only or not check["reference_reproducible"]:
                            row = dict(where, **check)
                            failed += not check["reference_reproducible"] and not args.reference_only
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                            continue
                        for mode in gdtool.MODES:
                            try:
                                row = compare(model, prompt.input_ids, prompt.attention_mask, args.new_tokens, 7,
                                              mode, settings, ref)
                            except feed.Unsupported as refusal:
                                row = {"mode": mode, "refused": str(refusal)}
                            row = dict(where, **check, **row)
                            rows.append(row)
                            failed += not row.get("scores_equal", False)
                            print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            suffix = "_reference" if args.reference_only else ""
            Path(args.out, f"parity_{name}{suffix}.json").write_text(json.dumps(rows, indent=1) + "\n")
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
