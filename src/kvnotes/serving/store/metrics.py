"""A front's ``/metrics`` series of its shared store: faults by reason, the fleet's learning, the
local mirror. Labels come from fixed vocabularies only (:data:`~kvnotes.serving.store.base.
FAULT_REASONS`): nothing a client or a tenant chose, and no entry's key, becomes a label."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvnotes.serving.store.base import FAULT_REASONS

FLEET_COUNTERS = {
    "local_sightings": "Sightings counted on this host because the store did not answer",
    "skipped_compiles": "Due compiles skipped because the fleet's lease could not be taken "
                        "(the store did not answer)",
    "published": "Entries compiled on this host and published to the store",
    "publish_failures": "Publishes the store refused or missed (tried again later)",
    "adopted": "Entries another host compiled, taken from the store instead of compiled",
    "fleet_evictions": "Entries forgotten in the store by the fleet's cap and quotas",
}
MIRROR_COUNTERS = {
    "fetched": "Entries the mirror copied from the store into the serving folder",
    "fetched_bytes": "Bytes the mirror copied from the store",
    "evicted": "Mirror copies deleted by its byte bound",
    "removed": "Mirror copies deleted because the store forgot them",
}
MIRROR_GAUGES = {
    "local_entries": "Entries the mirror holds in the serving folder",
    "local_bytes": "Bytes of the entries the mirror holds in the serving folder",
}


class StoreCollector:
    """A Prometheus collector read at each scrape: ``kvnotes_front_store_faults_total{reason}``
    (every reason, 0 included), ``kvnotes_front_fleet_*_total`` and
    ``kvnotes_front_mirror_*``.

    Args:
        faults: the store's fault counts by reason (``StoreFaults.to_dict``).
        fleet: the fleet learner's counters (``FleetLearner.fleet_counters``), if learning.
        mirror: the mirror's stats (``MirrorStats.to_dict``), if any.
    """

    def __init__(self, faults: Callable[[], Mapping[str, int]],
                 fleet: Callable[[], Mapping[str, int]] | None = None,
                 mirror: Callable[[], Mapping[str, object]] | None = None) -> None:
        self.faults, self.fleet, self.mirror = faults, fleet, mirror

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = self.faults()
        family = CounterMetricFamily("kvnotes_front_store_faults", "Shared store operations "
                                     "that failed, and values dropped, by reason (requests "
                                     "were served from local entries or exactly)",
                                     labels=["reason"])
        for reason in FAULT_REASONS:
            family.add_metric([reason], now.get(reason, 0))
        yield family
        if self.fleet is not None:
            fleet = self.fleet()
            for name, help_text in FLEET_COUNTERS.items():
                yield CounterMetricFamily(f"kvnotes_front_fleet_{name}", help_text,
                                          value=fleet.get(name, 0))
        if self.mirror is not None:
            stats = self.mirror()
            for name, help_text in MIRROR_COUNTERS.items():
                yield CounterMetricFamily(f"kvnotes_front_mirror_{name}", help_text,
                                          value=_number(stats.get(name)))
            for name, help_text in MIRROR_GAUGES.items():
                yield GaugeMetricFamily(f"kvnotes_front_mirror_{name}", help_text,
                                        value=_number(stats.get(name)))


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
