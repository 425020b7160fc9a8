"""RedisStore under faults a production Redis does see, each made real against a redis-server:
lost replies (a loopback proxy that drops them), stalls (DEBUG SLEEP), data written by someone
else (malformed manifests), a full server, a server that may evict any key."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from _proxy import DropProxy
from _store_helpers import MODEL, RedisServer

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.store import LocalMirror, MirrorConfig
from kvnotes.serving.store.bounds import evict
from kvnotes.serving.store.redis_store import RedisSettings, RedisStore

SMALL = RedisSettings(chunk_bytes=1024)


@pytest.fixture
def proxy(own_redis: RedisServer) -> Iterator[DropProxy]:
    p = DropProxy(own_redis.port)
    yield p
    p.stop()


def _manifest_key(store: RedisStore, key: str, owner: str = "~") -> str:
    return store._manifest_key(MODEL, owner, key)


def test_a_publish_whose_reply_is_lost_keeps_its_entry(own_redis, proxy, make_entry):
    raw = own_redis.client()
    store = RedisStore.connect(proxy.url, settings=RedisSettings(
        chunk_bytes=1024, old_generation_ttl_s=0.2, retries=2))
    raw.script_load(store._publish.script)  # so the lost reply is the publish's own run
    store.put(make_entry("k0", seed=9))  # the server's policy is read before the fault
    for version, seed in enumerate((1, 2)):  # a new entry, then a replaced one
        proxy.drop_reply_to(store._publish.sha.encode())
        entry = make_entry("k1", seed=seed, tokens=12)
        store.put(entry)  # the script ran; its reply was lost; redis-py sent it again
        assert proxy.dropped == version + 1
        time.sleep(0.5)  # past the previous generation's expiry
        got = store.get(MODEL, "k1", None)
        assert got is not None and got.data == entry.data
    chunks = raw.keys("kvn:e:{*/~/k1}:c:*")
    assert chunks and all(raw.pttl(k) == -1 for k in chunks)  # this generation's only, kept
    assert store.faults.total == 0


def _rewrite(raw, key: str, **changes: object) -> None:
    """Change fields of a published manifest (``info_*`` for its info's) behind the store."""
    manifest = json.loads(raw.get(key))
    for name, value in changes.items():
        if name.startswith("info_"):
            manifest["info"][name[5:]] = value
        else:
            manifest[name] = value
    raw.set(key, json.dumps(manifest))


@pytest.mark.parametrize("field", ["hits", "last_used", "tokens"])
def test_a_manifest_with_a_string_for_a_number_is_skipped_dropped_and_counted(
        redis_url, redis_server, make_entry, field):
    store, raw = RedisStore.connect(redis_url, settings=SMALL), redis_server.client()
    for i in range(3):
        store.put(make_entry(f"k{i}", seed=i))
    _rewrite(raw, _manifest_key(store, "k1"), **{f"info_{field}": "many"})
    assert [i.key for i in store.list(MODEL)] == ["k0", "k2"]
    assert store.faults.to_dict()["malformed"] == 1
    assert raw.get(_manifest_key(store, "k1")) is None
    assert b"k1" not in raw.smembers("kvn:idx:" + MODEL + ":~")
    assert store.get(MODEL, "k1", None) is None


def test_bad_hit_counts_in_the_lru_bookkeeping_never_stop_a_listing(redis_url, redis_server,
                                                                  make_entry):
    store, raw = RedisStore.connect(redis_url, settings=SMALL), redis_server.client()
    store.put(make_entry("k0"))
    raw.hset(f"kvn:hits:{MODEL}", mapping={"k0": "lots", "ghost": "7"})
    (info,) = store.list(MODEL)
    assert info.key == "k0" and info.hits == 0


@pytest.mark.parametrize("chunks", [9_000, 200_000])
def test_a_manifest_claiming_absurd_chunks_is_a_quick_miss_and_stops_nothing(
        redis_url, redis_server, make_entry, tmp_path, chunks):
    store, raw = RedisStore.connect(redis_url, settings=SMALL), redis_server.client()
    entries = [make_entry(f"k{i}", seed=i) for i in range(3)]
    for e in entries:
        store.put(e)
    _rewrite(raw, _manifest_key(store, "k1"), chunks=chunks)
    start = time.monotonic()
    assert store.get(MODEL, "k1", None) is None  # a miss, not an error
    assert time.monotonic() - start < 0.5
    assert store.faults.to_dict()["malformed"] == 1 and raw.get(_manifest_key(store, "k1")) is None
    _rewrite(raw, _manifest_key(store, "k2"), chunks=chunks)
    mirror = LocalMirror(store, tmp_path / "host" / MODEL, MirrorConfig(max_bytes=1 << 30))
    assert mirror.sync_once() == 1 and mirror.has("k0")  # the pass went past k2
    assert evict(store, MODEL, cap=0, quota=None) == ["k0"]  # the cap is enforced


def test_chunks_larger_than_declared_are_refused_before_they_are_read(redis_url, redis_server,
                                                                     make_entry):
    store, raw = RedisStore.connect(redis_url, settings=SMALL), redis_server.client()
    store.put(make_entry("k1"))
    (chunk,) = [k for k in raw.keys("kvn:e:*:c:*") if k.endswith(b":0")]
    raw.set(chunk, b"x" * (8 << 20))
    assert store.get(MODEL, "k1", None) is None
    assert store.faults.to_dict()["malformed"] == 1 and store.faults.to_dict()["checksum"] == 0


def test_a_dropped_entry_leaves_no_index_member_or_lru_row(redis_url, redis_server, make_entry):
    store, raw = RedisStore.connect(redis_url, settings=SMALL), redis_server.client()
    for i in range(3):
        store.put(make_entry(f"k{i}", seed=i))
    store.touch(MODEL, {"k0": 1, "k1": 1, "k2": 1})
    chunk = sorted(raw.keys("kvn:e:{*/~/k0}:c:*"))[1]
    raw.set(chunk, b"\0" * len(raw.get(chunk)))  # damaged: k0 is dropped at its read
    assert store.get(MODEL, "k0", None) is None
    raw.delete(_manifest_key(store, "k1"))  # evicted or flushed: a dangling member
    assert [i.key for i in store.list(MODEL)] == ["k2"]
    assert raw.smembers(f"kvn:idx:{MODEL}:~") == {b"k2"}
    assert [k for k, _ in raw.zrange(f"kvn:lru:{MODEL}", 0, -1, withscores=True)] == [b"k2"]
    assert set(raw.hkeys(f"kvn:hits:{MODEL}")) == {b"k2"}


def test_a_listing_during_a_publish_does_not_lose_the_entry(redis_url, make_entry, monkeypatch):
    writer = RedisStore.connect(redis_url, settings=SMALL)
    reader = RedisStore.connect(redis_url, settings=SMALL)
    publish = writer._publish_entry

    def listed_first(*args: object) -> None:
        assert reader.list(MODEL) == []  # indexed, not yet published: unlisted by the reader
        publish(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "_publish_entry", listed_first)
    writer.put(make_entry("k1"))
    assert [i.key for i in reader.list(MODEL)] == ["k1"]


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_a_server_that_may_evict_any_key_is_refused_with_a_clear_message(own_redis, make_entry,
                                                                        policy):
    raw = own_redis.client()
    raw.config_set("maxmemory-policy", policy)
    store = RedisStore.connect(own_redis.url, settings=SMALL)
    with pytest.raises(StoreUnavailableError) as err:
        store.put(make_entry("k1"))
    assert err.value.reason == "policy"
    assert policy in str(err.value) and "noeviction" in str(err.value)
    assert not store.ping() and store.faults.to_dict()["policy"] == 2
    assert raw.keys("kvn:*") == []  # refused before anything was written
    raw.config_set("maxmemory-policy", "volatile-lru")
    store.put(make_entry("k1"))
    assert store.get(MODEL, "k1", None) is not None


def test_forget_on_a_full_server_is_done_whole(own_redis, make_entry):
    raw = own_redis.client()
    store = RedisStore.connect(own_redis.url, settings=SMALL)
    store.put(make_entry("k0", "acme"))
    store.put(make_entry("k1", "acme", seed=1))
    store.pin(MODEL, "k1")
    raw.config_set("maxmemory", max(1, int(raw.info("memory")["used_memory"]) - 4096))
    with pytest.raises(StoreUnavailableError, match="maxmemory"):
        store.touch(MODEL, {"k0": 1})  # the server is full: writes that need memory refused
    assert store.forget(MODEL, "k1")
    assert store.forgotten(MODEL) == ["k1"]
    assert [c.op for c in store.changes(MODEL, "0-0")[1]] == ["put", "put", "forget"]
    assert [i.key for i in store.list(MODEL, every=True)] == ["k0"]
    assert raw.keys("kvn:e:*k1*") == [] and raw.smembers(f"kvn:pins:{MODEL}") == set()
    raw.config_set("maxmemory", 0)


def test_a_forget_whose_reply_is_lost_reports_it_done(own_redis, proxy, make_entry):
    store = RedisStore.connect(proxy.url, settings=SMALL)
    store.put(make_entry("k1", "acme"))
    own_redis.client().script_load(store._forget.script)
    proxy.drop_reply_to(store._forget.sha.encode())
    assert store.forget(MODEL, "k1") and proxy.dropped == 1
    assert store.forgotten(MODEL) == ["k1"] and store.list(MODEL, every=True) == []


REQUEST_PATH = RedisSettings(socket_timeout_s=0.05, connect_timeout_s=0.2, retries=0)


def test_a_lease_whose_take_timed_out_is_given_back_by_the_next_call(own_redis):
    host_a = RedisStore.connect(own_redis.url, settings=REQUEST_PATH)
    host_b = RedisStore.connect(own_redis.url)
    assert host_a.acquire_lease("compile:warm", ttl_s=600)  # the script is on the server
    sleeper = threading.Thread(
        target=lambda: own_redis.client().execute_command("DEBUG", "SLEEP", 0.5))
    sleeper.start()
    deadline = time.monotonic() + 2
    for n in range(1000):  # until a take meets the sleeping server (its SET runs when it wakes)
        name = f"compile:x{n}"
        try:
            assert host_a.acquire_lease(name, ttl_s=600)
        except StoreUnavailableError as err:
            assert err.reason == "timeout"
            break
        assert time.monotonic() < deadline, "the server never stalled"
        time.sleep(0.01)
    sleeper.join()
    assert not host_b.acquire_lease(name, ttl_s=600)  # the timed-out take was applied
    assert host_a.acquire_lease("compile:y", ttl_s=600)  # host A's next lease call ...
    assert host_b.acquire_lease(name, ttl_s=600)  # ... gave it back


def test_leases_are_taken_in_one_call_and_a_retried_take_is_still_held(redis_url, redis_server):
    a, b = RedisStore.connect(redis_url), RedisStore.connect(redis_url)
    assert a.acquire_leases(["l1", "l2", "l3"], 60) == [True, True, True]
    assert b.acquire_leases(["l2", "l4"], 60) == [False, True]
    assert not a.acquire_lease("l1", 60)  # held already, by another call of the same holder
    assert a.release_lease("l1") and not b.release_lease("l2")
    assert b.acquire_leases(["l1", "l2"], 60) == [True, False]
