"""The C++ op front (torch_ops/replay.py, csrc/replay.cpp): recordings, and replays on the GPU
that do exactly what the Python front does."""

import ctypes

import pytest
import torch
import triton
import triton.language as tl

import torch_ops
from torch_ops import backends, quant, replay
from torch_ops.ops import bucket
from torch_ops.kernels.triton.launcher import TritonLaunch

from . import samples


# --- recording (any device) ---------------------------------------------------------------------


def test_a_recording_lets_views_and_allocations_through_and_refuses_other_work():
    x, y = torch.arange(12, dtype=torch.int32), torch.randn(4, 8)
    with replay.Recording() as r:
        x.to(torch.int32), y.contiguous(), y.view(torch.int32), y[:, 2:], y.t()   # no tensor work
        made = torch.empty(3, 5)
    assert r.refused is None and len(r.buffers) == 1 and r.buffers[0].data_ptr() == made.data_ptr()
    for work in (lambda: x.to(torch.int64), lambda: y.expand(2, 4, 8).contiguous(), lambda: y.zero_()):
        with replay.Recording() as r:
            work()
        assert r.refused and r.refused.startswith("it runs aten::")
        with pytest.raises(replay.NotRecordable):
            r.encode([], [])


def test_addresses_resolve_to_one_argument_or_buffer_plus_an_offset():
    arg, other, buf = torch.randn(4, 8), torch.randn(3), torch.empty(6)
    where = replay._Addresses([(0, arg), (3, other)], [buf])
    assert where(arg.data_ptr()) == [replay._ARGUMENT, 0, 0]
    assert where(arg[1, 2:].data_ptr()) == [replay._ARGUMENT, 0, 40]
    assert where(other.data_ptr()) == [replay._ARGUMENT, 3, 0]
    assert where(buf[2:].data_ptr()) == [replay._BUFFER, 0, 8]
    assert where(0) == [replay._NULL, 0, 0]
    with pytest.raises(replay.NotRecordable, match="none or several"):
        where(arg.data_ptr() + arg.numel() * 4)   # just past its end
    # arguments at one address share it in every call of the signature: the first stands for all
    assert replay._Addresses([(4, arg), (1, arg.view(torch.int32))], [])(arg.data_ptr()) == [replay._ARGUMENT, 1, 0]
    overlapping = replay._Addresses([(0, arg), (1, arg[1:])], [])
    with pytest.raises(replay.NotRecordable, match="none or several"):
        overlapping(arg[2].data_ptr())


def test_a_library_call_records_its_struct_and_where_its_pointers_come_from():
    class Args(ctypes.Structure):
        _fields_ = [("a", ctypes.c_void_p), ("n", ctypes.c_int64), ("b", ctypes.c_void_p)]

    arg = torch.randn(8)
    r = replay.Recording()
    r.c_call(ctypes.pythonapi.Py_IsInitialized, Args(arg.data_ptr() + 16, 7, None), 0)
    code = replay._encode_c_call(0, replay._Addresses([(2, arg)], []), *r.launches[0][1:])
    entry = ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value
    size = ctypes.sizeof(Args)
    assert code[:3] == [replay._C_CALL, entry, size]
    assert code[3 + size:] == [2, 0, replay._ARGUMENT, 2, 16, 16, replay._NULL, 0, 0]
    assert bytes(code[3:3 + size])[8:16] == (7).to_bytes(8, "little")


def test_returned_tensors_must_be_buffers_of_the_call():
    arg = torch.randn(3)
    with replay.Recording() as r:
        out = torch.empty(3)
    assert r.refused is None
    with pytest.raises(replay.NotRecordable, match="did not allocate"):
        r.encode([], [arg])
    if torch.cuda.is_available():
        assert r.encode([], [out])[:3] == [torch.cuda.current_device(), 1, 0]


# --- replays on the GPU -------------------------------------------------------------------------

# cache_attention's int4 sample has an attn_mask: the vanilla backend serves it, through Python
REPLAYED = [(op, v) for op, variants in samples.VARIANTS.items() for v in variants if (op, v) != ("cache_attention", "int4")]
WRITTEN = {"kv_cache_write": lambda args, kwargs: [*args[2:4], kwargs.get("k_scale"), kwargs.get("v_scale")],
           "cache_attention": lambda args, kwargs: [args[10], args[11] if len(args) > 11 else kwargs.get("scale")]}


def _tensors(x, fn):
    """`x` (a tensor, or a tuple or dict holding some) with `fn` applied to each tensor."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _tensors(v, fn) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_tensors(v, fn) for v in x)
    return x


def _on_cuda(x):
    return _tensors(x, torch.Tensor.cuda)


def _redrawn(x):
    """The same call signature with other data: floating tensors redrawn, the rest copied."""
    return _tensors(x, lambda t: torch.randn_like(t) if t.is_floating_point() and t.element_size() > 1
                    and t.dim() > 1 else t.clone())


def _call(op, args, kwargs, backend=None):
    """The op's results, and what it wrote into its arguments (the caches of kv_cache_write and
    cache_attention)."""
    args, kwargs = _redrawn(args), _redrawn(kwargs)   # a private copy: the call may write into it
    with torch_ops.use_backend(backend):
        result = getattr(torch.ops.attn, op)(*args, **kwargs)
    results = [result] if isinstance(result, torch.Tensor) else list(result)
    return results + (WRITTEN[op](args, kwargs) if op in WRITTEN else [])


def _hopper_call(name):
    """Calls of the shapes the CUDA libraries serve (D = 128), with the backend to pin."""
    lens, hq, hkv, d = [300, 0, 77], 8, 2, 128
    if name.startswith("context"):
        cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        q, k, v = (torch.randn(sum(lens), h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        kwargs = dict(causal=True)
        if "fp8" in name:
            scales = [torch.rand(()) * 0.1 + 0.05 for _ in range(3)]
            q, k, v = (quant.quantize_fp8(x.float(), s, torch.float8_e4m3fn) for x, s in zip((q, k, v), scales))
            kwargs.update(q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
        return "context_attention", (q, k, v, cu, cu), kwargs, "cutlass"
    k, v, scales = samples.paged_cache(64, 16, hkv, d, "e4m3" if "fp8" in name else "bf16")
    tables = samples.block_tables_for(lens, 16, 64)
    if name.startswith("decode"):
        q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16)
        return "paged_decode", (q, k, v, tables, torch.tensor(lens, dtype=torch.int32)), scales, "cuda"
    q_lens = [200, 0, 7]
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), hq, d, dtype=torch.bfloat16)
    return "paged_prefill", (q, k, v, tables, cu, torch.tensor(lens, dtype=torch.int32)), {}, name.split()[-1]


HOPPER = ["context bf16", "context fp8", "decode bf16", "decode fp8", "prefill cutlass", "prefill mixed"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*(f"{op}:{v}" for op, v in REPLAYED), *(f"hopper:{name}" for name in HOPPER)])
def test_a_replay_does_what_the_python_front_does(csrc_libraries, monkeypatch, case):
    assert replay.installed(), "torch_ops.warmup() builds and installs the C++ front"
    family, variant = case.split(":")
    if family == "hopper":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the CUDA libraries' kernels need Hopper")
        op, args, kwargs, backend = _hopper_call(variant)
    else:
        (args, kwargs), op, backend = samples.sample(family, variant), family, None
    args, kwargs = _on_cuda(args), _on_cuda(kwargs)
    _call(op, args, kwargs, backend)   # the signature's first call: recorded
    torch.manual_seed(1)
    before = replay.counters()["replayed"]
    replayed = _call(op, args, kwargs, backend)
    assert replay.counters()["replayed"] == before + 1, f"attn::{op} ({variant}) was not replayed"
    monkeypatch.setenv("ATTN_REPLAY", "0")   # the Python front, on the same data
    torch.manual_seed(1)
    expected = _call(op, args, kwargs, backend)
    for got, want in zip(replayed, expected, strict=True):
        if want is not None:
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"attn::{op} ({variant})"


@pytest.mark.gpu
def test_a_growing_max_kvlen_replays_within_its_power_of_two(csrc_libraries):
    args, kwargs = _on_cuda(samples.sample("cache_attention", "paged"))
    bound = 9   # above the sample's key counts
    _call("cache_attention", args[:9] + (bound,) + args[10:], kwargs)   # recorded
    before = replay.counters()["replayed"]
    for grown in range(bound + 1, bucket(bound) + 1):
        _call("cache_attention", args[:9] + (grown,) + args[10:], kwargs)
    assert replay.counters()["replayed"] == before + bucket(bound) - bound


@triton.jit
def _fill_kernel(X, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(X + i, i.to(tl.float32), mask=i < n)


@pytest.mark.gpu
def test_a_triton_launch_outside_triton_launch_is_not_recorded():
    x = torch.zeros(8, device="cuda")
    with replay.Recording() as r:
        _fill_kernel[(1,)](x, 8, BLOCK=8)
    with pytest.raises(replay.NotRecordable, match="outside TritonLaunch"):
        r.encode([], [])
    with replay.Recording() as r:
        launch = TritonLaunch(_fill_kernel, (1,), (8,), dict(BLOCK=8))
        launch(x)   # compiles through the JIT
        launch(x)   # straight to the compiled launcher
    assert r.encode([(0, x)], [])[:2] == [torch.cuda.current_device(), 0]


@pytest.mark.gpu
def test_each_requested_backend_has_its_own_recording(csrc_libraries):
    args, kwargs = _on_cuda(samples.sample("paged_decode", "gqa"))
    for name in ("triton", "vanilla", None):
        with torch_ops.use_backend(name):
            first = torch.ops.attn.paged_decode(*args, **kwargs)
            before = replay.counters()
            again = torch.ops.attn.paged_decode(*args, **kwargs)
            after = replay.counters()
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        # vanilla runs in Python (nothing to record); the kernels replay
        assert after["replayed"] - before["replayed"] == (name != "vanilla")


@pytest.mark.gpu
def test_arguments_sharing_an_address_are_part_of_the_signature(csrc_libraries):
    args, kwargs = _on_cuda(samples.sample("context_attention", "causal"))
    q, k, v, cu_q, _ = args
    cu_k = cu_q.clone()
    torch.ops.attn.context_attention(q, k, v, cu_q, cu_q, **kwargs)   # recorded with one tensor for both
    before = replay.counters()["replayed"]
    shared = torch.ops.attn.context_attention(q, k, v, cu_q, cu_q, **kwargs)
    assert replay.counters()["replayed"] == before + 1
    cu_k.copy_(torch.tensor([0, 5, 10, 10]))   # other key lengths, in a tensor of their own: another signature
    separate = torch.ops.attn.context_attention(q, k, v, cu_q, cu_k, **kwargs)
    with torch_ops.use_backend("vanilla"):
        want_shared = torch.ops.attn.context_attention(q, k, v, cu_q, cu_q, **kwargs)
        want_separate = torch.ops.attn.context_attention(q, k, v, cu_q, cu_k, **kwargs)
    for got, want in ((shared, want_shared), (separate, want_separate)):
        torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_bad_input_raises_the_python_fronts_error_through_the_cpp_front(csrc_libraries):
    args, kwargs = _on_cuda(samples.sample("paged_decode", "gqa"))
    with pytest.raises(ValueError, match="block_tables must have one row per sequence"):
        torch.ops.attn.paged_decode(*args[:4], args[4][:-1], **kwargs)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_allocate_from_the_graph_pool(csrc_libraries):
    args, kwargs = _on_cuda(samples.sample("paged_decode", "gqa"))
    torch.ops.attn.paged_decode(*args, **kwargs)   # recorded
    out, lse = torch.ops.attn.paged_decode(*args, **kwargs)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        before = replay.counters()["replayed"]
        g_out, g_lse = torch.ops.attn.paged_decode(*args, **kwargs)
        assert replay.counters()["replayed"] == before + 1
    args[0].copy_(torch.randn_like(args[0]))
    graph.replay()
    want_out, want_lse = torch.ops.attn.paged_decode(*args, **kwargs)
    torch.testing.assert_close(g_out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(g_lse, want_lse, rtol=0, atol=0)
    assert not torch.equal(g_out, out)


@pytest.mark.gpu
def test_debug_checks_send_every_call_to_the_python_front(csrc_libraries, monkeypatch):
    args, kwargs = _on_cuda(samples.sample("merge_states", "plain"))
    monkeypatch.setenv("ATTN_DEBUG", "1")
    torch.ops.attn.merge_states(*args, **kwargs)
    before = replay.counters()["replayed"]
    torch.ops.attn.merge_states(*args, **kwargs)
    assert replay.counters()["replayed"] == before
    assert backends._environment["debug"]
