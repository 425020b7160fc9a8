"""The agent-layouts microbenchmark: its config, a run on a tiny model, the stored result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.research.agent.summary import BenchSummary
from kvnotes_bench.micro.agent_layouts import (
    AgentLayoutsConfig,
    AgentLayoutsResult,
    plot,
    run,
)

STORED = (Path(__file__).resolve().parents[3] / "docs" / "results" / "agent-layouts"
          / "agent-layouts.json")


def test_the_committed_result_reads_back(tmp_path):
    data = json.loads(STORED.read_text())
    result = AgentLayoutsResult.from_dict(data)
    assert result.to_dict() == data
    assert [r.order for r in result.rows] == ["request", "loaded", "appended"]
    plot(result, tmp_path / "agent-layouts.png", "stored")


def test_a_run_benches_each_layout_on_the_same_episodes(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = AgentLayoutsConfig(model="tiny", episodes=1, turns=2, orders=("request", "appended"),
                                threads=torch.get_num_threads(), skill_root=tmp_path / "skills")
    said: list[str] = []
    saved: list[tuple[str, BenchSummary]] = []
    result = run(config, engine, say=said.append,
                 saved=lambda order, bench: saved.append((order, bench)))
    assert [r.order for r in result.rows] == ["request", "appended"]
    assert [o for o, _ in saved] == ["request", "appended"]
    assert all(r.decisions == 2 and len(r.margin_errors) == 2 for r in result.rows)
    assert all(r.margin_errors == sorted(r.margin_errors) for r in result.rows)
    assert any(line.startswith("[appended] ") for line in said)
    data = json.loads(json.dumps(result.to_dict()))
    assert set(data) == {"model", "episodes", "guard", "rows"}
    assert AgentLayoutsResult.from_dict(data) == result
    plot(result, tmp_path / "agent-layouts.png", "tiny")
    assert (tmp_path / "agent-layouts.png").stat().st_size > 0


def test_the_config_refuses_an_unknown_order():
    with pytest.raises(InvalidArgumentError, match="valid orders: request"):
        AgentLayoutsConfig(orders=("sideways",))
    with pytest.raises(InvalidArgumentError, match="episodes and turns"):
        AgentLayoutsConfig(episodes=0)
