"""vLLM's ``/metrics`` (read with ``prometheus_client``'s parser) and a run's summary statistics.

Two kinds of figures come out of a snapshot: the prefix-cache counters (tokens queried and hit)
and the sums and counts of vLLM's per-request histograms. The difference of two snapshots taken
around a phase gives that phase's hit rate and, per request on average, where its time to first
token went (:func:`ttft_breakdown`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from kvnotes.core.errors import ServingError

K = TypeVar("K")

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"

# per-request histograms of vLLM v1 (vllm/v1/metrics/loggers.py); name -> what it measures
HISTOGRAMS: dict[str, str] = {
    "server_ttft_s": "vllm:time_to_first_token_seconds",  # arrival -> first token
    "queue_s": "vllm:request_queue_time_seconds",  # WAITING: arrival -> first scheduled
    "prefill_s": "vllm:request_prefill_time_seconds",  # scheduled -> first token
    "decode_step_s": "vllm:inter_token_latency_seconds",  # one decode step (per output token)
    "computed_tokens": "vllm:request_prefill_kv_computed_tokens",  # prompt tokens not cached
    "prompt_tokens": "vllm:request_prompt_tokens",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample of a ``/metrics`` text summed over its label sets: ``{sample name: total}``.

    Parsed by ``prometheus_client``; histogram buckets (``*_bucket``, one per ``le``) are left
    out, their ``*_sum`` and ``*_count`` kept. Summing over labels gives the server-wide value of
    a metric that vLLM splits by model name or engine. Text that is not Prometheus exposition
    format raises :class:`ServingError`.
    """
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    continue
                totals[s.name] = totals.get(s.name, 0.0) + float(s.value)
    except ValueError as err:
        raise ServingError(f"the server's /metrics is not Prometheus text ({err}); is the URL "
                           "a vLLM server?") from err
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


def histogram_means(before: Mapping[str, float], after: Mapping[str, float]
                    ) -> dict[str, dict[str, float | None]]:
    """Per histogram of :data:`HISTOGRAMS`: observations between two snapshots (``n``) and
    their mean (``mean``: delta of ``_sum`` over delta of ``_count``; None when nothing was
    observed or the server does not export it)."""
    out: dict[str, dict[str, float | None]] = {}
    for key, name in HISTOGRAMS.items():
        s0, s1 = before.get(f"{name}_sum"), after.get(f"{name}_sum")
        c0, c1 = before.get(f"{name}_count"), after.get(f"{name}_count")
        if None in (s0, s1, c0, c1):
            out[key] = {"n": None, "mean": None}
            continue
        n = c1 - c0  # type: ignore[operator]
        out[key] = {"n": n, "mean": (s1 - s0) / n if n > 0 else None}  # type: ignore[operator]
    return out


def ttft_breakdown(before: Mapping[str, float], after: Mapping[str, float], *,
                   client_ttft_mean_s: float | None) -> dict[str, Any]:
    """Where a phase's mean time to first token went, from vLLM's own per-request histograms.

    - ``queue_s``: waiting to be scheduled (``vllm:request_queue_time_seconds``).
    - ``compute_s``: computing the uncached prompt tokens (for the erratum: the partly filled
      last block, the errata and the question), i.e. the prefill time
      (``vllm:request_prefill_time_seconds``, scheduled -> first token) less one engine step.
    - ``first_step_s``: the engine step that emits the first token, estimated by the mean
      decode step of the same phase (``vllm:inter_token_latency_seconds``): the fixed cost of a
      forward pass over the weights, sampling and output that any step pays.
    - ``frontend_s``: client-side TTFT less the server's (``vllm:time_to_first_token_seconds``):
      HTTP, chat template, tokenization, detokenization and streaming.
    - ``computed_tokens``: mean uncached prompt tokens per request
      (``vllm:request_prefill_kv_computed_tokens``).

    Means over the requests that finished between the snapshots; missing histograms give None.
    """
    h = histogram_means(before, after)
    mean = {k: v["mean"] for k, v in h.items()}
    prefill, step = mean["prefill_s"], mean["decode_step_s"]
    compute = None if prefill is None else max(0.0, prefill - (step or 0.0))
    first_step = None if prefill is None or step is None else min(step, prefill)
    server = mean["server_ttft_s"]
    frontend = (None if server is None or client_ttft_mean_s is None
                else client_ttft_mean_s - server)
    return {"client_ttft_s": client_ttft_mean_s, "server_ttft_s": server,
            "queue_s": mean["queue_s"], "prefill_s": prefill, "compute_s": compute,
            "first_step_s": first_step, "frontend_s": frontend,
            "computed_tokens": mean["computed_tokens"], "prompt_tokens": mean["prompt_tokens"],
            "n": h["prefill_s"]["n"]}


def agreement(a: Mapping[K, str | None], b: Mapping[K, str | None]) -> tuple[int, int]:
    """(agreeing, compared): keys present in both where both decisions parsed and are equal.

    Unparsed decisions (None) count as compared and disagreeing, unless both are None.
    """
    keys = sorted(set(a) & set(b), key=str)
    same = sum(1 for k in keys if a[k] == b[k])
    return same, len(keys)
