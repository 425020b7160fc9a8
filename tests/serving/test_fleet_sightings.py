"""A fleet's sightings over one real Redis: a request's chunks are counted in one round trip
(the server's own counts say so), two hosts' counts add up, and a fault during the batch counts
the whole request on the host. No engine: the learner compiles into a fake serving folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import _fleet_hosts as fleet
from _learning_fakes import FakeSkills, seen

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner, LocalSightings, chunk_id
from kvnotes.serving.learning.fleet import (
    FleetStats,
    StoreGate,
    StoreSightings,
    request_path_settings,
)
from kvnotes.serving.store.redis_store import RedisStore

MODEL = "m0del0000000000000000000"

redis_server = fleet.redis_server  # a redis-server of each test's own


def counter(url: str, retry_s: float = 5.0) -> StoreSightings:
    """A host's sightings in the store at ``url`` (the request path's short timeouts)."""
    store = RedisStore.connect(url, settings=request_path_settings())
    return StoreSightings(StoreGate(store, retry_s, FleetStats()), MODEL, LocalSightings(1000),
                          ttl_s=60.0)


def learner(root: Path, sightings: StoreSightings) -> Learner:
    return Learner(LearnConfig(after=2, min_tokens=4), FakeSkills(root), sightings=sightings)


def server_counts(client: Any) -> dict[str, int]:
    """The server's reads from its clients' sockets and calls of the sightings' commands."""
    stats, calls = client.info("stats"), client.info("commandstats")
    out = {cmd: calls.get(f"cmdstat_{cmd}", {}).get("calls", 0)
           for cmd in ("exec", "incrby", "pexpire")}
    out["reads"] = stats["total_reads_processed"]
    return out


def delta(client: Any, act: Any) -> dict[str, int]:
    """What ``act()`` cost the server, less what reading the counts costs (measured)."""
    a, b = server_counts(client), server_counts(client)
    c = (act(), server_counts(client))[1]
    return {k: (c[k] - b[k]) - (b[k] - a[k]) for k in a}


def test_a_request_of_twenty_chunks_is_one_round_trip(redis_server, tmp_path):
    host = learner(tmp_path / "a", counter(redis_server.url))
    host.observe(None, [seen("a first request connects")])
    tools = [seen(f"tool number {i} of the request") for i in range(20)]
    probe = redis_server.client()
    try:
        cost = delta(probe, lambda: host.observe("acme", tools))
    finally:
        probe.close()
    assert cost == {"exec": 1, "incrby": 20, "pexpire": 20, "reads": 1}
    assert host.counters()["sightings"] == 21 and host.worker.pending() == 0


def test_two_hosts_counts_add_up_and_the_same_chunks_come_due(redis_server, tmp_path):
    sa, sb = counter(redis_server.url), counter(redis_server.url)
    x, y, z = b"x" * 16, b"y" * 16, b"z" * 16
    assert sa.sight_all([x, y]) == [1, 1]
    assert sb.sight_all([y, x, z]) == [2, 2, 1]
    assert sa.sight(x) == 3 and sb.sight_all([]) == []
    a, b = learner(tmp_path / "a", counter(redis_server.url)), learner(tmp_path / "b", sb)
    tools = [seen(f"tool number {i} of the request") for i in range(6)]
    a.observe("acme", tools[:3])
    b.observe("acme", tools)  # the fleet's second sighting of the first three
    assert (a.worker.pending(), b.worker.pending()) == (0, 3)
    assert b.run_pending() == 3
    done = {chunk_id("acme", t.token_ids): b.sightings.known(chunk_id("acme", t.token_ids))
            for t in tools}
    assert [bool(key) for key in done.values()] == [True] * 3 + [False] * 3
    assert sa.gate.stats.local_sightings == sb.gate.stats.local_sightings == 0


def test_a_fault_during_the_batch_counts_the_whole_request_on_the_host(redis_server, tmp_path):
    sightings = counter(redis_server.url)
    host = learner(tmp_path / "a", sightings)
    tools = [seen(f"tool number {i} of the request") for i in range(5)]
    assert sightings.sight_all([b"w" * 16]) == [1]  # connected
    probe = redis_server.client()
    try:  # the third chunk's counter is not a number: the server fails that INCR
        probe.set(f"kvn:seen:{MODEL}:{chunk_id('acme', tools[2].token_ids).hex()}", "x")
        cost = delta(probe, lambda: host.observe("acme", tools))
    finally:
        probe.close()
    assert cost["exec"] == 1 and cost["reads"] == 1  # one try, no retry
    assert sightings.gate.stats.local_sightings == 5  # the whole request, counted here
    assert sightings.gate.store.faults.to_dict()["error"] == 1 and not sightings.gate.open
    assert len(sightings.fallback) == 5 and host.counters()["sightings"] == 5
    host.observe("acme", tools)  # the store is left alone meanwhile: due on this host's count
    assert sightings.gate.stats.local_sightings == 10 and host.worker.pending() == 5


def test_a_store_that_is_down_counts_the_whole_request_on_the_host(redis_server, tmp_path):
    sightings = counter(redis_server.url, retry_s=0.2)
    host = learner(tmp_path / "a", sightings)
    tools = [seen(f"tool number {i} of the request") for i in range(20)]
    redis_server.stop()
    t0 = time.perf_counter()
    host.observe(None, tools)
    assert time.perf_counter() - t0 < 1.0
    assert sightings.gate.stats.local_sightings == 20
    assert sightings.gate.store.faults.to_dict()["down"] == 1
    redis_server.start()
    time.sleep(0.25)
    assert sightings.sight_all([chunk_id(None, tools[0].token_ids)]) == [1]  # the store's again
    assert sightings.gate.stats.local_sightings == 20
