"""The library's bounds over a whole store: which learned entries go, in the learner's order.

The same rule as one host's learner (:mod:`kvnotes.serving.library.eviction`): a tenant over
its quota loses its least recently used entries; then, while the library is over its cap, the
tenant furthest over its share loses first, then plain least recently used. Pinned entries and
the operator's registered ones are never chosen. Over a shared store the use is the fleet's
(every host's hits go to the store's LRU), and one host at a time should evict: take the lease
:data:`EVICT_LEASE` first (:func:`evict`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kvnotes.serving.library.eviction import cap_order
from kvnotes.serving.store.base import Store
from kvnotes.serving.store.entry import EntryInfo

EVICT_LEASE = "evict:{model}"


def victims(infos: Sequence[EntryInfo], *, cap: int | None, quota: int | None) -> list[EntryInfo]:
    """The learned entries to drop so that every tenant is within ``quota`` bytes and all
    learned entries within ``cap`` bytes (None: no such bound), in the order to drop them.

    Example:
        >>> from kvnotes.serving.store.entry import EntryInfo
        >>> def e(key, tenant, last):
        ...     return EntryInfo(key, "m", tenant, key, 1, 10, "", "tool", True, last_used=last)
        >>> [v.key for v in victims([e("a1", "a", 1), e("a2", "a", 2), e("b1", "b", 3)],
        ...                         cap=20, quota=None)]
        ['a1']
    """
    learned = sorted((i for i in infos if i.learned), key=lambda i: (i.last_used, i.key))
    held: dict[str | None, int] = defaultdict(int)
    for info in learned:
        held[info.tenant] += info.bytes
    total = sum(held.values())
    evictable = [i for i in learned if not i.pinned]
    chosen: dict[str, EntryInfo] = {}
    if quota is not None:
        for info in evictable:
            if held[info.tenant] > quota:
                chosen[info.key] = info
                held[info.tenant] -= info.bytes
                total -= info.bytes
    if cap is not None and total > cap:
        rest = [i.to_learned() for i in evictable if i.key not in chosen]
        by_key = {i.key: i for i in evictable}
        for row in cap_order(rest, cap, quota, dict(held)):
            if total <= cap:
                break
            chosen[row.key] = by_key[row.key]
            total -= row.bytes
    return list(chosen.values())


def evict(store: Store, model: str, *, cap: int | None, quota: int | None,
          lease_s: float = 60.0, hold: bool = False) -> list[str] | None:
    """Enforce the bounds on ``model``'s learned entries in ``store``: the keys forgotten, or
    None when another host holds the eviction lease (it is doing the same, or did it less than
    ``lease_s`` ago). ``hold``: keep the lease until it expires, so that a fleet whose hosts all
    try every ``lease_s`` lists the store once per ``lease_s``, not once per host."""
    lease = EVICT_LEASE.format(model=model)
    if not store.acquire_lease(lease, lease_s):
        return None
    try:
        gone = [v.key for v in victims(store.list(model, every=True), cap=cap, quota=quota)
                if store.forget(model, v.key)]
    except BaseException:
        store.release_lease(lease)
        raise
    if not hold:
        store.release_lease(lease)
    return gone
