"""agent-bench: the kvnotes agent against the recompute agent over scripted episodes.

Per turn, both agents (and the stale-record ablation) take the same request and events,
interleaved so that they run under the same machine load. Reported
(:class:`~kvnotes.research.agent.summary.BenchSummary`): decision identity overall and per turn, the
flips with their cases, latency per turn and in total, the latency ratio, and tokens computed
by each agent.

Example:
    >>> import tempfile
    >>> config = AgentBenchConfig(agent=AgentConfig(guard=0.25, variants=False), n_episodes=1,
    ...                      turns=2, stale=False, skill_root=tempfile.mkdtemp())
    >>> summary = run_bench(engine, config)
    >>> summary.decisions, summary.settings.episodes
    (2, ('ep000',))
    >>> 0.0 <= summary.identity <= 1.0 and summary.compute.flop_ratio > 1
    True
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.episodes import Episode, scripted_episode, scripted_episodes
from kvnotes.apps.agent.runtime import Agent, KvnotesAgent, RecomputeAgent, TurnResult
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.core import validate
from kvnotes.core.engine import Engine
from kvnotes.core.errors import ArgumentTypeError
from kvnotes.core.machine import machine_info
from kvnotes.eval.reports import write_bundle
from kvnotes.research.agent.report import plot_latency, report_markdown
from kvnotes.research.agent.summary import BenchSettings, BenchSummary, SkillStats, TurnRecord, summarize

WARM_UP_EPISODE = 10_000  # an episode no run measures


@dataclass(frozen=True, slots=True)
class AgentBenchConfig:
    """What agent-bench runs.

    Args:
        agent: the kvnotes agent's settings; the recompute agent reads the same prompt
            (``order``, ``history``, ``tool_calls``).
        n_episodes: scripted episodes, from ``first_episode`` on (a later range is a held-out
            set to choose settings such as the guard on).
        turns: turns per episode.
        stale: also run the stale-record ablation (state changes ignored).
        skill_root: the skill library folder (default: the kvnotes home's).
    """

    agent: AgentConfig = field(default_factory=AgentConfig)
    n_episodes: int = 40
    turns: int = 5
    first_episode: int = 0
    stale: bool = True
    skill_root: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.agent, AgentConfig):
            raise ArgumentTypeError(f"agent must be an AgentConfig, got "
                                    f"{type(self.agent).__name__}; pass AgentConfig(...)")
        validate.integer(self.n_episodes, "n_episodes", minimum=1)
        validate.integer(self.turns, "turns", minimum=1)
        validate.integer(self.first_episode, "first_episode", minimum=0)
        validate.flag(self.stale, "stale")

    def settings(self, episodes: Sequence[Episode]) -> BenchSettings:
        a = self.agent
        return BenchSettings(a.order, a.history, a.anchored, a.variants, a.guard, a.repair,
                             a.carry_record, tuple(ep.episode_id for ep in episodes))


def _agents(engine: Engine, book: SkillBook, config: AgentBenchConfig) -> dict[str, Agent]:
    agents: dict[str, Agent] = {"kvnotes": KvnotesAgent(engine, book, config.agent),
                                "recompute": RecomputeAgent(engine, book, config.agent)}
    if config.stale:  # the same prompt and anchors, the first record kept, nothing repaired
        agents["stale"] = KvnotesAgent(engine, book, dataclasses.replace(
            config.agent, updates="ignore", tool_calls=False, guard=None, repair=0,
            carry_record=True))
    return agents


def run_bench(engine: Engine, config: AgentBenchConfig | None = None, *,
              episodes: Sequence[Episode] | None = None,
              progress: Callable[[str], None] | None = None,
              on_episode: Callable[[BenchSummary], object] | None = None,
              on_skill: Callable[[int, int, str, bool], None] | None = None) -> BenchSummary:
    """Run the benchmark (``episodes``: these instead of the config's scripted range).

    ``progress`` gets one line per episode. ``on_episode`` receives the summary of the episodes
    done so far after each episode (the CLI writes it out, so an interrupted run still leaves
    its figures). ``on_skill`` follows the skill library's preparation
    (:meth:`KvnotesAgent.prepare`'s ``progress``), which takes minutes the first time a layout
    with variants runs on a model. The summary's ``settings`` records the agent's settings and
    the episodes.
    """
    config = AgentBenchConfig() if config is None else config
    episodes = (list(episodes) if episodes is not None
                else scripted_episodes(config.n_episodes, config.turns,
                                       first=config.first_episode))
    settings = config.settings(episodes)
    machine_before = machine_info()  # latency ratios mean little without the load beside them
    book = SkillBook(engine, config.skill_root)
    misses0 = book.library.misses
    agents = _agents(engine, book, config)
    t0 = time.perf_counter()
    for agent in agents.values():  # every splice compiled (or loaded) before any turn
        if isinstance(agent, KvnotesAgent):
            agent.prepare(progress=on_skill)
    prepare_s = time.perf_counter() - t0
    # one untimed turn each first: a fresh process's first forwards are slower (allocator,
    # kernel set-up), and the first episode would carry that for one agent more than the other
    warm = scripted_episode(WARM_UP_EPISODE, 1)
    for agent in agents.values():
        agent.start(warm.state)
        agent.turn(warm.turns[0].request, warm.turns[0].events)
    records: list[TurnRecord] = []

    def summary() -> BenchSummary:  # the figures of the episodes done so far
        skills = SkillStats(tuple(book.names), {n: len(book.token_ids(n)) for n in book.names},
                            book.library.misses - misses0, book.library.hits, prepare_s)
        return summarize(engine.name, records, settings=settings, skills=skills,
                         tool_calls=config.agent.tool_calls)

    for i, ep in enumerate(episodes):
        for agent in agents.values():
            agent.start(ep.state)
        rows: dict[str, list[TurnResult]] = {name: [] for name in agents}
        events_so_far: list[tuple[str, str]] = []
        for index, turn in enumerate(ep.turns):
            events_so_far += [(e.field, e.value) for e in turn.events]
            for name, agent in agents.items():
                rows[name].append(agent.turn(turn.request, turn.events))
            records.append(TurnRecord(
                ep.episode_id, index, turn.request.kind, turn.request.text, tuple(events_so_far),
                kvnotes=rows["kvnotes"][-1], recompute=rows["recompute"][-1],
                stale=rows["stale"][-1] if "stale" in rows else None))
        if progress:
            k = sum(r.latency_s for r in rows["kvnotes"])
            c = sum(r.latency_s for r in rows["recompute"])
            same = sum(a.decision.answer == b.decision.answer
                       for a, b in zip(rows["kvnotes"], rows["recompute"], strict=True))
            progress(f"[{i + 1}/{len(episodes)}] {ep.episode_id}: identical {same}/{len(ep.turns)}"
                     f"  kvnotes {k:.2f}s  recompute {c:.2f}s  ({c / k:.1f}x)")
        if on_episode:
            on_episode(summary())
    machine = {"before": machine_before, "after": machine_info(since=machine_before)}
    return dataclasses.replace(summary(), machine=machine)


def write_outputs(summary: BenchSummary, out_dir: str | Path) -> dict[str, Path]:
    """Write ``agent-bench.json``, ``report.md`` and ``latency.png`` into ``out_dir``."""
    return write_bundle(out_dir, summary.to_dict(), report=report_markdown(summary),
                        json_name="agent-bench.json", plot_name="latency.png",
                        plot=lambda path: plot_latency(summary, path))
