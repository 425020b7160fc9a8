"""The library's bounds over a shared store: quota, cap, pins, and one evicting host."""

from __future__ import annotations

from _store_helpers import MODEL

from kvnotes.serving.store.bounds import EVICT_LEASE, evict, victims
from kvnotes.serving.store.entry import EntryInfo
from kvnotes.serving.store.redis_store import RedisStore


def _info(key: str, tenant: str | None, last: float, *, pinned: bool = False,
          learned: bool = True) -> EntryInfo:
    return EntryInfo(key, MODEL, tenant, key, 1, 100, "", "tool", learned, pinned,
                     last_used=last)


def test_quota_then_cap_least_recently_used_first_pins_and_registered_kept():
    infos = [_info("a1", "a", 1), _info("a2", "a", 2), _info("a3", "a", 3, pinned=True),
             _info("b1", "b", 4), _info("reg", None, 0, learned=False)]
    assert [v.key for v in victims(infos, cap=None, quota=200)] == ["a1"]
    # a is over its share of the cap (150 each): its oldest unpinned go first
    assert [v.key for v in victims(infos, cap=200, quota=None)] == ["a1", "a2"]
    assert victims(infos, cap=None, quota=None) == []


def test_evict_forgets_over_a_real_store_under_one_lease(redis_url, make_entry):
    store, other = RedisStore.connect(redis_url), RedisStore.connect(redis_url)
    for i in range(3):
        store.put(make_entry(f"k{i}", "acme", seed=i))
    store.touch(MODEL, {"k0": 1}, when=3e9)  # k0 used last: k1 and k2 go first
    size = store.list(MODEL, every=True)[0].bytes
    assert other.acquire_lease(EVICT_LEASE.format(model=MODEL), 5)
    assert evict(store, MODEL, cap=size, quota=None) is None  # another host is at it
    other.release_lease(EVICT_LEASE.format(model=MODEL))
    assert evict(store, MODEL, cap=size, quota=None) == ["k1", "k2"]
    assert [i.key for i in store.list(MODEL, every=True)] == ["k0"]
