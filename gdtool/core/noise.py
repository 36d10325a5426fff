"""Counter-based noise: a uniform per (seed, prompt, sample, token, vocabulary id), by exact integer hashing.

A rollout that refills its slots cannot draw from one generator stream: the draws a sequence gets would then
depend on the slot it ran in and on what ran beside it. Here each draw is a pure function of its key:

    u(seed, prompt, sample, token, v) in (0, 1)

so a sequence's noise is the same whatever its slot, the slot count or the order sequences finish in.

The hash. The key is 9 words of 32 bits, little end first: seed mod 2**64 (low word, high word), prompt index
(low, high), sample index (low, high), token index (low, high) and v (the key's integers are int64, split as
two's complement: `x & 0xFFFFFFFF` and `(x >> 32) & 0xFFFFFFFF`, so negative keys are distinct keys too). Two
lanes hash them with MurmurHash3_x86_32 (Austin Appleby's public-domain hash, 36 bytes, no tail) under the
murmur seeds LANE_SEEDS = (0, 0x9E3779B9); its constants:

    block   k *= 0xCC9E2D51; k = rotl(k, 15); k *= 0x1B873593; h ^= k; h = rotl(h, 13); h = h * 5 + 0xE6546B64
    final   h ^= 36 (the length in bytes); h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35;
            h ^= h >> 16
    (all mod 2**32)

The 52 bits m = (lane0 >> 12) * 2**32 + lane1 give u = (2m + 1) / 2**53, exact in float64 and strictly inside
(0, 1): u is in [2**-53, 1 - 2**-53], so -log(u) is finite and positive (at most 36.8).

Arithmetic. Every value is held in an int64 tensor as an unsigned 32-bit number, so nothing overflows and no
shift sees a sign: a 32x32-bit product is formed from the constant's 16-bit halves (`_mul32`, each partial
product below 2**48) and masked. The result is exact integer arithmetic, hence the same bits on every device and
under torch.compile; nothing is read on the host and no generator state is used, so it can be captured. The
eight key words of a row are hashed once per row ([B] tensors); only the last block (v, the same for every row:
a [V] tensor) and the finalizer run over [B, V].

`exponentials` turns u into Exp(1) variates (-log u, float64); `sampling.choose_keyed` races them as
`sampling.choose` races the generator's: argmax(probs / E). The float64 log is not promised bit-equal across
devices (its last bit may differ), so CPU and GPU agree exactly on u and on the draw except where two
candidates tie within float64 rounding.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
C1, C2 = 0xCC9E2D51, 0x1B873593
N_ADD = 0xE6546B64
F1, F2 = 0x85EBCA6B, 0xC2B2AE35
LANE_SEEDS = (0, 0x9E3779B9)
WORDS = 9  # seed, prompt, sample, token (two words each), v
TWO_M53 = 2.0 ** -53


def _mul32(x, c: int):
    """x * c mod 2**32 for x in [0, 2**32) held in int64, c a 32-bit constant, without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _rotl(x, r: int):
    return ((x << r) & MASK32) | (x >> (32 - r))


def _scramble(k):
    return _mul32(_rotl(_mul32(k, C1), 15), C2)


def _block(h, k):
    """One murmur3 block: the state h takes the word k."""
    h = _rotl(h ^ _scramble(k), 13)
    return (_mul32(h, 5) + N_ADD) & MASK32


def _finish(h, length_bytes: int):
    h = h ^ length_bytes
    h = h ^ (h >> 16)
    h = _mul32(h, F1)
    h = h ^ (h >> 13)
    h = _mul32(h, F2)
    return h ^ (h >> 16)


def murmur3_words(words: list, seed: int = 0):
    """MurmurHash3_x86_32 of 32-bit words (ints or int64 tensors holding values in [0, 2**32), broadcast
    together), as the reference C code hashes their little-endian bytes. Exposed to pin the hash in tests."""
    h = seed & MASK32
    for k in words:
        h = _block(h, k)
    return _finish(h, 4 * len(words))


def _split(x):
    """Low and high 32-bit words of int64 values (two's complement)."""
    return x & MASK32, (x >> 32) & MASK32


def seed_words(seed: int, device=None) -> torch.Tensor:
    """The seed's two key words (mod 2**64, low word first) as a [2] int64 tensor: a step that reads its seed from
    this buffer draws the same noise as with the int, and a new seed is a copy into it, not a new graph."""
    seed = int(seed) & MASK64
    return torch.tensor([seed & MASK32, seed >> 32], dtype=torch.long, device=device)


def key_words(seed, prompt: torch.Tensor, sample: torch.Tensor, token: torch.Tensor) -> list:
    """The 8 key words of each row: seed (a Python int, taken mod 2**64, or its `seed_words`) and [B] int64
    indices."""
    if isinstance(seed, torch.Tensor):
        low, high = seed[0], seed[1]
    else:
        seed = int(seed) & MASK64
        low, high = seed & MASK32, seed >> 32
    return [low, high, *_split(prompt), *_split(sample), *_split(token)]


def uniform(seed, prompt: torch.Tensor, sample: torch.Tensor, token: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float64 u in (0, 1), u[b, v] = the hash of (seed, prompt[b], sample[b], token[b], v).

    prompt, sample and token are [B] int64 tensors on one device (the result's)."""
    words = key_words(seed, prompt.long(), sample.long(), token.long())
    v = torch.arange(vocab, dtype=torch.long, device=prompt.device)
    v_k = _scramble(v)  # the last block's word, the same for every row
    lanes = []
    for lane_seed in LANE_SEEDS:
        h = torch.full_like(prompt, lane_seed, dtype=torch.long)
        for k in words:
            h = _block(h, k)
        h = _rotl(h[:, None] ^ v_k[None, :], 13)
        h = (_mul32(h, 5) + N_ADD) & MASK32
        lanes.append(_finish(h, 4 * WORDS))
    m = ((lanes[0] >> 12) << 32) | lanes[1]  # 52 bits
    return (2 * m + 1).to(torch.float64) * TWO_M53


def exponentials(seed, prompt: torch.Tensor, sample: torch.Tensor, token: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """[B, vocab] float64 Exp(1) variates -log(u), finite and positive."""
    return -torch.log(uniform(seed, prompt, sample, token, vocab))
