"""Timing helpers shared by the ensemble benchmarks (ensemble.py, stacked_mlp.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


def seconds(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def mean_seconds(way: Callable[[], object], repeat: int) -> float:
    """Mean seconds per call over `repeat` calls in a row: one timed sample."""
    start = time.perf_counter()
    for _ in range(repeat):
        way()
    return (time.perf_counter() - start) / repeat


def repeats(way: Callable[[], object], sample: float) -> int:
    """Calls per timed sample, so that a sample of `way` lasts about `sample` seconds."""
    return max(1, round(sample / seconds(way)))
