"""`python -m gdtool run`: decode random prompts in one or all modes and say where the time went.

Prints a readable summary per model and batch size (tokens/s, steps, syncs, polls, wasted steps),
one row per mode (x polling policy x kernels), and whether the modes made the same tokens. The
replays and capture ms columns count CUDA graphs only: a graph mode that ran its step uncaptured (no
CUDA device) says "uncaptured" there instead of a figure. With
--json, one JSON document instead (per run: the config, the figures and the tokens' text; plus the
environment). Options follow the shared grammar of `gdtool.frontends.options`.

    python -m gdtool run                                   # all four modes on this machine's default model
    python -m gdtool run --model tiny-llama --mode step-graph --batch 4 --max-new-tokens 32 --show-tokens
    python -m gdtool run --model llama-1b --batch 1 16 --poll 1 16 async --do-sample --temperature 0.8 --top-p 0.9
"""
from __future__ import annotations

import os
import sys

import torch

from . import options
from ..measure import record
from ..loops.decode import decode
from ..core.modes import check_mode
from ..core.models import load_model, random_prompts


_FROM_MODEL = "(default: the model's generation config, as generate() reads it)"


def parser() -> options.Parser:
    p = options.Parser("python -m gdtool run", __doc__)
    p.add_model()
    p.add_mode(["all"])
    p.add_batch([4])
    p.add_poll(["default"], extra_help="; device-loop stops on the device and never polls")
    p.add_kernels()
    p.add_prompt_lengths("5,12", "(left-padded)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text, repeatable (needs a local checkpoint with a tokenizer; presets have none)")
    p.add_max_new_tokens(32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=options.number_type("--temperature", lambda v: 0 < v < float("inf"),
                                                             "a number > 0"),
                   help=f"sampling temperature (with --do-sample) {_FROM_MODEL}")
    p.add_argument("--top-k", type=options.int_type("--top-k", 0), metavar="N",
                   help=f"top-k (with --do-sample; 0 is off) {_FROM_MODEL}")
    p.add_argument("--top-p", type=options.number_type("--top-p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
                   help=f"nucleus top-p (with --do-sample; 1.0 is off) {_FROM_MODEL}")
    p.add_argument("--repetition-penalty", type=options.number_type("--repetition-penalty",
                                                                    lambda v: 0 < v < float("inf"), "a number > 0"),
                   help=f"repetition penalty (1.0 is off) {_FROM_MODEL}")
    p.list_option("--eos-token-id", item=options.int_item("eos token id", 0), default=[],
                  help="EOS token ids (default: the model's)")
    p.add_argument("--no-eos", action="store_true", help="disable EOS: every row runs to --max-new-tokens")
    p.add_argument("--pad-token-id", type=options.int_type("--pad-token-id", 0), metavar="N",
                   help="pad token id (default: the model's)")
    p.add_seed()
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="weights' dtype (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_device()
    p.add_int("--warmup", default=1, help="untimed decodes of each run before the reported one")
    p.add_argument("--show-tokens", action="store_true", help="print the generated token ids")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): on a GPU, PyTorch's default kernels are not "
                        "bitwise reproducible run to run over long decodes, so modes can drift apart")
    p.add_common(redo=False)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    return options.run(p, _main, args)


def _label(mode: str, poll: str, kernels: str, many_polls: bool, many_kernels: bool) -> str:
    label = mode + (f"+{kernels}" if many_kernels or kernels != "hf" else "")
    if many_polls and mode != "device-loop":
        label += f" poll {poll}"
    return label


def _main(args) -> int:
    from ..measure.polls import poll_value
    out = options.Output(args.json)
    if args.deterministic:  # before the first matmul: cuBLAS reads its workspace setting once
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    from ..core.models import default_device
    device = torch.device(args.device) if args.device else default_device()
    names = args.model or options.default_models(device.type == "cuda")
    prompt_lengths = args.prompt_len
    modes = options.expand_modes(args.mode)
    polls = list(dict.fromkeys(args.poll))
    kernels_list = list(dict.fromkeys(args.kernels))
    settings = {"do_sample": args.do_sample}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty", "pad_token_id"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.no_eos:
        settings["eos_token_id"] = None
    elif args.eos_token_id:
        settings["eos_token_id"] = args.eos_token_id
    plan = [(mode, poll, kernels) for kernels in kernels_list for mode in modes
            for poll in (polls if mode != "device-loop" else ["default"])]
    plan = list(dict.fromkeys(plan))
    batches = [None] if args.prompt else args.batch
    bar = options.progress(len(names) * len(batches) * len(plan) * (1 + args.warmup), "run", not args.no_progress,
                           unit="decode")
    runs, all_same, captured = [], True, False
    try:
        for name in names:
            model = load_model(name, seed=0, dtype=args.dtype, device=device)
            for batch in batches:
                ids, mask = _prompts(model, args, device, batch, prompt_lengths)
                results = {}
                for mode, poll, kernels in plan:
                    label = _label(mode, poll, kernels, len(polls) > 1, len(kernels_list) > 1)
                    bar.set_postfix_str(f"{name} b{ids.shape[0]} {label}", refresh=False)
                    kwargs = dict(mode=mode, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                  eos_poll_interval=None if mode == "device-loop" else poll_value(poll), **settings)
                    if kernels != "hf":
                        kwargs["kernels"] = kernels
                    for _ in range(args.warmup):
                        decode(model, ids, mask, **kwargs)
                        bar.update(1)
                    results[label] = (kernels, decode(model, ids, mask, **kwargs))
                    bar.update(1)
                    captured |= results[label][1].captured
                runs.append(_report(out, args, name, model, ids, results, device))
                all_same &= runs[-1]["tokens_identical"]
    finally:
        bar.close()
    if not captured and any(m != "eager" for m in modes):
        out.say(options.UNCAPTURED)
    out.document({"runs": runs, "tokens_identical": all_same, "captured": captured,
                  "environment": record.environment(device)})
    return 0 if all_same else 1


def _report(out, args, name, model, ids, results, device) -> dict:
    figures = {label: _figures(o) for label, (_, o) in results.items()}
    uncaptured = {label for label, (_, o) in results.items() if check_mode(o.mode).captures and not o.captured}
    _print_summary(out, name, ids, figures, uncaptured)
    # the same tokens are promised for every mode and policy with the same kernels
    same = True
    for kernels in dict.fromkeys(k for k, _ in results.values()):
        group = [o for k, o in results.values() if k == kernels]
        same &= all(torch.equal(o.tokens, group[0].tokens) for o in group)
    if len(results) > 1:
        out.say(f"tokens identical across modes: {'yes' if same else 'NO'}")
        if not same and device.type == "cuda" and not args.deterministic:
            out.say("  (on a GPU, default kernels are not run-to-run reproducible over long decodes: rerun with "
                    "--deterministic to tell that apart from a parity bug)")
    first = next(iter(results.values()))[1]
    doc = {"config": {"model": name, "batch": int(ids.shape[0]), "prompt_width": int(ids.shape[1]),
                      "max_new_tokens": args.max_new_tokens, "seed": args.seed, "runs": list(results),
                      "do_sample": args.do_sample, "no_eos": args.no_eos},
           "figures": figures, "tokens_identical": same}
    tokenizer = getattr(model, "gdtool_tokenizer", None)
    if tokenizer is not None:
        doc["text"] = tokenizer.batch_decode(first.tokens, skip_special_tokens=True)
        for row, text in enumerate(doc["text"]):
            # text that decodes to nothing (ids the tokenizer does not know) is shown as ids
            out.say(f"[{row}] {text}" if text.strip() else f"[{row}] (no text) token ids {first.tokens[row].tolist()}")
    elif os.path.isdir(os.path.expanduser(name)):
        out.say(f"no tokenizer in {name}: the generated tokens as ids")
        doc["text"] = None
        for row, ids in enumerate(first.tokens.tolist()):
            out.say(f"[{row}] {ids}")
    if args.show_tokens:
        doc["tokens"] = {label: o.tokens.tolist() for label, (_, o) in results.items()}
        for label, (_, o) in results.items():
            out.say(f"{label}: {o.tokens.tolist()}")
    return doc


def _prompts(model, args, device, batch, lengths):
    if args.prompt:
        tokenizer = getattr(model, "gdtool_tokenizer", None)
        if tokenizer is None:
            if os.path.isdir(getattr(model, "name_or_path", "") or ""):
                raise ValueError("--prompt needs a tokenizer and this checkpoint folder has none (no tokenizer files "
                                 "there): use --prompt-len instead, or add the tokenizer's files to the folder")
            raise ValueError("--prompt needs a local checkpoint with a tokenizer; presets have random weights and "
                             "no tokenizer: use --prompt-len instead")
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer(args.prompt, return_tensors="pt", padding=True)
        return enc.input_ids.to(device), enc.attention_mask.to(device)
    prompt = random_prompts(model, batch=batch, lengths=lengths, seed=args.seed)
    return prompt.input_ids, prompt.attention_mask


def _figures(out) -> dict:
    decode_s = out.timings.get("decode_s", float("nan"))
    return {"tokens_per_s": out.new_tokens / decode_s if decode_s else None,
            "ms_per_step": 1000 * decode_s / max(out.steps, 1), "new_tokens": out.new_tokens,
            "steps": out.steps, "replays": out.replays, "host_syncs": out.host_syncs, "polls": out.polls,
            "wasted_steps": out.wasted_steps, "captures": out.captures, "captured": out.captured,
            "launches": out.launches,
            **{k: round(v, 6) for k, v in out.timings.items()}, **getattr(out, "memory", {})}


def _print_summary(out, name, ids, figures, uncaptured=frozenset()) -> None:
    """The table; the runs named in `uncaptured` (graph modes that ran their step uncaptured) say so in the
    replays and capture ms columns, where a figure would count CUDA-graph work they did not do."""
    out.say(f"model {name}, batch {ids.shape[0]}, prompt width {ids.shape[1]}")
    width = max(14, *(len(label) + 2 for label in figures))
    out.say(f"{'run':<{width}}{'tokens/s':>10}{'ms/step':>9}{'tokens':>8}{'steps':>7}{'replays':>11}{'syncs':>7}"
            f"{'polls':>7}{'wasted':>8}{'prefill ms':>12}{'capture ms':>12}{'KV MiB':>9}{'pool MiB':>10}")
    for label, f in figures.items():
        replays = "uncaptured" if label in uncaptured else f"{f['replays']}"
        capture_ms = "uncaptured" if label in uncaptured else f"{1000 * (f['warmup_s'] + f['capture_s']):.2f}"
        out.say(f"{label:<{width}}{f['tokens_per_s']:>10.1f}{f['ms_per_step']:>9.3f}{f['new_tokens']:>8}"
                f"{f['steps']:>7}{replays:>11}{f['host_syncs']:>7}{f['polls']:>7}{f['wasted_steps']:>8}"
                f"{1000 * f['prefill_s']:>12.2f}{capture_ms:>12}"
                f"{f.get('kv_cache_bytes', 0) / 2**20:>9.2f}{f.get('graph_pool_bytes', 0) / 2**20:>10.2f}")


if __name__ == "__main__":
    sys.exit(main())
