"""`attn::kv_cache_write` with a value head dim of its own: the MLA latent cache written in one call
(`key` = the RoPE part into `latent[..., 512:]`, rotated, `value` = the compressed part into
`latent[..., :512]`), by the Triton kernel (`torch_ops.kernels.triton.latent_cache_write`) against
`reference.kv_cache_write` on a clone of the same poisoned cache, then read back by `paged_decode`.

Values and unrotated keys must come back bit for bit; rotated keys within one step of the cache
format (fp32 RoPE roundings may differ on the GPU). Slots the call does not write keep their poison.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ops
from torch_ops import errors, reference
from torch_ops.kernels.triton import kv_cache_write as kcw
from torch_ops.testing import assert_error_ratio, poison_

pytestmark = pytest.mark.usefixtures("clear_error_flags")

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
DV, DR = 512, 64


def make_problem(device, *, cache_dtype=BF16, t=9, hq=16, bs=16, rope="neox", with_query=True, num_blocks=None):
    """A latent cache (poisoned) and one call's arguments: `(latent, args, kwargs)`."""
    nb = num_blocks or -(-t // bs) + 3
    latent = torch.empty(nb, bs, 1, DV + DR, dtype=cache_dtype, device=device)
    poison_(latent)
    kv_c = torch.randn(t, 1, DV, dtype=BF16, device=device)
    k_pe = torch.randn(t, 1, DR, dtype=BF16, device=device) * 3
    slots = torch.randperm(nb * bs, device=device)[:t].to(torch.int32)
    if t > 2:
        slots[1] = -1                       # skipped
    kwargs = {}
    if cache_dtype == E4M3:
        s = torch.tensor(0.05, device=device)
        kwargs.update(k_scale=s, v_scale=s)   # one cache, one scale
    if rope:
        kwargs.update(positions=torch.randint(0, 512, (t,), dtype=torch.int32, device=device),
                      cos_sin_cache=reference.rope_cos_sin_cache(512, DR).to(device), rope_neox=rope == "neox")
        if with_query:
            q = torch.randn(t, hq, DV + DR, dtype=BF16, device=device)
            kwargs["query"] = q[..., DV:]    # the queries' RoPE part, a strided view
    return latent, (k_pe, kv_c, latent[..., DV:], latent[..., :DV], slots), kwargs


def write_both(latent, args, kwargs):
    """The Triton kernel's write into `latent` and the reference's into a clone; returns
    `(ours, theirs, rotated query (ours), rotated query (reference))`."""
    ref = latent.clone()
    with torch_ops.use_backend("triton"):
        q_ours = torch.ops.attn.kv_cache_write(*args, **kwargs)
    q_ref = reference.kv_cache_write(args[0], args[1], ref[..., DV:], ref[..., :DV], args[4], **kwargs)
    return latent, ref, q_ours, q_ref


def assert_same_writes(ours, ref, rotated: bool):
    """Values (and unrotated keys) bitwise; rotated keys within one step of the cache format."""
    bits = lambda x: x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16)
    assert torch.equal(bits(ours[..., :DV]), bits(ref[..., :DV])), "values differ"
    if not rotated:
        assert torch.equal(bits(ours[..., DV:]), bits(ref[..., DV:])), "keys differ"
        return
    written = ~torch.isnan(ref[..., DV:].float())
    assert torch.equal(written, ~torch.isnan(ours[..., DV:].float())), "other slots written or skipped"
    rel = 2.0 ** -3 if ref.dtype == E4M3 else 2.0 ** -7
    torch.testing.assert_close(ours[..., DV:].float()[written], ref[..., DV:].float()[written], rtol=rel, atol=2.0 ** -9)


@pytest.mark.parametrize("cache_dtype,bs,rope,with_query", [
    (BF16, 16, "neox", True), (BF16, 1, "gptj", True), (E4M3, 64, "gptj", True), (E4M3, 16, "neox", False),
    (BF16, 64, None, False), (E4M3, 1, None, False),
], ids=lambda x: str(x).replace("torch.", ""))
def test_latent_write(kernel_device, cache_dtype, bs, rope, with_query):
    latent, args, kwargs = make_problem(kernel_device, cache_dtype=cache_dtype, bs=bs, rope=rope, with_query=with_query)
    ours, ref, q_ours, q_ref = write_both(latent, args, kwargs)
    assert_same_writes(ours, ref, rotated=rope is not None)
    if with_query:
        assert q_ours.shape == (9, 16, DR) and q_ours.dtype == BF16
        truth = reference.apply_rope(kwargs["query"], kwargs["positions"], kwargs["cos_sin_cache"], rope == "neox",
                                     torch.float64)
        base = reference.apply_rope(kwargs["query"], kwargs["positions"], kwargs["cos_sin_cache"], rope == "neox",
                                    torch.float32).to(BF16)
        assert_error_ratio(q_ours, truth, base, name="rotated query")
    else:
        assert q_ours.numel() == 0
    errors.check_errors()   # good metadata sets no error bit


def test_slots_and_positions_out_of_range(kernel_device):
    latent, args, kwargs = make_problem(kernel_device, t=6, bs=4, num_blocks=3, rope="neox", with_query=False)
    slots = torch.tensor([0, 12, 5, 10**6, -7, 11], dtype=torch.int32, device=kernel_device)   # 12 slots
    kwargs["positions"] = torch.tensor([0, 1, 9999, 3, 4, -2], dtype=torch.int32, device=kernel_device)
    args = (*args[:4], slots)
    ours, ref, _, _ = write_both(latent, args, kwargs)
    assert_same_writes(ours, ref, rotated=True)
    rows = ours.flatten(0, 1).float()
    assert not torch.isnan(rows[[0, 5, 11]]).any() and torch.isnan(rows[1:5]).all()
    with pytest.raises(ValueError, match="slot_mapping: slot >= num_blocks \\* block_size.*positions: RoPE position"):
        errors.check_errors()


def test_written_latents_read_back_by_decode(kernel_device):
    """One MLA step: write each sequence's new latent row, then decode over the cache with the
    absorbed queries (their RoPE part rotated by the write), against dense attention."""
    hq, bs, lens = 16, 16, [37, 5]
    latent = torch.randn(8, bs, 1, DV + DR, dtype=BF16, device=kernel_device)
    table = torch.tensor([[3, 0, 6], [5, 1, 2]], dtype=torch.int32, device=kernel_device)
    new_slots = torch.tensor([6 * bs + 4, 5 * bs + 4], dtype=torch.int32, device=kernel_device)  # keys 36 and 4
    kv_c, k_pe = torch.randn(2, 1, DV, dtype=BF16, device=kernel_device), torch.randn(2, 1, DR, dtype=BF16, device=kernel_device)
    q = torch.randn(2, hq, DV + DR, dtype=BF16, device=kernel_device)
    cs = reference.rope_cos_sin_cache(64, DR).to(kernel_device)
    positions = torch.tensor([36, 4], dtype=torch.int32, device=kernel_device)
    with torch_ops.use_backend("triton"):
        q_pe = torch.ops.attn.kv_cache_write(k_pe, kv_c, latent[..., DV:], latent[..., :DV], new_slots, query=q[..., DV:],
                                             positions=positions, cos_sin_cache=cs, rope_neox=False)
        q = torch.cat([q[..., :DV], q_pe], dim=-1)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=kernel_device)
        out, lse = torch.ops.attn.paged_decode(q, latent, latent[..., :DV], table, seq_lens, scale=1 / math.sqrt(192))
    for b, n in enumerate(lens):
        rows = latent[table[b].long()].flatten(0, 1)[:n]          # [n, 1, 576]
        assert torch.equal(rows[n - 1, 0, :DV], kv_c[b, 0])        # the new row is the sequence's last key
        truth, truth_lse = reference.attend(q[b:b + 1], rows, rows[..., :DV], torch.tensor([n - 1]), causal=True,
                                            scale=1 / math.sqrt(192), compute_dtype=torch.float64)
        base, base_lse = reference.attend(q[b:b + 1], rows, rows[..., :DV], torch.tensor([n - 1]), causal=True,
                                          scale=1 / math.sqrt(192), compute_dtype=BF16)
        assert_error_ratio(out[b:b + 1], truth, base.to(BF16))
        assert_error_ratio(lse[b:b + 1], truth_lse, base_lse, name="lse")


def test_mla_step_under_torch_compile():
    """The latent write and the decode over views of one latent tensor compile without a graph
    break, once for three batch sizes (dynamic shapes), and equal eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(latent, k_pe, kv_c, q, slots, positions, cos_sin, table, seq_lens):
        q_pe = torch.ops.attn.kv_cache_write(k_pe, kv_c, latent[..., DV:], latent[..., :DV], slots, query=q[..., DV:],
                                             positions=positions, cos_sin_cache=cos_sin, rope_neox=False)
        q = torch.cat([q[..., :DV], q_pe], dim=-1)
        return torch.ops.attn.paged_decode(q, latent, latent[..., :DV], table, seq_lens, scale=0.07)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    cs = reference.rope_cos_sin_cache(64, DR)
    for n in (2, 3, 5):
        latent = torch.randn(4 * n, 16, 1, DV + DR, dtype=BF16)
        table = torch.randperm(4 * n).view(n, 4).int()
        seq_lens = torch.randint(1, 64, (n,), dtype=torch.int32)
        slots = (table[torch.arange(n), (seq_lens - 1) // 16] * 16 + (seq_lens - 1) % 16).int()
        inputs = (torch.randn(n, 1, DR, dtype=BF16), torch.randn(n, 1, DV, dtype=BF16),
                  torch.randn(n, 16, DV + DR, dtype=BF16), slots, seq_lens - 1, cs, table, seq_lens)
        eager_latent = latent.clone()
        out, lse = compiled(latent, *inputs)
        ref_out, ref_lse = step(eager_latent, *inputs)
        assert torch.equal(latent, eager_latent)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert counter.frame_count == 1


BAD = [
    ("value vs v_cache", lambda a, k: ((*a[:3], a[3][..., :256], a[4]), k), ValueError,
     "v_cache last dim must be 512 for value head dim 512 (key head dim 64), got 256"),
    ("value heads", lambda a, k: ((a[0], a[1].expand(9, 2, DV), *a[2:]), k), ValueError, "value shape (9, 2, 512) must equal key shape"),
    ("value dtype", lambda a, k: ((a[0], a[1].half(), *a[2:]), k), TypeError, "value dtype torch.float16 must equal key dtype"),
    ("int8 cache", lambda a, k: ((*a[:2], a[2].view(torch.int8), a[3].view(torch.int8), a[4]),
                                 {"k_scale": torch.ones(4, 16, 1, 8), "v_scale": torch.ones(4, 16, 1, 8)}),
     ValueError, "v_cache head dim (512) must equal k_cache head dim (64) in INT8 caches"),
    ("query head dim", lambda a, k: (a, {**k, "query": torch.zeros(9, 16, DV + DR, dtype=BF16)}), ValueError,
     "query must be [T, Hq, D] = [9, Hq, 64]"),
    ("rotary dim", lambda a, k: (a, {**k, "cos_sin_cache": torch.zeros(16, 128)}), ValueError,
     "cos_sin_cache rotary_dim (dim 1) must be even and in 2..64"),
]


@pytest.mark.parametrize("edit,error,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(edit, error, match):
    latent, args, kwargs = make_problem("cpu", cache_dtype=E4M3 if "int8" in match.lower() else BF16)
    args, kwargs = edit(args, kwargs)
    with pytest.raises(error, match=re.escape(match)):
        torch.ops.attn.kv_cache_write(*args, **kwargs)


def test_fake_returns_the_rotated_query_part():
    latent, args, kwargs = make_problem("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_latent = mode.from_tensor(latent)
        fake = (mode.from_tensor(args[0]), mode.from_tensor(args[1]), fake_latent[..., DV:], fake_latent[..., :DV],
                mode.from_tensor(args[4]))
        q = torch.ops.attn.kv_cache_write(*fake, **kwargs)
        assert q.shape == (9, 16, DR) and q.dtype == BF16


def test_unsupported_reasons():
    latent, args, kwargs = make_problem("cpu")
    assert kcw.unsupported(*args, **kwargs) == []
    big = torch.zeros(2, 1, 2048, dtype=BF16)
    cache = torch.zeros(4, 16, 1, 2048 + DR, dtype=BF16)
    why = kcw.unsupported(args[0][:2], big, cache[..., 2048:], cache[..., :2048], args[4][:2])
    assert any("head dims above 1024" in w for w in why), why


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rope", ["neox", "gptj"])
def test_latent_write_gpu(kernel_device, cache_dtype, rope):
    latent, args, kwargs = make_problem(kernel_device, cache_dtype=cache_dtype, t=4096, hq=128, bs=64, rope=rope)
    ours, ref, q_ours, q_ref = write_both(latent, args, kwargs)
    assert_same_writes(ours, ref, rotated=True)
    torch.testing.assert_close(q_ours.float(), q_ref.float(), rtol=2.0 ** -7, atol=1e-6)
    errors.check_errors()
