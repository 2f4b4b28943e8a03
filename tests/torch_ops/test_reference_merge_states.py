"""`merge_states` against the naive float64 attention over the whole key set, and at extreme or
non-finite lse."""

from __future__ import annotations

import math

import pytest
import torch

from torch_ops import reference

from .reference_helpers import D, F64, HEADS, naive_attention, rand


@HEADS
def test_merge_states_of_two_halves(hq, hkv):
    """Merged states of the two halves of a key set (split at a random key) equal attention over
    the whole set; learned sinks are added once, after merging."""
    q = torch.randn(5, hq, D, dtype=F64)
    k, v = torch.randn(9, hkv, D, dtype=F64), torch.randn(9, hkv, D, dtype=F64)
    sinks = torch.randn(hq)
    cut = int(torch.randint(1, 9, ()))
    (out_a, lse_a), (out_b, lse_b) = naive_attention(q, k[:cut], v[:cut]), naive_attention(q, k[cut:], v[cut:])
    whole_out, whole_lse = naive_attention(q, k, v)
    out, lse = torch.ops.attn.merge_states(out_a.float(), lse_a.float(), out_b.float(), lse_b.float())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    fp32_math = dict(rtol=1e-5, atol=1e-5)  # fp32 inputs and math, on lse values of a few units
    torch.testing.assert_close(out.double(), whole_out, **fp32_math)
    torch.testing.assert_close(lse.double(), whole_lse, **fp32_math)

    sink_out, sink_lse = naive_attention(q, k, v, sinks=sinks)
    with_sink = torch.logaddexp(lse.double(), sinks.double())
    torch.testing.assert_close(with_sink, sink_lse, **fp32_math)
    torch.testing.assert_close(out.double() * (lse.double() - with_sink).exp().unsqueeze(-1), sink_out, **fp32_math)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_states_empty(dtype):
    """Two empty states (lse -inf) merge to zeros and -inf, never NaN; merging with one empty
    state returns the other; otherwise `logaddexp` and the lse-weighted sum."""
    out_a, out_b = rand(4, 3, D, dtype=dtype), rand(4, 3, D, dtype=dtype)
    lse_a, lse_b = torch.randn(4, 3), torch.randn(4, 3)
    lse_a[0], lse_b[0], lse_a[1], lse_b[2] = -math.inf, -math.inf, -math.inf, -math.inf
    out, lse = torch.ops.attn.merge_states(out_a, lse_a, out_b, lse_b)
    assert not out[0].any() and bool((lse[0] == -math.inf).all())
    assert torch.equal(out[1], out_b[1]) and torch.equal(lse[1], lse_b[1])
    assert torch.equal(out[2], out_a[2]) and torch.equal(lse[2], lse_a[2])
    for h in range(3):
        la, lb = lse_a[3, h].item(), lse_b[3, h].item()
        both = math.log(math.exp(la) + math.exp(lb))
        expect = [math.exp(la - both) * a + math.exp(lb - both) * b
                  for a, b in zip(out_a[3, h].tolist(), out_b[3, h].tolist())]
        assert lse[3, h].item() == pytest.approx(both, rel=1e-6, abs=2e-6)  # fp32 math
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out[3, h].double(), torch.tensor(expect, dtype=F64), rtol=eps, atol=max(eps, 1e-5))


def test_merge_states_at_extreme_lse_keeps_the_weights_exact():
    lse_a, lse_b = torch.full((4, 2), 46000.25), torch.full((4, 2), 46000.0) + torch.rand(4, 2)
    ones = torch.ones(4, 2, 8)
    out, lse = reference.merge_states(ones, lse_a, ones, lse_b)
    assert (out - 1).abs().max() < 1e-6
    assert torch.allclose(lse.double(), torch.logaddexp(lse_a.double(), lse_b.double()), rtol=0, atol=0.01)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_merge_states_of_a_non_finite_lse_is_nan(bad):
    """An lse of +inf or NaN (not a partial state) gives NaN out and lse for its row, as the
    kernel's; the other rows merge as usual."""
    out_a, out_b = rand(4, 3, D, dtype=torch.float32), rand(4, 3, D, dtype=torch.float32)
    lse_a, lse_b = torch.randn(4, 3), torch.randn(4, 3)
    out0, lse0 = reference.merge_states(out_a, lse_a, out_b, lse_b)
    lse_b[2, 1] = bad
    out, lse = reference.merge_states(out_a, lse_a, out_b, lse_b)
    assert bool(out[2, 1].isnan().all()) and math.isnan(lse[2, 1])
    out[2, 1], lse[2, 1] = out0[2, 1], lse0[2, 1]
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
