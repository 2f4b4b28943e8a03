"""Helpers for tests and benchmarks: the error-ratio tolerance and random inputs.

The tolerance follows FlashAttention's rule: our error against a float64 reference may be at
most twice the error of the same computation done by plain PyTorch in the input precision,
plus a small floor (the rounding error of the output dtype at the reference's magnitude).
"""

from __future__ import annotations

import math

import torch

from .gpu import capture_cuda_graph


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference: equal infinities and NaN against NaN count as 0, any other NaN/inf
    mismatch as infinite."""
    x, ref = x.double(), ref.double()
    same = (torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))) | (torch.isnan(x) & torch.isnan(ref))
    diff = torch.where(same, torch.zeros_like(x), (x - ref).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return diff.max().item() if diff.numel() else 0.0


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the rounding error of `dtype` at the magnitude of `ref` (FlashAttention's atol)."""
    r = ref.double().nan_to_num(0.0, 0.0, 0.0)
    rounded = (r.to(dtype).double() + 0.3 - 0.3) if dtype != torch.float64 else r
    return 2 * (rounded - r).abs().max().item() if r.numel() else 0.0


def assert_error_ratio(
    out: torch.Tensor, truth: torch.Tensor, baseline: torch.Tensor, *, ratio: float = 2.0,
    floor: float | None = None, name: str = "out",
) -> None:
    """`max|out - truth| <= ratio * max|baseline - truth| + floor`.

    `truth` is the float64 reference, `baseline` the reference computed in the input precision
    (the error a plain PyTorch implementation makes), `out` the result under test. A baseline
    whose error is infinite (a NaN or infinity the truth lacks, or the reverse) bounds nothing:
    that raises too.
    """
    err = max_error(out, truth)
    base = max_error(baseline, truth)
    if math.isinf(base):
        raise AssertionError(f"{name}: the baseline differs from the truth by inf (non-finite values "
                             "where the other is finite): no bound")
    if floor is None:
        floor = rounding_floor(truth, out.dtype) + 1e-6
    bound = ratio * base + floor
    if not err <= bound:
        raise AssertionError(
            f"{name}: max error {err:.3e} > {ratio} x baseline error {base:.3e} + floor {floor:.3e}"
        )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or the max value for integer/FP8 dtypes) so that any
    element a kernel forgets to write shows up."""
    if t.dtype.is_floating_point and t.dtype.itemsize >= 2:
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0x7F)


def assert_replays_match_eager(call, fill, outputs, check, steps: int = 3) -> None:
    """Capture `call` once after `fill(0)`; then for each step, `fill(step)` writes new inputs in
    place, the `outputs` are poisoned, the graph replays, and the replayed outputs must equal an
    eager `call()`'s bit for bit and pass `check(*replayed_outputs)`."""
    fill(0)
    graph, _ = capture_cuda_graph(call)
    for step in range(1, steps + 1):
        fill(step)
        for t in outputs:
            poison_(t)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in outputs]
        call()
        assert all(torch.equal(r, t) for r, t in zip(replayed, outputs)), f"replay {step} differs from eager"
        check(*replayed)
