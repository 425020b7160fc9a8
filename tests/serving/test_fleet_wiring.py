"""``kvnotes serve --store``: the options, the front's config, the launcher's fleet learner, and a
front that mirrors a shared store without learning (a real redis-server, a fake vLLM)."""

from __future__ import annotations

import _fleet_hosts as fleet
import httpx2
import pytest
from _fleet_hosts import chunk, wait_for
from _front_fakes import HEADER
from typer.testing import CliRunner

import kvnotes
import kvnotes.serving.launch.launcher as launch_mod
from kvnotes.cli import app
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.config_file import load_serve_config
from kvnotes.serving.front.app import Front
from kvnotes.serving.front.config import FrontConfig, LearnConfig
from kvnotes.serving.launch.launcher import LaunchConfig, _front
from kvnotes.serving.learning.fleet import FleetLearner
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.skills import ServingSkills

engine, redis_server, hosts = fleet.engine, fleet.redis_server, fleet.hosts  # fixtures
TOOL = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather '
        'for a city today", "parameters": {"city": "string"}}}')


def test_the_front_config_checks_its_store_at_start(tmp_path):
    assert FrontConfig(store="redis://10.0.0.10:6379/0", mirror_bytes="2GiB").mirror_bytes \
        == 2 << 30
    with pytest.raises(InvalidArgumentError, match="port"):
        FrontConfig(store="redis://host:port/0")
    with pytest.raises(InvalidArgumentError, match="redis://"):
        FrontConfig(store=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="FrontConfig.store"):
        FrontConfig(store_password_file=tmp_path / "pw")


def test_serve_refuses_a_store_it_cannot_use_before_loading_a_model(tmp_path):
    with pytest.raises(InvalidArgumentError, match="--no-front"):
        load_serve_config(None, given={"skills": tmp_path, "store.url": "redis://127.0.0.1:6379/0",
                                       "no_front": True}, env={})
    with pytest.raises(InvalidArgumentError, match="--store redis"):
        load_serve_config(None, given={"skills": tmp_path,
                                       "store.password_file": tmp_path / "pw"}, env={})
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_serve_config(None, given={"skills": tmp_path, "store.url": "redis://127.0.0.1:6379/0",
                                       "store.password_file": tmp_path / "missing"}, env={})


def test_serve_passes_the_store_to_the_front(tmp_path, monkeypatch):
    seen: list[LaunchConfig] = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    (tmp_path / "pw").write_text("s3cret\n")
    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    config = tmp_path / "serve.toml"
    config.write_text(f'[store]\npassword_file = "{tmp_path / "pw"}"\n')
    CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--learn", "--store",
                             "redis://127.0.0.1:6379/2", "--config", str(config)])
    front = seen.pop().front
    assert front is not None and front.learn is not None
    assert (front.store, front.store_password_file) == ("redis://127.0.0.1:6379/2",
                                                        tmp_path / "pw")


def test_the_launchers_learning_front_learns_for_the_fleet(tmp_path, engine, redis_server):
    skills = ServingSkills(tmp_path / "skills", engine)
    front = _front(LaunchConfig(model="tiny", skills=tmp_path / "skills"),
                   FrontConfig(learn=LearnConfig(), store=redis_server.url),
                   "http://127.0.0.1:9", skills, "float32")
    learner, link = front.service.learner, front.service.store
    assert isinstance(learner, FleetLearner) and link is not None
    assert link.learner is learner and link.mirror.folder == skills.folder
    assert link.catalog is front.service.catalog
    link.stop()


def test_a_front_with_a_store_and_no_learner_mirrors_it(tmp_path, engine, tokenizer, hosts,
                                                        redis_server, fake):
    a = hosts("a")
    assert a.seen("acme", chunk(tokenizer, TOOL, after=HEADER), times=2) == 1
    (info,) = a.store.list(a.model, "acme")
    skills = ServingSkills(tmp_path / "b", engine)
    catalog = SkillCatalog(skills.folder, tokenizer, rescan_s=60.0)
    with Front(FrontConfig(upstream=fake.url, store=redis_server.url), catalog) as front:
        assert wait_for(lambda: info.key in {p.key for p in catalog.pieces()})
        stats = httpx2.get(front.url + "/kvnotes/stats", timeout=30).json()
        metrics = httpx2.get(front.url + "/metrics", timeout=30).text
    assert stats["store"]["mirror"]["fetched"] == 1 and "fleet" not in stats["store"]
    assert stats["store"]["url"] == redis_server.url
    assert 'kvnotes_front_store_faults_total{reason="down"} 0.0' in metrics
    assert "kvnotes_front_mirror_fetched_total 1.0" in metrics
    (piece,) = [p for p in catalog.pieces() if p.key == info.key]
    assert catalog.keys_of(piece.token_ids, "acme") == [info.key]
    assert catalog.keys_of(piece.token_ids, "globex") == []  # mirrored, never another's
