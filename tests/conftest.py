"""Test configuration: the `gpu` marker, Triton's CPU interpreter, seeds per test.

On a machine without CUDA, Triton kernels run under TRITON_INTERPRET=1 (set here, before any
kernel module is imported), and tests marked `gpu` are skipped with a reason. Kernels compile at
their first launch, in the test process (ATTN_COMPILE_WORKERS=1).
"""

import os
import random
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# kernels compile in the test process (tests of kernels.triton.precompile ask for workers)
os.environ.setdefault("ATTN_COMPILE_WORKERS", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> torch.device:
    """Where Triton kernel tests run: the GPU, or the CPU through Triton's interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed(request):
    """Seeds torch and `random` from the test's id and `ATTN_TEST_SEED` (default 0): a failure
    reproduces by running the test by name; another ATTN_TEST_SEED draws other inputs for every
    test. A failing test's report shows the seed ("seed" section)."""
    seed = zlib.crc32(f"{os.environ.get('ATTN_TEST_SEED', '0')}:{request.node.nodeid}".encode())
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.add_report_section("setup", "seed", f"torch.manual_seed({seed}), random.seed({seed})")


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    """Plans are cached per call signature and read module knobs and the environment when made
    (torch_ops/backends.py): every test starts without them, and each `monkeypatch` change, or
    its undoing, makes the next call plan again."""
    from torch_ops import backends

    for name in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv"):
        change = getattr(monkeypatch, name)

        def changed(*args, _change=change, **kwargs):
            _change(*args, **kwargs)
            backends.clear_plans()

        setattr(monkeypatch, name, changed)
    backends.clear_plans()
    yield
    monkeypatch.undo()
    backends.clear_plans()


@pytest.fixture(scope="session")
def csrc_libraries():
    """The CUTLASS and CUDA decode libraries, built: the automatic choice passes over unbuilt ones
    (tests of that choice on the GPU need them, as a user's `torch_ops.warmup()` provides them)."""
    import torch_ops

    torch_ops.warmup(progress=False)
