"""How a model's decode step is fed: the inputs generate() gives it, built on the device.

generate() never calls a model's forward with a bare 2-D mask. Before every forward it calls
`model.prepare_inputs_for_generation` (or the family's override: Mamba drops the mask after the
prefill, MiniMax-style models theirs), which slices the new token, passes the cache under the
model's keyword, the positions, `use_cache` and `logits_to_keep`, and for a static cache turns the
2-D mask into the per-layer-type masks of `create_masks_for_generate` (or the model's override).
gdtool calls the same functions with its own fixed-size buffers, so every family is fed as
generate() feeds it, with no per-family code here:

    prefill  prepare_inputs_for_generation(prompt, prompt mask, prefill positions, first iteration)
    decode   prepare_inputs_for_generation(token, mask over the cache, position, later iteration)

Three things generate() does with Python values that a captured step cannot, and what gdtool does:

- Sliding-window layers (`StaticSlidingWindowLayer`) keep a Python counter. Their mask is built
  from it (query offset, key offset) and their cache update takes another branch once the window
  is full. gdtool builds their mask from device tensors in a shifted frame that gives the same
  booleans (`Windows`), and runs one graph per phase (window not yet full / full), switched at the
  step the host computes in advance (`phase_of`).
- Mixture-of-experts blocks: generate() decodes under `_optimize_model_for_decode()`, which on a
  GPU switches `grouped_mm` experts to `batched_mm` (no host read, capturable). gdtool decodes
  under the same context manager (`decoding()`).
- Layers whose state a warm-up step changes for good (a sliding window that rolls, the conv and
  recurrent states of linear-attention layers) are saved before warm-up and capture and put back
  (`snapshot` / `restore`).
- Some models keep their recurrent state in plain module attributes and bind a new tensor to them at
  every forward (RecurrentGemma's conv and recurrent states): a graph would read the tensor bound at
  capture forever. gdtool gives each such attribute one tensor that every step reads and writes back
  into (`ModuleState`), and saves it around warm-up like a cache layer.

`check()` refuses, with the reason and what to use instead, the models gdtool cannot decode as
generate() does; it reads the built model (its modules, cache layers and forward), not config counts.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

from . import compat

CAPTURE_ATTENTION = ("sdpa", "eager")


class Unsupported(ValueError):
    """A model or setting gdtool refuses, with the reason and what to do instead."""


# -- what gdtool can decode ------------------------------------------------------------------------

def check(model, mode: str, device: torch.device | None = None) -> None:
    """Refuse, with the reason, what gdtool cannot decode exactly as generate() does in `mode`."""
    name = type(model).__name__
    if model.training:
        dropout = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        attn_dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
        if mode != "eager" or dropout or (isinstance(attn_dropout, float) and attn_dropout > 0):
            raise Unsupported("the model is in training mode (models built from a config start that way) and dropout "
                              "would change every token; call model.eval() first")
    from transformers import GenerationMixin
    if not isinstance(model, GenerationMixin):
        raise Unsupported(f"{name} does not decode with transformers' generate() (it is not a GenerationMixin: its "
                          "own generate(), if any, is not token-by-token decoding, e.g. block diffusion); gdtool "
                          "reproduces generate()'s decoding only: use the model's own method")
    if getattr(model.config, "is_encoder_decoder", False):
        raise Unsupported(f"{name} is an encoder-decoder model; gdtool decodes decoder-only causal LMs (use its "
                          "*ForCausalLM class, or generate())")
    supports_cache = getattr(model, "_supports_default_dynamic_cache", None)
    if supports_cache is not None and not supports_cache():
        raise Unsupported(f"{name} keeps a cache of its own, and generate() decodes it with that cache instead of a "
                          "static one; gdtool decodes over transformers' StaticCache only: use generate()")
    params = inspect.signature(model.forward).parameters
    taken = [k for k in ("cache", "past_key_values", "cache_params") if k in params]
    handed = compat.generate_cache_names()
    if not any(k in handed for k in taken):
        # 5.17's XLM names its cache `cache`, which that release's generate() does not hand a cache by
        named = (f" under a name generate() hands one by ({', '.join(handed[:2])}; it takes {taken[0]!r})"
                 if taken else "")
        raise Unsupported(f"{name}'s forward takes no cache{named}, so generate() recomputes the whole sequence at "
                          "every step; gdtool decodes over a static KV cache only: use generate()")
    if getattr(model.generation_config, "use_cache", True) is False:
        raise Unsupported(f"{name}'s generation config has use_cache=False, so generate() decodes it without a cache "
                          "(the whole sequence every step); set model.generation_config.use_cache = True (and "
                          "model.config.use_cache = True) to decode it with a static cache, as gdtool does")
    if mode == "eager":
        return
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in CAPTURE_ATTENTION:
        raise Unsupported(f"attention implementation {impl!r} is not supported by the graph modes; load the model with "
                          "attn_implementation='sdpa' (or 'eager'), or use mode='eager'")
    if device is not None and device.type == "cuda":
        routed = _host_routed_experts(model)
        if routed:
            raise Unsupported(f"{name}'s {routed[0]} finds which tokens each expert gets on the host (`{routed[1]}`; "
                              "it is not one of transformers' experts implementations, which generate() switches to "
                              "batched_mm), and no CUDA graph can capture a host read; use mode='eager'")
        eager_experts = [type(m).__name__ for m in experts_modules(model) if _experts_impl(m) == "eager"]
        if eager_experts:
            raise Unsupported(f"{name}'s experts ({eager_experts[0]}) run experts_implementation='eager', which loops "
                              "over the experts hit on the host and cannot be captured; call "
                              "model.set_experts_implementation('grouped_mm') (generate() then decodes with "
                              "batched_mm, as gdtool does) or use mode='eager'")


def check_cache(cache, mode: str, model) -> None:
    """Refuse the cache layers the graph modes cannot capture."""
    if mode == "eager":
        return
    kinds = {type(layer).__name__ for layer in compat.cache_layers(cache)}
    chunked = getattr(model.config.get_text_config(), "attention_chunk_size", None)
    types = set(getattr(model.config.get_text_config(), "layer_types", None) or ())
    if chunked and "chunked_attention" in types:
        raise Unsupported(f"{type(model).__name__} has chunked-attention layers, whose mask depends on the absolute "
                          "position in a way the graph modes' shifted frame does not keep; use mode='eager'")
    known = ("StaticLayer", "StaticSlidingWindowLayer", "StaticIndexedLayer", "DummyLayer", "LinearAttentionLayer", "LinearAttentionAndStaticFullAttentionLayer",
             "LinearAttentionAndStaticSlidingWindowAttentionLayer")
    unknown = sorted(kinds - set(known))
    if unknown:
        raise Unsupported(f"the graph modes do not know the cache layer {unknown[0]} (what it keeps on the host "
                          "between steps is not modelled); use mode='eager'")


def check_prefilled(cache, mode: str, model) -> None:
    """After the prefill, before any graph: refuse the caches that grow a position history. Qwen4-Exp's
    indexer concatenates every forward's 3-D positions onto a tensor bound on the cache (5.17:
    `cache.position_ids`; later: the first indexed layer's `indexer_position_ids`), so each step reads a
    longer tensor than the last, a shape no graph can hold (and its token selection loops on the host)."""
    if mode == "eager":
        return
    held = [("cache", "position_ids", getattr(cache, "position_ids", None))]
    held += [(f"cache layer {i}", "indexer_position_ids", getattr(layer, "indexer_position_ids", None))
             for i, layer in enumerate(compat.cache_layers(cache))]
    for where, name, value in held:
        if isinstance(value, torch.Tensor):
            raise Unsupported(f"{type(model).__name__} keeps the positions of every token so far in `{name}` on its "
                              f"{where}, a tensor that grows by one at every step, so no graph can hold it; use "
                              "mode='eager'")


def _host_routed_experts(model) -> tuple[str, str] | None:
    """(class, host op) of an experts or gating block of the model's own that finds on the host which tokens go
    to which expert: LongCat-Flash's experts loop over `nonzero` (its zero experts keep it off transformers'
    experts implementations), JetMoE's gating splits the tokens by `expert_size.tolist()`. generate() runs
    those host reads on a GPU too, and no capturable form gives the same bits (each expert's GEMM sees only
    its own tokens)."""
    experts = set(map(id, experts_modules(model)))
    classes = {type(m) for m in model.modules() if id(m) not in experts
               and any(word in type(m).__name__ for word in ("Experts", "Gating"))}
    for cls in sorted(classes, key=lambda c: c.__name__):
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        for op in (".nonzero(", ".tolist()"):
            if op in source:
                return cls.__name__, op.strip(".")
    return None


def grouped_mm_capturable(param) -> bool:
    """Whether transformers' grouped_mm experts run on `param`'s dtype and device without reading their offsets on the
    host (torch's grouped matmul: bf16 on a GPU of compute capability 9.0 or newer), so that a CUDA graph can hold
    them."""
    return (param.dtype == torch.bfloat16 and param.device.type == "cuda"
            and torch.cuda.get_device_capability(param.device) >= (9, 0))


def experts_modules(model) -> list:
    """The experts blocks that dispatch through transformers' experts implementations."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]


def _experts_impl(module) -> str | None:
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def experts_implementation(model) -> str | None:
    """The experts implementation a decode step of `model` runs (None without experts blocks)."""
    found = {_experts_impl(m) for m in experts_modules(model)}
    return ",".join(sorted(str(x) for x in found)) if found else None


# -- the feed ---------------------------------------------------------------------------------------

class Windows:
    """The masks of sliding-window layers from device tensors, in a frame shifted by a constant.

    HF builds a sliding layer's mask from `q_offset = cumulative_length_int` and
    `kv_offset = max(q_offset - window + 1, 0)`, both Python ints, and reads the 2-D mask at
    absolute key positions `kv_offset + k`. Causality and the window compare differences of
    positions, so shifting query and keys by the same amount gives the same booleans. gdtool hands
    the mask code a 2-D mask of width C + W (the cache's mask, then the W columns the window
    covers, gathered on the device) and, for sliding layers only, `kv_offset = C` (a constant) and a
    query offset tensor `C + q - kv_offset`, so one captured graph builds the right mask at every step.
    """

    def __init__(self, cache, width: int, cache_len: int):
        self.layers = [i for i, layer in enumerate(compat.cache_layers(cache)) if compat.is_sliding(layer)]
        self.width, self.cache_len = width, cache_len
        sizes = sorted({compat.cache_layers(cache)[i].max_cache_len for i in self.layers})
        self.groups = []  # (window, base column in the framed mask, layer indices)
        base = cache_len
        for size in sizes:
            members = [i for i in self.layers if compat.cache_layers(cache)[i].max_cache_len == size]
            self.groups.append((size, base, members))
            base += size
        self.group_of = {i: g for g, (_, _, members) in enumerate(self.groups) for i in members}
        self.query = None  # per group: [] long tensor, the shifted query offset of the current step
        self.position = None  # [] long tensor: tokens cached before the current step

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _columns(self, mask: torch.Tensor, index: torch.Tensor):
        """The slot of the token this forward feeds (= tokens already cached), and per window size its
        first key's position and the [B, W] mask over the W keys its window holds, from device tensors."""
        position = index + (self.width - 1)
        out = []
        for size, _, _ in self.groups:
            offset = (position - size + 1).clamp(min=0)
            columns = torch.arange(size, device=mask.device) + offset
            out.append((offset, mask.gather(1, columns.expand(mask.shape[0], size))))
        return position, out

    def framed_mask(self, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[B, C + sum(W)] mask, and the shifted query offsets for this step, from device tensors."""
        position, columns = self._columns(mask, index)
        query = [position - offset + base for (offset, _), (_, base, _) in zip(columns, self.groups)]
        self.query, self.position = query, position
        return torch.cat([mask] + [window for _, window in columns], dim=1)

    def layer_masks(self, mask: torch.Tensor, index: torch.Tensor) -> dict:
        """{sliding layer index: [B, W] mask over its cache's W slots} for one decoded token: slot k of a
        window holds the key at position offset + k (before it is full, offset 0; once full, the roll
        keeps the last W keys in order), so these are the 2-D mask's columns at those positions."""
        _, columns = self._columns(mask, index)
        return {i: columns[g][1] for i, g in self.group_of.items()}

    @contextlib.contextmanager
    def patched(self, cache):
        """The cache answers the mask code in the shifted frame for sliding layers (decode only)."""
        mask_sizes, query_offset = cache.get_mask_sizes, cache.get_query_offset

        def get_mask_sizes(query_length, layer_idx=0, *args, **kwargs):
            group = self.group_of.get(layer_idx)
            if group is None or query_length != 1:
                return mask_sizes(query_length, layer_idx, *args, **kwargs)
            size, base, _ = self.groups[group]
            return size, base

        def get_query_offset(layer_idx=0, *args, **kwargs):
            group = self.group_of.get(layer_idx)
            if group is None or self.query is None:
                return query_offset(layer_idx, *args, **kwargs)
            return self.query[group]

        seq_length = cache.get_seq_length

        def get_seq_length(*args, **kwargs):
            # 5.17's sliding layer answers with its Python counter, which a graph would keep at its capture value
            # (EXAONE 4.5 derives its positions from it); the same count, from the device
            length = seq_length(*args, **kwargs)
            return self.position if isinstance(length, int) and length and self.position is not None else length

        cache.get_mask_sizes, cache.get_query_offset = get_mask_sizes, get_query_offset
        cache.get_seq_length = get_seq_length
        updates = {}
        for i in self.layers:
            layer = compat.cache_layers(cache)[i]
            updates[i] = layer.update
            layer.update = _full_window_update(layer, layer.update)
            # the layers answer too: a model may put its own cache.get_mask_sizes in place at every forward
            # (5.17's RecurrentGemma binds one that asks its first attention layer), over the one above
            layer.get_mask_sizes = _framed_sizes(layer.get_mask_sizes, *self.groups[self.group_of[i]][:2])
        try:
            yield
        finally:
            del cache.get_mask_sizes, cache.get_query_offset, cache.get_seq_length
            self.position = None
            for i, update in updates.items():
                layer = compat.cache_layers(cache)[i]
                for name in ("update", "get_mask_sizes"):
                    if layer.__dict__.get(name) is not None:
                        delattr(layer, name)


def _framed_sizes(mask_sizes, size: int, base: int):
    """A sliding layer's mask sizes in the shifted frame for one new token, its own otherwise."""
    def get_mask_sizes(query_length, *args, **kwargs):
        return (size, base) if query_length == 1 else mask_sizes(query_length, *args, **kwargs)
    return get_mask_sizes


def _full_window_update(layer, update):
    """HF's update of a full window for one new token, without its `torch.tensor([-1], device=...)`
    (a host-to-device copy a graph cannot capture): roll left by one, write the last slot. Same data."""

    def full_update(key_states, value_states, *args, **kwargs):
        if layer.cumulative_length_int >= layer.max_cache_len and key_states.shape[-2] == 1 \
                and layer.is_initialized:
            layer.cumulative_length_int += 1
            new_keys = layer.keys.roll(-1, dims=-2)
            new_values = layer.values.roll(-1, dims=-2)
            new_keys[:, :, -1:] = key_states
            new_values[:, :, -1:] = value_states
            layer.keys.copy_(new_keys)
            layer.values.copy_(new_values)
            return layer.keys, layer.values
        return update(key_states, value_states, *args, **kwargs)

    return full_update


class ModuleState:
    """State a model keeps in plain module attributes, not in the cache, and rebinds at every forward.

    RecurrentGemma's recurrent blocks do `self.conv1d_state = conv_state[:, :, 1:]`: the next forward
    reads whatever tensor the attribute holds. Run eagerly that is fine; captured, the graph would read
    the tensor bound at capture at every replay. The attributes the prefill binds (found by comparing
    the modules' tensors before and after it) get a slot: a tensor of their own that every later
    forward copies its new value into, the attribute bound back to it (`settle`, part of the step, so
    the copy is captured). The values are the model's own: bit for bit what generate() computes.
    """

    def __init__(self, model):
        self.model = model
        self.slots: dict = {}  # (module, attribute name) -> the tensor every decode step reads and writes
        self.before: dict | None = None

    def _tensors(self) -> dict:
        return {(module, name): value for module in self.model.modules()
                for name, value in vars(module).items() if isinstance(value, torch.Tensor)}

    def watch(self) -> None:
        """Before the prefill: remember which tensors the modules hold."""
        self.before = self._tensors()

    def settle(self) -> None:
        """After a forward: copy what it bound into the slots and bind the slots back."""
        if self.before is not None:  # the prefill: what it bound becomes a slot, or refills one
            before, self.before = self.before, None
            for key, value in self._tensors().items():
                if key in self.slots or before.get(key) is not value:
                    self._keep(key, value, prefill=True)
            return
        for key in self.slots:
            self._keep(key, getattr(key[0], key[1]), prefill=False)

    def _keep(self, key, value: torch.Tensor, prefill: bool) -> None:
        module, name = key
        slot = self.slots.get(key)
        if slot is value:
            return
        if slot is None or slot.shape != value.shape or slot.dtype != value.dtype or slot.device != value.device:
            if not prefill:
                raise Unsupported(f"{type(module).__name__}.{name} (state kept on the module) changed from "
                                  f"{tuple(slot.shape)} to {tuple(value.shape)} between decode steps, so no graph "
                                  "can hold it; use mode='eager'")
            slot = self.slots[key] = value.clone(memory_format=torch.contiguous_format)
        else:
            slot.copy_(value)
        setattr(module, name, slot)

    def snapshot(self) -> list:
        return [(module, {name: slot.clone()}) for (module, name), slot in self.slots.items()]


class Feed:
    """The model inputs of the prefill and of one decode step, as generate() builds them."""

    def __init__(self, model, cache, width: int, cache_len: int):
        self.model, self.cache, self.width, self.cache_len = model, cache, width, cache_len
        self.cache_kw, self.logits_to_keep = compat.forward_kwargs(model)
        supports = getattr(model, "_supports_logits_to_keep", None)
        if supports is not None:
            self.logits_to_keep = bool(supports())
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.windows = Windows(cache, width, cache_len)
        self.module_state = ModuleState(model)
        layers = compat.cache_layers(cache)
        self.all_linear = bool(layers) and all(compat.is_linear(layer) and not hasattr(layer, "keys") for layer in layers)

    def _common(self, attention_mask, position_ids) -> dict:
        kwargs = {self.cache_kw: self.cache, "attention_mask": attention_mask, "use_cache": True}
        if self.takes_positions:
            kwargs["position_ids"] = position_ids
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
        kwargs = self._common(attention_mask, positions)
        compat.start_fresh(self.model)
        self.module_state.watch()
        length = None if self.all_linear else input_ids.shape[1]
        return self.model.prepare_inputs_for_generation(input_ids, next_sequence_length=length,
                                                        is_first_iteration=True, **kwargs)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> dict:
        if self.windows:
            mask = self.windows.framed_mask(mask, index)
        kwargs = self._common(mask, positions)
        return self.model.prepare_inputs_for_generation(tokens, next_sequence_length=1, is_first_iteration=False,
                                                        **kwargs)

    def settle(self) -> None:
        """After each forward (inside the step, so a graph holds it): module-held state back in its slots."""
        self.module_state.settle()

    @contextlib.contextmanager
    def decoding(self):
        """What holds for every decode forward: generate()'s decode-time experts implementation, the
        sliding layers' shifted frame, and masks built without host-to-device copies."""
        optimize = getattr(self.model, "_optimize_model_for_decode", None)
        moe = optimize is not None and bool(experts_modules(self.model))
        before = self.model.get_experts_implementation() if moe else None
        experts = optimize() if moe else contextlib.nullcontext()
        frame = self.windows.patched(self.cache) if self.windows else contextlib.nullcontext()
        with experts, frame, compat.capturable_masks(), compat.capturable_positions(self.model, self.cache_len):
            self._before_decoding = before
            try:
                yield
            finally:
                self._before_decoding = None

    @contextlib.contextmanager
    def prefilling(self):
        """A prefill inside `decoding()` (a rollout's refill): the experts as generate()'s prefill runs them, in the
        model's own implementation where the decode switched grouped_mm to batched_mm. batched_mm copies every routed
        expert's weights for each token (`gate_up_proj[ids]`): 48 GiB for a refill of 8 prompts of 128 tokens of
        Qwen3-30B-A3B, where its decode step's one token a row copies 0.4 GiB. Only where grouped_mm runs without a
        host read, so that a graph can hold it: bf16 on a GPU of compute capability 9.0 or newer (transformers'
        fallback for the other dtypes reads its offsets on the host); elsewhere the prefill keeps batched_mm."""
        before = getattr(self, "_before_decoding", None)
        if before is None:   # no experts, or not inside decoding(): nothing was switched
            yield
            return
        now = self.model.get_experts_implementation()
        param = next(self.model.parameters())
        switch = now != before and grouped_mm_capturable(param)
        if switch:
            self.model.set_experts_implementation(before)
        try:
            yield
        except torch.OutOfMemoryError as error:
            if now == before or switch:
                raise
            raise torch.OutOfMemoryError(
                f"a refill's prefill ran out of GPU memory in the batched_mm experts, which copy every routed "
                f"expert's weights for each of its tokens (generate()'s decode-time implementation; grouped_mm, "
                f"generate()'s prefill's, reads the host for {param.dtype} on {param.device} and no graph can hold "
                "it). Lower refill_rows (fewer prompts a prefill), or run the model in bfloat16 on a GPU of compute "
                f"capability 9.0 or newer, where refills prefill with grouped_mm. ({str(error).splitlines()[0]})"
            ) from error
        finally:
            if switch:
                self.model.set_experts_implementation(now)

    # -- phases of the sliding layers --
    def phase_of(self, step: int) -> int:
        """Decode step j (1-based; it feeds the token at slot width + j - 1): how many window sizes are full."""
        position = self.width + step - 1
        return sum(position >= size for size, _, _ in self.windows.groups)

    def phases(self, max_new_tokens: int) -> list[tuple[int, int, int]]:
        """(phase, first step, last step) for decode steps 1..max_new_tokens - 1."""
        out = []
        for step in range(1, max_new_tokens):
            phase = self.phase_of(step)
            if out and out[-1][0] == phase:
                out[-1] = (phase, out[-1][1], step)
            else:
                out.append((phase, step, step))
        return out

    def enter_phase(self, phase: int, saved: list) -> None:
        """Put the sliding layers as they stand at the start of a step of `phase`, for a warm-up step or the
        capture: the window the prefill left (`saved`, from `snapshot()`), and the Python counters pinned on the
        phase's side of "full" (`pin_phase`). Each warm-up step advances the counters by one, so without this a
        phase that starts one or two tokens short of a full window would be warmed up, and captured, in
        the full phase (its roll branch instead of the slot write)."""
        self.restore(saved)
        self.pin_phase(phase)

    def counted_phase(self) -> int:
        """The phase the sliding layers' Python counters are in: how many window sizes are full."""
        layers = compat.cache_layers(self.cache)
        return sum(layers[members[0]].cumulative_length_int >= size for size, _, members in self.windows.groups)

    def pin_phase(self, phase: int) -> None:
        """Each sliding layer's Python counter at one value per side of "full": its window size once full (the
        first `phase` window sizes), one less before. The counter only picks the update's branch (the slot comes
        from the cache's tensor counter, the mask and the sequence length from the shifted frame of `Windows`),
        so a step of one phase computes the same at any count of that phase; pinned, a graph captures, and
        dynamo specializes on, one value per phase rather than one per step."""
        layers = compat.cache_layers(self.cache)
        for g, (size, _, members) in enumerate(self.windows.groups):
            for i in members:
                layers[i].cumulative_length_int = size if g < phase else size - 1

    @contextlib.contextmanager
    def pinned(self):
        """Around one uncaptured step that dynamo specializes on the counters (the compiled step): the counters
        pinned for its phase (yielded) during the step, and afterwards where the step would have left the true
        counts (true count + what the step advanced), so the next step reads its own phase off them."""
        layers = compat.cache_layers(self.cache)
        before = {i: layers[i].cumulative_length_int for i in self.windows.layers}
        phase = self.counted_phase()
        self.pin_phase(phase)
        pinned = {i: layers[i].cumulative_length_int for i in before}
        try:
            yield phase
        finally:
            for i, count in before.items():
                layers[i].cumulative_length_int = count + layers[i].cumulative_length_int - pinned[i]

    def frozen_counters(self):
        """A function that puts the sliding layers' Python counters back where they stand now: what a
        graph captured now replays with, whatever the counters say later."""
        layers = compat.cache_layers(self.cache)
        counts = {i: layers[i].cumulative_length_int for i in self.windows.layers}
        if not counts:
            return None

        def freeze():
            for i, count in counts.items():
                layers[i].cumulative_length_int = count
        return freeze

    # -- state a warm-up step changes for good --
    def snapshot(self) -> list:
        saved = []
        for layer in compat.cache_layers(self.cache):
            if compat.is_sliding(layer) or compat.is_linear(layer):
                saved.append((layer, _layer_state(layer)))
        return saved + self.module_state.snapshot()

    @staticmethod
    def restore(saved: list) -> None:
        for layer, state in saved:
            for key, value in state.items():
                if isinstance(value, dict):
                    for k, v in value.items():
                        if isinstance(v, torch.Tensor):
                            getattr(layer, key)[k].copy_(v)
                        else:
                            getattr(layer, key)[k] = v
                elif isinstance(value, torch.Tensor):
                    getattr(layer, key).copy_(value)
                else:
                    setattr(layer, key, value)


def _layer_state(layer) -> dict:
    """What `compat.rewind` cannot put back: a sliding window's contents and counters, linear states."""
    state = {}
    if compat.is_sliding(layer):
        for key in ("keys", "values", "cumulative_length"):
            value = getattr(layer, key, None)
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()
        state["cumulative_length_int"] = layer.cumulative_length_int
    for key in ("conv_states", "recurrent_states", "has_previous_state"):
        value = getattr(layer, key, None)
        if isinstance(value, dict):
            state[key] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
    return state
