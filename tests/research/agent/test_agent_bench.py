"""The agent benchmark: the run, its typed summary read back, the report, the guard sweep and
the ``agent-bench`` command."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_engine
from typer.testing import CliRunner

from kvnotes.apps.agent import (
    AgentConfig,
    KvnotesAgent,
    SkillBook,
    scripted_episodes,
)
from kvnotes.apps.agent.runtime import TurnResult
from kvnotes.core.errors import (
    InvalidArgumentError,
    KvnotesError,
)
from kvnotes.ops.decisions import Decision, Guard
from kvnotes.research.agent.report import report_markdown
from kvnotes.research.agent.run import AgentBenchConfig, run_bench, write_outputs
from kvnotes.research.agent.summary import BenchSummary, TurnRecord


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture(scope="module")
def skill_root(tmp_path_factory):
    return tmp_path_factory.mktemp("skills")


@pytest.fixture(scope="module")
def book(engine, skill_root):
    b = SkillBook(engine, skill_root)
    b.prepare()
    KvnotesAgent(engine, b).prepare()  # everything the (anchored) agent splices
    return b


def test_bench_writes_json_report_and_plot(engine, book, skill_root, tmp_path):
    result = run_bench(engine, AgentBenchConfig(skill_root=skill_root),
                       episodes=scripted_episodes(1, 2))
    assert result.decisions == 2 and 0.0 <= result.identity <= 1.0
    assert result.stale is not None and result.stale.decisions_after_state_change >= 0
    assert result.tokens.kvnotes_computed < result.tokens.recompute_computed
    assert len(result.per_turn) == 2 and result.skills.compiled_now == 0
    assert all(p.stale_identity is not None for p in result.per_turn)
    paths = write_outputs(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["flip_count"] == len(data["flips"])
    assert list(data) == ["settings", "model", "episodes", "turns_per_episode", "decisions",
                          "identity", "flip_count", "flips", "per_turn", "latency", "tokens",
                          "compute", "recompute_margin_median", "guard", "fast_margin_error",
                          "guard_sweep", "skills", "tool_calls", "records", "stale", "machine"]
    assert set(data["records"][0]) == {"episode", "turn", "kind", "request", "events_so_far",
                                       "kvnotes", "recompute", "stale"}
    assert "stale_identity" in data["per_turn"][0] and "under_0.001" in data["fast_margin_error"]
    again = BenchSummary.from_dict(data)  # the figures read back, typed
    assert again.to_dict(records=False) == {k: v for k, v in data.items() if k != "records"}
    assert again.records == () and again.flip_count == data["flip_count"]
    lean = {k: v for k, v in data.items() if k not in ("settings", "compute", "fast_margin_error")}
    read = BenchSummary.from_dict(lean)  # a summary without them still reads and reports
    assert read.settings is None and read.compute is None and read.fast_margin_error is None
    report = report_markdown(read)
    assert "decision identity with recompute" in report and "arithmetic" not in report
    assert "decision identity with recompute" in paths["report"].read_text()
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_bench_reports_the_guard(engine, book, skill_root):
    config = AgentBenchConfig(agent=AgentConfig(guard=1e9), stale=False, skill_root=skill_root)
    result = run_bench(engine, config, episodes=scripted_episodes(1, 3))
    g = result.guard
    fired = [r.turn for r in result.records if r.kvnotes.decision.guard.fired]
    assert g.decisions == 3 and g.fired == len(fired) >= 1 and g.tokens > 0
    assert 0 not in fired  # turn 0's notes are exact: nothing to redo
    assert result.identity == 1.0  # every inexact decision re-taken on exact notes
    comp = result.compute
    assert 0 < comp.guard_flops < comp.kvnotes_flops < comp.recompute_flops
    assert comp.fast_flop_ratio > comp.flop_ratio > 1
    assert sum(r.kvnotes.guard_flops > 0 for r in result.records) == len(fired)
    report = report_markdown(result)
    assert "arithmetic, recompute / kvnotes" in report
    assert "## Lower guard thresholds, read off this run" in report
    assert result.guard_sweep[0].tau == 1.0  # nothing above 1e9 is in the default sweep
    assert result.fast_margin_error.under_0_001 >= 1  # turn 0 is exact
    assert f"decision guard (tau = 1000000000.0) fired | {len(fired)} of 3" in \
        report_markdown(result)


def _record(fast, fast_margin, choice, margin, fired, seconds=0.0, guard_flops=0.0):
    """A turn record whose kvnotes decision was guarded at tau 1.0 (re-decided when fired)."""
    guard = Guard(1.0, fired, fast, fast_margin, choice if fired else None, seconds=seconds)
    kvnotes = TurnResult(0, "cancel", Decision(choice if fired else fast, {}, margin, guard=guard),
                         None, 1.0 + seconds, 10, 0, 10, flops=10.0 + guard_flops,
                         guard_flops=guard_flops)
    recompute = TurnResult(0, "cancel", Decision(choice, {}, margin), None, 8.0, 80, 0, 80,
                           flops=80.0)
    return TurnRecord("ep000", 0, "cancel", "", (), kvnotes, recompute)


def test_margin_errors_and_the_guard_sweep_read_off_records():
    from kvnotes.research.agent.summary import fast_margin_errors, guard_sweep, margin_error_stats

    records = [_record("a", 2.0, "a", 2.0, False),              # exact notes: no error
               _record("a", 0.6, "a", 0.9, True, 3.0, 30.0),    # a fire that changed nothing
               _record("b", 0.2, "a", 0.1, True, 1.0, 10.0)]    # a fire that caught a flip
    assert fast_margin_errors(records) == pytest.approx([0.0, 0.3, 0.3])
    stats = margin_error_stats(records)
    assert stats.max == pytest.approx(0.3) and stats.under_0_001 == 1
    sweep = {row.tau: row for row in guard_sweep(records, (2.0, 1.0, 0.5, 0.1))}
    assert 2.0 not in sweep  # above the run's own tau: its extra fires never ran
    assert (sweep[1.0].fired, sweep[1.0].missed_flips) == (2, 0)
    assert sweep[1.0].latency_ratio == pytest.approx(24 / 7)
    assert (sweep[0.5].fired, sweep[0.5].missed_flips) == (1, 0)
    assert sweep[0.5].latency_ratio == pytest.approx(24 / 4)
    assert sweep[0.5].flop_ratio == pytest.approx(240 / 40)
    assert (sweep[0.1].fired, sweep[0.1].missed_flips) == (0, 1)
    assert sweep[0.1].latency_ratio == pytest.approx(24 / 3)


def test_agent_bench_command_prints_the_arithmetic(engine, skill_root, tmp_path, monkeypatch):
    from kvnotes.core import models
    from kvnotes_bench.cli import app

    monkeypatch.setattr(models, "load", lambda model, **device_dtype: engine)
    result = CliRunner().invoke(app, ["agent", "--model", "tiny", "--episodes", "1",
                                      "--turns", "2", "--no-stale", "--order", "appended",
                                      "--skills-dir", str(skill_root), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "decision identity: " in result.output
    assert "arithmetic: recompute / kvnotes " in result.output
    data = json.loads((tmp_path / "agent-bench.json").read_text())
    assert data["compute"]["flop_ratio"] > 1 and data["decisions"] == 2


def test_bench_records_its_settings_and_runs_a_held_out_range(engine, book, skill_root):
    config = AgentBenchConfig(agent=AgentConfig(carry_record=True, guard=0.5), n_episodes=1,
                         turns=2, first_episode=7, skill_root=skill_root, stale=False)
    result = run_bench(engine, config)
    s = result.settings
    assert s.episodes == ("ep007",) and s.carry_record is True and s.guard == 0.5
    assert {r.episode for r in result.records} == {"ep007"}
    assert "Episodes ep007; order request, history 0, variants True, guard 0.5, repair 0, " \
           "carry_record True." in report_markdown(result)
    assert [e.episode_id for e in scripted_episodes(2, 1, first=5)] == ["ep005", "ep006"]
    with pytest.raises(KvnotesError, match="first must be an episode index"):
        scripted_episodes(2, first=-1)


def test_bench_config_checks_the_episode_count():
    with pytest.raises(InvalidArgumentError, match="^n_episodes must be >= 1, got 0$"):
        AgentBenchConfig(n_episodes=0)
