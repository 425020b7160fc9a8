"""The bench's statistics: one percentile definition and one bootstrap confidence interval.

Every percentile a workload publishes (TTFT p50/p90/p99, inter-token gaps, the guard's margin
quantiles) is :func:`percentile`: ``numpy.percentile`` with ``method="linear"`` (numpy's
default, type 7 of Hyndman and Fan: the value at rank ``(n - 1) * q / 100``, interpolated
between its neighbours). Results written before this module used other definitions in two
places, and their published figures keep them:

- the fleet's p90 TTFT per round (``serve-bench fleet``, ``docs/results/areas/fleet.md``) was the
  nearest rank, ``sorted(xs)[ceil(0.9 * n) - 1]``;
- the guard's margin quantiles (``composed_p10``/``_p50``, ``exact_p10``/``_p50`` in
  ``guard.json``) were ``sorted(xs)[min(n - 1, int(q * n))]``.

Rerun, those figures can move by up to one gap between neighbouring samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

PERCENTILE_METHOD: Final = "linear"


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by :data:`PERCENTILE_METHOD`; NaNs are
    dropped, and None when nothing is left.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([], 90)
        (2.5, None)
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    xs = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if xs.size == 0:
        return None
    return float(np.percentile(xs, q, method=PERCENTILE_METHOD))


def median(values: Iterable[float]) -> float | None:
    """The 50th :func:`percentile` (the middle value, or the mean of the two middle ones)."""
    return percentile(values, 50)


def bootstrap_ci(values: Sequence[float],
                 statistic: Callable[[NDArray[np.float64]], float] = np.mean, *,
                 level: float = 0.95, resamples: int = 2000, seed: int = 0
                 ) -> tuple[float, float] | None:
    """A percentile-bootstrap confidence interval at ``level`` for ``statistic`` of ``values``
    (``scipy.stats.bootstrap``, seeded, so a rerun on the same values gives the same interval);
    None for fewer than two values, where no interval can be resampled.

    Example:
        >>> lo, hi = bootstrap_ci([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> lo < 3.0 < hi
        True
    """
    from scipy.stats import bootstrap

    xs = np.asarray(values, dtype=float)
    if xs.size < 2:
        return None
    res = bootstrap((xs,), statistic, confidence_level=level, n_resamples=resamples,
                    method="percentile", vectorized=False, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
