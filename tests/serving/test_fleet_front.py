"""Two hosts' fronts over one real Redis (a fake vLLM behind each): a chunk learned through host A
is spliced on host B's first request with it, and host B's front keeps answering, with its local
entries only, while the store is killed, restarted and flushed; ``/metrics`` counts why."""

from __future__ import annotations

from typing import Any

import _fleet_hosts as fleet
import httpx2
import pytest
from _fleet_hosts import Host, chunk, wait_for
from _front_fakes import BAGGAGE, HEADER, MODEL, REFUNDS, USER

import kvnotes.serving.front.service as service_module
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.planning.chunks import SeenChunk

engine, redis_server, hosts = fleet.engine, fleet.redis_server, fleet.hosts  # fixtures
BODY = {"model": MODEL, "prompt": HEADER + REFUNDS + BAGGAGE + USER, "max_tokens": 2}
OTHER = "\nSEATS: a seat by the window costs 9 euros on flights longer than two hours.\n"


class _WithChunks:
    """A read request with the chunks the test says it carries."""

    def __init__(self, req: Any, chunks: tuple[SeenChunk, ...]) -> None:
        self._req, self.chunks = req, chunks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


@pytest.fixture
def carried(monkeypatch):
    """``carried[:] = [chunk, ...]``: the chunks every request is read with from now on."""
    chunks: list[SeenChunk] = []
    read = service_module.read_request
    monkeypatch.setattr(service_module, "read_request",
                        lambda *a, **k: _WithChunks(read(*a, **k), tuple(chunks)))
    return chunks


def registered(host: Host) -> Host:
    host.skills.add(HEADER, name="header")
    host.skills.add(REFUNDS, name="refunds", after=HEADER)
    host.catalog.refresh(force=True)
    return host


def front_of(host: Host, fake: Any) -> Front:
    """A front over the host's fleet learner: the service links the learner's store, mirror
    and catalog, and shows their series."""
    return Front(FrontConfig(upstream=fake.url), host.catalog, host.learner)


def post(front: Front, body: dict[str, Any] = BODY) -> dict[str, Any]:
    resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def metric(front: Front, line: str) -> float:
    text = httpx2.get(front.url + "/metrics", timeout=30).text
    found = [ln for ln in text.splitlines() if ln.startswith(line + " ")]
    assert found, f"{line} not in /metrics"
    return float(found[0].split()[-1])


def test_a_chunk_learned_through_host_a_is_spliced_on_host_bs_first_request(
        hosts, tokenizer, fake, carried):
    a, b = registered(hosts("a")), registered(hosts("b"))
    carried[:] = [chunk(tokenizer, BAGGAGE, after=HEADER + REFUNDS, kind="content")]
    b.mirror.start()
    with front_of(a, fake) as front_a, front_of(b, fake) as front_b:
        for _ in range(2):
            post(front_a)
        assert a.learner.wait_idle(120)
        (entry,) = a.learner.registry.entries()
        assert wait_for(lambda: b.has(entry.key))  # B's mirror fetched it in the background
        plan = post(front_b)["usage"]["kvnotes"]["plan"]
        assert plan["skills"][-1] == entry.name  # B's first request with it splices it
        assert metric(front_b, "kvnotes_front_mirror_fetched_total") == 1
        assert metric(front_a, "kvnotes_front_fleet_published_total") == 1
    assert a.learner.counters()["compiles"] + b.learner.counters()["compiles"] == 1


def test_host_bs_front_answers_through_a_store_killed_restarted_and_flushed(
        hosts, tokenizer, fake, carried, redis_server):
    a, b = registered(hosts("a")), registered(hosts("b", retry_s=0.2))
    baggage = chunk(tokenizer, BAGGAGE, after=HEADER + REFUNDS, kind="content")
    seats = chunk(tokenizer, OTHER, after=HEADER + REFUNDS, kind="content")
    carried[:] = [baggage]
    assert a.seen(None, baggage, times=2) == 1
    (learned,) = a.learner.registry.entries()
    b.mirror.start()
    assert wait_for(lambda: b.has(learned.key))
    local = {"header", "refunds", learned.name}
    with front_of(b, fake) as front:
        assert wait_for(lambda: learned.key in {p.key for p in b.catalog.pieces()})
        redis_server.stop()  # killed mid-run
        plans = [post(front)["usage"]["kvnotes"]["plan"] for _ in range(4)]
        assert all(set(p["skills"]) <= local for p in plans)  # local, checked entries only
        assert plans[-1]["skills"][-1] == learned.name
        assert metric(front, 'kvnotes_front_store_faults_total{reason="down"}') >= 1
        assert metric(front, "kvnotes_front_fleet_local_sightings_total") >= 1
        redis_server.start()  # restarted: picked up again
        client = redis_server.client()
        client.flushall()  # and flushed
        client.close()
        carried[:] = [seats]
        assert wait_for(lambda: (post(front), b.learner.wait_idle(60),
                                 b.learner.counters()["compiles"] == 1)[-1], timeout=30)
        assert [i.name for i in b.store.list(b.model)] == [f"content-{_ident(seats)}"]
        with_seats = {**BODY, "prompt": HEADER + REFUNDS + OTHER + USER}
        b.catalog.refresh(force=True)  # its own compile: found at the catalog's next rescan
        plan = post(front, with_seats)["usage"]["kvnotes"]["plan"]
        assert plan["skills"][-1] == f"content-{_ident(seats)}"  # learned after the faults
    assert b.learner.counters()["failures"] == 0


def _ident(seen: SeenChunk) -> str:
    from kvnotes.serving.learning.sightings import chunk_id

    return chunk_id(None, seen.token_ids).hex()[:8]
