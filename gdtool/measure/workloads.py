"""Workloads that end: per-row response lengths drawn from a named distribution.

A model with random weights never "decides" to stop, yet the EOS-polling question is about batches
whose rows end at different steps. This module is the harness that controls those lengths: it draws
one target length per row, and `gdtool.decode(..., target_lengths=...)` forces the row to emit
``eos_token_id[0]`` as its target-length-th new token, inside the captured step. The same device-side
EOS bookkeeping then runs as with a natural EOS (the "finished" mask, the pad fill, the all-finished
flag the host polls), so what is measured is the cost of polling, not of a different code path. The
lengths are synthetic: they stand in for a real model's response-length distribution, they do not
come from one.

    from gdtool.measure import workloads
    dist = workloads.geometric(mean=128, cap=512)       # or "geom:128:512"
    lengths = dist.draw(batch=16, seed=0)                 # LongTensor [16], values in 1..512
    out = gdtool.decode(model, ids, mask, mode="step-graph", max_new_tokens=dist.max_length,
                        eos_token_id=[2], target_lengths=lengths)
    assert out.new_tokens == int(lengths.sum())

    workloads.parse("eos-off")                            # EOS disabled: every row runs max_new_tokens

Distributions (a length counts the EOS token itself, so it is at least 1):
``fixed(n)``, ``uniform(lo, hi)`` (integers, both ends included), ``geometric(mean, cap)`` (number of
tokens up to and including the first EOS when each token is EOS with probability 1/mean, then
capped: ``min(L, cap)``; ``mean`` is the mean before the cap), ``listed([..])`` (the given lengths,
row by row), ``empirical([..])`` (rows drawn with replacement from the given lengths), and
``eos_off()`` (no EOS at all: ``eos_token_id=None``, every row runs to ``max_new_tokens``).
Draws are seeded: the same (distribution, batch, seed) gives the same lengths on every machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "LengthDist",
    "empirical",
    "eos_off",
    "expected_max",
    "fixed",
    "geometric",
    "listed",
    "max_pmf",
    "parse",
    "uniform",
]


@dataclass(frozen=True)
class LengthDist:
    """A per-row response-length distribution. Build one with the functions of this module."""

    kind: str                      # fixed | uniform | geometric | listed | empirical | eos-off
    params: tuple = ()

    # -- names ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Short stable name used in run-config names and CSV columns: fixed128, uniform16-256,
        geom128cap512, list5-9-12, emp5-9-12, eos-off."""
        p = self.params
        if self.kind == "fixed":
            return f"fixed{p[0]}"
        if self.kind == "uniform":
            return f"uniform{p[0]}-{p[1]}"
        if self.kind == "geometric":
            return f"geom{_num(p[0])}cap{p[1]}"
        if self.kind == "listed":
            return "list" + "-".join(str(v) for v in p)
        if self.kind == "empirical":
            return "emp" + "-".join(str(v) for v in p)
        return "eos-off"

    @property
    def spec(self) -> str:
        """The string `parse` reads back: fixed:128, uniform:16:256, geom:128:512, list:5,9,12."""
        p = self.params
        if self.kind == "fixed":
            return f"fixed:{p[0]}"
        if self.kind == "uniform":
            return f"uniform:{p[0]}:{p[1]}"
        if self.kind == "geometric":
            return f"geom:{_num(p[0])}:{p[1]}"
        if self.kind in ("listed", "empirical"):
            return ("list:" if self.kind == "listed" else "emp:") + ",".join(str(v) for v in p)
        return "eos-off"

    def __str__(self) -> str:
        return self.name

    # -- what a decode needs -------------------------------------------------------------------
    @property
    def eos(self) -> bool:
        """False for `eos_off()`: decode with ``eos_token_id=None`` and no target lengths."""
        return self.kind != "eos-off"

    @property
    def max_length(self) -> int | None:
        """Longest length this distribution can draw (the natural ``max_new_tokens``); None for eos-off."""
        p = self.params
        if self.kind == "fixed":
            return p[0]
        if self.kind == "uniform":
            return p[1]
        if self.kind == "geometric":
            return p[1]
        if self.kind in ("listed", "empirical"):
            return max(p)
        return None

    def draw(self, batch: int, seed: int = 0) -> torch.LongTensor | None:
        """Target lengths for ``batch`` rows as a CPU LongTensor [batch]; None for eos-off."""
        if batch < 1:
            raise ValueError(f"batch={batch} must be at least 1")
        if not self.eos:
            return None
        rng = np.random.default_rng(seed)
        p = self.params
        if self.kind == "fixed":
            values = np.full(batch, p[0])
        elif self.kind == "uniform":
            values = rng.integers(p[0], p[1] + 1, size=batch)
        elif self.kind == "geometric":
            values = np.minimum(rng.geometric(1.0 / p[0], size=batch), p[1])
        elif self.kind == "listed":
            if len(p) != batch:
                raise ValueError(
                    f"listed() holds {len(p)} lengths but the batch has {batch} rows; pass one length "
                    f"per row, or use empirical({list(p)}) to draw rows from these lengths")
            values = np.array(p)
        else:
            values = rng.choice(np.array(p), size=batch, replace=True)
        return torch.as_tensor(values, dtype=torch.long)

    # -- exact distribution (for the cost model) -----------------------------------------------
    def pmf(self, max_new_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, probabilities) of one row's length, capped at ``max_new_tokens`` when given
        (a decode never emits more). eos-off: all mass at ``max_new_tokens``."""
        p = self.params
        if self.kind == "eos-off":
            if max_new_tokens is None:
                raise ValueError("eos-off rows run to max_new_tokens; pass max_new_tokens to get their length")
            values, probs = np.array([max_new_tokens]), np.array([1.0])
        elif self.kind == "fixed":
            values, probs = np.array([p[0]]), np.array([1.0])
        elif self.kind == "uniform":
            values = np.arange(p[0], p[1] + 1)
            probs = np.full(len(values), 1.0 / len(values))
        elif self.kind == "geometric":
            q = 1.0 / p[0]
            values = np.arange(1, p[1] + 1)
            probs = q * (1 - q) ** (values - 1)
            probs[-1] = (1 - q) ** (p[1] - 1)          # everything at or past the cap lands on it
        else:
            values, counts = np.unique(np.array(p), return_counts=True)
            probs = counts / counts.sum()
        if max_new_tokens is not None:
            values = np.minimum(values, max_new_tokens)
            values, inverse = np.unique(values, return_inverse=True)
            probs = np.bincount(inverse, weights=probs)
        return values.astype(np.int64), probs

    def mean(self, max_new_tokens: int | None = None) -> float:
        """Expected length of one row (useful tokens per row), capped at ``max_new_tokens``."""
        values, probs = self.pmf(max_new_tokens)
        return float((values * probs).sum())


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not float(value).is_integer() or int(value) < 1:
        raise ValueError(f"{name}={value!r} must be a whole number of tokens >= 1 (a length counts the EOS token)")
    return int(value)


def fixed(n: int) -> LengthDist:
    """Every row ends after exactly ``n`` new tokens (EOS included)."""
    return LengthDist("fixed", (_positive_int("n", n),))


def uniform(lo: int, hi: int) -> LengthDist:
    """Lengths uniform over the integers lo..hi, both included."""
    lo, hi = _positive_int("lo", lo), _positive_int("hi", hi)
    if lo > hi:
        raise ValueError(f"uniform(lo={lo}, hi={hi}): lo must not exceed hi; swap them")
    return LengthDist("uniform", (lo, hi))


def geometric(mean: float, cap: int) -> LengthDist:
    """Each new token is EOS with probability 1/mean (memoryless, like a model whose stop probability
    does not depend on the position), lengths capped at ``cap``. The capped mean is a bit below
    ``mean``: see `LengthDist.mean`."""
    if not (isinstance(mean, (int, float)) and mean >= 1):
        raise ValueError(f"geometric mean={mean!r} must be >= 1 token (the EOS token itself counts)")
    mean = int(mean) if float(mean).is_integer() else float(mean)
    return LengthDist("geometric", (mean, _positive_int("cap", cap)))


def listed(lengths) -> LengthDist:
    """The given lengths, one per row, in order (the batch must have as many rows)."""
    values = tuple(_positive_int("length", v) for v in _as_list(lengths))
    if not values:
        raise ValueError("listed() needs at least one length")
    return LengthDist("listed", values)


def empirical(lengths) -> LengthDist:
    """Rows drawn with replacement from the given lengths (e.g. response lengths of a real dataset)."""
    values = tuple(_positive_int("length", v) for v in _as_list(lengths))
    if not values:
        raise ValueError("empirical() needs at least one length")
    return LengthDist("empirical", values)


def eos_off() -> LengthDist:
    """EOS disabled: decode with ``eos_token_id=None``; every row runs ``max_new_tokens``."""
    return LengthDist("eos-off")


def _as_list(lengths):
    if isinstance(lengths, torch.Tensor):
        return lengths.flatten().tolist()
    return list(lengths)


def parse(spec) -> LengthDist:
    """A `LengthDist` from a spec or a name: ``fixed:128`` / ``fixed128``, ``uniform:16:256``,
    ``geom:128:512`` / ``geom128cap512``, ``list:5,9,12``, ``emp:5,9,12``, ``eos-off``; a
    `LengthDist` passes through, a list of ints becomes `listed`."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, (list, tuple, torch.Tensor)):
        return listed(spec)
    if not isinstance(spec, str):
        raise TypeError(f"cannot read a length distribution from {spec!r}; pass e.g. 'geom:128:512'")
    s = spec.strip().lower()
    try:
        if s in ("eos-off", "eos_off", "none", "off"):
            return eos_off()
        head, _, rest = s.partition(":")
        args = rest.split(":") if rest else []
        if head == "fixed" and len(args) == 1:
            return fixed(int(args[0]))
        if head == "uniform" and len(args) == 2:
            return uniform(int(args[0]), int(args[1]))
        if head in ("geom", "geometric") and len(args) == 2:
            return geometric(float(args[0]), int(args[1]))
        if head in ("list", "emp") and len(args) == 1:
            values = [int(v) for v in args[0].replace("-", ",").split(",") if v]
            return listed(values) if head == "list" else empirical(values)
        # names as written by LengthDist.name

        if m := re.fullmatch(r"fixed(\d+)", s):
            return fixed(int(m[1]))
        if m := re.fullmatch(r"uniform(\d+)-(\d+)", s):
            return uniform(int(m[1]), int(m[2]))
        if m := re.fullmatch(r"geom([\d.]+)cap(\d+)", s):
            return geometric(float(m[1]), int(m[2]))
        if m := re.fullmatch(r"(list|emp)([\d-]+)", s):
            values = [int(v) for v in m[2].split("-") if v]
            return listed(values) if m[1] == "list" else empirical(values)
    except ValueError as err:
        raise ValueError(f"length distribution {spec!r}: {err}") from None
    raise ValueError(
        f"unknown length distribution {spec!r}; use fixed:N, uniform:LO:HI, geom:MEAN:CAP, "
        f"list:A,B,C (one per row), emp:A,B,C (drawn with replacement) or eos-off")


def expected_max(dist: LengthDist, batch: int, max_new_tokens: int | None = None, *,
                 samples: int | None = None, seed: int = 0) -> float:
    """E[max length over ``batch`` rows], the number of tokens until the batch's last row ends.

    Exact from the pmf (rows independent: P(max <= m) = F(m)^batch); with ``samples`` set, a seeded
    Monte Carlo estimate instead (a cross-check). `listed` lengths are fixed: their max."""
    if samples:
        if not dist.eos:
            return float(max_new_tokens)
        rows = torch.stack([dist.draw(batch, seed=seed + i) for i in range(samples)])
        top = rows.max(dim=1).values
        if max_new_tokens is not None:
            top = top.clamp(max=max_new_tokens)
        return float(top.double().mean())
    values, p_max = max_pmf(dist, batch, max_new_tokens)
    return float((values * p_max).sum())


def max_pmf(dist: LengthDist, batch: int, max_new_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) of the max length over ``batch`` independent rows."""
    if dist.kind == "listed":
        m = max(dist.params)
        return np.array([min(m, max_new_tokens) if max_new_tokens else m]), np.array([1.0])
    values, probs = dist.pmf(max_new_tokens)
    cdf = np.cumsum(probs)
    cdf[-1] = 1.0
    below = np.concatenate([[0.0], cdf[:-1]])
    return values, cdf ** batch - below ** batch

