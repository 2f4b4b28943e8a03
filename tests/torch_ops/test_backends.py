"""The backend registry (torch_ops/backends.py): automatic choice, declines, explicit requests."""

import pytest
import torch

import torch_ops
from torch_ops import backends


class _Fake:
    def __init__(self, name, reasons=(), declines=()):
        self.name, self.auto_devices = name, ("cpu",)
        self._reasons, self._declines = list(reasons), list(declines)

    def reasons(self, op, args, kwargs):
        return self._reasons

    def auto_declines(self, op, args, kwargs):
        return self._declines


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(backends, "_BACKENDS", list(backends._BACKENDS))
    return backends._BACKENDS


def test_automatic_choice_skips_backends_that_cannot_serve_or_decline(registry):
    q = torch.randn(2, 2, 8)
    registry[:0] = [_Fake("slow_here", declines=["measured slower"]), _Fake("broken", reasons=["no kernel"])]
    assert torch_ops.backend_for("merge_states", q, q[..., 0], q, q[..., 0]) == registry[-1].name
    with torch_ops.use_backend("slow_here"):   # a decline only affects the automatic choice
        assert torch_ops.backend_for("merge_states", q, q[..., 0], q, q[..., 0]) == "slow_here"
    with torch_ops.use_backend("broken"), pytest.raises(ValueError, match="'broken' cannot run attn::merge_states: no kernel"):
        torch_ops.backend_for("merge_states", q, q[..., 0], q, q[..., 0])
