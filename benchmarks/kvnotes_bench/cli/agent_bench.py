"""``kvnotes-bench agent``: the kvnotes agent against the recompute agent on scripted episodes
(:mod:`kvnotes.research.agent`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvnotes.cli.agent import carry_option, compiling, guard_option, order_option, variants_option
from kvnotes.cli.app import emit_json, fail, folder_option
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import KvnotesError
from kvnotes_bench.cli.app import app

if TYPE_CHECKING:  # the CLI starts fast: the agent is imported when a command runs
    from kvnotes.research.agent.run import AgentBenchConfig
    from kvnotes.research.agent.summary import BenchSummary


@app.command("agent")
def agent_bench(
    model: str = typer.Option(..., "--model", "-m", help="model alias, HF folder or .gguf file"),
    episodes: int = typer.Option(40, "--episodes", "-n", min=1, help="scripted episodes"),
    turns: int = typer.Option(5, "--turns", "-t", min=1, help="turns per episode"),
    out: Path = typer.Option(Path("out/agent-bench"), "--out", help="folder for the outputs"),
    tool_calls: bool = typer.Option(False, "--tool-calls", help="also write and check tool calls"),
    stale: bool = typer.Option(True, "--stale/--no-stale",
                               help="also run the stale-record ablation (state changes ignored)"),
    skills_dir: Path | None = typer.Option(None, "--skills-dir",
                                           help="skill library folder (default: kvnotes home)"),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    guard: float | None = guard_option(),
    anchored: bool = typer.Option(True, "--anchor/--no-anchor",
                                  help="compile skills behind the agent's system header (and "
                                       "the fixed tools skill)"),
    history: int = typer.Option(0, "--history", min=-1,
                                help="past exchanges kept in the prompt (-1: all)"),
    order: str = order_option(),
    variants: bool = variants_option(),
    repair: float = typer.Option(0.0, "--repair", min=0.0,
                                 help="recompute this many first tokens of each inexact splice "
                                      "(< 1: a fraction of the skill)"),
    carry_record: bool = carry_option(),
    first: int = typer.Option(0, "--first", min=0,
                              help="first scripted episode (a later range is a held-out set "
                                   "to choose settings such as --guard on)"),
) -> None:
    """Decision identity and latency: the kvnotes agent against the recompute agent.

    Writes agent-bench.json, report.md and latency.png into --out (after every episode, so an
    interrupted run keeps what it measured).
    """
    from kvnotes.apps.agent import AgentConfig
    from kvnotes.research.agent.run import AgentBenchConfig

    try:
        command = AgentBenchCommand(
            bench=AgentBenchConfig(
                agent=AgentConfig(order=order, history=None if history < 0 else history,
                                  tool_calls=tool_calls, anchored=anchored, variants=variants,
                                  guard=guard, repair=repair if 0 < repair < 1 else int(repair),
                                  carry_record=carry_record),
                n_episodes=episodes, turns=turns, first_episode=first, stale=stale,
                skill_root=skills_dir),
            model=ModelOptions(model, device, dtype, threads or None), out=out)
        summary, paths = command.run()
    except KvnotesError as err:
        fail(err)
    if as_json:
        emit_json(summary.to_dict(records=False))
        return
    typer.echo(_bench_lines(summary))
    typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}")


@dataclass(frozen=True)
class AgentBenchCommand:
    """What ``agent-bench`` runs: the benchmark's config, the model, and the output folder."""

    bench: AgentBenchConfig
    model: ModelOptions
    out: Path

    def __post_init__(self) -> None:
        folder_option(self.out, "--out")

    def run(self) -> tuple[BenchSummary, dict[str, Path]]:
        """Run the benchmark, rewriting the bundle in ``out`` after every episode."""
        from kvnotes.research.agent.run import run_bench, write_outputs

        engine = self.model.load()
        summary = run_bench(engine, self.bench, progress=lambda line: typer.echo(line, err=True),
                            on_episode=lambda partial: write_outputs(partial, self.out),
                            on_skill=compiling)
        return summary, write_outputs(summary, self.out)


def _bench_lines(summary: BenchSummary) -> str:
    """The terminal summary of an agent-bench run: identity, flips, guard, latency, tokens."""
    lat = summary.latency
    lines = [f"decision identity: {summary.identity:.1%} "
             f"({summary.decisions - summary.flip_count}/{summary.decisions}), "
             f"flips: {summary.flip_count}"]
    lines += [f"  flip {f.episode} turn {f.turn + 1} {f.kind}: kvnotes "
              f"{f.kvnotes!r} vs recompute {f.recompute!r} "
              f"(recompute margin {f.recompute_margin:.3f})" for f in summary.flips]
    g = summary.guard
    if g is not None:
        lines.append(f"guard (tau {g.tau}): fired {g.fired}/{g.decisions}, changed "
                     f"{g.changed}, cost {g.tokens} tokens / {g.seconds:.2f}s")
    lines.append(f"total latency: recompute {lat.recompute_total_s:.2f}s, kvnotes "
                 f"{lat.kvnotes_total_s:.2f}s, ratio {lat.ratio:.2f}x")
    tok = summary.tokens
    lines.append(f"tokens computed: recompute {tok.recompute_computed}, kvnotes "
                 f"{tok.kvnotes_computed} (reused {tok.kvnotes_reused})")
    comp = summary.compute
    if comp is not None:
        lines.append(f"arithmetic: recompute / kvnotes {comp.flop_ratio:.1f}x FLOPs (fast path "
                     f"{comp.fast_flop_ratio:.1f}x FLOPs, {comp.fast_latency_ratio:.1f}x "
                     "latency)")
    return "\n".join(lines)
