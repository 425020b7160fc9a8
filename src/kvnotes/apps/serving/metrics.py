"""Prometheus ``/metrics`` parsing and the summary statistics of a benchmark run."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"

_SAMPLE = re.compile(
    r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric over its label sets: ``{name: total}``.

    Comment lines (``# HELP``/``# TYPE``) and malformed lines are skipped; ``NaN`` and ``+Inf``
    parse as floats. Summing over labels gives the server-wide value of a counter that vLLM
    splits by model name or engine.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        totals[m.group("name")] = totals.get(m.group("name"), 0.0) + value
    return totals


@dataclass(frozen=True)
class PrefixCacheCounters:
    """A snapshot of vLLM's prefix-cache counters (in tokens)."""

    queries: float
    hits: float

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float] | str) -> PrefixCacheCounters:
        """Read the two counters from parsed metrics (or raw ``/metrics`` text).

        Raises ``KeyError`` naming the missing counter when the server does not export it (a
        server without prefix caching, or not vLLM).
        """
        parsed = parse_prometheus(metrics) if isinstance(metrics, str) else metrics
        for name in (PREFIX_QUERIES, PREFIX_HITS):
            if name not in parsed:
                raise KeyError(f"{name} is not in the server's /metrics (is this vLLM with "
                               "prefix caching enabled?)")
        return cls(queries=parsed[PREFIX_QUERIES], hits=parsed[PREFIX_HITS])

    def __sub__(self, earlier: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - earlier.queries, self.hits - earlier.hits)

    @property
    def hit_rate(self) -> float | None:
        """hits / queries; None when nothing was queried."""
        return self.hits / self.queries if self.queries > 0 else None


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linearly interpolated as numpy does; None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def agreement(a: Mapping[object, str | None], b: Mapping[object, str | None]) -> tuple[int, int]:
    """(agreeing, compared): keys present in both where both decisions parsed and are equal.

    Unparsed decisions (None) count as compared and disagreeing, unless both are None.
    """
    keys = sorted(set(a) & set(b), key=str)
    same = sum(1 for k in keys if a[k] == b[k])
    return same, len(keys)
