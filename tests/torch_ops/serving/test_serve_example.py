"""examples/serve.py runs on CPU, the Triton kernels through the interpreter, and its greedy
outputs equal the vanilla backend's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_serve_example_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "examples/serve.py", "--backend", "triton", "--check", "--num-requests", "8"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout and "metadata build (CPU)" in result.stdout
    assert "8/8 requests have the same greedy output" in result.stdout
