"""A decoder that keeps its captured graphs across calls: what an RL loop or a server calls thousands of times.

`gdtool.decode()` builds buffers, a static cache and a CUDA graph for one call and frees them. A
`Decoder` keeps them, keyed by a `Signature` (gdtool/core/signature.py): every address, dtype, shape and
stride of the model's tensors, the precision flags, the shapes and the settings a captured step has
baked in. A call with the signature of an earlier one replays that graph; anything changed captures a
new one, so a graph is never replayed stale. In-place weight updates (`p.copy_(new)`, what an RL
weight sync does) keep every address, so they keep the signature and the next replay reads the new
weights.

    dec = gdtool.Decoder(model, max_new_tokens=64, do_sample=True, temperature=0.8, return_logprobs=True)
    out = dec.generate(ids, mask, seed=0)          # captures
    out = dec.generate(ids2, mask2)                # same shapes: replays, out.captures == 0
    dec.graphs                                     # the graphs it holds: mode's graph, batch, width, phase, captured
    dec = gdtool.Decoder(model, buckets=(32, 64, 128), max_new_tokens=64)   # prompt widths share graphs
    dec.close()                                    # frees graphs, caches, buffers

Tokens are those of `generate()` on the prompt the Decoder actually runs: with `buckets`, the prompt
left-padded to its bucket (docs/decoder.md says when that equals generate() on the unpadded prompt).

Without CUDA (a CPU) nothing is captured: `captures` stays 0 and each graph the Decoder would capture on
a GPU is built as an uncaptured stand-in, counted in `uncaptured` and listed in `graphs` with
`captured=False`. The reuse is the same: a call with a known signature builds nothing.
"""
from __future__ import annotations

import copy
import time
from collections import OrderedDict

import torch

from ..core import compat, sampling
from ..core import signature as signatures
from .decode import DecodeOutput, Engine, _infer_mask, check_input_ids, check_poll, check_run, check_samples, repeat_samples
from ..core.graphs import can_capture
from ..core.modes import check_mode
from ..core.settings import SUPPORTED, resolve

# Keywords a Decoder takes besides generate()'s settings; `configure()` may change them.
OPTIONS = ("max_new_tokens", "return_scores", "return_logprobs", "num_samples", "eos_poll_interval", "capture",
           "kernels")


class Decoder:
    """Decode with `model` again and again, capturing a graph once per signature (LRU, `max_graphs`).

    mode: one of gdtool.MODES ("step-graph" by default; `gdtool.core.modes`). max_graphs: engines (graph + static cache +
    buffers) kept at once; the least recently used is closed when a new one is needed. buckets:
    increasing prompt widths; a prompt is left-padded to the smallest bucket that holds it (wider
    prompts run at their own width). Settings: those of `gdtool.decode()` (kernels: one of
    `gdtool.core.modes.KERNELS`, "hf", "compiled" or "fast"), resolved against `model.generation_config` as generate()
    resolves them (again whenever that config changes).
    """

    def __init__(self, model, mode: str = "step-graph", max_graphs: int = 8, buckets=None, *,
                 max_new_tokens: int | None = None, return_scores: bool = False, return_logprobs: bool = False,
                 num_samples: int = 1, eos_poll_interval: int | str | None = None, capture: bool | None = None,
                 kernels: str = "hf", **settings):
        check_mode(mode)  # before anything else is read
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r} must be an int >= 1 (engines kept at once)")
        self.model, self.mode, self.max_graphs = model, mode, max_graphs
        self.buckets = _check_buckets(buckets)
        self.device = next(model.parameters()).device
        self.captures = 0          # CUDA graphs captured over this Decoder's life
        self.uncaptured = 0        # graphs a GPU would have captured, built uncaptured instead (no CUDA, capture=False)
        self.evictions = 0         # engines closed to stay under max_graphs
        self.engines: OrderedDict = OrderedDict()  # Signature -> Engine, least recently used first
        self._options, self._settings = {}, {}
        self._resolved = self._config_snapshot = None
        self.configure(max_new_tokens=max_new_tokens, return_scores=return_scores, return_logprobs=return_logprobs,
                       num_samples=num_samples, eos_poll_interval=eos_poll_interval, capture=capture, kernels=kernels,
                       **settings)

    # -- settings -----------------------------------------------------------------------------------
    def configure(self, **changes) -> "Decoder":
        """Change settings or options for the next calls (e.g. temperature between eval and train rollouts).

        Graphs captured under the old settings stay cached: switching back replays them.
        """
        settings, options = dict(self._settings), dict(self._options)
        for name, value in changes.items():
            if name in OPTIONS:
                options[name] = value
            else:
                settings[name] = value  # unknown or refused names are reported by resolve()
        check_samples(options["num_samples"], settings)
        sampling.logprobs_kind(options["return_logprobs"])
        options["kernels"] = check_run(self.model, self.mode, options["kernels"], options["capture"])
        check_poll(options["eos_poll_interval"], self.mode)
        resolved = self._resolve(options, settings)
        check_samples(options["num_samples"], {}, resolved)
        self._settings, self._options = settings, options
        self._resolved, self._config_snapshot = resolved, copy.deepcopy(vars(self.model.generation_config))
        return self

    @property
    def settings(self):
        """The resolved `Settings` the next call uses."""
        return self._current_settings()

    def _resolve(self, options, settings):
        explicit = {k: v for k, v in settings.items() if k in SUPPORTED}
        extra = {k: v for k, v in settings.items() if k not in SUPPORTED}
        return resolve(self.model, options["max_new_tokens"], explicit, extra)

    def _current_settings(self):
        # generate() resolves against model.generation_config on every call; so does a Decoder, but only
        # when that config changed since the last resolution (a dict comparison, not a resolution).
        try:
            changed = vars(self.model.generation_config) != self._config_snapshot
        except (RuntimeError, ValueError):  # a value that does not compare (a tensor): resolve every call
            changed = True
        if changed:
            self._resolved = self._resolve(self._options, self._settings)
            self._config_snapshot = copy.deepcopy(vars(self.model.generation_config))
        return self._resolved

    # -- one call -----------------------------------------------------------------------------------
    def signature(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  target_lengths=None) -> signatures.Signature:
        """The key of the graph `generate()` would use for these inputs now."""
        settings = self._current_settings()
        ids, _, _ = self._prepare(input_ids, attention_mask, target_lengths, settings)
        return self._signature(ids, target_lengths is not None, settings)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, seed: int | None = None,
                 target_lengths=None) -> DecodeOutput:
        """Decode like `gdtool.decode()` with this Decoder's settings, replaying a graph when one fits."""
        t0 = time.perf_counter()
        settings = self._current_settings()
        ids, mask, targets = self._prepare(input_ids, attention_mask, target_lengths, settings)
        key = self._signature(ids, targets is not None, settings)
        signature_s = time.perf_counter() - t0
        engine = self.engines.get(key)
        if engine is None:
            while len(self.engines) >= self.max_graphs:
                _, old = self.engines.popitem(last=False)
                old.close()
                self.evictions += 1
            engine = Engine(self.model, self.mode, settings, ids, return_scores=self._options["return_scores"],
                            with_targets=targets is not None, capture=self._options["capture"],
                            cache_len=key.cache_len, return_logprobs=self._options["return_logprobs"],
                            kernels=self._options["kernels"])
            self.engines[key] = engine
        else:
            self.engines.move_to_end(key)
        built = engine.uncaptured
        out = engine.run(ids, mask, target_lengths=targets, seed=seed,
                         eos_poll_interval=self._options["eos_poll_interval"])
        self.captures += out.captures
        self.uncaptured += engine.uncaptured - built
        out.timings["signature_s"] = signature_s
        out.timings["total_s"] = time.perf_counter() - t0
        return out

    def _prepare(self, input_ids, attention_mask, target_lengths, settings):
        """The prompt the engine runs: rows repeated for num_samples, then left-padded to the bucket."""
        check_input_ids(input_ids)
        if attention_mask is None:
            attention_mask = _infer_mask(input_ids, settings)
        samples = self._options["num_samples"]
        if samples > 1:
            input_ids, attention_mask, target_lengths = repeat_samples(input_ids, attention_mask, target_lengths,
                                                                       samples, settings)
        width = input_ids.shape[1]
        bucket = next((b for b in self.buckets if b >= width), width)
        if bucket > width:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; got "
                                 f"{tuple(getattr(attention_mask, 'shape', ()))}")
            pad = settings.pad_token_id if settings.pad_token_id is not None else 0
            extra = bucket - width
            input_ids = torch.cat([input_ids.new_full((input_ids.shape[0], extra), pad), input_ids], dim=1)
            attention_mask = torch.cat([attention_mask.new_zeros((attention_mask.shape[0], extra)), attention_mask],
                                       dim=1)
        return input_ids, attention_mask, target_lengths

    def _signature(self, ids, targets: bool, settings) -> signatures.Signature:
        batch, width = ids.shape
        cache_len = compat.cache_length(self.model, width, settings.max_new_tokens)
        return signatures.of(self.model, mode=self.mode, batch=batch, width=width, cache_len=cache_len,
                             settings=settings, targets=targets,
                             captured=self.captured,
                             return_scores=self._options["return_scores"],
                             return_logprobs=self._options["return_logprobs"],
                             num_samples=self._options["num_samples"], kernels=self._options["kernels"])

    @property
    def captured(self) -> bool:
        """Whether this Decoder's graphs are CUDA graphs: its mode captures, `capture` is not False, and the
        model is on a CUDA device. False: eager, or a graph mode whose graphs run uncaptured (`uncaptured`)."""
        return (check_mode(self.mode).captures and self._options["capture"] is not False
                and can_capture(next(self.model.parameters()).device))

    @property
    def graphs(self) -> list[dict]:
        """The graphs the held engines hold, least recently used first: one per window phase of an engine
        (a device loop's WHILE node wraps each). `graph` is what one holds ("forward" or "step"); `captured`
        is False where it runs uncaptured (no CUDA, or capture=False): what a GPU would capture."""
        return [{"graph": engine.spec.graph, "batch": engine.batch, "width": engine.width,
                 "cache_len": engine.cache_len, "phase": phase, "captured": bool(graph.captured)}
                for engine in self.engines.values() for phase, graph in engine.graphs.items()]

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every graph, static cache and buffer. The Decoder stays usable: the next call captures again."""
        while self.engines:
            _, engine = self.engines.popitem(last=False)
            engine.close()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        # where the mode's graphs run uncaptured, the count of them says what a GPU would have captured
        built = f", uncaptured={self.uncaptured}" if check_mode(self.mode).captures and not self.captured else ""
        return (f"Decoder(mode={self.mode!r}, engines={len(self.engines)}/{self.max_graphs}, "
                f"captures={self.captures}{built}, buckets={self.buckets})")


def _check_buckets(buckets) -> tuple[int, ...]:
    if buckets is None:
        return ()
    widths = tuple(buckets)
    if not widths or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in widths) \
            or list(widths) != sorted(set(widths)):
        raise ValueError(f"buckets={buckets!r} must be increasing positive ints (prompt widths), e.g. (32, 64, 128)")
    return widths
