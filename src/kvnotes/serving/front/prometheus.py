"""The front's Prometheus metrics (``GET /metrics``) and its bounded counters.

Label values come from fixed vocabularies only (:data:`OUTCOMES`, the planning reasons of
:data:`~kvnotes.serving.planning.request.REASONS`, :data:`ROUTES`): no client-chosen string
becomes a label or a key, so the set of series stays bounded whatever clients send.
Each front has its own registry (several fronts in one process do not share counters).
The variant series (``kvnotes_front_variant_*{owner}``) are sums over the entries plans spliced,
by owner (``registered``, ``learned``): no entry's key or name is a label, so ``/metrics`` says
nothing of any tenant's entries.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.planning.request import REASONS
from kvnotes.serving.protocol import Outcome

if TYPE_CHECKING:
    from kvnotes.serving.planning.variant_demand import VariantHits

OUTCOMES = tuple(o.value for o in Outcome)
ROUTES = ("completion", "chat")
TOKEN_KINDS = ("spliced", "repaired", "computed")
VARIANT_OWNERS = ("registered", "learned")
# the learner's counters (kvnotes.serving.learning.LearnerStats) and what they count
LEARN_COUNTERS = {
    "sightings": "Chunks seen in requests (long enough to learn)",
    "compiles": "Chunks compiled in the background and published",
    "failures": "Background compiles that failed (or whose text encodes to other tokens)",
    "dropped": "Compile jobs dropped because the queue was full",
    "evictions": "Learned entries evicted by the library cap, a tenant's quota or the "
                 "variant cap",
    "variant_sightings": "Skills seen behind a predecessor they have no variant for",
    "variant_compiles": "Skill variants compiled in the background and published",
}
LEARN_GAUGES = {
    "learned_bytes": "Bytes of learned entries in the serving folder",
    "learned_entries": "Learned entries in the serving folder",
    "learned_variants": "Learned skill variants in the serving folder",
    "learned_variant_bytes": "Bytes of learned skill variants in the serving folder",
}
_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
            60, 120)


class FrontMetrics:
    """Counters and histograms of one front (thread-safe, like prometheus_client's own)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge, Histogram
        from prometheus_client import Counter as PCounter

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = PCounter("kvnotes_front_requests", "Requests by route and outcome",
                                 ["route", "outcome"], registry=r)
        self.forwarded = PCounter("kvnotes_front_forwarded",
                                  "Requests answered exactly (forwarded, or sent exactly as "
                                  "part-wise ids), by reason", ["reason"], registry=r)
        self.tokens = PCounter("kvnotes_front_prompt_tokens",
                               "Prompt tokens of spliced requests by kind", ["kind"], registry=r)
        self.phases = PCounter("kvnotes_front_phases", "Phase requests sent", registry=r)
        self.in_flight = Gauge("kvnotes_front_requests_in_flight", "Requests in flight",
                               registry=r)
        self.overhead = Histogram("kvnotes_front_overhead_seconds", "Time from a request's "
                                  "arrival to its first upstream request (reading, checking, "
                                  "planning)", ["route"], buckets=_LATENCY, registry=r)
        self.ttft = Histogram("kvnotes_front_ttft_seconds", "Time from a request's arrival to "
                              "the first byte of its answer", ["route"], buckets=_LATENCY,
                              registry=r)
        self._learner: Callable[[], dict[str, int]] | None = None
        self._store: Callable[[], JsonObject] | None = None
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # the outcomes, for /kvnotes/stats
        self.reasons: Counter[str] = Counter()
        for route in ROUTES:
            for outcome in OUTCOMES:
                self.requests.labels(route, outcome)
        for reason in REASONS:
            self.forwarded.labels(reason)
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)

    def outcome(self, route: str, outcome: str, reason: str | None = None) -> None:
        route = route if route in ROUTES else "completion"
        outcome = Outcome(outcome).value if outcome in OUTCOMES else Outcome.INTERNAL_ERROR.value
        self.requests.labels(route, outcome).inc()
        with self._lock:
            self.counts[outcome] += 1
            if reason is not None:
                reason = reason if reason in REASONS else "not_planned"
                self.reasons[reason] += 1
            if reason is not None:
                self.forwarded.labels(reason).inc()

    def spliced_tokens(self, spliced: int, repaired: int, computed: int, phases: int) -> None:
        for kind, n in zip(TOKEN_KINDS, (spliced, repaired, computed), strict=True):
            self.tokens.labels(kind).inc(n)
        self.phases.inc(phases)

    def watch_learner(self, counters: Callable[[], dict[str, int]]) -> None:
        """Expose a learner's counters (``kvnotes_front_learn_*_total``,
        ``kvnotes_front_learned_bytes`` / ``_entries``), read at each scrape."""
        self._learner = counters
        self.registry.register(_LearnerCollector(counters))

    def watch_variants(self, hits: VariantHits, folder: Path | None,
                       learned: Callable[[str], bool] | None = None) -> None:
        """Expose splice counts summed by owner (``kvnotes_front_variant_spliced_total``,
        ``_exact_total``: their ratio is the hit rate) and the spliced entries' bytes on disk
        (``kvnotes_front_variant_bytes``), read at each scrape; ``folder``: the serving folder
        (an entry whose file is gone is forgotten); ``learned``: whether a key is a learned
        entry. Per-entry hits are the operator's: ``kvnotes skills list``."""
        self.registry.register(_VariantCollector(hits, folder, learned))

    def watch_store(self, collector: Any, stats: Callable[[], JsonObject]) -> None:
        """Expose a shared store's series (``collector``: a Prometheus collector,
        :class:`~kvnotes.serving.store.metrics.StoreCollector`) and its counters under
        ``store`` in ``/kvnotes/stats``."""
        self._store = stats
        self.registry.register(collector)

    def stats(self) -> JsonObject:
        """The counters as ``/kvnotes/stats`` shows them (fixed keys only)."""
        with self._lock:
            out: JsonObject = {"requests": sum(self.counts.values()),
                               "outcomes": dict(self.counts),
                               "forwarded": dict(self.reasons)}
        if self._learner is not None:
            out["learner"] = dict(self._learner())
        if self._store is not None:
            out["store"] = self._store()
        return out

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


class _LearnerCollector:
    """A Prometheus collector over a learner's counters (read at each scrape, no copies)."""

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = self.counters()
        for name, help_text in LEARN_COUNTERS.items():
            yield CounterMetricFamily(f"kvnotes_front_learn_{name}", help_text,
                                      value=now.get(name, 0))
        for name, help_text in LEARN_GAUGES.items():
            yield GaugeMetricFamily(f"kvnotes_front_{name}", help_text, value=now.get(name, 0))


class _VariantCollector:
    """A Prometheus collector over a front's :class:`VariantHits` (read at each scrape):
    totals by owner (``registered``: the operator's entries, ``learned``: the learner's), never
    a series per entry, so a tenant reading ``/metrics`` learns nothing of another tenant's
    entries, and the series stay bounded."""

    def __init__(self, hits: VariantHits, folder: Path | None,
                 learned: Callable[[str], bool] | None) -> None:
        self.hits, self.folder, self.learned = hits, folder, learned

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        totals = {owner: [0, 0, 0, 0] for owner in VARIANT_OWNERS}  # used, exact, bytes, entries
        for key, _name, used, placed in self.hits.rows():
            nbytes = 0
            if self.folder is not None:
                try:
                    nbytes = (self.folder / f"{key}{ENTRY_SUFFIX}").stat().st_size
                except OSError:
                    self.hits.forget(key)  # evicted or deleted: no longer counted
                    continue
            owner = "learned" if self.learned is not None and self.learned(key) \
                else "registered"
            row = totals[owner]
            row[0] += used
            row[1] += placed
            row[2] += nbytes
            row[3] += 1
        labels = ["owner"]
        spliced = CounterMetricFamily("kvnotes_front_variant_spliced", "Plans that spliced an "
                                      "entry (a skill's variant), summed over the entries still "
                                      "in the serving folder", labels=labels)
        exact = CounterMetricFamily("kvnotes_front_variant_exact", "Of those, the entries "
                                    "spliced exactly placed (behind the ids they were compiled "
                                    "behind: nothing repaired)", labels=labels)
        size = GaugeMetricFamily("kvnotes_front_variant_bytes", "Bytes of the entries that "
                                 "plans spliced", labels=labels)
        count = GaugeMetricFamily("kvnotes_front_variant_entries", "Entries that plans "
                                  "spliced", labels=labels)
        for owner, (used, placed, nbytes, n) in totals.items():
            spliced.add_metric([owner], used)
            exact.add_metric([owner], placed)
            size.add_metric([owner], nbytes)
            count.add_metric([owner], n)
        yield spliced
        yield exact
        yield size
        yield count
