"""The Triton kernels compile for Hopper (sm_90) on any machine (tests/torch_ops/kernels/triton/sm90_compile.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.torch_ops.kernels.triton.sm90_compile"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("ok ") == 13, result.stdout
