"""Tile, launch and split-K choices of the Triton `paged_decode` kernel, from shapes only, and
its tuning knobs (`tuning`). The reasoning and measurements behind them: the module docstring of
`torch_ops.kernels.triton.paged_decode`."""

from __future__ import annotations

import dataclasses
import functools

from ...quant import KVFormat
from . import cdiv, pow2
from .tuning import Knobs


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernel's tuning knobs, read when a launch is prepared (`tuning`)."""

    num_splits: int | None = None      # a fixed split count (tests force split-K with it)
    min_split_tokens: int = 64         # a split covers at least this many keys (rounded to BLOCK_N)
    max_splits: int = 256              # B = 1 over 1-2 KV heads takes 128-256 (a cap of 64: 1.2-2.3x slower
                                       # at 16k-32k keys); 384 and 512 run 2-4x slower (one-tile merge)
    merge_tile: int = 4096             # partial values per merge program (more splits: fewer dims each)
    replica_min_keys: int = 512        # quantized one-warp programs score 2 tiles side by side from
                                       # this many keys per split (`config`)
    programs_per_sm: int | None = None   # resident programs per SM for the split heuristic (None: the config's)
    config: dict | None = None         # a `config` dict for every call (replicas, rows32 default off)
    dequant_asm: bool | None = None    # None: PTX dequantization on CUDA, plain Triton otherwise
    # Short contexts on the large tiles (<= 16 query rows, a table of at most `keys` keys): one split
    # instead of two splits and their merge; at D = 128 in 8-warp programs of 7 stages. block_d (the
    # head dim rounded up to a power of two: D = 80 and 96 follow D = 128, unmeasured) -> (keys, config
    # changes). H200, 16-token pages: D = 128 B = 4 32/32 ctx 512 18.3 -> 15.7 us, B = 16 32/8 18.7 -> 16.3,
    # at 1k within 0.3 us, at 2k 42.3 -> 47.6; D = 64 B = 4 32/32 ctx 512 13.1 -> 9.9, ctx 1k 16.4 -> 15.0,
    # B = 16 32/8 ctx 1k 17.0 -> 16.0 (two splits still win at 2k: 24.8 against 26.4).
    short_context: dict = dataclasses.field(
        default_factory=lambda: {128: (512, {"num_warps": 8, "num_stages": 7}), 64: (1024, {})})
    # Quantized formats on grids of at least one program per SM: tables of at most this many keys
    # take one split (no merge launch). H200, 32/8 heads, D = 128, ctx 256, B = 32 / 64: FP8 16.3 ->
    # 15.4 / 19.7 -> 18.0 us, INT8 19.1 -> 17.4 / 23.4 -> 20.1, INT4 15.4 -> 14.1 / 19.4 -> 16.6; at
    # 512 keys and B = 32 two splits still win (FP8 20.6 against 26.5 us).
    quantized_one_split_keys: int = 256


tuning = Knobs(Tuning())   # `with paged_decode.tuning(num_splits=4): ...`; `tuning.current`: the knobs in force

INTERPRETER_SMS = 8   # the interpreter's stand-in: a small "GPU", so that the split heuristic still splits
ONE_PAGE_SPAN = 1 << 30   # the page size the kernels assume for single-page block tables

# split heuristic costs, in "tokens of one program's work"
SPLIT_FIXED_COST = 48                 # prologue/epilogue of one program
MERGE_COST = 96                       # the merge kernel's launch and its tail

# Large tiles of the plain format (block_d -> BLOCK_N; 70 KB of shared memory at 5 stages:
# 3 programs per SM) and the M tiles they are used up to.
LARGE_TILE_KEYS = {64: 128, 128: 64}
LARGE_TILE_PROGRAMS_PER_SM = 3
LARGE_TILE_MAX_BLOCK_M = 32


def config(head_dim: int, fmt: KVFormat, block_m: int, programs: int, sms: int) -> dict:
    """Tile and launch parameters from shapes (`programs` = B x Hkv x M tiles before any split):
    BLOCK_N (keys per tile), num_warps, num_stages, and `programs_per_sm` (resident programs per
    SM, for `split_count`; from the compiled registers and shared memory at D = 128, sm_90a).

    A stage holds one K and one V tile. Triton's pipeliner spends two stages on the block-table
    indirection, so `num_stages = 5` keeps two tiles of each program in flight (three buffers).
    `large_tile_splits` may double the plain format's tile."""
    if tuning.current.config:
        return dict(tuning.current.config)
    block_d = max(16, pow2(head_dim))
    one_warp = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 5, "programs_per_sm": 8}
    if fmt is KVFormat.PLAIN and block_d <= 128 and block_m <= 16 and 32 <= programs < sms // 2:
        # Few programs (B x Hkv = 32..65 on an H200): split-K makes the parallelism, and one-warp
        # programs of 16-key tiles (see below) split finer. Against 4-warp 32-key tiles (H200)
        # B = 1 at 32/32 and B = 4 at 32/8 and 64/8 run 1.00-1.15x (B = 1, ctx 1k, 32/32: 13.5 ->
        # 12.0 us); with fewer programs one warp each leaves too few bytes in flight (B = 1 at 32/4
        # 0.84-0.97x, ctx 32k 26.1 -> 31.1 us; at 32/8 0.89-0.94x below ctx 4k). From half the SMs
        # up, `large_tile_splits` takes over.
        return one_warp
    if fmt is KVFormat.PLAIN:
        # D = 128: 32 keys: 64-key tiles take 168 registers and 72 KB (3 programs per SM), and
        # 512 programs then run in 1.3 waves (H200, B=64, ctx 4k, 32/8 heads: 328 -> 249 us).
        # D <= 64: 64 keys (H200, 32/8 heads, D = 64: B=32 ctx 2k 45.6 -> 41.5 us, B=64 ctx 4k
        # 154 -> 132 us, B=128 ctx 2k 159 -> 149 us; B=1 and B=8 within 0.5-1 us).
        warps = 8 if block_m * block_d >= 64 * 256 else 4
        return {"BLOCK_N": 64 if block_d <= 64 else 32, "num_warps": warps, "num_stages": 5, "programs_per_sm": 4}
    if block_d <= 128 and block_m <= 16:
        # Quantized: one-warp programs of 16-key tiles. With 4 warps the warps of a program split
        # a tile's keys, so every tile paid cross-warp softmax reductions and a shared-memory
        # exchange of P (35 barriers per tile); one warp owns its rows and keys, and split-K
        # supplies the parallelism instead. 16-key tiles keep FP8 at 126 registers (32 keys: 254).
        # H200, 32/8 heads, ctx 4k, B = 256 / 64: 128-key 4-warp tiles -> 16-key 1-warp: FP8 701
        # -> 533 / 196 -> 162 us, INT8 966 -> 724 / 248 -> 197, INT4 761 -> 557 / 191 -> 147.
        # `programs_per_sm` 8 (16 splits more and is slower: INT8 B = 64 234 us).
        # `replicas`: with <= 8 query rows, the 16-row tile holds two copies of them, each copy
        # scoring its own 16-key tile, so one softmax step and one rescale of the accumulators
        # serve 32 keys (merged in the epilogue). H200, 32/8 heads, splits of >= 1k keys: FP8 B = 64 ctx 4k 160 -> 141 us, B = 16 ctx
        # 16k 162 -> 142, B = 256 535 -> 518; INT4 148 -> 137, 554 -> 503; INT8 1-4%; 32/32 heads
        # B = 128 within the 6-8% those points move between runs. Splits of 64-128 keys run 4-10%
        # slower (`prepare` keeps one tile below `Tuning.replica_min_keys` per split); four copies take 255
        # registers and spill.
        # `rows32` (FP8 only): single-page tiles as one base pointer and 32-bit row offsets, ~50
        # fewer instructions per 16 keys for +8-15 registers: FP8 B = 64 ctx 4k 147 -> 140 us
        # (R = 2), B = 16 ctx 1k 23.2 -> 21.3 (R = 1), but at one split and R = 1 the registers
        # cost occupancy (B = 256 ctx 256 41.7 -> 48.7; `prepare` leaves it out there, and where
        # replica tiles are clamped); INT8/INT4 gain no instructions and lose up to 8%.
        return dict(one_warp, replicas=2, rows32=fmt is KVFormat.FP8)
    if block_d <= 128:
        # 32-row tiles (several query tokens per sequence): one warp would spill, and 128-key
        # 4-warp tiles spill 76-228 bytes; two warps spill nothing (168-229 registers). H200,
        # B = 64, 4 tokens x 64/8 heads, ctx 4k: FP8 572 -> 363 us, INT8 936 -> 395, INT4
        # 1147 -> 342.
        return {"BLOCK_N": 32, "num_warps": 2, "num_stages": 5, "programs_per_sm": 4}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 5, "programs_per_sm": 2}   # D = 256


def large_tile_splits(programs: int, sms: int) -> int:
    """Split count for the plain format's large tiles (`LARGE_TILE_KEYS`), 0 where they do not
    pay. When the batch alone (`programs` = B x Hkv x M tiles) comes near filling the `sms`, a
    memory-bound SM streams the same bytes whether they come as a few long programs or many
    split ones, so splitting only adds the merge; larger tiles keep more bytes in flight per
    program instead. One split (two below one program per SM), as long as they fit one wave of
    `LARGE_TILE_PROGRAMS_PER_SM`. H200, 32/8 heads, 16-token pages and the static-cache layout:
    D = 64 B = 32 ctx 2k 41.8 -> 37.3 us
    (static cache 39.9 -> 36.1), B = 16 27.1 -> 24.8, B = 32 ctx 4k 73.8 -> 68.8; D = 128 B = 32
    ctx 2k 73.1 -> 68.2, B = 16 ctx 4k 73.8 -> 72.6. Fewer programs (long contexts at small
    batch) want many splits of small tiles; more than a wave (B = 64 at 8 KV heads) small tiles."""
    if programs < sms // 2:
        return 0
    splits = cdiv(sms, programs)
    return splits if programs * splits <= LARGE_TILE_PROGRAMS_PER_SM * sms else 0


def split_count(batch: int, num_kv_heads: int, m_tiles: int, max_blocks: int, block_size: int,
                block_n: int, group_rows: int, sms: int, programs_per_sm: int) -> int:
    """Split-K factor from shapes only (never from data: the grid is fixed under CUDA graphs).

    Models the time of the worst case (every sequence at the table's capacity) as
    waves x (keys per split + fixed cost) + the merge (kernel, plus each split's partial state,
    `2 * rows` key-equivalents of traffic), and picks the cheapest count."""
    knobs = tuning.current
    if knobs.num_splits is not None:
        return max(1, int(knobs.num_splits))
    return _cheapest_split_count(batch * num_kv_heads * m_tiles, max_blocks * block_size, block_n, group_rows,
                                 max(1, sms * programs_per_sm), knobs.min_split_tokens, knobs.max_splits, SPLIT_FIXED_COST,
                                 MERGE_COST)


@functools.lru_cache(maxsize=4096)
def _cheapest_split_count(programs: int, cap: int, block_n: int, group_rows: int, slots: int, min_tokens: int,
                          max_splits: int, fixed_cost: int, merge_cost: int) -> int:
    """`split_count`'s search (cached: it runs on every call, ~100 µs of Python at 256 splits)."""
    if programs == 0 or cap == 0:
        return 1
    min_split = max(block_n, cdiv(min_tokens, block_n) * block_n)
    best, best_cost = 1, None
    for s in range(1, max_splits + 1):
        per = max(min_split, cdiv(cdiv(cap, s), block_n) * block_n)
        if s > 1 and (s - 1) * per >= cap:
            continue                       # the last split would be empty: same as fewer splits
        waves = cdiv(programs * s, slots)
        cost = waves * (per + fixed_cost)
        if s > 1:
            cost += merge_cost + programs * s * 2 * group_rows / slots
        if best_cost is None or cost < best_cost * 0.97:
            best, best_cost = s, cost
    return best
