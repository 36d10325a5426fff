"""The command line's one grammar: option names, list syntax, defaults, errors, progress and --json.

Every command (`run`, `bench` and its `--workload rollout`, `profile`, `profile --nsys`, `sweep`) that
takes one of these options spells it the same way, means the same by it and reads a list the same way,
with spaces or commas (``--batch 1 4 16`` is ``--batch 1,4,16``). Which command takes which is the
table in docs/cli.md (tests/test_grammar.py holds it to the parsers of `COMMANDS`);
a command given an option it lacks names the commands that take it.

    --model M...          presets (gdtool.PRESETS) or local checkpoint folders      (alias --models)
    --mode M...           eager, forward-graph, step-graph, device-loop, or all      (alias --modes)
    --batch B...          rows per decode                                            (alias --batches)
    --poll P...           EOS polling: k >= 1, never (or 0), async, default         (aliases --polls,
                          --eos-poll-interval)
    --kernels K...        decode's kernels: hf, compiled or fast (`kernels_help`)
    --lengths L...        response-length distributions (gdtool.measure.workloads)
    --prompt-len N        prompt tokens per row                                      (alias --prompt-length)
    --max-new-tokens N, --seed N, --warmup N, --repeats N, --out PATH
    --redo                measure configs again that --out already holds (default: skip them, resume)
    --set KEY=VALUE       a gdtool.decode argument; KEY and VALUE checked against SET_KEYS
    --device D            cpu, cuda or cuda:N
    --json                one JSON document on stdout, the readable table on stderr
    --no-progress         no progress bar (it goes to stderr)

Defaults suit the machine: the model is llama-1b on a CUDA GPU and tiny-llama on a CPU; results go
under results/ (bench, profile, sweep). A bad value ends the command before any work with one line
naming the problem and the fix, and exit status 2, as argparse does: a missing model folder, an
--out that cannot be written, an unknown --set key.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..core.modes import KERNELS

__all__ = ["COMMANDS", "Output", "Parser", "UNCAPTURED", "default_models", "kernels_help", "option_table", "progress",
           "split"]

# Every parser of the command line, by how it is called (bench's rollout workload has a parser of its own):
# what docs/cli.md's table of options is held to, and where an option a command lacks is looked up.
COMMANDS = {"run": "gdtool.frontends.run", "bench": "gdtool.frontends.bench",
            "bench --workload rollout": "gdtool.frontends.rollout_bench", "profile": "gdtool.frontends.profile",
            "sweep": "gdtool.frontends.sweep"}

# Printed under every speed table made without a CUDA device.
UNCAPTURED = ("note: no CUDA device here, so forward-graph, step-graph and device-loop ran their step "
              "uncaptured (no CUDA graph): their speed on this machine says nothing about what capture wins")

_OFF = "off"


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def default_models(cuda: bool | None = None) -> list[str]:
    """The model a command runs when none is named: llama-1b on a CUDA GPU, tiny-llama on a CPU."""
    cuda = cuda_available() if cuda is None else cuda
    return ["llama-1b" if cuda else "tiny-llama"]


def out_path(path, file: bool = False, error=None) -> str:
    """The absolute path of a results folder (or, `file=True`, a results file), its folder created and
    checked writable by writing a scratch file there. A failure calls `error` with one line naming
    --out (raises ValueError without one)."""
    import tempfile
    from pathlib import Path
    target = Path(path).expanduser().absolute()
    folder = target.parent if file else target
    try:
        if file and (target.is_dir() or str(path).endswith(("/", os.sep))):
            raise IsADirectoryError(21, "is a folder, not a file")
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise NotADirectoryError(20, "not a folder")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".gdtool-write-check-"):
            pass
        if file and target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(13, "the file is read-only")
    except OSError as err:
        reason = err.strerror or type(err).__name__
        scratch = ".gdtool-write-check-" in str(err.filename)
        where = f" at {err.filename}" if err.filename and not scratch and str(err.filename) != str(path) else ""
        message = (f"--out {path}: cannot write there ({reason}{where}); pass a {'file' if file else 'folder'} "
                   "path you can write to")
        if error is None:
            raise ValueError(message) from None
        error(message)
    return str(target)


def given(argv, names) -> list[str]:
    """The options of `names` that `argv` holds, in its order, spelled out in full (``--slots 4`` or
    ``--slots=4``): a command refuses with them the options of another of its forms before it parses."""
    return [arg.split("=", 1)[0] for arg in argv if arg.split("=", 1)[0] in names]


def split(values) -> list[str]:
    """Items of a list option: each value split on commas and whitespace, empty items dropped."""
    items = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        items += [x for x in str(value).replace(",", " ").split() if x]
    return items


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and shows every option's default (lists as typed: ``1 4 16``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = _OFF
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "on"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default)) if default else "none"
        elif default is None:
            shown = "none"
        else:
            shown = str(default)
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse with the house formatter and one-line errors: ``PROG: error: MESSAGE`` and exit 2."""

    def __init__(self, prog: str, description: str, epilog: str | None = None):
        super().__init__(prog=prog, description=description, epilog=epilog, formatter_class=Formatter)

    def error(self, message):
        message = " ".join(str(message).split()) + self._elsewhere(message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _elsewhere(self, message) -> str:
        """For argparse's "unrecognized arguments": which commands take the first unknown option, if any do."""
        prefix = "unrecognized arguments: "
        if not str(message).startswith(prefix):
            return ""
        unknown = next((arg.split("=", 1)[0] for arg in str(message)[len(prefix):].split() if arg.startswith("--")),
                       None)
        me = self.prog.removeprefix("python -m gdtool ")
        takers = [command for command, known in option_table().items() if unknown in known and command != me]
        if not takers:
            return ""
        return f"; {unknown} is an option of {spoken(takers, 'and')}, not of {me}"

    # -- shared options -----------------------------------------------------------------------
    def list_option(self, *names, item, default, help, metavar=None, splitter=None):
        """A list option read the house way: spaces or commas, each item checked by `item` (which raises
        ValueError naming the fix); a repeated option adds to the list."""
        return self.add_argument(*names, action=ListAction, item=item, splitter=splitter, default=list(default),
                                 help=help, metavar=metavar or names[0].lstrip("-").upper().replace("-", "_"))

    def add_lengths(self, default):
        return self.list_option("--lengths", item=lengths_item, default=default, splitter=split_lengths,
                                help="response-length distributions (gdtool.measure.workloads): fixed:N, uniform:LO:HI, "
                                     "geom:MEAN:CAP, list:A,B,C (one per row), emp:A,B,C (drawn), eos-off")

    def add_model(self, cuda: bool | None = None):
        here = default_models(cuda)[0]
        from ..core.models import PRESETS
        return self.list_option("--model", "--models", item=model_item, default=[],
                                help=f"presets ({', '.join(PRESETS)}) or local checkpoint folders (default: "
                                     f"llama-1b on a CUDA GPU, tiny-llama on a CPU; here {here})")

    def add_mode(self, default, choices=None, extra_help=""):
        from ..core.modes import MODES
        choices = tuple(choices or MODES)
        return self.list_option("--mode", "--modes", item=choice_item("mode", choices + ("all",)), default=default,
                                help=f"decode modes: {', '.join(choices)}, or all{extra_help}")

    def add_batch(self, default):
        return self.list_option("--batch", "--batches", item=int_item("batch", 1), default=default,
                                help="batch sizes (rows per decode)")

    def add_poll(self, default, extra_help=""):
        return self.list_option("--poll", "--polls", "--eos-poll-interval", item=poll_item, default=default,
                                help="EOS polling: an interval k >= 1 (read the device's all-finished flag every k "
                                     "steps), never (or 0), async (read the previous step's flag), or default "
                                     f"(each mode's own){extra_help}")

    def add_kernels(self, default=("hf",)):
        return self.list_option("--kernels", item=kernels_item, default=default, help=kernels_help())

    def add_device(self):
        return self.add_argument("--device", type=device_type, default=None, metavar="DEVICE",
                                 help="cpu, cuda or cuda:N (default: cuda where there is one)")

    def add_int(self, *names, default, minimum=0, help):
        return self.add_argument(*names, type=int_type(names[0], minimum), default=default, help=help,
                                 metavar="N")

    def add_prompt_len(self, default=128):
        return self.add_int("--prompt-len", "--prompt-length", default=default, minimum=1,
                            help="prompt tokens per row")

    def add_prompt_lengths(self, default: str, what: str = ""):
        """--prompt-len taking one length or LO,HI (rows of lengths drawn between them): parsed to (lo, hi)."""
        return self.add_argument("--prompt-len", "--prompt-length", default=default, metavar="LO[,HI]",
                                 type=_argparse_type(prompt_lengths, "prompt lengths"),
                                 help="prompt lengths: one length, or LO,HI for rows of lengths drawn between them"
                                      + (f" {what}" if what else ""))

    def add_max_new_tokens(self, default, minimum=1, help="tokens generated per row"):
        return self.add_int("--max-new-tokens", default=default, minimum=minimum, help=help)

    def add_seed(self):
        return self.add_int("--seed", default=0, help="seed of the prompts and of sampling")

    def add_out(self, default, what):
        return self.add_argument("--out", default=default, metavar="PATH", help=what)

    def out_path(self, path, file: bool = False) -> str:
        """--out made ready before any work: its folder created and written to once, as an absolute path;
        a path that cannot be written ends the command with one line naming --out (exit 2)."""
        return out_path(path, file=file, error=self.error)

    def add_common(self, redo: bool = True):
        """--redo (where results resume), --json and --no-progress."""
        if redo:
            self.add_argument("--redo", action="store_true",
                              help="measure again configs that --out already holds (otherwise they are skipped: "
                                   "rerun a command to resume it)")
        self.add_argument("--json", action="store_true",
                          help="print one JSON document on stdout (the readable table goes to stderr)")
        self.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def spoken(items, conjunction: str = "or") -> str:
    """Items as a sentence lists them: ``a``, ``a or b``, ``a, b or c``."""
    items = [str(item) for item in items]
    return ", ".join(items[:-1]) + f" {conjunction} " + items[-1] if len(items) > 1 else "".join(items)


def option_table() -> dict[str, dict[str, argparse.Action]]:
    """{command: {option string: its action}} for every parser of `COMMANDS`, built by its module's `parser()`
    (aliases included, --help left out)."""
    import importlib
    table = {}
    for command, module in COMMANDS.items():
        parser = importlib.import_module(module).parser()
        table[command] = {name: action for action in parser._actions for name in action.option_strings
                          if action.dest != "help"}
    return table


def _family(cls_name: str, suffix: str) -> str:
    """A family named as transformers' class prefix: LlamaForCausalLM -> Llama, GptOssExperts -> GptOss."""
    return cls_name[:-len(suffix)] if cls_name.endswith(suffix) else cls_name


def fast_scope() -> str:
    """Where kernels="fast" runs gdtool's own kernels, read from the tables the fast step decides with: the whole
    forward's families (`kernels.forward.FAMILIES`) and the batch each path takes (`forward.line_paths`, the
    same function `forward.plan` asks), the MoE blocks' families and limits (`kernels.experts.blocks`, where
    `refusal` reads them), the linear layers' rows (`kernels.linear.MAX_ROWS`, `kernels.dot.MAX_ROWS`)."""
    from ..kernels import dot, forward, linear
    from ..kernels.experts import blocks as experts

    def names(items):
        return ", ".join(items)

    measured = [_family(c, "ForCausalLM") for c in forward.FAMILIES if c in forward.MEASURED_LINE]
    others = [_family(c, "ForCausalLM") for c in forward.FAMILIES if c not in forward.MEASURED_LINE]
    lines, wider_than = [], 0
    for largest, _ in forward.measured_lines():
        rows = forward.gemv_rows(forward.line_paths(largest if largest is not None else wider_than + 1))
        batch = f"batch 1-{rows}" if rows > 1 else "batch 1"
        lines.append(f"{batch} up to hidden size {largest}" if largest is not None else f"{batch} wider")
        wider_than = largest or wider_than
    moe = {family: _family(experts_cls, "Experts") for family, (_, experts_cls, _) in experts.FAMILIES.items()}
    small = [moe[f] for f in moe if f not in experts.GROUPED_FAMILIES]
    smaller = f" ({names(small)} <= {experts.MAX_TOKENS})" if small else ""
    return (f"the whole forward of {names(measured)} at {' and '.join(lines)}, of {names(others)} at batch <= "
            f"{forward.gemv_rows(forward.line_paths(None))}; elsewhere, inside the compiled forward, the MoE blocks of "
            f"{names(moe.values())} at batch <= {experts.MAX_GROUPED_TOKENS}{smaller}, the attention (split-KV) and "
            f"the linear layers at batch <= {linear.MAX_ROWS} (<= {dot.MAX_ROWS} on the tensor cores with "
            f"GDTOOL_DOT_LINEAR=1); on CUDA only the paths whose CUDA tests passed "
            "(kernels/triton.py CUDA_TESTED); docs/fast.md")


def kernels_help() -> str:
    """--kernels' help: every option of `core.modes.KERNELS_RUN` with what it runs, fast's scope (`fast_scope`)."""
    from ..core.modes import KERNELS_RUN
    parts = [f"{name} ({what}{': ' + fast_scope() if name == 'fast' else ''})" for name, what in KERNELS_RUN.items()]
    return "decode's kernels: " + spoken(parts)


def split_lengths(values) -> list[str]:
    """Items of --lengths: as `split`, except that the numbers of a ``list:A,B,C`` / ``emp:A,B,C`` spec
    stay with it (``--lengths list:3,5 geom:8:32`` is two distributions)."""
    items = []
    for token in split(values):
        if token.isdigit() and items and items[-1].split(":", 1)[0].lower() in ("list", "emp"):
            items[-1] += "," + token
        else:
            items.append(token)
    return items


class ListAction(argparse.Action):
    """A list option: see `Parser.list_option`."""
    def __init__(self, option_strings, dest, item=None, splitter=None, **kwargs):
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kwargs)
        self.item = item
        self.splitter = splitter or split

    def __call__(self, parser, namespace, values, option_string=None):
        items = self.splitter(values)
        if not items:
            parser.error(f"argument {option_string}: give at least one value")
        try:
            converted = [self.item(x) for x in items]
        except ValueError as err:
            parser.error(f"argument {option_string}: {err}")
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, list(current) + converted)


# ---------------------------------------------------------------------------------------------
# item checks: each returns the item (converted) or raises ValueError naming the fix

def model_item(name: str) -> str:
    from ..core.models import PRESETS, check_local
    if name in PRESETS or check_local(name):
        return name
    raise ValueError(f"unknown model {name!r}; use a preset ({', '.join(PRESETS)}) or a local checkpoint folder")


def choice_item(what: str, choices):
    def check(value: str) -> str:
        if value not in choices:
            raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")
        return value
    return check


def int_item(what: str, minimum: int):
    def check(value) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{what} {value!r} is not a whole number; use e.g. {max(minimum, 1)}") from None
        if number < minimum:
            raise ValueError(f"{what} {number} must be at least {minimum}")
        return number
    return check


def prompt_lengths(text: str) -> tuple[int, int]:
    """--prompt-len: "N" or "LO,HI" as (lo, hi), 1 <= lo <= hi."""
    items = split(text)
    try:
        lengths = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"--prompt-len {text!r}: give one length or LO,HI (e.g. 5,12)") from None
    if not 1 <= len(lengths) <= 2 or min(lengths) < 1:
        raise ValueError(f"--prompt-len {text!r}: give one length >= 1, or LO,HI with 1 <= LO <= HI (e.g. 5,12)")
    lo, hi = lengths[0], lengths[-1]
    if lo > hi:
        raise ValueError(f"--prompt-len {text!r}: LO > HI; swap them ({hi},{lo})")
    return lo, hi


def _argparse_type(parse, name: str):
    """`parse` as an argparse type: its ValueError becomes argparse's one-line error."""
    def convert(value):
        try:
            return parse(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    convert.__name__ = name
    return convert


def int_type(flag: str, minimum: int):
    return _argparse_type(int_item(flag.lstrip("-"), minimum), "whole number")


def device_type(value: str) -> str:
    """--device: cpu, cuda or cuda:N, and a CUDA device only where torch sees one."""
    import torch
    kind, _, index = value.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise argparse.ArgumentTypeError(f"unknown device {value!r}; use cpu, cuda or cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{value}: torch sees no CUDA device here; use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{value}: torch sees {torch.cuda.device_count()} CUDA devices "
                                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return value


def number_type(flag: str, ok, accepted: str):
    """A float option checked by `ok`, the error naming the flag and what it accepts."""
    def convert(value):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or number != number or not ok(number):
            raise argparse.ArgumentTypeError(f"{flag} {value!r}: give {accepted}")
        return number
    convert.__name__ = "number"
    return convert


def poll_item(value: str) -> str:
    from ..measure.polls import poll_label
    return poll_label(value)


def kernels_item(value: str) -> str:
    from ..core.modes import KERNELS
    if value not in KERNELS:
        raise ValueError(f"unknown kernels {value!r}; choose from {', '.join(KERNELS)}")
    return value


def lengths_item(value: str) -> str:
    from ..measure import workloads
    workloads.parse(value)
    return value


def expand_modes(modes, choices=None) -> list[str]:
    """'all' -> every mode (of `choices`); duplicates dropped, order kept."""
    from ..core.modes import MODES
    choices = list(choices or MODES)
    out = []
    for m in modes:
        out += choices if m == "all" else [m]
    return list(dict.fromkeys(out))


def _number(kind, ok=lambda v: True, nullable=True):
    """A conversion to a number of `kind` (int or float; an int stays an int) for which `ok` holds."""
    def convert(text):
        value = json.loads("null" if text.lower() == "none" else text)
        if value is None and nullable:
            return None
        wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
        if wrong_type or (kind is int and not isinstance(value, int)) or not ok(value):
            raise ValueError
        return value
    return convert


def _flag(text):
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError


def _token_ids(text):
    if text.strip().lower() in ("null", "none"):
        return None
    value = json.loads(text) if text.strip().startswith("[") else [int(x) for x in split(text)]
    value = value if isinstance(value, list) else [value]
    if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ValueError
    return value[0] if len(value) == 1 else value


def _poll(text):
    from ..measure.polls import poll_value
    if text.strip().lower() in ("null", "none"):
        return None
    return poll_value(text)


def _kernels(text):
    from ..core.modes import KERNELS
    if text not in KERNELS:
        raise ValueError
    return text


# The gdtool.decode arguments --set takes: key -> (conversion, the values it accepts). A conversion
# raises ValueError on a bad value; the command then names the key and these values.
SET_KEYS = {
    "do_sample": (_flag, "true or false"),
    "temperature": (_number(float, lambda v: 0 < v < float("inf")), "a number > 0, or null"),
    "top_k": (_number(int, lambda v: v >= 0), "a whole number >= 0 (0 is off), or null"),
    "top_p": (_number(float, lambda v: 0 < v <= 1), "a number in (0, 1] (1.0 is off), or null"),
    "repetition_penalty": (_number(float, lambda v: 0 < v < float("inf")), "a number > 0 (1.0 is off), or null"),
    "eos_token_id": (_token_ids, "a token id, ids as 2,7 or [2,7], or null (EOS off)"),
    "pad_token_id": (_number(int, lambda v: v >= 0), "a token id (a whole number >= 0), or null"),
    "eos_poll_interval": (_poll, "a whole number k >= 1, never (or 0), async, or null (the mode's own)"),
    "kernels": (_kernels, spoken(KERNELS)),
    "steps_per_launch": (_number(int, lambda v: v >= 1), "a whole number >= 1 (device-loop only), or null"),
    "num_samples": (_number(int, lambda v: v >= 1, nullable=False), "a whole number >= 1"),
    "capture": (lambda v: None if v.strip().lower() in ("null", "none") else _flag(v), "true, false or null"),
    "return_scores": (_flag, "true or false"),
    "return_logprobs": (_flag, "true or false"),
}
# Keys with an option of their own.
SET_OPTIONS = {"max_new_tokens": "--max-new-tokens", "seed": "--seed", "mode": "--mode", "input_ids": "--prompt-len",
               "attention_mask": "--prompt-len", "target_lengths": "sweep --lengths"}


def check_setting(key: str, value: str, extra: dict | None = None):
    """The decode argument `key` read from the text `value`, or ValueError naming the key and the values
    it accepts. `extra` adds keys a command takes besides decode's ({key: (conversion, accepted)})."""
    from ..core.settings import REFUSED, _refuse_unsupported
    known = {**SET_KEYS, **(extra or {})}
    if key in SET_OPTIONS:
        raise ValueError(f"--set {key}=...: use {SET_OPTIONS[key]} instead")
    if key in REFUSED:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        try:
            _refuse_unsupported(None, {key: parsed})  # raises unless the value means "off"
        except ValueError as err:
            raise ValueError(f"--set {err}") from None
        return parsed
    if key not in known:
        import difflib
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"--set {key}: unknown setting; {hint}--set takes {', '.join(known)}")
    convert, accepted = known[key]
    try:
        return convert(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise ValueError(f"--set {key}={value!r}: {key} takes {accepted}") from None


def settings(pairs, parser: Parser, extra: dict | None = None) -> dict:
    """--set KEY=VALUE pairs as decode arguments, each checked against the settings gdtool knows
    (`SET_KEYS`, plus `extra`): an unknown key or a bad value ends the command with one line naming the
    key and what it accepts, before anything runs."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            parser.error(f"--set {pair!r} is not KEY=VALUE; e.g. --set eos_poll_interval=16")
        try:
            out[key] = check_setting(key, value.strip(), extra)
        except ValueError as err:
            parser.error(str(err))
    return out


# ---------------------------------------------------------------------------------------------
# output

class Output:
    """Where a command writes: the readable text on stdout (stderr with --json), and with --json one
    JSON document on stdout, last."""

    def __init__(self, as_json: bool = False):
        self.as_json = as_json

    def say(self, text: str = "", above=None) -> None:
        """Print `text`; `above`: a progress bar on stderr to lift out of the way first (it redraws below)."""
        if above is None:
            print(text, file=sys.stderr if self.as_json else sys.stdout, flush=True)
            return
        with above.external_write_mode(file=sys.stderr):
            print(text, file=sys.stderr if self.as_json else sys.stdout, flush=True)

    def document(self, doc: dict) -> None:
        if self.as_json:
            print(json.dumps(doc, default=_plain), flush=True)


def _plain(value):
    try:
        return value.item()  # numpy scalars
    except AttributeError:
        return str(value)


def progress(total: int | None = None, desc: str = "", enabled: bool = True, unit: str = "config"):
    """A tqdm progress bar on stderr (tqdm.auto: a widget in a notebook), counting configs unless told otherwise."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5)


def run(parser: Parser, command, args):
    """Run `command(args)`; a ValueError or FileNotFoundError (bad input that got past the parser: an
    unsupported setting, a missing nsys) ends it with one line and exit 2, as a parser error would.
    ``GDTOOL_TRACEBACK=1`` lets the exception through, traceback and all."""
    try:
        return command(args)
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("GDTOOL_TRACEBACK"):
            raise
        parser.error(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
