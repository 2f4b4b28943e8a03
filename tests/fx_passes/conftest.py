"""Every FX-pass test starts from a clean compiler: no compiled frames, no counters, no
FX-graph/AOTAutograd cache hits (a hit skips the passes, so their counters would stay at zero),
and ends with the Inductor hook as it found it, even if the test failed half-way."""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

import fx_passes


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    counters.clear()
    hook_before = getattr(inductor_config, fx_passes.HOOK)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    setattr(inductor_config, fx_passes.HOOK, hook_before)
    fx_passes._installed = None
    torch._dynamo.reset()
