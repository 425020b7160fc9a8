"""Learned skill variants: a (predecessor, skill) pair seen ``after`` times is compiled behind
its predecessor in the background, bounded per skill (least recently used evicted), counted
(spliced, exactly placed) and shown in ``/metrics``. A tiny random llama compiles; the real
SmolLM2 tokenizer encodes."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import httpx2
import pytest
from _front_fakes import BAGGAGE, HEADER, MODEL, REFUNDS, USER
from conftest import make_tiny_engine

from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner, skill_id
from kvnotes.serving.library.manifest import read_entry
from kvnotes.serving.library.registry import LearnedRegistry, registry_path
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.phases import sent_spans
from kvnotes.serving.planning.variant_demand import VariantCandidate, VariantHits, variant_candidates
from kvnotes.serving.skills import ServingSkills

MEALS = ("\nMEALS: a hot meal is served on flights longer than three hours; special meals "
         "are ordered at least two days before departure, and drinks are free on every flight.")
PROMPT = HEADER + REFUNDS + BAGGAGE + USER  # baggage behind refunds: no variant for it yet


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture
def lib(engine, tmp_path):
    lib = ServingSkills(tmp_path, engine)
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE), ("meals", MEALS)):
        lib.add(text, name=name, after=HEADER)
    return lib


def learner_for(lib: ServingSkills, **config: Any) -> Learner:
    return Learner(LearnConfig(**{"after": 2, "min_tokens": 4, **config}), lib)


def planned(lib: ServingSkills, tokenizer, text: str):
    catalog = SkillCatalog(lib.folder, tokenizer, rescan_s=0.0)
    parts = catalog.lay_out(catalog.find(text))
    return parts, [t for p in parts for t in p.token_ids]


def candidates(lib: ServingSkills, tokenizer, text: str) -> list[VariantCandidate]:
    parts, ids = planned(lib, tokenizer, text)
    return variant_candidates(sent_spans(parts), ids)


def test_a_pair_seen_n_times_is_compiled_behind_its_predecessor(lib, tokenizer):
    learner = learner_for(lib, after=2)
    (cand,) = candidates(lib, tokenizer, PROMPT)
    assert (cand.name, cand.predecessor) == ("baggage", "refunds")
    assert list(cand.after) == lib.after_skill("refunds", header=HEADER)
    learner.observe_variants(None, [cand, cand])  # one request, one sighting
    assert learner.run_pending() == 0
    learner.observe_variants("acme", [cand])  # another tenant counts apart
    assert learner.run_pending() == 0
    learner.observe_variants(None, [cand])  # the second: queued, compiled by the worker only
    assert len(learner.registry) == 0
    assert learner.run_pending() == 1
    (entry,) = learner.registry.entries()
    assert (entry.kind, entry.variant_of, entry.behind, entry.tenant) == (
        "variant", "baggage", "refunds", None)
    assert entry.behind_tokens == len(cand.after) and entry.tokens == len(cand.token_ids)
    assert entry.skill == skill_id(None, cand.token_ids)
    assert entry.bytes == lib.entry_path(entry.key).stat().st_size
    piece, _, _ = read_entry(lib.entry_path(entry.key), lib.manifest.fingerprint_obj)
    assert (piece.token_ids, piece.behind, piece.name) == (cand.token_ids, cand.after, "baggage")
    # planned again, the prompt splices the variant exactly placed: no candidate left
    parts, ids = planned(lib, tokenizer, PROMPT)
    chosen = {p.piece.name: p.piece.key for p in parts if p.piece is not None}
    assert chosen["baggage"] == entry.key
    assert variant_candidates(sent_spans(parts), ids) == []
    used, exact = VariantHits().record(parts)
    assert entry.key in used and entry.key in exact
    learner.observe_variants(None, [cand])  # learned: not queued again
    assert learner.run_pending() == 0
    c = learner.counters()
    assert (c["variant_sightings"], c["variant_compiles"], c["compiles"]) == (4, 1, 0)
    assert (c["learned_variants"], c["learned_variant_bytes"]) == (1, entry.bytes)


def _variant_of_meals(lib: ServingSkills, tokenizer, pred: str) -> VariantCandidate:
    after = tuple(lib.after_skill(pred, header=HEADER))
    ids = tuple(encode(tokenizer, MEALS))
    return VariantCandidate(after, "meals", ids, len(after), pred)


def test_the_variant_cap_evicts_the_least_recently_used_learned_variant(lib, tokenizer):
    learner = learner_for(lib, after=1, max_variants=2)
    keys = []
    for pred in ("refunds", "baggage"):
        learner.observe_variants(None, [_variant_of_meals(lib, tokenizer, pred)])
        assert learner.run_pending() == 1
        keys.append(learner.registry.entries()[-1].key)
        time.sleep(0.01)  # distinct last uses
    learner.use([keys[0]])  # the one behind refunds is now the more recently used
    learner.observe_variants(None, [_variant_of_meals(lib, tokenizer, "header")])
    assert learner.run_pending() == 1
    left = {e.key: e.behind for e in learner.registry.entries()}
    assert keys[0] in left and keys[1] not in left and len(left) == 2
    assert not lib.entry_path(keys[1]).exists()
    # the operator's own meals entry is never a learned variant: neither counted nor evicted
    meals = next(g for g in lib.variants() if g.name == "meals" and g.tenant is None)
    assert len(meals.variants) == 3
    assert learner.counters()["evictions"] == 1 and learner.counters()["learned_variants"] == 2


def test_pinned_and_leased_variants_outlive_the_cap(lib, tokenizer):
    learner = learner_for(lib, after=1, max_variants=1)
    learner.observe_variants(None, [_variant_of_meals(lib, tokenizer, "refunds")])
    learner.run_pending()
    (first,) = [e.key for e in learner.registry.entries()]
    learner.registry.pin(first)
    learner.observe_variants(None, [_variant_of_meals(lib, tokenizer, "baggage")])
    learner.run_pending()
    second = next(e.key for e in learner.registry.entries() if e.key != first)
    held = learner.lease([second])
    learner.observe_variants(None, [_variant_of_meals(lib, tokenizer, "header")])
    learner.run_pending()
    keys = {e.key for e in learner.registry.entries()}
    assert {first, second} <= keys and len(keys) == 3  # over the cap: nothing evictable
    learner.release(held)
    skill = learner.registry.get(first).skill
    assert learner.cap_variants(skill) == 2
    assert [e.key for e in learner.registry.of_skill(skill)] == [first]


def test_a_skill_whose_text_does_not_round_trip_is_not_learned(lib, tokenizer):
    learner = learner_for(lib, after=1)
    cand = _variant_of_meals(lib, tokenizer, "refunds")
    split = tuple(encode(tokenizer, " he")) + tuple(encode(tokenizer, "llo"))  # " hello" apart
    assert tuple(encode(tokenizer, " hello")) != split
    odd = VariantCandidate(cand.after, "meals", cand.token_ids + split, cand.start, "refunds")
    before = {p.name for p in lib.folder.iterdir()}
    learner.observe_variants(None, [odd])
    assert learner.run_pending() == 1
    assert learner.counters()["failures"] == 1 and len(learner.registry) == 0
    assert {p.name for p in lib.folder.iterdir()} == before  # nothing left behind
    learner.observe_variants(None, [odd])
    assert learner.run_pending() == 0  # not tried again


def test_hits_count_the_chosen_entry_and_its_exact_placements(lib, tokenizer):
    learner = learner_for(lib, after=1)
    learner.observe_variants(None, candidates(lib, tokenizer, PROMPT))
    learner.run_pending()
    (entry,) = learner.registry.entries()
    parts, _ = planned(lib, tokenizer, PROMPT)
    used, exact = VariantHits().record(parts)
    learner.release(learner.lease([entry.key, "other"], used=used, exact=exact))
    learner.enforce()  # writes the counts
    row = learner.registry.get(entry.key)
    assert (row.hits, row.exact) == (1, 1)


def test_an_older_registry_gains_the_variant_columns(tmp_path):
    path = registry_path(tmp_path)
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE learned (key TEXT PRIMARY KEY, tenant TEXT, name TEXT NOT "
                   "NULL, kind TEXT NOT NULL, tokens INTEGER NOT NULL, bytes INTEGER NOT NULL, "
                   "hits INTEGER NOT NULL DEFAULT 0, last_used REAL NOT NULL, pinned INTEGER "
                   "NOT NULL DEFAULT 0, created REAL NOT NULL)")
        db.execute("INSERT INTO learned VALUES ('k1', 'acme', 'tool-1', 'tool', 4, 40, 3, 1.0, "
                   "0, 1.0)")
    with LearnedRegistry(tmp_path) as reg:
        row = reg.get("k1")
        assert row is not None and (row.hits, row.skill, row.variant_of, row.exact) == (
            3, "", None, 0)
        reg.use({"k1": 1}, exact={"k1": 1})
        assert (reg.get("k1").hits, reg.get("k1").exact) == (4, 1)
        assert reg.variant_totals() == (0, 0)


def test_max_variants_is_checked():
    with pytest.raises(InvalidArgumentError, match="max_variants"):
        LearnConfig(max_variants=0)


def test_the_front_learns_a_variant_and_reports_its_hits(fake, lib, tokenizer):
    learner = learner_for(lib, after=2)
    catalog = SkillCatalog(lib.folder, tokenizer, rescan_s=0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    parts, _ = planned(lib, tokenizer, PROMPT)
    start = next(s.start for s in sent_spans(parts) if s.name == "baggage")
    with Front(FrontConfig(upstream=fake.url), catalog, learner) as front:
        for _ in range(2):
            resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=30)
            assert resp.is_success
            plan = resp.json()["usage"]["kvnotes"]["plan"]
            assert "baggage" not in plan["exactly_placed"]
            assert any(a <= start < b for a, b in plan["regions"])  # its first tokens repaired
        assert learner.wait_idle(120)
        (entry,) = learner.registry.entries()
        assert (entry.variant_of, entry.behind) == ("baggage", "refunds")
        resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=30)
        plan = resp.json()["usage"]["kvnotes"]["plan"]
        assert "baggage" in plan["exactly_placed"]
        assert not any(a <= start < b for a, b in plan["regions"])  # nothing of it repaired
        metrics = httpx2.get(front.url + "/metrics", timeout=30).text
    label = 'owner="learned"'  # summed by owner: no entry's key or name is a label
    assert f"kvnotes_front_variant_spliced_total{{{label}}} 1.0" in metrics
    assert f"kvnotes_front_variant_exact_total{{{label}}} 1.0" in metrics
    assert f"kvnotes_front_variant_bytes{{{label}}} {float(entry.bytes)}" in metrics
    assert entry.key not in metrics and "baggage" not in metrics
    assert "kvnotes_front_learn_variant_compiles_total 1.0" in metrics
    assert "kvnotes_front_learned_variants 1.0" in metrics
    row = learner.registry.get(entry.key)
    assert (row.hits, row.exact) == (1, 1)  # written when the learner stopped


def test_the_common_prefix_by_bisection_is_the_tokenwise_one():
    import random

    from kvnotes.serving.planning.variant_demand import _common_prefix

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 20))]
        b = [rng.randint(0, 2) for _ in range(rng.randint(0, 20))]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert _common_prefix(a, b) == n
