"""Learning for a fleet over one real Redis: sightings add up across hosts, one host compiles,
the others mirror or adopt its entry, a dead compiler's lease expires, tenants stay apart, and a
store that is down, slow or flushed costs learning, never an answer. Two hosts are two
:class:`FleetLearner` s (each its own folder) in this process; a tiny random llama compiles."""

from __future__ import annotations

import threading
import time

import _fleet_hosts as fleet
from _fleet_hosts import Host, chunk, lease_name, wait_for
from _front_fakes import HEADER

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.store.redis_store import RedisStore

TOOL = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather '
        'for a city today", "parameters": {"city": "string"}}}')
OTHER = ('{"type": "function", "function": {"name": "book_table", "description": "Book a '
         'table at a restaurant", "parameters": {"name": "string", "people": "integer"}}}')


# the fleet's fixtures (a module-scoped engine, a redis-server of each test's, its hosts)
engine, redis_server, hosts = fleet.engine, fleet.redis_server, fleet.hosts


def compiles(*hosts: Host) -> int:
    return sum(h.learner.counters()["compiles"] for h in hosts)


def test_a_chunk_seen_twice_on_one_host_is_compiled_once_for_the_fleet(hosts, tokenizer):
    a, b = hosts("a"), hosts("b")
    tool = chunk(tokenizer, TOOL, after=HEADER)
    assert a.seen(None, tool) == 0 and b.seen(None, tool) == 1  # the fleet's 2nd sighting
    assert compiles(a, b) == 1 and b.learner.fleet_counters()["published"] == 1
    (info,) = a.store.list(a.model)
    assert info.learned and info.name.startswith("tool-") and b.has(info.key)
    a.mirror.sync_once()  # host A's mirror fetches what host B compiled
    assert a.has(info.key) and a.mirror.stats.fetched == 1
    assert info.key in {p.key for p in a.catalog.pieces()}  # matchable: the catalog rescanned
    # host A's own sightings come due again: it takes the fleet's entry, never compiles it
    assert a.seen(None, tool, times=2) == 1
    assert compiles(a, b) == 1 and a.learner.fleet_counters()["adopted"] == 1
    assert a.learner.bounds.holds(info.key) and info.key not in a.mirror.copies()
    assert a.seen(None, tool, times=3) == 0  # learned here now: no more counting


def test_a_chunk_another_host_learned_behind_another_prefix_is_taken_not_compiled(hosts,
                                                                                  tokenizer):
    # agent traffic: the same tool behind a different prefix on each host (other tools before
    # it). Host B learned it; host A's own sightings come due behind its own prefix: A takes
    # B's entry (its tokens are the tool's; the connector re-rotates it), as one host learns a
    # chunk once whatever prefix it comes due behind. Recompiling it cost a compile per host,
    # and compiles are what a saturated fleet lacks (docs/results/areas/fleet.md, the quiet
    # soak's hit rate).
    a, b = hosts("a"), hosts("b")
    tool_on_b = chunk(tokenizer, TOOL, after=HEADER)
    tool_on_a = chunk(tokenizer, TOOL, after=HEADER + OTHER)
    assert b.seen(None, tool_on_b, times=2) == 1 and compiles(b) == 1
    (info,) = b.store.list(b.model)
    a.mirror.sync_once()
    assert a.has(info.key)
    assert a.seen(None, tool_on_a, times=2) == 1  # due on A, behind its own prefix
    assert compiles(a, b) == 1 and a.learner.fleet_counters()["adopted"] == 1
    assert a.learner.bounds.holds(info.key) and info.key not in a.mirror.copies()
    assert [i.key for i in a.store.list(a.model)] == [info.key]  # one entry for the fleet
    assert a.seen(None, tool_on_a, times=3) == 0  # learned here now: no more counting


def test_a_host_that_dies_mid_compile_leaves_no_entry_and_its_lease_expires(hosts, tokenizer,
                                                                            redis_server):
    b = hosts("b", lease_s=1.0)
    tool = chunk(tokenizer, TOOL, after=HEADER)
    dead = RedisStore.connect(redis_server.url)  # host A: took the lease, then was killed
    assert dead.acquire_lease(lease_name(b, None, tool), 1.0)
    dead.close()
    assert b.seen(None, tool, times=3) == 0  # due, but A holds the compile
    assert b.store.list(b.model, every=True) == []  # nothing published, nothing partial
    time.sleep(1.1)
    assert b.seen(None, tool) == 1 and compiles(b) == 1
    assert len(b.store.list(b.model, every=True)) == 1


def test_one_host_compiles_while_the_others_wait_on_its_lease(hosts, tokenizer):
    a, b = hosts("a"), hosts("b")
    tool = chunk(tokenizer, TOOL, after=HEADER)
    a.learner.observe(None, [tool])
    a.learner.observe(None, [tool])  # due on A: queued, its lease held
    assert b.seen(None, tool, times=3) == 0  # B's sightings are due too, but A compiles it
    assert a.learner.run_pending() == 1 and compiles(a, b) == 1


def test_a_tenant_never_splices_or_lists_another_tenants_entry_across_hosts(hosts, tokenizer):
    a, b = hosts("a"), hosts("b")
    tool = chunk(tokenizer, TOOL, after=HEADER)
    assert a.seen("acme", tool, times=2) == 1
    (acme,) = a.store.list(a.model, "acme")
    assert acme.tenant == "acme" and a.store.list(a.model, "globex") == []
    b.mirror.sync_once()
    assert b.has(acme.key)  # a host copies every tenant's entries ...
    assert b.catalog.keys_of(tool.token_ids, "globex") == []  # ... but splices only its own
    assert b.catalog.keys_of(tool.token_ids, "acme") == [acme.key]
    assert b.seen("globex", tool, times=2) == 1  # globex counts apart and compiles its own
    globex = {i.key for i in b.store.list(b.model, "globex")} - {acme.key}
    assert len(globex) == 1 and b.learner.fleet_counters()["adopted"] == 0
    assert b.store.get(b.model, acme.key, "globex") is None


def test_a_store_that_is_down_costs_learning_never_a_request(hosts, tokenizer, redis_server):
    a = hosts("a", retry_s=0.3)
    tool, other = chunk(tokenizer, TOOL, after=HEADER), chunk(tokenizer, OTHER, after=HEADER)
    redis_server.stop()
    t0 = time.perf_counter()
    assert a.seen(None, tool, times=5) == 0  # counted here; compiles need the fleet's lease
    assert time.perf_counter() - t0 < 1.0
    stats = a.learner.fleet_counters()
    assert stats["local_sightings"] == 5 and stats["skipped_compiles"] >= 1
    assert a.learner.store_faults()["down"] >= 1
    redis_server.start()  # back on the same port: picked up again after retry_s
    time.sleep(0.35)
    assert a.seen(None, other, times=2) == 1 and compiles(a) == 1
    assert len(a.store.list(a.model)) == 1


def test_a_slow_store_is_waited_for_a_bounded_time(hosts, tokenizer, redis_server):
    a = hosts("a", retry_s=5.0)
    tool = chunk(tokenizer, TOOL, after=HEADER)
    client = redis_server.client()
    sleeper = threading.Thread(target=lambda: client.execute_command("DEBUG", "SLEEP", "1"))
    sleeper.start()
    probe = _probe(redis_server.port)
    assert wait_for(lambda: _asleep(probe), timeout=0.9), "the server never stopped answering"
    probe.close()
    try:
        t0 = time.perf_counter()
        a.learner.observe(None, [tool])
        a.learner.observe(None, [tool])
        took = time.perf_counter() - t0
    finally:
        sleeper.join()
        client.close()
    assert took < 0.5  # one request-path timeout (50 ms), then the store is left alone
    assert a.learner.store_faults()["timeout"] >= 1
    assert a.learner.fleet_counters()["local_sightings"] == 2


def test_a_flushed_store_keeps_local_entries_and_learning_goes_on(hosts, tokenizer,
                                                                 redis_server):
    a, b = hosts("a"), hosts("b")
    tool, other = chunk(tokenizer, TOOL, after=HEADER), chunk(tokenizer, OTHER, after=HEADER)
    assert a.seen(None, tool, times=2) == 1
    (info,) = a.store.list(a.model)
    b.mirror.sync_once()
    client = redis_server.client()
    client.flushall()
    client.close()
    assert a.has(info.key) and b.has(info.key)  # each host keeps what it holds
    b.mirror.sync_once()
    assert b.has(info.key)  # a flushed store forgets nothing a host holds
    assert b.seen(None, other, times=2) == 1  # learning goes on into the emptied store
    assert [i.name for i in a.store.list(a.model)] != [] and compiles(a, b) == 2
    assert wait_for(lambda: a.mirror.sync_once() >= 0 and len(a.mirror.copies()) == 1)


def test_a_full_store_refuses_a_publish_and_takes_it_once_it_has_room(hosts, tokenizer,
                                                                     redis_server):
    a = hosts("a")
    tool = chunk(tokenizer, TOOL, after=HEADER)
    a.learner.observe(None, [tool])
    a.learner.observe(None, [tool])  # due: queued, the fleet's lease taken
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]))  # full
    try:
        assert a.learner.run_pending() == 1 and compiles(a) == 1  # compiled, kept here
        (row,) = a.learner.registry.entries()
        assert a.has(row.key) and a.learner.store_faults()["full"] >= 1
        assert a.learner.fleet_counters()["publish_failures"] == 1
        assert a.learner.publisher.unpublished == 1
    finally:
        client.config_set("maxmemory", 0)
        client.close()
    a.learner.upkeep()  # the worker's chore: published now
    assert [i.key for i in a.store.list(a.model)] == [row.key]
    assert a.learner.fleet_counters()["published"] == 1


def test_a_host_publishes_its_entries_again_into_an_emptied_store(hosts, tokenizer,
                                                                 redis_server):
    a, b = hosts("a"), hosts("b")
    tool = chunk(tokenizer, TOOL, after=HEADER)
    a.learner.upkeep()  # the store's epoch, as this host first saw it
    assert a.seen(None, tool, times=2) == 1
    (row,) = a.learner.registry.entries()
    redis_server.stop()
    redis_server.start()  # restarted without persistence: the store is empty
    assert a.store.list(a.model) == []
    a.learner.upkeep()
    assert [i.key for i in a.store.list(a.model)] == [row.key]
    b.mirror.sync_once()
    assert b.has(row.key)  # a host that never saw it gets it from the refilled store


def test_the_fleets_cap_is_enforced_by_one_host_per_period(hosts, tokenizer):
    a, b = hosts("a"), hosts("b")
    assert a.seen(None, chunk(tokenizer, TOOL, after=HEADER), times=2) == 1
    assert b.seen(None, chunk(tokenizer, OTHER, after=HEADER), times=2) == 1
    assert len(a.store.list(a.model)) == 2
    a.learner.config = b.learner.config = LearnConfig(after=2, min_tokens=4, library_cap=1)
    gone = a.learner.enforce_fleet()
    assert gone is not None and len(gone) == 2 and a.store.list(a.model) == []
    assert b.learner.enforce_fleet() is None  # A did it less than evict_s ago
    assert a.learner.fleet_counters()["fleet_evictions"] == 2


def _probe(port: int):
    """A client that gives up on a command after 20 ms, at once (no retries)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(port=port, socket_timeout=0.02, retry=Retry(NoBackoff(), 0))


def _asleep(client) -> bool:
    import redis

    try:
        client.ping()
    except redis.exceptions.TimeoutError:
        return True
    return False
