"""kernels="compiled" for a rollout whose rows are their own sequences (`core/rollout_step.py`).

The decode step of `RowStep` (HF's forward over the per-row cache write, selection, the update of every slot and
the flags) runs as one inductor program; the refill (one prompt's prefill and its first token) stays HF's
kernels, captured as it is. The compiled function is kept in the model's table of compiled steps
(`compiled.py`), one per shape key: the state's buffers (slots, sequences, cache columns, what is recorded),
the settings, the per-row window and what the log-probabilities are of. The seed is read from a buffer
(`noise.seed_words`), so a new seed compiles nothing; neither does a second rollout of the same shapes.

As with the static step, the compiled step rounds differently from HF's kernels (it is not bitwise generate());
each mode is bit for bit its uncaptured twin, the same program called directly (`capture=False`).
"""
from __future__ import annotations

import time

import torch

from ..core.rollout_step import RowStep
from . import step as kernel_step
from .compiled import _ATTR, _Compiled, _fresh, _graphs_compiled, _no_function_modes


def _row_step(step):
    RowStep.__call__(step)


class CompiledRowStep(RowStep):
    """`RowStep` whose decode step (`__call__`) runs a compiled function; `refill` is RowStep's."""

    kernels = "compiled"

    def __call__(self) -> None:
        entry = self._entry()
        before = _graphs_compiled()
        t0 = time.perf_counter()
        with _no_function_modes():
            entry.fn(self)
        compiled = _graphs_compiled() - before
        if compiled:
            entry.compile_s += time.perf_counter() - t0
            entry.compiles += compiled
        entry.calls += 1

    def _key(self) -> tuple:
        buffers = tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in sorted(vars(self.state).items())
                        if isinstance(t, torch.Tensor))
        param = next(self.model.parameters())
        return ("rows", param.dtype, str(param.device), buffers, self.settings, self.window, self.logprobs_of)

    def _entry(self) -> _Compiled:
        table = self.model.__dict__.setdefault(_ATTR, {})
        key = self._key()
        if key not in table:
            slots, columns = self.state.mask.shape
            name = (f"rows_s{slots}_q{self.queue_size}_c{columns}_n{self.settings.max_new_tokens}_"
                    + ("sample" if self.settings.do_sample else "greedy"))
            fn = torch.compile(_fresh(_row_step), backend="inductor", fullgraph=True, dynamic=False,
                               options=kernel_step.INDUCTOR_OPTIONS)   # the static step's, read at each compile
            table[key] = _Compiled(fn, name, kernels="compiled")
        return table[key]
