"""Prefill attention: our kernels (`attn::context_attention`, `attn::paged_prefill`) against peers.

Usage (GPU machine):  python benchmarks/bench_prefill.py [--quick] [--check] [--tune] [--out DIR]
  --quick      ~2-minute subset (D=128, S in {2k, 8k}, one paged and one mixed case, few peers)
  --check      verify each of our configurations against the float64 reference first (max error)
  --tune       sweep tile configs of our kernel (prefill_attention.tuning) on a few shapes
  --sections / --seqlens / --head-dims / --peers / --flex-head-dims / --budget-s select a subset
Writes JSON (GPU, versions, date, commit, every measurement) under --out (default
benchmarks/results/) and prints a compact table last.

Notes
-----
* FLOPs: 4 * Hq * D * (visible query-key pairs). Non-causal: sum_b Lq_b * Lk_b; causal context
  attention counts half of that (the FlashAttention convention); the
  paged cases count their exact pairs (a chunk of C queries over a prefix of P keys sees
  C * P + C * (C + 1) / 2). TFLOP/s = FLOPs / time.
* Context attention follows the FA3-paper sizing: 16k tokens in total (batch = 16k / S), Hq = Hkv
  = 32, bf16. "ragged" batches hold the same 16k tokens in sequences of random lengths (0.25x to
  1.75x S, at least two sequences): peers without varlen input (SDPA) are skipped there.
* Paged prefill over a cached prefix: Llama-style GQA 32/8, D = 128, 16-token pages on a random
  page permutation; "ours_contiguous" runs context_attention on the same keys gathered into one
  packed tensor (the cost of paging). The mixed batch (prefills, chunks and decodes in one launch)
  is compared with the sum of its parts, each launched alone (decodes also through paged_decode).
* Peers run in the same process on the same inputs, each optional (the reason it is missing is
  recorded): flash and cuDNN SDPA (torch.nn.attention.sdpa_kernel, uniform batches), FlashInfer
  BatchPrefillWithRaggedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper with backend "fa3"
  and "fa2", compiled FlexAttention (causal / document block masks; a few shapes: compile time).
* Expected (H100 SXM, bf16 forward, 16k tokens): FA2 ~320-370 TFLOP/s,
  Triton-tutorial ~390-400 (D=128 non-causal), FA3 ~500-650, cuDNN ~400-600. Our kernel is an
  FA2-style Triton kernel (wgmma via Triton, cp.async pipelining, no warp specialization or TMA):
  the Triton-tutorial level is the target.
* Timing: benchmarks/common.py (CUDA graph of back-to-back calls, median of replays), with the
  number of calls per graph chosen from a first eager timing (~40 ms of work per replay).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TOTAL_TOKENS = 16384
HEADS = 32
SEQLENS = [512, 2048, 8192, 16384]
HEAD_DIMS = [64, 128, 256]
QUICK_SEQLENS = [2048, 8192]
QUICK_HEAD_DIMS = [128]
PAGE = 16   # default cache block size (vLLM's)
PEERS = ["flash_sdpa", "cudnn_sdpa", "flashinfer_fa3", "flashinfer_fa2", "flex"]
SECTIONS = ["context", "paged", "mixed"]
# paged prefill over a cached prefix: (batch, prefix, chunk)
PAGED_CASES = [(4, 2048, 512), (4, 8192, 2048), (1, 16384, 4096), (16, 4096, 256)]
PAGED_BLOCK_SIZES = [16, 64]     # every paged case in each; 32 and 128 on one case
QUICK_PAGED_CASES = [(4, 8192, 2048)]
# mixed batch: (name, [(q_len, seq_len), ...]) in launch order
MIXED_CASES = [
    ("1x2k prefill + 2x512 chunks on 4k + 64 decodes on 2k",
     [(2048, 2048)] + [(512, 4608)] * 2 + [(1, 2048)] * 64),
    ("4x1k chunks on 8k + 128 decodes on 4k",
     [(1024, 9216)] * 4 + [(1, 4096)] * 128),
]
TUNE_CONFIGS = {   # head dim -> (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
}


# ------------------------------------------------------------------------------------------------
# problems
# ------------------------------------------------------------------------------------------------


def seq_lengths(seqlen: int, ragged: bool, rng: random.Random) -> list[int]:
    """Lengths of a batch of TOTAL_TOKENS tokens: uniform (all `seqlen`) or ragged (random
    lengths of 0.25x to 1.75x `seqlen`, at least two sequences, same total)."""
    batch = max(1, TOTAL_TOKENS // seqlen)
    if not ragged:
        return [seqlen] * batch
    batch = max(2, batch)
    w = [rng.uniform(0.25, 1.75) for _ in range(batch)]
    lens = [max(1, int(TOTAL_TOKENS * x / sum(w))) for x in w]
    lens[-1] += TOTAL_TOKENS - sum(lens)
    return lens


def cumsum0(lens) -> torch.Tensor:
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


class ContextCase:
    """Packed self-attention: q/k/v [T, H, D] bf16, `cu_seqlens`."""

    def __init__(self, lens, d, causal, heads=HEADS):
        self.lens, self.d, self.causal, self.heads = lens, d, causal, heads
        t = sum(lens)
        self.q, self.k, self.v = (torch.randn(t, heads, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        self.cu = cumsum0(lens)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(t, heads, dtype=torch.float32, device="cuda")

    @property
    def flops(self) -> float:
        pairs = sum(n * n for n in self.lens)
        return 4 * self.heads * self.d * pairs * (0.5 if self.causal else 1.0)

    def ours(self, backend: str | None = None):
        """Our context_attention on `backend` (None: the automatic choice, CUTLASS on Hopper where
        it serves the call, else Triton)."""
        import torch_ops

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.context_attention.out(self.q, self.k, self.v, self.cu, self.cu, causal=self.causal,
                                                     out=self.out, lse=self.lse)
        return fn

    def triton_launch(self):
        """The Triton kernel's prepared launch of this case, run once (its `kernels` compiled)."""
        from torch_ops.kernels.triton import context_attention

        args, kw = (self.q, self.k, self.v, self.cu, self.cu), dict(causal=self.causal, out=self.out, lse=self.lse)
        return common.run_prepared(context_attention, *args, **kw)

    def backend(self) -> str:
        import torch_ops

        return torch_ops.backend_for("context_attention", self.q, self.k, self.v, self.cu, self.cu, causal=self.causal)


def backend_for_case(case: "PagedCase") -> str:
    import torch_ops

    return torch_ops.backend_for("paged_prefill", case.q, case.k, case.v, case.block_tables, case.cu, case.sl,
                                 causal=case.causal)


class PagedCase:
    """Queries over a paged bf16 cache: `specs` = [(q_len, seq_len)], GQA `hq/hkv`, 16-token pages on
    a random permutation; the query rows are the last `q_len` positions of each sequence."""

    def __init__(self, specs, d=128, hq=32, hkv=8, causal=True, cache=None, page_ids=None, page=PAGE):
        self.specs, self.d, self.hq, self.hkv, self.causal, self.page = specs, d, hq, hkv, causal, page
        self.q_lens = [s[0] for s in specs]
        self.seq_lens = [s[1] for s in specs]
        pages = [-(-n // page) for n in self.seq_lens]
        if cache is None:
            nb = sum(pages)
            cache = tuple(torch.randn(nb, page, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            perm = torch.randperm(nb).tolist()
            page_ids = [[perm.pop() for _ in range(n)] for n in pages]
        self.k, self.v = cache
        self.page_ids = page_ids
        width = max(pages + [1])
        table = torch.zeros(len(specs), width, dtype=torch.int32)
        for b, ids in enumerate(self.page_ids):
            table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.block_tables = table.cuda()
        self.cu = cumsum0(self.q_lens)
        self.sl = torch.tensor(self.seq_lens, dtype=torch.int32, device="cuda")
        t = sum(self.q_lens)
        self.q = torch.randn(t, hq, d, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(t, hq, dtype=torch.float32, device="cuda")

    def subset(self, idx: list[int]) -> "PagedCase":
        """The sequences `idx` alone, over the same cache pages."""
        return PagedCase([self.specs[i] for i in idx], self.d, self.hq, self.hkv, self.causal,
                         cache=(self.k, self.v), page_ids=[self.page_ids[i] for i in idx], page=self.page)

    @property
    def flops(self) -> float:
        pairs = 0
        for ql, sl in self.specs:
            pairs += ql * (sl - ql) + ql * (ql + 1) // 2 if self.causal else ql * sl
        return 4 * self.hq * self.d * pairs

    def ours(self, backend: str | None = None):
        """paged_prefill on the backend the automatic choice takes, or on `backend`."""
        import torch_ops

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.paged_prefill.out(self.q, self.k, self.v, self.block_tables, self.cu, self.sl,
                                                 causal=self.causal, out=self.out, lse=self.lse)
        return fn

    def triton_launch(self):
        """The Triton kernel's prepared launch of this case, run once (its `kernels` compiled)."""
        from torch_ops.kernels.triton import paged_prefill

        args = (self.q, self.k, self.v, self.block_tables, self.cu, self.sl)
        kw = dict(causal=self.causal, out=self.out, lse=self.lse)
        return common.run_prepared(paged_prefill, *args, **kw)

    def ours_decode(self):
        """paged_decode on this (decode-only) batch: the sibling kernel."""
        import torch_ops

        def fn():
            with torch_ops.use_backend("triton"):
                torch.ops.attn.paged_decode.out(self.q, self.k, self.v, self.block_tables, self.sl,
                                                out=self.out, lse=self.lse)
        return fn

    def contiguous(self):
        """Our context_attention (the automatic choice: CUTLASS on Hopper) over the same keys gathered
        into packed K/V (no paging)."""
        import torch_ops

        ks, vs = [], []
        for b, n in enumerate(self.seq_lens):
            idx = torch.tensor(self.page_ids[b], device="cuda", dtype=torch.long)
            ks.append(self.k[idx].flatten(0, 1)[:n])
            vs.append(self.v[idx].flatten(0, 1)[:n])
        k, v = torch.cat(ks), torch.cat(vs)
        cu_k = cumsum0(self.seq_lens)

        def fn():
            with torch_ops.use_backend(None):
                torch.ops.attn.context_attention.out(self.q, k, v, self.cu, cu_k, causal=self.causal,
                                                     out=self.out, lse=self.lse)
        return fn


# ------------------------------------------------------------------------------------------------
# peers (each returns a callable or raises with the reason)
# ------------------------------------------------------------------------------------------------


def sdpa_fn(case: ContextCase, backend_name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    if len(set(case.lens)) != 1:
        raise RuntimeError("no varlen input in SDPA (padding would time a different problem)")
    b, s = len(case.lens), case.lens[0]
    q, k, v = (x.view(b, s, case.heads, case.d).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v))
    backend = getattr(SDPBackend, backend_name)

    def fn():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    fn()
    return fn


def flashinfer_context_fn(case: ContextCase, backend: str):
    import flashinfer

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(common.flashinfer_workspace(), "NHD", backend=backend)
    w.plan(case.cu, case.cu, case.heads, case.heads, case.d, causal=case.causal, q_data_type=torch.bfloat16)

    def fn():
        w.run(case.q, case.k, case.v)
    fn()
    return fn


def flashinfer_paged_fn(case: PagedCase, backend: str):
    import flashinfer

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(common.flashinfer_workspace(), "NHD", backend=backend)
    pages = [len(ids) for ids in case.page_ids]
    indptr = cumsum0(pages)
    indices = torch.tensor([i for ids in case.page_ids for i in ids], dtype=torch.int32, device="cuda")
    last = torch.tensor([n - (p - 1) * case.page for n, p in zip(case.seq_lens, pages)], dtype=torch.int32,
                        device="cuda")
    w.plan(case.cu, indptr, indices, last, case.hq, case.hkv, case.d, case.page, causal=case.causal,
           q_data_type=torch.bfloat16)

    def fn():
        w.run(case.q, (case.k, case.v))
    fn()
    return fn


_FLEX = None


def flex_fn(case: ContextCase):
    """Compiled FlexAttention: [B, H, S, D] with a causal block mask (uniform batches), or the
    packed tokens as one sequence with a document mask (ragged)."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    causal = case.causal
    if len(set(case.lens)) == 1:
        b, s = len(case.lens), case.lens[0]
        q, k, v = (x.view(b, s, case.heads, case.d).transpose(1, 2).contiguous() for x in (case.q, case.k, case.v))

        def mask_mod(b_, h_, qi, ki):
            return qi >= ki
        mask = create_block_mask(mask_mod, None, None, s, s, device="cuda") if causal else None
    else:
        t = sum(case.lens)
        q, k, v = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (case.q, case.k, case.v))
        doc = torch.repeat_interleave(torch.arange(len(case.lens), device="cuda"),
                                      torch.tensor(case.lens, device="cuda"))

        def mask_mod(b_, h_, qi, ki):
            same = doc[qi] == doc[ki]
            return same & (qi >= ki) if causal else same
        mask = create_block_mask(mask_mod, None, None, t, t, device="cuda")

    def fn():
        _FLEX(q, k, v, block_mask=mask)
    fn()
    return fn


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


def kernel_report(case) -> dict:
    """Resources of the Triton prefill kernel of `case` (registers, spills, shared memory)."""
    k = case.triton_launch().kernels[0].kernel
    rep = {}
    try:
        rep.update(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                   num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages)
        rep["wgmma"] = k.asm["ptx"].count("wgmma.mma_async")
    except Exception as e:  # noqa: BLE001
        rep["error"] = f"{type(e).__name__}: {str(e)[:100]}"
    return rep


def _error_row(out, truth, base) -> dict:
    from torch_ops.testing import max_error, rounding_floor

    err, base_err = max_error(out, truth), max_error(base, truth)
    floor = rounding_floor(truth, out.dtype) + 1e-6
    return {"max_err": err, "baseline_err": base_err, "ok": bool(err <= 2 * base_err + floor)}


def check_context(case: ContextCase, rows: int = 512, heads: int = 2) -> dict:
    """Our output for the last `rows` queries of the first sequence (first `heads` heads) against the
    float64 reference on the same rows: bottom-right alignment puts them at the same positions."""
    from torch_ops import reference

    case.ours()()
    torch.cuda.synchronize()
    n = case.lens[0]
    r = min(rows, n)
    q = case.q[n - r:n, :heads]
    k, v = case.k[:n, :heads], case.v[:n, :heads]
    cu_q = torch.tensor([0, r], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    truth, _ = reference.context_attention(q, k, v, cu_q, cu_k, causal=case.causal, compute_dtype=torch.float64)
    base, _ = reference.context_attention(q, k, v, cu_q, cu_k, causal=case.causal, compute_dtype=torch.bfloat16)
    return _error_row(case.out[n - r:n, :heads], truth, base)


def check_paged(case: PagedCase, seqs: int = 4, rows: int = 512) -> dict:
    """Our output for the last `rows` queries of a few sequences against the float64 reference."""
    from torch_ops import reference

    case.ours()()
    torch.cuda.synchronize()
    results = []
    starts = case.cu.tolist()
    for b in range(min(seqs, len(case.specs))):
        r = min(rows, case.specs[b][0])
        if r == 0:
            continue
        q = case.q[starts[b + 1] - r:starts[b + 1]]
        cu_q = torch.tensor([0, r], dtype=torch.int32, device="cuda")
        args = (case.k, case.v, case.block_tables[b:b + 1], cu_q, case.sl[b:b + 1])
        truth, _ = reference.paged_prefill(q, *args, causal=case.causal, compute_dtype=torch.float64)
        base, _ = reference.paged_prefill(q, *args, causal=case.causal, compute_dtype=torch.bfloat16)
        results.append(_error_row(case.out[starts[b + 1] - r:starts[b + 1]], truth, base))
    return max(results, key=lambda x: (not x["ok"], x["max_err"]), default={})


class Runner:
    def __init__(self, args):
        self.args = args
        self.t_end = time.time() + args.budget_s
        self.rows: list[dict] = []
        self.flex_left = 2 if args.quick else 16

    def time_left(self) -> float:
        return self.t_end - time.time()

    def peer(self, row: dict, name: str, make, flops: float, ours_us: float) -> None:
        """Time peer `name` (built by `make()`), or record why it is missing."""
        if self.time_left() < 20:
            row[name] = "skipped: time budget"
            return
        try:
            us, how = common.time_long_us(make())
            row[f"{name}_us"], row[f"{name}_timing"] = us, how
            row[f"{name}_tflops"] = flops / us / 1e6
            row[f"vs_{name}"] = us / ours_us
        except Exception as e:  # noqa: BLE001
            row[name] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"
        torch.cuda.synchronize()

    def ours(self, row: dict, case, check) -> float | None:
        if self.args.check:
            row["check"] = common.run_check(check)
        flops = case.flops
        try:
            us, how = common.time_long_us(case.ours())
        except Exception as e:  # noqa: BLE001
            row["error"] = f"ours: {type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
            return None
        row.update(ours_us=us, ours_timing=how, ours_tflops=flops / us / 1e6, kernel=kernel_report(case))
        return us

    def context(self, seqlen: int, d: int, causal: bool, ragged: bool) -> dict:
        rng = random.Random(seqlen * 1000 + d)
        lens = seq_lengths(seqlen, ragged, rng)
        row = {"section": "context", "seqlen": seqlen, "d": d, "causal": causal,
               "batch": "ragged" if ragged else "uniform", "num_seqs": len(lens), "heads": HEADS}
        case = ContextCase(lens, d, causal)
        row["tflop"], row["backend"] = case.flops / 1e12, case.backend()
        us = self.ours(row, case, lambda: check_context(case))
        if us is None:
            return row
        peers = self.args.peers
        if row["backend"] != "triton":
            row["kernel"] = {"backend": row["backend"]}   # kernel_report() describes Triton kernels only
            self.peer(row, "ours_triton", lambda: case.ours("triton"), case.flops, us)
        if "flash_sdpa" in peers:
            self.peer(row, "flash_sdpa", lambda: sdpa_fn(case, "FLASH_ATTENTION"), case.flops, us)
        if "cudnn_sdpa" in peers:
            self.peer(row, "cudnn_sdpa", lambda: sdpa_fn(case, "CUDNN_ATTENTION"), case.flops, us)
        for backend in ("fa3", "fa2"):
            if f"flashinfer_{backend}" in peers:
                self.peer(row, f"flashinfer_{backend}", lambda: flashinfer_context_fn(case, backend), case.flops, us)
        if "flex" in peers:
            if self.flex_left > 0 and d in self.args.flex_head_dims and seqlen in (2048, 8192):
                self.flex_left -= 1
                self.peer(row, "flex", lambda: flex_fn(case), case.flops, us)
            else:
                row["flex"] = "skipped: compile-time budget (a few shapes only)"
        return row

    def paged(self, batch: int, prefix: int, chunk: int, page: int = PAGE, d: int = 128) -> dict:
        case = PagedCase([(chunk, prefix + chunk)] * batch, d=d, page=page)
        row = {"section": "paged", "desc": f"{batch}x {chunk} on {prefix} cached, {page}-token blocks", "d": case.d,
               "causal": True, "block_size": page,
               "heads": f"{case.hq}/{case.hkv}", "tflop": case.flops / 1e12}
        us = self.ours(row, case, lambda: check_paged(case))
        if us is None:
            return row
        self.peer(row, "ours_contiguous", case.contiguous, case.flops, us)
        self.other_backends(row, case, us)
        for backend in ("fa3", "fa2"):
            if f"flashinfer_{backend}" in self.args.peers:
                self.peer(row, f"flashinfer_{backend}", lambda: flashinfer_paged_fn(case, backend), case.flops, us)
        return row

    def other_backends(self, row: dict, case: "PagedCase", us: float) -> None:
        """Record which backend the automatic choice took, and time the others as peers."""
        row["backend"] = backend_for_case(case)
        for backend in ("triton", "cutlass", "mixed"):
            if backend != row["backend"]:
                self.peer(row, f"ours_{backend}", lambda: case.ours(backend), case.flops, us)

    def mixed(self, name: str, specs: list[tuple[int, int]]) -> dict:
        order = list(range(len(specs)))
        random.Random(len(specs)).shuffle(order)
        case = PagedCase([specs[i] for i in order])
        row = {"section": "mixed", "desc": name, "d": case.d, "causal": True, "heads": f"{case.hq}/{case.hkv}",
               "tflop": case.flops / 1e12}
        us = self.ours(row, case, lambda: check_paged(case, seqs=len(specs)))
        if us is None:
            return row
        kinds = {"prefill": lambda s: s[0] == s[1] and s[0] > 1, "chunk": lambda s: 1 < s[0] < s[1],
                 "decode": lambda s: s[0] == 1}
        parts_us = 0.0
        for kind, pick in kinds.items():
            idx = [i for i, s in enumerate(case.specs) if pick(s)]
            if not idx:
                continue
            part = case.subset(idx)
            try:
                t, _ = common.time_long_us(part.ours())
                row[f"part_{kind}_us"] = t
                parts_us += t
                if kind == "decode":
                    row["part_decode_paged_decode_us"], _ = common.time_long_us(part.ours_decode())
            except Exception as e:  # noqa: BLE001
                row[f"part_{kind}"] = f"error: {type(e).__name__}: {str(e)[:160]}"
        row["parts_sum_us"] = parts_us
        row["mixed_vs_parts"] = parts_us / us
        self.other_backends(row, case, us)
        for backend in ("fa3", "fa2"):
            if f"flashinfer_{backend}" in self.args.peers:
                self.peer(row, f"flashinfer_{backend}", lambda: flashinfer_paged_fn(case, backend), case.flops, us)
        return row

    def tune(self) -> list[dict]:
        """Our kernel under each candidate config (S = 8k uniform context, both masks; one paged case)."""
        from torch_ops.kernels.triton import prefill_attention as pa

        out = []
        jobs = [("context", d, causal) for d in self.args.head_dims for causal in (False, True)]
        jobs.append(("paged", 128, True))
        for kind, d, causal in jobs:
            case = ContextCase(seq_lengths(8192, False, random.Random(0)), d, causal) if kind == "context" \
                else PagedCase([(2048, 10240)] * 4)
            for cfg in [None] + TUNE_CONFIGS.get(d, []):
                if self.time_left() < 30:
                    return out
                names = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
                res = {"kind": kind, "d": d, "causal": causal,
                       "config": "default" if cfg is None else dict(zip(names, cfg))}
                try:
                    with pa.tuning(config=None if cfg is None else res["config"]):
                        us, _ = common.time_long_us(case.ours())
                        res.update(us=us, tflops=case.flops / us / 1e6, kernel=kernel_report(case))
                except Exception as e:  # noqa: BLE001
                    res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(res)
                k = res.get("kernel", {})
                print(f"tune {kind:7} d{d:<3} causal={causal!s:5} {str(res['config']):70} "
                      + (f"{res['tflops']:6.1f} TFLOP/s regs={k.get('n_regs')} spills={k.get('n_spills')} "
                         f"smem={k.get('shared')}" if "us" in res else res["error"]), flush=True)
            del case
            torch.cuda.empty_cache()
        return out


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--sections", nargs="*", default=SECTIONS, choices=SECTIONS)
    p.add_argument("--seqlens", type=int, nargs="*")
    p.add_argument("--head-dims", type=int, nargs="*")
    p.add_argument("--paged-head-dims", type=int, nargs="*", default=[128], help="head dims of the paged section")
    p.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS)
    p.add_argument("--flex-head-dims", type=int, nargs="*", default=[128],
                   help="head dims at which FlexAttention runs (S = 2k and 8k; each shape compiles)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop measuring after this many seconds")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill needs a CUDA GPU")
        return 1
    args.seqlens = args.seqlens or (QUICK_SEQLENS if args.quick else SEQLENS)
    args.head_dims = args.head_dims or (QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    if args.quick:
        args.budget_s = min(args.budget_s, 150)

    env = common.environment()
    print(f"# {env.get('gpu')}  torch {env['torch']}  triton {env['triton']}  flashinfer {env['flashinfer']}",
          flush=True)
    runner = Runner(args)
    payload = {"env": env, "args": vars(args), "rows": runner.rows}
    if args.tune:
        payload["tune"] = runner.tune()
        common.write_partial(args.out, "bench_prefill", payload)

    jobs = []
    if "context" in args.sections:
        jobs += [("context", (s, d, c, r)) for d in args.head_dims for s in args.seqlens
                 for c in (False, True) for r in (False, True)]
    if "paged" in args.sections:
        for d in args.paged_head_dims:
            jobs += [("paged", (*c, page, d)) for c in (QUICK_PAGED_CASES if args.quick else PAGED_CASES)
                     for page in PAGED_BLOCK_SIZES]
            if not args.quick:
                jobs += [("paged", (4, 8192, 2048, page, d)) for page in (32, 128)]
    if "mixed" in args.sections:
        jobs += [("mixed", c) for c in (MIXED_CASES[:1] if args.quick else MIXED_CASES)]
    if args.quick:   # one case of each section first, so that the time budget reaches them all
        firsts = [next(j for j in jobs if j[0] == kind) for kind in SECTIONS if any(j[0] == kind for j in jobs)]
        jobs = firsts + [j for j in jobs if j not in firsts]
    for kind, params in jobs:
        if runner.time_left() < 15:
            runner.rows.append({"section": kind, "params": list(params)[:2], "skipped": "time budget"})
            continue
        try:
            row = getattr(runner, kind)(*params)
        except Exception as e:  # noqa: BLE001
            row = {"section": kind, "params": str(params)[:100], "error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        runner.rows.append(row)
        print(_short(row), flush=True)
        common.write_partial(args.out, "bench_prefill", payload)
        torch.cuda.empty_cache()

    path = common.write_json(args.out, "bench_prefill", payload)
    print(f"# wrote {path}")
    print(summary(runner.rows))
    return 0


def _label(r: dict) -> str:
    if r.get("section") == "context":
        return f"ctx S={r['seqlen']} {r['batch']}"
    return f"{r.get('section')} {r.get('desc', r.get('params', ''))}"


def _short(r: dict) -> str:
    if r.get("skipped") or r.get("error") and not r.get("ours_us"):
        return f"{_label(r)}: {r.get('skipped') or r.get('error')}"
    s = f"{_label(r):45} d{r['d']} causal={r['causal']!s:5} ours {r['ours_us']:9.1f} us {r['ours_tflops']:6.1f} TFLOP/s"
    for peer in ["ours_contiguous"] + PEERS:
        if f"{peer}_tflops" in r:
            s += f" | {peer} {r[peer + '_tflops']:.1f}"
        elif isinstance(r.get(peer), str):
            s += f" | {peer} n/a"
    if "mixed_vs_parts" in r:
        s += f" | parts {r['parts_sum_us']:.1f} us (x{r['mixed_vs_parts']:.2f})"
    if "check" in r:
        c = r["check"]
        s += f" | err {c.get('max_err', math.nan):.1e}/{c.get('baseline_err', math.nan):.1e}"
    return s


def summary(rows: list[dict]) -> str:
    cols = [("label", "case".ljust(44), "s"), ("d", "D", "d"), ("causal", "causal", "s"),
            ("ours_tflops", "ours_TF", ".1f"),
            ("flash_sdpa_tflops", "flash_TF", ".1f"), ("cudnn_sdpa_tflops", "cudnn_TF", ".1f"),
            ("flashinfer_fa3_tflops", "FIfa3_TF", ".1f"), ("flashinfer_fa2_tflops", "FIfa2_TF", ".1f"),
            ("flex_tflops", "flex_TF", ".1f"), ("ours_contiguous_tflops", "contig_TF", ".1f"),
            ("best_vs_ours", "xbest", ".2f"), ("mixed_vs_parts", "parts/mix", ".2f"), ("err", "err_ok", "s")]
    view = []
    for r in rows:
        if not r.get("ours_us"):
            continue
        v = dict(r, label=_label(r)[:44].ljust(44), causal=str(r["causal"]))
        peers = [r[f"{p}_us"] for p in PEERS if isinstance(r.get(f"{p}_us"), float)]
        v["best_vs_ours"] = min(peers) / r["ours_us"] if peers else None
        if "check" in r:
            v["err"] = "ok" if r["check"].get("ok") else "BAD"
        view.append(v)
    head = "TFLOP/s (causal context counted as half); xbest = best peer time / ours (> 1: ours faster)"
    return head + "\n" + common.table(view, cols)


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    sys.exit(main())
