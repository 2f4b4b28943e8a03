"""Fixtures of the Triton kernel tests."""

import contextlib

import pytest

from torch_ops import errors
from torch_ops.kernels.triton import paged_decode as pd


@pytest.fixture
def knobs():
    """Set the decode kernels' tuning knobs for one test (`paged_decode.tuning`, restored afterwards)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(pd.tuning(**changes))


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-K partials start as NaN: the merge may read only what the splits wrote."""
    real = pd.split_workspace
    monkeypatch.setattr(pd, "split_workspace", lambda *a: tuple(t.fill_(float("nan")) for t in real(*a)))


@pytest.fixture
def clear_error_flags():
    """The device error flags start and end the test cleared (a test may leave bits set on purpose)."""
    with contextlib.suppress(ValueError):
        errors.check_errors()
    yield
    with contextlib.suppress(ValueError):
        errors.check_errors()
