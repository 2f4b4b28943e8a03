"""examples/serve.py runs on CPU, the Triton kernels through the interpreter, and in lockstep with
the vanilla backend (teacher-forced) its logits agree."""

import os
import re
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
    check = next(line for line in result.stdout.splitlines() if line.startswith("check:"))
    steps, worst = re.search(r"check: (\d+) steps .* max \|logit difference\| (\S+);", check).groups()
    assert int(steps) > 8 and float(worst) < 1e-3 and "; 0 greedy choices differ" in check, check
