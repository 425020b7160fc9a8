"""A front's link to the shared store (:class:`StoreLink`): what ``kvnotes serve --store`` opens.
Against a real redis-server; no vLLM, no front."""

from __future__ import annotations

import _fleet_hosts as fleet
import pytest
from _fleet_hosts import chunk, wait_for
from _front_fakes import HEADER
from prometheus_client import CollectorRegistry, generate_latest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.front.store_link import StoreLink
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.skills import ServingSkills

engine, redis_server, hosts = fleet.engine, fleet.redis_server, fleet.hosts  # fixtures
TOOL = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather '
        'for a city today", "parameters": {"city": "string"}}}')


def test_serve_takes_a_redis_url_and_refuses_a_folder(tmp_path):
    with pytest.raises(InvalidArgumentError, match="redis://"):
        StoreLink.open(str(tmp_path), None, tmp_path / "m0del")
    with pytest.raises(InvalidArgumentError, match="port"):
        StoreLink.open("redis://host:port/0", None, tmp_path / "m0del")


def test_a_link_mirrors_rescans_the_catalog_and_shows_its_faults(tmp_path, engine, tokenizer,
                                                                 hosts, redis_server):
    a = hosts("a")
    assert a.seen(None, chunk(tokenizer, TOOL, after=HEADER), times=2) == 1
    (info,) = a.store.list(a.model)
    skills = ServingSkills(tmp_path / "b", engine)
    link = StoreLink.open(redis_server.url, None, skills.folder, poll_s=0.05)
    link.catalog = SkillCatalog(skills.folder, tokenizer, rescan_s=60.0)
    learner = link.fleet_learner(LearnConfig(after=2, min_tokens=4), skills)
    registry = CollectorRegistry()
    link.watch(registry)
    link.start()
    try:
        assert wait_for(lambda: info.key in {p.key for p in link.catalog.pieces()})
        redis_server.stop()
        learner.observe(None, [chunk(tokenizer, TOOL + " ", after=HEADER)])
        assert wait_for(lambda: link.faults()["down"] >= 1)
        text = generate_latest(registry).decode()
    finally:
        link.stop()
        learner.stop()
    assert 'kvnotes_front_store_faults_total{reason="down"}' in text
    assert "kvnotes_front_fleet_local_sightings_total 1.0" in text
    assert "kvnotes_front_mirror_fetched_total 1.0" in text
