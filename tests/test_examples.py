"""The examples run as documented."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kv_dtype,backend", [("bf16", None), ("e4m3", None), ("int4", None), ("int8", "triton")])
def test_quickstart(kv_dtype, backend):
    """The example checks itself (it exits non-zero on a large error); with `triton` on CPU, the
    kernels run through the interpreter."""
    cpu_triton = {"ATTN_BACKEND": backend, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env = {**os.environ, **(cpu_triton if backend else {})}
    result = subprocess.run([sys.executable, "examples/quickstart.py", "--kv-dtype", kv_dtype, "--steps", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "paged_decode" in result.stdout and "paged_prefill" in result.stdout and "kv_cache_write" in result.stdout


def test_llama_paged():
    result = subprocess.run([sys.executable, "examples/llama_paged.py", "--steps", "2"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "logits match the plain formulation" in result.stdout, result.stderr


def test_readme_tour():
    """The README's tour runs as shown and says what it says."""
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## Use")[1].split("```python\n")[1].split("```")[0]
    result = subprocess.run([sys.executable, "-c", tour], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "prefill matches context attention: True" in result.stdout
    assert "attn::paged_decode runs on" in result.stdout
