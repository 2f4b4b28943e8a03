"""The CUDA device: its facts (looked up once per device), tensors kept for the process, and
capturing work in a CUDA graph. Every SM-count and capability lookup of the package goes through
here."""

from __future__ import annotations

import functools
import threading

import torch


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else device.index
    return index if index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device | int | None = None, cpu: int | None = None) -> int:
    """Streaming multiprocessors of `device` (a CUDA device, its index, or None: the current one).
    A CPU device (Triton's interpreter) counts as `cpu` SMs: the caller's stand-in for its heuristics."""
    if isinstance(device, torch.device) and device.type != "cuda":
        if cpu is None:
            raise ValueError(f"device must be a CUDA device (or give `cpu`, the SMs of a CPU stand-in), got {device}")
        return cpu
    return _properties(_index(device)).multi_processor_count


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """`(major, minor)` compute capability of `device`."""
    p = _properties(_index(device))
    return p.major, p.minor


def kept_tensor(make, device: torch.device) -> torch.Tensor:
    """`make()`, a tensor on `device` for the caller to keep for the life of the process, made on
    a helper thread and waited for: its memory comes from the allocator's ordinary pool, never from
    the private pool of a CUDA graph, to which `torch.compile(mode="reduce-overhead")` routes every
    allocation of the calling thread while it warms up or records a graph (memory it frees and
    reuses). Call it outside a stream capture."""
    if device.type != "cuda":
        return make()
    made: list = []

    def work():
        try:
            with torch.cuda.device(device):
                made.append(make())
                torch.cuda.current_stream().synchronize()
        except BaseException as e:   # raised again on the calling thread
            made.append(e)

    thread = threading.Thread(target=work, name="attn-kept-tensor")
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def capture_cuda_graph(fn):
    """Warm `fn` up on a side stream (compiling its kernels outside the capture), then capture
    one call in a CUDA graph. Returns `(graph, what the captured call returned)`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
