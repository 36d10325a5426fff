"""`python -m gdtool run`: decode random prompts in one or all modes and say where the time went.

Prints a readable summary (tokens/s, steps, syncs, polls, wasted steps) per mode, then one JSON
line with the config, the figures, the environment and, with --show-tokens, the tokens.

    python -m gdtool run                                   # all three modes on the default model
    python -m gdtool run --model tiny-llama --mode step-graph --batch 4 --max-new-tokens 32 --show-tokens
    python -m gdtool run --model llama-1b --mode all --batch 16 --do-sample --temperature 0.8 --top-p 0.9
"""
from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from .decode import MODES, decode
from .models import PRESETS, default_device, load_model, random_prompts


def environment(device: torch.device | str | None = None) -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device) if device is not None else str(default_device())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gdtool run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"preset ({', '.join(PRESETS)}) or local checkpoint path; default llama-1b on a GPU, "
                        "tiny-llama on a CPU")
    p.add_argument("--mode", default="all", choices=[*MODES, "all"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", default="5,12", help="prompt lengths 'lo,hi' (left-padded) or one length")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text (repeatable; needs a local checkpoint with a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--eos-token-id", type=_ints, help="comma-separated EOS ids (default: the model's)")
    p.add_argument("--no-eos", action="store_true", help="disable EOS: every row runs to --max-new-tokens")
    p.add_argument("--pad-token-id", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-poll-interval", default=None, help="k >= 1, 0 (never) or 'async'; default per mode")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per mode before the reported one")
    p.add_argument("--show-tokens", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): on a GPU, PyTorch's default kernels are not "
                        "bitwise reproducible run to run over long decodes, so modes can drift apart")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.deterministic:  # before the first matmul: cuBLAS reads its workspace setting once
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device) if args.device else default_device()
    name = args.model or ("llama-1b" if device.type == "cuda" else "tiny-llama")
    model = load_model(name, seed=0, dtype=args.dtype, device=device)
    ids, mask = _prompts(model, args, device)
    settings = {"do_sample": args.do_sample}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty", "pad_token_id"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.no_eos:
        settings["eos_token_id"] = None
    elif args.eos_token_id is not None:
        settings["eos_token_id"] = args.eos_token_id
    poll = args.eos_poll_interval
    poll = None if poll is None else (poll if poll == "async" else int(poll))
    modes = MODES if args.mode == "all" else (args.mode,)
    results = {}
    for mode in modes:
        mode_poll = None if mode == "device-loop" else poll  # the device loop stops exactly: nothing to poll
        for _ in range(args.warmup):
            decode(model, ids, mask, mode=mode, max_new_tokens=args.max_new_tokens, seed=args.seed,
                   eos_poll_interval=mode_poll, **settings)
        results[mode] = decode(model, ids, mask, mode=mode, max_new_tokens=args.max_new_tokens, seed=args.seed,
                               eos_poll_interval=mode_poll, **settings)
    figures = {mode: _figures(out) for mode, out in results.items()}
    _print_summary(name, ids, figures)
    first = next(iter(results.values()))
    same = all(torch.equal(out.tokens, first.tokens) for out in results.values())
    if len(results) > 1:
        print(f"tokens identical across modes: {'yes' if same else 'NO'}")
        if not same and device.type == "cuda" and not args.deterministic:
            print("  (on a GPU, default kernels are not run-to-run reproducible over long decodes: rerun with "
                  "--deterministic to tell that apart from a parity bug)")
    record = {"config": {"model": name, "batch": ids.shape[0], "prompt_width": ids.shape[1],
                         "max_new_tokens": args.max_new_tokens, "seed": args.seed, "modes": list(modes),
                         "eos_poll_interval": poll, **settings},
              "figures": figures, "tokens_identical": same, "environment": environment(device)}
    tokenizer = getattr(model, "gdtool_tokenizer", None)
    if tokenizer is not None:
        record["text"] = tokenizer.batch_decode(first.tokens, skip_special_tokens=True)
        for row, text in enumerate(record["text"]):
            print(f"[{row}] {text}")
    if args.show_tokens:
        record["tokens"] = {mode: out.tokens.tolist() for mode, out in results.items()}
        for mode, out in results.items():
            print(f"{mode}: {out.tokens.tolist()}")
    print(json.dumps(record))
    return 0 if same else 1


def _prompts(model, args, device):
    if args.prompt:
        tokenizer = getattr(model, "gdtool_tokenizer", None)
        if tokenizer is None:
            raise SystemExit("--prompt needs a local checkpoint with a tokenizer; presets have random weights and "
                             "no tokenizer: use --prompt-len instead")
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer(args.prompt, return_tensors="pt", padding=True)
        return enc.input_ids.to(device), enc.attention_mask.to(device)
    lengths = _ints(args.prompt_len)
    lengths = (lengths[0], lengths[-1])
    prompt = random_prompts(model, batch=args.batch, lengths=lengths, seed=args.seed)
    return prompt.input_ids, prompt.attention_mask


def _figures(out) -> dict:
    decode_s = out.timings.get("decode_s", float("nan"))
    return {"tokens_per_s": out.new_tokens / decode_s if decode_s else None,
            "ms_per_step": 1000 * decode_s / max(out.steps, 1), "new_tokens": out.new_tokens,
            "steps": out.steps, "replays": out.replays, "host_syncs": out.host_syncs, "polls": out.polls,
            "wasted_steps": out.wasted_steps, "captures": out.captures,
            **{k: round(v, 6) for k, v in out.timings.items()}, **getattr(out, "memory", {})}


def _print_summary(name, ids, figures) -> None:
    print(f"model {name}, batch {ids.shape[0]}, prompt width {ids.shape[1]}")
    header = f"{'mode':<14}{'tokens/s':>10}{'ms/step':>9}{'tokens':>8}{'steps':>7}{'replays':>9}{'syncs':>7}" \
             f"{'polls':>7}{'wasted':>8}{'prefill ms':>12}{'capture ms':>12}{'KV MiB':>9}{'pool MiB':>10}"
    print(header)
    for mode, f in figures.items():
        print(f"{mode:<14}{f['tokens_per_s']:>10.1f}{f['ms_per_step']:>9.3f}{f['new_tokens']:>8}{f['steps']:>7}"
              f"{f['replays']:>9}{f['host_syncs']:>7}{f['polls']:>7}{f['wasted_steps']:>8}"
              f"{1000 * f['prefill_s']:>12.2f}{1000 * (f['warmup_s'] + f['capture_s']):>12.2f}"
              f"{f.get('kv_cache_bytes', 0) / 2**20:>9.2f}{f.get('graph_pool_bytes', 0) / 2**20:>10.2f}")


if __name__ == "__main__":
    sys.exit(main())
