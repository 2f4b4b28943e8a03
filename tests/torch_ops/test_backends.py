"""The op front (torch_ops/backends.py): automatic choice, declines, explicit requests, plans."""

import pytest
import torch

import torch_ops
from torch_ops import backends


class _Fake:
    def __init__(self, name, reasons=(), declines=()):
        self.name, self.auto_devices = name, ("cpu",)
        self._reasons, self._declines = list(reasons), list(declines)
        self.prepared = self.runs = 0

    def reasons(self, op, args, kwargs):
        return self._reasons

    def auto_declines(self, op, args, kwargs):
        return self._declines

    def prepare(self, op, args, kwargs):
        self.prepared += 1

        def launch(out_a, lse_a, out_b, lse_b, *, out, lse):
            self.runs += 1
            out.copy_(out_a)
            lse.copy_(lse_a)

        return launch


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry: fakes registered in a test leave with it."""
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    monkeypatch.setattr(backends, "PRIORITY", {op: list(names) for op, names in backends.PRIORITY.items()})
    backends.clear_plans()
    yield
    backends.clear_plans()


def _states(tokens=2):
    q = torch.randn(tokens, 2, 8)
    return q, q[..., 0].contiguous(), q, q[..., 0].contiguous()


def test_automatic_choice_skips_backends_that_cannot_serve_or_decline(registry):
    torch_ops.register_backend(_Fake("slow_here", declines=["measured slower"]))
    torch_ops.register_backend(_Fake("broken", reasons=["no kernel"]))
    assert backends.PRIORITY["merge_states"][:2] == ["broken", "slow_here"]   # registered last: tried first
    choice = torch_ops.explain("merge_states", *_states())
    assert choice.backend == "vanilla" and not choice.requested
    assert choice.passed_over == {"broken": ["no kernel"], "slow_here": ["measured slower"],
                                  "triton": ["not chosen automatically on cpu"]}
    assert "slow_here passed over: measured slower" in str(choice)
    with torch_ops.use_backend("slow_here"):   # a decline only affects the automatic choice
        assert torch_ops.backend_for("merge_states", *_states()) == "slow_here"
    with torch_ops.use_backend("broken"), pytest.raises(ValueError, match="'broken' cannot run attn::merge_states: no kernel"):
        torch_ops.backend_for("merge_states", *_states())


def test_explain_takes_the_op_or_its_name():
    by_name = torch_ops.explain("merge_states", *_states())
    for op in (torch.ops.attn.merge_states, torch.ops.attn.merge_states.default, "attn::merge_states"):
        assert torch_ops.explain(op, *_states()) == by_name
    assert torch_ops.backend_for(torch.ops.attn.merge_states, *_states()) == by_name.backend
    for other in ("merge", torch.ops.aten.add):
        with pytest.raises(ValueError, match="op must be one of"):
            torch_ops.explain(other, *_states())
    with pytest.raises(TypeError, match="op must be an attn:: op or its name"):
        torch_ops.explain(3, *_states())


def test_priority_is_explicit_for_every_op():
    assert set(backends.PRIORITY) == set(torch_ops.ops.SPECS)
    for names in backends.PRIORITY.values():
        assert names[-1] == "vanilla" and set(names) <= set(backends.backend_names())


def test_a_signature_is_planned_once(registry):
    fake = _Fake("fast")
    torch_ops.register_backend(fake)
    for _ in range(3):
        a, la, b, lb = _states()
        out, lse = torch.ops.attn.merge_states(a, la, b, lb)
        assert torch.equal(out, a) and torch.equal(lse, la)   # the fake's launch ran on this call's tensors
    assert (fake.prepared, fake.runs) == (1, 3)
    torch.ops.attn.merge_states(*_states(tokens=3))   # another shape: another plan
    assert (fake.prepared, fake.runs) == (2, 4)
    with torch_ops.use_backend("vanilla"):   # the requested backend is part of the signature
        torch.ops.attn.merge_states(*_states(tokens=3))
    assert (fake.prepared, fake.runs) == (2, 4)


def test_bad_input_is_rejected_on_every_call(registry):
    a, la, b, lb = _states()
    torch.ops.attn.merge_states(a, la, b, lb)
    for _ in range(2):   # a failed validation caches nothing
        with pytest.raises(ValueError, match="lse_b"):
            torch.ops.attn.merge_states(a, la, b, lb[:1])


def test_plans_follow_the_requested_backend_from_the_environment(registry, monkeypatch):
    fake = _Fake("fast")
    torch_ops.register_backend(fake)
    torch.ops.attn.merge_states(*_states())
    monkeypatch.setenv("ATTN_BACKEND", "vanilla")
    torch.ops.attn.merge_states(*_states())
    assert fake.runs == 1
    monkeypatch.setenv("ATTN_BACKEND", "nonesuch")
    with pytest.raises(ValueError, match="unknown backend 'nonesuch'"):
        torch.ops.attn.merge_states(*_states())


def test_explain_names_the_kernel():
    from . import samples

    args, kwargs = samples.sample("paged_decode", "gqa")
    with torch_ops.use_backend("triton"):
        choice = torch_ops.explain("paged_decode", *args, **kwargs)
    assert choice.backend == "triton" and choice.requested
    assert choice.kernel.startswith("Triton paged_decode, grid ") and "kernel: Triton" in str(choice)


def test_cutlass_and_mixed_decline_a_separate_value_head_dim():
    # the checks the `cutlass` and `mixed` backends run on a GPU, device-independent part
    from torch_ops.kernels.cuda import fmha_sm90
    from . import samples

    (q, k, v, *_), _ = samples.sample("context_attention", "mla")
    assert any("value head dim 8 != query head dim 16" in why for why in fmha_sm90.problem_reasons(q, k, v))
    assert not any("value head dim" in why for why in fmha_sm90.problem_reasons(q, k, k))
    (q, k_cache, v_cache, tables, *_), _ = samples.sample("paged_prefill", "mla")
    assert any("v_cache head dim 8 != k_cache head dim 16" in why
               for why in fmha_sm90.paged_problem_reasons(q, k_cache, v_cache, tables))
    assert not any("v_cache head dim" in why for why in fmha_sm90.paged_problem_reasons(q, k_cache, k_cache, tables))
