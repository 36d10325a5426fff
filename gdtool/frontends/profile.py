"""`python -m gdtool profile`: per decode step, host vs device time, in-process or under Nsight Systems.

In-process (`gdtool.measure.timing`, no profiler attached): every config is timed first, then, on a GPU,
each gets its kernel pass (a second identical decode under torch.profiler) for device busy time;
torch.profiler leaves CUPTI attached and would tax every later launch. With --nsys, one profiled
process per config under Nsight Systems, exported to sqlite and read back (`gdtool.measure.nsys`); --read
reads exports someone already made. Results go to --out (default: results/profile, results/nsys with
--nsys; the command ends by printing where): steps.csv (one row per step), summary.csv
(per metric: median, p20, p80, mean, total, per_token), env.json; a rerun skips the configs already
there (--redo measures them again).

    python -m gdtool profile                                          # this machine's default model, every mode
    python -m gdtool profile --model llama-1b --batch 1 16 --max-new-tokens 48 --no-eos --out my-timing
    python -m gdtool profile --nsys --model llama-1b --batch 1 16 --trace graph --no-eos --out my-session
    python -m gdtool profile --read my-session/llama-1b_b1_step-graph_graph_noeos.sqlite.gz
"""
from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..measure import nsys, record
from . import estimate, options

NSYS_ONLY = ("trace", "repeat", "keep_report", "fixture")
IN_PROCESS_OUT, NSYS_OUT = "results/profile", "results/nsys"
NSYS_SETTINGS = {"fuse_projections": (options._flag, "true or false (--nsys only)")}
IN_PROCESS_ONLY = ("warmup", "no_busy")


@dataclass(frozen=True)
class ProfileConfig(record.Config):
    """One in-process profile: a model, batch size and mode with its decode settings."""
    model: str
    batch: int
    mode: str
    max_new_tokens: int = 48
    prompt_len: int = 128
    seed: int = 0
    eos: bool = True
    poll: str = "default"
    kernels: str = "hf"
    settings: tuple = ()          # (("key", value), ...): extra gdtool.decode arguments

    def name_parts(self) -> list:
        return [Path(self.model).name or self.model, f"b{self.batch}", self.mode,
                f"n{self.max_new_tokens}" if self.max_new_tokens != 48 else "",
                f"p{self.prompt_len}" if self.prompt_len != 128 else "",
                f"poll{self.poll}" if self.poll != "default" else "",
                self.kernels if self.kernels != "hf" else "", "" if self.eos else "noeos",
                *(f"{k}{v}" for k, v in self.settings)]

    def decode_kwargs(self) -> dict:
        from ..measure.polls import poll_value
        kwargs = dict(self.settings, max_new_tokens=self.max_new_tokens, seed=self.seed)
        if not self.eos:
            kwargs["eos_token_id"] = None
        if self.poll != "default" and self.mode != "device-loop":
            kwargs["eos_poll_interval"] = poll_value(self.poll)
        if self.kernels != "hf":
            kwargs["kernels"] = self.kernels
        return kwargs


def parser() -> options.Parser:
    p = options.Parser("python -m gdtool profile", __doc__)
    p.add_model()
    p.add_mode(["all"], extra_help=" (with --nsys, all is eager, forward-graph, step-graph)")
    p.add_batch([1])
    p.add_poll(["default"])
    p.add_kernels()
    p.add_max_new_tokens(48, minimum=2, help="tokens per row (decode steps: one fewer)")
    p.add_prompt_len(128)
    p.add_seed()
    p.add_argument("--no-eos", action="store_true", help="eos_token_id=None: every decode runs all its steps "
                   "(the host still polls on schedule)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra gdtool.decode argument, repeatable, e.g. --set repetition_penalty=1.1; KEY is one of "
                        f"{', '.join(options.SET_KEYS)}, or a generate() setting gdtool refuses set to off; with "
                        "--nsys also fuse_projections=true (fuse q/k/v and gate/up first, as bench --fuse-projections)")
    p.add_out(None, f"results folder, made if missing (default: {IN_PROCESS_OUT} in-process, {NSYS_OUT} with --nsys)")
    inproc = p.add_argument_group("in-process only")
    inproc.add_argument("--warmup", type=options.int_type("--warmup", 0), default=None, metavar="N",
                        help="untimed decodes before each timed one (default: 1)")
    inproc.add_argument("--no-busy", "--no-kernels", action="store_true",
                        help="skip the torch.profiler kernel pass: device_busy_us stays NaN")
    traced = p.add_argument_group("Nsight Systems (--nsys, --read)")
    traced.add_argument("--nsys", action="store_true", help="record each config under Nsight Systems")
    traced.add_argument("--trace", action=options.ListAction, item=options.choice_item("trace", nsys.TRACES),
                        default=[], metavar="TRACE",
                        help="--cuda-graph-trace: graph (host time) and/or node (kernels inside replays) "
                             "(default: graph)")
    traced.add_argument("--repeat", type=options.int_type("--repeat", 1), default=None, metavar="N",
                        help="decodes per profiled process; the summary reads the last (default: 2)")
    traced.add_argument("--keep-report", action="store_true", help="also keep the .nsys-rep files (for the GUI)")
    traced.add_argument("--fixture", action="store_true", help="write slimmed exports (test fixtures)")
    traced.add_argument("--read", nargs="+", metavar="EXPORT", default=None,
                        help="read existing exports (sqlite, plain or .gz) instead of recording")
    p.add_common()
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    traced = args.nsys or args.read
    given = {k for k in NSYS_ONLY if getattr(args, k) not in (None, False, [])}
    if given and not traced:
        p.error(f"--{sorted(given)[0].replace('_', '-')} is an Nsight Systems option; add --nsys (or drop it)")
    given = {k for k in IN_PROCESS_ONLY if getattr(args, k) not in (None, False)}
    if given and traced:
        p.error(f"--{sorted(given)[0].replace('_', '-')} is an in-process option; drop it with --nsys / --read")
    # fuse_projections is no decode argument: the --nsys target fuses the model before decoding
    args.settings = options.settings(args.set, p, extra=NSYS_SETTINGS)
    if "fuse_projections" in args.settings and not traced:
        p.error("--set fuse_projections is an Nsight Systems setting; add --nsys (or drop it)")
    if args.read:
        return options.run(p, _read, args)
    modes = None
    if args.nsys:
        modes = options.expand_modes(args.mode, nsys.MODES)
        bad = [m for m in modes if m not in nsys.MODES]
        if bad:
            p.error(f"--nsys traces {', '.join(nsys.MODES)}, not {', '.join(bad)}: drop it (the in-process profile "
                    "times device-loop)")
    # the last check, before any work: a path it cannot write fails now (and a refused command makes no folder)
    args.out = p.out_path(args.out or (NSYS_OUT if args.nsys else IN_PROCESS_OUT))
    if args.nsys:
        return options.run(p, lambda a: _nsys(a, modes), args)
    return options.run(p, _in_process, args)


# ---------------------------------------------------------------------------------------------
# in-process

def _configs(args, models) -> list[ProfileConfig]:
    settings = tuple(sorted(args.settings.items()))
    return [ProfileConfig(model, batch, mode, args.max_new_tokens, args.prompt_len, args.seed, not args.no_eos,
                          poll if mode != "device-loop" else "default", kernels, settings)
            for model in models for batch in args.batch for kernels in dict.fromkeys(args.kernels)
            for mode in options.expand_modes(args.mode)
            for poll in (dict.fromkeys(args.poll) if mode != "device-loop" else ["default"])]


def _cuda() -> bool:
    """Whether kernel passes can run here (a CUDA device): a seam for the tests."""
    import torch
    return torch.cuda.is_available()


def _in_process(args) -> int:
    from ..measure import timing
    from ..core.models import load_model, random_prompts
    out = options.Output(args.json)
    cuda = _cuda()
    models = args.model or options.default_models(cuda)
    configs = list(dict.fromkeys(_configs(args, models)))
    folder = Path(args.out or IN_PROCESS_OUT)
    folder.mkdir(parents=True, exist_ok=True)
    env = record.environment()
    record.write_sidecar(folder / "env.json", env, session=dict(configs=[c.name for c in configs]))
    dtypes = {"model": str, "mode": str, "poll": str, "kernels": str, "settings": str, "metric": str}
    steps_file = record.Results(folder / "steps.csv", dtype=dtypes, first=())
    summary_file = record.Results(folder / "summary.csv", dtype=dtypes, first=())
    busy = cuda and not args.no_busy

    def done(cfg) -> bool:
        rows = summary_file.rows(cfg)
        if rows.empty or args.redo:
            return False
        if busy and cfg.mode != "device-loop":
            return bool(rows.loc[rows["metric"] == "device_busy_us", "per_token"].notna().all())
        return True

    todo = [cfg for cfg in configs if not done(cfg)]
    if not todo:  # else each model's line, once it loads, says what is coming
        out.say(estimate.announce("profile", 0, len(configs), str(folder)))
    # The bar counts configs: timed first, then (on CUDA) again through their kernel passes.
    bar = options.progress(len(todo), "profile: timing", not args.no_progress)
    results, loaded = [], {}
    warmup = 1 if args.warmup is None else args.warmup

    def write(cfg, res):  # after every timed config and every kernel pass: a crash keeps what was measured
        columns = cfg.columns()
        steps_file.replace(cfg, res.steps.assign(**columns))
        summary_file.replace(cfg, res.summary.reset_index().assign(**columns, notes=" | ".join(res.notes)))
        steps_file.save()
        summary_file.save()

    try:
        # Every config is timed before any kernel pass: torch.profiler leaves CUPTI attached, which would tax
        # the host side of every later config (timing.TAINTED).
        for cfg in todo:
            bar.set_postfix_str(cfg.name, refresh=False)
            if cfg.model not in loaded:
                loaded[cfg.model] = load_model(cfg.model, seed=0)
                out.say(_announce(loaded[cfg.model], cfg.model, configs, todo, folder, warmup, busy), above=bar)
            model = loaded[cfg.model]
            prompt = random_prompts(model, batch=cfg.batch, lengths=(cfg.prompt_len, cfg.prompt_len), seed=cfg.seed)
            res = timing.profile(model, prompt.input_ids, prompt.attention_mask, mode=cfg.mode, warmup=warmup,
                                 busy=False, **cfg.decode_kwargs())
            results.append((cfg, res))
            write(cfg, res)
            bar.update(1)
        if busy:
            bar.reset(total=len(results))
            bar.set_description("profile: kernel passes")
            for cfg, res in results:
                bar.set_postfix_str(cfg.name, refresh=False)
                timing.add_device_busy(res)
                write(cfg, res)
                bar.update(1)
    finally:
        bar.close()
    mine = summary_file.df[summary_file.df["config_hash"].isin({c.hash for c in configs})]
    table = _table(mine, [c.name for c in configs])
    out.say("per token, µs (syncs: per token); host/step: the median step's host time, µs")
    out.say(table.round(2).to_string(index=False))
    if not cuda:
        out.say("device columns are NaN: no CUDA device to time")
        if any(c.mode != "eager" for c in configs):
            out.say(options.UNCAPTURED)
    out.say(f"results in {folder.absolute()}")
    out.document({"out": str(folder), "captured": cuda, "per_token": json.loads(table.to_json(orient="records")),
                  "environment": env})
    return 0


def _announce(model, name: str, configs, todo, folder: Path, warmup: int, busy: bool) -> str:
    """The line said before a model's first config is timed: its configs to run and an estimate, from their decodes
    (`warmup` untimed, one timed, and with `busy` the kernel pass; every step counted, as with --no-eos: random
    weights seldom end a row early) at the rates of a short decode timed here."""
    several = len({cfg.model for cfg in configs}) > 1
    mine = [cfg for cfg in todo if cfg.model == name]
    total = sum(cfg.model == name for cfg in configs)
    who = name if several else None
    works = [estimate.Work(cfg.mode, cfg.batch, warmup + 1 + busy, cfg.max_new_tokens - 1) for cfg in mine]
    try:
        clock = estimate.probe(model, [cfg.mode for cfg in mine], [cfg.batch for cfg in mine],
                               max(cfg.prompt_len for cfg in mine), max(cfg.max_new_tokens for cfg in mine))
    except Exception as err:  # no estimate is no reason to stop: the configs raise their own errors
        reason = traceback.format_exception_only(type(err), err)[-1].strip()[:200]
        return estimate.announce("profile", len(mine), total, str(folder), model=who) + \
            f"; no estimate (the timed probe decode failed: {reason})"
    left_out = "model loads and captures" + (", the profiler's overhead" if busy else "") + " not counted"
    if several and name == todo[0].model:
        left_out += "; each further model's configs are estimated when it loads"
    return estimate.announce("profile", len(mine), total, str(folder), clock, works, left_out, model=who)


def _table(summary: pd.DataFrame, order: list[str] | None = None) -> pd.DataFrame:
    """One row per config, in `order` (names; default: as in `summary`): its keys, per-token figures and
    the median step's host time."""
    from ..measure.timing import METRICS
    keys = [k for k in ("model", "batch", "mode", "poll", "kernels") if k in summary.columns]
    order = [n for n in (order or dict.fromkeys(summary["name"])) if n in set(summary["name"])]
    per_token = summary.pivot(index="name", columns="metric", values="per_token").reindex(order)
    host = summary[summary["metric"] == "host_us"].set_index("name")["median"].reindex(order).rename("host/step")
    first = summary.drop_duplicates("name").set_index("name")[keys].reindex(order)
    table = first.join(per_token[[m for m in METRICS if m in per_token.columns]]).join(host).reset_index(drop=True)
    varied = [k for k in ("poll", "kernels") if k in table.columns and table[k].nunique() > 1]
    return table.drop(columns=[k for k in ("poll", "kernels") if k in table.columns and k not in varied])


# ---------------------------------------------------------------------------------------------
# Nsight Systems

def _nsys(args, modes) -> int:
    out = options.Output(args.json)
    settings = dict(args.settings)
    kernels = list(dict.fromkeys(args.kernels))
    polls = list(dict.fromkeys(args.poll))
    models = args.model or options.default_models()
    from ..measure.polls import poll_value
    configs = []
    for trace in dict.fromkeys(args.trace or ["graph"]):
        for model in models:
            for batch in args.batch:
                for kernel in kernels:
                    for poll in polls:
                        extra = dict(settings)
                        if kernel != "hf":
                            extra["kernels"] = kernel
                        if poll != "default":
                            extra["eos_poll_interval"] = poll_value(poll)
                        for mode in modes:
                            configs.append(nsys.TraceConfig(model, batch, mode, trace, args.max_new_tokens,
                                                          args.prompt_len, args.repeat or 2, args.seed,
                                                          not args.no_eos, tuple(sorted(extra.items()))))
    folder = Path(args.out or NSYS_OUT)
    steps, table = nsys.session(configs, folder, keep_report=args.keep_report, fixture=args.fixture,
                                echo=lambda m: out.say(m), redo=args.redo, progress=not args.no_progress)
    out.say(nsys.format_table(table))
    out.say(f"results in {folder.absolute()}")
    out.document({"out": str(folder), "rows": json.loads(table.to_json(orient="records"))})
    return 0


def _read(args) -> int:
    out = options.Output(args.json)
    frames = []
    for path in args.read:
        df = nsys.read(path)
        nsys.check_totals(df, path)
        named = {}
        try:
            named = nsys.parse_name(Path(path).name)
        except ValueError:
            pass
        frames.append(df.assign(file=Path(path).name, model=named.get("model", "?")))
    table = nsys.summary(pd.concat(frames, ignore_index=True))
    out.say(nsys.format_table(table))
    out.document({"out": None, "rows": json.loads(table.to_json(orient="records"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
