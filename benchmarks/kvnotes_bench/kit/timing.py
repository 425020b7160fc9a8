"""Timing a call: one warm-up, then the median of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def median_time(fn: Callable[[], T], reps: int) -> tuple[float, list[float], T]:
    """One warm-up call of ``fn``, then ``reps`` timed calls: their median (seconds), every
    time, and what the last call returned.

        >>> median, times, value = median_time(lambda: 7, 3)
        >>> (len(times), value, median >= 0)
        (3, 7, True)
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    out = fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out
