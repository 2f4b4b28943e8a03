"""Tile and launch parameters of the Triton prefill kernel (`prefill_attention.py`): the tiles per
head dim and call class (`config`), the smaller ones tried when a tile does not fit the GPU
(`_smaller`), the split of a head dim into two power-of-two parts (`split_dims`), and the knobs
tests and tuning runs override (`tuning`)."""

from __future__ import annotations

import dataclasses

import torch

from . import pow2
from .tuning import Knobs


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernel family's tuning knobs, read when a launch is prepared (`tuning`)."""

    config: dict | None = None   # a `config` for every call: {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}


tuning = Knobs(Tuning())   # `with prefill_attention.tuning(config={...}): ...`


def split_dims(head_dim: int) -> int:
    """The first part's width where a head dim that is no power of two is the sum of two (192 =
    128 + 64, 96 = 64 + 32, 80 = 64 + 16): its scores then take one dot per part, with no padded
    dims (`_attend_tile`). 0: one dot over the head dim padded to a power of two."""
    lo = pow2(head_dim) // 2
    rest = head_dim - lo
    return lo if pow2(head_dim) != head_dim and rest >= 16 and rest & (rest - 1) == 0 else 0


def config(head_dim: int, dtype: torch.dtype, causal: bool, paged: bool = False,
           rows_per_seq: int | None = None, group_scaled: bool = False) -> dict:
    """Tile and launch parameters: BLOCK_M (query rows), BLOCK_N (keys), num_warps, num_stages.

    Starting points from FlashAttention-2's forward tiles (128 x 128 for D <= 64 non-causal,
    128 x 64 for D = 128, 128 x 64 with 8 warps for D = 256), checked by compiling for sm_90a
    (ptxas, no GPU): every default uses wgmma, pipelines K/V with cp.async, fits 200 KB of shared
    memory (H100: 227 KB) and spills at most a few dozen bytes (D = 256 with every feature on).
    8 warps = two warpgroups of 64 rows. `causal` keeps D <= 64 at 64-key tiles (less waste on
    the diagonal); `paged` takes 128-key tiles at D <= 128 (measured), with 5 stages at D <= 64
    so that the K/V loads behind the block-table load are double-buffered;
    `group_scaled` (INT8/INT4 caches, whose gathered scale tiles are staged in shared memory too)
    halves BLOCK_N at D = 256 (256 KB -> 160 KB). fp32 inputs take FMA ("ieee") dots, which spill
    beyond 16 x 16 tiles. `rows_per_seq` (query rows per sequence from shapes: ceil(T / B) x query
    heads per KV head) shrinks BLOCK_M for decode-heavy batches. Measured on a GPU: the paged
    tiles at D = 64 and 128; `benchmarks/bench_prefill.py --tune` sweeps the alternatives."""
    if tuning.current.config:
        return dict(tuning.current.config)
    block_d = max(16, pow2(head_dim))
    if dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
    if block_d <= 64:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64 if causal else 128, "num_warps": 8, "num_stages": 3}
    elif block_d <= 128:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    if paged and block_d <= 128:
        # 128-key tiles over a paged cache. Triton's pipeliner spends stages on the block-table
        # load the K/V addresses depend on: the K/V tiles are single-buffered below 5 stages
        # (TTGIR, sm_90a), double-buffered from 5. H200, 4 x 2048 causal queries on 8k cached
        # keys, GQA 32/8, 16-token pages:
        # D = 128 309 -> 379-382 TFLOP/s at 3 stages (5 stages: 255 registers, 370);
        # D = 64 201 -> 300 at 5 stages.
        cfg.update(BLOCK_N=128, num_stages=3 if block_d == 128 else 5)
    if group_scaled and block_d > 128:
        cfg["BLOCK_N"] = 32
    if rows_per_seq is not None and rows_per_seq < cfg["BLOCK_M"]:
        cfg["BLOCK_M"] = max(16, pow2(rows_per_seq))
        cfg["num_warps"] = 4
    return cfg


def _smaller(cfg: dict) -> dict | None:
    """The next config to try when `cfg` does not fit the GPU (same BLOCK_M: same grid)."""
    if cfg["num_stages"] > 2:
        return {**cfg, "num_stages": cfg["num_stages"] - 1}
    if cfg["BLOCK_N"] > 16:
        return {**cfg, "BLOCK_N": cfg["BLOCK_N"] // 2}
    return None
