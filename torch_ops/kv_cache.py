"""Paged KV caches: physical layouts seen as logical views, allocation and random filling, and the
host-side block allocator and per-sequence block tables.

Every cache tensor is seen through the logical shape `[num_blocks, block_size, Hkv, D]` (last dim
`D / 2` for packed INT4) with arbitrary block/token/head strides; see `docs/ops.md` ("KV cache").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from torch_ops import quant

LAYOUTS = ("NHD", "HND", "combined_NHD", "combined_HND", "vllm")
SCALE_CACHE_DTYPES = (torch.float16, torch.float32)
MAX_BLOCK_SIZE = 256


# ---------------------------------------------------------------------------------------------
# Views of users' tensors
# ---------------------------------------------------------------------------------------------


def _check_ndim(name: str, x: torch.Tensor, ndim: int, expected: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")


def from_hnd(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HND tensors `[num_blocks, Hkv, block_size, D]` -> logical views
    `[num_blocks, block_size, Hkv, D]`."""
    _check_ndim("k", k, 4, "[num_blocks, Hkv, block_size, D]")
    _check_ndim("v", v, 4, "[num_blocks, Hkv, block_size, D]")
    return k.transpose(1, 2), v.transpose(1, 2)


def from_combined(kv: torch.Tensor, layout: str = "NHD") -> tuple[torch.Tensor, torch.Tensor]:
    """One K/V tensor `[num_blocks, 2, block_size, Hkv, D]` (layout "NHD", FlashInfer) or
    `[num_blocks, 2, Hkv, block_size, D]` ("HND", TRT-LLM) -> logical `(k, v)` views."""
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    inner = "block_size, Hkv" if layout == "NHD" else "Hkv, block_size"
    _check_ndim("kv", kv, 5, f"[num_blocks, 2, {inner}, D]")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_blocks, 2, {inner}, D], got shape {tuple(kv.shape)}")
    k, v = kv[:, 0], kv[:, 1]
    return (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))


def from_vllm(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `[2, num_blocks, block_size, Hkv, D]` -> logical `(k, v)` views."""
    expected = "[2, num_blocks, block_size, Hkv, D]"
    _check_ndim("kv", kv, 5, expected)
    if kv.shape[0] != 2:
        raise ValueError(f"kv must be {expected}, got shape {tuple(kv.shape)}")
    return kv[0], kv[1]


def _check_fp8_scale(name: str, scale: torch.Tensor, num_kv_heads: int) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a float32 tensor for an FP8 cache, got {got}")
    if scale.dim() != 0 and tuple(scale.shape) != (num_kv_heads,):
        raise ValueError(
            f"{name} must be 0-d or [Hkv={num_kv_heads}] for an FP8 cache, "
            f"got shape {tuple(scale.shape)}"
        )


def _empty_pair(layout: str, nb: int, bs: int, h: int, last: int, dtype, device):
    """Storage in the physical `layout`, returned as logical `(k, v)` views `[nb, bs, h, last]`."""
    if layout == "NHD":
        return (torch.empty(nb, bs, h, last, dtype=dtype, device=device),
                torch.empty(nb, bs, h, last, dtype=dtype, device=device))
    if layout == "HND":
        return from_hnd(torch.empty(nb, h, bs, last, dtype=dtype, device=device),
                        torch.empty(nb, h, bs, last, dtype=dtype, device=device))
    if layout == "combined_NHD":
        return from_combined(torch.empty(nb, 2, bs, h, last, dtype=dtype, device=device), "NHD")
    if layout == "combined_HND":
        return from_combined(torch.empty(nb, 2, h, bs, last, dtype=dtype, device=device), "HND")
    return from_vllm(torch.empty(2, nb, bs, h, last, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


@dataclass
class PagedKVCache:
    """K and V caches of one layer with their scales.

    `k`, `v`: logical `[num_blocks, block_size, Hkv, D]` (uint8 `[..., D / 2]` for packed INT4),
    any strides, last dim contiguous. `k_scale`, `v_scale`: None (plain), fp32 0-d or `[Hkv]`
    (FP8), or scale caches `[num_blocks, block_size, Hkv, D // quant_group]` fp16/fp32 (INT8/INT4).
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_ndim("k", self.k, 4, "[num_blocks, block_size, Hkv, D]")
        _check_ndim("v", self.v, 4, "[num_blocks, block_size, Hkv, D]")
        if self.v.shape != self.k.shape or self.v.dtype != self.k.dtype:
            raise ValueError(
                f"v must match k: k is {tuple(self.k.shape)} {self.k.dtype}, "
                f"v is {tuple(self.v.shape)} {self.v.dtype}"
            )
        if self.v.device != self.k.device:
            raise ValueError(f"v must be on k's device {self.k.device}, got {self.v.device}")
        for name, x in (("k", self.k), ("v", self.v)):
            if x.stride(-1) != 1 and x.shape[-1] > 1:
                raise ValueError(f"{name} must have a contiguous last dim, got strides {x.stride()}")
        fmt = self.format  # raises TypeError on an unsupported dtype
        for name in ("k_scale", "v_scale"):
            scale = getattr(self, name)
            if fmt is quant.KVFormat.PLAIN:
                if scale is not None:
                    raise ValueError(f"{name} must be None for a {self.k.dtype} cache")
            elif scale is None:
                raise ValueError(f"a {fmt.value} cache ({self.k.dtype}) needs {name}")
            elif scale.device != self.k.device:
                raise ValueError(
                    f"{name} must be on the cache's device {self.k.device}, got {scale.device}"
                )
            elif fmt is quant.KVFormat.FP8:
                _check_fp8_scale(name, scale, self.num_kv_heads)
            else:
                self._check_scale_cache(name, scale)
        if fmt.group_scaled and (self.k_scale.shape, self.k_scale.dtype) != (
            self.v_scale.shape, self.v_scale.dtype
        ):
            raise ValueError(
                "k_scale and v_scale must have the same shape and dtype, got "
                f"{tuple(self.k_scale.shape)} {self.k_scale.dtype} and "
                f"{tuple(self.v_scale.shape)} {self.v_scale.dtype}"
            )

    def _check_scale_cache(self, name: str, scale: torch.Tensor) -> None:
        if scale.dtype not in SCALE_CACHE_DTYPES:
            raise TypeError(f"{name} must be float16 or float32, got {scale.dtype}")
        expected = f"[{self.num_blocks}, {self.block_size}, {self.num_kv_heads}, D // quant_group]"
        if scale.dim() != 4 or scale.shape[:3] != self.k.shape[:3]:
            raise ValueError(f"{name} must be {expected}, got shape {tuple(scale.shape)}")
        if scale.shape[-1] == 0 or self.head_dim % scale.shape[-1]:
            raise ValueError(
                f"{name} must be {expected} with a last dim dividing head_dim {self.head_dim}, "
                f"got shape {tuple(scale.shape)}"
            )
        if scale.stride(-1) != 1 and scale.shape[-1] > 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {scale.stride()}")

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        """Logical D (twice the stored last dim for packed INT4)."""
        return self.k.shape[3] * (2 if self.format is quant.KVFormat.INT4 else 1)

    @property
    def format(self) -> quant.KVFormat:
        return quant.kv_format(self.k.dtype)

    @property
    def quant_group(self) -> int:
        """Elements per scale for INT8/INT4, else 0."""
        return self.head_dim // self.k_scale.shape[-1] if self.format.group_scaled else 0

    def scale_kwargs(self) -> dict[str, torch.Tensor | None]:
        """`{"k_scale": ..., "v_scale": ...}`, to splat into the ops."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `(k, v)`, each `[num_blocks, block_size, Hkv, D]` (new tensors)."""
        return (quant.dequantize(self.k, self.k_scale, self.format),
                quant.dequantize(self.v, self.v_scale, self.format))

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        layout: str = "NHD",
        quant_group: int | None = None,
        scale_dtype: torch.dtype = torch.float32,
        fp8_scale: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> PagedKVCache:
        """An uninitialized cache (`torch.empty`; fill it, e.g. with `random_`).

        `dtype` is the storage dtype: fp16/bf16/fp32, float8_e4m3fn/e5m2, int8 (INT8) or uint8
        (packed INT4). INT8/INT4 need `quant_group` (dividing `head_dim`) and get scale caches of
        `scale_dtype` in the same layout. FP8 scales are copies of `fp8_scale` (0-d or `[Hkv]`
        fp32; default 1.0), one tensor for k and one for v. `layout` is the physical layout of
        one storage: "NHD" `[nb, bs, H, D]` (k and v separate), "HND" `[nb, H, bs, D]`,
        "combined_NHD" `[nb, 2, bs, H, D]`, "combined_HND" `[nb, 2, H, bs, D]`, "vllm"
        `[2, nb, bs, H, D]`.
        """
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be an int in 1..{MAX_BLOCK_SIZE}, got {block_size!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        fmt = quant.kv_format(dtype)
        if fmt.group_scaled != (quant_group is not None):
            need = "needs" if fmt.group_scaled else "takes no"
            raise ValueError(f"a {dtype} cache {need} quant_group, got {quant_group!r}")
        if fmt is quant.KVFormat.INT4 and head_dim % 2:
            raise ValueError(f"head_dim must be even for a packed INT4 cache, got {head_dim}")
        if fp8_scale is not None and fmt is not quant.KVFormat.FP8:
            raise ValueError(f"fp8_scale is only for FP8 caches, got a {dtype} cache")

        last = head_dim // 2 if fmt is quant.KVFormat.INT4 else head_dim
        k, v = _empty_pair(layout, num_blocks, block_size, num_kv_heads, last, dtype, device)
        k_scale = v_scale = None
        if fmt is quant.KVFormat.FP8:
            if fp8_scale is None:
                fp8_scale = torch.ones((), dtype=torch.float32)
            _check_fp8_scale("fp8_scale", fp8_scale, num_kv_heads)
            k_scale = fp8_scale.to(k.device, copy=True)
            v_scale = fp8_scale.to(k.device, copy=True)
        elif fmt.group_scaled:
            if not isinstance(quant_group, int) or quant_group <= 0 or head_dim % quant_group:
                raise ValueError(f"quant_group must divide head_dim {head_dim}, got {quant_group!r}")
            if scale_dtype not in SCALE_CACHE_DTYPES:
                raise TypeError(f"scale_dtype must be float16 or float32, got {scale_dtype}")
            k_scale, v_scale = _empty_pair(layout, num_blocks, block_size, num_kv_heads,
                                           head_dim // quant_group, scale_dtype, device)
        return cls(k, v, k_scale, v_scale)


@torch.no_grad()
def random_(cache: PagedKVCache, generator: torch.Generator | None = None) -> PagedKVCache:
    """Fill `cache` in place with random normal values, quantized to its format; returns it.

    Each KV head gets its own standard deviation in [0.5, 2), so per-head scale bugs show.
    INT8/INT4 scale caches get the group scales; FP8 scales are overwritten in place with
    calibrated ones (absmax / fp8 max, per head when `[Hkv]`), so the full FP8 range is used.
    Values are drawn on the generator's device (the cache's device without one).
    """
    fmt = cache.format
    if fmt is quant.KVFormat.FP8 and cache.k_scale.data_ptr() == cache.v_scale.data_ptr():
        raise ValueError("random_ calibrates k_scale and v_scale separately: they must not "
                         "share memory")
    shape = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
    gen_device = generator.device if generator is not None else cache.k.device
    for x, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        head_std = torch.empty(cache.num_kv_heads, device=gen_device)
        head_std.uniform_(0.5, 2.0, generator=generator)
        values = torch.randn(shape, generator=generator, device=gen_device) * head_std[:, None]
        values = values.to(x.device)
        if fmt is quant.KVFormat.FP8:
            absmax = values.abs().amax(dim=(0, 1, 3)) if scale.dim() else values.abs().amax()
            scale.copy_(absmax / quant.fp8_max(x.dtype))
        scale_dtype = scale.dtype if fmt.group_scaled else torch.float32
        stored, group_scales = quant.quantize(values, scale, x.dtype, cache.quant_group, scale_dtype)
        x.copy_(stored)
        if group_scales is not None:
            scale.copy_(group_scales)
    return cache


# ---------------------------------------------------------------------------------------------
# Host-side block management
# ---------------------------------------------------------------------------------------------


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks in a `BlockAllocator`."""


class BlockAllocator:
    """Block ids `0..num_blocks-1`: a free stack and reference counts `refcounts
    [num_blocks]` (host numpy arrays, read-only outside this class, so that a serving step
    allocates for a whole batch at once: `take`)."""

    def __init__(self, num_blocks: int, reclaim: Callable[[int], None] | None = None):
        """`reclaim(n)`, if given, is asked to free up to `n` more blocks (e.g. by evicting a
        prefix cache's blocks) when an allocation finds too few free."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.reclaim = reclaim
        # The free ids are _free[:num_free]; the top of the stack is handed out first (low ids).
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_free = num_blocks
        self.refcounts = np.zeros(num_blocks, dtype=np.int32)
        self._num_refs = 0  # refcounts.sum()

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_shared_refs(self) -> int:
        """References beyond the first of each allocated block (0: no block is shared)."""
        return self._num_refs - (self.num_blocks - self._num_free)

    def take(self, n: int) -> np.ndarray:
        """`n` free blocks `[n]` int32 with refcount 1; all or nothing (`OutOfBlocksError`)."""
        if n > self._num_free and self.reclaim is not None:
            self.reclaim(n - self._num_free)
        top = self._num_free
        if n > top:
            raise OutOfBlocksError(f"cannot allocate {n} blocks: {top} of {self.num_blocks} are free")
        blocks = self._free[top - n:top][::-1].copy()
        self._num_free = top - n
        self.refcounts[blocks] = 1
        self._num_refs += n
        return blocks

    def allocate(self, n: int) -> list[int]:
        """`take` as a list of ints."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        return self.take(n).tolist()

    def free(self, blocks) -> None:
        """Decrement each block's refcount; blocks reaching 0 return to the pool (in the order
        of their last occurrence in `blocks`). Freeing a block more times than it is referenced
        raises `ValueError` and changes nothing."""
        ids = self._ids(blocks)
        unique, first, counts = np.unique(ids[::-1], return_index=True, return_counts=True)
        bad = self.refcounts[unique] < counts
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(
                f"block {int(unique[b])} freed {int(counts[b])} time(s) but its refcount is "
                f"{int(self.refcounts[unique[b]])} (double free?)"
            )
        self.refcounts[unique] -= counts.astype(np.int32)
        self._num_refs -= len(ids)
        zero = self.refcounts[unique] == 0
        last = len(ids) - 1 - first[zero]  # where each released block last occurs in `blocks`
        released = unique[zero][np.argsort(last)]
        self._free[self._num_free:self._num_free + len(released)] = released
        self._num_free += len(released)

    def share(self, blocks) -> None:
        """Increment the refcount of allocated blocks (another sequence now uses them)."""
        ids = self._ids(blocks)
        unallocated = self.refcounts[ids] == 0
        if unallocated.any():
            raise ValueError(f"block {int(ids[np.argmax(unallocated)])} is not allocated, "
                             "cannot share it")
        np.add.at(self.refcounts, ids, 1)
        self._num_refs += len(ids)

    def refcount(self, block: int) -> int:
        if not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in 0..{self.num_blocks - 1}, got {block!r}")
        return int(self.refcounts[block])

    def _ids(self, blocks) -> np.ndarray:
        """`blocks` (ints) as an intp array, each checked to be a block id."""
        ids = np.asarray(blocks, dtype=np.intp).reshape(-1)
        out = (ids < 0) | (ids >= self.num_blocks)
        if out.any():
            raise ValueError(f"block must be an int in 0..{self.num_blocks - 1}, "
                             f"got {int(ids[np.argmax(out)])}")
        return ids


class BlockTables:
    """Per-sequence block tables over a `BlockAllocator`. Token `p` of a sequence sits in slot
    `table[p // block_size] * block_size + p % block_size`.

    Blocks may be shared between sequences (`fork`, prefix caching). Writes are copy-on-write: a
    shared block about to receive new tokens is replaced in the writer's table by a fresh block,
    and the pair `(src, dst)` is queued; the owner of the device caches must copy those blocks
    (`take_copies`) before the next cache write.

    Storage is one row per sequence of host numpy arrays, so that a step's metadata gathers a
    batch with a few vectorized reads (`rows`, then `array[rows]`, `lens[rows]`, ...): `array
    [rows, cols]` int32 block ids, 0 past each sequence's blocks; `num_blocks [rows]`; `lens
    [rows]` tokens in the table; `offsets [rows]` tokens dropped before its first block
    (`drop_blocks`). Rows are reused after `free`; both dimensions double when full, so keep
    no views of these arrays across calls that add sequences or blocks.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = allocator
        self.block_size = block_size
        self.array = np.zeros((8, 8), dtype=np.int32)
        self.num_blocks = np.zeros(8, dtype=np.int64)
        self.lens = np.zeros(8, dtype=np.int64)
        self.offsets = np.zeros(8, dtype=np.int64)
        self._rows: dict = {}
        self._free_rows = list(range(7, -1, -1))  # pop() hands out low rows first
        # The last list of ids `rows` looked up and its answer, until a sequence is freed; the
        # last answer of `rows` whose ids `append_batch` found distinct.
        self._last_lookup: tuple[list, np.ndarray] | None = None
        self._distinct_rows: np.ndarray | None = None
        self._copies: list[tuple[int, int]] = []

    def _row(self, seq_id) -> int:
        if seq_id not in self._rows:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return self._rows[seq_id]

    def rows(self, seq_ids) -> np.ndarray:
        """Row index of each sequence in `seq_ids` (the batch order), `[B]` intp, read-only.
        Asked again for an equal list with no sequence freed in between (steady decode steps),
        it returns the same array without looking the ids up."""
        is_list = type(seq_ids) is list
        if is_list and self._last_lookup is not None and self._last_lookup[0] == seq_ids:
            return self._last_lookup[1]
        try:
            rows = np.fromiter(map(self._rows.__getitem__, seq_ids), dtype=np.intp,
                               count=len(seq_ids))
        except KeyError as e:
            raise KeyError(f"unknown sequence {e.args[0]!r}") from None
        rows.flags.writeable = False
        if is_list:
            self._last_lookup = (list(seq_ids), rows)  # a copy: the caller may change its list
        return rows

    def issued(self, rows: np.ndarray) -> bool:
        """Whether `rows` is the array `rows` last returned, with no sequence freed since:
        then it holds rows of live sequences, which callers need not check again."""
        return self._last_lookup is not None and rows is self._last_lookup[1]

    def _new_row(self, seq_id) -> int:
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if not self._free_rows:
            n = len(self.lens)
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            for name in ("num_blocks", "lens", "offsets"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, np.int64)]))
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self._free_rows.pop()
        self._rows[seq_id] = row
        return row

    def _set_blocks(self, row: int, start: int, blocks: list[int]) -> None:
        """Write `blocks` at columns `start..` of `row` (its block count becomes their end)."""
        end = start + len(blocks)
        self._fit_columns(end)
        self.array[row, start:end] = blocks
        self.num_blocks[row] = end

    def reserve_columns(self, n: int) -> None:
        """Make `array` at least `n` columns wide now, exactly `n` if it grows: a metadata
        builder whose `max_blocks_per_seq` is the width copies rows as they are
        (`MetadataBuilder.build_from_tables`). A table that outgrows it doubles it."""
        if n > self.array.shape[1]:
            self.array = np.pad(self.array, ((0, 0), (0, n - self.array.shape[1])))

    def _fit_columns(self, n: int) -> None:
        if n > self.array.shape[1]:
            self.reserve_columns(max(n, 2 * self.array.shape[1]))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def _check_count(name: str, n) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")

    def add(self, seq_id, num_tokens: int, shared_blocks: list[int] = ()) -> list[int]:
        """A new sequence of `num_tokens` tokens; returns their slots. Its table starts with
        `shared_blocks` (full blocks already holding its first tokens, e.g. a cached prefix;
        their refcount + 1), then fresh blocks."""
        if seq_id in self._rows:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._check_count("num_tokens", num_tokens)
        shared = list(shared_blocks)
        if len(shared) * self.block_size > num_tokens:
            raise ValueError(
                f"{len(shared)} shared blocks hold more than the sequence's {num_tokens} tokens"
            )
        fresh = self.allocator.allocate(self._blocks_for(num_tokens) - len(shared))
        self.allocator.share(shared)
        row = self._new_row(seq_id)
        self._set_blocks(row, 0, shared + fresh)
        self.lens[row] = num_tokens
        self.offsets[row] = 0
        return self.slots(seq_id, 0, num_tokens)

    def append(self, seq_id, num_tokens: int = 1) -> list[int]:
        """Grow a sequence by `num_tokens` (`append_batch` of one); returns the new tokens'
        slots. On `OutOfBlocksError` the sequence is unchanged."""
        self._check_count("num_tokens", num_tokens)
        start = self.seq_len(seq_id)
        self.append_batch([seq_id], [num_tokens])
        return self.slots(seq_id, start, num_tokens)

    def append_batch(self, seq_ids, num_tokens) -> np.ndarray:
        """Grow sequence `seq_ids[i]` (distinct) by `num_tokens[i]` tokens: new blocks past
        each one's last block, and a copy of its last block first when that block is shared
        and receives tokens (copy-on-write). The blocks and copies are those of `append` called
        for each sequence in order, but all are allocated at once: on `OutOfBlocksError`
        nothing changes. Returns the sequences' rows `[B]` (as `rows(seq_ids)`)."""
        rows = self.rows(seq_ids)
        counts = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
        if counts.shape != rows.shape or counts.min(initial=0) < 0:
            raise ValueError(f"num_tokens must hold {len(rows)} ints >= 0 (one per sequence), "
                             f"got {np.asarray(num_tokens).tolist()}")
        if rows is not self._distinct_rows:
            if len(rows) > 1 and np.bincount(rows).max() > 1:
                raise ValueError("seq_ids must be distinct")
            self._distinct_rows = rows
        bs = self.block_size
        start, have = self.lens[rows], self.num_blocks[rows]
        need = (start + counts + bs - 1) // bs - have  # new blocks at the end of each table
        copies, src = self._copies_on_write(rows, start, have, counts)
        extra = need
        if len(copies):
            extra = need.copy()
            extra[copies] += 1
        total = int(extra.sum())
        if total:  # most decode steps allocate nothing
            blocks = self.allocator.take(total)
            first = np.cumsum(extra) - extra  # each sequence's share of `blocks`: copy, then new
            if len(copies):
                dst = blocks[first[copies]]
                self.array[rows[copies], have[copies] - 1] = dst
                self._copies += zip(src.tolist(), dst.tolist())
                self.allocator.free(src)  # the copied blocks stay referenced by other sequences
                first[copies] += 1
            grow = np.flatnonzero(need)
            k = need[grow]
            seq = np.repeat(grow, k)
            nth = np.arange(len(seq)) - np.repeat(np.cumsum(k) - k, k)  # 0.. within a sequence
            self._fit_columns(int((have + need).max()))
            self.array[rows[seq], have[seq] + nth] = blocks[first[seq] + nth]
            self.num_blocks[rows] = have + need
        self.lens[rows] = start + counts
        return rows

    def _copies_on_write(self, rows, start, have, counts) -> tuple[np.ndarray, np.ndarray]:
        """Which sequences of `append_batch` copy their last block before writing into it, and
        that block: `(indices into rows, source blocks)`. A partly filled last block receives
        tokens; if shared, its k-th writer in the batch (k = 0, 1, ...) copies it while its
        refcount, less the k copies before, is above 1, as one-by-one appends would."""
        if not self.allocator.num_shared_refs:  # no block is shared: the common case, first
            return rows[:0], rows[:0]
        last = self.array[rows, have - 1]  # (any block of an empty table: filtered out below)
        shared = self.allocator.refcounts[last] > 1
        if not shared.any():  # (e.g. only the full blocks of a prefix cache are shared)
            return rows[:0], last[:0]
        writers = np.flatnonzero(shared & (counts > 0) & (start % self.block_size != 0))
        src = last[writers]
        order = np.argsort(src, kind="stable")
        sorted_src = src[order]
        group_start = np.flatnonzero(np.r_[True, sorted_src[1:] != sorted_src[:-1]])
        rank = np.empty(len(src), dtype=np.int64)
        rank[order] = np.arange(len(src)) - np.repeat(group_start, np.diff(np.r_[group_start, len(src)]))
        copy = rank < self.allocator.refcounts[src] - 1
        return writers[copy], src[copy]

    def make_writable(self, seq_id, block_indices) -> None:
        """Give the sequence its own copy of each shared block among `table[i]`, `i` in
        `block_indices` (before rewriting tokens in place), allocating all copies at once."""
        table = self.array[self._row(seq_id)]
        shared = [i for i in block_indices if self.allocator.refcount(int(table[i])) > 1]
        fresh = self.allocator.allocate(len(shared))
        for i, dst in zip(shared, fresh):
            src = int(table[i])
            self._copies.append((src, dst))
            self.allocator.free([src])
            table[i] = dst

    def take_copies(self) -> list[tuple[int, int]]:
        """The `(src, dst)` block copies queued since the last call, in order; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent_id, child_id) -> None:
        """`child_id` starts as a copy of `parent_id`, sharing its blocks (refcount + 1); either
        may then grow (copy-on-write)."""
        parent = self._row(parent_id)
        blocks = self.block_table(parent_id)
        child = self._new_row(child_id)
        self.allocator.share(blocks)
        self._set_blocks(child, 0, blocks)
        self.lens[child] = self.lens[parent]
        self.offsets[child] = self.offsets[parent]

    def drop_blocks(self, seq_id, first: int, n: int) -> None:
        """Remove `n` full blocks from a sequence's table starting at index `first` (tokens that
        left a sliding window) and release them; later tokens move `n * block_size` down and the
        sequence's `position_offset` grows by as many."""
        row = self._row(seq_id)
        self._check_count("first", first)
        self._check_count("n", n)
        if (first + n) * self.block_size > self.lens[row]:
            raise ValueError(
                f"blocks {first}..{first + n - 1} are not all full in sequence {seq_id!r} "
                f"of length {int(self.lens[row])}"
            )
        table = self.block_table(seq_id)
        self.allocator.free(table[first:first + n])
        self.array[row, :len(table)] = 0
        self._set_blocks(row, 0, table[:first] + table[first + n:])
        self.lens[row] -= n * self.block_size
        self.offsets[row] += n * self.block_size

    def free(self, seq_id) -> None:
        """Drop a sequence, releasing its references to its blocks."""
        row = self._row(seq_id)
        self.allocator.free(self.block_table(seq_id))
        self.array[row] = 0
        self.num_blocks[row] = self.lens[row] = self.offsets[row] = 0
        del self._rows[seq_id]
        self._free_rows.append(row)
        self._last_lookup = None

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._rows

    def block_table(self, seq_id) -> list[int]:
        row = self._row(seq_id)
        return self.array[row, :self.num_blocks[row]].tolist()

    def seq_len(self, seq_id) -> int:
        return int(self.lens[self._row(seq_id)])

    def position_offset(self, seq_id) -> int:
        """Tokens dropped from the front by `drop_blocks`: absolute position = position in the
        table + this."""
        return int(self.offsets[self._row(seq_id)])

    def slots(self, seq_id, start: int, n: int) -> list[int]:
        """Slots of tokens `start .. start + n - 1` of a sequence."""
        row = self._row(seq_id)
        length = int(self.lens[row])
        if start < 0 or n < 0 or start + n > length:
            raise ValueError(
                f"tokens {start}..{start + n - 1} are outside sequence {seq_id!r} "
                f"of length {length}"
            )
        bs = self.block_size
        first = start // bs
        table = self.array[row, first:self._blocks_for(start + n)].tolist()
        return [table[p // bs - first] * bs + p % bs for p in range(start, start + n)]
