"""The learned library's bounds (:mod:`kvnotes.serving.learning.learned_bounds`,
:mod:`kvnotes.serving.library.eviction`): victims chosen in memory, costing what they evict; no
compile scans the registry or the folder; the index follows the registry lazily (another
process's writes, files deleted by hand)."""

from __future__ import annotations

import random
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from _learning_fakes import FakeSkills, seen, stored

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Bounds, LearnedIndex, Learner
from kvnotes.serving.library.eviction import cap_order, cap_walk
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry


def entry(key: str, tenant: str | None = None, nbytes: int = 10, last_used: float = 0.0,
          **kw: object) -> LearnedEntry:
    return LearnedEntry(key, tenant, key, "tool", 1, nbytes, last_used=last_used,
                        **kw)  # type: ignore[arg-type]


# ---- the cap's order ---------------------------------------------------------------------------
def reference_cap_order(candidates: Sequence[LearnedEntry], cap: int, quota: int | None
                        ) -> list[LearnedEntry]:
    """The cap's order written as a whole sort over a list (the rule, read plainly)."""
    held: dict[str | None, int] = defaultdict(int)
    for e in candidates:
        held[e.tenant] += e.bytes
    tenants = [t for t, n in held.items() if n > 0]
    share = cap / max(1, len(tenants))
    if quota is not None:
        share = min(share, quota)
    queues: dict[str | None, deque[LearnedEntry]] = defaultdict(deque)
    for e in candidates:
        queues[e.tenant].append(e)
    order: list[LearnedEntry] = []
    rest = deque(candidates)
    while len(order) < len(candidates):
        over = [(held[t] - share, t) for t, q in queues.items() if q and held[t] > share]
        if over:
            e = queues[max(over, key=lambda x: x[0])[1]].popleft()
        else:
            while rest[0] in order:
                rest.popleft()
            e = rest.popleft()
            queues[e.tenant].remove(e)
        held[e.tenant] -= e.bytes
        order.append(e)
    return order


def test_the_lazy_cap_walk_is_the_cap_order():
    rng = random.Random(7)
    for _ in range(300):
        es = [entry(f"k{i}", rng.choice(["a", "b", "c", None]), rng.randint(1, 30))
              for i in range(rng.randint(0, 25))]
        cap, quota = rng.randint(1, 200), rng.choice([None, rng.randint(1, 100)])
        assert [e.key for e in cap_order(es, cap, quota)] == \
            [e.key for e in reference_cap_order(es, cap, quota)]


def test_the_cap_walk_reads_only_as_far_as_it_evicts():
    read = []

    def lazily(es: list[LearnedEntry]) -> Iterator[LearnedEntry]:
        for e in es:
            read.append(e.key)
            yield e

    es = [entry(f"k{i}", "a") for i in range(1000)]
    walk = cap_walk({"a": lazily(es)}, lazily(es), {"a": 10_000}, cap=9_970, quota=None)
    assert [next(walk).key for _ in range(3)] == ["k0", "k1", "k2"]
    assert len(read) <= 8


# ---- the index and the victims -----------------------------------------------------------------
def test_the_index_keeps_its_totals_and_order():
    idx = LearnedIndex([entry("b", "x", 20, 2.0), entry("a", "x", 10, 1.0),
                        entry("v", None, 5, 3.0, variant_of="s")])
    assert (idx.total, idx.held("x"), idx.variants, idx.variant_bytes) == (35, 30, 1, 5)
    assert [e.key for e in idx.evictable()] == ["a", "b", "v"]
    idx.touch({"a": 2}, {"a": 1}, when=9.0)
    assert [e.key for e in idx.evictable()] == ["b", "v", "a"]
    got = idx.get("a")
    assert got is not None and (got.hits, got.exact, got.last_used) == (2, 1, 9.0)
    assert idx.remove("b") is not None and idx.remove("b") is None
    assert (idx.total, idx.held("x"), len(idx)) == (15, 10, 2)
    idx.remove("a")
    assert idx.tenants() == [None] and idx.held("x") == 0


def test_victims_skip_the_pinned_and_the_leased_and_leave_the_index():
    bounds = Bounds(LearnedIndex([entry("p", "x", last_used=1.0, pinned=True),
                                  entry("l", "x", last_used=2.0), entry("o", "x", last_used=3.0),
                                  entry("n", "x", last_used=4.0)]))
    held = bounds.lease(["l"])
    assert [e.key for e in bounds.over_quota("x", quota=25)] == ["o", "n"]
    assert not bounds.holds("o") and bounds.holds("l") and bounds.totals()[0] == 20
    assert not bounds.claim("l")  # leased
    bounds.release(held)
    assert bounds.claim("l") and bounds.totals()[:2] == (10, 1)
    victim = entry("r", "x")
    bounds.lease(["r"])
    assert bounds.reprieve(victim) and bounds.holds("r")  # leased since its choice: kept


def test_the_variant_cap_keeps_the_newest_and_the_kept():
    es = [entry(f"v{i}", None, last_used=float(i), skill="s") for i in range(4)]
    bounds = Bounds(LearnedIndex(es))
    assert [e.key for e in bounds.over_variants("s", 2, keep="v0")] == ["v1", "v2"]
    assert [e.key for e in bounds.of_skill("s")] == ["v0", "v3"]


# ---- no scan per compile -------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [3, 40])
def test_a_compile_reads_no_other_row_and_no_other_file(tmp_path, monkeypatch, rows):
    skills = FakeSkills(tmp_path)
    registry = LearnedRegistry(tmp_path)
    for i in range(rows):
        stored(tmp_path, registry, f"row{i:03d}", "acme", last_used=float(i + 1))
    learner = Learner(LearnConfig(after=1, min_tokens=1, library_cap=100 * rows), skills,
                      registry)
    for name in ("entries", "evictable", "total_bytes", "of_skill", "variant_totals"):
        monkeypatch.setattr(registry, name, lambda *a, _n=name, **k: pytest.fail(f"{_n}()"))
    checked: list[str] = []
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: checked.append(p.stem) or is_file(p))
    learner.observe("acme", [seen("one more tool")])
    assert learner.run_pending() == 1
    assert learner.counters()["failures"] == 0
    # the cap evicted the least recently used; only the new entry's and that victim's files
    # were looked at, however many rows there are
    assert "row000" not in registry and len(registry) == rows
    new = skills.path_for("one more tool", after=seen("x").after_ids, tenant="acme").stem
    assert sorted(set(checked)) == sorted({new, "row000"})


# ---- the index follows the registry --------------------------------------------------------------
def test_a_pin_from_another_process_is_read_at_the_next_upkeep(tmp_path):
    registry = LearnedRegistry(tmp_path)
    for i in range(3):
        stored(tmp_path, registry, f"k{i}", last_used=float(i + 1))
    learner = Learner(LearnConfig(library_cap=200), FakeSkills(tmp_path), registry)
    assert not learner.reload(only_if_changed=True)  # nothing written elsewhere
    with LearnedRegistry(tmp_path) as cli:  # kvnotes skills pin, another connection
        cli.pin("k0")
    learner.upkeep()
    assert learner.bounds.over_cap(200, None)[0].key == "k1"  # k0 is pinned in memory too


def test_a_pin_the_index_missed_still_saves_its_entry(tmp_path):
    registry = LearnedRegistry(tmp_path)
    for i in range(3):
        stored(tmp_path, registry, f"k{i}", last_used=float(i + 1))
    learner = Learner(LearnConfig(library_cap=200), FakeSkills(tmp_path), registry)
    registry.pin("k0")  # this very connection: no reload sees it; the victim's row does
    assert learner.enforce() == 1
    assert sorted(e.key for e in registry.entries()) == ["k0", "k2"]
    assert learner.counters()["learned_bytes"] == 200


def test_the_sweep_checks_a_bounded_batch_round_robin(tmp_path):
    registry = LearnedRegistry(tmp_path)
    for i in range(5):
        stored(tmp_path, registry, f"k{i}", last_used=float(i + 1))
    learner = Learner(LearnConfig(), FakeSkills(tmp_path), registry)
    for key in ("k1", "k4"):
        (tmp_path / f"{key}.safetensors").unlink()
    assert [learner.sweep(2), learner.sweep(2), learner.sweep(2)] == [1, 0, 1]
    assert sorted(e.key for e in registry.entries()) == ["k0", "k2", "k3"]
    assert learner.counters()["learned_entries"] == 3


def test_the_worker_keeps_the_index_in_step_on_its_own(tmp_path):
    registry = LearnedRegistry(tmp_path)
    for i in range(3):
        stored(tmp_path, registry, f"k{i}", last_used=float(i + 1))
    learner = Learner(LearnConfig(flush_s=0.05), FakeSkills(tmp_path), registry).start()
    try:
        (tmp_path / "k1.safetensors").unlink()  # by hand
        with LearnedRegistry(tmp_path) as cli:  # kvnotes skills pin, another process
            cli.pin("k2")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            index = {e.key: e.pinned for e in learner.bounds.to_verify(None)}
            if index == {"k0": False, "k2": True}:
                break
            time.sleep(0.02)
        assert index == {"k0": False, "k2": True}
    finally:
        learner.stop()
    assert sorted(e.key for e in registry.entries()) == ["k0", "k2"]


# ---- the front's per-entry state follows the index -----------------------------------------------
def test_evicted_and_forgotten_entries_leave_the_known_map_and_the_hit_counts(tmp_path):
    from kvnotes.serving.learning.sightings import chunk_id
    from kvnotes.serving.planning.variant_demand import VariantHits

    skills = FakeSkills(tmp_path, nbytes=100)
    learner = Learner(LearnConfig(after=1, min_tokens=4, library_cap=400), skills)
    hits = VariantHits()
    learner.on_gone(lambda keys: hits.forget(*keys))
    chunks = [seen(f"tool number {i:02d}") for i in range(40)]
    for chunk in chunks:
        learner.observe(None, [chunk])
        assert learner.run_pending() == 1
        with hits._lock:  # each entry spliced once, as the front counts it
            key = skills.path_for(chunk.text, after=chunk.after_ids).stem
            hits.used[key], hits.names[key] = 1, "tool"
    held = {e.key for e in learner.registry.entries()}
    assert len(held) == 4 and learner.counters()["evictions"] == 36
    known = {learner.sightings.known(chunk_id(None, c.token_ids)) for c in chunks}
    assert known - {None} == held  # the 36 evicted are no longer known, at once
    assert {row[0] for row in hits.rows()} == held  # nor counted, with no scrape
    with LearnedRegistry(tmp_path) as cli:  # kvnotes skills forget, another process
        gone = sorted(held)[0]
        cli.remove(gone)
    (tmp_path / f"{gone}.safetensors").unlink()
    learner.upkeep()
    assert {row[0] for row in hits.rows()} == held - {gone}
    assert gone not in {learner.sightings.known(chunk_id(None, c.token_ids)) for c in chunks}
    swept = sorted(held - {gone})[0]
    (tmp_path / f"{swept}.safetensors").unlink()  # by hand: the sweep finds it
    assert learner.sweep() == 1
    assert {row[0] for row in hits.rows()} == held - {gone, swept}
    assert len(learner.sightings._known) == 2 == len(learner.sightings._idents)
