"""benchmarks/report.py renders the serving results, picking the newest run of each kind."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

ENV = {"date": "2026-01-02T03:04:05+00:00", "git_commit": "abc1234", "torch": "2.11", "triton": "3.6",
       "gpu": "Test GPU", "transformers": "5.0"}
MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
METADATA_ROW = {"kind": "decode", "num_seqs": 256, "num_tokens": 256, "prepare_us": 48.25, "append_us": 12.5,
                "total_us": 61.0}


def serving(replay: dict, **extra) -> dict:
    rows = [{"batch": 64, "ours_tokens_per_s": 30000.4, "ours_step_wall_us": 2000.0, "ours_step_gpu_us": 1500.0,
             "ours_host_us": 400.0, "ours_metadata_us": 70.0, "hf_tokens_per_s": 12000.0, "speedup": 2.5},
            {"batch": 1, "ours_tokens_per_s": 700.0, "ours_step_wall_us": 1300.0, "ours_step_gpu_us": 1000.0,
             "ours_host_us": 140.0, "ours_metadata_us": 80.0, "hf_error": "RuntimeError: boom"}]
    return {"env": ENV, "model": MODEL, "prompt_len": 512, "new_tokens": 64, "hf_reps": 1, "metadata": [],
            "rows": rows, "replay": {"batch": 64, "replays": 100, "kernels_per_replay": 212.0, **replay}, **extra}


def test_serving_section():
    replay = {"replay_us": 1400.0, "replay_wall_us": 1450.0, "kernel_sum_us": 1350.0, "ratio": 1400 / 1350,
              "ratio_isolated": 1450 / 1350}
    lines = report.serving_section(serving(replay, metadata=[METADATA_ROW]), "serving_x.json")
    assert lines[0] == "## serving: engine decode vs transformers: Test GPU (serving_x.json)"
    assert "| 64 | 30000 | 2000.0 | 1500.0 | 400.0 | 70.0 | 12000 | 2.50 |" in lines
    assert "| 1 | 700 | 1300.0 | 1000.0 | 140.0 | 80.0 | - | - |" in lines
    assert "- transformers at B = 1 failed: RuntimeError: boom" in lines
    assert "| 64 | 1400.0 | 1450.0 | 1350.0 | 212 | 1.037 | 1.074 |" in lines
    assert "| decode | 256 | 256 | 48.2 | 12.5 | 61.0 | - |" in lines  # a full run's metadata rows


def test_serving_section_replay_before_back_to_back_timing():
    """Older files have only `replay_wall_us`, and their `ratio` is the one-at-a-time ratio."""
    replay = {"replay_wall_us": 1450.0, "kernel_sum_us": 1350.0, "ratio": 1450 / 1350}
    lines = report.serving_section(serving(replay), "serving_grid_x.json")
    assert "| 64 | - | 1450.0 | 1350.0 | 212 | - | 1.074 |" in lines
    assert not any(line.startswith("Host time per step") for line in lines)


def test_metadata_section_and_newest_run(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", results)
    engine = {"kind": "engine decode", "num_seqs": 256, "num_tokens": 256, "prepare_us": 111.0,
              "append_us": 70.0, "total_us": 181.0, "host_us": 215.5}
    failed = {"kind": "engine decode", "num_seqs": 256, "error": "ValueError: bad"}
    # The newest run by date is the one whose name sorts first.
    for name, date, rows in (("serving_metadata_G_b", "2026-01-01T00:00:00+00:00", [METADATA_ROW, failed]),
                             ("serving_metadata_G_a", "2026-01-02T00:00:00+00:00", [METADATA_ROW, engine]),
                             ("serving_metadata_partial", "2026-01-03T00:00:00+00:00", [failed])):
        (results / f"{name}.json").write_text(json.dumps({"env": {**ENV, "date": date}, "metadata": rows}))
    report.main()
    text = (tmp_path / "docs" / "performance.md").read_text()
    assert text.count("## serving: host time per step") == 1
    assert "## serving: host time per step: Test GPU (serving_metadata_G_a.json)" in text
    assert "| engine decode | 256 | 256 | 111.0 | 70.0 | 181.0 | 215.5 |" in text
    assert "failed" not in text
    assert "- engine decode 256 failed: ValueError: bad" in report.serving_metadata_section(
        {"env": ENV, "metadata": [failed]}, "x.json")


def test_fp8_section():
    row = {"case": "S=8192 D=128 H=32", "causal": False, "cutlass_fp8_tflops": 693.4, "cutlass_fp8_rmse": 4.74e-4,
           "flashinfer_fa3_fp8_tflops": 817.0, "flashinfer_fa3_fp8_rmse": 4.67e-4,
           "flashinfer_fa3_fp8_vs_cutlass_fp8": 0.849, "cudnn_sdpa_bf16": "unavailable: RuntimeError: no varlen"}
    lines = report.fp8_section({"env": ENV, "cutlass_persistent": False, "rows": [row]}, "fp8_x.json")
    assert lines[0] == "## FP8 context attention: Test GPU (fp8_x.json)"
    assert "| S=8192 D=128 H=32 | False | 693 | - | - | - | 817 | - | - | 0.85 | 4.74e-04 / 4.67e-04 |" in lines
