"""benchmarks/report.py: the sections it renders from small synthetic results, which run of each
benchmark it picks, that it works without matplotlib, and that the committed results and
docs/performance.md are what it keeps and writes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

ENV = {"date": "2026-01-02T03:04:05+00:00", "git_commit": "abc1234def (a note)", "torch": "2.11", "triton": "3.6",
       "flashinfer": "0.7", "gpu": "NVIDIA H200", "transformers": "5.0"}


def decode_row(batch, fmt="bf16", us=250.0, **peers):
    kv_bytes = batch * 4096 * 8 * 128 * 2 * (2 if fmt == "bf16" else 1)
    return {"batch": batch, "ctx": 4096, "hq": 32, "hkv": 8, "fmt": fmt, "backend": "triton", "ours_us": us,
            "ours_GBps": kv_bytes / us / 1e3, "kv_bytes": kv_bytes, "check": {"ok": True}, **peers}


def decode_run(rows, date=ENV["date"], gpu="NVIDIA H200", peers=("flashinfer", "flashinfer_tc")):
    return {"env": {**ENV, "date": date, "gpu": gpu}, "bandwidth": {"read_GBps": 4000.0},
            "args": {"check": True, "out": "/x", "batch": [1, 64], "ctx": None, "peers": list(peers),
                     "budget_s": 1e9}, "rows": rows}


HOST = {"env": ENV, "args": {"out": "/x", "quick": False, "batch": 32, "ctx": 256},
        "shape": {"batch": 32, "ctx": 256, "hq": 32, "hkv": 8, "d": 128, "page": 16, "prefill_seqs": 4,
                  "prefill_q": 64},
        "iters": 200, "repeats": 5,
        "rows": [{"op": "paged_decode", "variant": "bf16", "backend": "auto", "chosen": "triton", "host_us": 11.3,
                  "replayed": 1.0, "device_us": 11.7, "first_ms": 6128.9},
                 {"op": "paged_decode", "variant": "bf16", "backend": "auto/python", "host_us": 32.3},
                 {"op": "paged_decode", "variant": "bf16", "backend": "cuda", "host_us": 12.4},
                 {"op": "paged_decode", "variant": "bf16", "backend": "triton", "host_us": 11.7},
                 {"op": "paged_decode", "variant": "bf16", "backend": "cutlass", "na": "cannot run"},
                 {"op": "paged_decode", "variant": "bf16", "backend": "flashinfer", "host_us": 42.2}]}


def write(folder: Path, name: str, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_decode_section():
    data = decode_run([decode_row(64, flashinfer_us=380.0, flashinfer_tc_us=255.0), decode_row(1, us=10.0)])
    text, lines, _, cmd = report.decode(data, "decode_x")
    assert "At batch 64 (4096 keys, 32/8 heads, bf16): ours 250.0 µs, FlashInfer 380.0 µs, FlashInfer tc 255.0 µs" \
        in text
    assert "our best row read 4295 GB/s, 107% of the 4000 GB/s read bandwidth" in text
    assert "2 rows were checked against the reference: all passed." in text
    # the peers that never ran (cuDNN, flash SDPA, flex) lose their columns
    assert lines[0] == ("| B | ctx | Hq/Hkv | KV | ours µs | kernel | GB/s | % read | FlashInfer µs | FlashInfer tc µs "
                        "| × FlashInfer | × FlashInfer tc |")
    assert lines[2] == "| 64 | 4096 | 32/8 | bf16 | 250.0 | triton | 4295 | 107 | 380.0 | 255.0 | 1.52 | 1.02 |"
    assert lines[3] == "| 1 | 4096 | 32/8 | bf16 | 10.0 | triton | 1678 | 42 | - | - | - | - |"
    assert cmd == "python benchmarks/bench_decode.py --check --batch 1 64 --peers flashinfer flashinfer_tc"


def test_decode_formats_section():
    """A run without peers compares formats: one row per shape run in every format."""
    rows = [decode_row(64), decode_row(64, "fp8", 140.0), decode_row(1)]
    text, lines, _, cmd = report.decode(decode_run(rows, peers=()), "decode_formats_x")
    assert "The automatic choice ran bf16: triton; fp8: triton." in text
    assert lines == ["| B | ctx | Hq/Hkv | bf16 | fp8 |", "|---|---|---|---|---|",
                     "| 64 | 4096 | 32/8 | 250.0 (4295) | 140.0 (3835) |"]
    assert cmd.endswith("--batch 1 64 --peers")


def test_latest_run_per_benchmark_mode_and_gpu(tmp_path):
    old = write(tmp_path, "decode_H200_b", decode_run([decode_row(1)], date="2026-01-01T00:00:00+00:00"))
    new = write(tmp_path, "decode_H200_a", decode_run([decode_row(1)], date="2026-01-02T00:00:00+00:00"))
    h100 = write(tmp_path, "bench_decode_NVIDIA_H100_x", decode_run([decode_row(1)], gpu="NVIDIA H100 80GB HBM3"))
    ours = write(tmp_path, "decode_formats_H200_c", decode_run([decode_row(1)], peers=()))
    graphs = write(tmp_path, "e2e_compile_graphs_H200", {"env": ENV, "graphs": True, "rows": []})
    eager = write(tmp_path, "e2e_compile_H200", {"env": ENV, "graphs": False, "rows": []})
    write(tmp_path, "trial_decode_H200", decode_run([decode_row(1)], date="2027-01-01T00:00:00+00:00"))
    write(tmp_path, "bench_decode_partial", decode_run([decode_row(1)], date="2027-01-01T00:00:00+00:00"))
    runs = report.latest(tmp_path.glob("*.json"))
    assert {key: path for key, (path, _) in runs.items()} == {
        ("decode", "", "NVIDIA H200"): new, ("decode", "", "NVIDIA H100 80GB HBM3"): h100,
        ("decode", "ours only", "NVIDIA H200"): ours,
        ("e2e", "CUDA graphs", "NVIDIA H200"): graphs, ("e2e", "", "NVIDIA H200"): eager}
    assert old not in {path for path, _ in runs.values()}


def test_render_skips_missing_sections(tmp_path):
    write(tmp_path, "bench_host_H200_x", HOST)
    doc = report.render(tmp_path, None)
    assert "## Host time per eager call" in doc
    assert "## Decode" not in doc and "## Prefill" not in doc and "## Serving" not in doc
    assert "| NVIDIA H200 | 4.8 TB/s | 989 TFLOP/s | 1979 TFLOP/s |" in doc
    assert "| paged_decode | bf16 | 11.3 (triton) | 100% | 32.3 | 11.7 (triton) | 11.7 | 6129 | 42.2 |" in doc
    assert "`bench_host_H200_x.json`: 2026-01-02, commit abc1234," in doc
    assert "Reproduce: `python benchmarks/bench_host.py --batch 32 --ctx 256`" in doc


def test_render_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ImportError
    assert report.pyplot() is None
    write(tmp_path / "results", "decode_H200_x", decode_run([decode_row(64, flashinfer_us=380.0)]))
    img = tmp_path / "img"
    img.mkdir()
    doc = report.render(tmp_path / "results", img)
    assert "| 64 | 4096 | 32/8 | bf16 | 250.0 |" in doc
    assert "![" not in doc and not list(img.iterdir())


def test_render_writes_and_links_plots(tmp_path):
    pytest.importorskip("matplotlib")
    write(tmp_path / "results", "decode_H200_x", decode_run([decode_row(64, flashinfer_us=380.0)]))
    write(tmp_path / "results", "bench_host_H200_x", HOST)
    img = tmp_path / "img"
    img.mkdir()
    (img / "stale.png").write_bytes(b"")
    doc = report.render(tmp_path / "results", img)
    assert sorted(p.name for p in img.iterdir()) == ["bench_host_H200_x.png", "decode_H200_x.png"]
    assert "![decode_H200_x](img/decode_H200_x.png)" in doc


def test_commands():
    rows = [{"case": "S=8192 D=128 H=32", "causal": False}, {"case": "S=8192 ragged D=128 H=32", "causal": True},
            {"case": "S=2048 B=1 D=256 H=16", "causal": False}]
    *_, cmd = report.fp8({"env": ENV, "cutlass_persistent": True, "rows": rows}, "fp8_x")
    assert cmd == "ATTN_CUTLASS_PERSISTENT=1 python benchmarks/bench_fp8.py --shapes 128:32:8192 256:16:2048:1"
    model = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16}
    rows = [{"case": "prefill", "shape": "1 x 8", "variant": "bf16", "mode": m, "time_us": t}
            for m, t in (("eager", 30.0), ("compile", 20.0), ("passes", 10.0))]
    text, lines, _, cmd = report.e2e({"env": ENV, "graphs": True, "model": model, "rows": rows}, "e2e_x")
    assert cmd == "python benchmarks/bench_e2e_compile.py --graphs --no-fp8 --cases prefill"
    assert "Times: CUDA-graph replays." in text
    assert lines[2] == "| prefill, 1 x 8 | bf16 | 30 | 20 | 10 | 2.00 | - / - |"   # no breaks or recompiles recorded


def test_serving_sections():
    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    rows = [{"batch": 64, "ours_tokens_per_s": 30000.4, "ours_step_wall_us": 2000.0, "hf_tokens_per_s": 12000.0,
             "speedup": 2.5},
            {"batch": 1, "ours_tokens_per_s": 700.0, "hf_error": "RuntimeError: boom"}]
    replay = {"batch": 64, "replays": 100, "kernels_per_replay": 212.0, "replay_us": 1400.0, "kernel_sum_us": 1350.0,
              "ratio": 1400 / 1350}
    data = {"env": ENV, "model": model, "prompt_len": 512, "new_tokens": 64, "rows": rows, "replay": replay,
            "metadata": []}
    text, lines, _, cmd = report.serving(data, "serving_grid_H200_x")
    assert "took 1400 µs, 1.037x the 1350 µs sum of its 212 kernels" in text
    assert "| 64 | 30000 | 2000.0 | 12000 | 2.50 |" in lines
    assert "- transformers at B = 1 failed: RuntimeError: boom" in lines
    assert cmd == "python benchmarks/bench_serving.py --grid"
    metadata = [{"kind": "decode", "num_seqs": 256, "num_tokens": 256, "prepare_us": 48.25, "append_us": 12.5,
                 "total_us": 61.0}, {"kind": "engine decode", "num_seqs": 256, "error": "ValueError: bad"}]
    _, lines, _, _ = report.serving_metadata({"env": ENV, "metadata": metadata}, "serving_metadata_x")
    assert "| decode | 256 | 256 | 48.2 | 12.5 | 61.0 |" in lines
    assert "- engine decode 256 failed: ValueError: bad" in lines


def test_generate_section():
    def row(model, mode, tps, equal=None):
        r = {"model": model, "batch": 8, "prompt_lengths": [600] * 8, "new_tokens": 128, "mode": mode,
             "tokens_per_s": tps, "seconds": 1.0, "first_s": 30.0}
        return r if equal is None else {**r, "tokens_equal_eager": equal}
    rows = [row("llama", "eager", 100.0), row("llama", "compile", 400.0, "yes"), row("llama", "passes", 600.0, "yes"),
            {"model": "gemma2", "batch": 8, "mode": "passes", "error": "RuntimeError: boom"}]
    data = {"env": ENV, "args": {"batch": [8], "quick": False}, "rows": rows}
    text, lines, _, cmd = report.generate(data, "generate_H200_x")
    assert "128 new tokens" in text
    assert "| llama | 8 | 100 | 400 | 600 | 1.50 | yes |" in lines
    assert cmd == "python benchmarks/bench_generate.py --batch 8"


def test_committed_results_hold_only_the_latest_runs():
    """benchmarks/results/ keeps the latest JSON of each benchmark on each GPU and nothing else."""
    kept = {path for path, _ in report.latest(report.RESULTS.glob("*.json")).values()}
    assert set(report.RESULTS.iterdir()) == kept


def test_committed_document_is_generated_and_short():
    """docs/performance.md is what report.py writes from the committed results (run
    `python benchmarks/report.py` after adding results), within 300 lines."""
    doc = report.render(report.RESULTS, None)
    assert len(doc.splitlines()) <= 300
    assert report.DOC.read_text() == doc


def mla_row(batch, fmt="bf16", hq=128, ctx=4096, us=100.0, **peers):
    latent = batch * ctx * 576 * (2 if fmt == "bf16" else 1)
    return {"section": "decode", "batch": batch, "ctx": ctx, "hq": hq, "fmt": fmt, "backend": "triton",
            "latent_bytes": latent, "ours_us": us, "ours_GBps": latent / us / 1e3,
            "ours_tflops": 2 * batch * hq * ctx * 1088 / us / 1e6, "check": {"ok": True}, **peers}


def mla_run():
    rows = [mla_row(1, us=10.0), mla_row(64, us=200.0, flashinfer_fa2_us=300.0, flashinfer_fa3_us=250.0),
            mla_row(64, "fp8", us=120.0, flashinfer_fa3="unavailable: RuntimeError: no FP8"),
            mla_row(64, ctx=1024, us=60.0),   # another context: in the JSON, not in the table
            {"section": "decode", "params": [128, 16384, 128, "fp8"], "error": "RuntimeError: boom"},
            {"section": "prefill", "seqlen": 4096, "num_seqs": 4, "hq": 128, "d_qk": 192, "d_v": 128, "causal": True,
             "backend": "triton", "ours_us": 5000.0, "ours_tflops": 420.0, "flashinfer_fa3_tflops": 525.0}]
    args = {"quick": False, "check": True, "out": "/x", "sections": ["decode", "prefill"], "batch": [1, 64],
            "ctx": None, "heads": None, "formats": ["bf16", "fp8"], "seqlens": None, "page": 64,
            "peers": ["flashinfer_fa2", "flashinfer_fa3", "sdpa_mha", "cudnn_sdpa"], "budget_s": 1e9}
    return {"env": ENV, "bandwidth": {"read_GBps": 4000.0}, "args": args, "rows": rows}


def test_mla_section():
    text, lines, _, cmd = report.mla(mla_run(), "bench_mla_x")
    assert "Our best row read 1510 GB/s, 31% of the 4.8 TB/s nominal and 38% of the 4000 GB/s read bandwidth" in text
    assert "Cells at ctx = 4096" in text
    assert ("Prefill, 4 x 4096 tokens, 128 heads of 192/128 dims, causal: ours 420 TFLOP/s (42% of peak, triton), "
            "FlashInfer fa3 525, cuDNN SDPA -.") in text
    assert "4 rows were checked against the reference: all passed." in text
    assert lines == ["| KV | Hq | B=1 | B=64 |", "|---|---|---|---|",
                     "| bf16 | 128 | 472 | 1510 (1.25) |", "| fp8 | 128 | - | 1258 |"]
    assert cmd == "python benchmarks/bench_mla.py --check --batch 1 64"   # defaults left out


def test_mla_results_are_rendered(tmp_path):
    pytest.importorskip("matplotlib")
    write(tmp_path / "results", "bench_mla_NVIDIA_H200_x", mla_run())
    img = tmp_path / "img"
    img.mkdir()
    doc = report.render(tmp_path / "results", img)
    assert "## MLA: latent-cache decode and 192/128 prefill (DeepSeek-V3 shapes)" in doc
    assert "| bf16 | 128 | 472 | 1510 (1.25) |" in doc
    assert [p.name for p in img.iterdir()] == ["bench_mla_NVIDIA_H200_x.png"]
    assert report.benchmark(Path("mla_H200_x.json")) == "mla"
