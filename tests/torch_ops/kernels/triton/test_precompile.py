"""torch_ops/kernels/triton/precompile.py: launches recorded instead of run, and their variants compiled ahead in
parallel processes."""

import dataclasses
import time

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

import torch_ops
from torch_ops import backends, reference
from torch_ops.kernels.triton import precompile
from torch_ops.testing import assert_error_ratio, poison_

from ... import samples


def _decode(device, batch):
    k, v, _ = samples.paged_cache(2 * batch, 4, 2, 16, "bf16", device=device)
    tables = samples.block_tables_for([7] * batch, 4, 2 * batch).to(device)
    lens = torch.full((batch,), 7, dtype=torch.int32, device=device)
    q = torch.randn(batch, 4, 16, dtype=torch.bfloat16, device=device)
    return q, k, v, tables, lens


def test_recorded_launches_do_not_run_and_name_their_variants(kernel_device):
    calls = [_decode(kernel_device, 2) for _ in range(2)]   # one signature, two calls
    buffers = [(poison_(torch.empty(2, 4, 16, dtype=torch.bfloat16, device=kernel_device)),
                poison_(torch.empty(2, 4, device=kernel_device))) for _ in calls]
    with torch_ops.use_backend("triton"), precompile.recorded() as launches:
        for call, (out, lse) in zip(calls, buffers):
            torch.ops.attn.paged_decode.out(*call, out=out, lse=lse)
    assert all(out.isnan().all() and lse.isnan().all() for out, lse in buffers), "a recorded launch ran"
    assert launches and all(l.kernel.startswith("_") and l.module.startswith("torch_ops.kernels.triton") for l in launches)
    assert len({l.variant for l in launches}) == len(launches) // 2   # each variant once per call
    assert all(isinstance(a, (int, float, bool, tuple, type(None))) for l in launches for a in l.args)
    assert not backends._PLANS["paged_decode.out"]   # plans made while recording are dropped
    with torch_ops.use_backend("triton"):
        for call in calls:
            out, lse = torch.ops.attn.paged_decode(*call)
            truth = reference.paged_decode(*call, compute_dtype=torch.float64)
            base = reference.paged_decode(*call, compute_dtype=torch.bfloat16)
            assert_error_ratio(out, truth[0], base[0])


def test_variant_key_follows_triton_specialization():
    from torch_ops.kernels.triton.paged_decode import _merge_kernel as fn

    params = precompile._params(fn)
    names = [name for name, *_ in params]
    meta = {name: 1 for name, constexpr, *_ in params if constexpr}
    x = torch.empty(64, dtype=torch.float32)
    args = [x if name[0].isupper() else 32 for name, constexpr, *_ in params if not constexpr]
    key = precompile.variant_key(fn, tuple(args), meta)
    assert key[0] == "_merge_kernel"
    assert precompile.variant_key(fn, tuple(precompile._describe(a) for a in args), meta) == key
    unaligned = [x[1:] if isinstance(a, torch.Tensor) else a for a in args]
    assert precompile.variant_key(fn, tuple(unaligned), meta) != key            # 16-byte alignment
    assert precompile.variant_key(fn, tuple(args), {**meta, "num_warps": 8}) != key
    changed = list(args)
    changed[names.index("num_splits")] = 33   # do_not_specialize: any value, one variant
    assert precompile.variant_key(fn, tuple(changed), meta) == key
    changed[names.index("stride_pt")] = 33
    assert precompile.variant_key(fn, tuple(changed), meta) != key


def _probe(X, n, BLOCK: tl.constexpr):
    pass


PROBE = JITFunction(_probe)   # compiled Triton's kind of kernel even under TRITON_INTERPRET=1


def test_ledger_lists_the_variants_compiled_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    a = precompile.Launch(__name__, "PROBE", (("tensor", "float32", True), 5), (1, 1, 1), (("BLOCK", 16),))
    b = dataclasses.replace(a, meta=(("BLOCK", 32),))
    hopper = (9, 0)
    assert precompile.uncompiled([a, b], hopper) == [a, b]
    precompile.record_compiled([a], hopper)
    assert precompile.uncompiled([a, b], hopper) == [b]
    assert precompile.uncompiled([a], (10, 0)) == [a]   # another GPU
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert precompile.uncompiled([a], hopper) == [a]    # other Triton settings


def test_compiler_hands_each_new_variant_to_a_worker_as_it_is_added(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    a = precompile.Launch(__name__, "PROBE", (("tensor", "float32", True), 5), (1, 1, 1), (("BLOCK", 16),))
    same = dataclasses.replace(a, args=(("tensor", "float32", True), 7))   # 5 and 7: one specialization
    b = dataclasses.replace(a, meta=(("BLOCK", 32),))
    listed = dataclasses.replace(a, meta=(("BLOCK", 64),))
    hopper = (9, 0)
    precompile.record_compiled([listed], hopper)
    compiler = precompile.Compiler(2, 0, hopper)
    compiler.add(a)
    assert [launch for launch, _ in compiler.todo] == [a], "submitted when added"
    for launch in (a, same, listed, b):
        compiler.add(launch)
    assert [launch for launch, _ in compiler.todo] == [a, b]
    assert compiler.finish() == 2
    failed = [r for r in caplog.records if "compiling ahead failed" in r.getMessage()]
    if torch.cuda.is_available():
        assert not failed and precompile.uncompiled([a, b], hopper) == []
    else:   # the workers have no GPU to compile for: logged, and the ledger does not list them
        assert len(failed) == 2 and precompile.uncompiled([a, b], hopper) == [a, b]


@pytest.mark.gpu
def test_variants_compile_in_parallel_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))   # a fresh cache: nothing compiled yet
    calls = [_decode("cuda", b) for b in (1, 64)] + [_decode("cuda", 3)]
    cubins_while_recording = []

    def run_then_wait():
        run()
        deadline = time.monotonic() + 120
        while not any(tmp_path.rglob("*.cubin")) and time.monotonic() < deadline:
            time.sleep(0.1)
        cubins_while_recording.append(any(tmp_path.rglob("*.cubin")))

    with torch_ops.use_backend("triton"):
        run = lambda: [torch.ops.attn.paged_decode(*c) for c in calls]   # noqa: E731
        compiled = precompile.compile_ahead(run_then_wait, workers=2)
        assert compiled >= 2
        assert cubins_while_recording == [True], "variants compile while the block is still recorded"
        assert precompile.compile_ahead(run, workers=2) == 0, "a warm cache compiles nothing again"
        for call in calls:
            out, _ = torch.ops.attn.paged_decode(*call)
            truth = reference.paged_decode(*call, compute_dtype=torch.float64)
            base = reference.paged_decode(*call, compute_dtype=torch.bfloat16)
            assert_error_ratio(out, truth[0], base[0])
