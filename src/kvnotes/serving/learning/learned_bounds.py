"""Keeping the learned library bounded: an in-memory index of the learned entries, the leases
requests hold on them, and the choice of victims.

Bounds (learned entries only: the operator's registered skills are not in the registry and are
never evicted): ``max_variants`` learned entries per skill, ``tenant_quota`` bytes per tenant,
then ``library_cap`` bytes in all, each enforced by evicting the least recently used entries
(last spliced), except pinned ones and those under lease; the cap takes from the tenants over
their share first (:func:`~kvnotes.serving.library.eviction.cap_walk`).

:class:`LearnedIndex` mirrors the registry's rows in memory (least recently used order overall
and per tenant, bytes per tenant, entries per skill), updated as entries are added, used and
removed, so choosing victims reads no row and no file, and costs what it evicts, not what the
library holds. :class:`Bounds` guards it with the one short lock that the request path takes
(:meth:`Bounds.lease`, :meth:`Bounds.use`, :meth:`Bounds.holds`): victims are chosen and taken
out of the index under it, and their files deleted by the caller after it is released.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from kvnotes.serving.library.eviction import cap_walk
from kvnotes.serving.library.registry import LearnedEntry


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds at one enforcement (None: no cap, no quota)."""

    library_cap: int | None = None
    tenant_quota: int | None = None
    max_variants: int = 4


class LearnedIndex:
    """The learned entries in memory (not thread-safe: :class:`Bounds` holds its lock).

    Example:
        >>> idx = LearnedIndex([LearnedEntry("k1", "acme", "t", "tool", 4, 40, last_used=1.0)])
        >>> idx.put(LearnedEntry("k2", None, "t", "tool", 4, 60, last_used=2.0))
        >>> idx.total, idx.held("acme"), [e.key for e in idx.evictable()]
        (100, 40, ['k1', 'k2'])
    """

    def __init__(self, entries: Iterable[LearnedEntry] = ()) -> None:
        self._lru: OrderedDict[str, LearnedEntry] = OrderedDict()  # most recently used last
        self._tenants: dict[str | None, OrderedDict[str, LearnedEntry]] = {}
        self._held: dict[str | None, int] = {}
        self._skills: dict[str, set[str]] = {}
        self.total = 0
        self.variants = 0
        self.variant_bytes = 0
        for entry in sorted(entries, key=lambda e: (e.last_used, e.key)):
            self.put(entry)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: str) -> LearnedEntry | None:
        return self._lru.get(key)

    def keys(self) -> list[str]:
        return list(self._lru)

    def entries(self) -> Iterator[LearnedEntry]:
        """Every entry, least recently used first."""
        return iter(self._lru.values())

    def held(self, tenant: str | None) -> int:
        """Bytes of ``tenant``'s learned entries (pinned and leased ones included)."""
        return self._held.get(tenant, 0)

    def put(self, entry: LearnedEntry) -> None:
        """Add ``entry`` (replacing one of its key) as the most recently used."""
        self.remove(entry.key)
        self._lru[entry.key] = entry
        self._tenants.setdefault(entry.tenant, OrderedDict())[entry.key] = entry
        self._held[entry.tenant] = self._held.get(entry.tenant, 0) + entry.bytes
        self._skills.setdefault(entry.skill, set()).add(entry.key)
        self.total += entry.bytes
        if entry.variant_of is not None:
            self.variants += 1
            self.variant_bytes += entry.bytes

    def remove(self, key: str) -> LearnedEntry | None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return None
        tenant = self._tenants[entry.tenant]
        del tenant[key]
        if not tenant:
            del self._tenants[entry.tenant]
        self._held[entry.tenant] -= entry.bytes
        if not self._held[entry.tenant]:
            del self._held[entry.tenant]
        skill = self._skills[entry.skill]
        skill.discard(key)
        if not skill:
            del self._skills[entry.skill]
        self.total -= entry.bytes
        if entry.variant_of is not None:
            self.variants -= 1
            self.variant_bytes -= entry.bytes
        return entry

    def touch(self, hits: Mapping[str, int], exact: Mapping[str, int], when: float) -> None:
        """Count uses (as the registry's ``use`` does) and move the used to the recent end."""
        for key in {**hits, **exact}:
            entry = self._lru.get(key)
            if entry is not None:
                self.put(replace(entry, hits=entry.hits + hits.get(key, 0),
                                 exact=entry.exact + exact.get(key, 0),
                                 last_used=max(entry.last_used, when)))

    def evictable(self, tenant: str | None = None, *, every: bool = True
                  ) -> Iterator[LearnedEntry]:
        """Unpinned entries (all, or ``tenant``'s), least recently used first, lazily."""
        entries = self._lru if every else self._tenants.get(tenant, OrderedDict())
        return (e for e in entries.values() if not e.pinned)

    def of_skill(self, skill: str) -> list[LearnedEntry]:
        """The learned entries of one skill, least recently used first."""
        entries = [self._lru[k] for k in self._skills.get(skill, ())]
        return sorted(entries, key=lambda e: (e.last_used, e.key))

    def tenants(self) -> list[str | None]:
        return list(self._tenants)


class Bounds:
    """The learned index, the leases requests hold, the uses not yet written, and the choice
    of victims, under one short lock (see the module docstring)."""

    def __init__(self, index: LearnedIndex | None = None) -> None:
        self._lock = threading.Lock()
        self._index = LearnedIndex() if index is None else index
        self._leases: Counter[str] = Counter()
        self._hits: Counter[str] = Counter()  # uses not yet written to the registry
        self._exact: Counter[str] = Counter()  # of those, the exactly placed ones
        self._to_verify: deque[str] = deque()  # the sweep's round

    # ---- the request path ---------------------------------------------------------------------
    def lease(self, keys: Iterable[str], *, used: Iterable[str] | None = None,
              exact: Iterable[str] = ()) -> tuple[str, ...]:
        """Hold ``keys`` against eviction until :meth:`release`, and count a use of each of
        ``used`` (default: of ``keys``), ``exact`` of them exactly placed."""
        held = tuple(dict.fromkeys(keys))
        with self._lock:
            self._leases.update(held)
            self._hits.update(held if used is None else used)
            self._exact.update(exact)
        return held

    def release(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._leases.subtract(keys)
            self._leases = +self._leases  # drop the zeros

    def leased(self, key: str) -> bool:
        with self._lock:
            return self._leases[key] > 0

    def use(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._hits.update(keys)

    def holds(self, key: str) -> bool:
        """Whether ``key`` is a learned entry the index holds."""
        with self._lock:
            return key in self._index

    # ---- the worker's side --------------------------------------------------------------------
    def take_uses(self, when: float) -> tuple[Counter[str], Counter[str]]:
        """The uses counted since the last call (``(hits, exact)``), applied to the index as
        used at ``when``; the caller writes them to the registry."""
        with self._lock:
            hits, self._hits = self._hits, Counter()
            exact, self._exact = self._exact, Counter()
            self._index.touch(hits, exact, when)
        return hits, exact

    def put(self, entry: LearnedEntry) -> None:
        with self._lock:
            self._index.put(entry)

    def drop(self, key: str) -> LearnedEntry | None:
        with self._lock:
            return self._index.remove(key)

    def reload(self, entries: Iterable[LearnedEntry]) -> list[str]:
        """Replace the index with ``entries`` (the registry's rows, read by the caller);
        returns the keys it held that ``entries`` lack (forgotten by another process)."""
        index = LearnedIndex(entries)
        with self._lock:
            gone = [key for key in self._index.keys() if key not in index]
            self._index = index
            self._to_verify.clear()
        return gone

    def claim(self, key: str) -> bool:
        """Take ``key`` out of the index to delete it, unless a request holds it."""
        with self._lock:
            if self._leases[key] > 0:
                return False
            self._index.remove(key)
            return True

    def reprieve(self, entry: LearnedEntry) -> bool:
        """Put a chosen victim back when a request leased it since it was chosen."""
        with self._lock:
            if self._leases[entry.key] <= 0:
                return False
            self._index.put(entry)
            return True

    def to_verify(self, limit: int | None) -> list[LearnedEntry]:
        """The next ``limit`` entries (None: all) whose files a sweep checks, round robin."""
        with self._lock:
            if limit is None:
                return list(self._index.entries())
            if not self._to_verify:
                self._to_verify.extend(self._index.keys())
            batch = [self._to_verify.popleft() for _ in range(min(limit, len(self._to_verify)))]
            return [e for e in (self._index.get(k) for k in batch) if e is not None]

    def totals(self) -> tuple[int, int, int, int]:
        """``(bytes, entries, variants, variant bytes)`` of the learned entries."""
        with self._lock:
            idx = self._index
            return idx.total, len(idx), idx.variants, idx.variant_bytes

    def of_skill(self, skill: str) -> list[LearnedEntry]:
        with self._lock:
            return self._index.of_skill(skill)

    # ---- victims --------------------------------------------------------------------------------
    def over_variants(self, skill: str, max_variants: int, keep: str | None = None
                      ) -> list[LearnedEntry]:
        """The least recently used of ``skill``'s entries beyond ``max_variants`` (never
        ``keep``, pinned or leased ones), taken out of the index."""
        with self._lock:
            entries = self._index.of_skill(skill)
            over = len(entries) - max_variants
            free = [e for e in entries if e.key != keep and not e.pinned
                    and self._leases[e.key] <= 0]
            return self._take(free[:max(0, over)])

    def over_quota(self, tenant: str | None, quota: int) -> list[LearnedEntry]:
        """``tenant``'s least recently used evictable entries beyond ``quota`` bytes."""
        with self._lock:
            total, chosen = self._index.held(tenant), []
            for entry in self._index.evictable(tenant, every=False):
                if total <= quota:
                    break
                if self._leases[entry.key] <= 0:
                    chosen.append(entry)
                    total -= entry.bytes
            return self._take(chosen)

    def over_cap(self, cap: int, quota: int | None) -> list[LearnedEntry]:
        """Evictable entries in the cap's order (tenants over their share first) until the
        library is within ``cap`` bytes."""
        with self._lock:
            idx = self._index
            if idx.total <= cap:
                return []
            tenants = idx.tenants()
            queues = {t: self._free(idx.evictable(t, every=False)) for t in tenants}
            held = {t: idx.held(t) for t in tenants}
            total, chosen = idx.total, []
            for entry in cap_walk(queues, self._free(idx.evictable()), held, cap, quota):
                chosen.append(entry)
                total -= entry.bytes
                if total <= cap:
                    break
            return self._take(chosen)

    def _free(self, entries: Iterator[LearnedEntry]) -> Iterator[LearnedEntry]:
        return (e for e in entries if self._leases[e.key] <= 0)

    def _take(self, entries: list[LearnedEntry]) -> list[LearnedEntry]:
        for entry in entries:
            self._index.remove(entry.key)
        return entries
