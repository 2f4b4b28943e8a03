"""FP8 (and bf16) context attention: the `cutlass` backend against FlashInfer fa3 (FP8 and bf16),
cuDNN SDPA (bf16) and our Triton path, on packed varlen batches of 16k tokens.

Each row times every implementation on the same inputs (CUDA graphs, common.time_us), reports
TFLOP/s (4 * sum(Lq * Lk_visible) * H * D), the ratio of each peer's time to ours, and the RMSE
against an fp32 reference on the same FP8 inputs (heads 0-1, for ours and FlashInfer's FP8).

Accuracy of incoherent processing (docs/cutlass.md, "Incoherent processing"): each row also runs
every FP8 implementation once on q/k with outlier channels (`add_outlier_channels_`), quantized
per tensor without and with a Hadamard rotation of q and k (`quant.quantize_qk_incoherent`):
`<impl>_outlier_rmse` and `<impl>_hadamard_outlier_rmse`, both against the fp32 reference on the
unquantized bf16 inputs (the whole quantization error, not only the kernel's). `hadamard_us`
is the rotation of q and k alone (two bf16 matmuls, unfused), per call.

    python benchmarks/bench_fp8.py [--quick | --shapes D:H:S[:B] ...] [--peers flashinfer_fa3,cudnn_sdpa,triton] [--out benchmarks/results]

A shape's optional B is the number of sequences (default: 16k tokens' worth); B = 1 is one
prompt's prefill, a grid of few waves.

The cutlass rows run the grid the automatic choice takes (the persistent one for short sequences,
`fmha_sm90.PERSISTENT_SHORT`); `ATTN_CUTLASS_PERSISTENT=1` / `0` forces the persistent / plain grid
(recorded in the JSON as `cutlass_persistent`: true, false, or null for automatic;
benchmarks/probe_cutlass.py puts both grids side by side).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch_ops  # noqa: E402
from torch_ops import quant, reference  # noqa: E402
from torch_ops.kernels.cuda import fmha_sm90  # noqa: E402

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
TOKENS = 16384
SHAPES = [(128, 32, 8192), (256, 16, 8192), (128, 32, 2048), (128, 32, 512)]   # (head dim, heads, sequence length)


def lengths(seqlen: int, ragged: bool, batch: int | None = None) -> list[int]:
    if not ragged:
        return [seqlen] * (batch or TOKENS // seqlen)
    rng, lens = random.Random(seqlen), []
    while sum(lens) < TOKENS:
        lens.append(min(rng.randint(seqlen // 8, 2 * seqlen), TOKENS - sum(lens)))
    return lens


def add_outlier_channels_(q: torch.Tensor, k: torch.Tensor, channels: int = 4, factor: float = 30.0,
                          score_std: float = 3.0) -> None:
    """Scale the same `channels` random channels per head of q and k `[T, H, D]` by `factor` (as
    in LLM activations), then q so that the scores' std is about `score_std` (not one-hot)."""
    heads, d = q.shape[1:]
    picked = torch.rand(heads, d, device=q.device).argsort(dim=1)[:, :channels]
    gain = torch.ones(heads, d, device=q.device).scatter_(1, picked, factor)
    score_var = (d - channels + channels * factor ** 4) / d
    q.mul_(gain * (score_std / score_var ** 0.5))
    k.mul_(gain)


class Case:
    """Random bf16 q/k/v `[T, H, D]` (q/k with outlier channels if asked), their per-tensor FP8
    quantization, and the FLOP count."""

    def __init__(self, lens, d, heads, causal, outliers=False):
        self.lens, self.d, self.heads, self.causal = lens, d, heads, causal
        t = sum(lens)
        self.cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to("cuda", torch.int32)
        self.q, self.k, self.v = (torch.randn(t, heads, d, device="cuda", dtype=BF16) for _ in range(3))
        if outliers:
            add_outlier_channels_(self.q, self.k)
        self.quantize(hadamard=False)
        pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
        self.flops = 4 * pairs * heads * d

    def quantize(self, hadamard: bool):
        """Set `q8/k8/v8` and `scales` (per tensor); with `hadamard`, q and k are rotated first."""
        if hadamard:
            self.q8, self.k8, q_scale, k_scale = quant.quantize_qk_incoherent(self.q, self.k)
        else:
            (self.q8, q_scale), (self.k8, k_scale) = quant.quantize_fp8_amax(self.q), quant.quantize_fp8_amax(self.k)
        self.v8, v_scale = quant.quantize_fp8_amax(self.v)
        self.scales = {"q_scale": q_scale, "k_scale": k_scale, "v_scale": v_scale}

    def ours(self, fp8: bool, backend: str):
        args = (self.q8, self.k8, self.v8) if fp8 else (self.q, self.k, self.v)
        out = torch.empty(self.q.shape, dtype=BF16, device="cuda")
        lse = torch.empty(self.q.shape[:2], device="cuda")
        scales = self.scales if fp8 else {}

        def fn():
            with torch_ops.use_backend(backend):
                torch.ops.attn.context_attention.out(*args, self.cu, self.cu, causal=self.causal, out=out, lse=lse, **scales)
        fn()
        return fn, out

    def flashinfer(self, fp8: bool):
        import flashinfer

        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(common.flashinfer_workspace(), "NHD", backend="fa3")
        dtype = E4M3 if fp8 else BF16
        w.plan(self.cu, self.cu, self.heads, self.heads, self.d, causal=self.causal, q_data_type=dtype,
               kv_data_type=dtype, o_data_type=BF16)
        # fa3 FP8 takes per-head descale tensors [H] positionally (a 0-d tensor is read out of bounds)
        descales = tuple(self.scales[f"{n}_scale"].expand(self.heads).contiguous() for n in "qkv")
        args = (self.q8, self.k8, self.v8, *descales) if fp8 else (self.q, self.k, self.v)
        out = torch.empty(self.q.shape, dtype=BF16, device="cuda")

        def fn():
            w.run(*args, out=out)
        fn()
        return fn, out

    def cudnn(self):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if len(set(self.lens)) != 1:
            raise RuntimeError("SDPA has no varlen input")
        b, s = len(self.lens), self.lens[0]
        q, k, v = (x.view(b, s, self.heads, self.d).transpose(1, 2) for x in (self.q, self.k, self.v))

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        fn()
        return fn, None

    def rmse(self, out: torch.Tensor, heads: int = 2, unquantized: bool = False) -> float:
        """RMSE of `out` (heads 0..heads-1) against the fp32 reference on the dequantized FP8 inputs,
        or with `unquantized` on the bf16 inputs before quantization (and rotation)."""
        sl = slice(0, heads)
        inputs, s = ((self.q, self.k, self.v), {}) if unquantized else ((self.q8, self.k8, self.v8), self.scales)
        truth, _ = reference.context_attention(*(x[:, sl] for x in inputs), self.cu, self.cu,
                                               causal=self.causal, compute_dtype=torch.float32, **s)
        diff = out[:, sl].float() - truth.float()
        if not torch.isfinite(diff).all():
            raise RuntimeError(f"{(~torch.isfinite(diff)).float().mean().item():.1%} of the output is not finite")
        return (diff ** 2).mean().sqrt().item()


def time_us(fn) -> tuple[float, str]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e6
    return common.time_us([fn], calls=int(max(1, min(20, 40_000 // max(one, 1.0)))), replays=7)


def implementations(case: Case, peers: list[str]) -> dict:
    """name -> a function that prepares the implementation on `case` and returns `(fn, out)`."""
    impls = {"cutlass_fp8": lambda: case.ours(True, "cutlass"), "cutlass_bf16": lambda: case.ours(False, "cutlass")}
    if "triton" in peers:
        impls.update(triton_fp8=lambda: case.ours(True, "triton"), triton_bf16=lambda: case.ours(False, "triton"))
    if "flashinfer_fa3" in peers:
        impls.update(flashinfer_fa3_fp8=lambda: case.flashinfer(True), flashinfer_fa3_bf16=lambda: case.flashinfer(False))
    if "cudnn_sdpa" in peers:
        impls["cudnn_sdpa_bf16"] = case.cudnn
    return impls


def outlier_accuracy(case: Case, peers: list[str]) -> dict:
    """`<impl>[_hadamard]_outlier_rmse` of every FP8 implementation on `case` (outlier data) without
    and with the rotation of q and k, and `hadamard_us`, the rotation's time per call."""
    row = {}
    fp8 = {name: make for name, make in implementations(case, peers).items() if name.endswith("fp8")}
    for hadamard in (False, True):
        case.quantize(hadamard)
        for name, make in fp8.items():
            key = f"{name}{'_hadamard' if hadamard else ''}_outlier_rmse"
            try:
                row[key] = case.rmse(make()[1], unquantized=True)
            except Exception as e:  # noqa: BLE001 - recorded like an unavailable peer
                row[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
            torch.cuda.synchronize()
    row["hadamard_us"], _ = time_us(lambda: (quant.hadamard_rotate(case.q), quant.hadamard_rotate(case.k)))
    return row


def bench_row(case: Case, outlier_case: Case, peers: list[str], label: str) -> dict:
    row = {"case": label, "d": case.d, "heads": case.heads, "causal": case.causal, "num_seqs": len(case.lens),
           "max_len": max(case.lens), "tflop": case.flops / 1e12}
    impls = implementations(case, peers)
    for name, make in impls.items():
        try:
            fn, out = make()
            us, how = time_us(fn)
            row[f"{name}_us"], row[f"{name}_tflops"], row[f"{name}_timing"] = us, case.flops / us / 1e6, how
            if out is not None and name.endswith("fp8"):
                try:
                    row[f"{name}_rmse"] = case.rmse(out)
                except RuntimeError as e:
                    row[f"{name}_rmse"] = f"error: {e}"
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is recorded with the reason
            row[name] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
    for name in impls:
        if f"{name}_us" in row and "cutlass_fp8_us" in row and name != "cutlass_fp8":
            row[f"{name}_vs_cutlass_fp8"] = row[f"{name}_us"] / row["cutlass_fp8_us"]
    row.update(outlier_accuracy(outlier_case, peers))
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="D=128 S=8k only")
    p.add_argument("--shapes", nargs="*", help="D:H:S or D:H:S:B (B sequences; default: all of SHAPES)")
    p.add_argument("--peers", default="flashinfer_fa3,cudnn_sdpa,triton")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    peers = args.peers.split(",") if args.peers else []
    persistent = fmha_sm90.persistent_mode()
    print(f"cutlass kernels: {({True: 'persistent', False: 'plain'}).get(persistent, 'automatic')} grid", flush=True)
    rows = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    for d, heads, seqlen, *batch in shapes:
        batch = batch[0] if batch else None
        for causal in (False, True):
            for ragged in ((False, True) if seqlen == 8192 and d == 128 and batch is None else (False,)):
                label = f"S={seqlen}{' ragged' if ragged else ''}{f' B={batch}' if batch else ''} D={d} H={heads}"
                lens = lengths(seqlen, ragged, batch)
                rows.append(bench_row(Case(lens, d, heads, causal), Case(lens, d, heads, causal, outliers=True),
                                      peers, label))
                r = rows[-1]
                cells = [f"{k.removesuffix('_tflops')}={r[k]:.0f}" for k in r if k.endswith("_tflops")]
                rm = [f"{k.removesuffix('_rmse')} rmse={r[k]:.2e}" if isinstance(r[k], float) else f"{k}: {r[k]}"
                      for k in r if k.endswith("_rmse")]
                print(f"{label:28} causal={causal!s:5} " + " ".join(cells) + " | " + " ".join(rm)
                      + f" | hadamard_us={r['hadamard_us']:.1f}", flush=True)
                for k in r:
                    if isinstance(r[k], str) and r[k].startswith("unavailable"):
                        print(f"   {k}: {r[k]}", flush=True)
    path = common.write_json(args.out, "fp8", {"env": common.environment(), "cutlass_persistent": persistent,
                                               "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    import torch_ops

    torch_ops.warmup()   # the CUTLASS and CUDA decode libraries, which the automatic choice uses once built
    main()
