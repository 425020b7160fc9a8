"""Sightings and compile leases are interfaces (:class:`SightingCounter`,
:class:`CompileLease`): two learners (two hosts' fronts, each with its own folder) handed one
shared counter and one shared set of leases count a chunk together and compile it once."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from _learning_fakes import FakeSkills, seen

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import (
    CompileLease,
    Learner,
    LocalCompileLeases,
    LocalSightings,
    SightingCounter,
    Sightings,
    chunk_id,
)


class SharedCounter:
    """A :class:`SightingCounter` that several learners share (a store's stand-in)."""

    def __init__(self) -> None:
        self.counts: dict[bytes, int] = {}
        self.calls: list[list[bytes]] = []  # each call's identities
        self._lock = threading.Lock()

    def sight(self, ident: bytes) -> int:
        return self.sight_all([ident])[0]

    def sight_all(self, idents: Sequence[bytes]) -> list[int]:
        with self._lock:
            self.calls.append(list(idents))
            for ident in idents:
                self.counts[ident] = self.counts.get(ident, 0) + 1
            return [self.counts[ident] for ident in idents]

    def clear(self, ident: bytes) -> None:
        with self._lock:
            self.counts.pop(ident, None)


def test_the_local_pieces_are_the_interfaces():
    counter: SightingCounter = LocalSightings(8)
    leases: CompileLease = LocalCompileLeases()
    assert counter.sight(b"x") == 1 and leases.take(b"x")
    assert counter.sight_all([b"y", b"x", b"y"]) == [1, 2, 2] and counter.sight_all([]) == []


def test_a_requests_chunks_are_counted_in_one_call_and_the_same_ones_come_due(tmp_path):
    counter = SharedCounter()
    learner = Learner(LearnConfig(after=2, min_tokens=3), FakeSkills(tmp_path / "a"),
                      sightings=counter)
    tools = [seen(f"tool number {i}") for i in range(20)]
    learner.observe("acme", tools[:5])
    assert counter.calls == [[chunk_id("acme", t.token_ids) for t in tools[:5]]]
    learner.observe("acme", [*tools, seen("ab"), tools[3]])  # short and repeated: not counted
    assert counter.calls[1] == [chunk_id("acme", t.token_ids) for t in tools]
    assert learner.worker.pending() == 5 and learner.counters()["sightings"] == 25
    assert learner.run_pending() == 5 and len(learner.registry) == 5  # the five seen twice
    assert [learner.sightings.known(chunk_id("acme", t.token_ids)) is not None
            for t in tools[:6]] == [True] * 5 + [False]
    learner.observe("acme", tools[:6])  # learned ones are not counted: one call for the sixth
    assert counter.calls[2] == [chunk_id("acme", tools[5].token_ids)]
    assert learner.worker.pending() == 1
    learner.observe("acme", tools[:5])  # nothing left to count: no call at all
    assert len(counter.calls) == 3


def test_two_learners_count_together_and_compile_once(tmp_path):
    counter, leases = SharedCounter(), LocalCompileLeases()
    config = LearnConfig(after=2, min_tokens=1)
    a, b = (Learner(config, FakeSkills(tmp_path / name), sightings=counter,
                    compile_leases=leases) for name in ("a", "b"))
    tool = seen("a tool both hosts see")
    a.observe("acme", [tool])
    assert a.worker.pending() == 0  # one sighting in all
    b.observe("acme", [tool])  # the second, on the other host: due there
    assert (a.worker.pending(), b.worker.pending()) == (0, 1)
    a.observe("acme", [tool])  # due here too, but b holds its compile
    assert a.worker.pending() == 0
    assert b.run_pending() == 1 and len(b.registry) == 1
    assert counter.counts == {}  # compiled: counted from scratch
    assert b.sightings.known(chunk_id("acme", tool.token_ids)) == b.registry.entries()[0].key


def test_one_request_is_one_sighting_and_short_chunks_are_not_counted():
    sightings = Sightings(after=2, min_tokens=3, max_tracked=10)
    long, short = seen("abcd"), seen("ab")
    jobs = sightings.chunk_jobs("acme", [long, long, short])
    assert [j.ident for j in jobs] == [chunk_id("acme", long.token_ids)]
    assert not sightings.due(jobs[0], lambda key: False)
    assert sightings.due(jobs[0], lambda key: False)  # the second request's
    sightings.learned(jobs[0].ident, "k1")
    assert not sightings.due(jobs[0], lambda key: True)  # learned, still held
    assert not sightings.due(jobs[0], lambda key: False)  # gone: counted from scratch (1)
    assert sightings.known(jobs[0].ident) is None
