"""``serve-bench fleet``'s whole run over fake hosts (no vLLM, a tiny random engine) and a real
``redis-server``: the hosts are launched with the store, each part runs, the faults happen, the
soak is checked, and the bundle is written."""

from __future__ import annotations

import json

import pytest
from _fake_fleet import FakeHost, Fleet

from kvnotes.serving.launch import launcher
from kvnotes.serving.launch.launcher import LaunchConfig
from kvnotes.serving.store.redis_process import REDIS_SERVER
from kvnotes_bench.serving import fleet_run
from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig
from kvnotes_bench.serving.fleet import FleetBenchConfig
from kvnotes_bench.serving.fleet_report import write_outputs


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_run_fleet_over_fake_hosts(tmp_path, monkeypatch, tiny_llama) -> None:
    from kvnotes.serving.skills import ServingSkills

    fleet = Fleet()
    launched: list[FakeHost] = []

    def prepare(config: LaunchConfig, engine: object) -> FakeHost:
        assert config.skills is not None and config.front is not None
        host = FakeHost(config, fleet, ServingSkills(config.skills, tiny_llama))
        launched.append(host)
        return host

    monkeypatch.setattr(launcher, "prepare", prepare)
    # every tool one learnable chunk (the fake compiles one entry per tool)
    monkeypatch.setattr(fleet_run, "learnable_chunks", lambda tokenizer: lambda request: [
        (sum(map(ord, t["function"]["name"])),) * 40 for t in request.chunks])
    config = FleetBenchConfig(
        cases=3, soak_cases=6, concurrency=(1, 2), rounds=2, per_round=1, miss_repeats=2,
        learn_timeout_s=5.0, mirror_timeout_s=5.0,
        soak=AgentSoakConfig(clients=2, requests=20, pool=6, max_tokens=2),
        # two fake hosts and the Redis faults (the pause, drop, evict and host kill are
        # tests/bench/serving/test_fleet.py's, against a real server)
        hosts=2, faults=(("kill", 0.15), ("restart", 0.25), ("flush", 0.45), ("kill", 0.65),
                         ("restart", 0.75)))
    lines: list[str] = []
    result = fleet_run.run_fleet(config, LaunchConfig(model="smollm2-135m", block_size=32),
                                 tiny_llama, out=tmp_path, request_timeout_s=30.0,
                                 command="kvnotes-bench serve fleet", say=lines.append)
    a, b, folder = launched
    assert a.config.front.store == b.config.front.store == result.redis["url"]
    assert folder.config.front.store is None and a.folder != b.folder
    assert len(result.share) == 3
    for case in result.share:
        assert case.learned and case.mirrored and case.compiles["b"] == 0
        assert case.share == pytest.approx(0.6) and case.identical
    assert sum(c.expected for c in result.share) == result.compiles["a"]["compiles"]
    assert result.series["after_share"]["a"]["kvnotes_front_fleet_published_total"] > 0
    assert {(r.store, r.concurrency) for r in result.ttft} == {
        ("redis", 1), ("folder", 1), ("redis", 2), ("folder", 2)}
    assert all(len(r.p90s) == 2 and r.failed == 0 for r in result.ttft)
    assert result.miss is not None and len(result.miss.measured) == 2
    assert result.fetch is not None and result.fetch.failed == 0
    assert [e.name for e in result.faults] == ["kill", "restart", "flush", "kill", "restart"]
    assert all(e.ok for e in result.faults), [e.error for e in result.faults]
    assert len(result.soak_records) == 20
    assert all(r.answer.ok and r.verdict is not None for r in result.soak_records)
    assert (tmp_path / "soak-requests.jsonl").is_file()
    data = json.loads(json.dumps(result.to_dict()))
    paths = write_outputs(data, tmp_path)
    assert paths["plot"].is_file() and "## Goals (a shared store)" in paths["report"].read_text()
    assert data["goals"]["share_compiles"]["met"] and data["goals"]["soak_faults"]["met"]
    assert any("host b: up" in line for line in lines)
    # the fake server answers with other tokens than the tiny engine: each answer is rendered
    # and checked, and shows as wrong, never unchecked
    assert data["goals"]["soak_unchecked"]["met"]
    assert not data["goals"]["soak_wrong"]["met"]
    assert {r.verdict["status"] for r in result.soak_records} <= {"wrong", "near_tie"}
