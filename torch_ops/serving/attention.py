"""Model-level attention backends, in the spirit of TRT-LLM's `AttentionBackend` /
`AttentionMetadata`: a model is built with one backend; each serving step the backend
`prepare`s the step's metadata once (host lengths and block tables -> device buffers, plus any
plan its kernels need); each layer then calls `forward(layer, q, k, v, meta)`, which writes the
new k/v into that layer's paged cache and attends.

Backends: `vanilla` and `triton` run the `torch.ops.attn` ops on that op-level backend
(`torch_ops.backends` decides how an op runs; this module only asks for one), `flashinfer`
runs FlashInfer's paged wrappers when `flashinfer` is importable. `docs/backends.md` explains how
to add one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch

from torch_ops import use_backend
from torch_ops.metadata import AttentionMetadata, MetadataBuilder
from torch_ops.serving.cache_manager import KVCacheManager

MAX_DECODE_QUERIES = 8  # paged_decode serves 1..8 new tokens per sequence
DECODE_DTYPES = (torch.float16, torch.bfloat16)  # its query dtypes (fp32 goes through paged_prefill)


@dataclass(frozen=True)
class AttentionConfig:
    """Attention of one model. `cos_sin_cache [max_position, rotary_dim]` fp32 (cosines, then
    sines) enables RoPE on q and k, fused into the cache write; `rope_neox` picks the style."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    window_left: int = -1
    sink_tokens: int = 0
    softcap: float = 0.0
    cos_sin_cache: torch.Tensor | None = None
    rope_neox: bool = True

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")


@dataclass
class StepMetadata:
    """What every layer of one step needs: the device metadata (`attn`), whether the step is a
    uniform decode (`paged_decode`, 1..8 tokens per sequence) or goes through `paged_prefill`
    (any mix of prefill chunks and decodes), and the backend's own plan, if any."""

    attn: AttentionMetadata
    decode: bool
    plan: object = None


class AttentionBackend(abc.ABC):
    """The attention of one model over its `KVCacheManager`.

    `graph_safe` backends keep every tensor a step reads at a fixed address and launch grids
    that depend only on shapes, so a decode step built with `prepare(..., pad_to=bucket)` can be
    captured once in a CUDA graph and replayed after later `prepare` calls with the same bucket.
    """

    name: ClassVar[str]
    graph_safe: ClassVar[bool]

    def __init__(self, config: AttentionConfig, kv: KVCacheManager, *, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int):
        why = self.unsupported(config, kv)
        if why:
            raise ValueError(f"attention backend {self.name!r} cannot serve this model: " + "; ".join(why))
        cache = kv.caches[0]
        if (cache.num_kv_heads, cache.head_dim) != (config.num_kv_heads, config.head_dim):
            raise ValueError(
                f"the KV cache has {cache.num_kv_heads} KV heads of dim {cache.head_dim}, the model "
                f"{config.num_kv_heads} of dim {config.head_dim}"
            )
        if kv.window_left != config.window_left or kv.sink_tokens != config.sink_tokens:
            raise ValueError(
                f"the KV cache keeps window_left={kv.window_left}, sink_tokens={kv.sink_tokens}; "
                f"the model attends with {config.window_left}, {config.sink_tokens}"
            )
        self.config = config
        self.kv = kv
        self.builder = MetadataBuilder(max_num_seqs, max_num_tokens, max_blocks_per_seq,
                                       kv.block_size, cache.k.device)
        kv.tables.reserve_columns(max_blocks_per_seq)

    @classmethod
    def unsupported(cls, config: AttentionConfig, kv: KVCacheManager) -> list[str]:
        """Why this backend cannot serve the model (empty: it can)."""
        return []

    def prepare(self, seq_ids: Sequence, query_lens: Sequence[int] | np.ndarray, *,
                pad_to: int | None = None, token_ids: Sequence[int] | None = None,
                rows: np.ndarray | None = None) -> StepMetadata:
        """Metadata of one step for the sequences `seq_ids`, each with `query_lens[i]` new
        tokens already appended in the cache manager. The new tokens are packed in this order;
        their `token_ids`, if given, travel with the metadata (`meta.attn.token_ids`). `rows`:
        the sequences' rows in `kv.tables` if the caller has them (`append_batch` returns them)."""
        tables = self.kv.tables
        if rows is None:
            rows = tables.rows(seq_ids)
        elif len(rows) != len(seq_ids):
            raise ValueError(f"rows must hold one row per sequence: {len(seq_ids)}, got {len(rows)}")
        md = self.builder.build_from_tables(tables, rows, query_lens, pad_to=pad_to, token_ids=token_ids,
                                            position_offsets=self.kv.window_left >= 0)
        return self.step_metadata(md)

    def step_metadata(self, md: AttentionMetadata) -> StepMetadata:
        """Wrap a built `AttentionMetadata` (also used to capture CUDA graphs on dummy data)."""
        decode = 0 < md.q_per_seq <= MAX_DECODE_QUERIES
        return StepMetadata(md, decode, self.plan(md, decode))

    def plan(self, md: AttentionMetadata, decode: bool) -> object:
        """Backend work done once per step, after the metadata is built (default: none)."""
        return None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        """`q [T, Hq, D]`, `k`/`v [T, Hkv, D]` of the step's new tokens (before RoPE) ->
        attention output `[T, Hq, D]`. Writes k/v into layer `layer`'s cache first."""
        cache = self.kv.caches[layer]
        cfg = self.config
        rope = {}
        if cfg.cos_sin_cache is not None:
            rope = dict(query=q, positions=meta.attn.positions, cos_sin_cache=cfg.cos_sin_cache,
                        rope_neox=cfg.rope_neox)
        with self.op_backend():
            rotated = torch.ops.attn.kv_cache_write(k, v, cache.k, cache.v, meta.attn.slot_mapping,
                                                    **cache.scale_kwargs(), **rope)
        return self.attend(layer, rotated if rope else q, meta)

    def op_backend(self):
        """The op-level backend (`torch_ops.use_backend`) for the ops this backend calls."""
        return use_backend(None)

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Attention of the rotated `q [T, Hq, D]` over layer `layer`'s cache -> `[T, Hq, D]`."""


class OpsAttention(AttentionBackend):
    """`torch.ops.attn.paged_decode` / `paged_prefill` on one op-level backend."""

    op_backend_name: ClassVar[str]

    def op_backend(self):
        return use_backend(self.op_backend_name)

    def attend(self, layer, q, meta):
        cache = self.kv.caches[layer]
        cfg = self.config
        md = meta.attn
        kwargs = dict(scale=cfg.scale, window_left=cfg.window_left, sink_tokens=cfg.sink_tokens,
                      softcap=cfg.softcap, **cache.scale_kwargs())
        with self.op_backend():
            if meta.decode and q.dtype in DECODE_DTYPES:
                out, _ = torch.ops.attn.paged_decode(q, cache.k, cache.v, md.block_tables, md.seq_lens,
                                                     **kwargs)
            else:
                out, _ = torch.ops.attn.paged_prefill(q, cache.k, cache.v, md.block_tables,
                                                      md.cu_seqlens_q, md.seq_lens, **kwargs)
        return out


class VanillaAttention(OpsAttention):
    """The pure-PyTorch reference ops (any device; reads metadata on the host)."""

    name = "vanilla"
    graph_safe = False
    op_backend_name = "vanilla"


class TritonAttention(OpsAttention):
    """Our Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    graph_safe = True
    op_backend_name = "triton"


class FlashInferAttention(AttentionBackend):
    """FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` (uniform one-token decode steps) and
    `BatchPrefillWithPagedKVCacheWrapper` (everything else), planned once per step from host
    data. The cache write stays `attn::kv_cache_write`. Not captured in CUDA graphs here (a plan
    outside graph mode would be replayed with stale data)."""

    name = "flashinfer"
    graph_safe = False
    WORKSPACE_BYTES = 128 << 20
    HEAD_DIMS = (64, 128, 256)

    @classmethod
    def unsupported(cls, config, kv):
        why = []
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            why.append(f"flashinfer is not importable ({e})")
        cache = kv.caches[0]
        if cache.k.device.type != "cuda":
            why.append(f"FlashInfer needs a CUDA cache, got {cache.k.device}")
        if cache.k.dtype not in (torch.float16, torch.bfloat16):
            why.append(f"this adapter serves fp16/bf16 caches, got {cache.k.dtype}")
        if cache.k.stride() != cache.k.contiguous().stride() or cache.v.stride() != cache.v.contiguous().stride():
            why.append("this adapter needs separate contiguous NHD k/v caches")
        if config.sink_tokens:
            why.append("FlashInfer has no sink tokens")
        if config.head_dim not in cls.HEAD_DIMS:
            why.append(f"FlashInfer's paged kernels take head dims {cls.HEAD_DIMS}, got {config.head_dim}")
        return why

    def __init__(self, config, kv, **kwargs):
        super().__init__(config, kv, **kwargs)
        import flashinfer

        workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=kv.caches[0].k.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def prepare(self, seq_ids, query_lens, *, pad_to=None, token_ids=None, rows=None):
        # FlashInfer plans from host data; padding sequences are not needed without graphs.
        meta = super().prepare(seq_ids, query_lens, token_ids=token_ids, rows=rows)
        kv, bs = self.kv, self.kv.block_size
        seq_lens = np.array([kv.seq_len(s) for s in seq_ids], dtype=np.int64)
        pages = -(-seq_lens // bs)
        indices = np.concatenate([kv.block_table(s)[:n] for s, n in zip(seq_ids, pages)] + [np.zeros(0)])
        as_tensor = lambda x: torch.tensor(np.asarray(x), dtype=torch.int32)  # noqa: E731
        kv_indptr = as_tensor(np.concatenate([[0], np.cumsum(pages)]))
        last_page_len = as_tensor(seq_lens - (pages - 1) * bs)
        kv_indices = as_tensor(indices).to(kv.caches[0].k.device)
        cfg, dtype = self.config, kv.caches[0].k.dtype
        common = dict(window_left=cfg.window_left, logits_soft_cap=cfg.softcap or None,
                      sm_scale=cfg.scale, q_data_type=dtype, kv_data_type=dtype)
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs)
        if meta.attn.q_per_seq == 1:
            self._decode.plan(kv_indptr, kv_indices, last_page_len, *shape, pos_encoding_mode="NONE",
                              **common)
            meta.plan = self._decode
        else:
            qo_indptr = as_tensor(np.concatenate([[0], np.cumsum(query_lens)]))
            self._prefill.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, *shape, causal=True,
                               **common)
            meta.plan = self._prefill
        return meta

    def attend(self, layer, q, meta):
        cache = self.kv.caches[layer]
        return meta.plan.run(q, (cache.k, cache.v))


BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TritonAttention, FlashInferAttention, VanillaAttention)
}


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class called `name` (one of `BACKENDS`)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {list(BACKENDS)}")
    return BACKENDS[name]
