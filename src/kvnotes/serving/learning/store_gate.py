"""A fleet learner's door to its store on the request path, and what the fleet side counted.

:class:`StoreGate` makes a store call unless the store failed less than ``retry_s`` seconds ago,
so a request never waits on a store that is down beyond one timeout; :class:`FleetStats` counts
what the fleet side did (sightings kept local, compiles skipped, publishes, adoptions).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar, TypeVar

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.store.base import Store

log = logging.getLogger("kvnotes.serving.front")
T = TypeVar("T")


@dataclass
class FleetStats:
    """What the fleet side of a learner did (``to_dict()`` at the JSON boundary)."""

    local_sightings: int = 0  # sightings counted in this process: the store did not answer
    skipped_compiles: int = 0  # due jobs not compiled: the fleet's lease could not be taken
    published: int = 0  # entries compiled here and published to the store
    publish_failures: int = 0  # publishes the store refused or missed (tried again later)
    adopted: int = 0  # entries another host compiled, taken from the store instead
    fleet_evictions: int = 0  # entries forgotten in the store by the fleet's bounds

    _lock: ClassVar[threading.Lock] = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Count (from any thread)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return asdict(self)


class StoreGate:
    """The request path's door to a store: a call is made unless the store failed less than
    ``retry_s`` seconds ago; a fault (counted by the store, by reason) closes the door for that
    long and is logged once. Thread-safe."""

    def __init__(self, store: Store, retry_s: float, stats: FleetStats) -> None:
        self.store, self.retry_s, self.stats = store, retry_s, stats
        self._lock = threading.Lock()
        self._closed_until = 0.0
        self._reason: str | None = None

    @property
    def open(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._closed_until

    def call(self, what: str, op: Callable[[Store], T]) -> tuple[bool, T | None]:
        """``(True, op(store))``, or ``(False, None)`` when the door is closed or ``op``
        failed."""
        if not self.open:
            return False, None
        try:
            value = op(self.store)
        except StoreUnavailableError as err:
            self._fault(what, err.reason, str(err))
            return False, None
        except Exception as err:  # noqa: BLE001 -- the store is an optimization: serve on
            self.store.faults.count("error")
            self._fault(what, "error", f"{type(err).__name__}: {err}")
            return False, None
        with self._lock:
            was, self._reason = self._reason, None
        if was is not None:
            log.warning("kvnotes learner: store %s answers again; sightings and compiles are "
                        "the fleet's again", self.store.url)
        return True, value

    def _fault(self, what: str, reason: str, detail: str) -> None:
        with self._lock:
            first = self._reason is None
            self._reason = reason
            self._closed_until = time.monotonic() + self.retry_s
        if first:
            log.warning("kvnotes learner: store %s failed (%s) during %s: sightings are counted "
                        "on this host and nothing is compiled until it answers (tried again "
                        "every %.1f s): %s", self.store.url, reason, what, self.retry_s, detail)
