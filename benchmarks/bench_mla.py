"""MLA attention in DeepSeek-V3's shapes: latent-cache decode and 192/128 prefill against peers.

Decode over a paged latent cache and prefill with a value head dim of its own, `torch.ops.attn`
against FlashInfer and SDPA.

Usage (GPU machine):  python benchmarks/bench_mla.py [--quick] [--check] [--out DIR]
  --quick      a short grid (B in {1, 64}, ctx in {1k, 4k}, Hq = 128; one prefill length)
  --check      check every configuration of ours against the float64 reference (without it: the
               configurations of the grid's first batch size, a few points)
  --sections / --batch / --ctx / --heads / --formats / --seqlens / --page / --peers / --budget-s
               select a subset
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a table last. Peers are optional: a peer that cannot be
imported or run records why, and its columns print as "-".

Notes
-----
* Decode, the absorbed form: `query [B, Hq, 576]` (512 latent dims, then 64 RoPE dims), one
  latent cache `k_cache [num_blocks, page, 1, 576]` and `v_cache = k_cache[..., :512]` (a view),
  `out [B, Hq, 512]`, softmax scale `1/sqrt(192)` (DeepSeek-V3's query-key head before
  absorption); bf16 and FP8 e4m3 latent caches (one scale for K and V), 64-token pages in a
  random order, one new token per sequence, `seq_lens = ctx`.
* Bytes: the latent cache read once, `B * ctx * 576 * element size`; queries and outputs,
  `Hq * (576 + 512) * 2` bytes per sequence, are not counted (at Hq = 128 they add 24 % to a
  bf16 latent of 1k keys, 1.5 % at 16k; at Hq = 16, 3 % and 0.2 %). FLOPs: `2 * Hq * ctx * (576 + 512)` per
  sequence (scores over 576 dims, output over 512). Decode is bandwidth-bound at Hq = 16
  (2 * (576 + 512) * 16 / 1152 = 30 FLOP per bf16 byte) and near the H200's ridge at Hq = 128
  (240 FLOP per byte against 989 TFLOP/s / 4.8 TB/s = 206): both percentages are reported, of
  the nominal 4.8 TB/s HBM (H200), of the read bandwidth measured in this run
  (`common.device_bandwidth`, the ceiling the other benchmarks use) and of the 989 TFLOP/s dense
  bf16 peak.
* Decode peers, on the same latent tensor: FlashInfer `BatchMLAPagedAttentionWrapper` with
  backends "fa2" and "fa3" (`ckv_cache`/`kpe_cache` are views of the latent, as its strides
  allow; an FP8 cache's scale as its `ckv_scale` and `kpe_scale`); and, for context, the
  decompressed equivalent (per-head keys `[B, Hq, ctx, 192]` and values `[B, Hq, ctx, 128]`, the
  attention transformers runs; bf16 only, skipped past
  `MAX_DECOMPRESSED_BYTES`) under SDPA (`sdpa_mha`) and under our `paged_decode`, one page per
  sequence (`ours_mha`: what `fx_passes` makes of transformers' DeepSeek-V3 decode step). Every
  GB/s column is latent bytes / time: the same decode step, so the decompressed columns show what
  reading the decompressed cache costs.
* Prefill, not absorbed: packed self-attention of 16k tokens (`TOTAL_TOKENS`, batch = 16k / S),
  128 heads, queries and keys of 192 dims, values of 128, causal, bf16: `context_attention`
  against FlashInfer fa3 (`BatchPrefillWithRaggedKVCacheWrapper`, `head_dim_qk=192`,
  `head_dim_vo=128`) and cuDNN SDPA. FLOPs: `2 * Hq * (192 + 128) * S^2 / 2` per sequence (the
  visible half of the query-key pairs, the FlashAttention convention).
* Timing: benchmarks/common.py (CUDA graph of back-to-back calls, median of replays; decode
  input sets rotated past L2).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

LATENT, ROPE = 512, 64            # DeepSeek-V3: kv_lora_rank, qk_rope_head_dim
D = LATENT + ROPE                 # 576
QK_HEAD, V_HEAD = 192, 128        # qk_nope_head_dim + qk_rope_head_dim, v_head_dim
SCALE = QK_HEAD ** -0.5
PAGE = 64
GRID_BATCH = [1, 8, 32, 64, 128]
GRID_CTX = [1024, 4096, 16384]
GRID_HEADS = [16, 128]
QUICK_BATCH = [1, 64]
QUICK_CTX = [1024, 4096]
QUICK_HEADS = [128]
FORMATS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_SCALE = 1 / 64
PREFILL_HEADS = 128
TOTAL_TOKENS = 16384
SEQLENS = [1024, 4096, 16384]
QUICK_SEQLENS = [4096]
DECODE_PEERS = ["flashinfer_fa2", "flashinfer_fa3", "sdpa_mha", "ours_mha"]
PREFILL_PEERS = ["flashinfer_fa3", "cudnn_sdpa"]
PEERS = list(dict.fromkeys(DECODE_PEERS + PREFILL_PEERS))
SECTIONS = ["decode", "prefill"]
MAX_DECOMPRESSED_BYTES = 24e9


# ------------------------------------------------------------------------------------------------
# counting
# ------------------------------------------------------------------------------------------------


def latent_bytes(batch: int, ctx: int, fmt: str) -> int:
    """Bytes of latent cache a decode step reads: `batch * ctx` rows of 576 elements."""
    return batch * ctx * D * torch.empty((), dtype=FORMATS[fmt]).element_size()


def decompressed_bytes(batch: int, ctx: int, hq: int) -> int:
    """Bytes of the decompressed bf16 keys `[B, Hq, ctx, 192]` and values `[B, Hq, ctx, 128]`."""
    return batch * hq * ctx * (QK_HEAD + V_HEAD) * 2


def decode_flops(batch: int, ctx: int, hq: int) -> float:
    """`2 * Hq * ctx * (576 + 512)` per sequence: scores over 576 dims, output over 512."""
    return 2.0 * batch * hq * ctx * (D + LATENT)


def prefill_flops(lens: list[int], hq: int, causal: bool = True) -> float:
    """`2 * Hq * (192 + 128)` per query-key pair; causal counts half of each `S^2`."""
    pairs = sum(n * n for n in lens) * (0.5 if causal else 1.0)
    return 2.0 * hq * (QK_HEAD + V_HEAD) * pairs


def rates(row: dict, key: str, us: float, nbytes: float | None, flops: float, limits: dict) -> None:
    """Adds `<key>_us` and what it achieved: GB/s of `nbytes` (% of nominal HBM and of the
    measured read bandwidth) and TFLOP/s (% of the dense bf16 peak)."""
    row[f"{key}_us"] = us
    if nbytes is not None:
        gbps = nbytes / us / 1e3
        row[f"{key}_GBps"] = gbps
        row[f"{key}_pct_hbm"] = 100 * gbps / (limits["hbm_TBps"] * 1e3)
        if limits.get("read_GBps"):
            row[f"{key}_pct_read"] = 100 * gbps / limits["read_GBps"]
    row[f"{key}_tflops"] = flops / us / 1e6
    row[f"{key}_pct_peak"] = 100 * row[f"{key}_tflops"] / limits["bf16_TFLOPs"]


# ------------------------------------------------------------------------------------------------
# problems
# ------------------------------------------------------------------------------------------------


class DecodeCase:
    """One MLA decode step: `n_sets` rotated copies of (query `[B, Hq, 576]`, latent cache
    `[num_blocks, page, 1, 576]`) sharing one block table (a random page permutation)."""

    def __init__(self, batch, ctx, hq, fmt="bf16", page=PAGE, n_sets=1, device="cuda"):
        self.batch, self.ctx, self.hq, self.fmt, self.page = batch, ctx, hq, fmt, page
        self.blocks_per_seq = -(-ctx // page)
        nb = batch * self.blocks_per_seq
        dtype = FORMATS[fmt]
        self.sets = []
        for _ in range(n_sets):
            q = torch.randn(batch, hq, D, dtype=torch.bfloat16, device=device)
            latent = torch.randn(nb, page, 1, D, dtype=torch.bfloat16, device=device)
            if fmt == "fp8":
                latent = (latent / FP8_SCALE).clamp_(-448, 448).to(dtype)
            self.sets.append((q, latent))
        self.scale = torch.tensor(FP8_SCALE, device=device) if fmt == "fp8" else None
        self.block_tables = torch.randperm(nb, device=device).to(torch.int32).view(batch, -1)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.out = [torch.empty(batch, hq, LATENT, dtype=torch.bfloat16, device=device) for _ in range(n_sets)]
        self.lse = [torch.empty(batch, hq, dtype=torch.float32, device=device) for _ in range(n_sets)]

    @property
    def nbytes(self) -> int:
        return latent_bytes(self.batch, self.ctx, self.fmt)

    @property
    def flops(self) -> float:
        return decode_flops(self.batch, self.ctx, self.hq)

    def args(self, i: int = 0) -> tuple[tuple, dict]:
        """`paged_decode`'s arguments for set i (values: the latent's first 512 dims, a view)."""
        q, latent = self.sets[i]
        return ((q, latent, latent[..., :LATENT], self.block_tables, self.seq_lens),
                dict(scale=SCALE, k_scale=self.scale, v_scale=self.scale))

    def ours(self, i: int = 0, backend: str | None = None):
        import torch_ops

        args, kwargs = self.args(i)
        out, lse = self.out[i], self.lse[i]

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.paged_decode.out(*args, **kwargs, out=out, lse=lse)
        return fn

    def backend(self) -> str:
        import torch_ops

        args, kwargs = self.args()
        return torch_ops.backend_for("paged_decode", *args, **kwargs)


class PrefillCase:
    """Packed causal self-attention: q/k `[T, H, 192]`, v `[T, H, 128]` bf16, `cu_seqlens`."""

    def __init__(self, lens, heads=PREFILL_HEADS, d_qk=QK_HEAD, d_v=V_HEAD, device="cuda"):
        self.lens, self.heads, self.d_qk, self.d_v = lens, heads, d_qk, d_v
        t = sum(lens)
        self.q, self.k = (torch.randn(t, heads, d_qk, dtype=torch.bfloat16, device=device) for _ in range(2))
        self.v = torch.randn(t, heads, d_v, dtype=torch.bfloat16, device=device)
        self.cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device, torch.int32)
        self.out = torch.empty(t, heads, d_v, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(t, heads, dtype=torch.float32, device=device)

    @property
    def flops(self) -> float:
        return prefill_flops(self.lens, self.heads)

    def ours(self, backend: str | None = None):
        import torch_ops

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.context_attention.out(self.q, self.k, self.v, self.cu, self.cu, causal=True,
                                                     out=self.out, lse=self.lse)
        return fn

    def backend(self) -> str:
        import torch_ops

        return torch_ops.backend_for("context_attention", self.q, self.k, self.v, self.cu, self.cu, causal=True)


# ------------------------------------------------------------------------------------------------
# checks against the reference
# ------------------------------------------------------------------------------------------------


def _error_row(out, truth, base) -> dict:
    from torch_ops.testing import max_error, rounding_floor

    err, base_err = max_error(out, truth), max_error(base, truth)
    floor = rounding_floor(truth, out.dtype) + 1e-6
    return {"max_err": err, "baseline_err": base_err, "ok": bool(err <= 2 * base_err + floor)}


def check_decode(case: DecodeCase, seqs: int = 4, backend: str | None = None) -> dict:
    """Our output for the first `seqs` sequences against the float64 reference, next to the
    reference computed in bf16."""
    from torch_ops import reference

    case.ours(0, backend)()
    n = min(seqs, case.batch)
    (q, k, v, bt, sl), kwargs = case.args()
    args = (k, v, bt[:n], sl[:n])
    truth, _ = reference.paged_decode(q[:n].float(), *args, compute_dtype=torch.float64, **kwargs)
    base, _ = reference.paged_decode(q[:n], *args, compute_dtype=q.dtype, **kwargs)
    return _error_row(case.out[0][:n], truth, base)


def check_prefill(case: PrefillCase, rows: int = 256, heads: int = 2, backend: str | None = None) -> dict:
    """Our output for the last `rows` queries of the first sequence (first `heads` heads)
    against the float64 reference over the same keys."""
    from torch_ops import reference

    case.ours(backend)()
    n = case.lens[0]
    r = min(rows, n)
    q, k, v = case.q[n - r:n, :heads], case.k[:n, :heads], case.v[:n, :heads]
    cu_q = torch.tensor([0, r], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    truth, _ = reference.context_attention(q, k, v, cu_q, cu_k, causal=True, compute_dtype=torch.float64)
    base, _ = reference.context_attention(q, k, v, cu_q, cu_k, causal=True, compute_dtype=torch.bfloat16)
    return _error_row(case.out[n - r:n, :heads], truth, base)


# ------------------------------------------------------------------------------------------------
# peers
# ------------------------------------------------------------------------------------------------


def flashinfer_mla_fns(case: DecodeCase, backend: str):
    """FlashInfer's MLA decode on the case's latent tensors (ckv/kpe: views of each)."""
    import flashinfer

    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(common.flashinfer_workspace(), backend=backend)
    device = case.block_tables.device
    qo_indptr = torch.arange(case.batch + 1, dtype=torch.int32, device=device)
    kv_indptr = qo_indptr * case.blocks_per_seq
    kv_indices = case.block_tables.flatten().contiguous()
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, case.seq_lens, case.hq, LATENT, ROPE, case.page, False,
                 SCALE, torch.bfloat16, FORMATS[case.fmt])
    scales = dict(ckv_scale=FP8_SCALE, kpe_scale=FP8_SCALE) if case.fmt == "fp8" else {}
    fns = []
    for i, (q, latent) in enumerate(case.sets):
        rows = latent[:, :, 0]
        q_nope, q_pe, ckv, kpe = q[..., :LATENT], q[..., LATENT:], rows[..., :LATENT], rows[..., LATENT:]
        out = case.out[i]

        def fn(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, out=out):
            wrapper.run(q_nope, q_pe, ckv, kpe, out=out, **scales)
        fns.append(fn)
    fns[0]()
    return fns


class DecompressedCase:
    """The decompressed equivalent of a decode step: `n_sets` rotated copies of queries `[B, Hq,
    1, 192]`, keys `[B, Hq, ctx, 192]` and values `[B, Hq, ctx, 128]` (bf16)."""

    def __init__(self, batch, ctx, hq, n_sets=1, device="cuda"):
        self.sets = [(torch.randn(batch, hq, 1, QK_HEAD, dtype=torch.bfloat16, device=device),
                      torch.randn(batch, hq, ctx, QK_HEAD, dtype=torch.bfloat16, device=device),
                      torch.randn(batch, hq, ctx, V_HEAD, dtype=torch.bfloat16, device=device)) for _ in range(n_sets)]
        self.block_tables = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.out = [torch.empty(batch, hq, V_HEAD, dtype=torch.bfloat16, device=device) for _ in range(n_sets)]
        self.lse = [torch.empty(batch, hq, dtype=torch.float32, device=device) for _ in range(n_sets)]

    def paged_args(self, i: int = 0) -> tuple:
        """`paged_decode`'s arguments for set i: each sequence one page of ctx tokens (`k.transpose(1, 2)`)."""
        q, k, v = self.sets[i]
        return q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2), self.block_tables, self.seq_lens

    def ours_fns(self) -> list:
        fns = []
        for i in range(len(self.sets)):
            def fn(args=self.paged_args(i), out=self.out[i], lse=self.lse[i]):
                torch.ops.attn.paged_decode.out(*args, scale=SCALE, out=out, lse=lse)
            fns.append(fn)
        fns[0]()
        return fns

    def sdpa_fns(self) -> list:
        """SDPA on CUDA kernels only (cuDNN, memory-efficient or flash; not the math fallback)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernels = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]
        fns = []
        for q, k, v in self.sets:
            def fn(q=q, k=k, v=v):
                with sdpa_kernel(kernels):
                    F.scaled_dot_product_attention(q, k, v, scale=SCALE)
            fns.append(fn)
        fns[0]()
        return fns


def flashinfer_prefill_fn(case: PrefillCase, backend: str = "fa3"):
    import flashinfer

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(common.flashinfer_workspace(), "NHD", backend=backend)
    w.plan(case.cu, case.cu, case.heads, case.heads, case.d_qk, head_dim_vo=case.d_v, causal=True,
           q_data_type=torch.bfloat16)

    def fn():
        w.run(case.q, case.k, case.v)
    fn()
    return fn


def cudnn_prefill_fn(case: PrefillCase):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if len(set(case.lens)) != 1:
        raise RuntimeError("no varlen input in SDPA")
    b, s = len(case.lens), case.lens[0]
    q, k, v = (x.view(b, s, case.heads, x.shape[-1]).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v))

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    fn()
    return fn


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


class Runner:
    """Measures rows. `device`, `time` (decode: calls -> (µs, how)), `time_long` (prefill: one
    call -> (µs, how)) and the prefill size are attributes, so that rows can be built on a CPU
    with a stand-in timer."""

    def __init__(self, args, env, bw, device="cuda"):
        self.args, self.device = args, device
        self.time, self.time_long = common.time_us, common.time_long_us
        self.total_tokens, self.prefill_heads = TOTAL_TOKENS, PREFILL_HEADS
        self.l2 = env.get("l2_bytes", 50 << 20) or (50 << 20)
        hbm, bf16, _ = common.nominal_limits(env.get("gpu", ""))
        self.limits = {"hbm_TBps": hbm, "read_GBps": bw.get("read_GBps"), "bf16_TFLOPs": bf16}
        self.t_end = time.time() + args.budget_s
        self.rows: list[dict] = []

    def time_left(self) -> float:
        return self.t_end - time.time()

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info()[0] if self.device == "cuda" else 1 << 40

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def peer(self, row: dict, name: str, make, nbytes, flops, ours_us: float, long: bool = False) -> None:
        """Time peer `name` (`make()` returns its calls; with `long`, its one call), or record why
        it is missing."""
        if self.time_left() < 20:
            row[name] = "skipped: time budget"
            return
        try:
            fns = make()
            us, how = (self.time_long if long else self.time)(fns)
            rates(row, name, us, nbytes, flops, self.limits)
            row[f"{name}_timing"], row[f"vs_{name}"] = how, us / ours_us
        except Exception as e:  # noqa: BLE001
            row[name] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        self.sync()

    def decode(self, batch: int, ctx: int, hq: int, fmt: str, check: bool) -> dict:
        row = {"section": "decode", "batch": batch, "ctx": ctx, "hq": hq, "fmt": fmt, "page": self.args.page,
               "latent_bytes": latent_bytes(batch, ctx, fmt), "flops": decode_flops(batch, ctx, hq)}
        us = self.latent(row, check)
        mha = [p for p in ("sdpa_mha", "ours_mha") if p in self.args.peers]
        if mha and fmt == "bf16":
            self.decompressed(row, mha, us)
        return row

    def latent(self, row: dict, check: bool) -> float:
        """Ours and FlashInfer's MLA on the latent cache of `row`'s shape; returns our µs."""
        batch, ctx, hq, fmt, nbytes = (row[k] for k in ("batch", "ctx", "hq", "fmt", "latent_bytes"))
        n_sets = common.rotation_count(nbytes, self.l2, budget_bytes=int(min(8 << 30, self.free_bytes() * 0.3)))
        case = DecodeCase(batch, ctx, hq, fmt, self.args.page, n_sets=n_sets, device=self.device)
        row["rotated_sets"], row["backend"] = n_sets, case.backend()
        if check:
            row["check"] = common.run_check(lambda: check_decode(case))
        us, how = self.time([case.ours(i) for i in range(n_sets)])
        rates(row, "ours", us, nbytes, row["flops"], self.limits)
        row["ours_timing"] = how
        for backend in ("fa2", "fa3"):
            if f"flashinfer_{backend}" in self.args.peers:
                self.peer(row, f"flashinfer_{backend}", lambda: flashinfer_mla_fns(case, backend), nbytes, row["flops"],
                          us)
        return us

    def decompressed(self, row: dict, peers: list[str], ours_us: float) -> None:
        """`peers` (sdpa_mha, ours_mha) on the decompressed equivalent of `row`'s decode step."""
        batch, ctx, hq = row["batch"], row["ctx"], row["hq"]
        size = decompressed_bytes(batch, ctx, hq)
        free = self.free_bytes()
        if size > MAX_DECOMPRESSED_BYTES or 1.2 * size > free:
            row.update({p: f"skipped: decompressed K/V of {size / 1e9:.0f} GB" for p in peers})
            return
        sets = common.rotation_count(size, self.l2, budget_bytes=int(min(8 << 30, free * 0.3)))
        row["decompressed_bytes"], row["decompressed_sets"] = size, sets
        case = DecompressedCase(batch, ctx, hq, sets, device=self.device)
        for p in peers:
            self.peer(row, p, case.sdpa_fns if p == "sdpa_mha" else case.ours_fns, row["latent_bytes"], row["flops"],
                      ours_us)

    def prefill(self, seqlen: int, check: bool) -> dict:
        lens = [seqlen] * max(1, self.total_tokens // seqlen)
        case = PrefillCase(lens, self.prefill_heads, device=self.device)
        row = {"section": "prefill", "seqlen": seqlen, "num_seqs": len(lens), "hq": case.heads, "d_qk": case.d_qk,
               "d_v": case.d_v, "causal": True, "flops": case.flops, "backend": case.backend()}
        if check:
            row["check"] = common.run_check(lambda: check_prefill(case))
        us, how = self.time_long(case.ours())
        rates(row, "ours", us, None, case.flops, self.limits)
        row["ours_timing"] = how
        if "flashinfer_fa3" in self.args.peers:
            self.peer(row, "flashinfer_fa3", lambda: flashinfer_prefill_fn(case), None, case.flops, us, long=True)
        if "cudnn_sdpa" in self.args.peers:
            self.peer(row, "cudnn_sdpa", lambda: cudnn_prefill_fn(case), None, case.flops, us, long=True)
        return row


def decode_jobs(batches, ctxs, heads, formats) -> list[tuple[int, int, int, str]]:
    """(B, ctx, Hq, format) in run order: bf16 then FP8, by heads, batch, context."""
    return [(b, c, h, f) for f in formats for h in heads for b in batches for c in ctxs]


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------


def best_peer(row: dict, peers) -> float | None:
    """The fastest time among `peers` in `row`, or None."""
    times = [row[f"{p}_us"] for p in peers if isinstance(row.get(f"{p}_us"), (int, float))]
    return min(times) if times else None


def summary(rows: list[dict], limits: dict) -> str:
    """The decode and prefill tables (missing values as "-")."""
    decode, prefill = [], []
    for r in rows:
        if not r.get("ours_us"):
            continue
        v = dict(r)
        if "check" in r:
            v["err"] = "ok" if r["check"].get("ok") else "BAD"
        fi = best_peer(r, ("flashinfer_fa2", "flashinfer_fa3"))
        v["vs_fi"] = fi / r["ours_us"] if fi else None
        (decode if r["section"] == "decode" else prefill).append(v)
    out = [f"HBM {limits['hbm_TBps']} TB/s nominal, read {num(limits.get('read_GBps'), 0)} GB/s measured, dense bf16 "
           f"{limits['bf16_TFLOPs']} TFLOP/s; GB/s: latent bytes / time; xFI = best FlashInfer time / ours (> 1: ours "
           "faster)"]
    if decode:
        out.append(common.table(decode, [
            ("batch", "B", "d"), ("ctx", "ctx", "d"), ("hq", "Hq", "d"), ("fmt", "kv", "s"),
            ("backend", "backend", "s"),
            ("ours_us", "ours_us", ".1f"), ("ours_GBps", "GB/s", ".0f"), ("ours_pct_hbm", "%HBM", ".1f"),
            ("ours_pct_read", "%read", ".1f"), ("ours_tflops", "TFLOP/s", ".0f"), ("ours_pct_peak", "%peak", ".1f"),
            ("flashinfer_fa2_us", "FIfa2_us", ".1f"), ("flashinfer_fa3_us", "FIfa3_us", ".1f"),
            ("sdpa_mha_us", "sdpa_mha_us", ".1f"), ("ours_mha_us", "ours_mha_us", ".1f"), ("vs_fi", "xFI", ".2f"),
            ("err", "err_ok", "s")]))
    if prefill:
        out.append(common.table(prefill, [
            ("seqlen", "S", "d"), ("num_seqs", "B", "d"), ("hq", "H", "d"), ("backend", "backend", "s"),
            ("ours_us", "ours_us", ".1f"), ("ours_tflops", "TFLOP/s", ".0f"), ("ours_pct_peak", "%peak", ".1f"),
            ("flashinfer_fa3_tflops", "FIfa3_TF", ".0f"), ("cudnn_sdpa_tflops", "cudnn_TF", ".0f"),
            ("vs_fi", "xFI", ".2f"), ("err", "err_ok", "s")]))
    return "\n".join(out)


def num(v, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _short(r: dict) -> str:
    if r.get("error") or r.get("skipped"):
        return f"{r.get('section')} {r.get('params', '')}: {r.get('error') or r.get('skipped')}"
    if r["section"] == "decode":
        s = (f"decode {r['batch']:>4}x{r['ctx']:<6} Hq={r['hq']:<4} {r['fmt']:<5} ours {r['ours_us']:8.1f} us "
             f"{r['ours_GBps']:6.0f} GB/s {r['ours_pct_hbm']:5.1f}% HBM {r['ours_tflops']:5.0f} TFLOP/s")
        peers = DECODE_PEERS
    else:
        s = (f"prefill S={r['seqlen']:<6} x{r['num_seqs']:<3} ours {r['ours_us']:9.1f} us "
             f"{r['ours_tflops']:5.0f} TFLOP/s {r['ours_pct_peak']:5.1f}% peak")
        peers = PREFILL_PEERS
    for p in peers:
        if f"{p}_us" in r:
            s += f" | {p} {r[p + '_us']:.1f}"
        elif isinstance(r.get(p), str):
            s += f" | {p} n/a"
    if "check" in r:
        c = r["check"]
        s += f" | err {c.get('max_err', math.nan):.1e}/{c.get('baseline_err', math.nan):.1e}"
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true", help="check every configuration against the reference")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--sections", nargs="*", default=SECTIONS, choices=SECTIONS)
    p.add_argument("--batch", type=int, nargs="*")
    p.add_argument("--ctx", type=int, nargs="*")
    p.add_argument("--heads", type=int, nargs="*", help="query heads of the decode grid")
    p.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--seqlens", type=int, nargs="*", help="prefill sequence lengths")
    p.add_argument("--page", type=int, default=PAGE, help="latent cache page size (tokens)")
    p.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this many seconds")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla needs a CUDA GPU")
        return 1
    batches = args.batch or (QUICK_BATCH if args.quick else GRID_BATCH)
    ctxs = args.ctx or (QUICK_CTX if args.quick else GRID_CTX)
    heads = args.heads or (QUICK_HEADS if args.quick else GRID_HEADS)
    seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)

    env, bw = common.machine()
    runner = Runner(args, env, bw)
    payload = {"env": env, "bandwidth": bw, "limits": runner.limits, "args": vars(args), "rows": runner.rows}

    jobs = []
    if "decode" in args.sections:
        jobs += [("decode", (*job, args.check or job[0] == batches[0]))
                 for job in decode_jobs(batches, ctxs, heads, args.formats)]
    if "prefill" in args.sections:
        jobs += [("prefill", (s, args.check or s == seqlens[0])) for s in seqlens]
    for kind, params in jobs:
        if runner.time_left() < 15:
            runner.rows.append({"section": kind, "params": list(params[:-1]), "skipped": "time budget"})
            continue
        try:
            row = getattr(runner, kind)(*params)
        except Exception as e:  # noqa: BLE001
            row = {"section": kind, "params": list(params[:-1]), "error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
        runner.rows.append(row)
        print(_short(row), flush=True)
        common.write_partial(args.out, "bench_mla", payload)
        torch.cuda.empty_cache()

    path = common.write_json(args.out, "bench_mla", payload)
    print(f"# wrote {path}")
    print(summary(runner.rows, runner.limits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
