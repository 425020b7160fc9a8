"""``serve-bench fleet``'s loss check against a real Redis: the entries published (the store's
change feed) after the last destructive fault, less those forgotten since, that the store no
longer returns whole are reported lost; entries published before that fault are not counted."""

from __future__ import annotations

import time

from _store_helpers import MODEL

from kvnotes.serving.store.redis_store import RedisStore
from kvnotes_bench.serving.fleet_soak import FaultEvent, published_lost


def test_entries_published_after_the_last_flush_and_then_lost_are_counted(
        redis_url, make_entry) -> None:
    store = RedisStore.connect(redis_url)
    store.put(make_entry("before"))
    store.client.flushall()  # the fault: what was published before it may be gone
    flush = FaultEvent("flush", 0.5, ok=True, wall=time.time())
    time.sleep(0.01)  # the feed's row ids are milliseconds
    for key in ("kept", "lost", "forgotten"):
        store.put(make_entry(key))
    store.forget(MODEL, "forgotten")
    manifest = next(k for k in store.client.scan_iter(match="*lost}:m"))
    store.client.delete(manifest)  # lost behind the fleet's back
    got = published_lost(redis_url, [FaultEvent("kill", 0.1, ok=True, wall=0.0), flush,
                                     FaultEvent("restart", 0.9, error="the soak ended first")])
    store.close()
    assert got["after"] == ["flush"] and got["since"] == flush.wall
    assert got["published"] == 2 and got["lost"] == 1
    assert [k.rpartition("/")[2] for k in got["lost_keys"]] == ["lost"]
