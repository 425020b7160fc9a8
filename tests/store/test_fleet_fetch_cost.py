"""``serve-bench fleet``'s fetch cost against a real Redis store: every entry fetched once,
timed, its bytes counted."""

from __future__ import annotations

from kvnotes.serving.store import store_from_url
from kvnotes_bench.serving.fleet_parts import fetch_cost


def test_fetch_cost_reads_every_entry(redis_url, make_entry) -> None:
    store = store_from_url(redis_url)
    entries = [make_entry(f"k{i:02d}", tenant=None if i % 2 else "acme", tokens=16, seed=i)
               for i in range(4)]
    for entry in entries:
        store.put(entry)
    store.close()
    cost = fetch_cost(redis_url, mirror={"fetched": 1})
    assert cost.entries == 4 and cost.failed == 0
    assert cost.bytes == sum(len(e.data) for e in entries)
    assert cost.seconds > 0 and cost.s_per_mb is not None and cost.mirror == {"fetched": 1}
