"""A kernel family's tuning knobs: one frozen dataclass of them, read when a launch is prepared,
and a context manager that changes them for a while (tests, benchmarks, tuning sweeps)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Generic, Iterator, TypeVar

from ... import backends

T = TypeVar("T")


class Knobs(Generic[T]):
    """`knobs.current`: the knobs in force (a frozen dataclass). `with knobs(name=value, ...):`
    replaces some of them inside the block; plans are cached per call signature and read the
    knobs when made, so entering and leaving clear them (`backends.clear_plans`)."""

    def __init__(self, defaults: T):
        self.current = defaults

    @contextlib.contextmanager
    def __call__(self, **changes) -> Iterator[T]:
        saved = self.current
        self.current = dataclasses.replace(saved, **changes)
        backends.clear_plans()
        try:
            yield self.current
        finally:
            self.current = saved
            backends.clear_plans()
