"""A full sliding window's cache update for one decoded token, in one kernel (`kernels="fast"`, Gemma 3).

Once a sliding layer's window is full, HF's `StaticSlidingWindowLayer.update` makes room for the new token
by rolling the window left by one and writing the token's key and value in the last slot:

    new_keys = keys.roll(-1, dims=-2); new_keys[:, :, -1] = k; keys.copy_(new_keys)     (and the values)

four kernels over the layer's whole cache (two rolls into new tensors, two copies back) before the write.
`roll_left` shifts both caches left by one slot in place, in one kernel, and leaves the last slot to the
write that follows (`gemv.qkv_rope` writes k and v there, as it writes any slot): the cache ends bit for
bit as HF's update leaves it (a copy, no arithmetic), in HF's own tensors and layout [B, Hkv, W, D].

In place, without a race: each program owns one slice of the head dimension of one (row, key/value head)
of one of the two caches, for all W slots, so no two programs touch one address. Within a program every
thread loads its part of slots 1 .. W-1 before any thread stores slots 0 .. W-2 (a barrier between them).

Why not inside `qkv_rope`, where k and v are computed: the program that writes slot W - 1 of a (row, head,
dims) would then have to roll those dims itself (the old slot W - 1 must be read before it is overwritten),
and a tile of `qkv_rope` is a whole head for Gemma's per-head norm: the two programs of a key/value head
would move W x D values each, serially, while the query heads' programs finish. Here the move is spread
over the GPU, and the write stays the one `qkv_rope` already does.

With PDL the move runs before the kernel's wait, not after it as in the other kernels, so it overlaps the
kernel before (the previous layer's last product): at prompt 1024 on the H200, where all 22 sliding windows of
gemma-3-1b roll every step, the roll waiting first cost 3.4 µs a layer of the step's time (the node trace at
41fab16, profiles/h200/nsys-fast/gemma-3-1b-b1-p1024-41fab16/). Safe because of what PDL guarantees: a kernel
starts only once every block of the one before has called `gdc_launch_dependents`, which each decode kernel
calls after its own `gdc_wait`; so when the roll starts, every kernel but the one just before it has ended,
and the last kernel to touch this layer's cache (its attention, one step earlier) among them. The kernel just
before never reads or writes a layer's cache it does not serve, and it is never this layer's (the roll is
the layer's first kernel). The roll waits last: it ends after that kernel, and the kernels after the roll,
which wait for the roll to end, see that kernel's writes as if the roll had waited first. It lets the next
kernel start at once (`gdc_launch_dependents` first): that one, `qkv_rope`, only loads weights before its
own wait, and the kernels after it start after that wait, once the roll and the kernel before it have ended.

    roll_left(keys, values)            Triton (CUDA, or Triton's interpreter)
    roll_left_reference(keys, values)  HF's arithmetic: roll, copy back
"""
from __future__ import annotations

import torch

from .triton import HAVE_TRITON, launch_options, next_pow2, tl, triton

SLICE_BYTES = 16           # bytes of the head dimension per program and slot: one 16-byte load per slot
ELEMENTS_PER_PROGRAM = 4096  # slots x slice held at once; more slots loop in chunks of this size


def roll_left_reference(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Both [B, Hkv, W, D] caches rolled left by one slot along W, in place (slot W - 1 then holds the old
    slot 0, which the write of the new token replaces), as HF's update rolls them."""
    keys.copy_(keys.roll(-1, dims=-2))
    values.copy_(values.roll(-1, dims=-2))


if HAVE_TRITON:
    @triton.jit
    def _roll_left_kernel(k_ptr, v_ptr, W: tl.constexpr, D: tl.constexpr, DS: tl.constexpr, CHUNK: tl.constexpr,
                          PDL: tl.constexpr):
        # program (row * Hkv + head, slice of D, keys or values): slots 0 .. W - 2 <- slots 1 .. W - 1
        bh = tl.program_id(0)
        dims = tl.program_id(1) * DS + tl.arange(0, DS)[None, :]
        if tl.program_id(2) == 0:
            base = k_ptr + bh.to(tl.int64) * (W * D)
        else:
            base = v_ptr + bh.to(tl.int64) * (W * D)
        if PDL:  # the next kernel (qkv_rope) may start loading its weights now; it waits for this one's end
            tl.extra.cuda.gdc_launch_dependents()
        for start in range(0, W - 1, CHUNK):
            slots = start + tl.arange(0, CHUNK)[:, None]
            keep = slots < W - 1
            moved = tl.load(base + (slots + 1) * D + dims, mask=keep)
            # every thread's loads of this chunk land before any thread overwrites a slot another one reads;
            # later chunks read slots past this chunk's stores
            tl.debug_barrier()
            tl.store(base + slots * D + dims, moved, mask=keep)
        if PDL:  # the move done, wait for the kernel before: this one ends after it (see the module's docstring)
            tl.extra.cuda.gdc_wait()


def roll_config(w: int, d: int, element_size: int) -> tuple[int, int]:
    """(DS dims per program, CHUNK slots per iteration)."""
    ds = min(d, max(1, SLICE_BYTES // element_size))
    chunk = min(next_pow2(max(w - 1, 1)), max(1, ELEMENTS_PER_PROGRAM // ds))
    return ds, chunk


def roll_left(keys: torch.Tensor, values: torch.Tensor, config: tuple[int, int] | None = None) -> None:
    """Triton `roll_left`: the same in-place result as `roll_left_reference` on slots 0 .. W - 2 (slot W - 1
    keeps its old value, for the new token's write to replace)."""
    if keys.shape != values.shape or keys.dtype != values.dtype or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError(f"roll_left needs contiguous keys and values of one shape and dtype; got "
                         f"{tuple(keys.shape)} {keys.dtype} and {tuple(values.shape)} {values.dtype}")
    b, hkv, w, d = keys.shape
    ds, chunk = config or roll_config(w, d, keys.element_size())
    if d % ds or ds & (ds - 1):
        raise ValueError(f"roll_left: a slice of {ds} dims must be a power of two dividing head_dim {d}")
    _roll_left_kernel[(b * hkv, d // ds, 2)](keys, values, W=w, D=d, DS=ds, CHUNK=chunk, num_warps=4,
                                            **launch_options(keys.device))
