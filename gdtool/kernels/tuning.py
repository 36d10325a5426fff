"""The kernels' tuning, read from per-device files: which file holds this device's, and what is in it.

Tile sizes, batch lines and split-KV parameters are data, not code: one JSON file per device, Triton version and
capability in `configs/` (written by the GPU sweeps: `profiles/moe_sweep.py --write-config`,
`profiles/decode_kernels_probe.py --write-config`). Each section of a file holds the parameters of one kernel's rule,
its `provenance` (commit, sweep, the result files, date) and, for the tiled kernels, `shapes`: rows a sweep wrote for
the exact shapes it timed, consulted before the rule.

Which file a CUDA device reads: the one of its name, capability and Triton version; else the nearest of its
capability (nearest Triton version, then the closest name); else `configs/defaults.json`. The last two say so once,
naming the file used and why. A CPU reads the defaults quietly: the torch references as they are, Triton's
interpreter with larger GEMV tiles (`interpreter()`: the same bits in fewer operations).
The multiprocessor count is the device's own (DEFAULT_MULTIPROCESSORS without one).

A probe that tries other values passes a `Tuning` (`use(...)`, or a kernel's `tune=` argument), it does not patch
module globals: `current(device).with_values("attention", programs_per_sm=1)`.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULTS = "defaults.json"
DEFAULT_MULTIPROCESSORS = 132   # the H200's: the count of the CPU and of no device (the sweeps ran there)


class TuningWarning(UserWarning):
    """A device without its own tuning file runs another's, or the defaults."""


# -- the file format ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """A list of {"when": {conditions}, value: ...} rows, the first whose conditions hold wins (`pick`). A condition
    is `var` (equal), `var_max` (at most) or `var_below` (less than), of the variables `over`. catch_all: the last
    row has no "when" (every shape gets a value). partial: a row may give any subset of `values`."""
    values: tuple
    over: tuple
    catch_all: bool = True
    partial: bool = False
    counts: tuple = ()   # values that may be 0


INT, NUMBER, BOOL, TEXT = "a positive integer", "a positive number", "true or false", "a string"
_PROVENANCE = {"commit": TEXT, "sweep": TEXT, "files": "a list of strings", "date": TEXT}
_CONFIG_FIELDS = ("router_rows", "gate_up_rows", "down_rows", "warps", "chunk", "routed", "stacked", "packed",
                  "router_warps", "down_warps", "router_early", "down_early")   # experts.Config's
SCHEMA = {
    "gemv": {"tile_elements": INT, "max_block_n": INT, "tiles_per_sm": INT,
             "launch": Rows(("warps", "per_sm"), ("k", "block_k", "block_n")),
             "shapes": Rows(("block_n", "warps", "per_sm"), ("n", "k", "tiles"), catch_all=False)},
    "qkv_rope": {"tile_elements": INT, "launch": Rows(("warps", "per_sm"), ("block_k",)),
                 "shapes": Rows(("hb", "warps", "per_sm"), ("k", "d"), catch_all=False)},
    "attention": {"programs_per_sm": NUMBER, "block_s": INT, "combine_d": INT, "combine_elements": INT,
                  "early_elements": INT, "fused_elements": INT, "loop_elements": INT},
    "batch_lines": {"lines": Rows(("rows",), ("hidden",), counts=("rows",))},
    "experts_small": {"max_rows": INT, "router_elements": INT, "gate_up_elements": INT, "down_elements": INT,
                      "warps": INT, "chunk": INT,
                      "one_token": {"gate_up_elements": INT, "wide_warps": INT, "wide_from": INT, "chunk": INT,
                                    "long_chunk": INT, "short_max": INT, "router_rows": INT, "router_warps": INT,
                                    "down_rows_divisor": INT, "down_warps": INT, "routed": BOOL, "stacked": BOOL,
                                    "packed": BOOL, "router_early": BOOL, "down_early": BOOL},
                      "shapes": Rows(_CONFIG_FIELDS, ("hidden", "intermediate", "tokens"), catch_all=False,
                                     partial=True)},
    "experts_oss": {"gate_up_cols": INT, "down_cols": INT, "block_k": INT, "warps": INT, "grouped_from": INT},
    "dot": {"block_n": INT, "block_k": INT, "warps": INT, "stages": INT, "programs_per_sm": NUMBER, "min_chunks": INT},
    "experts_grouped": {"from_tokens": INT,
                        "tiles": Rows(("block_m", "block_n", "block_k", "warps", "stages"), ("tokens",))},
}
_HEADER = ("device", "capability", "triton", "note")


class ConfigError(ValueError):
    """A tuning file that does not hold what the kernels read: the message names the file and the field."""


def _fits(value, kind) -> bool:
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if kind == _PROVENANCE["files"]:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    return number and (kind == NUMBER or isinstance(value, int))


def _check_rows(rows, spec: Rows, where: str, fail) -> None:
    if not isinstance(rows, list) or (spec.catch_all and not rows):
        fail(where, "a list of rows" + (' ending with a row without "when"' if spec.catch_all else ""))
    conditions = {f"{v}{s}" for v in spec.over for s in ("", "_max", "_below")}
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(row, dict):
            fail(at, "an object")
        when = row.get("when", {})
        if not isinstance(when, dict) or set(when) - conditions or not all(_fits(v, INT) for v in when.values()):
            fail(f"{at}.when", f"conditions of {', '.join(sorted(conditions))}, each a positive integer")
        if spec.catch_all and i == len(rows) - 1 and "when" in row:
            fail(at, "the last row without \"when\" (the catch-all)")
        extra = set(row) - {"when", *spec.values}
        if extra:
            fail(f"{at}.{sorted(extra)[0]}", f"one of {', '.join(spec.values)}")
        for name in spec.values:
            if name not in row:
                if not spec.partial:
                    fail(f"{at}.{name}", INT)
            elif not (spec.partial and (row[name] is None or isinstance(row[name], bool)) or _fits(row[name], INT)
                      or name in spec.counts and row[name] == 0 and not isinstance(row[name], bool)):
                fail(f"{at}.{name}", INT + (" or 0" if name in spec.counts else "")
                     + (", true, false or null" if spec.partial else ""))


def _check(data, schema: dict, where: str, fail) -> None:
    if not isinstance(data, dict):
        fail(where or "the file", "an object")
    for name, kind in schema.items():
        at = f"{where}.{name}" if where else name
        if name not in data:
            fail(at, "present")
        if isinstance(kind, dict):
            _check(data[name], kind, at, fail)
        elif isinstance(kind, Rows):
            _check_rows(data[name], kind, at, fail)
        elif not _fits(data[name], kind):
            fail(at, kind)
    allowed = set(schema) | ({"provenance"} if where in SCHEMA else set()) | (set(_HEADER) if not where else set())
    extra = set(data) - allowed
    if extra:
        fail(f"{where + '.' if where else ''}{sorted(extra)[0]}", "not a field of the format (a misspelling?)")
    if where in SCHEMA:
        _check(data.get("provenance"), _PROVENANCE, f"{where}.provenance", fail)


def validate(data: dict, path: str) -> dict:
    """`data` (a tuning file's JSON) if it holds every field the kernels read, else ConfigError naming the field."""
    def fail(where, what):
        raise ConfigError(f"{path}: {where}: expected {what}, got "
                          f"{_value_at(data, where)!r}")
    _check(data, SCHEMA, "", fail)
    if data.get("capability") is not None and not (isinstance(data["capability"], list) and len(
            data["capability"]) == 2 and all(isinstance(v, int) for v in data["capability"])):
        fail("capability", "[major, minor]")
    for name in ("device", "triton"):
        if data.get(name) is not None and not isinstance(data[name], str):
            fail(name, TEXT)
    return data


def _value_at(data, where: str):
    """The value at a dotted path with [i] indices (what the error message quotes), or None where absent."""
    value = data
    for part in where.replace("[", ".[").split("."):
        if not part:
            continue
        try:
            value = value[int(part[1:-1])] if part.startswith("[") else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return value


# -- a device's tuning ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tuning:
    """One file's tuning for one device: `tune["gemv"]["tile_elements"]`; `pick(section, table, **shape)`."""
    data: dict = field(repr=False)
    source: str              # the file read
    multiprocessors: int = DEFAULT_MULTIPROCESSORS
    why: str = ""            # how the file was chosen for the device ("" where it is the device's own)

    def __getitem__(self, section: str) -> dict:
        return self.data[section]

    def provenance(self, section: str) -> dict:
        return self.data[section]["provenance"]

    def pick(self, section: str, table: str, **shape) -> dict | None:
        """The values of the first row of `section`'s `table` whose conditions hold at `shape` (None: no row)."""
        for row in self.data[section][table]:
            if all(_holds(name, bound, shape) for name, bound in row.get("when", {}).items()):
                return {k: v for k, v in row.items() if k != "when"}
        return None

    def with_values(self, section: str, **values) -> "Tuning":
        """A copy with `section`'s fields replaced (validated): what a probe passes to try other values."""
        data = copy.deepcopy(self.data)
        data[section].update(values)
        return replace(self, data=validate(data, f"{self.source} with {section} {values}"))


def _holds(condition: str, bound: int, shape: dict) -> bool:
    for suffix, test in (("_max", lambda v: v <= bound), ("_below", lambda v: v < bound), ("", lambda v: v == bound)):
        name = condition[: -len(suffix)] if suffix else condition
        if (not suffix or condition.endswith(suffix)) and name in shape:
            return test(shape[name])
    raise KeyError(f"condition {condition!r}: the shape gives {', '.join(sorted(shape))}")


def read(path: str, multiprocessors: int = DEFAULT_MULTIPROCESSORS, why: str = "") -> Tuning:
    """The tuning file at `path`, validated."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    return Tuning(validate(data, path), path, multiprocessors, why)


def _version(text: str | None) -> tuple:
    parts = []
    for part in (text or "0").split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _distance(a: str | None, b: str | None) -> tuple:
    """How far two Triton versions are: minor releases first, then patches."""
    (a1, a2, a3), (b1, b2, b3) = _version(a), _version(b)
    return abs((a1 * 1000 + a2) - (b1 * 1000 + b2)), abs(a3 - b3)


def _headers(directory: str) -> list[tuple[str, dict]]:
    out = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.endswith(".json") and name != DEFAULTS:
            path = os.path.join(directory, name)
            with open(path) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}: not JSON ({e})") from None
            out.append((path, data))
    return out


def find(device: str, capability: tuple, triton: str | None, directory: str = CONFIG_DIR) -> tuple[str, str]:
    """(path, why) of the file a device of this name, capability and Triton version reads; why is '' for its own
    file, else what was used and why (the nearest file of its capability, or the defaults)."""
    want = f"{device} (sm_{capability[0]}{capability[1]}, Triton {triton})"
    same = [(path, data) for path, data in _headers(directory) if tuple(data.get("capability") or ()) == capability]
    for path, data in same:
        if data.get("device") == device and _version(data.get("triton")) == _version(triton):
            return path, ""
    if same:
        def rank(item):
            name = item[1].get("device") or ""
            return _distance(item[1].get("triton"), triton), -len(os.path.commonprefix([name, device]))
        path, data = min(same, key=rank)
        return path, (f"no tuning file for {want}: using {os.path.basename(path)} ({data.get('device')}, Triton "
                      f"{data.get('triton')}), the nearest of the same capability")
    return os.path.join(directory, DEFAULTS), (f"no tuning file for {want} nor any of its capability: using the "
                                               f"defaults ({DEFAULTS})")


def for_properties(properties, triton: str | None, directory: str = CONFIG_DIR) -> Tuning:
    """The tuning of a device described by torch's device properties (name, major, minor, multi_processor_count);
    the file chosen by `find`, and said once where it is not the device's own."""
    path, why = find(properties.name, (properties.major, properties.minor), triton, directory)
    if why and why not in _said:
        _said.add(why)
        warnings.warn(f"gdtool kernel tuning: {why}", TuningWarning, stacklevel=3)
    return read(path, properties.multi_processor_count, why)


_said: set = set()
_devices: dict = {}
_defaults: list = []
_interpreter: list = []
_override: list = []


def defaults() -> Tuning:
    """configs/defaults.json: the tuning of a CPU, of no device, and of a GPU with no file of its capability."""
    if not _defaults:
        _defaults.append(read(os.path.join(CONFIG_DIR, DEFAULTS)))
    return _defaults[0]


# Triton's CPU interpreter pays per operation, not per byte: each tile is a few numpy calls, whatever its size, and
# it runs the programs one after another. Its tuning is the defaults but for one multiprocessor, so the GEMV's
# tiles are not halved toward hundreds of programs, and tiles of up to 128 rows and 64K weights. K stays in one
# tile (BLOCK_K, K's padding, as in the defaults' rule), so each row's sum is the same: the same bits, in fewer,
# larger operations (tiny-llama's 4 steps at batch 2: 21 s in the defaults' 8-row tiles, 3.2 s in these). Attention's
# programs per multiprocessor grow as the count shrinks, so its split plan is the defaults' (the same coverage).
INTERPRETER_MULTIPROCESSORS = 1
INTERPRETER_GEMV = {"max_block_n": 128, "tile_elements": 65536}


def interpreter() -> Tuning:
    """The tuning of Triton's CPU interpreter (TRITON_INTERPRET=1): the defaults with larger GEMV tiles and one
    multiprocessor (above)."""
    if not _interpreter:
        base = defaults()
        programs = base["attention"]["programs_per_sm"] * base.multiprocessors
        tune = base.with_values("gemv", **INTERPRETER_GEMV).with_values(
            "attention", programs_per_sm=programs / INTERPRETER_MULTIPROCESSORS)
        _interpreter.append(replace(tune, multiprocessors=INTERPRETER_MULTIPROCESSORS,
                                    why="Triton's interpreter: the defaults, larger GEMV tiles, one multiprocessor"))
    return _interpreter[0]


def current(device=None) -> Tuning:
    """The tuning the kernels read on `device` (a torch.device; None or a CPU: the defaults, or under Triton's
    interpreter `interpreter()`), or the one `use` set. Read once per device."""
    if _override:
        return _override[-1]
    if device is None or device.type != "cuda":
        from .triton import interpreting
        return interpreter() if interpreting() else defaults()
    import torch
    from .triton import version
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _devices:
        _devices[index] = for_properties(torch.cuda.get_device_properties(index), version())
    return _devices[index]


@contextmanager
def use(tuning: Tuning):
    """Every kernel reads `tuning`, whatever its device, inside the block (a probe's or a sweep's values)."""
    _override.append(tuning)
    try:
        yield tuning
    finally:
        _override.pop()
