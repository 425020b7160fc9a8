"""The order in which the library cap evicts learned entries: tenants over their share first.

With a cap below the sum of the tenants' quotas, evicting the least recently used entries of
the whole library would let one busy tenant push a quiet one out of entries it holds well
within its quota. A tenant's *share* is the cap split evenly between the tenants that hold
learned entries (at most its quota): :func:`cap_walk` evicts from the tenant furthest over
its share while any is over, least recently used first within it, and only then in plain
least-recently-used order. A tenant within its share keeps its entries as long as another
holds more than its own.

:func:`cap_walk` is lazy (it reads each tenant's entries only as far as it evicts, so the
learner stops it once the library is under its cap); :func:`cap_order` is the whole order.

Example:
    >>> from kvnotes.serving.library.registry import LearnedEntry
    >>> def e(key, tenant, nbytes):
    ...     return LearnedEntry(key, tenant, key, "tool", 1, nbytes)
    >>> quiet, busy = [e("q1", "quiet", 10)], [e(f"b{i}", "busy", 10) for i in range(5)]
    >>> [x.key for x in cap_order(quiet + busy, cap=40, quota=None)][:3]   # quiet's is oldest
    ['b0', 'b1', 'b2']
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

from kvnotes.serving.library.registry import LearnedEntry


class _Head:
    """An iterator of entries with a look at its next one not yet taken."""

    def __init__(self, entries: Iterable[LearnedEntry]) -> None:
        self._rest = iter(entries)
        self._next: LearnedEntry | None = None

    def peek(self, taken: set[str]) -> LearnedEntry | None:
        while self._next is None or self._next.key in taken:
            self._next = next(self._rest, None)
            if self._next is None:
                return None
        return self._next


def cap_walk(queues: Mapping[str | None, Iterable[LearnedEntry]], lru: Iterable[LearnedEntry],
             held: Mapping[str | None, int], cap: int, quota: int | None
             ) -> Iterator[LearnedEntry]:
    """The evictable entries in the order the cap evicts them, read lazily.

    Args:
        queues: each tenant's evictable entries, least recently used first.
        lru: every evictable entry, least recently used first.
        held: each tenant's bytes (its pinned and held entries included).
        cap: the library's cap; quota: a tenant's quota (None: none).
    """
    left = dict(held)
    tenants = [t for t, n in left.items() if n > 0]
    share = cap / max(1, len(tenants))
    if quota is not None:
        share = min(share, quota)
    heads = {tenant: _Head(entries) for tenant, entries in queues.items()}
    rest = _Head(lru)
    taken: set[str] = set()
    while True:
        over = [(left.get(t, 0) - share, t) for t, head in heads.items()
                if left.get(t, 0) > share and head.peek(taken) is not None]
        if over:
            _, tenant = max(over, key=lambda x: x[0])
            entry = heads[tenant].peek(taken)
        else:
            entry = rest.peek(taken)
        if entry is None:
            return
        taken.add(entry.key)
        left[entry.tenant] = left.get(entry.tenant, 0) - entry.bytes
        yield entry


def cap_order(candidates: Sequence[LearnedEntry], cap: int, quota: int | None,
              held: dict[str | None, int] | None = None) -> list[LearnedEntry]:
    """``candidates`` (evictable, least recently used first) in the order the cap evicts
    them; ``held``: each tenant's bytes (default: the candidates' own)."""
    queues: dict[str | None, list[LearnedEntry]] = defaultdict(list)
    for entry in candidates:
        queues[entry.tenant].append(entry)
    if held is None:
        held = {t: sum(e.bytes for e in q) for t, q in queues.items()}
    return list(cap_walk(queues, candidates, held, cap, quota))
