"""Tenants and keys under hostile use (issue #46, items 5 and 7): ``/metrics`` needs the
operator's or the metrics key and names no entry; quotas hold when the library cap is below
their sum; keys that could never match are refused at start; an entry forgotten behind the
learner's back is learned again; the per-entry counts stay bounded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
from _front_fakes import MODEL
from _hostile import completion, healthy, serve
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner, chunk_id
from kvnotes.serving.library.eviction import cap_order
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.variant_demand import VariantHits


def keys_file(tmp_path: Path, keys: dict[str, dict]) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": keys}), "utf-8")
    return path


# ---- /metrics ----------------------------------------------------------------------------------
def test_metrics_need_the_operators_or_the_metrics_key(upstream, published, tokenizer,
                                                       tmp_path):
    config = FrontConfig(upstream=upstream.url, block_size=16, model=MODEL, api_key="sk-op",
                         metrics_key="sk-scrape", key_file=keys_file(tmp_path, {
                             "sk-acme": {"tenant": "acme"}, "sk-shared": {}}))
    with serve(config, SkillCatalog(published.folder, tokenizer)) as front:
        acme = {"authorization": "Bearer sk-acme"}
        assert completion(front, headers=acme).status_code == 200  # splices header, refunds
        for auth in (None, "Bearer sk-acme", "Bearer sk-shared", "Bearer nope", "sk-op"):
            resp = httpx2.get(front.url + "/metrics", timeout=10,
                              headers={"authorization": auth} if auth else {})
            assert resp.status_code == 401, auth
            assert resp.json()["error"]["type"] == "AuthenticationError"
        for key in ("sk-op", "sk-scrape"):
            resp = httpx2.get(front.url + "/metrics", timeout=10,
                              headers={"authorization": f"Bearer {key}"})
            assert resp.status_code == 200
        text = resp.text
        assert 'kvnotes_front_variant_spliced_total{owner="registered"} 2.0' in text
        for name in ("refunds", "header", *front.service.variant_hits.used):  # no entry is a label
            assert name not in text
        healthy(front, headers=acme)


def test_metrics_stay_open_without_keys(upstream, published, tokenizer):
    config = FrontConfig(upstream=upstream.url, block_size=16, model=MODEL)
    with serve(config, SkillCatalog(published.folder, tokenizer)) as front:
        assert httpx2.get(front.url + "/metrics", timeout=10).status_code == 200


# ---- keys refused at start ---------------------------------------------------------------------
@pytest.mark.parametrize(("key", "why"), [
    (" sk-acme", "blanks around it"), ("sk-acme\t", "blanks around it"),
    ("sk-äcme", "not printable ASCII"), ("sk acme", "a blank"), ("", "empty"),
])
def test_keys_a_client_could_never_send_are_refused_at_start(upstream, published, tokenizer,
                                                             tmp_path, key, why):
    path = keys_file(tmp_path, {"sk-good": {}, key: {"tenant": "acme"}})
    with pytest.raises(InvalidArgumentError, match=why) as err:
        Front(FrontConfig(upstream=upstream.url, key_file=path),
              SkillCatalog(published.folder, tokenizer))
    assert "key #2" in str(err.value)
    if key.strip():
        assert key.strip() not in str(err.value)  # the message never quotes a key
    with pytest.raises(InvalidArgumentError, match=why):
        FrontConfig(upstream=upstream.url, api_key=key)


# ---- learned entries: forgotten, bounded ----------------------------------------------------------
def _entry_file(folder: Path, key: str, nbytes: int) -> None:
    (folder / f"{key}.safetensors").write_bytes(b"\0" * nbytes)


def test_an_entry_forgotten_behind_the_learners_back_is_learned_again(tmp_path):
    registry = LearnedRegistry(tmp_path)
    registry.record(LearnedEntry("k1", "acme", "k1", "tool", 3, 10))
    _entry_file(tmp_path, "k1", 10)
    learner = Learner(LearnConfig(after=1, min_tokens=1), SimpleNamespace(folder=tmp_path),
                      registry)
    chunk = SeenChunk("tool", "t", (1, 2, 3), ())
    cid = chunk_id("acme", chunk.token_ids)
    learner.sightings.learned(cid, "k1")  # learned: its entry is k1
    learner.observe("acme", [chunk])
    assert learner.worker.pending() == 0  # learned and still there: nothing to do
    (tmp_path / "k1.safetensors").unlink()  # deleted by hand: the sweep finds it gone
    assert learner.sweep() == 1 and "k1" not in registry
    learner.observe("acme", [chunk])
    assert learner.worker.pending() == 1 and learner.sightings.known(cid) is None
    learner.run_pending()  # (its compile fails here: no engine)
    with LearnedRegistry(tmp_path) as cli:  # kvnotes skills forget, from another process
        cli.record(LearnedEntry("k2", "acme", "k2", "tool", 3, 10))
        learner.reload(only_if_changed=True)
        learner.sightings.learned(cid, "k2")
        cli.remove("k2")
    assert learner.reload(only_if_changed=True)
    learner.observe("acme", [chunk])
    assert learner.worker.pending() == 1


def test_quotas_hold_when_the_cap_is_below_their_sum(tmp_path):
    registry = LearnedRegistry(tmp_path)
    quiet = LearnedEntry("q1", "quiet", "q1", "tool", 1, 10, last_used=1.0)
    busy = [LearnedEntry(f"b{i}", "busy", f"b{i}", "tool", 1, 10, last_used=2.0 + i)
            for i in range(5)]
    for entry in (quiet, *busy):
        _entry_file(tmp_path, entry.key, entry.bytes)
        registry.record(entry)
    # cap 40 < quotas 30 + 30: the busy tenant (50 bytes) is over its share (20), quiet is not
    learner = Learner(LearnConfig(library_cap=40, tenant_quota=30),
                      SimpleNamespace(folder=tmp_path), registry)
    learner.enforce()
    assert "q1" in registry  # the least recently used, but its tenant is within its share
    assert sorted(e.key for e in registry.entries()) == ["b2", "b3", "b4", "q1"]
    assert registry.total_bytes() <= 40


def test_the_cap_falls_back_to_least_recently_used_when_no_tenant_is_over():
    es = [LearnedEntry(k, t, k, "tool", 1, 10) for k, t in (("a", "x"), ("b", "y"), ("c", "x"))]
    assert [e.key for e in cap_order(es, cap=60, quota=None)] == ["a", "b", "c"]


def test_variant_counts_stay_bounded():
    hits = VariantHits(max_entries=3)
    for i in range(10):
        piece = SimpleNamespace(key=f"k{i}", name=f"tool-{i}", behind=None, origin=0)
        hits.record([SimpleNamespace(piece=piece, token_ids=(1, 2))])
    assert [k for k, *_ in hits.rows()] == ["k7", "k8", "k9"]
    assert len(hits.names) == 3 and len(hits.exact) <= 3


def test_the_fronts_counts_of_an_evicted_entry_go_with_it(upstream, published, tokenizer,
                                                         tmp_path):
    registry = LearnedRegistry(tmp_path)
    for key in ("k1", "k2"):
        (tmp_path / f"{key}.safetensors").write_bytes(b"\0" * 10)
        registry.record(LearnedEntry(key, None, key, "tool", 4, 10))
    learner = Learner(LearnConfig(), SimpleNamespace(folder=tmp_path), registry)
    front = Front(FrontConfig(upstream=upstream.url, block_size=16, model=MODEL),
                  SkillCatalog(published.folder, tokenizer), learner)
    for key in ("k1", "k2"):
        piece = SimpleNamespace(key=key, name="tool", behind=None, origin=0)
        front.service.variant_hits.record([SimpleNamespace(piece=piece, token_ids=(1, 2))])
    assert learner.evict("k1")
    assert [k for k, *_ in front.service.variant_hits.rows()] == ["k2"]  # no scrape needed


def test_serve_takes_a_metrics_key_and_refuses_it_without_the_front(tmp_path):
    runner = CliRunner()
    config = tmp_path / "serve.toml"
    config.write_text('[auth]\nmetrics_key = "sk-scrape"\n')
    result = runner.invoke(app, ["serve", "--skills", str(tmp_path), "--no-front",
                                 "--config", str(config)])
    assert result.exit_code == 2 and "auth.metrics_key are the" in " ".join(result.output.split())
    result = runner.invoke(app, ["serve", "--skills", str(tmp_path), "--api-key", " sk-op"])
    assert result.exit_code == 2 and "blanks around it" in result.output
