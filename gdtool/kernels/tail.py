"""The greedy fast step's tail in one kernel: the argmax's second stage, the state's update and the cache counters.

After the fast forward, greedy decoding ran the two-stage argmax (2 kernels), then `Step.update` compiled by
inductor (4 elementwise kernels at batch 1: the token written out, lengths / done flags, position, mask column
and step index), and the forward's `torch._foreach_add_` on the caches' counters before the lm_head. In a node
trace of llama-1b at batch 1 (H200, e4c1eba) those 7 kernels took ~11 µs a step, most of it launch latency:
each ran ~1-1.5 µs after a ~0.4 µs gap, and the counters' kernel between the last layer and the lm_head cut
the PDL link there. Here one program, launched after the argmax's first stage, does all of it:

    token = argmax over the blocks' best (NaN first, ties to the smallest index: `sampling._best`)
    Step.update for greedy without targets, scores or log-probabilities (the same integer arithmetic):
        finished rows get pad; out[:, index] = token; lengths += unfinished; seen[token] = 1;
        unfinished *= token not in eos; done; done_at; tokens = token; positions += 1;
        mask[:, min(index + prompt width, last slot)] = 1; index += 1
    every counter += 1 (the forward's, `forward.forward(advance=False)`)

Every value is an integer, so the result equals the reference (`update_reference`: `sampling.argmax_reference`,
`Step.update`, `torch._foreach_add_`) exactly. The counters are separate one-element tensors (one per cache
layer): the kernel reads their addresses from a small device table, made before capture, as
`triton.zero_counts`'s buffers are; a set of counters first met during a capture is advanced by
`torch._foreach_add_` instead. GDTOOL_ONE_KERNEL_TAIL=0: the argmax's two kernels and the compiled update, as before.
"""
from __future__ import annotations

import torch

from . import sampling
from .triton import HAVE_TRITON, asked, launch_options, next_pow2, tl, triton, untested_on_cuda

PATH = "greedy tail in one kernel"  # its kernel path's name (triton.CUDA_TESTED)


def refusal(state, device) -> str:
    """'' where `update` can run the tail of this state's step on `device`, else why not (as `experts.refusal`)."""
    if not asked("one_kernel_tail"):
        return "GDTOOL_ONE_KERNEL_TAIL=0"
    if state.targets is not None:
        return "forced lengths (targets)"
    if state.scores is not None or state.logprobs is not None:
        return "scores or log-probabilities recorded"
    return untested_on_cuda(PATH, device)


def update_reference(scores: torch.Tensor, step, counters: list) -> None:
    """What the kernel does, in torch: the argmax, `Step.update`, the counters' add."""
    step.update(sampling.argmax_reference(scores))
    if counters:
        torch._foreach_add_(counters, 1)


_TABLES: dict = {}


def _addresses(counters: list):
    """A device table of the counters' addresses (int64), one per set of counters; None where a set is first met
    during a capture (a table made there would be a copy the graph replays). Kept for the process: a captured graph
    reads its table at every replay, so none is ever freed (a few bytes a cache layer)."""
    key = tuple(c.data_ptr() for c in counters)
    if key not in _TABLES:
        device = counters[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _TABLES[key] = torch.tensor(key, dtype=torch.int64, device=device)
    return _TABLES[key]


if HAVE_TRITON:
    @triton.jit
    def _tail(v_ptr, i_ptr, BLOCKS, B, tokens_ptr, tokens_stride, positions_ptr, positions_stride, mask_ptr,
              mask_stride, index_ptr, out_ptr, out_stride, lengths_ptr, unfinished_ptr, done_ptr, done_at_ptr,
              seen_ptr, seen_stride, eos_ptr, E, counters_ptr, COUNTERS, pad, last_index, last_slot, prompt_width,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, EOS_BLOCK: tl.constexpr, COUNTERS_BLOCK: tl.constexpr,
              HAS_EOS: tl.constexpr, HAS_SEEN: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.arange(0, ROWS)
        rows = r < B
        c = tl.arange(0, BLOCK)
        inside = rows[:, None] & (c < BLOCKS)[None, :]
        at = r[:, None] * BLOCKS + c[None, :]
        x = tl.load(v_ptr + at, mask=inside, other=float("-inf"))
        idx = tl.load(i_ptr + at, mask=inside, other=2147483647)
        token = sampling._best(x, idx, inside, 1).to(tl.int64)

        step = tl.load(index_ptr)
        index = tl.minimum(step, last_index)
        unfinished = tl.load(unfinished_ptr + r, mask=rows, other=0)
        if HAS_EOS:
            token = token * unfinished + pad * (1 - unfinished)
        tl.store(out_ptr + r * out_stride + index, token, mask=rows)
        lengths = tl.load(lengths_ptr + r, mask=rows, other=0)
        tl.store(lengths_ptr + r, lengths + unfinished, mask=rows)
        if HAS_SEEN:
            tl.store(seen_ptr + r * seen_stride + token, tl.full([ROWS], 1, tl.int1), mask=rows)
        if HAS_EOS:
            e = tl.arange(0, EOS_BLOCK)
            eos = tl.load(eos_ptr + e, mask=e < E, other=0)
            hits = tl.sum(((token[:, None] == eos[None, :]) & (e < E)[None, :]).to(tl.int32), axis=1)
            unfinished = unfinished * (hits == 0).to(tl.int64)
            tl.store(unfinished_ptr + r, unfinished, mask=rows)
        done = (tl.max(tl.where(rows, unfinished, 0), axis=0) == 0) | (step >= last_index)
        tl.store(done_ptr, done)
        done_at = tl.load(done_at_ptr)
        tl.store(done_at_ptr, tl.where(done & (done_at < 0), step, done_at))
        tl.store(tokens_ptr + r * tokens_stride, token, mask=rows)
        positions = tl.load(positions_ptr + r * positions_stride, mask=rows, other=0)
        tl.store(positions_ptr + r * positions_stride, positions + 1, mask=rows)
        slot = tl.minimum(step + prompt_width, last_slot)
        tl.store(mask_ptr + r * mask_stride + slot, tl.full([ROWS], 1, tl.int64), mask=rows)
        tl.store(index_ptr, step + 1)
        if COUNTERS_BLOCK > 0:
            k = tl.arange(0, COUNTERS_BLOCK)
            address = tl.load(counters_ptr + k, mask=k < COUNTERS, other=0)
            counter = address.to(tl.pointer_type(tl.int64), bitcast=True)
            tl.store(counter, tl.load(counter, mask=k < COUNTERS) + 1, mask=k < COUNTERS)


def update(scores: torch.Tensor, step, counters: list) -> None:
    """The argmax of `scores` [B, V] (float32) as the next token, `step.update` of it (`refusal` says where not) and
    every counter (one-element int64 tensors) + 1, in two kernels: the argmax's first stage, then `_tail`."""
    s = step.state
    b, _ = scores.shape
    values, index = sampling.argmax_blocks(scores)
    blocks = values.shape[1]
    table = _addresses(counters) if counters else None
    if counters and table is None:
        torch._foreach_add_(counters, 1)
    eos = s.eos if s.eos is not None else s.index
    seen = s.seen if s.seen is not None else s.mask
    _tail[(1,)](values, index, blocks, b, s.tokens, s.tokens.stride(0), s.positions, s.positions.stride(0), s.mask,
                s.mask.stride(0), s.index, s.out, s.out.stride(0), s.lengths, s.unfinished, s.done, s.done_at,
                seen, seen.stride(0), eos, eos.numel(), table if table is not None else s.index,
                0 if table is None else table.numel(), step.pad, step.last_index, step.last_slot, step.prompt_width,
                ROWS=max(2, next_pow2(b)), BLOCK=max(2, next_pow2(blocks)), EOS_BLOCK=max(2, next_pow2(eos.numel())),
                COUNTERS_BLOCK=0 if table is None else max(2, next_pow2(table.numel())),
                HAS_EOS=s.eos is not None, HAS_SEEN=s.seen is not None, num_warps=4,
                **launch_options(scores.device))
