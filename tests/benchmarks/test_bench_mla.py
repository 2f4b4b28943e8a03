"""benchmarks/bench_mla.py on CPU: its command line, byte and FLOP counts, rates, the summary table
on synthetic rows, and its decode and prefill problems through the ops and its checks (the
reference, and the Triton kernels under the interpreter)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_ops.testing import assert_error_ratio

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_mla", ROOT / "benchmarks" / "bench_mla.py")
bench_mla = importlib.util.module_from_spec(_spec)
sys.modules["bench_mla"] = bench_mla
_spec.loader.exec_module(bench_mla)

LIMITS = {"hbm_TBps": 4.8, "read_GBps": 4000.0, "bf16_TFLOPs": 989}


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_mla.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "flashinfer_fa3" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_main_without_cuda_says_so(capsys):
    assert bench_mla.main(["--quick"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_uses_only_the_public_modules():
    source = (ROOT / "benchmarks" / "bench_mla.py").read_text()
    for private in ("torch_ops.kernels", "decode_sm90", "fmha_sm90", "cutlass"):
        assert private not in source


def test_counts():
    assert bench_mla.latent_bytes(2, 1024, "bf16") == 2 * 1024 * 576 * 2
    assert bench_mla.latent_bytes(2, 1024, "fp8") == 2 * 1024 * 576
    assert bench_mla.decode_flops(2, 1024, 128) == 2 * 2 * 128 * 1024 * (576 + 512)
    assert bench_mla.decompressed_bytes(1, 1024, 16) == 16 * 1024 * (192 + 128) * 2
    assert bench_mla.prefill_flops([4, 2], 128) == 2 * 128 * (192 + 128) * (16 + 4) / 2
    assert bench_mla.prefill_flops([4], 1, causal=False) == 2 * (192 + 128) * 16
    assert bench_mla.common.nominal_limits("NVIDIA H100 80GB HBM3")[0] == 3.35
    assert bench_mla.common.nominal_limits("NVIDIA H200")[0] == 4.8


def test_rates():
    row = {}
    bench_mla.rates(row, "ours", 100.0, 4.8e8, 9.89e10, LIMITS)
    assert row["ours_us"] == 100.0
    assert row["ours_GBps"] == pytest.approx(4800) and row["ours_pct_hbm"] == pytest.approx(100)
    assert row["ours_pct_read"] == pytest.approx(120)
    assert row["ours_tflops"] == pytest.approx(989) and row["ours_pct_peak"] == pytest.approx(100)
    prefill = {}
    bench_mla.rates(prefill, "cudnn_sdpa", 10.0, None, 1e9, LIMITS)
    assert "cudnn_sdpa_GBps" not in prefill and prefill["cudnn_sdpa_tflops"] == pytest.approx(100)


def test_decode_grid_order():
    jobs = bench_mla.decode_jobs([1, 8], [1024], [16, 128], ["bf16", "fp8"])
    assert jobs[:3] == [(1, 1024, 16, "bf16"), (8, 1024, 16, "bf16"), (1, 1024, 128, "bf16")]
    assert len(jobs) == 8 and jobs[-1] == (8, 1024, 128, "fp8")


def decode_row(batch, fmt="bf16", hq=128, us=200.0, **peers):
    row = {"section": "decode", "batch": batch, "ctx": 4096, "hq": hq, "fmt": fmt, "backend": "triton",
           "latent_bytes": bench_mla.latent_bytes(batch, 4096, fmt), "check": {"ok": True}}
    bench_mla.rates(row, "ours", us, row["latent_bytes"], bench_mla.decode_flops(batch, 4096, hq), LIMITS)
    return {**row, **peers}


def test_summary_on_synthetic_rows():
    rows = [decode_row(64, flashinfer_fa2_us=300.0, flashinfer_fa3_us=250.0),
            {**decode_row(1, us=10.0), "flashinfer_fa2": "unavailable: ImportError: no flashinfer",
             "check": {"ok": False}},
            {"section": "decode", "params": [128, 16384, 128, "fp8"], "error": "RuntimeError: boom"},
            {"section": "prefill", "seqlen": 4096, "num_seqs": 4, "hq": 128, "backend": "triton", "ours_us": 5000.0,
             "ours_tflops": 420.0, "ours_pct_peak": 42.5, "flashinfer_fa3_us": 4000.0, "flashinfer_fa3_tflops": 525.0}]
    text = bench_mla.summary(rows, LIMITS)
    lines = text.splitlines()
    assert lines[0].startswith("HBM 4.8 TB/s nominal, read 4000 GB/s measured")
    decode = [line.split() for line in lines[1:4]]
    assert decode[0][:6] == ["B", "ctx", "Hq", "kv", "backend", "ours_us"]
    assert decode[1] == ["64", "4096", "128", "bf16", "triton", "200.0", "1510", "31.5", "37.7", "365", "36.9",
                         "300.0", "250.0", "-", "-", "1.25", "ok"]
    assert decode[2][-5:] == ["-", "-", "-", "-", "BAD"]   # peers that did not run
    prefill = lines[4:]
    assert prefill[1].split() == ["4096", "4", "128", "triton", "5000.0", "420", "42.5", "525", "-", "0.80", "-"]
    assert "RuntimeError" not in text


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("backend", ["vanilla", "triton"])
def test_decode_case_checks_against_the_reference(fmt, backend):
    """A small latent cache (16 query heads: the Triton MLA kernel's least) on the CPU: the op
    (on the reference, or Triton's interpreter) within the check's tolerance."""
    case = bench_mla.DecodeCase(2, 40, 16, fmt, page=16, n_sets=2, device="cpu")
    (q, k, v, bt, sl), kwargs = case.args(1)
    assert k.shape == (6, 16, 1, 576) and v.shape == (6, 16, 1, 512) and v.data_ptr() == k.data_ptr()
    assert bt.shape == (2, 3) and sorted(bt.flatten().tolist()) == list(range(6))
    assert kwargs["scale"] == 192 ** -0.5 and (kwargs["k_scale"] is None) == (fmt == "bf16")
    assert case.nbytes == bench_mla.latent_bytes(2, 40, fmt)
    check = bench_mla.check_decode(case, backend=backend)
    assert check["ok"], check
    assert case.out[0].shape == (2, 16, 512) and torch.isfinite(case.out[0]).all()


@pytest.mark.parametrize("backend", ["vanilla", "triton"])
def test_prefill_case_checks_against_the_reference(backend):
    case = bench_mla.PrefillCase([24, 24], heads=2, device="cpu")
    assert case.q.shape == (48, 2, 192) and case.v.shape == (48, 2, 128) and case.cu.tolist() == [0, 24, 48]
    check = bench_mla.check_prefill(case, rows=8, backend=backend)
    assert check["ok"], check
    assert case.out.shape == (48, 2, 128)


def test_decompressed_case_on_the_op_matches_sdpa():
    """The decompressed equivalent through `paged_decode` (one page per sequence, values of 128
    dims under keys of 192) against SDPA in float64 on the same tensors."""
    import torch.nn.functional as F

    case = bench_mla.DecompressedCase(2, 20, 4, n_sets=2, device="cpu")
    q, k, v, bt, sl = case.paged_args(1)
    assert k.shape == (2, 20, 4, 192) and v.shape == (2, 20, 4, 128) and bt.tolist() == [[0], [1]]
    fns = case.ours_fns()   # runs set 0 once
    fns[1]()
    for i, (q, k, v) in enumerate(case.sets):
        truth = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=bench_mla.SCALE)[:, :, 0]
        base = F.scaled_dot_product_attention(q, k, v, scale=bench_mla.SCALE)[:, :, 0]
        assert_error_ratio(case.out[i], truth, base)


@pytest.mark.filterwarnings("ignore:.*[Ff]lash attention:UserWarning")   # SDPA's CUDA kernels on the CPU
def test_runner_builds_rows_on_the_cpu():
    """Decode and prefill rows through the Runner with a stand-in timer (each call run once): our
    rates and check, and every peer timed or recorded as unavailable (FlashInfer and SDPA's CUDA
    kernels cannot run here), never raising."""
    args = bench_mla.parser().parse_args(["--page", "16"])
    runner = bench_mla.Runner(args, {"gpu": "NVIDIA H200", "l2_bytes": 1 << 20}, {"read_GBps": 4000.0}, device="cpu")

    def run_once(fns):
        for fn in fns if isinstance(fns, list) else [fns]:
            fn()
        return 100.0, "test"
    runner.time = runner.time_long = run_once
    runner.total_tokens, runner.prefill_heads = 32, 2
    bench_mla.MAX_DECOMPRESSED_BYTES, limit = 1e6, bench_mla.MAX_DECOMPRESSED_BYTES
    try:
        small = runner.decode(2, 40, 16, "bf16", check=True)
        large = runner.decode(8, 64, 16, "bf16", check=False)   # decompressed K/V past the limit
        fp8 = runner.decode(2, 40, 16, "fp8", check=False)
    finally:
        bench_mla.MAX_DECOMPRESSED_BYTES = limit
    prefill = runner.prefill(16, check=True)
    assert small["backend"] == "vanilla" and small["check"]["ok"] and small["rotated_sets"] > 1
    assert small["ours_GBps"] == pytest.approx(2 * 40 * 576 * 2 / 100 / 1e3)
    assert small["ours_pct_hbm"] == pytest.approx(100 * small["ours_GBps"] / 4800)
    assert small["flashinfer_fa2"].startswith("unavailable") and small["flashinfer_fa3"].startswith("unavailable")
    assert small["sdpa_mha"].startswith("unavailable")   # CUDA kernels only
    assert small["ours_mha_us"] == 100.0 and small["decompressed_bytes"] == 2 * 16 * 40 * 320 * 2
    assert large["sdpa_mha"].startswith("skipped") and large["ours_mha"].startswith("skipped")
    assert "sdpa_mha" not in fp8 and "ours_mha" not in fp8   # the decompressed cache is bf16: once per shape
    assert prefill["num_seqs"] == 2 and prefill["check"]["ok"] and prefill["ours_tflops"] > 0
    assert prefill["cudnn_sdpa"].startswith("unavailable") and "ours_GBps" not in prefill
    lines = bench_mla.summary([small, large, fp8, prefill], runner.limits).splitlines()
    assert len(lines) == 1 + 4 + 2 and "cudnn_TF" in lines[5]
