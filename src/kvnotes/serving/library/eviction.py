"""The order in which the library cap evicts learned entries: tenants over their share first.

With a cap below the sum of the tenants' quotas, evicting the least recently used entries of
the whole library would let one busy tenant push a quiet one out of entries it holds well
within its quota. A tenant's *share* is the cap split evenly between the tenants that hold
learned entries (at most its quota): :func:`cap_order` evicts from the tenant furthest over
its share while any is over, least recently used first within it, and only then in plain
least-recently-used order. A tenant within its share keeps its entries as long as another
holds more than its own.

Example:
    >>> from kvnotes.serving.library.registry import LearnedEntry
    >>> def e(key, tenant, nbytes):
    ...     return LearnedEntry(key, tenant, key, "tool", 1, nbytes)
    >>> quiet, busy = [e("q1", "quiet", 10)], [e(f"b{i}", "busy", 10) for i in range(5)]
    >>> [x.key for x in cap_order(quiet + busy, cap=40, quota=None)][:3]   # quiet's is oldest
    ['b0', 'b1', 'b2']
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

from kvnotes.serving.library.registry import LearnedEntry


def cap_order(candidates: Sequence[LearnedEntry], cap: int, quota: int | None,
              held: dict[str | None, int] | None = None) -> list[LearnedEntry]:
    """``candidates`` (evictable, least recently used first) in the order the cap evicts
    them; ``held``: each tenant's bytes (default: the candidates' own)."""
    if held is None:
        held = defaultdict(int)
        for entry in candidates:
            held[entry.tenant] += entry.bytes
    held = dict(held)
    tenants = [t for t, n in held.items() if n > 0]
    share = cap / max(1, len(tenants))
    if quota is not None:
        share = min(share, quota)
    queues: dict[str | None, deque[LearnedEntry]] = defaultdict(deque)
    for entry in candidates:
        queues[entry.tenant].append(entry)
    order: list[LearnedEntry] = []
    taken: set[str] = set()
    rest = deque(candidates)
    while len(order) < len(candidates):
        over = [(held.get(t, 0) - share, t) for t, q in queues.items() if q
                and held.get(t, 0) > share]
        if over:
            _, tenant = max(over, key=lambda x: x[0])
            entry = queues[tenant].popleft()
        else:
            while rest[0].key in taken:
                rest.popleft()
            entry = rest.popleft()
            queues[entry.tenant].remove(entry)
        taken.add(entry.key)
        held[entry.tenant] = held.get(entry.tenant, 0) - entry.bytes
        order.append(entry)
    return order
