"""What runs where, and with which tiles: the token limits of the small and grouped paths, and each
kernel's tile config (rows per program, loads, warps), from the device's tuning file (`kernels/tuning.py`, sections
experts_small, experts_oss, experts_grouped; the H200's read from its sweeps, profiles/moe_sweep.py).
Plain Python: no Triton needed to read a plan."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import tuning
from ..triton import next_pow2

MAX_TOKENS = 16      # tokens per step the small-batch kernels take (the grouped ones run from `grouped_from`)
MAX_EXPERTS = 1024   # the router's logits of one row are held in registers for the top-k
MAX_CHUNK = 4096   # elements of a weight row one load covers; longer rows are read in static chunks


def _chunks(k: int, limit: int | None = None) -> tuple[int, int]:
    block = min(next_pow2(k), limit or MAX_CHUNK)
    return block, -(-k // block)


@dataclass(frozen=True)
class Config:
    """Rows per program tile and warps of each kernel (tuned per shape on the H200, `experts_config`)."""
    router_rows: int
    gate_up_rows: int
    down_rows: int
    warps: int = 4
    chunk: int | None = None   # elements of a weight row one load of gate/up and down covers (None: MAX_CHUNK)
    routed: bool = False       # the router kernel routes (its last program per row); gate/up reads the ids
    stacked: bool = False      # down: the k experts' tiles of a program as one load, one sum per chunk
    packed: bool = False       # routed: the top-k one reduction a round over packed keys, not a max and a min
    router_warps: int | None = None   # the router kernel's warps (None: warps)
    down_warps: int | None = None     # the down kernel's warps (None: warps)
    router_early: bool = False   # the router's weight rows (first chunk) loaded before its PDL wait
    down_early: bool = False     # stacked: down's routing and weight tiles loaded before its PDL wait

    def __post_init__(self):
        if self.chunk is not None and (self.chunk < 1 or self.chunk & (self.chunk - 1)):
            raise ValueError(f"Config(chunk={self.chunk}): a load covers a power of two of a row's elements "
                             "(e.g. 512, 1024, 4096), or None for MAX_CHUNK")
        for name in ("warps", "router_warps", "down_warps"):
            value = getattr(self, name)
            if value is not None and value not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"Config({name}={value}): a kernel runs a power of two of warps, 1 to 32"
                                 + ("" if name == "warps" else ", or None for `warps`"))
        if self.down_early and not (self.routed and self.stacked):
            raise ValueError("Config(down_early=True): down reads the routing before its PDL wait only where the "
                             "router kernel wrote it, two kernels back (routed=True), into its stacked tiles "
                             "(stacked=True); set both")
        if self.packed and not self.routed:
            raise ValueError("Config(packed=True): the packed top-k runs in the router kernel's routing; "
                             "set routed=True too")


def experts_config(hidden: int, intermediate: int, tokens: int = 1, tune: tuning.Tuning | None = None) -> Config:
    """The small kernels' Config at this shape, from the device's tuning (`tune`; None: the defaults), section
    experts_small: a sweep's row for this exact shape and token count where there is one ("shapes"), over the rule.
    The H200 file's rule: gate/up: 16K weight elements per program at one token (8 rows of 2048, 8 warps), 8K above it (4 rows,
    4 warps); down: 4K (4 rows of 1024); the router's whole rows, 4K per program. Above one token both read
    their rows 1024 elements a load (34.7 us a block against 36.6 with whole 2048-element rows). At one token
    the rows are routed once in the router kernel (`routed`), down reads its k experts as one load
    (`stacked`), and both read 256 elements a load (a warp's 32 x 8: each chunk's sum stays in a warp): 30.5 us
    a block against 35.0 for the same tiles unrouted at 1024 (profiles/h200/moe-sweep-39ace1a/); the top-k there
    one reduction a round over packed keys (`packed`): 30.42 us against 30.86 (moe-sweep-5260519/); and the router
    one row a program in one warp (its routing's reductions in shuffles), down half the rows in 4 warps (more
    programs an SM): 28.68 us against 30.44 (moe-sweep-79cb9d0/; rows longer than 4096 elements keep
    1024-element loads, their static chunks few). The fastest small-kernel
    configs of the H200 sweeps at Qwen3-30B-A3B's shapes (profiles/moe_sweep.py; tests/test_experts.py holds
    the H200 file to them); other shapes keep the elements per program of gate/up and down (the router's one row in one
    warp, and down's 4 warps, at one token everywhere). At one token the router's weight rows, and down's routing
    and weight tiles, load before their PDL wait (`router_early`, `down_early`: moe_sweep.py's "early" grid, a
    chain of blocks, times them)."""
    tune = tune or tuning.current()
    rule, one_token = tune["experts_small"], tune["experts_small"]["one_token"]
    kh, ki = _chunks(hidden)[0], _chunks(intermediate)[0]
    one = tokens == 1
    most = rule["max_rows"]
    base = Config(router_rows=max(1, min(most, rule["router_elements"] // kh)),
                  gate_up_rows=max(1, min(most, (one_token if one else rule)["gate_up_elements"] // kh)),
                  down_rows=max(1, min(most, rule["down_elements"] // ki)),
                  warps=one_token["wide_warps"] if one and kh >= one_token["wide_from"] else rule["warps"],
                  chunk=rule["chunk"])
    if one:
        flags = {name: one_token[name] for name in ("routed", "stacked", "packed", "router_early", "down_early")}
        base = replace(base, chunk=one_token["chunk" if max(kh, ki) <= one_token["short_max"] else "long_chunk"],
                       router_rows=one_token["router_rows"], router_warps=one_token["router_warps"],
                       down_rows=max(1, base.down_rows // one_token["down_rows_divisor"]),
                       down_warps=one_token["down_warps"], **flags)
    exact = tune.pick("experts_small", "shapes", hidden=hidden, intermediate=intermediate, tokens=tokens)
    return replace(base, **exact) if exact else base


@dataclass(frozen=True)
class OssConfig:
    """gpt-oss's gate/up and down kernels: output columns per program (gate/up: intermediate columns, each
    a gate and an up column), the reduction rows each step of the loop reads, warps. gpt-oss-20b at one token
    has ~360 programs of each (2.7 per H200 multiprocessor), each reading 64 or 128 contiguous bytes per
    weight row and 8K-element tiles: the fastest of the H200 sweep at one token (moe-sweep-0f91d78; from
    `grouped_from` tokens the grouped kernels run). Routing the rows in the router kernel (as `Config.routed`) was
    no faster here: 64.50 against 62.96 us a block at these tiles, the fastest of 108 configs
    (profiles/h200/moe-sweep-a7748ba/, one block captured at one token), and was removed. The values: the device's
    tuning (`oss_config`)."""
    gate_up_cols: int
    down_cols: int
    block_k: int
    warps: int


def oss_config(tune: tuning.Tuning | None = None) -> OssConfig:
    """gpt-oss's tiles from the device's tuning (`tune`; None: the defaults), section experts_oss."""
    section = (tune or tuning.current())["experts_oss"]
    return OssConfig(**{name: section[name] for name in ("gate_up_cols", "down_cols", "block_k", "warps")})


COMBINE_COLS = 256   # output columns per program of gpt-oss's combine (its sums read 4 float32 rows)

MAX_GROUPED_TOKENS = 64
ALIGN_ELEMENTS = 4096   # (expert, pair) comparisons an align program holds at a time: [BLOCK_E, 4096 // BLOCK_E]
ALIGN_TAIL = 1024        # slots the align kernel's tail program fills with -1 at a time
GROUPED_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")   # no shared expert (gpt-oss: its own layout)


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int      # sorted (token, expert) slots per tile: rows of each tl.dot
    block_n: int      # output columns per program
    block_k: int      # reduction step
    warps: int = 4
    stages: int = 2


# The grouped tiles: one table, by the largest token count each row covers (the device's tuning, experts_grouped.tiles):
# in the H200 file, per batch of the H200 sweeps (qwen3-30b-a3b at 1, 2, 4, ..., 64 tokens, gpt-oss-20b at 1, 4, 16,
# 32, 64), the config whose worst time over the models swept there is nearest their fastest (profiles/moe_sweep.py
# `steadiest`; tests/test_experts.py holds the H200 file to the sweeps its provenance names). Every config in them
# was checked against the torch reference on the H200 (column `ok`).
# Tokens per step from which the grouped kernels run (families without a shared expert; the others keep the small
# kernels up to MAX_TOKENS): one past the largest swept batch where the small kernels won (`moe_sweep.grouped_from`),
# each against the kernels it replaces: experts_grouped.from_tokens the small kernels' (qwen3-30b-a3b's sweep),
# experts_oss.grouped_from gpt-oss's own kernels' (gpt-oss-20b's). One number for both ran gpt-oss-20b's blocks at 4
# tokens 21% slower on the H100 (its kernels 241 against the grouped 199 us a block, where Qwen3's small ones won at 4,
# 108 against 113: profiles/h100/moe-sweep-1bc10cb/). On the H200 the grouped kernels won at every batch from 2
# (qwen3-30b-a3b: 50 against 57 us a block at 2 tokens, 207 against 328 at 16; gpt-oss-20b: 142 against 190 at 4); at 1
# gpt-oss-20b's small kernels won by 0.3% (62.7 against 62.9 us; qwen3-30b-a3b's grouped ones by 6%, 34.5 against 36.7).
# The fast forward's MoE layers (<= 4 rows) keep the small kernels, which take the layer's norm and residual.
# (The grouped path's routing in the router kernel, no route kernel, was no faster: 36.6 against 35.9 us a block at 1
# token, 51.4 against 51.1 at 2, profiles/h200/moe-sweep-39ace1a/ variant "grouped-routed"; removed.)


def grouped_from(tune: tuning.Tuning | None = None, oss: bool = False) -> int:
    """Tokens per step from which the grouped kernels run (the device's tuning; None: the defaults): in place of the
    small kernels, or (oss) of gpt-oss's."""
    tune = tune or tuning.current()
    return tune["experts_oss"]["grouped_from"] if oss else tune["experts_grouped"]["from_tokens"]


def runs_grouped(family: str, tokens: int, tune: tuning.Tuning | None = None) -> bool:
    """Whether a block of `family` at `tokens` rows runs the grouped kernels (else the small ones, or gpt-oss's)."""
    return family in GROUPED_FAMILIES and tokens >= grouped_from(tune, oss=family == "gpt_oss")


def grouped_config(tokens: int, tune: tuning.Tuning | None = None, itemsize: int = 2) -> GroupedConfig:
    """The grouped kernels' tiles at `tokens` rows: the first row of the tuning's experts_grouped.tiles covering it.
    The tiles are swept in bf16; for operands of `itemsize` bytes more than 2 (float32) the reduction step shrinks
    in proportion, so that a pipeline stage holds the bytes it holds in bf16 (on an H100, float32 operands in the
    widest bf16 tile asked for 272 KB of shared memory, past its 227 KB)."""
    cfg = GroupedConfig(**(tune or tuning.current()).pick("experts_grouped", "tiles", tokens=tokens))
    if itemsize > 2:
        cfg = replace(cfg, block_k=max(16, cfg.block_k * 2 // itemsize))
    return cfg


def grouped_slots(pairs: int, experts: int, block_m: int) -> int:
    """Slots of the sorted buffer in the worst case: every pair, plus a partly filled tile per expert that
    can appear; a multiple of block_m."""
    worst = pairs + min(experts, pairs) * (block_m - 1)
    return -(-worst // block_m) * block_m
