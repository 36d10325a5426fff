"""`gdtool.rollout`: many ragged prompts through a fixed number of slots.

A static batch waits for its longest row: with realistic response lengths most row-steps of a large
batch decode pads for rows that finished long ago. A rollout takes a list of prompts (many more than
the slots) and keeps `slots` rows decoding:

    out = gdtool.rollout(model, prompts, slots=64, max_new_tokens=512, refill="host", eos_token_id=eos)
    out.sequences[i].tokens, .logprobs, .finish_reason     # in input order: prompt-major, then sample
    out.useful_tokens, out.row_steps, out.row_step_share, out.tokens_per_s
    out.to_frame()                                         # one row per sequence

refill="off"   today's static batches: `slots` consecutive sequences at a time, left-padded, through a
               `Decoder` (any mode and kernels). Each sequence is bit for bit generate() on its batch.
refill="host"  each slot holds one sequence at its own positions (`core/rollout_step.py`). Between steps
               the host refills the slots that finished: the free slots, in slot order, take prompts
               from the queue in input order; their prompts are prefilled alone (those of one width
               together) and copied into the slots' cache rows before the next step. A sequence that
               ends at its prefill (EOS first, or max_new_tokens=1) frees its slot for another round
               before the step. Greedy, each sequence is generate() on its prompt alone, up to rounding
               (the step runs batched, over a longer cache): tokens equal in float64 on a CPU.
               Sampling draws keyed noise (`core/noise.py`), not generate()'s generator stream: token t of
               sample k of prompt p races exponentials that are a hash of (seed, p, k, t, vocabulary id),
               so a sequence does not depend on its slot, the slot count or its neighbours; the same seed
               gives the same rollout. Temperature, top-k, top-p and the repetition penalty apply as in
               generate(). `seed` is required to sample.
               eager mode, HF's kernels, dense full-attention models for now.

Figures: `useful_tokens` (the sequences' lengths), `row_steps` (one per slot and decode step, plus one per
prefilled row: what the device ran, counted on the device for refill="host"), `row_step_share`, host
syncs, prefill time (refills included), decode time and `tokens_per_s` (useful tokens per second of the
whole call).
"""
from __future__ import annotations

import operator
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..core import ranges
from ..core.rollout_step import RowStep, check_rows, new_row_state, row_cache
from ..core.settings import UNSET, resolve
from ..core.syncs import Counter, hidden_waits
from .decode import check_run, check_samples
from .decoder import Decoder

__all__ = ["REFILLS", "RolloutOutput", "Sequence", "rollout"]
REFILLS = ("off", "host")


@dataclass
class Sequence:
    """One finished sequence of a rollout."""
    prompt_index: int
    sample_index: int
    tokens: torch.Tensor              # [length] int64 on the CPU, up to and including EOS
    logprobs: torch.Tensor | None     # [length] float32 log-probability of each token under the processed scores
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
    slots: int
    max_new_tokens: int
    mode: str
    useful_tokens: int                # sum of the sequences' lengths
    row_steps: int                    # rows x token steps the device ran (a prefilled row counts one)
    decode_steps: int                 # decode forwards (refill="off": summed over the batches)
    prefills: int                     # prefill forwards (refill="host": one per refill group)
    prefilled_rows: int               # rows those prefills ran (one per sequence)
    host_syncs: int                   # blocking reads of device values, hidden ones included
    prefill_s: float                  # prompt forwards and first tokens, refills included
    decode_s: float                   # decode steps, EOS checks and read-backs (graph warm-up and capture too)
    total_s: float

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
                    host_syncs=self.host_syncs,
                    prefill_s=self.prefill_s, decode_s=self.decode_s, total_s=self.total_s,
                    tokens_per_s=self.tokens_per_s)


def rollout(model, prompts, *, slots: int, max_new_tokens: int, num_samples: int = 1, refill: str = "off",
            seed: int | None = None, return_logprobs: bool = True, mode: str = "eager", kernels: str = "hf",
            capture: bool | None = None, on_finished=None, do_sample=UNSET, temperature=UNSET, top_k=UNSET,
            top_p=UNSET, repetition_penalty=UNSET, eos_token_id=UNSET, pad_token_id=UNSET,
            **unsupported) -> RolloutOutput:
    """Decode every prompt of `prompts` (token id lists, ragged) `num_samples` times through `slots` rows.

    Settings resolve as generate() resolves them (see `gdtool.decode`). refill="off": `seed` seeds the global
    generators once, before the first batch, and the batches draw from them in turn (generate()'s stream, bit
    for bit). refill="host": sampling needs `seed` (an int, taken mod 2**64): the noise of token t of sample k
    of prompt p is keyed by (seed, p, k, t) (`core.noise`), so a sequence is the same whatever slot it ran in
    and however many slots ran; the global generators are not touched. `on_finished(sequence)` is
    called with each `Sequence` as soon as the host has it (refill="host": at the step it finished; "off": after
    its batch). Everything is checked before any work: a bad input or a setting the refill cannot honour ends
    in one ValueError that says why and what to use instead.
    """
    t_start = time.perf_counter()
    if not isinstance(refill, str) or refill not in REFILLS:
        raise ValueError(f"refill={refill!r} is not one of {REFILLS}: 'off' decodes static batches of `slots` "
                         "sequences, 'host' refills finished slots with the next prompt between steps")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r} must be an int >= 1 (rows decoded at once)")
    if on_finished is not None and not callable(on_finished):
        raise ValueError(f"on_finished={on_finished!r} must be callable (it gets each finished Sequence) or None")
    check_samples(num_samples, unsupported)
    given = {k: v for k, v in dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                   repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                                   pad_token_id=pad_token_id).items() if v is not UNSET}
    settings = resolve(model, max_new_tokens, given, unsupported)
    check_samples(num_samples, {}, settings)
    kernels = check_run(model, mode, kernels, capture)
    if refill == "host":
        seed = _check_host(mode, kernels, settings, seed)
    texts = _check_prompts(model, prompts, settings.max_new_tokens)
    sequences = [(p, k, ids) for p, ids in enumerate(texts) for k in range(num_samples)]
    if refill == "host":
        check_rows(model, max(len(ids) for ids in texts) + settings.max_new_tokens - 1)
        run = _HostRollout(model, settings, sequences, slots, return_logprobs, on_finished, seed)
    else:
        run = _StaticRollout(model, settings, sequences, slots, return_logprobs, on_finished,
                             Decoder(model, mode=mode, max_new_tokens=settings.max_new_tokens,
                                     return_logprobs=return_logprobs, kernels=kernels, capture=capture,
                                     **given, **unsupported))
    if seed is not None and refill == "off":
        torch.manual_seed(seed)
    out = run.run()
    out.mode = mode
    out.total_s = time.perf_counter() - t_start
    return out


def _check_host(mode: str, kernels: str, settings, seed):
    """Refuse what refill='host' cannot run; return the seed (a Python int when sampling)."""
    if mode != "eager":
        raise ValueError(f"refill='host' runs mode='eager' for now (mode={mode!r}: refilling inside a captured step "
                         "or the device loop is not built yet); use mode='eager', or refill='off' for the graph modes")
    if kernels != "hf":
        raise ValueError(f"refill='host' runs HF's kernels (kernels='hf'); kernels={kernels!r} is not wired to the "
                         "per-row cache write yet: use kernels='hf', or refill='off'")
    if not settings.do_sample:
        return seed
    try:
        if isinstance(seed, bool):
            raise TypeError
        return operator.index(seed)
    except TypeError:
        raise ValueError(f"refill='host' samples with noise keyed by (seed, prompt, sample, token), not the global "
                         f"generator, so it needs a seed: pass seed=<int> (got seed={seed!r}), or refill='off' to "
                         "draw from the global generator as generate() does") from None


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
    """refill="off": `slots` consecutive sequences at a time, left-padded, through one Decoder."""

    def __init__(self, model, settings, sequences, slots, return_logprobs, on_finished, decoder: Decoder):
        self.model, self.settings, self.sequences, self.slots = model, settings, sequences, slots
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
                out = self.decoder.generate(ids.to(device), mask.to(device))
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


class _HostRollout:
    """refill="host": `slots` rows, each its own sequence; the host refills finished rows between steps."""

    def __init__(self, model, settings, sequences, slots, return_logprobs, on_finished, seed):
        self.model, self.settings, self.sequences, self.slots = model, settings, sequences, slots
        self.on_finished = on_finished
        self.device = next(model.parameters()).device
        width = max(len(ids) for _, _, ids in sequences)
        cache_len = width + settings.max_new_tokens - 1
        vocab = model.config.get_text_config().vocab_size
        self.state = new_row_state(slots, cache_len, settings, vocab, self.device, return_logprobs)
        self.step = RowStep(model, row_cache(model, cache_len), self.state, settings, seed)
        self.queue = deque(range(len(sequences)))
        self.holding: list = [None] * slots   # the sequence each slot runs, None when empty
        self.results: list = [None] * len(sequences)
        self.syncs = self.prefills = self.prefilled_rows = 0
        self.useful = 0

    def run(self) -> RolloutOutput:
        state, waits = self.state, Counter()
        prefill_s = decode_s = 0.0
        steps = 0
        with torch.inference_mode(), self.step.decoding(), ranges.span(ranges.DECODE, self.slots):
            t0 = time.perf_counter()
            self._admit(list(range(self.slots)), waits)
            prefill_s += time.perf_counter() - t0
            while any(q is not None for q in self.holding):
                t0 = time.perf_counter()
                steps += 1
                with ranges.span(ranges.STEP, steps), hidden_waits(self.device, waits):
                    self.step()
                with ranges.span(ranges.EOS_CHECK):
                    flags = state.unfinished.tolist()
                    self._count_sync()
                done = [slot for slot, q in enumerate(self.holding) if q is not None and not flags[slot]]
                if done:
                    self._harvest(done)
                t1 = time.perf_counter()
                decode_s += t1 - t0
                if done:
                    self._admit(done, waits)
                    prefill_s += time.perf_counter() - t1
            t0 = time.perf_counter()
            row_steps = int(state.ran.sum())  # counted on the device
            self._count_sync()
            decode_s += time.perf_counter() - t0
        return RolloutOutput(self.results, "host", self.slots, self.settings.max_new_tokens, "", self.useful,
                             row_steps, steps, self.prefills, self.prefilled_rows, self.syncs + waits.count, prefill_s,
                             decode_s, 0.0)

    def _count_sync(self) -> None:
        self.syncs += 1
        ranges.count_syncs()

    def _admit(self, free: list, waits: Counter) -> None:
        """Free slots, in slot order, take the next sequences in input order; those of one prompt width are
        prefilled together. Slots whose sequence ends at its prefill take the next ones, round after round."""
        while free and self.queue:
            assigned = [(slot, self.queue.popleft()) for slot in free[:len(self.queue)]]
            groups: dict = {}
            for slot, q in assigned:
                groups.setdefault(len(self.sequences[q][2]), []).append((slot, q))
                self.holding[slot] = q
            with ranges.span(ranges.PREFILL), hidden_waits(self.device, waits):
                for members in groups.values():
                    rows = torch.tensor([slot for slot, _ in members], device=self.device)
                    ids = torch.tensor([self.sequences[q][2] for _, q in members], device=self.device)
                    keys = torch.tensor([self.sequences[q][:2] for _, q in members], device=self.device)
                    self.step.refill(rows, ids, keys[:, 0], keys[:, 1])
                    self.prefills += 1
                    self.prefilled_rows += len(members)
            flags = self.state.unfinished.tolist()
            self._count_sync()
            free = [slot for slot, _ in assigned if not flags[slot]]
            if free:
                self._harvest(free)

    def _harvest(self, slots: list) -> None:
        """Read the finished sequences of `slots` back (one read, two with log-probabilities) and empty the slots."""
        s = self.state
        rows = torch.tensor(slots, device=self.device)
        read = torch.cat([s.lengths[rows, None], s.out[rows]], dim=1).cpu()
        self._count_sync()
        logprobs = None
        if s.logprobs is not None:
            logprobs = s.logprobs[rows].cpu()
            self._count_sync()
        for i, slot in enumerate(slots):
            q = self.holding[slot]
            length = int(read[i, 0])
            tokens = read[i, 1:1 + length].clone()
            p, k, _ = self.sequences[q]
            seq = Sequence(p, k, tokens, None if logprobs is None else logprobs[i, :length].clone(),
                           _finish_reason(tokens.tolist(), self.settings), slot=slot)
            self.results[q] = seq
            self.useful += length
            self.holding[slot] = None
            if self.on_finished is not None:
                self.on_finished(seq)
