"""Tensor parallelism: 2 gloo processes on CPU, heads and MLP columns sharded; greedy outputs
equal the single-process engine's (also through examples/serve_tp.py), and bad sizes are
rejected."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_ops.serving.engine import generate
from torch_ops.serving.tp import check_divisible

from .helpers import CONFIG, build_engine, random_requests


def _requests(seed):
    return random_requests(random.Random(seed), 6, CONFIG.vocab_size, max_prompt=14, max_new=6)


def _worker(rank, world, rendezvous, seed, results):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        engine = build_engine(tp_group=dist.group.WORLD, tp_size=world, seed=seed)
        assert engine.kv.caches[0].num_kv_heads == CONFIG.num_kv_heads // world
        outputs = generate(engine, _requests(seed), [0, 0, 1, 2, 2, 4])
        results[rank] = outputs
    finally:
        dist.destroy_process_group()


def test_two_rank_greedy_equals_single_process(tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), seed, results), nprocs=2, join=True)
        sharded = dict(results)
    single = generate(build_engine(seed=seed), _requests(seed), [0, 0, 1, 2, 2, 4])
    assert sharded[0] == sharded[1] == single


def test_sizes_must_divide():
    with pytest.raises(ValueError, match="num_kv_heads=2 must be divisible by the tensor-parallel size 4"):
        check_divisible(CONFIG, 4)


def test_serve_tp_example_on_cpu():
    """examples/serve_tp.py spawns 2 gloo processes and checks itself against 1 process."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "examples/serve_tp.py", "--nproc", "2", "--num-requests", "6"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "2 ranks (gloo)" in result.stdout
    assert "6/6 requests have the same greedy output as the single-device run" in result.stdout
