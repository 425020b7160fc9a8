"""A fleet's compile leases on a request's path over one real Redis: all of a request's due
chunks' leases are one store call (the server's own counts say so), and a chunk whose lease
take timed out is compiled by another host once the first has made its next call. No engine:
the learner compiles into a fake serving folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _fleet_hosts as fleet
from _learning_fakes import FakeSkills, seen

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning.fleet import FleetLearner, request_path_settings
from kvnotes.serving.store.redis_store import RedisStore

redis_server = fleet.redis_server  # a redis-server of each test's own


def host(root: Path, url: str) -> FleetLearner:
    return FleetLearner(LearnConfig(after=2, min_tokens=4), FakeSkills(root),
                        store=RedisStore.connect(url),
                        request_store=RedisStore.connect(url, settings=request_path_settings()))


def server_counts(client: Any) -> dict[str, int]:
    """The server's reads from its clients' sockets, and its calls of scripts and MULTI/EXEC."""
    stats, calls = client.info("stats"), client.info("commandstats")
    out = {cmd: calls.get(f"cmdstat_{cmd}", {}).get("calls", 0) for cmd in ("evalsha", "exec")}
    out["reads"] = stats["total_reads_processed"]
    return out


def test_twenty_due_chunks_of_a_request_take_their_leases_in_one_call(redis_server, tmp_path):
    learner = host(tmp_path / "a", redis_server.url)
    warm = [seen("a first chunk that comes due early")]
    learner.observe(None, warm)
    learner.observe(None, warm)  # due: the lease script is loaded on the server
    tools = [seen(f"tool number {i} of the request") for i in range(20)]
    learner.observe("acme", tools)
    probe = redis_server.client()
    a, b = server_counts(probe), server_counts(probe)  # what reading the counts costs
    learner.observe("acme", tools)  # the second sighting: all 20 come due
    c = server_counts(probe)
    probe.close()
    cost = {k: (c[k] - b[k]) - (b[k] - a[k]) for k in a}
    # the sightings' MULTI/EXEC and one lease script: two round trips in all
    assert cost == {"evalsha": 1, "exec": 1, "reads": 2}
    assert learner.worker.pending() == 21
    assert learner.fleet_counters()["skipped_compiles"] == 0


def test_a_chunk_repeated_in_a_request_is_queued_once(redis_server, tmp_path):
    learner = host(tmp_path / "a", redis_server.url)
    tool = seen("a tool that the request lists twice")
    learner.observe(None, [tool])
    learner.observe(None, [tool, tool])
    assert learner.worker.pending() == 1
