"""Are long greedy decodes reproducible, run to run and mode to mode, on this GPU?

Runs generate() (static cache, no compile) and every gdtool mode twice on llama-1b, greedy, EOS off,
for a padded and an unpadded batch, and prints for each pair the first step where tokens differ.
A difference between two runs of the same mode is run-to-run nondeterminism of the kernels; one
that appears only between modes would be a parity bug.

    python profiles/determinism.py --model llama-1b --batch 1,16 --max-new-tokens 256
"""
import argparse
import itertools
import json

import torch

import gdtool


def first_difference(a: torch.Tensor, b: torch.Tensor):
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a != b).any(0).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8")
    args = p.parse_args()
    if args.deterministic:
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    model = gdtool.load_model(args.model, seed=0)
    report = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for lengths in [(128, 128), (96, 128)]:
            prompt = gdtool.random_prompts(model, batch=batch, lengths=lengths, seed=0)
            runs = {}
            for rep in range(2):
                torch.manual_seed(rep)  # no draw depends on it (greedy); kernels must not either
                if hasattr(model, "_previous_max_cache_length"):
                    del model._previous_max_cache_length
                g = model.generate(prompt.input_ids, attention_mask=prompt.attention_mask,
                                   max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                                   cache_implementation="static", disable_compile=True)
                runs[f"generate#{rep}"] = g[:, prompt.input_ids.shape[1]:].cpu()
                for mode in gdtool.MODES:
                    out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=mode,
                                        max_new_tokens=args.max_new_tokens, eos_token_id=None)
                    runs[f"{mode}#{rep}"] = out.tokens
            pairs = {f"{a} vs {b}": first_difference(runs[a], runs[b]) for a, b in itertools.combinations(runs, 2)}
            row = {"batch": batch, "lengths": lengths, "padded": lengths[0] != lengths[1],
                   "first_difference": {k: v for k, v in pairs.items() if v is not None},
                   "identical_pairs": sum(v is None for v in pairs.values()), "pairs": len(pairs)}
            print(json.dumps(row), flush=True)
            report.append(row)
    print(json.dumps({"determinism": report, "deterministic_algorithms": args.deterministic, "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))


if __name__ == "__main__":
    main()
