"""LocalMirror: a host's bounded copy of a shared Redis store, filled in the background."""

from __future__ import annotations

import shutil
import time

import pytest
from _store_helpers import MODEL, RedisServer

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.store import FolderStore, LocalMirror, MirrorConfig
from kvnotes.serving.store.redis_store import RedisSettings, RedisStore

FAST = RedisSettings(chunk_bytes=1024, socket_timeout_s=0.3, connect_timeout_s=0.3, retries=0)


def _mirror(store, tmp_path, max_bytes: int = 1 << 30, **config: float) -> LocalMirror:
    return LocalMirror(store, tmp_path / "host-b" / MODEL, MirrorConfig(max_bytes, **config))


def test_what_one_host_published_is_copied_to_another_hosts_folder(redis_url, tmp_path,
                                                                   make_entry):
    host_a = RedisStore.connect(redis_url, settings=FAST)
    entries = [make_entry(f"k{i}", "acme" if i % 2 else None, seed=i) for i in range(3)]
    for e in entries:
        host_a.put(e)
    mirror = _mirror(RedisStore.connect(redis_url, settings=FAST), tmp_path)
    assert mirror.sync_once() == 3 and mirror.sync_once() == 0
    for e in entries:
        assert (mirror.folder / f"{e.info.key}.safetensors").read_bytes() == e.data
    assert mirror.stats.fetched == 3 and mirror.stats.fetched_bytes == sum(e.info.bytes
                                                                           for e in entries)


def test_the_byte_bound_holds_and_evicts_the_least_recently_used_copy(redis_url, tmp_path,
                                                                      make_entry):
    store = RedisStore.connect(redis_url, settings=FAST)
    entries = [make_entry(f"k{i}", seed=i) for i in range(3)]
    for e in entries:
        store.put(e)
    size = entries[0].info.bytes
    mirror = _mirror(store, tmp_path, max_bytes=2 * size)
    assert mirror.sync_once() == 2  # a poll copies what fits, evicting nothing
    (missing,) = [e.info.key for e in entries if not mirror.has(e.info.key)]
    first, second = mirror.copies()
    mirror.used([first])  # now `second` is the least recently used
    assert mirror.want(missing, None) and mirror.fetch_wanted() == 1
    assert mirror.has(missing) and mirror.has(first) and not mirror.has(second)
    assert mirror.stats.evicted == 1 and mirror.stats.local_bytes <= 2 * size
    mirror.flush_hits()
    assert {i.key: i.hits for i in store.list(MODEL)}[first] == 1  # this host's hits, shared


def test_an_entry_forgotten_in_the_store_is_removed_here(redis_url, tmp_path, make_entry):
    store = RedisStore.connect(redis_url, settings=FAST)
    store.put(make_entry("k1", "acme"))
    mirror = _mirror(store, tmp_path)
    mirror.sync_once()
    assert mirror.has("k1") and store.forget(MODEL, "k1")
    mirror.sync_once()
    assert not mirror.has("k1") and mirror.stats.removed == 1


def test_a_store_that_dies_costs_its_entries_only(own_redis: RedisServer, tmp_path, make_entry):
    store = RedisStore.connect(own_redis.url, settings=FAST)
    store.put(make_entry("k1"))
    mirror = _mirror(store, tmp_path, poll_s=0.05, retry_s=0.05)
    mirror.sync_once()
    own_redis.stop()
    start = time.monotonic()
    assert mirror.want("k2", None)  # the request path: a queue put
    assert time.monotonic() - start < 0.05
    with pytest.raises(StoreUnavailableError):
        mirror.fetch_wanted()
    assert mirror.has("k1") and mirror.stats.faults_by_reason == {"down": 1}
    own_redis.start()
    store.put(make_entry("k2", seed=2))
    mirror.start()
    try:
        assert mirror.want("k2", None)
        deadline = time.monotonic() + 10
        while not mirror.has("k2"):
            assert time.monotonic() < deadline, mirror.stats
            time.sleep(0.02)
    finally:
        mirror.stop()


def test_a_mirrored_entry_is_indexed_by_the_connectors_piece_store(redis_url, tmp_path,
                                                                   tiny_llama):
    from kvnotes.serving.skills import ServingSkills

    lib = ServingSkills(tmp_path / "host-a", tiny_llama)
    piece = lib.add("Refunds are issued within 30 days of purchase.", name="refunds",
                    tenant="acme")
    model = lib.folder.name
    shared = RedisStore.connect(redis_url)
    local_a = FolderStore(lib.folder.parent)
    entry = local_a.get(model, piece.key, "acme")
    assert entry is not None
    shared.put(entry)
    folder_b = tmp_path / "host-b" / model
    folder_b.mkdir(parents=True)
    shutil.copy(lib.folder / "serving.json", folder_b / "serving.json")  # host B's own serve
    mirror = LocalMirror(shared, folder_b, MirrorConfig(max_bytes=1 << 30))
    assert mirror.sync_once() >= 1
    index = PieceStore(folder_b)
    assert piece.key in {p.key for p in index.view("acme").pieces()}
    assert piece.key not in {p.key for p in index.view("globex").pieces()}


def test_between_listings_the_mirror_follows_the_change_feed(redis_url, tmp_path, make_entry,
                                                             monkeypatch):
    store = RedisStore.connect(redis_url, settings=FAST)
    store.put(make_entry("k1"))
    mirror = _mirror(RedisStore.connect(redis_url, settings=FAST), tmp_path)
    assert mirror.sync_once() == 1
    store.put(make_entry("k2", "acme", seed=2))
    listed = []
    monkeypatch.setattr(mirror.store, "list", lambda *a, **k: listed.append(a) or [])
    assert mirror.sync_once() == 1 and mirror.has("k2") and listed == []  # no listing read
    store.forget(MODEL, "k2")
    mirror.sync_once()
    assert not mirror.has("k2") and mirror.stats.removed == 1
