"""No request waits on the learner's disk work: with a compile or an eviction's delete held
open, the request path's calls (:meth:`Learner.observe`, ``observe_variants``, ``lease``,
``release``, ``use``, ``counters``) return from another thread; and they read no file and no
registry row at all."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _learning_fakes import FakeSkills, seen, stored

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.library.registry import LearnedRegistry
from kvnotes.serving.planning.variant_demand import VariantCandidate

BOUND_S = 5.0  # far above an in-memory call; far below the 60 s the held work waits


def returns_while_held(calls: Callable[[], None]) -> None:
    """Run ``calls`` on another thread; it must finish within ``BOUND_S``."""
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            calls()
        except BaseException as err:  # noqa: BLE001 -- reported below
            errors.append(err)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="request").start()
    assert done.wait(BOUND_S), "a request-path call waited on the learner's disk work"
    assert not errors, errors


def a_request(learner: Learner, *keys: str) -> Callable[[], None]:
    def calls() -> None:
        learner.observe("acme", [seen("a tool the tenant sends"), seen("first tool")])
        learner.observe_variants(None, [VariantCandidate((1, 2), "s", (3, 4, 5), 2, "p")])
        held = learner.lease(keys, used=keys[:1], exact=keys[:1])
        learner.use(keys)
        assert all(learner.leased(k) for k in keys)
        learner.release(held)
        assert learner.counters()["sightings"] >= 2

    return calls


def test_a_request_is_never_blocked_by_a_delete(tmp_path, monkeypatch):
    skills = FakeSkills(tmp_path)
    registry = LearnedRegistry(tmp_path)
    stored(tmp_path, registry, "old", last_used=1.0)
    stored(tmp_path, registry, "new", last_used=2.0)
    learner = Learner(LearnConfig(after=1, min_tokens=1, library_cap=150), skills, registry)
    gate, deleting = threading.Event(), threading.Event()
    unlink = Path.unlink

    def held_unlink(self: Path, missing_ok: bool = False) -> None:
        if self.suffix == ".safetensors":
            deleting.set()
            assert gate.wait(60)
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", held_unlink)
    evicted: list[int] = []
    evicting = threading.Thread(target=lambda: evicted.append(learner.enforce()))
    evicting.start()
    try:
        assert deleting.wait(30), "the cap chose no victim"
        returns_while_held(a_request(learner, "new", "old"))
    finally:
        gate.set()
        evicting.join(30)
    assert evicted == [1]
    assert "old" not in registry and not (tmp_path / "old.safetensors").exists()
    assert "new" in registry


def test_a_request_is_never_blocked_by_a_compile(tmp_path):
    skills = FakeSkills(tmp_path)
    skills.gate = threading.Event()
    learner = Learner(LearnConfig(after=1, min_tokens=1, library_cap=150), skills).start()
    try:
        learner.observe(None, [seen("first tool")])
        assert skills.entered.wait(30), "the worker started no compile"
        returns_while_held(a_request(learner, "some-key"))
        skills.gate.set()
        assert learner.wait_idle(30)
    finally:
        skills.gate.set()
        learner.stop()
    # the chunks seen while it compiled were learned after it; the cap keeps one of 100 bytes
    counts = learner.counters()
    assert (counts["compiles"], counts["variant_compiles"], counts["failures"]) == (3, 1, 0)
    assert len(learner.registry) == 1 and learner.registry.total_bytes() == 100


class _Spy:
    """Wraps the registry's connection: records the threads that touch it."""

    def __init__(self, db: Any, seen_by: set[str]) -> None:
        self._db, self._seen_by = db, seen_by

    def __getattr__(self, name: str) -> Any:
        self._seen_by.add(threading.current_thread().name)
        return getattr(self._db, name)


def test_the_request_path_reads_no_file_and_no_registry_row(tmp_path, monkeypatch):
    skills = FakeSkills(tmp_path)
    learner = Learner(LearnConfig(after=1, min_tokens=1), skills)
    learner.observe("acme", [seen("first tool")])
    assert learner.run_pending() == 1
    (entry,) = learner.registry.entries()
    touched: set[str] = set()
    stat, open_ = os.stat, open

    def spy_stat(path: Any, *a: Any, **kw: Any) -> Any:
        touched.add(threading.current_thread().name)
        return stat(path, *a, **kw)

    def spy_open(*a: Any, **kw: Any) -> Any:
        touched.add(threading.current_thread().name)
        return open_(*a, **kw)

    monkeypatch.setattr(os, "stat", spy_stat)
    monkeypatch.setattr("builtins.open", spy_open)
    monkeypatch.setattr(learner.registry, "_db", _Spy(learner.registry._db, touched))
    # a learned chunk seen again (its entry checked in memory), a new one, leases and uses
    returns_while_held(a_request(learner, entry.key))
    assert "request" not in touched
    monkeypatch.undo()
    assert learner.worker.pending() == 2  # the new chunk and the variant; the learned one not
