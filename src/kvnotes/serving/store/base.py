"""The skill store's contract: what a library behind one host or a whole fleet answers.

A :class:`Store` holds library entries (:class:`~kvnotes.serving.store.entry.StoredEntry`) by
model fingerprint id and key, each owned by a tenant or shared (tenant None, the operator's),
and the little a fleet of learners needs to agree on: sighting counts, compile leases, pins
and last use. Two implementations: :class:`~kvnotes.serving.store.folder.FolderStore` (the
folder the connector reads, as before) and :class:`~kvnotes.serving.store.redis_store.RedisStore`
(one server for many hosts). Nothing here runs on a request's path: a host splices from its
local folder, which :class:`~kvnotes.serving.store.mirror.LocalMirror` fills in the background.

Faults: a store that cannot answer raises :class:`~kvnotes.core.errors.StoreUnavailableError`
(its ``reason`` one of :data:`FAULT_REASONS`) and counts it in :attr:`Store.faults`; a value
that fails its checks is dropped, counted, and read as a miss. Reading never returns another
tenant's entry.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvnotes.serving.store.entry import EntryInfo, StoredEntry

# why a store operation failed or a value was dropped (the fault counter's labels)
FAULT_REASONS = (
    "down",  # no connection (refused, reset, closed while reading)
    "timeout",  # no answer within the socket timeout
    "full",  # the server refused a write: maxmemory reached (OOM)
    "readonly",  # a replica answered (a failover in progress)
    "loading",  # the server is loading its data set after a restart
    "auth",  # the password or user was refused
    "tls",  # the TLS handshake failed (rediss:// to a server without TLS, a bad certificate)
    "policy",  # the server's maxmemory-policy can evict the store's bookkeeping: refused
    "checksum",  # a value whose checksum failed (dropped, read as a miss)
    "partial",  # an entry with a chunk missing (evicted or expired; dropped, a miss)
    "malformed",  # an entry's info that is not one (dropped, a miss)
    "error",  # any other error the server answered
)


class StoreFaults:
    """Counts of store faults by reason (thread-safe; ``to_dict()`` for ``/metrics``).

    Example:
        >>> faults = StoreFaults(); faults.count("timeout"); faults.count("timeout")
        >>> faults.to_dict()["timeout"], faults.total
        (2, 2)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FAULT_REASONS, 0)

    def count(self, reason: str) -> None:
        assert reason in self._counts, reason
        with self._lock:
            self._counts[reason] += 1

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


@dataclass(frozen=True, slots=True)
class Change:
    """One publish (``op="put"``) or forget (``op="forget"``) in a store's change feed."""

    op: str
    key: str
    tenant: str | None
    bytes: int = 0  # a publish's size (0: not known)


@runtime_checkable
class Store(Protocol):
    """A skill library shared by the hosts that serve one set of models.

    ``model`` is a model fingerprint id (:attr:`ModelFingerprint.id`), ``key`` an entry's
    content address (its file stem). A tenant sees the shared entries (tenant None) and its own.
    """

    url: str  # where it is, for logs (a password never appears in it)
    faults: StoreFaults

    def put(self, entry: StoredEntry) -> None:
        """Publish an entry atomically: a reader sees all of it or none of it."""
        ...

    def get(self, model: str, key: str, tenant: str | None) -> StoredEntry | None:
        """The entry, checked, if ``tenant`` may read it; None for a miss (absent, another
        tenant's, or dropped because it failed its checks)."""
        ...

    def list(self, model: str | None = None, tenant: str | None = None, *,
             every: bool = False) -> builtins.list[EntryInfo]:
        """Infos of the entries ``tenant`` may read (``every``: all tenants', for operators),
        of one model or (None) of every model; least recently used first."""
        ...

    def models(self) -> builtins.list[str]:
        """The model fingerprint ids the store holds entries for."""
        ...

    def pin(self, model: str, key: str, pinned: bool = True) -> bool:
        """Pin (never evicted) or unpin a learned entry; False when it is not a learned entry."""
        ...

    def forget(self, model: str, key: str) -> bool:
        """Drop a learned entry (registered ones are the operator's: False); True when dropped.
        Hosts' local copies of it are removed too (see :meth:`forgotten`)."""
        ...

    def delete(self, model: str, key: str) -> bool:
        """Remove an entry, learned or not; True when there was one."""
        ...

    def touch(self, model: str, hits: Mapping[str, int], when: float | None = None) -> None:
        """Count uses of entries (key -> uses), last used ``when`` (default now): the LRU order."""
        ...

    def forgotten(self, model: str, since: float = 0.0) -> builtins.list[str]:
        """Keys forgotten since ``since`` (seconds since the epoch): local copies to remove."""
        ...

    def changes(self, model: str, after: str | None
                ) -> tuple[str, builtins.list[Change]] | None:
        """What was published or forgotten since position ``after`` of the store's change feed
        (None: from now on), as ``(new position, changes)``, oldest first; None when the store
        keeps no feed or it no longer reaches back to ``after`` (then read :meth:`list`)."""
        ...

    def incr_sightings(self, names: Sequence[str],
                       ttl_s: float = 86400.0) -> builtins.list[int]:
        """Count one more sighting of each of ``names`` (chunks' identities) in one call (one
        round trip to a server) and return their counts, in order; a count not incremented for
        ``ttl_s`` seconds starts again from zero. A fault raises for the whole call (a server
        may have counted some of them: Redis runs a transaction's other commands when one
        fails)."""
        ...

    def epoch(self) -> str:
        """A token that stays the same while the store keeps its data, and changes when it is
        emptied (a Redis restarted without persistence, or flushed): hosts then publish again
        the entries they hold."""
        ...

    def clear_sighting(self, name: str) -> None:
        """Forget ``name``'s sightings (it was compiled, or will never be)."""
        ...

    def acquire_lease(self, name: str, ttl_s: float) -> bool:
        """Take the lease ``name`` for ``ttl_s`` seconds; False when another holder has it. A
        holder that dies leaves it to expire."""
        ...

    def release_lease(self, name: str) -> bool:
        """Give back a lease this store object holds; False when it had expired or is not ours."""
        ...

    def acquire_leases(self, names: Sequence[str], ttl_s: float) -> builtins.list[bool]:
        """:meth:`acquire_lease` for each of ``names`` in one call (one round trip to a
        server), in order. A take whose answer was lost (a timeout) is given back by this
        store's next lease call, so that no lease is held by a holder that believes it holds
        nothing."""
        ...

    def settle_leases(self) -> int:
        """Give back now the leases whose take or give-back got no answer (see
        :meth:`acquire_leases`); how many were pending."""
        ...

    def close(self) -> None:
        ...


def visible(info: EntryInfo, tenant: str | None) -> bool:
    """True when a request of ``tenant`` may read the entry: the shared ones and its own."""
    return info.tenant is None or info.tenant == tenant
