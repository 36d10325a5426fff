"""kernels="compiled" and "fast" for a rollout whose rows are their own sequences (`core/rollout_step.py`).

Inductor programs: the decode forward of `RowStep` (HF's forward over the per-row cache write) with the
selection of each slot's token (`forward_select`), and per refill size g and width w a refill's prefill of g
prompts w columns wide with their first tokens (`prefill_select`), its decoder layers compiled once for all
(`regions.py`: a program's compile time no longer grows with depth). The update of the per-sequence results,
the flags and the choice of slot and sequence stay as they are, captured around them. Neither program reads the queue or the results, so they are the same for any
number of prompts: each is kept in the model's table of compiled steps (`compiled.py`), one per shape key
(slots, cache columns, refill rows and width, what is recorded, the settings, the per-row window, what the
log-probabilities are of). The seed is
read from a buffer (`noise.seed_words`), so a new seed compiles nothing; neither does another rollout of the same
slots and cache columns.

Each call runs inside the attention dispatcher's scope (`attention.scope`), as the static compiled step does: a
one-token query over the cache takes the packed grouped-query form, not HF's `repeat_kv`, which copies every row's
whole cache per layer (at 64 slots that copy is most of the step). kernels="fast" adds gdtool's split-KV kernels for
those calls (`attention.split_kv_plan`; gpt-oss: `sinks_plan`), which read the per-row mask and skip each row's
masked columns: the rows' own lengths, without a shared write index. On a mixture of experts the decode
program's MoE blocks run gdtool's experts kernels (`experts.scope`, as in the static fast step, whose
qwen3-30b-a3b runs at batch 64 with them), planned for the slots. A prefill (W query tokens) keeps HF's attention and
experts; gdtool's own decode forward and its matrix-vector kernels are not used here (the forward's cache write
is one column shared by every row).

As with the static step, the compiled program rounds differently from HF's kernels (it is not bitwise
generate()); each mode is bit for bit its eager run, the same program called directly.
"""
from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..core.rollout_step import RowStep
from . import attention, experts, regions
from . import step as kernel_step
from .compiled import _ATTR, _Compiled, _fresh, _graphs_compiled, _no_function_modes


def _forward_select(step):
    return RowStep.forward_select(step)


def _prefill_select(step, *args):
    return RowStep.prefill_select(step, *args)


class CompiledRowStep(RowStep):
    """`RowStep` whose `forward_select` and `prefill_select` run compiled functions (kernels "compiled" or "fast")."""

    def __init__(self, *args, kernels: str = "compiled", **kwargs):
        super().__init__(*args, **kwargs)
        if kernels not in ("compiled", "fast"):
            raise ValueError(f"kernels={kernels!r}: a compiled row step runs 'compiled' or 'fast'")
        self.kernels = kernels
        self.sinks_kernel, self.sinks_note = attention.sinks_plan(self.model, kernels)
        self.split_kernel, self.split_note = attention.split_kv_plan(self.model, kernels)
        attention.install()
        self.regions = regions.plan(self.model)   # refills' prefills compile by layer (regions.py)
        # "fast" on a mixture of experts: the decode program's MoE blocks in gdtool's kernels, planned for the slots
        self.moe_plan = experts.plan(self.model, self.slots) if kernels == "fast" else None
        # the cache allocated now, not at the first write: a program compiled around that write would branch on
        # it and be compiled again once it is done
        config = self.model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(self.model.parameters())
        self.cache.early_initialization(self.slots, heads, head_dim, param.dtype, param.device)

    def forward_select(self) -> tuple:
        return self._call(_forward_select)

    def prefill_select(self, *args) -> tuple:
        return self._call(_prefill_select, *args)

    def _call(self, body, *args) -> tuple:
        if _get_current_dispatch_mode() is not None:
            # dynamo skips a frame under a dispatch mode and marks its code to run uncompiled for good: every
            # later call, captured or not, would run HF's eager ops in place of this program
            raise RuntimeError(f"the compiled row step ({self.kernels}) ran under a TorchDispatchMode "
                               f"({type(_get_current_dispatch_mode()).__name__}); dynamo would leave it "
                               "uncompiled from then on. Call it outside the mode (a capture's warm-up watches HF's "
                               "kernels only: kernels.step.watched)")
        shape = tuple(args[0].shape) if args else (0, 0)
        regional = bool(self.regions) and body is _prefill_select
        moe = self.moe_plan if body is _forward_select else None
        entry = self._entry(body, *shape, regional)
        before = _graphs_compiled()
        t0 = time.perf_counter()
        try:
            with _no_function_modes(), attention.scope(self.sinks_kernel, self.split_kernel), experts.scope(moe), \
                    regions.scope(self.regions if regional else []):
                result = entry.fn(self, *args)
        except Exception as error:   # noqa: BLE001 - a region dynamo cannot trace: the whole model, said so
            if not regional or entry.calls:
                raise
            self.model.__dict__[_ATTR].pop(self._key(body, *shape, True), None)   # never ran: not kept
            entry = self._entry(body, *shape, False)
            entry.note = f"compiled whole: by layer it failed ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
            self.regions = []
            with _no_function_modes(), attention.scope(self.sinks_kernel, self.split_kernel):
                result = entry.fn(self, *args)
        compiled = _graphs_compiled() - before
        if compiled:
            entry.compile_s += time.perf_counter() - t0
            entry.compiles += compiled
        entry.calls += 1
        return result

    def _key(self, body, rows: int, width: int, regional: bool) -> tuple:
        s = self.state
        read = (s.tokens, s.positions, s.mask, s.seen, s.prompt_index, s.sample_index, s.lengths, s.targets, s.eos)
        buffers = tuple(None if t is None else (tuple(t.shape), t.dtype, str(t.device)) for t in read)
        param = next(self.model.parameters())
        return ("rows", body.__name__, rows, width, param.dtype, str(param.device), buffers, self.records_logprobs, self.settings,
                self.window, self.logprobs_of, self.sinks_kernel, self.split_kernel, regional,
                self._moe_key(body))

    def _moe_key(self, body) -> tuple:
        """The MoE layers the decode program runs in gdtool's kernels (a prefill: none)."""
        return self.moe_plan.key() if self.moe_plan is not None and body is _forward_select else ()

    def _entry(self, body, rows: int, width: int, regional: bool = False) -> _Compiled:
        """The compiled program of `body` for this step's shapes; `rows` and `width`: a prefill's prompts and
        columns (0, 0: decode); `regional`: its decoder layers compiled once each kind (regions.py)."""
        table = self.model.__dict__.setdefault(_ATTR, {})
        key = self._key(body, rows, width, regional)
        if key not in table:
            slots, columns = self.state.mask.shape
            what = "decode" if body is _forward_select else f"prefill_g{rows}_w{width}"
            name = f"rows_{what}_s{slots}_c{columns}_n{self.settings.max_new_tokens}_" + \
                ("sample" if self.settings.do_sample else "greedy") + ("_split" if self.split_kernel else "") + \
                ("_sinks" if self.sinks_kernel else "") + ("_moe" if self._moe_key(body) else "")
            fn = torch.compile(_fresh(body), backend="inductor", fullgraph=True, dynamic=False,
                               options=kernel_step.INDUCTOR_OPTIONS)   # the static step's, read at each compile
            moe = self.moe_plan.note() if self._moe_key(body) else ""
            table[key] = _Compiled(fn, name, kernels=self.kernels,
                                   note="compiled by layer (nested compile regions)" if regional else moe)
        return table[key]
