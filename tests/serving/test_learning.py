"""Learning on sight: tenancy of entries, the learned registry, the learner's bounds, and the
front's wiring (against a fake vLLM). A tiny random llama compiles; the real SmolLM2 tokenizer
encodes."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest
from _front_fakes import BAGGAGE, HEADER, MODEL, REFUNDS, USER
from conftest import make_tiny_engine
from test_connector_writer import fake_layer, share

import kvnotes
import kvnotes.serving.front.service as service_module
from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.config import LearnConfig, parse_size
from kvnotes.serving.learning import Learner
from kvnotes.serving.library.manifest import entry_paths, read_entry
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.registry import (
    LearnedEntry,
    LearnedRegistry,
    forget,
    registry_path,
)
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, SpliceRange, leading_run
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.protocol import SpliceRequest
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.vllm.kv_writer import KvWriter
from kvnotes.serving.vllm.plans import SplicePlanner

TOOL_A = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather '
          'for a city today", "parameters": {"city": "string"}}}')
TOOL_B = ('{"type": "function", "function": {"name": "book_table", "description": "Book a '
          'table at a restaurant", "parameters": {"name": "string", "people": "integer"}}}')


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture
def lib(engine, tmp_path):
    return ServingSkills(tmp_path, engine)


def chunk(tokenizer, text: str, after: str = HEADER, kind: str = "tool") -> SeenChunk:
    return SeenChunk(kind, text, tuple(encode(tokenizer, text)), tuple(encode(tokenizer, after)))


def learner_for(lib: ServingSkills, **config: Any) -> Learner:
    return Learner(LearnConfig(**{"after": 2, "min_tokens": 4, **config}), lib)


# ---- tenancy of entries --------------------------------------------------------------------------
def test_an_entrys_key_holds_its_tenant_and_its_prefix(lib, tokenizer):
    after = list(encode(tokenizer, HEADER))
    shared = lib.add(TOOL_A, name="a", after=after)
    acme = lib.add(TOOL_A, name="a", after=after, tenant="acme")
    globex = lib.add(TOOL_A, name="a", after=after, tenant="globex")
    elsewhere = lib.add(TOOL_A, name="a", after=after + [13], tenant="acme")
    assert len({shared.key, acme.key, globex.key, elsewhere.key}) == 4
    assert lib.add(TOOL_A, name="again", after=after, tenant="acme").key == acme.key  # one entry
    assert len(entry_paths(lib.folder)) == 4
    piece, _, _ = read_entry(lib.entry_path(acme.key), lib.manifest.fingerprint_obj)
    assert (piece.tenant, piece.behind) == ("acme", tuple(after))
    assert (acme.tenant, acme.behind) == ("acme", tuple(after))
    store = PieceStore(lib.folder)
    assert {p.key: p.tenant for p in store.index.pieces()}[globex.key] == "globex"
    with pytest.raises(InvalidArgumentError, match="tenant"):
        lib.add(TOOL_A, tenant="no spaces")


def tenant_pieces() -> tuple[PieceIndex, list[int], PieceInfo, PieceInfo]:
    idx = PieceIndex()
    shared = PieceInfo("shared", "header", tuple(range(100, 120)), 0)
    acme = PieceInfo("acme-tool", "tool", tuple(range(200, 240)), 20, tenant="acme")
    for p in (shared, acme):
        idx.add(p)
    return idx, list(shared.token_ids + acme.token_ids) + [1, 2, 3], shared, acme


def test_a_tenant_never_splices_another_tenants_entry():
    """The connector's scheduler side: the run stops before another tenant's piece, with or
    without splice ranges, even when handed an index that holds it."""
    idx, prompt, shared, acme = tenant_pieces()
    planner = SplicePlanner(block_size=16)
    assert planner.match("own", "acme", prompt, 0, idx) == 60
    assert planner.match("other", "globex", prompt, 0, idx) == 20  # the shared header only
    assert planner.match("shared", None, prompt, 0, idx) == 20
    ranges = SpliceRequest((SpliceRange(0, 0, 20), SpliceRange(20, 20, 60)))
    assert planner.match("own-r", "acme", prompt, 0, idx, ranges) == 60
    assert planner.match("other-r", "globex", prompt, 16, idx, ranges) == 4
    planner.allocated("other-r", [0, 1, 2, 3], 4)
    (load,) = planner.take({"other-r": 1})
    assert [p.piece.key for p in load.run] == ["shared"]


def test_the_store_gives_each_tenant_its_view(lib, tokenizer):
    after = list(encode(tokenizer, HEADER))
    lib.add(HEADER, name="header")
    acme = lib.add(TOOL_A, name="a", after=after, tenant="acme")
    store = PieceStore(lib.folder, rescan_s=0)
    ids = list(encode(tokenizer, HEADER)) + list(acme.token_ids) + [5]
    assert [p.piece.name for p in leading_run(ids, store.view("acme"))] == ["header", "a"]
    assert [p.piece.name for p in leading_run(ids, store.view("globex"))] == ["header"]
    assert [p.piece.name for p in leading_run(ids, store.view(None))] == ["header"]
    globex = lib.add(TOOL_A, name="a", after=after, tenant="globex")  # the views follow
    store.refresh(force=True)
    assert leading_run(ids, store.view("globex"))[-1].piece.key == globex.key
    assert globex.key not in store.view("acme") and acme.key in store.view("acme")
    lib.entry_path(acme.key).unlink()
    store.refresh(force=True)
    assert acme.key not in store.view("acme")


def test_the_catalog_shows_a_tenant_the_shared_entries_and_its_own(lib, tokenizer):
    lib.add(REFUNDS, name="refunds")
    lib.add(BAGGAGE, name="baggage", tenant="acme")
    catalog = SkillCatalog(lib.folder, tokenizer)
    text = HEADER + REFUNDS + BAGGAGE + USER
    found = {t: [p.skill.name for p in catalog.find(text, t) if p.skill] for t in
             (None, "acme", "globex")}
    assert found == {None: ["refunds"], "acme": ["refunds", "baggage"], "globex": ["refunds"]}
    parts = catalog.lay_out(catalog.find(text, "acme"), tenant="acme")
    assert [p.piece.name for p in parts if p.piece] == ["refunds", "baggage"]
    # a layout checked against another tenant's view drops what that tenant cannot see
    parts = catalog.lay_out(catalog.find(text, "acme"), tenant="globex")
    assert [p.piece.name for p in parts if p.piece] == ["refunds"]
    assert catalog.keys_of(encode(tokenizer, BAGGAGE), "globex") == []
    assert len(catalog.keys_of(encode(tokenizer, BAGGAGE), "acme")) == 1


# ---- the registry --------------------------------------------------------------------------------
def test_the_registry_counts_pins_and_orders_by_last_use(tmp_path):
    with LearnedRegistry(tmp_path) as reg:
        reg.record(LearnedEntry("aaaaaa1", "acme", "tool-1", "tool", 40, 1000, last_used=10.0))
        reg.record(LearnedEntry("bbbbbb2", "acme", "tool-2", "tool", 50, 2000, last_used=20.0))
        reg.record(LearnedEntry("cccccc3", None, "content-3", "content", 60, 3000,
                                last_used=5.0))
        reg.use({"aaaaaa1": 3}, when=30.0)
        assert reg.get("aaaaaa1") is not None and reg.get("aaaaaa1").hits == 3
        assert [e.key for e in reg.evictable()] == ["cccccc3", "bbbbbb2", "aaaaaa1"]
        assert reg.pin("cccccc3") and not reg.pin("nope")
        assert [e.key for e in reg.evictable()] == ["bbbbbb2", "aaaaaa1"]
        assert [e.key for e in reg.evictable("acme", every=False)] == ["bbbbbb2", "aaaaaa1"]
        assert reg.total_bytes() == 6000 and reg.total_bytes("acme", every=False) == 3000
        assert reg.total_bytes(None, every=False) == 3000
        assert reg.resolve("bbbbbb") == "bbbbbb2"
        with pytest.raises(InvalidArgumentError, match="no learned entry"):
            reg.resolve("dddddd")
        assert reg.remove("bbbbbb2") and len(reg) == 2
    with sqlite3.connect(registry_path(tmp_path)) as db:  # WAL: readers beside a writer
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


_WRITER = """
import sys
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry
folder, start = sys.argv[1], int(sys.argv[2])
with LearnedRegistry(folder) as reg:
    for i in range(start, start + 50):
        reg.record(LearnedEntry(f"k{i:06d}", None, "t", "tool", 1, 1))
        reg.use({"shared": 1})
"""


def test_two_processes_write_the_registry_at_once(tmp_path):
    """The front and the command line touch one registry: neither fails nor loses a write."""
    with LearnedRegistry(tmp_path) as reg:
        reg.record(LearnedEntry("shared", None, "t", "tool", 1, 1))
    env = {**os.environ, "PYTHONPATH": str(Path(kvnotes.__file__).parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(s)], env=env)
             for s in (0, 50)]
    assert [p.wait(120) for p in procs] == [0, 0]
    with LearnedRegistry(tmp_path) as reg:
        assert len(reg) == 101
        assert reg.get("shared").hits == 100


# ---- the learner ---------------------------------------------------------------------------------
def test_a_chunk_is_compiled_at_its_nth_sighting_and_never_on_observe(lib, tokenizer):
    learner = learner_for(lib, after=3)
    a, short = chunk(tokenizer, TOOL_A), chunk(tokenizer, "hi there")
    learner.observe("acme", [a, a, short])  # one sighting per request; short ones ignored
    learner.observe("acme", [a])
    assert learner.run_pending() == 0 and entry_paths(lib.folder) == []
    learner.observe("globex", [a])  # another tenant counts apart
    learner.observe("acme", [a])  # the third: queued, not compiled here
    assert entry_paths(lib.folder) == []
    assert learner.run_pending() == 1
    (entry,) = learner.registry.entries()
    assert (entry.tenant, entry.kind, entry.tokens) == ("acme", "tool", len(a))
    assert entry.name.startswith("tool-") and entry.bytes == lib.entry_path(entry.key).stat().st_size
    piece, _, _ = read_entry(lib.entry_path(entry.key), lib.manifest.fingerprint_obj)
    assert (piece.token_ids, piece.behind, piece.tenant) == (a.token_ids, a.after_ids, "acme")
    learner.observe("acme", [a])  # learned: not queued again
    assert learner.run_pending() == 0
    assert learner.counters()["compiles"] == 1 and learner.counters()["sightings"] == 5


def test_a_full_queue_drops_the_job_and_a_later_sighting_queues_it_again(lib, tokenizer):
    learner = learner_for(lib, after=1, queue_size=1)
    learner.observe(None, [chunk(tokenizer, TOOL_A), chunk(tokenizer, TOOL_B)])
    assert learner.counters()["dropped"] == 1
    assert learner.run_pending() == 1
    learner.observe(None, [chunk(tokenizer, TOOL_B)])
    assert learner.run_pending() == 1 and len(learner.registry) == 2


def test_the_operators_own_entry_is_never_taken_for_a_learned_one(lib, tokenizer):
    lib.add(TOOL_A, name="weather", after=list(encode(tokenizer, HEADER)))
    learner = learner_for(lib, after=1, library_cap=1)
    learner.observe(None, [chunk(tokenizer, TOOL_A)])
    learner.run_pending()
    assert len(learner.registry) == 0 and len(entry_paths(lib.folder)) == 1


def test_the_worker_thread_learns_in_the_background(lib, tokenizer):
    learner = learner_for(lib, after=1).start()
    try:
        learner.observe("acme", [chunk(tokenizer, TOOL_A)])
        assert learner.wait_idle(120)
    finally:
        learner.stop()
    assert len(learner.registry) == 1


def learned(learner: Learner, tokenizer, *texts: str, tenant: str | None = None) -> list[str]:
    keys = []
    for text in texts:
        learner.observe(tenant, [chunk(tokenizer, text, kind="content")])
        learner.run_pending()
        keys.append(learner.registry.entries()[-1].key)
        time.sleep(0.01)  # distinct last uses
    return keys


def test_the_library_cap_evicts_the_least_recently_used(lib, tokenizer):
    learner = learner_for(lib, after=1)
    a, b = learned(learner, tokenizer, TOOL_A, TOOL_B)
    size = learner.registry.total_bytes()
    learner.config = LearnConfig(after=1, min_tokens=4, library_cap=size - 1)
    learner.use([a])  # a is now the more recently used
    assert learner.enforce() == 1
    assert [e.key for e in learner.registry.entries()] == [a]
    assert not lib.entry_path(b).exists() and lib.entry_path(a).exists()
    assert learner.counters()["evictions"] == 1
    assert learner.counters()["learned_bytes"] == learner.registry.total_bytes()
    # evicted, the chunk is learned again when it keeps coming
    learner.observe(None, [chunk(tokenizer, TOOL_B, kind="content")])
    assert learner.run_pending() == 1


def test_pinned_and_leased_entries_are_never_evicted(lib, tokenizer):
    learner = learner_for(lib, after=1)
    a, b = learned(learner, tokenizer, TOOL_A, TOOL_B)
    learner.config = LearnConfig(after=1, min_tokens=4, library_cap=1)
    learner.registry.pin(a)
    held = learner.lease([b])
    assert learner.enforce() == 0 and len(learner.registry) == 2
    learner.release(held)
    assert learner.enforce() == 1
    assert [e.key for e in learner.registry.entries()] == [a]


def test_a_tenants_quota_evicts_only_its_own(lib, tokenizer):
    learner = learner_for(lib, after=1)
    (other,) = learned(learner, tokenizer, TOOL_A, tenant="globex")
    first, _ = learned(learner, tokenizer, TOOL_A, TOOL_B, tenant="acme")
    quota = max(e.bytes for e in learner.registry.entries()) + 1
    learner.config = LearnConfig(after=1, min_tokens=4, tenant_quota=quota)
    assert learner.enforce("acme") == 1
    keys = {e.key for e in learner.registry.entries()}
    assert first not in keys and other in keys and len(keys) == 2


def test_an_entry_evicted_after_planning_fails_its_load_and_is_recomputed(lib, tokenizer,
                                                                         caplog):
    """Never wrong: a request planned with an entry the learner then evicts gets its blocks
    reported for recompute (vLLM's ``recompute`` policy prefills them), and the next
    rescan plans no request with it."""
    learner = learner_for(lib, after=1)
    (key,) = learned(learner, tokenizer, TOOL_A)
    store = PieceStore(lib.folder, rescan_s=0)
    piece = store.index.get(key)
    assert piece is not None
    ids = list(piece.behind) + list(piece.token_ids) + [9]
    planner = SplicePlanner(block_size=16)
    start = len(piece.behind)
    ranges = SpliceRequest((SpliceRange(start, start, start + len(piece)),))
    assert planner.match("r", None, ids, 0, store.view(None), ranges) == 0  # no hit in it
    n = planner.match("r", None, ids, start, store.view(None), ranges)  # the prefix is cached
    assert n == len(piece)
    planner.allocated("r", list(range(8)), n)
    (load,) = planner.take({"r": 1})
    assert learner.evict(key)  # between planning and loading
    m = store.manifest
    writer = KvWriter(lib.folder, m, share(m))
    layers = [(i, fake_layer(m.num_kv_heads, m.head_dim)) for i in range(m.num_layers)]
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        failed = writer.write([load], layers)
    assert failed == set(load.written_blocks) and "recomputed" in caplog.text
    assert all(not layer.impl.calls for _, layer in layers)  # nothing written from it
    store.refresh(force=True)
    assert key not in store.view(None)
    assert planner.match("r2", None, ids, start, store.view(None), ranges) == 0


def test_learn_config_checks_and_sizes():
    assert parse_size("256MiB") == 256 << 20 and parse_size("1.5k") == 1500
    assert LearnConfig(library_cap="1GiB").library_cap == 1 << 30  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        parse_size("lots")
    with pytest.raises(InvalidArgumentError, match="after"):
        LearnConfig(after=0)


def test_forget_deletes_the_file_and_the_row(lib, tokenizer):
    learner = learner_for(lib, after=1)
    (key,) = learned(learner, tokenizer, TOOL_A)
    assert forget(lib.folder, key, learner.registry)
    assert not lib.entry_path(key).exists() and key not in learner.registry


# ---- the front -----------------------------------------------------------------------------------
class _WithChunks:
    """A read request with the chunks the request reader will attach."""

    def __init__(self, req: Any, chunks: tuple[SeenChunk, ...]) -> None:
        self._req, self.chunks = req, chunks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


def test_the_front_observes_learns_in_the_background_and_leases(fake, lib, tokenizer,
                                                                monkeypatch):
    lib.add(HEADER, name="header")
    lib.add(REFUNDS, name="refunds", after=HEADER)
    seen = chunk(tokenizer, BAGGAGE, after=HEADER + REFUNDS, kind="content")
    read = service_module.read_request
    monkeypatch.setattr(service_module, "read_request",
                        lambda *a, **k: _WithChunks(read(*a, **k), (seen,)))
    learner = learner_for(lib, after=2)
    leases: list[tuple[str, ...]] = []
    lease = learner.lease
    monkeypatch.setattr(learner, "lease",
                        lambda keys, **kw: leases.append(lease(keys, **kw)) or leases[-1])
    catalog = SkillCatalog(lib.folder, tokenizer, rescan_s=0)
    body = {"model": MODEL, "prompt": HEADER + REFUNDS + BAGGAGE + USER, "max_tokens": 2}
    with Front(FrontConfig(upstream=fake.url), catalog, learner) as front:
        for _ in range(2):
            assert httpx2.post(front.url + "/v1/completions", json=body, timeout=30).is_success
        assert learner.wait_idle(120)
        (entry,) = learner.registry.entries()
        assert entry.tokens == len(seen) and entry.tenant is None
        resp = httpx2.post(front.url + "/v1/completions", json=body, timeout=30)
        assert resp.json()["usage"]["kvnotes"]["plan"]["skills"][-1] == entry.name  # spliced
        metrics = httpx2.get(front.url + "/metrics", timeout=30).text
        stats = httpx2.get(front.url + "/kvnotes/stats", timeout=30).json()
    assert entry.key in leases[-1] and not learner.leased(entry.key)  # released at the end
    assert "kvnotes_front_learn_compiles_total 1.0" in metrics
    assert "kvnotes_front_learn_sightings_total 3.0" in metrics
    assert stats["learner"]["learned_entries"] == 1
    assert learner.registry.get(entry.key).hits >= 1  # written when the learner stopped


def test_rows_of_entries_deleted_by_hand_hold_no_bytes_once_swept(lib, tokenizer):
    learner = learner_for(lib, after=1)
    a, b = learned(learner, tokenizer, TOOL_A, TOOL_B)
    learner.config = LearnConfig(after=1, min_tokens=4,
                                 library_cap=learner.registry.get(a).bytes)
    lib.entry_path(b).unlink()  # not through the learner
    assert learner.sweep(limit=1) == 0  # a batch: the least recently used, a, is there
    assert learner.sweep(limit=1) == 1  # the next: b is gone
    assert learner.counters()["learned_bytes"] == learner.registry.get(a).bytes
    assert learner.enforce() == 0
    assert [e.key for e in learner.registry.entries()] == [a]


def test_a_chunk_whose_text_encodes_to_other_tokens_is_not_learned(lib, tokenizer):
    learner = learner_for(lib, after=1)
    a = chunk(tokenizer, TOOL_A)
    merged = SeenChunk("tool", TOOL_A, a.token_ids[:-1] + (13,), a.after_ids)  # not its text's
    learner.observe(None, [merged])
    assert learner.run_pending() == 1
    assert learner.counters()["failures"] == 1 and len(learner.registry) == 0
    assert entry_paths(lib.folder) == []  # nothing left behind
    learner.observe(None, [merged])
    assert learner.run_pending() == 0  # not tried again


def test_the_compile_thread_runs_at_the_configured_nice_value() -> None:
    import os
    import threading

    from kvnotes.serving.learning import lower_priority

    seen: dict[str, int | bool] = {}

    def worker() -> None:
        seen["lowered"] = lower_priority(7)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if not seen["lowered"]:
        pytest.skip("this platform sets no per-thread priority")
    assert seen["nice"] >= 7
    # the caller's own thread is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 7
    assert lower_priority(0) is False
    with pytest.raises(InvalidArgumentError):
        LearnConfig(compile_nice=20)


def test_a_compile_s_share_of_a_busy_core_follows_the_kernel_weights() -> None:
    from kvnotes.serving.front.config import DEFAULT_COMPILE_NICE, busy_core_share

    shares = [busy_core_share(n) for n in range(20)]
    assert shares[0] == 0.5
    assert all(a > b for a, b in zip(shares, shares[1:], strict=False))  # higher nice, less
    assert 0.03 < busy_core_share(DEFAULT_COMPILE_NICE) < 0.04
    assert busy_core_share(19) < 0.015
    assert LearnConfig().compile_nice == DEFAULT_COMPILE_NICE
    with pytest.raises(InvalidArgumentError):
        busy_core_share(20)
