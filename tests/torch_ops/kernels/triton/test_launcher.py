"""TritonLaunch (torch_ops/kernels/triton/launcher.py): the first call goes through the JIT, later ones
straight to the compiled kernel's launcher with the same arguments; a fake kernel stands in for
Triton's, so that the bookkeeping runs on CPU."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from triton.runtime.errors import OutOfResources

from torch_ops.kernels.triton import launcher


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """`fn[grid](*args, **meta)` like a JIT function with parameters X, Y, n, BLOCK, FLAG=True."""

    params = [types.SimpleNamespace(name=n, default=d) for n, d in
              (("X", None), ("Y", None), ("n", None), ("BLOCK", None), ("FLAG", True))]

    def __init__(self, fits=lambda meta: True):
        self.compiled, self.jit_calls, self.fits = _Compiled(), [], fits

    def __getitem__(self, grid):
        def call(*args, **meta):
            if not self.fits(meta):
                raise OutOfResources(1, 0, "shared memory")
            self.jit_calls.append((grid, args, meta))
            return self.compiled
        return call


@pytest.fixture
def gpu(monkeypatch):
    """A current CUDA device (`gpu.device`) and its stream, and no interpreter."""
    state = types.SimpleNamespace(device=0)
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.device)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 100 + device, raising=False)
    return state


def test_later_calls_go_straight_to_the_launcher(gpu):
    fn = _Kernel()
    launch = launcher.TritonLaunch(fn, (4, 2), (7,), {"BLOCK": 64, "num_warps": 4})
    launch("x0", "y0")
    assert fn.jit_calls == [((4, 2, 1), ("x0", "y0", 7), {"BLOCK": 64, "num_warps": 4})]
    launch("x1", "y1")
    # grid, stream, function, metadata, no launch metadata or hooks, then every parameter in order
    assert fn.compiled.launches == [(4, 2, 1, 100, "function", "metadata", None, None, None, "x1", "y1", 7, 64, True)]
    assert launch.kernel is fn.compiled and len(fn.jit_calls) == 1


def test_another_current_device_or_a_launch_hook_goes_through_the_jit(gpu, monkeypatch):
    fn = _Kernel()
    launch = launcher.TritonLaunch(fn, (1,), (), {"BLOCK": 16})
    launch("x", "y", 3)
    gpu.device = 1
    launch("x", "y", 3)
    assert len(fn.jit_calls) == 2 and not fn.compiled.launches
    monkeypatch.setattr(launcher, "_launch_hooks_set", lambda: True)
    launch("x", "y", 3)
    assert len(fn.jit_calls) == 3 and not fn.compiled.launches


def test_a_kernel_that_does_not_fit_is_retried_smaller(gpu):
    fn = _Kernel(fits=lambda meta: meta["BLOCK"] <= 32)
    launch = launcher.TritonLaunch(fn, (1,), (5,), {"BLOCK": 128},
                                   shrink=lambda meta: {"BLOCK": meta["BLOCK"] // 2} if meta["BLOCK"] > 16 else None)
    launch("x", "y")
    assert launch.meta == {"BLOCK": 32} and fn.jit_calls[-1][2] == {"BLOCK": 32}
    with pytest.raises(OutOfResources):
        launcher.TritonLaunch(_Kernel(fits=lambda meta: False), (1,), (5,), {"BLOCK": 32},
                              shrink=lambda meta: None)("x", "y")


def test_interpreted_kernels_always_go_through_the_jit(gpu, monkeypatch):
    monkeypatch.setattr(launcher, "interpreting", lambda: True)
    fn = _Kernel()
    launch = launcher.TritonLaunch(fn, (1,), (5,), {"BLOCK": 16})
    launch("x", "y")
    launch("x", "y")
    assert len(fn.jit_calls) == 2 and not fn.compiled.launches


@pytest.mark.parametrize("mode,expected", [("none", ("absent", "absent")), ("given", ("k", "v"))])
def test_scale_operands(mode, expected):
    assert launcher.scale_operands(mode, "k", "v", 4, "absent") == expected


def test_scale_operands_expand_and_copy():
    k, v = torch.tensor(2.0), torch.arange(4.0)
    ks, vs = launcher.scale_operands("per_head", k, v.expand(4), 4, None)
    assert torch.equal(ks, torch.full((4,), 2.0)) and ks.is_contiguous() and torch.equal(vs, v)
    strided = torch.arange(8.0).view(2, 4)[:, ::2]
    ks, vs = launcher.scale_operands("contiguous", strided, strided, 4, None)
    assert ks.is_contiguous() and torch.equal(ks, strided)


_KEYS_IN_ORDER = """
import importlib, json, pkgutil, sys
import torch_ops.kernels.triton as package
from torch_ops.kernels.triton.launcher import _JIT_CALLABLE, settle_cache_key
fns = {}
for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"{package.__name__}.{info.name}")
    fns.update({f"{info.name}.{name}": fn for name, fn in vars(module).items()
                if isinstance(fn, _JIT_CALLABLE) and fn.__module__ == module.__name__})
names = sorted(fns, reverse=sys.argv[1] == "reversed")
print(json.dumps({name: settle_cache_key(fns[name]) for name in names}))
"""


def test_cache_keys_do_not_depend_on_what_was_compiled_before():
    """Two fresh processes settle every kernel's Triton cache key in opposite orders (compiled JIT
    functions: no interpreter) and agree on each: a compile-ahead worker and the serving process
    then find each other's kernels in Triton's cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    keys = [json.loads(subprocess.run([sys.executable, "-c", _KEYS_IN_ORDER, order], env=env, check=True,
                                      capture_output=True, text=True).stdout)
            for order in ("sorted", "reversed")]
    assert len(keys[0]) > 20 and all(keys[0].values())
    assert keys[0] == keys[1]
