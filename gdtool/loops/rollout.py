"""`gdtool.rollout`: many ragged prompts through a fixed number of slots.

A static batch waits for its longest row: with realistic response lengths most row-steps of a large
batch decode pads for rows that finished long ago. A rollout takes a list of prompts (many more than
the slots) and keeps `slots` rows decoding:

    out = gdtool.rollout(model, prompts, slots=64, max_new_tokens=512, refill="device", mode="device-loop",
                         eos_token_id=eos)
    out.sequences[i].tokens, .logprobs, .finish_reason     # in input order: prompt-major, then sample
    out.useful_tokens, out.row_steps, out.row_step_share, out.tokens_per_s
    out.to_frame()                                         # one row per sequence

refill="off"   today's static batches: `slots` consecutive sequences at a time, left-padded, through a
               `Decoder` (any mode and kernels). Each sequence is bit for bit generate() on its batch. Each
               batch is as wide as its widest prompt, so ragged prompts capture a graph per width;
               `buckets=(W,)` pads every batch to W (the Decoder's buckets): one graph for them all.
refill="host"  each slot holds one sequence at its own positions (`core/rollout_step.py`). After each
               decode step the host reads the flags and, while slots are free and the queue is not
               empty, runs a refill: the next sequences (input order) start in the first free slots,
               their prompts prefilled together (up to `refill_rows`, default 8, in one forward: a
               size of R, R/2, .., 1 graphs), each one's keys and values written into its slot's
               cache row. `refill_after=A` (default: an eighth of the slots, at least 1) waits until
               A slots are free (or all the queue has left), so that one forward fills several.
               A refill prefills the smallest width bucket that holds its prompts: the longest
               prompt and up to `refill_widths - 1` halvings of it (default 1: none), so short prompts do
               not pay for the longest one's pads. Greedy, each sequence is generate() on its prompt alone, up to rounding
               (tokens equal in float64 on a CPU). Sampling draws keyed noise (`core/noise.py`),
               not generate()'s generator stream, so a sequence does not depend on its slot, the
               slot count or its neighbours; `seed` is required to sample.
refill="device" the same step and refills, decided on the device: step-graph launches one graph per
               step whose refills run in a WHILE node; device-loop runs the whole rollout in one
               launch (`steps_per_launch` chunks it). Bit for bit refill="host".
               Both: every kernels option. "compiled" compiles the decode step over the per-row cache
               write and the refill's prefill (`kernels/rows.py`); "fast" adds gdtool's split-KV
               attention, which reads each row's mask. Families: docs/rollout.md.

Figures: `useful_tokens` (the sequences' lengths), `row_steps` (one per slot and decode step, plus one per
refill: what the device ran, counted on the device), `row_step_share`, host
syncs, prefill time (refills included), decode time and `tokens_per_s` (useful tokens per second of the
whole call).
"""
from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass

import torch

from ..core import graphs, ranges, sampling
from ..core.modes import check_mode
from ..core.rollout_step import (REFILL_ROWS, REFILL_WIDTHS, RowStep, check_rows, default_refill_after,
                                  new_row_state, refill_plan, refill_sizes, row_cache)
from ..core.settings import UNSET, resolve
from ..core.syncs import Counter, hidden_waits
from ..kernels.rows import CompiledRowStep
from ..kernels.step import watched
from .decode import check_run, check_samples
from .decoder import Decoder

__all__ = ["REFILLS", "REFILL_ROWS", "REFILL_WIDTHS", "RolloutInterrupted", "RolloutOutput", "Sequence", "rollout"]
REFILLS = ("off", "host", "device")


@dataclass
class Sequence:
    """One finished sequence of a rollout."""
    prompt_index: int
    sample_index: int
    tokens: torch.Tensor              # [length] int64 on the CPU, up to and including EOS
    logprobs: torch.Tensor | None     # [length] float32 log-probability of each token (return_logprobs: under the
                                      # processed scores, or "temperature": under softmax(logits / temperature))
    finish_reason: str                # "eos" or "length"
    slot: int                         # refill="host": the slot it ran in; "off": its row in its batch
    batch: int | None = None          # refill="off": the batch it ran in

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass
class RolloutOutput:
    sequences: list                   # Sequence per prompt and sample, in input order
    refill: str
    slots: int                        # rows decoded at once (refill: at most one per sequence)
    max_new_tokens: int
    mode: str
    useful_tokens: int                # sum of the sequences' lengths
    row_steps: int                    # rows x token steps the device ran (a prefilled row counts one)
    decode_steps: int                 # decode forwards (refill="off": summed over the batches)
    prefills: int                     # prefill forwards (off: one per batch; refill: one per refill)
    prefilled_rows: int               # rows those prefills ran (one per sequence)
    host_syncs: int                   # blocking reads of device values, hidden ones included
    prefill_s: float                  # prompt forwards and first tokens, refills included
    decode_s: float                   # decode steps, EOS checks and read-backs (graph warm-up and capture too)
    total_s: float
    setup_s: float = 0.0              # refill="host"/"device": warm-up and capture before the first prefill
    setup_parts: dict | None = None   # captured refill: setup_s in parts: warmup_s, capture_s, and for "device"
    #                                   loop_s (building the WHILE loop)
    launches: int | None = None       # refill="device" captured: graph launches of the decode loop
    refill_sizes: dict | None = None  # refill: {rows: refills of that many rows}
    refill_widths: dict | None = None  # refill: {columns: refills prefilled that wide}
    refill_after: int | None = None   # refill: the refill_after it ran with (given, or default_refill_after(slots))

    @property
    def row_step_share(self) -> float:
        """The share of row-steps that made a token someone keeps."""
        return self.useful_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Useful tokens per second of the whole call."""
        return self.useful_tokens / self.total_s if self.total_s > 0 else 0.0

    def rows(self) -> list[dict]:
        """One dict per sequence, in input order."""
        return [dict(prompt_index=s.prompt_index, sample_index=s.sample_index, length=s.length,
                     finish_reason=s.finish_reason, slot=s.slot, batch=s.batch, tokens=s.tokens.tolist(),
                     logprob=None if s.logprobs is None else float(s.logprobs.double().sum()))
                for s in self.sequences]

    def to_frame(self):
        """`rows()` as a pandas DataFrame."""
        import pandas as pd
        return pd.DataFrame(self.rows())

    def summary(self) -> dict:
        return dict(refill=self.refill, slots=self.slots, mode=self.mode, sequences=len(self.sequences),
                    useful_tokens=self.useful_tokens, row_steps=self.row_steps, row_step_share=self.row_step_share,
                    decode_steps=self.decode_steps, prefills=self.prefills, prefilled_rows=self.prefilled_rows,
                    refill_sizes=self.refill_sizes, refill_widths=self.refill_widths,
                    host_syncs=self.host_syncs,
                    prefill_s=self.prefill_s, decode_s=self.decode_s, total_s=self.total_s,
                    tokens_per_s=self.tokens_per_s)


def rollout(model, prompts, *, slots: int, max_new_tokens: int | None = None, num_samples: int = 1, refill: str = "off",
            refill_rows: int | None = None, refill_after: int | None = None, refill_widths: int | None = None,
            seed: int | None = None, return_logprobs: bool | str = True, mode: str = "eager", kernels: str = "hf",
            capture: bool | None = None, on_finished=None, on_group=None, eos_poll_interval: int | None = None,
            steps_per_launch: int | None = None, target_lengths=None, buckets=None, do_sample=UNSET,
            temperature=UNSET, top_k=UNSET, top_p=UNSET, repetition_penalty=UNSET, eos_token_id=UNSET,
            pad_token_id=UNSET,
            **unsupported) -> RolloutOutput:
    """Decode every prompt of `prompts` (token id lists, ragged) `num_samples` times through `slots` rows.

    `model` may be a `Decoder`: its model, mode, kernels, capture and settings are used, and what this call
    names (other than at its default) overrides them.

    Settings resolve as generate() resolves them (see `gdtool.decode`). refill="off": `seed` seeds the global
    generators once, before the first batch, and the batches draw from them in turn (generate()'s stream, bit
    for bit). refill="host": sampling needs `seed` (an int, taken mod 2**64): the noise of token t of sample k
    of prompt p is keyed by (seed, p, k, t) (`core.noise`), so a sequence is the same whatever slot it ran in
    and however many slots ran; the global generators are not touched. `refill_rows` (default REFILL_ROWS),
    `refill_after` (default `default_refill_after(slots)`: an eighth of the slots) and `refill_widths` (default
    REFILL_WIDTHS: the most width buckets a refill prefills at) shape the refills (module doc); they change which
    sequences share a prefill and how wide, so the bits of a run in low precision, never the sequences each policy
    gives in every mode. `on_finished(sequence)` is
    called with each `Sequence` as soon as the host has it (refill="host": at the step it finished; "off": after
    its batch). `return_logprobs`: True gives each token's log-probability under the processed scores (what
    generate() samples from), "temperature" under softmax(logits / temperature) alone (what PPO/GRPO ratios
    compare a trainer's recomputed log-probabilities against), False none. Everything is checked before any work:
    a bad input or a setting the refill cannot honour ends in one ValueError that says why and what to use instead.
    `buckets` (refill="off"): the static Decoder's prompt widths (`Decoder`): each batch left-padded to the smallest
    that holds its widest prompt, so batches of ragged prompts share graphs; generate() on the batch as padded.
    """
    if isinstance(model, Decoder):
        return rollout(**_from_decoder(model, prompts, slots=slots, max_new_tokens=max_new_tokens,
                                       num_samples=num_samples, refill=refill, refill_rows=refill_rows,
                                       refill_after=refill_after, refill_widths=refill_widths, seed=seed,
                                       return_logprobs=return_logprobs, mode=mode, kernels=kernels, capture=capture,
                                       on_finished=on_finished, on_group=on_group,
                                       eos_poll_interval=eos_poll_interval, steps_per_launch=steps_per_launch,
                                       target_lengths=target_lengths, buckets=buckets, do_sample=do_sample,
                                       temperature=temperature,
                                       top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                                       eos_token_id=eos_token_id, pad_token_id=pad_token_id, **unsupported))
    t_start = time.perf_counter()
    if not isinstance(refill, str) or refill not in REFILLS:
        raise ValueError(f"refill={refill!r} is not one of {REFILLS}: 'off' decodes static batches of `slots` "
                         "sequences, 'host' refills finished slots with the next prompt between steps, 'device' "
                         "refills them on the device (captured modes)")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r} must be an int >= 1 (rows decoded at once)")
    sampling.logprobs_kind(return_logprobs)
    if on_finished is not None and not callable(on_finished):
        raise ValueError(f"on_finished={on_finished!r} must be callable (it gets each finished Sequence) or None")
    if on_group is not None and not callable(on_group):
        raise ValueError(f"on_group={on_group!r} must be callable (it gets the num_samples Sequences of a prompt "
                         "once all have finished) or None")
    check_samples(num_samples, unsupported)
    given = {k: v for k, v in dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                   repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                                   pad_token_id=pad_token_id).items() if v is not UNSET}
    settings = resolve(model, max_new_tokens, given, unsupported)
    check_samples(num_samples, {}, settings)
    kernels = check_run(model, mode, kernels, capture)
    if refill != "off":
        seed = _check_rows_policy(refill, mode, kernels, settings, seed, eos_poll_interval, steps_per_launch)
        refill_rows, refill_after, refill_widths = _check_refill_shape(refill_rows, refill_after, refill_widths)
        if buckets is not None:
            raise ValueError(f"buckets={buckets!r} pads the static batches of refill='off'; refill={refill!r} "
                             "prefills each refill at its own width buckets: use refill_widths=J instead (or "
                             "refill='off')")
    texts = _check_prompts(model, prompts, settings.max_new_tokens)
    sequences = [(p, k, ids) for p, ids in enumerate(texts) for k in range(num_samples)]
    targets = _check_targets(target_lengths, len(sequences), settings, refill)
    if refill != "off":
        check_rows(model, max(len(ids) for ids in texts) + settings.max_new_tokens, refill)
        # rows that would never hold a sequence are not allocated (nor counted as row-steps)
        run = _RowRollout(model, settings, sequences, min(slots, len(sequences)), return_logprobs, on_finished,
                          on_group, seed, refill, mode, capture, eos_poll_interval, steps_per_launch, num_samples,
                          targets, kernels, refill_rows, refill_after, refill_widths)
    else:
        if on_group is not None or eos_poll_interval is not None or steps_per_launch is not None \
                or refill_rows is not None or refill_after is not None or refill_widths is not None:
            raise ValueError("on_group, eos_poll_interval, steps_per_launch, refill_rows, refill_after and "
                             "refill_widths are refill='host'/'device' options; refill='off' decodes through a "
                             "Decoder: leave them unset")
        run = _StaticRollout(model, settings, sequences, slots, return_logprobs, on_finished, targets,
                             Decoder(model, mode=mode, buckets=buckets, max_new_tokens=settings.max_new_tokens,
                                     return_logprobs=return_logprobs, kernels=kernels, capture=capture,
                                     **given, **unsupported))
    if seed is not None and refill == "off":
        torch.manual_seed(seed)
    out = run.run()
    out.mode = mode
    out.total_s = time.perf_counter() - t_start
    return out


_ROLLOUT_DEFAULTS = dict(max_new_tokens=None, num_samples=1, return_logprobs=True, mode="eager", kernels="hf",
                         capture=None, eos_poll_interval=None, buckets=None)


def _from_decoder(decoder: Decoder, prompts, **given) -> dict:
    """rollout(decoder, ...): the Decoder's model, mode, kernels, capture and settings (`configure`'s), with what
    the call names explicitly on top. refill="off" still decodes through a Decoder of its own (with this one's
    buckets, unless the call names others); the refill
    policies capture their graphs per call (the queue and the prompt width shape them), so weights updated in
    place between rollouts are always seen."""
    options = decoder._options
    args = dict(decoder._settings, model=decoder.model, prompts=prompts, mode=decoder.mode,
                kernels=options["kernels"], capture=options["capture"], max_new_tokens=options["max_new_tokens"],
                return_logprobs=options["return_logprobs"], num_samples=options["num_samples"])
    if given.get("refill") == "device" and decoder.mode == "step-graph":
        args["eos_poll_interval"] = options["eos_poll_interval"]
    if given.get("refill", "off") == "off" and decoder.buckets:   # its static batches padded as the Decoder pads
        args["buckets"] = decoder.buckets
    for name, value in given.items():
        if value is UNSET or (name in _ROLLOUT_DEFAULTS and value == _ROLLOUT_DEFAULTS[name]
                              and name in args):
            continue
        args[name] = value
    return args


def _check_rows_policy(refill, mode: str, kernels: str, settings, seed, poll, steps_per_launch):
    """Refuse what refill='host'/'device' cannot run; return the seed (a Python int when sampling)."""
    spec = check_mode(mode)
    if refill == "host" and spec.device_loop:
        raise ValueError("refill='host' with mode='device-loop': the device loop does not come back to the host "
                         "between steps; use refill='device' (refills on the device), or mode='step-graph'")
    if refill == "device" and spec.graph == "forward":
        raise ValueError("refill='device' with mode='forward-graph': only the forward is captured, so the host runs "
                         "every refill anyway; use mode='step-graph' or 'device-loop' (or refill='host')")
    if kernels != "hf" and spec.graph == "forward":
        raise ValueError(f"refill={refill!r} with kernels={kernels!r} compiles the whole decode step, and "
                         "mode='forward-graph' captures the forward alone; use mode='step-graph' (or 'eager', "
                         "'device-loop'), or kernels='hf'")
    if poll is not None and (refill != "device" or spec.device_loop or mode == "eager"
                             or isinstance(poll, bool) or not isinstance(poll, int) or poll < 1):
        raise ValueError(f"eos_poll_interval={poll!r}: a rollout polls only with refill='device' in mode='step-graph' "
                         "(an int >= 1: steps launched between reads of `done`); leave it unset otherwise")
    if steps_per_launch is not None and (not spec.device_loop or isinstance(steps_per_launch, bool)
                                         or not isinstance(steps_per_launch, int) or steps_per_launch < 1):
        raise ValueError(f"steps_per_launch={steps_per_launch!r}: an int >= 1 with mode='device-loop' (steps per "
                         "launch; finished sequences are read between launches); leave it unset otherwise")
    if not settings.do_sample:
        return seed
    try:
        if isinstance(seed, bool):
            raise TypeError
        return operator.index(seed)
    except TypeError:
        raise ValueError(f"refill={refill!r} samples with noise keyed by (seed, prompt, sample, token), not the "
                         f"global generator, so it needs a seed: pass seed=<int> (got seed={seed!r}), or "
                         "refill='off' to draw from the global generator as generate() does") from None


def _check_refill_shape(rows, after, widths) -> tuple[int, int | None, int]:
    """refill_rows, refill_after and refill_widths as ints >= 1 (the defaults where None; refill_after's depends
    on the slots: `default_refill_after`)."""
    rows = REFILL_ROWS if rows is None else rows
    widths = REFILL_WIDTHS if widths is None else widths
    for name, value, what in (("refill_rows", rows, "the most prompts one refill prefills together"),
                              ("refill_after", after, "refill once this many slots are free"),
                              ("refill_widths", widths, "the most widths a refill prefills at; 1: every refill "
                               "at the longest prompt's width")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1 ({what})")
    return rows, after, widths


def _check_targets(target_lengths, count: int, settings, refill: str):
    """target_lengths (a harness for controlled lengths with random weights): one int in [1, max_new_tokens] per
    sequence, in input order (prompt-major, then sample); the sequence's first EOS id is forced as that token."""
    if target_lengths is None:
        return None
    if not settings.has_eos:
        raise ValueError("target_lengths forces an EOS id at each target, and no eos_token_id is set; pass "
                         "eos_token_id=<id>")
    targets = [int(t) for t in torch.as_tensor(target_lengths).flatten().tolist()]
    if len(targets) != count:
        raise ValueError(f"target_lengths has {len(targets)} values; pass one per sequence ({count}: prompts x "
                         "num_samples, in input order)")
    bad = [t for t in targets if not 1 <= t <= settings.max_new_tokens]
    if bad:
        raise ValueError(f"target_lengths holds {bad[0]}, outside [1, max_new_tokens={settings.max_new_tokens}]")
    return targets


def _check_prompts(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """The prompts as lists of ints, or one ValueError naming the first bad one."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be a list of token id lists (or a 2-D tensor, one prompt per row); got a "
                             f"{prompts.dim()}-D tensor")
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of token id lists; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
    text = model.config.get_text_config()
    vocab, positions = text.vocab_size, getattr(text, "max_position_embeddings", None)
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool or prompt.is_complex():
                raise ValueError(f"prompt {i} must be a 1-D integer tensor or a list of ints; got {prompt.dim()}-D "
                                 f"{prompt.dtype}")
            ids = prompt.tolist()
        elif isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"prompt {i} must be a list of token ids; got {type(prompt).__name__} "
                             "(tokenize text first)")
        else:
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                bad = next(t for t in ids if isinstance(t, bool) or not isinstance(t, int))
                raise ValueError(f"prompt {i} holds {bad!r} ({type(bad).__name__}); token ids are ints")
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab}) (min {min(ids)}, max "
                             f"{max(ids)}); check the tokenizer matches the model")
        if positions is not None and len(ids) + max_new_tokens - 1 > positions:
            raise ValueError(f"prompt {i} has {len(ids)} tokens: with max_new_tokens {max_new_tokens} it needs "
                             f"{len(ids) + max_new_tokens - 1} positions, more than the model's {positions}; shorten "
                             "it or ask for fewer tokens")
        out.append(ids)
    return out


def _finish_reason(tokens: list[int], settings) -> str:
    return "eos" if settings.has_eos and tokens and tokens[-1] in settings.eos_token_id else "length"


class _StaticRollout:
    """refill="off": `slots` consecutive sequences at a time, left-padded, through one Decoder (whose buckets pad
    further)."""

    def __init__(self, model, settings, sequences, slots, return_logprobs, on_finished, targets, decoder: Decoder):
        self.model, self.settings, self.sequences, self.slots = model, settings, sequences, slots
        self.targets = targets
        self.return_logprobs, self.on_finished, self.decoder = return_logprobs, on_finished, decoder

    def run(self) -> RolloutOutput:
        device = next(self.model.parameters()).device
        pad = self.settings.pad_token_id if self.settings.pad_token_id is not None else 0
        results, figures = [], dict(useful=0, row_steps=0, steps=0, prefills=0, syncs=0, prefill_s=0.0, decode_s=0.0)
        try:
            for batch, first in enumerate(range(0, len(self.sequences), self.slots)):
                members = self.sequences[first:first + self.slots]
                width = max(len(ids) for _, _, ids in members)
                ids = torch.full((len(members), width), pad, dtype=torch.long)
                mask = torch.zeros((len(members), width), dtype=torch.long)
                for row, (_, _, prompt) in enumerate(members):
                    ids[row, width - len(prompt):] = torch.tensor(prompt)
                    mask[row, width - len(prompt):] = 1
                targets = None if self.targets is None else self.targets[first:first + self.slots]
                out = self.decoder.generate(ids.to(device), mask.to(device), target_lengths=targets)
                lengths = out.lengths.tolist()
                for row, (p, k, _) in enumerate(members):
                    tokens = out.tokens[row, :lengths[row]].clone()
                    logprobs = None if out.logprobs is None else out.logprobs[row, :lengths[row]].clone()
                    seq = Sequence(p, k, tokens, logprobs, _finish_reason(tokens.tolist(), self.settings), slot=row,
                                   batch=batch)
                    results.append(seq)
                    if self.on_finished is not None:
                        self.on_finished(seq)
                figures["useful"] += sum(lengths)
                figures["row_steps"] += len(members) * (out.steps + 1)
                figures["steps"] += out.steps
                figures["prefills"] += 1
                figures["syncs"] += out.host_syncs
                figures["prefill_s"] += out.timings["prefill_s"]
                figures["decode_s"] += out.timings["decode_s"] + out.timings["warmup_s"] + out.timings["capture_s"]
        finally:
            self.decoder.close()
        return RolloutOutput(results, "off", self.slots, self.settings.max_new_tokens, "", figures["useful"],
                             figures["row_steps"], figures["steps"], figures["prefills"], len(results),
                             figures["syncs"], figures["prefill_s"], figures["decode_s"], 0.0)


class RolloutInterrupted(KeyboardInterrupt):
    """A KeyboardInterrupt during a rollout: `output` holds the sequences finished before it (a RolloutOutput)."""

    def __init__(self, output):
        super().__init__(f"rollout interrupted after {len(output.sequences)} finished sequences (see .output)")
        self.output = output


class _Clock:
    """Seconds between laps, the device's queued work included (synchronized at each lap)."""

    def __init__(self, synchronize):
        self.synchronize = synchronize
        self.synchronize()
        self.t = time.perf_counter()

    def lap(self) -> float:
        self.synchronize()
        t, self.t = self.t, time.perf_counter()
        return self.t - t


_FAR = 1 << 62  # a device loop's step limit where only `done` stops it


class _RowRollout:
    """refill="host" or "device": `slots` rows, each its own sequence (`core/rollout_step.py`).

    Both policies run `RowStep.__call__` (one decode step) and `RowStep.refill(g)` (g sequences into the first
    free slots) in one order: after each step, refill `group` rows `width` columns wide while `settled` is 0.
    "host" reads `settled`, `group`, `width` and `done` after each step and each refill. "device" in step-graph launches one graph per step, its
    refills first, in one WHILE node per size on the device, and reads `done` every `poll` steps; in device-loop
    one launch runs the rollout (`steps_per_launch` chunks it). Uncaptured (eager, or no CUDA) the device's
    conditions are read on the host: the same calls, so the twin of every captured run."""

    def __init__(self, model, settings, sequences, slots, return_logprobs, on_finished, on_group, seed, refill,
                 mode, capture, poll, steps_per_launch, num_samples, targets=None, kernels="hf",
                 refill_rows=REFILL_ROWS, refill_after=None, refill_widths=REFILL_WIDTHS):
        self.model, self.settings, self.sequences, self.slots = model, settings, sequences, slots
        self.on_finished, self.on_group, self.refill, self.mode = on_finished, on_group, refill, mode
        self.spec, self.poll, self.steps_per_launch = check_mode(mode), poll, steps_per_launch
        self.num_samples, self.kernels = num_samples, kernels
        self.device = next(model.parameters()).device
        vocab = model.config.get_text_config().vocab_size
        sizes = refill_sizes(refill_rows, slots, len(sequences))
        # the (size, width) pairs the queue can ask for: one refill graph (and compiled prefill) each
        width, widths, shapes = refill_plan([len(ids) for _, _, ids in sequences], slots, refill_rows, refill_widths)
        self.shapes = list(shapes)
        cache_len = width + settings.max_new_tokens
        self.state = new_row_state(slots, sequences, settings, vocab, self.device, return_logprobs, targets, sizes,
                                   widths)
        cache = row_cache(model, cache_len)
        self.refill_after = default_refill_after(slots) if refill_after is None else refill_after
        shape = dict(sizes=sizes, after=self.refill_after, widths=widths)
        self.step = RowStep(model, cache, self.state, settings, seed, **shape) if kernels == "hf" else \
            CompiledRowStep(model, cache, self.state, settings, seed, kernels=kernels, **shape)
        self.step.logprobs_of = sampling.logprobs_kind(return_logprobs) or "processed"
        self.capture = self.spec.captures and capture is not False and graphs.can_capture(self.device)
        self.graphs: list = []
        self.loops: list = []
        self.syncs = 0
        self.waits = Counter()
        self.results: list = [None] * len(sequences)
        self.delivered = 0
        self.groups_left: dict = {}
        self.refill_clock = None   # refill="device" captured: [scratch, ns] of the refills, timed on the device

    # -- host reads --
    def _read(self, tensor: torch.Tensor) -> list:
        self.syncs += 1
        ranges.count_syncs()
        return tensor.tolist()

    def _flags(self) -> tuple[bool, bool, tuple]:
        """(done, settled, the shape of the next refill: (rows, width)) in one read."""
        s = self.state
        done, settled, group, width = self._read(torch.cat([s.done, s.settled, s.group, s.width]))
        return bool(done), bool(settled), (group, width)

    # -- building: warm-up and capture --
    def _build(self) -> None:
        step, state = self.step, self.state
        step.flags()   # the first refill's size: every slot is free
        self.do_step = step
        self.do_refill = {(g, w): functools.partial(step.refill, g, w) for g, w in self.shapes}
        if not self.capture:
            return
        snap = state.snapshot()
        parts = self.setup_parts = {}
        clock = _Clock(self._synchronize)
        # HF's kernels: the first warm-up step watched for what a graph cannot hold. Never a compiled step: under
        # the watching dispatch mode dynamo skips its function, and marks it to run uncompiled from then on
        watch = watched(self.model, self.kernels)
        constants = {}
        with ranges.span(ranges.WARMUP):
            for shape in self.shapes:
                constants[shape] = graphs.warm_up(self.do_refill[shape], 2, model=watch)
                state.restore(snap)
            if self.spec.graph == "forward":
                step.phase["prefill"] = None
                forward = graphs.warm_up(step.forward, 2, model=watch)
            else:
                forward = graphs.warm_up(step, 2, model=watch)
        state.restore(snap)
        parts["warmup_s"] = clock.lap()
        pool = torch.cuda.graph_pool_handle()
        keep = self.refill == "device"
        with ranges.span(ranges.CAPTURE):
            if self.spec.graph == "forward":
                fwd = graphs.capture(step.forward, self.device, pool, model=self.model, constants=forward)
                self.graphs.append(fwd)

                def replayed():
                    fwd.replay()
                    return fwd.output
                step.forward_fn = replayed              # forward-graph: the refills' prefills stay eager
            else:
                refills = {shape: graphs.capture(self.do_refill[shape], self.device, pool, keep_graph=keep,
                                                 model=self.model, constants=constants[shape])
                           for shape in self.shapes}
                self.graphs += list(refills.values())
                whole = graphs.capture(step, self.device, pool, keep_graph=keep, model=self.model,
                                       constants=forward)
                self.graphs.append(whole)
                self.do_step = whole.replay
                self.do_refill = {shape: graph.replay for shape, graph in refills.items()}
        parts["capture_s"] = clock.lap()
        if keep:
            from .devloop import DeviceLoop
            far = torch.tensor(_FAR, dtype=torch.long, device=self.device)
            self.refill_clock = torch.zeros(2, dtype=torch.long, device=self.device)
            self.step_loop = DeviceLoop(whole.graph, state.done, state.steps, far, inner=self._chain(refills),
                                        inner_clock=self.refill_clock)
            self.loops.append(self.step_loop)
            parts["loop_s"] = clock.lap()

    def _chain(self, refills: dict) -> list:
        """The device loop's refills: per size, largest first, a WHILE node running while `group` is that size;
        its body the size's one refill graph, or where it has several widths one WHILE node per width, each
        running its graph while `width` is that width (the width may go up or down between two refills of one
        size, so the size's node runs its widths again until `group` changes)."""
        s, step = self.state, self.step
        chain = []
        for i, g in enumerate(step.sizes):
            widths = [(j, w) for j, w in enumerate(step.widths) if (g, w) in refills]
            if len(widths) == 1:
                chain.append((refills[g, widths[0][1]].graph, s.pick[i:i + 1]))
            else:
                chain.append(([(refills[g, w].graph, s.pick_width[i, j:j + 1]) for j, w in widths], s.pick[i:i + 1]))
        return chain

    # -- the run --
    def run(self) -> RolloutOutput:
        t_start = time.perf_counter()
        prefill_s = 0.0
        try:
            with torch.inference_mode(), self.step.decoding(), ranges.span(ranges.DECODE, self.slots):
                self._build()
                t_loop = time.perf_counter()
                try:
                    if self.refill == "device" and self.capture:
                        prefill_s = self._device()
                    else:
                        prefill_s = self._host()
                except KeyboardInterrupt:
                    self._synchronize()
                    self._harvest()
                    raise RolloutInterrupted(self._output(prefill_s, time.perf_counter() - t_loop)) from None
                loop_s = time.perf_counter() - t_loop
                self._harvest()
        finally:
            for loop in self.loops:
                loop.close()
            for graph in self.graphs:
                graph.close()
        out = self._output(prefill_s, loop_s)
        out.setup_s = t_loop - t_start
        out.setup_parts = getattr(self, "setup_parts", None) or None
        return out

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _settle(self) -> bool:
        """Refill while `settled` is 0, `group` rows at a time (host reads); returns done."""
        done, settled, shape = self._flags()
        while not settled:
            self._refill(shape)
            done, settled, shape = self._flags()
        return done

    def _refill(self, shape: tuple) -> None:
        with ranges.span(ranges.PREFILL, shape[0]), hidden_waits(self.device, self.waits):
            self.do_refill[shape]()

    def _host(self) -> float:
        """Both policies with the conditions read on the host (refill="host", and every uncaptured run)."""
        prefill_s = 0.0
        t0 = time.perf_counter()
        done = self._settle()
        prefill_s += time.perf_counter() - t0
        steps = 0
        while not done:
            steps += 1
            with ranges.span(ranges.STEP, steps), hidden_waits(self.device, self.waits):
                self.do_step()
            with ranges.span(ranges.EOS_CHECK):
                done, settled, shape = self._flags()
            if self.on_finished is not None or self.on_group is not None:
                self._harvest()
            if not settled:
                t0 = time.perf_counter()
                self._refill(shape)
                done = self._settle()
                prefill_s += time.perf_counter() - t0
        return prefill_s

    def _device(self) -> float:
        """refill="device", captured: the refills in WHILE nodes after each step, on the device (and at the start
        of each launch: the first one fills the slots). Returns the refills' seconds, timed on the device around
        each refill graph (the loop's `inner_clock`)."""
        launches = 0
        if self.spec.device_loop:
            while True:
                self.step_loop.launch(max_steps=self.steps_per_launch)
                launches += 1
                done = self._read(self.state.done)[0]
                if self.on_finished is not None or self.on_group is not None:
                    self._harvest()
                if done:
                    break
        else:
            poll = max(1, self.poll or 1)
            while True:
                for _ in range(poll):
                    self.step_loop.launch(max_steps=1)
                launches += poll
                with ranges.span(ranges.EOS_POLL):
                    done = self._read(self.state.done)[0]
                if self.on_finished is not None or self.on_group is not None:
                    self._harvest()
                if done:
                    break
        self.launches = launches
        return self._read(self.refill_clock[1:])[0] / 1e9

    # -- results --
    def _harvest(self) -> None:
        """Read the sequences finished since the last harvest (a read of the flags, one of their rows)."""
        s = self.state
        q = len(self.sequences)
        finished = self._read(s.finished[:q])
        new = [i for i in range(q) if finished[i] and self.results[i] is None]
        if not new:
            return
        rows = torch.tensor(new, device=self.device)
        read = torch.cat([s.out_lengths[rows, None], s.slot_of[rows, None], s.out[rows]], dim=1).cpu()
        self.syncs += 1
        logprobs = None
        if s.logprobs is not None:
            logprobs = s.logprobs[rows].cpu()
            self.syncs += 1
        for j, i in enumerate(new):
            length = int(read[j, 0])
            tokens = read[j, 2:2 + length].clone()
            p, k, _ = self.sequences[i]
            seq = Sequence(p, k, tokens, None if logprobs is None else logprobs[j, :length].clone(),
                           _finish_reason(tokens.tolist(), self.settings), slot=int(read[j, 1]))
            self.results[i] = seq
            self.delivered += 1
            if self.on_finished is not None:
                self.on_finished(seq)
            if self.on_group is not None:
                left = self.groups_left.setdefault(p, self.num_samples) - 1
                self.groups_left[p] = left
                if left == 0:
                    self.on_group([self.results[i - k + j2] for j2 in range(self.num_samples)])

    def _output(self, prefill_s: float, loop_s: float) -> RolloutOutput:
        s = self.state
        row_steps, steps, refills, started, *counts = (int(v) for v in self._read(
            torch.cat([torch.stack([s.ran.sum(), s.steps, s.refills, s.next]), s.refill_counts.flatten()])))
        sizes, widths = self.step.sizes, self.step.widths
        counts = [counts[i * len(widths):(i + 1) * len(widths)] for i in range(len(sizes))]   # [K][J]
        done = [seq for seq in self.results if seq is not None]
        out = RolloutOutput(done, self.refill, self.slots, self.settings.max_new_tokens, "",
                            sum(seq.length for seq in done), row_steps, steps, refills, started,
                            self.syncs + self.waits.count, prefill_s, max(loop_s - prefill_s, 0.0), 0.0)
        out.launches = getattr(self, "launches", None)
        out.refill_sizes = {g: sum(row) for g, row in zip(sizes, counts) if sum(row)}
        out.refill_widths = {w: sum(row[j] for row in counts) for j, w in enumerate(widths)
                             if any(row[j] for row in counts)}
        out.refill_after = self.refill_after
        return out
