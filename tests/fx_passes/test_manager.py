"""`fx_passes.enable/disable/enabled` and `PassManager`: the Inductor hook is restored exactly, a
pass already installed there keeps running, the uuid follows the config, and nothing is
rewritten unless enabled."""

import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import fx_passes
from fx_passes import HOOK, PASSES, PassConfig, PassManager


class RecordingPass(CustomGraphPass):
    """A user's pass: records the call targets of every graph it sees."""

    def __init__(self, name="recording"):
        self.name, self.seen = name, []

    def __call__(self, graph):
        self.seen.append({getattr(n.target, "__name__", n.target) for n in graph.nodes})

    def uuid(self):
        return self.name


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def compile_sdpa():
    """Compile and run `causal_sdpa`; returns whether the generated code calls the attn op."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(causal_sdpa, fullgraph=True), q, k, v)
    return "attn.context_attention" in "\n".join(code)


def hook():
    return getattr(inductor_config, HOOK)


def test_import_changes_no_config():
    script = (
        "import torch._inductor.config as i, torch._dynamo.config as d\n"
        "before = (i.get_config_copy(), d.get_config_copy())\n"
        "import fx_passes\n"
        "assert (i.get_config_copy(), d.get_config_copy()) == before\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("previous", [None, "pass", "list"])
def test_enable_then_disable_restores_the_hook_exactly(previous):
    user = {"pass": RecordingPass(), "list": [RecordingPass("a"), RecordingPass("b")]}.get(previous)
    with inductor_config.patch({HOOK: user}):
        manager = fx_passes.enable()
        assert hook() is manager and isinstance(manager, PassManager)
        assert manager.user_passes == (() if user is None else tuple(user) if previous == "list" else (user,))
        assert fx_passes.enable(PassConfig(sdpa_to_attn=False)).user_passes == manager.user_passes
        fx_passes.disable()
        assert hook() is user
        fx_passes.disable()
        assert hook() is user


def test_enabled_nests_and_restores():
    user = RecordingPass()
    with inductor_config.patch({HOOK: user}):
        with fx_passes.enabled() as outer:
            with fx_passes.enabled(PassConfig(sdpa_to_attn=False)) as inner:
                assert hook() is inner and inner.user_passes == (user,)
            assert hook() is outer
        assert hook() is user
        fx_passes.disable()
        assert hook() is user


def test_disable_refuses_to_overwrite_a_hook_changed_after_enable():
    with inductor_config.patch({HOOK: None}):
        manager = fx_passes.enable()
        setattr(inductor_config, HOOK, RecordingPass())
        with pytest.raises(RuntimeError, match="changed after fx_passes.enable"):
            fx_passes.disable()
        setattr(inductor_config, HOOK, manager)
        fx_passes.disable()
        assert hook() is None


def test_user_pass_runs_first_and_rewrite_still_happens():
    user = RecordingPass()
    with inductor_config.patch({HOOK: user}), fx_passes.enabled():
        assert compile_sdpa()
    assert len(user.seen) == 1 and "scaled_dot_product_attention" in user.seen[0]
    assert counters["attn"]["sdpa_to_attn_matched"] == 1


@pytest.mark.parametrize("setup", ["never_enabled", "after_disable", "disabled_in_config"])
def test_no_rewrite_unless_enabled(setup):
    if setup == "after_disable":
        before = inductor_config.get_config_copy()
        fx_passes.enable()
        fx_passes.disable()
        assert inductor_config.get_config_copy() == before
    with fx_passes.enabled(PassConfig(sdpa_to_attn=False)) if setup == "disabled_in_config" else contextlib.nullcontext():
        assert not compile_sdpa()
    assert counters["attn"]["sdpa_to_attn_matched"] == 0


def test_uuid_covers_config_and_user_passes():
    base = PassManager().uuid()
    assert base == PassManager(PassConfig()).uuid()
    assert PassManager(PassConfig(sdpa_to_attn=False)).uuid() != base
    assert PassManager(user_passes=(RecordingPass("a"),)).uuid() != PassManager(user_passes=(RecordingPass("b"),)).uuid()
    assert PassManager(user_passes=(lambda graph: None,)).uuid() is None


def test_config_has_one_switch_per_pass():
    assert [f.name for f in dataclasses.fields(PassConfig)] == list(PASSES)


def test_cache_keys_follow_the_config(tmp_path, monkeypatch):
    """With the FX-graph and AOTAutograd caches on, a compile under another config misses."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with inductor_config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        with fx_passes.enabled(PassConfig(sdpa_to_attn=False)):
            assert not compile_sdpa()
        torch._dynamo.reset()
        with fx_passes.enabled():
            compile_sdpa()
    assert counters["attn"]["sdpa_to_attn_matched"] == 1
