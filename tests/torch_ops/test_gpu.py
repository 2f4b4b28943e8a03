import pytest
import torch

from torch_ops import gpu


def _pool_of(tensor: torch.Tensor, segments: list[dict]) -> tuple:
    for segment in segments:
        if segment["address"] <= tensor.data_ptr() < segment["address"] + segment["total_size"]:
            return tuple(segment["segment_pool_id"])
    raise AssertionError("the tensor lies in no segment of the allocator")


@pytest.mark.gpu
def test_kept_tensor_is_not_in_the_pool_of_a_graph_being_warmed_up():
    """Inside reduce-overhead's warm-up every allocation of the thread goes to the graph's pool,
    which the graph later reuses; a tensor kept for the process must come from elsewhere."""
    device = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.graph_pool_handle()
    torch._C._cuda_beginAllocateCurrentThreadToPool(device.index, pool)
    try:
        routed = torch.zeros(1, device=device)
        kept = gpu.kept_tensor(lambda: torch.full((1,), 7, dtype=torch.int32, device=device), device)
    finally:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    segments = torch.cuda.memory_snapshot()
    assert _pool_of(routed, segments) == tuple(pool)   # the routing this test relies on is in force
    assert _pool_of(kept, segments) != tuple(pool)
    assert kept.item() == 7
    del routed
    torch._C._cuda_releasePool(device.index, pool)


def test_kept_tensor_raises_what_make_raises():
    with pytest.raises(ValueError, match="bad"):
        gpu.kept_tensor(lambda: (_ for _ in ()).throw(ValueError("bad")), torch.device("cuda", 0)
                        if torch.cuda.is_available() else torch.device("cpu"))
