"""kernels="compiled" for a rollout whose rows are their own sequences (`core/rollout_step.py`).

The decode forward of `RowStep` (HF's forward over the per-row cache write) and the selection of each slot's
token run as one inductor program (`forward_select`); the update of the per-sequence results, the flags and the
refill (one prompt's prefill and its first token) stay as they are, captured with it. The program reads the
slot-sized buffers and the cache only, never the queue or the results, so it is the same for any number of
prompts: it is kept in the model's table of compiled steps (`compiled.py`), one per shape key (slots, cache
columns, what is recorded, the settings, the per-row window, what the log-probabilities are of). The seed is
read from a buffer (`noise.seed_words`), so a new seed compiles nothing; neither does another rollout of the same
slots and cache columns.

As with the static step, the compiled program rounds differently from HF's kernels (it is not bitwise
generate()); each mode is bit for bit its eager run, the same program called directly.
"""
from __future__ import annotations

import time

import torch

from ..core.rollout_step import RowStep
from . import step as kernel_step
from .compiled import _ATTR, _Compiled, _fresh, _graphs_compiled, _no_function_modes


def _forward_select(step):
    return RowStep.forward_select(step)


class CompiledRowStep(RowStep):
    """`RowStep` whose `forward_select` runs a compiled function."""

    kernels = "compiled"

    def forward_select(self) -> tuple:
        entry = self._entry()
        before = _graphs_compiled()
        t0 = time.perf_counter()
        with _no_function_modes():
            result = entry.fn(self)
        compiled = _graphs_compiled() - before
        if compiled:
            entry.compile_s += time.perf_counter() - t0
            entry.compiles += compiled
        entry.calls += 1
        return result

    def _key(self) -> tuple:
        s = self.state
        read = (s.tokens, s.positions, s.mask, s.seen, s.prompt_index, s.sample_index, s.lengths, s.targets, s.eos)
        buffers = tuple(None if t is None else (tuple(t.shape), t.dtype, str(t.device)) for t in read)
        param = next(self.model.parameters())
        return ("rows", param.dtype, str(param.device), buffers, s.logprobs is not None, self.settings, self.window,
                self.logprobs_of)

    def _entry(self) -> _Compiled:
        table = self.model.__dict__.setdefault(_ATTR, {})
        key = self._key()
        if key not in table:
            slots, columns = self.state.mask.shape
            name = f"rows_s{slots}_c{columns}_n{self.settings.max_new_tokens}_" + \
                ("sample" if self.settings.do_sample else "greedy")
            fn = torch.compile(_fresh(_forward_select), backend="inductor", fullgraph=True, dynamic=False,
                               options=kernel_step.INDUCTOR_OPTIONS)   # the static step's, read at each compile
            table[key] = _Compiled(fn, name, kernels="compiled")
        return table[key]
