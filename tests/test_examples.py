"""The examples run as documented."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kv_dtype", ["bf16", "e4m3", "int4"])
def test_quickstart(kv_dtype):
    result = subprocess.run([sys.executable, "examples/quickstart.py", "--kv-dtype", kv_dtype, "--steps", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "paged_decode" in result.stdout and "paged_prefill" in result.stdout


def test_llama_paged():
    result = subprocess.run([sys.executable, "examples/llama_paged.py", "--steps", "2"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "logits match the plain formulation" in result.stdout, result.stderr
