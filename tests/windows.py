"""A seeded sweep over sliding windows: which architectures, which cases, and what each case covers.

A sliding layer of window w keeps min(w, cache length) slots, takes another branch once they are all
written, and its mask is built from Python counters: gdtool runs one graph per window phase and
switches at the step the window fills. What can go wrong depends on where that step falls, so every
architecture gets one case per place (`FILLS`), drawn at random otherwise (window, prompt width,
left padding, new tokens, greedy or sampling with a repetition penalty, all-sliding or mixed layers):

    prefill   the prompt fills the window (p >= w): full from the first decode step
    step1     the first decode step fills it (p = w - 1): full from the second
    step2     the second does (p = w - 2)
    later     a later decode step does
    never     the decode ends before the window fills (the cache may be shorter than the window)

`coverage()` names what a list of cases covers, so a test can assert that nothing was left out:
each place, very short decodes (1 or 2 decode steps), a phase switch crossed inside the decode, both
layer patterns, greedy and sampling.
"""
from __future__ import annotations

import functools
import random
import warnings
from dataclasses import dataclass

import zoo

FILLS = ("prefill", "step1", "step2", "later", "never")
PATTERNS = {"sliding": ("sliding_attention", "sliding_attention"), "mixed": ("full_attention", "sliding_attention")}
# the families the sweep must reach whatever the installed transformers builds (the defect was seen on these)
REQUIRED = ("mistral", "ministral", "qwen2", "phi3", "gemma2", "gemma3_text", "cohere2", "olmo3", "gpt_oss")
# config fields the tiny builder leaves unset where the default config has None
EXTRA = {"ministral": {"head_dim": 16}}
# architectures whose window has another name, and their layer patterns (a hybrid's "mixed": recurrent + attention)
OWN_WINDOW = {"recurrent_gemma": ("attention_window_size", "block_types",
                                  {"sliding": ["attention", "attention"], "mixed": ["recurrent", "attention"]})}
MODES = ("eager", "forward-graph", "step-graph", "device-loop")
POLLS = (1, 3, "async", 0)


@dataclass(frozen=True)
class Case:
    arch: str
    pattern: str          # "sliding" (every layer) or "mixed" (full, then sliding)
    window: int
    width: int            # padded prompt width p
    pads: tuple           # left pads per row
    new_tokens: int       # n: n - 1 decode steps after the prefill
    sampling: bool
    poll: object          # step-graph's eos_poll_interval
    seed: int

    @property
    def fill(self) -> str:
        """Where the window fills: during the prefill, at decode step 1, 2, later, or never."""
        return fill_of(self.window, self.width, self.new_tokens)

    @property
    def switches(self) -> bool:
        """A decode step runs before the window is full and another after: the phase switch is crossed."""
        return 1 <= self.window - self.width <= self.new_tokens - 2

    @property
    def name(self) -> str:
        mode = "sample" if self.sampling else "greedy"
        return (f"{self.arch}-{self.pattern}-w{self.window}-p{self.width}-pads{''.join(map(str, self.pads))}-"
                f"n{self.new_tokens}-{mode}")


def fill_of(window: int, width: int, new_tokens: int) -> str:
    steps_to_fill = window - width  # decode steps that write the window's last empty slots
    if steps_to_fill <= 0:
        return "prefill"
    if steps_to_fill > new_tokens - 1:
        return "never"
    return {1: "step1", 2: "step2"}.get(steps_to_fill, "later")


def _draw(rng: random.Random, fill: str, windows, widths, new_tokens) -> tuple[int, int, int]:
    """(window, prompt width, new tokens) whose window fills at `fill`."""
    for _ in range(10000):
        w, n = rng.choice(windows), rng.choice(new_tokens)
        p = {"prefill": rng.randint(w, max(w, max(widths))), "step1": w - 1, "step2": w - 2,
             "later": w - rng.randint(3, max(3, n - 1)), "never": w - rng.randint(n, n + 4)}[fill]
        if p >= 2 and fill_of(w, p, n) == fill:
            return w, p, n
    raise AssertionError(f"no window, width and length fill at {fill!r} within the ranges given")


def cases(arch: str, patterns: tuple, per_fill: int = 1, seed: int = 0, windows=range(3, 9), widths=range(2, 11),
          new_tokens=range(2, 13)) -> list[Case]:
    """`per_fill` cases for every place the window can fill, random in everything else."""
    rng = random.Random(f"{seed}-{arch}")
    out = []
    for i in range(per_fill):
        for fill in FILLS:
            short = rng.random() < 0.3 and fill in ("prefill", "step1", "never")
            w, p, n = _draw(rng, fill, windows, widths, (2, 3) if short else new_tokens)
            pads = [rng.randint(0, min(3, p - 1)) for _ in range(3)]
            pads[rng.randrange(3)] = 0  # one row unpadded: the padded width is the longest prompt
            out.append(Case(arch, patterns[(i + len(out)) % len(patterns)], w, p, tuple(pads), n,
                            sampling=rng.random() < 0.5, poll=rng.choice(POLLS), seed=rng.randrange(1 << 16)))
    return out


def coverage(all_cases: list[Case]) -> dict[str, int]:
    """How many cases exercise each thing the sweep must cover."""
    got = {fill: sum(c.fill == fill for c in all_cases) for fill in FILLS}
    got["short (1-2 decode steps)"] = sum(c.new_tokens <= 3 for c in all_cases)
    got["phase switch crossed"] = sum(c.switches for c in all_cases)
    for pattern in PATTERNS:
        got[f"pattern {pattern}"] = sum(c.pattern == pattern for c in all_cases)
    got["greedy"] = sum(not c.sampling for c in all_cases)
    got["sampling"] = sum(c.sampling for c in all_cases)
    return got


# -- architectures ----------------------------------------------------------------------------------

def _overrides(arch: str, window: int, pattern: str) -> dict | None:
    from transformers import CONFIG_MAPPING
    if arch in OWN_WINDOW:
        field, layers, patterns = OWN_WINDOW[arch]
        return {**zoo.KNOBS.get(arch, {}), field: window, layers: patterns[pattern]}
    base = zoo.window_overrides(arch, window)
    if base is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = CONFIG_MAPPING[arch]().to_dict()
    d = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    out = dict(base, **EXTRA.get(arch, {}))
    if "layer_types" in d:
        out["layer_types"] = list(PATTERNS[pattern])
    elif pattern != "sliding":
        return None  # no per-layer types: every attention layer slides
    if "max_window_layers" in d:
        out["max_window_layers"] = 0 if pattern == "sliding" else 1
    return out


def layer_kinds(model) -> str:
    """One letter per cache layer: S sliding, F full attention, - anything else."""
    from gdtool.core import compat
    cache = compat.static_cache(model, 16)
    return "".join("S" if compat.is_sliding(layer) else "F" if type(layer).__name__ == "StaticLayer" else "-"
                   for layer in compat.cache_layers(cache))


def _realized(model, arch: str, pattern: str) -> bool:
    kinds = layer_kinds(model).replace("-", "")
    if arch in OWN_WINDOW:  # a recurrent block keeps its state on its module (5.17: a sliding cache layer it never fills)
        recurrent = "recurrent" in (getattr(model.config, "block_types", None) or ())
        return "S" in kinds and recurrent == (pattern == "mixed")
    return "S" in kinds and (("F" in kinds) if pattern == "mixed" else set(kinds) == {"S"})


@functools.lru_cache(maxsize=16)
def build(arch: str, window: int, pattern: str):
    """The tiny model of `arch` with sliding layers of `window` in `pattern`, or None where the config cannot
    give that pattern. Raises when it does not build."""
    overrides = _overrides(arch, window, pattern)
    if overrides is None:
        return None
    model = zoo.build(arch, **overrides)
    return model if _realized(model, arch, pattern) else None


@functools.lru_cache(maxsize=None)
def patterns_of(arch: str) -> tuple:
    """The layer patterns `arch` can be built with at tiny size (empty: it does not build with a window)."""
    import torch
    from reference import generate
    out = []
    for pattern in PATTERNS:
        try:
            model = build(arch, 5, pattern)
            if model is not None:
                generate(model, torch.full((1, 3), 5), torch.ones(1, 3, dtype=torch.long), 2, do_sample=False)
                out.append(pattern)
        except Exception:  # noqa: BLE001 - the tiny builder cannot make it, or generate() cannot decode it
            pass
    return tuple(out)


def architectures() -> list[str]:
    """Every architecture whose config has a sliding window (built or not: the test reports which not)."""
    out = []
    for arch in zoo.architectures():
        try:
            if arch in OWN_WINDOW or zoo.window_overrides(arch, 5) is not None:
                out.append(arch)
        except Exception:  # noqa: BLE001 - a config class that cannot be built with defaults
            pass
    return out


def prompt(case: Case, device):
    import torch
    gen = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(3, zoo.VOCAB, (len(case.pads), case.width), generator=gen)
    mask = torch.ones_like(ids)
    for row, pads in enumerate(case.pads):
        mask[row, :pads] = 0
    return (ids * mask).to(device), mask.to(device)


def run(case: Case, device="cpu") -> list[str]:
    """Decode `case` in every mode against generate(); the mismatches, one line each."""
    from reference import assert_same, decode, generate
    model = build(case.arch, case.window, case.pattern).to(device)
    ids, mask = prompt(case, device)
    settings = dict(zoo.SAMPLING) if case.sampling else dict(do_sample=False)
    settings.update(eos_token_id=None, pad_token_id=0)
    ref_tokens, ref_scores = generate(model, ids, mask, case.new_tokens, seed=case.seed, **settings)
    failures = []
    for mode in MODES:
        poll = case.poll if mode == "step-graph" else None
        out = decode(model, ids, mask, case.new_tokens, seed=case.seed, mode=mode, eos_poll_interval=poll, **settings)
        try:
            assert_same(out, ref_tokens, ref_scores)
        except AssertionError as error:
            first = str(error).strip().splitlines()[0][:120]
            failures.append(f"{case.name} {mode} poll={poll}: {first}")
    return failures


def run_kernels(case: Case, kernels: str, modes=("eager", "step-graph"), device="cpu", dtype=None,
                expect: str | None = None) -> list[str]:
    """Decode `case` greedily with `kernels` ("compiled", "fast") in `modes`: each mode's tokens and scores
    bit for bit its uncaptured twin's (the option's promise, captured equals uncaptured: eager for the modes
    that compile the forward alone, the step-graph uncaptured for those that compile the whole step,
    `uncaptured_twin`), and, in float32 (a CPU), every mode's tokens generate()'s (the fused kernels round
    differently, not enough to change a token here; in bf16 on a GPU they may). `expect`: a phrase every compiled
    step's account (`compiles()`) must hold, e.g. that gdtool's own kernels ran. The mismatches, one line each."""
    import torch
    from gdtool.kernels.step import compiles
    from reference import decode, generate
    model = build(case.arch, case.window, case.pattern).to(device=device, dtype=dtype)
    ids, mask = prompt(case, device)
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    ref_tokens = None
    if dtype in (None, torch.float32):
        ref_tokens, _ = generate(model, ids, mask, case.new_tokens, seed=case.seed, **settings)
    failures, outs = [], {}
    for mode in modes:
        out = outs[mode, None] = decode(model, ids, mask, case.new_tokens, seed=case.seed, mode=mode, kernels=kernels,
                                        **settings)
        if ref_tokens is not None and not torch_equal(out.tokens, ref_tokens):
            failures.append(f"{case.name} {mode} kernels={kernels}: tokens differ from generate()")
    failures += [f"{case.name} {mode} kernels={kernels}: differs from {twin}" for mode, twin in apart_from_twins(
        outs, kernels, device, lambda mode, capture: decode(model, ids, mask, case.new_tokens, seed=case.seed,
                                                            mode=mode, capture=capture, kernels=kernels, **settings))]
    if expect is not None:
        failures += [f"{case.name} kernels={kernels}: {expect!r} not in {k!r}" for k in compiles(model).kernels
                     if expect not in k]
    return failures


def apart_from_twins(outs: dict, kernels: str, device: str, rerun) -> list[tuple[str, str]]:
    """(mode, its twin's name) for each decode of `outs` ({(mode, None): output}) whose tokens or scores are not bit
    for bit its uncaptured twin's (`gdtool.kernels.step.uncaptured_twin`: the same programs called directly).
    `rerun(mode, capture)` decodes a twin `outs` lacks; where nothing captures (a CPU) a graph mode ran uncaptured
    already, so its own decode stands for it."""
    import torch
    from gdtool.core import graphs
    from gdtool.kernels.step import uncaptured_twin
    captures = graphs.can_capture(torch.device(device))
    apart = []
    for mode, _ in list(outs):
        twin = uncaptured_twin(mode, kernels)
        if twin not in outs:
            outs[twin] = outs[twin[0], None] if not captures and (twin[0], None) in outs else rerun(*twin)
        if not same(outs[mode, None], outs[twin]):
            apart.append((mode, twin[0] if twin[1] is None else f"{twin[0]} (capture={twin[1]})"))
    return apart


def same(a, b) -> bool:
    """Two decodes' tokens and scores bit for bit."""
    return torch_equal(a.tokens, b.tokens) and len(a.scores) == len(b.scores) and \
        all(torch_equal(x, y) for x, y in zip(a.scores, b.scores))


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a.cpu(), b.cpu())
