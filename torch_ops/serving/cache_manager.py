"""The KV-cache manager of a model: one block pool for all layers, per-request block tables,
prefix sharing, copy-on-write forks, sliding-window recycling and StreamingLLM sink tokens.

Host bookkeeping lives in `torch_ops.kv_cache.BlockTables`; this class adds what needs the
device caches (block copies, sink re-rotation) and the policies (prefix cache, window).
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np
import torch

from torch_ops import quant
from torch_ops.kv_cache import BlockAllocator, BlockTables, PagedKVCache


class KVCacheManager:
    """Paged K/V caches `[num_blocks, block_size, Hkv, D]` for `num_layers` layers, all indexed by
    the same block ids, and the block tables of the requests using them.

    - **Prefix caching** (`prefix_caching=True`): every full block is registered under the hash
      of all tokens up to its end; a new request reuses the longest registered prefix of its
      prompt (refcounted, never written again). The cache holds one reference per block; blocks
      only it references are evicted, least recently used first, when the pool runs dry.
      Registration happens when the append that fills a block is scheduled: the step's forward
      writes every new k/v of a layer before that layer attends, so a request admitted in the
      same step already reads the written block.
    - **Sliding window** (`window_left >= 0`: a query at position `p` sees keys `>= p -
      window_left`): full blocks that no future query can see are released, so a request holds
      at most `(window_left + 1) / block_size + 2` blocks plus its sink blocks. The ops then see
      positions within the cache (`seq_len` counts cached tokens only, which keeps every
      query-key distance); `position_offset(seq)` is the number of tokens dropped, to add to
      RoPE positions (`MetadataBuilder.build(position_offsets=...)`).
    - **StreamingLLM sinks** (`sink_tokens > 0` with a window): the blocks holding the first
      `sink_tokens` tokens are never dropped. With `cos_sin_cache`, sink keys are rotated
      forward by the number of dropped tokens each time blocks are dropped, so that their RoPE
      distance to new queries is their distance within the cache, as in StreamingLLM (the window
      keys keep their absolute rotation, whose distances are already the in-cache ones). Each
      re-rotation rounds the sink keys to the cache format once more.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        device: torch.device | str,
        quant_group: int | None = None,
        prefix_caching: bool = False,
        window_left: int = -1,
        sink_tokens: int = 0,
        cos_sin_cache: torch.Tensor | None = None,
        rope_neox: bool = True,
    ):
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(window_left, int) or window_left < -1:
            raise ValueError(f"window_left must be an int >= -1, got {window_left!r}")
        if not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window_left < 0:
            raise ValueError("sink_tokens needs a sliding window (window_left >= 0)")
        if prefix_caching and window_left >= 0:
            raise ValueError("prefix_caching and a sliding window (window_left >= 0) cannot be "
                             "combined: dropped and re-rotated blocks cannot be shared")
        self.caches = [
            PagedKVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                  quant_group=quant_group, device=device)
            for _ in range(num_layers)
        ]
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, reclaim=self._evict_cached_blocks)
        self.tables = BlockTables(self.allocator, block_size)
        self.prefix_caching = prefix_caching
        self.window_left = window_left
        self.sink_tokens = sink_tokens
        self.cos_sin_cache = cos_sin_cache
        self.rope_neox = rope_neox
        self._tokens: dict = {}       # seq -> token ids written so far (prefix caching)
        self._hashes: dict = {}       # seq -> hash of each of its full blocks
        self._prefix = collections.OrderedDict()  # hash -> block, least recently used first
        self._sink_shifts: list[tuple[list[int], int]] = []  # (sink slots, shift) to rotate

    # --- requests -------------------------------------------------------------------------

    def add(self, seq_id, prompt: Sequence[int] = ()) -> int:
        """Register a request. With prefix caching, its table starts with the cached blocks of
        the longest cached prefix of `prompt` (at most `len(prompt) - 1` tokens, so that one is
        left to compute). Returns the number of prompt tokens already in the cache."""
        shared: list[int] = []
        hashes: list[int] = []
        if self.prefix_caching:
            bs = self.block_size
            for i in range((len(prompt) - 1) // bs):
                h = self._block_hash(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs])
                if h not in self._prefix:
                    break
                self._prefix.move_to_end(h)
                shared.append(self._prefix[h])
                hashes.append(h)
        cached = len(shared) * self.block_size
        self.tables.add(seq_id, cached, shared_blocks=shared)
        self._tokens[seq_id] = list(prompt[:cached])
        self._hashes[seq_id] = hashes
        return cached

    def append(self, seq_id, tokens: int | Sequence[int]) -> list[int]:
        """Make room for new tokens (a count, or their ids when prefix caching) and return
        their slots (`append_batch` of one). On `OutOfBlocksError` nothing changes."""
        self.append_batch([seq_id], [tokens])
        n = tokens if isinstance(tokens, int) else len(tokens)
        return self.tables.slots(seq_id, self.seq_len(seq_id) - n, n)

    def append_batch(self, seq_ids: Sequence, tokens: Sequence) -> np.ndarray:
        """Make room for the new tokens of each sequence in `seq_ids` (distinct): `tokens[i]`
        is a count, or the token ids when prefix caching. Blocks out of the window are
        released first; shared blocks written into are copied (see `apply_pending`). On
        `OutOfBlocksError` no table grows. Returns the sequences' rows in `tables` `[B]`."""
        counts = self._counts(tokens)
        if self.window_left >= 0:
            self._drop_out_of_window(seq_ids)
        rows = self.tables.append_batch(seq_ids, counts)
        if self.prefix_caching:
            for seq_id, new in zip(seq_ids, tokens):
                self._register_full_blocks(seq_id, new)
        return rows

    def _counts(self, tokens: Sequence) -> np.ndarray:
        """New tokens per sequence `[B]` from `append_batch`'s `tokens`."""
        if self.prefix_caching:
            if not any(isinstance(t, int) for t in tokens):
                return np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        else:
            try:
                counts = np.asarray(tokens)
            except ValueError:  # ragged lists
                counts = None
            if counts is not None and counts.ndim == 1 and (counts.dtype.kind in "iu" or not counts.size):
                return counts.astype(np.int64, copy=False)
        need = "token ids" if self.prefix_caching else "a token count"
        raise TypeError(f"tokens must be {need} with prefix_caching={self.prefix_caching}, "
                        "one entry per sequence")

    def fork(self, parent_id, child_id) -> None:
        """`child_id` continues `parent_id` (parallel sampling, beam search): all blocks
        shared, copied on the first write into a shared one."""
        self.tables.fork(parent_id, child_id)
        self._tokens[child_id] = list(self._tokens[parent_id])
        self._hashes[child_id] = list(self._hashes[parent_id])

    def free(self, seq_id) -> None:
        self.tables.free(seq_id)
        del self._tokens[seq_id], self._hashes[seq_id]

    def seq_len(self, seq_id) -> int:
        """Tokens in the cache (dropped window tokens excluded)."""
        return self.tables.seq_len(seq_id)

    def block_table(self, seq_id) -> list[int]:
        return self.tables.block_table(seq_id)

    def position_offset(self, seq_id) -> int:
        """Tokens dropped from the window: absolute position = position in the cache + this."""
        return self.tables.position_offset(seq_id)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, counting prefix-cache blocks that could be evicted."""
        evictable = sum(self.allocator.refcount(b) == 1 for b in self._prefix.values())
        return self.allocator.num_free + evictable

    # --- device work ------------------------------------------------------------------------

    @torch.no_grad()
    def apply_pending(self) -> None:
        """Run the queued device work on every layer: copy-on-write block copies, then sink
        re-rotations. Call once per step, before the forward."""
        copies = self.tables.take_copies()
        shifts, self._sink_shifts = self._sink_shifts, []
        if copies:
            device = self.caches[0].k.device
            src, dst = torch.tensor(copies, dtype=torch.long, device=device).unbind(1)
            for cache in self.caches:
                for x in (cache.k, cache.v) + ((cache.k_scale, cache.v_scale)
                                               if cache.format.group_scaled else ()):
                    x[dst] = x[src]
        for slots, shift in shifts:
            for cache in self.caches:
                self._rotate_keys(cache, slots, shift)

    def _rotate_keys(self, cache: PagedKVCache, slots: list[int], shift: int) -> None:
        """Rotate the keys at `slots` by `shift` more RoPE positions, in place (values kept)."""
        device = cache.k.device
        s = torch.tensor(slots, dtype=torch.long, device=device)
        rows = (s // self.block_size, s % self.block_size)
        group = cache.format.group_scaled
        k = quant.dequantize(cache.k[rows], cache.k_scale[rows] if group else cache.k_scale, cache.format)
        v = quant.dequantize(cache.v[rows], cache.v_scale[rows] if group else cache.v_scale, cache.format)
        dtype = cache.k.dtype if cache.format is quant.KVFormat.PLAIN else torch.float32
        positions = torch.full((len(slots),), shift, dtype=torch.int32, device=device)
        torch.ops.attn.kv_cache_write(k.to(dtype), v.to(dtype), cache.k, cache.v, s.to(torch.int32),
                                      **cache.scale_kwargs(), positions=positions,
                                      cos_sin_cache=self.cos_sin_cache, rope_neox=self.rope_neox)

    # --- policies -------------------------------------------------------------------------

    def _drop_out_of_window(self, seq_ids: Sequence) -> None:
        """Release, in each sequence, the full blocks after the sink blocks that no query at a
        position >= its current length can see (their last key is below `length - window_left`)."""
        bs = self.block_size
        sink_blocks = -(-self.sink_tokens // bs)
        drop = (self.tables.lens[self.tables.rows(seq_ids)] - self.window_left) // bs - sink_blocks
        for i in np.flatnonzero(drop > 0).tolist():
            seq_id, n = seq_ids[i], int(drop[i])
            self.tables.drop_blocks(seq_id, sink_blocks, n)
            if self.sink_tokens and self.cos_sin_cache is not None:
                self.tables.make_writable(seq_id, range(sink_blocks))
                self._sink_shifts.append((self.tables.slots(seq_id, 0, self.sink_tokens), n * bs))

    @staticmethod
    def _block_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
        return hash((parent, tuple(block_tokens)))

    def _register_full_blocks(self, seq_id, new_tokens: Sequence[int]) -> None:
        tokens, hashes = self._tokens[seq_id], self._hashes[seq_id]
        tokens.extend(new_tokens)
        bs = self.block_size
        if len(tokens) // bs == len(hashes):  # no block filled up (most decode steps)
            return
        table = self.tables.block_table(seq_id)
        for i in range(len(hashes), len(tokens) // bs):
            h = self._block_hash(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs])
            hashes.append(h)
            if h not in self._prefix:
                self.allocator.share([table[i]])
                self._prefix[h] = table[i]

    def drop_prefix_cache(self) -> None:
        """Free every prefix-cache block that no request uses (after synthetic requests: warm-up)."""
        self._evict_cached_blocks(len(self._prefix))

    def _evict_cached_blocks(self, n: int) -> None:
        """Free up to `n` prefix-cache blocks that no request uses, least recently used first."""
        victims = [h for h, b in self._prefix.items() if self.allocator.refcount(b) == 1][:n]
        self.allocator.free([self._prefix.pop(h) for h in victims])
