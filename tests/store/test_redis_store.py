"""RedisStore against a real redis-server: publish, read, tenancy, damage, and the server's
faults (killed, restarted, flushed, full, slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _store_helpers import MODEL, RedisServer

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.store.redis_store import RedisSettings, RedisStore

SMALL_CHUNKS = RedisSettings(chunk_bytes=1024)  # several chunks per test entry
FAST = RedisSettings(chunk_bytes=1024, socket_timeout_s=0.3, connect_timeout_s=0.3, retries=0)


def _store(url: str, settings: RedisSettings = SMALL_CHUNKS) -> RedisStore:
    return RedisStore.connect(url, settings=settings)


def test_an_entry_round_trips_in_chunks_with_its_info(redis_url, make_entry):
    store = _store(redis_url)
    entry = make_entry("k1", tokens=12)
    assert entry.info.bytes > 3 * 1024  # several chunks
    store.put(entry)
    got = store.get(MODEL, "k1", None)
    assert got is not None and got.data == entry.data and got.info == entry.info
    assert [i.key for i in store.list(MODEL)] == ["k1"]
    assert store.models() == [MODEL]
    assert store.get(MODEL, "nope", None) is None


def test_a_tenant_never_lists_or_gets_another_tenants_entry(redis_url, make_entry):
    store = _store(redis_url)
    store.put(make_entry("shared1", None, learned=False))
    store.put(make_entry("acme1", "acme", seed=1))
    store.put(make_entry("globex1", "globex", seed=2))
    assert {i.key for i in store.list(MODEL, "acme")} == {"shared1", "acme1"}
    assert {i.key for i in store.list(MODEL, None)} == {"shared1"}
    assert {i.key for i in store.list(MODEL, every=True)} == {"shared1", "acme1", "globex1"}
    assert store.get(MODEL, "globex1", "acme") is None
    assert store.get(MODEL, "acme1", None) is None
    assert store.get(MODEL, "acme1", "acme") is not None
    assert store.get(MODEL, "shared1", "globex") is not None


def test_a_manifest_moved_into_another_tenants_namespace_is_refused(redis_url, redis_server,
                                                                  make_entry):
    store = _store(redis_url)
    store.put(make_entry("globex1", "globex"))
    raw = redis_server.client()
    # an operator's slip (or an attack on the store): globex's manifest copied under acme's key
    manifest = raw.get(store._manifest_key(MODEL, "globex", "globex1"))
    raw.set(store._manifest_key(MODEL, "acme", "globex1"), manifest)
    assert store.get(MODEL, "globex1", "acme") is None
    assert store.faults.to_dict()["malformed"] == 1
    assert raw.get(store._manifest_key(MODEL, "acme", "globex1")) is None  # dropped
    assert store.get(MODEL, "globex1", "globex") is not None  # the real one is untouched


def test_a_value_whose_checksum_fails_is_dropped_and_read_as_a_miss(redis_url, redis_server,
                                                                   make_entry):
    store = _store(redis_url)
    store.put(make_entry("k1"))
    raw = redis_server.client()
    chunk = sorted(k for k in raw.keys("kvn:e:*:c:*"))[1]
    value = bytearray(raw.get(chunk))
    value[10] ^= 0xFF
    raw.set(chunk, bytes(value))
    assert store.get(MODEL, "k1", None) is None
    assert store.faults.to_dict()["checksum"] == 1
    assert raw.keys("kvn:e:*") == []  # manifest and chunks gone
    assert store.list(MODEL) == []


def test_a_publish_that_fails_before_its_manifest_leaves_nothing_visible(redis_url, redis_server,
                                                                        make_entry, monkeypatch):
    store = _store(redis_url)

    def boom(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt  # the writer stopped between its chunks and the publish

    monkeypatch.setattr(store, "_publish_entry", boom)
    with pytest.raises(KeyboardInterrupt):
        store.put(make_entry("k1"))
    reader = _store(redis_url)
    assert reader.get(MODEL, "k1", None) is None and reader.list(MODEL) == []
    raw = redis_server.client()
    staged = raw.keys("kvn:e:*:c:*")
    assert staged and all(0 < raw.pttl(k) <= 600_000 for k in staged)  # they expire


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from _store_helpers import entry_bytes, MODEL
    from kvnotes.serving.store.entry import describe
    from kvnotes.serving.store.entry import StoredEntry
    from kvnotes.serving.store.redis_store import RedisSettings, RedisStore
    data = entry_bytes(Path(sys.argv[2]), "k1", tokens=12)
    store = RedisStore.connect(sys.argv[1], settings=RedisSettings(chunk_bytes=1024))
    store.put(StoredEntry(describe(data, "k1", MODEL), data))
""")


def test_a_writer_killed_between_chunks_publishes_nothing_and_its_chunks_expire(
        redis_url, redis_server, tmp_path):
    ready = tmp_path / "ready"
    env = {**os.environ, "KVNOTES_TEST_PAUSE": "store-chunk", "KVNOTES_TEST_PAUSE_READY": str(ready),
           "PYTHONPATH": os.pathsep.join([str(Path("src").resolve()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, redis_url, str(tmp_path),
                             str(Path(__file__).parent)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        reader = _store(redis_url)
        assert reader.get(MODEL, "k1", None) is None and reader.list(MODEL) == []
    finally:
        proc.kill()
        proc.wait(10)
    raw = redis_server.client()
    staged = raw.keys("kvn:e:*:c:*")
    assert len(staged) == 1 and 0 < raw.pttl(staged[0]) <= 600_000
    assert raw.keys("kvn:e:*:m") == [] and reader.get(MODEL, "k1", None) is None


def test_readers_see_whole_entries_while_one_is_republished(redis_url, make_entry):
    store = _store(redis_url)
    versions = [make_entry("k1", seed=s, tokens=12) for s in range(3)]
    store.put(versions[0])
    datas = {v.data for v in versions}
    stop, seen, bad = threading.Event(), [], []

    def read() -> None:
        reader = _store(redis_url)
        while not stop.is_set():
            got = reader.get(MODEL, "k1", None)
            (seen if got is not None and got.data in datas else bad).append(got)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(30):
        store.put(versions[i % 3])
    stop.set()
    for t in threads:
        t.join()
    assert seen and not bad


def test_sightings_count_across_two_hosts_and_expire(redis_url):
    a, b = _store(redis_url), _store(redis_url)
    assert [s.incr_sightings(["chunk-1"])[0] for s in (a, b, a)] == [1, 2, 3]
    assert b.incr_sightings(["chunk-2"], ttl_s=0.2)[0] == 1
    time.sleep(0.4)
    assert a.incr_sightings(["chunk-2"])[0] == 1


def test_a_batch_of_sightings_is_one_transaction_counted_with_the_others(redis_url,
                                                                             redis_server):
    a, b = _store(redis_url), _store(redis_url)
    probe = redis_server.client()
    assert a.incr_sightings(["c1"])[0] == 1
    calls = _calls(probe)
    assert b.incr_sightings(["c2", "c1", "c3"]) == [1, 2, 1]
    assert a.incr_sightings(["c3", "c3"], ttl_s=0.2) == [2, 3]  # in order, each counted
    done = _calls(probe)
    assert (done["exec"] - calls["exec"], done["incrby"] - calls["incrby"]) == (2, 5)
    assert a.incr_sightings([]) == [] and _calls(probe)["exec"] == done["exec"]  # no call
    assert 0 < probe.pttl("kvn:seen:c3") <= 200 and probe.pttl("kvn:seen:c2") > 86_000_000
    time.sleep(0.4)
    assert b.incr_sightings(["c3", "c2"]) == [1, 2]
    probe.close()


def _calls(client) -> dict[str, int]:
    """The server's count of calls per command (INFO commandstats)."""
    stats = client.info("commandstats")
    return {cmd: stats.get(f"cmdstat_{cmd}", {}).get("calls", 0) for cmd in ("exec", "incrby")}


def test_a_lease_is_held_by_one_host_and_a_dead_holders_lease_expires(redis_url):
    a, b = _store(redis_url), _store(redis_url)
    assert a.acquire_lease("compile:k1", ttl_s=0.5)
    assert not b.acquire_lease("compile:k1", ttl_s=0.5)
    assert not b.release_lease("compile:k1")  # not b's to give back
    assert a.release_lease("compile:k1") and b.acquire_lease("compile:k1", ttl_s=0.3)
    b.close()  # b dies holding it
    time.sleep(0.5)
    assert a.acquire_lease("compile:k1", ttl_s=1)


def test_pin_forget_and_touch_on_learned_entries_only(redis_url, make_entry):
    store = _store(redis_url)
    store.put(make_entry("reg1", None, learned=False))
    store.put(make_entry("learn1", "acme", seed=1))
    assert not store.pin(MODEL, "reg1") and not store.forget(MODEL, "reg1")
    assert store.pin(MODEL, "learn1")
    store.touch(MODEL, {"learn1": 3}, when=2e9)
    (info,) = [i for i in store.list(MODEL, "acme") if i.key == "learn1"]
    assert info.pinned and info.hits == 3 and info.last_used == 2e9
    assert [i.key for i in store.list(MODEL, every=True)] == ["reg1", "learn1"]  # LRU first
    assert store.forget(MODEL, "learn1")
    assert store.get(MODEL, "learn1", "acme") is None and store.forgotten(MODEL) == ["learn1"]
    assert store.delete(MODEL, "reg1") and store.list(MODEL, every=True) == []


def test_flushall_reads_as_misses_and_the_store_is_used_again(redis_url, redis_server, make_entry):
    store = _store(redis_url)
    store.put(make_entry("k1"))
    redis_server.client().flushall()
    assert store.get(MODEL, "k1", None) is None and store.list(MODEL) == []
    store.put(make_entry("k1"))
    assert store.get(MODEL, "k1", None) is not None


def test_a_killed_server_is_unavailable_then_picked_up_again(own_redis: RedisServer, make_entry,
                                                             caplog):
    store = _store(own_redis.url, FAST)
    store.put(make_entry("k1"))
    own_redis.stop()
    with pytest.raises(StoreUnavailableError) as err:
        store.get(MODEL, "k1", None)
    assert err.value.reason == "down" and "is the server running" in str(err.value)
    with pytest.raises(StoreUnavailableError):
        store.put(make_entry("k2"))
    assert not store.available and store.faults.to_dict()["down"] == 2
    assert sum("unavailable (down)" in r.message for r in caplog.records) == 1  # logged once
    own_redis.start()  # restarted empty (no persistence): the store answers, with misses
    assert store.get(MODEL, "k1", None) is None and store.available
    store.put(make_entry("k1"))
    assert store.get(MODEL, "k1", None) is not None
    assert any("answers again" in r.message for r in caplog.records)


def test_a_full_server_refuses_writes_with_a_clear_error_and_keeps_serving_reads(
        own_redis: RedisServer, make_entry):
    store = _store(own_redis.url, FAST)
    store.put(make_entry("k0"))
    raw = own_redis.client()
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 64 * 1024)
    with pytest.raises(StoreUnavailableError) as err:
        for i in range(1, 200):
            store.put(make_entry(f"k{i}", seed=i, tokens=32))
    assert err.value.reason == "full" and "maxmemory" in str(err.value)
    assert store.faults.to_dict()["full"] == 1
    assert store.get(MODEL, "k0", None) is not None  # reads go on
    raw.config_set("maxmemory", 0)
    store.put(make_entry("late", tokens=32))
    assert store.get(MODEL, "late", None) is not None


def test_a_slow_server_times_out_quickly(own_redis: RedisServer, make_entry):
    store = _store(own_redis.url, FAST)
    store.put(make_entry("k1"))
    sleeper = threading.Thread(
        target=lambda: own_redis.client().execute_command("DEBUG", "SLEEP", 2))
    sleeper.start()
    deadline = time.monotonic() + 1.5
    while True:  # until the server is asleep (the thread's command may not be there yet)
        start = time.monotonic()
        try:
            store.get(MODEL, "k1", None)
        except StoreUnavailableError as err:
            assert err.reason == "timeout"
            break
        assert time.monotonic() < deadline, "the server never stopped answering"
        time.sleep(0.02)
    assert time.monotonic() - start < 1.2  # the socket timeout (0.3 s), not the sleep (2 s)
    sleeper.join()
    assert store.get(MODEL, "k1", None) is not None
