"""The four decode loops (`gdtool.core.modes`). They drive the same `Step` and differ only in where a step runs.

    eager          per step the host runs forward, select, update, and reads the "all finished" flag
    forward-graph  the model forward is one CUDA-graph replay; select, update and the check stay eager
    step-graph     the whole step is one replay; the host reads the flag every `eos_poll_interval` steps
    device-loop    the step graph is the body of a CUDA-graph WHILE node: one launch runs the rollout and
                   stops on the device right after the last row finishes (`steps_per_launch` chunks it)

With HF's kernels (`kernels="hf"`, the default) tokens never depend on the mode or on the polling interval:
every mode computes, bit for bit,
`torch.manual_seed(seed); model.generate(..., cache_implementation="static", disable_compile=True)`.

    out = gdtool.decode(model, ids, mask, mode="step-graph", max_new_tokens=64, eos_poll_interval=16)
    out = gdtool.decode(model, ids, mask, mode="eager", max_new_tokens=64, do_sample=True, seed=0)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..core import compat, feed, graphs, ranges, sampling
from ..core.capture import capture_phases
from ..core.modes import DEFAULT_POLL, MODES, check_mode
from ..kernels import step as kernel_step
from ..core.settings import UNSET, Settings, resolve
from ..core.step import State, new_state, seed_seen
from ..core.syncs import Counter, hidden_waits

__all__ = ["MODES", "DecodeOutput", "Engine", "check_run", "decode"]
WARMUP_STEPS = 2


@dataclass
class DecodeOutput:
    """What one decode made, and what it did to make it.

    `captured` says whether the steps ran as CUDA-graph replays: True for the graph modes on a CUDA
    device (unless `capture=False`); False in eager mode, with `capture=False`, and without CUDA (a
    CPU), where the graph modes run the same step uncaptured. `captures` and `replays` count CUDA
    graphs only, so they are 0 wherever `captured` is False. `launches` counts the host's calls of the
    mode's graph, captured or not (one per forward in forward-graph, per step in step-graph, per loop
    launch in device-loop; 0 in eager): where captured it equals `replays`, uncaptured it says how
    many times the stand-in step ran in their place. `timings["capture_s"]` is the time spent
    recording graphs (0 uncaptured); `timings["warmup_s"]` the warm-up steps, which run either way.
    """
    tokens: torch.Tensor              # [B, T] new tokens on the CPU, trimmed as generate() trims them
    lengths: torch.Tensor             # [B] tokens per row up to and including its EOS
    steps: int                        # decode forwards after the prefill
    replays: int                      # CUDA-graph launches (0 where not captured)
    host_syncs: int                   # blocking host waits, hidden ones included
    polls: int                        # reads of the "all finished" flag
    wasted_steps: int                 # steps run after the last row had finished
    mode: str
    batch: int
    max_new_tokens: int
    device: str
    timings: dict = field(default_factory=dict)
    scores: tuple | None = None       # T x [B, V] float32 processed scores, with return_scores=True
    captures: int = 0                 # CUDA graphs captured by this call
    captured: bool = False            # the steps ran as CUDA-graph replays (see the docstring)
    launches: int = 0                 # calls of the mode's graph, captured or uncaptured (see the docstring)
    logprobs: torch.Tensor | None = None  # [B, T] float32 log-probability of each token, with return_logprobs
                                          # (True: processed scores; "temperature": logits / temperature alone)
    memory: dict = field(default_factory=dict)  # kv_cache_bytes, graph_pool_bytes, buffer_bytes of the engine
    experts: str | None = None        # MoE: the experts implementation the decode steps ran (generate()'s choice)

    @property
    def new_tokens(self) -> int:
        return int(self.lengths.sum())


def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, mode: str = "eager",
           max_new_tokens: int | None = None, do_sample=UNSET, temperature=UNSET, top_k=UNSET, top_p=UNSET,
           repetition_penalty=UNSET, eos_token_id=UNSET, pad_token_id=UNSET, seed: int | None = None,
           eos_poll_interval: int | str | None = None, return_scores: bool = False, target_lengths=None,
           capture: bool | None = None, steps_per_launch: int | None = None, on_chunk=None,
           return_logprobs: bool | str = False, num_samples: int = 1, kernels: str = "hf", **unsupported) -> DecodeOutput:
    """Decode `max_new_tokens` (required) from left-padded prompts; see the module docstring.

    Settings resolve as generate() resolves them (explicit, then `model.generation_config`, then
    transformers' defaults; an explicit None overrides). `seed` seeds the global generators as
    `torch.manual_seed(seed)` does; with `seed=None` the global generator is used and left where
    generate() would have left it. `target_lengths` ([B] ints) forces row b to emit its first EOS id
    as its target_lengths[b]-th token (a harness for controlled lengths with random weights).
    `capture`: None captures the graph modes where CUDA is available; False runs them uncaptured;
    True requires capture. device-loop only: `steps_per_launch=N` runs at most N steps per launch
    and calls `on_chunk(tokens)` (CPU [B, produced]) between launches, for streaming.
    `return_logprobs` fills `out.logprobs` [B, T]: the log-softmax of the processed scores at each
    written token (0 after a row's EOS); return_logprobs="temperature": of the logits over the temperature alone
    (no penalty, top-k or top-p), the distribution PPO/GRPO ratios use. `num_samples=k` decodes every prompt k
    times, rows repeated as generate()'s `num_return_sequences=k` repeats them.
    `kernels`, one of `gdtool.core.modes.KERNELS` (each described there): "hf" (the default) runs HF's kernels;
    "compiled" the same step with fused kernels (torch.compile, no CUDA graphs of its own; gdtool captures it):
    faster, not bitwise generate(); "fast" the compiled step with gdtool's own decode kernels where they apply
    (gdtool/kernels/step.py, docs/fast.md).
    """
    check_samples(num_samples, unsupported)
    sampling.logprobs_kind(return_logprobs)   # a bad value fails before any work
    explicit = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                    repetition_penalty=repetition_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    settings = resolve(model, max_new_tokens, explicit, unsupported)
    check_samples(num_samples, {}, settings)
    if num_samples > 1:
        input_ids, attention_mask, target_lengths = repeat_samples(input_ids, attention_mask, target_lengths,
                                                                   num_samples, settings)
    engine = Engine(model, mode, settings, input_ids, return_scores=return_scores,
                    with_targets=target_lengths is not None, capture=capture, return_logprobs=return_logprobs,
                    kernels=kernels)
    try:
        return engine.run(input_ids, attention_mask, target_lengths=target_lengths, seed=seed,
                          eos_poll_interval=eos_poll_interval, steps_per_launch=steps_per_launch,
                          on_chunk=on_chunk)
    finally:
        engine.close()


def check_samples(num_samples, unsupported: dict, settings: Settings | None = None) -> None:
    """num_samples is gdtool's name for generate()'s num_return_sequences (refused by that name)."""
    sequences = unsupported.get("num_return_sequences")
    if sequences not in (None, 1):
        raise ValueError(f"num_return_sequences={sequences!r}: gdtool calls it num_samples; pass "
                         f"num_samples={sequences!r} (rows repeated as generate() repeats them)")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r} must be an int >= 1 (samples per prompt)")
    if settings is not None and num_samples > 1 and not settings.do_sample:
        raise ValueError(f"num_samples={num_samples} with greedy decoding would repeat one answer (generate() "
                         "refuses it too); pass do_sample=True, or num_samples=1")


def repeat_samples(input_ids, attention_mask, target_lengths, num_samples: int, settings: Settings):
    """Each prompt row `num_samples` times in a row, as generate() expands for num_return_sequences."""
    check_input_ids(input_ids)
    if attention_mask is None:
        attention_mask = _infer_mask(input_ids, settings)
    if target_lengths is not None:
        targets = torch.as_tensor(target_lengths, dtype=torch.long).flatten()
        # one length per prompt is repeated like its prompt; one per output row is taken as it is
        target_lengths = targets.repeat_interleave(num_samples) if targets.numel() == input_ids.shape[0] else targets
    return (input_ids.repeat_interleave(num_samples, dim=0), attention_mask.repeat_interleave(num_samples, dim=0),
            target_lengths)


def check_poll(eos_poll_interval, mode: str):
    poll = DEFAULT_POLL[mode] if eos_poll_interval is None else eos_poll_interval
    if check_mode(mode).device_loop and poll != 0:
        raise ValueError(f"eos_poll_interval={eos_poll_interval!r}: the device loop checks the flag on the device after "
                         "every step and stops exactly; leave eos_poll_interval unset (or 0), and use "
                         "steps_per_launch=N to read tokens every N steps")
    if poll == "async":
        return poll
    if isinstance(poll, bool) or not isinstance(poll, int) or poll < 0:
        raise ValueError(f"eos_poll_interval={eos_poll_interval!r} must be an int >= 0 (1 = every step, 0 = never) "
                         "or 'async'")
    return poll


def check_run(model, mode: str, kernels: str, capture: bool | None) -> str:
    """What a decode or a Decoder checks of its model and choices before any work: the mode, the model
    (`feed.check`: refused, with the reason, where gdtool cannot decode it as generate() does in `mode`), the
    kernels (`kernel_step.check_kernels`) and capture. Returns the kernels choice."""
    check_mode(mode)
    device = next(model.parameters()).device
    feed.check(model, mode, device)
    kernels = kernel_step.check_kernels(kernels, device, model, mode)
    if capture and not graphs.can_capture(device):
        raise ValueError(f"capture=True needs a CUDA device, and the model is on {device}; use capture=None to run "
                         "the graph modes uncaptured (same step function) where there is no CUDA")
    return kernels


def check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError("input_ids must be a 2-D integer tensor [batch, prompt_length]; got "
                         f"{type(input_ids).__name__} {getattr(input_ids, 'shape', '')} {getattr(input_ids, 'dtype', '')}")
    batch, width = input_ids.shape
    if batch == 0:
        raise ValueError("the batch is empty (input_ids has 0 rows); pass at least one prompt")
    if width == 0:
        raise ValueError("the prompts are empty (input_ids has 0 columns); every row needs at least one token")


def _validate(model, input_ids, attention_mask, settings: Settings, target_lengths):
    """Check the inputs on the host (one read-back) and return the attention mask to use."""
    check_input_ids(input_ids)
    batch, width = input_ids.shape
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {device}; move them with "
                         f"input_ids.to({str(device)!r})")
    vocab = model.config.get_text_config().vocab_size
    ids = input_ids.detach().cpu()
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab}) (min {int(ids.min())}, "
                         f"max {int(ids.max())}); check the tokenizer matches the model")
    if attention_mask is None:
        attention_mask = _infer_mask(input_ids, settings)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}; got "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but the model is on {device}; "
                         f"move it with attention_mask.to({str(device)!r})")
    mask = attention_mask.detach().cpu().long()
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
    if (mask.sum(1) == 0).any():
        rows = (mask.sum(1) == 0).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} have no token (their attention_mask is all 0); drop them or give them a prompt")
    if (mask[:, 1:] < mask[:, :-1]).any():
        rows = (mask[:, 1:] < mask[:, :-1]).any(1).nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} are right-padded or have holes in their attention_mask; gdtool needs "
                         "left padding (tokenizer.padding_side = 'left'): pads first, then the prompt")
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and width + settings.max_new_tokens - 1 > max_positions:
        raise ValueError(f"prompt width {width} + max_new_tokens {settings.max_new_tokens} - 1 exceeds the model's "
                         f"{max_positions} positions; shorten the prompt or ask for fewer tokens")
    targets = None
    if target_lengths is not None:
        if not settings.has_eos:
            raise ValueError("target_lengths forces an EOS token, but EOS is disabled; pass eos_token_id")
        targets = torch.as_tensor(target_lengths, dtype=torch.long).flatten()
        if targets.numel() != batch or (targets < 1).any():
            raise ValueError(f"target_lengths needs one length >= 1 per row ({batch} rows); got {target_lengths!r}")
    return attention_mask.long(), targets


def _infer_mask(input_ids, settings: Settings) -> torch.Tensor:
    # generate(): without a mask, pads are inferred from the pad id, unless pad is also an EOS id.
    pad = settings.pad_token_id
    if pad is not None and (input_ids == pad).any() and pad not in settings.eos_token_id:
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class Engine:
    """Buffers, static cache and captured graphs for one (model, mode, settings, batch, width).

    `run()` may be called again with prompts of the same shape: buffers are refilled in place and
    captured graphs are replayed, not captured again.
    """

    def __init__(self, model, mode: str, settings: Settings, input_ids: torch.Tensor, return_scores: bool = False,
                 with_targets: bool = False, capture: bool | None = None, cache_len: int | None = None,
                 return_logprobs: bool = False, kernels: str = "hf"):
        check_input_ids(input_ids)
        self.kernels = check_run(model, mode, kernels, capture)
        device = next(model.parameters()).device
        self.model, self.mode, self.settings, self.device = model, mode, settings, device
        self.spec = check_mode(mode)
        self.captures_enabled = self.spec.captures and capture is not False and graphs.can_capture(device)
        self.batch, self.width = input_ids.shape
        self.cache_len = cache_len or compat.cache_length(model, self.width, settings.max_new_tokens)
        self.cache = compat.static_cache(model, self.cache_len)
        feed.check_cache(self.cache, mode, model)
        vocab = model.config.get_text_config().vocab_size
        self.state: State = new_state(input_ids, torch.ones_like(input_ids), settings, self.cache_len, vocab,
                                      return_scores, torch.ones(self.batch, dtype=torch.long) if with_targets else None,
                                      return_logprobs)
        self.step = kernel_step.new_step(self.kernels, mode, model, self.cache, self.state, settings, self.width)
        self.step.logprobs_of = sampling.logprobs_kind(return_logprobs) or "processed"
        self.feed = self.step.feed
        # sliding-window layers take another branch once their window is full: one graph per phase
        self.phases = self.feed.phases(settings.max_new_tokens)
        self.graphs: dict = {}  # phase -> captured (or uncaptured) step
        self.loops: list = []   # device-loop: one WHILE-node graph per phase, around that phase's step graph
        self.rng_increment = None
        self.captures = 0
        self.uncaptured = 0        # graphs this mode captures on a CUDA device, built here as uncaptured stand-ins
        self.graph_pool_bytes = 0  # device memory reserved by the capture (the graph's private pool)

    # -- one call ---------------------------------------------------------------------------------
    def run(self, input_ids, attention_mask=None, target_lengths=None, seed=None, eos_poll_interval=None,
            steps_per_launch=None, on_chunk=None):
        t_start = time.perf_counter()
        settings, state, device = self.settings, self.state, self.device
        poll = check_poll(eos_poll_interval, self.mode)
        if (steps_per_launch is not None or on_chunk is not None) and not self.spec.device_loop:
            raise ValueError("steps_per_launch and on_chunk belong to mode='device-loop'; the other modes return to "
                             "the host every step")
        if steps_per_launch is not None and (isinstance(steps_per_launch, bool) or not isinstance(steps_per_launch, int)
                                             or steps_per_launch < 1):
            raise ValueError(f"steps_per_launch={steps_per_launch!r} must be an int >= 1, or None for one launch")
        if tuple(input_ids.shape) != (self.batch, self.width):
            raise ValueError(f"this engine was built for prompts of shape {(self.batch, self.width)}; got "
                             f"{tuple(input_ids.shape)}")
        mask, targets = _validate(self.model, input_ids, attention_mask, settings, target_lengths)
        if (targets is None) != (state.targets is None):
            raise ValueError("target_lengths must be given to every call of an engine built with them, and only then")
        waits = Counter()
        explicit_waits = 1  # the read-back of the inputs for validation
        compat.remember_cache_length(self.model, self.cache_len)
        self._reset(input_ids, mask, targets)
        if seed is not None:
            torch.manual_seed(seed)
        generator = default_generator(device)
        timings = {"warmup_s": 0.0, "capture_s": 0.0}
        n = settings.max_new_tokens
        captures_before = self.captures
        launches_before = self._launches()

        with torch.inference_mode(), ranges.span(ranges.DECODE, self.batch):
            t0 = time.perf_counter()
            with ranges.span(ranges.PREFILL), hidden_waits(device, waits):
                self.step.prefill(input_ids, mask)
            _sync(device)
            explicit_waits += device.type == "cuda"
            timings["prefill_s"] = time.perf_counter() - t0
            trail = {0: generator.get_state()} if settings.do_sample else None
            with self.feed.decoding():
                experts = feed.experts_implementation(self.model)
                if self.spec.captures and n > 1 and not self.graphs:
                    explicit_waits += self._capture(generator, timings, waits)
                t0 = time.perf_counter()
                if self.spec.device_loop:
                    steps, polls, loop_waits = self._device_loop(steps_per_launch, on_chunk, generator)
                else:
                    steps, polls, loop_waits = self._loop(poll, trail, generator, waits)
            explicit_waits += loop_waits
            # copies even on a CPU, where .cpu() would alias the buffers the next call of this engine overwrites
            lengths, tokens = state.lengths.to("cpu", copy=True), state.out.to("cpu", copy=True)
            done_at = int(state.done_at)
            logprobs = state.logprobs.to("cpu", copy=True) if state.logprobs is not None else None
            explicit_waits += 1
            timings["decode_s"] = time.perf_counter() - t0
        used = done_at + 1 if done_at >= 0 else n
        wasted = max(0, steps - (used - 1))
        if trail is not None and wasted:
            generator.set_state(trail[used - 1])
        scores = tuple(state.scores[i].clone() for i in range(used)) if state.scores is not None else None
        timings["total_s"] = time.perf_counter() - t_start
        launches = steps if self.graphs else 0
        if self.spec.device_loop:
            launches = self._launches() - launches_before
        # a stand-in step run as Python is no replay: only CUDA graphs are counted as such
        captured = self.captures_enabled and bool(self.graphs)
        return DecodeOutput(tokens=tokens[:, :used], lengths=lengths, steps=steps,
                            replays=launches if captured else 0, captured=captured, launches=launches,
                            host_syncs=explicit_waits + waits.count, polls=polls, wasted_steps=wasted, mode=self.mode,
                            batch=self.batch, max_new_tokens=n, device=str(device), timings=timings, scores=scores,
                            captures=self.captures - captures_before, memory=self.memory(), experts=experts,
                            logprobs=logprobs[:used].T.contiguous() if logprobs is not None else None)

    def memory(self) -> dict:
        """Bytes this engine holds on its device: static KV cache, graph pool, step buffers."""
        kv = sum(t.nbytes for layer in compat.cache_layers(self.cache) for t in
                 (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))
        buffers = sum(t.nbytes for t in vars(self.state).values() if isinstance(t, torch.Tensor))
        return {"kv_cache_bytes": kv, "graph_pool_bytes": self.graph_pool_bytes, "buffer_bytes": buffers}

    def _reset(self, input_ids, mask, targets) -> None:
        s = self.state
        with torch.inference_mode():
            compat.rewind(self.cache, 0)
            s.mask.zero_()
            s.mask[:, :self.width] = mask
            s.index.zero_()
            s.out.fill_(self.step.pad)
            s.lengths.zero_()
            s.unfinished.fill_(1)
            s.done.zero_()
            s.done_at.fill_(-1)
            if s.seen is not None:
                seed_seen(s.seen, input_ids, mask)
            if s.scores is not None:
                s.scores.zero_()
            if s.logprobs is not None:
                s.logprobs.zero_()
            if targets is not None:
                s.targets.copy_(targets)

    def _launches(self) -> int:
        return sum(loop.launches for loop in self.loops)

    def _capture(self, generator, timings, waits) -> int:
        """Warm up and capture this mode's graph, one per phase of the sliding layers; leave state, cache
        and generator as after the prefill. Returns the host waits it made."""
        feed.check_prefilled(self.cache, self.mode, self.model)
        fn = self.step.forward if self.spec.graph == "forward" else self.step
        captured = capture_phases(fn, self.step, (p for p, _, _ in self.phases), capture=self.captures_enabled,
                                  width=self.width, warmup_steps=min(WARMUP_STEPS, self.cache_len - self.width),
                                  model=self.model, watch=kernel_step.watched(self.model, self.kernels),
                                  # the WHILE node embeds the captured cudaGraph_t
                                  keep_graph=self.spec.device_loop, generator=generator, waits=waits)
        self.graphs = captured.graphs
        self.captures += captured.captures
        self.uncaptured += len(captured.graphs) - captured.captures
        self.graph_pool_bytes += captured.pool_bytes
        if self.rng_increment is None:
            self.rng_increment = captured.rng_increment
        timings["warmup_s"] += captured.warmup_s
        timings["capture_s"] += captured.capture_s
        syncs = captured.syncs
        if self.spec.device_loop:
            from .devloop import DeviceLoop
            draws = self.settings.do_sample and self.captures_enabled
            for phase, _, last in self.phases:
                graph = self.graphs[phase]
                body = graph.graph if self.captures_enabled else graph
                # a phase's loop stops at its last step (index last + 1); the next phase's loop takes over on the device
                self.loops.append(DeviceLoop(body, self.state.done, self.state.index, last + 1,
                                             advance_rng=draws, rng_increment=self.rng_increment if draws else None,
                                             generator=generator if draws else None))
        return syncs

    def _device_loop(self, steps_per_launch, on_chunk, generator):
        """Launch each phase's WHILE loop until every row finished (one launch a phase unless chunked).
        Returns (steps, polls, waits)."""
        state = self.state
        if not self.loops:  # max_new_tokens == 1: the prefill made the only token
            return 0, 0, 0
        polls = syncs = 0
        from .devloop import _generator_state, _set_generator_offset
        draws = self.loops[0].captured and self.loops[0].advance_rng
        start = _generator_state(generator)[1] if draws else None
        finished = False
        for loop, (_, first, last) in zip(self.loops, self.phases):
            if draws:
                # the draws of step j start where j - 1 replays would have left the generator
                _set_generator_offset(generator, start + (first - 1) * self.rng_increment)
            loop.start_rollout()
            while True:
                with ranges.span(ranges.REPLAY):
                    loop.launch(max_steps=steps_per_launch)
                if steps_per_launch is None:
                    break
                with ranges.span(ranges.EOS_POLL):
                    # one read of flag, index and tokens between launches: the streaming point
                    finished, produced = bool(state.done), int(state.index)
                    polls += 1
                    syncs += 1
                    ranges.count_syncs()
                if on_chunk is not None:
                    on_chunk(state.out[:, :produced].cpu())
                if finished or produced > last:
                    break
            if draws:
                loop.finish_rollout(steps=0)
            if finished:
                break
        steps = int(state.index) - 1  # the prefill made token 0; part of the final read-back's wait
        if draws:
            _set_generator_offset(generator, start + steps * self.rng_increment)
        return steps, polls, syncs

    def _loop(self, poll, trail, generator, waits):
        """Run decode steps 1..N-1 until a poll finds every row finished. Returns (steps, polls, waits)."""
        state, step, n, graph, device = self.state, self.step, self.settings.max_new_tokens, self.spec.graph, self.device
        # where the whole step is captured the host polls the flag; eager and forward-graph check it
        check = ranges.EOS_POLL if graph == "step" else ranges.EOS_CHECK
        polls = syncs = 0
        flag = _FlagReader(state.done, device) if poll == "async" else None
        if flag is not None:
            flag.copy()  # the prefill token's flag, read after step 1 is launched
        if poll != "async" and poll >= 1:
            with ranges.span(check):
                polls, syncs = 1, 1
                ranges.count_syncs()
                if bool(state.done):
                    return 0, polls, syncs
        steps = 0
        for j in range(1, n):
            with ranges.span(ranges.STEP, j):
                if graph is None:
                    with ranges.span(ranges.FORWARD), hidden_waits(device, waits):
                        logits = step.forward()
                    with ranges.span(ranges.SELECT):
                        next_tokens = step.select(logits)
                    with ranges.span(ranges.UPDATE):
                        step.update(next_tokens)
                elif graph == "forward":
                    forward = self.graphs[self.feed.phase_of(j)]
                    with ranges.span(ranges.REPLAY):
                        forward.replay()
                    with ranges.span(ranges.SELECT):
                        step.update(step.select(forward.output))
                else:
                    with ranges.span(ranges.REPLAY):
                        self.graphs[self.feed.phase_of(j)].replay()
                steps = j
                if trail is not None:
                    trail[j] = generator.get_state()
                if poll == "async":
                    with ranges.span(check):
                        flag.copy()
                        finished = flag.read_previous()
                    polls += 1
                    syncs += 1
                    ranges.count_syncs()
                    if finished:
                        break
                elif poll >= 1 and j % poll == 0:
                    with ranges.span(check):
                        polls += 1
                        syncs += 1
                        ranges.count_syncs()
                        if bool(state.done):
                            break
                if trail is not None and (poll == "async" or (poll >= 1 and j % poll == 0)):
                    for old in [k for k in trail if k < j - 1]:
                        del trail[old]
        return steps, polls, syncs

    def close(self) -> None:
        for loop in self.loops:
            loop.close()
        self.loops = []
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
        self.cache = None
        self.step = None
        self.state = None


class _FlagReader:
    """The deferred EOS check: after step t is launched, read the flag that step t-1 copied to pinned memory."""

    def __init__(self, done: torch.Tensor, device: torch.device):
        self.done = done
        pinned = device.type == "cuda"
        self.slots = [torch.zeros((), dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
        # blocking: the host sleeps in the wait instead of spinning, so the wait is not counted as host work
        self.events = [torch.cuda.Event(blocking=True) if pinned else None for _ in range(2)]
        self.copies = 0

    def copy(self) -> None:
        """Queue a copy of the flag as it stands after the work launched so far."""
        slot = self.copies % 2
        self.slots[slot].copy_(self.done, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.copies += 1

    def read_previous(self) -> bool:
        """Wait for the copy before the last one and read it: the step before the one just launched."""
        slot = self.copies % 2  # the older of the two slots
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return bool(self.slots[slot])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
