"""Agent commands: ``agent-bench`` (kvnotes agent vs recompute agent) and ``agent`` (one
interactive episode in the terminal)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvnotes.cli.app import app, emit_json, fail, folder_option
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import KvnotesError

if TYPE_CHECKING:  # the CLI starts fast: the agent is imported when a command runs
    from kvnotes.apps.agent import Event, KvnotesAgent, SkillBook
    from kvnotes.bench.agent.run import AgentBenchConfig
    from kvnotes.bench.agent.summary import BenchSummary


def _guard_option() -> Any:
    return typer.Option(None, "--guard", min=0.0,
                        help="re-decide on exactly recomputed notes when the top-two margin "
                             "(log-prob) is below this")


def _order_option() -> Any:
    return typer.Option("request", "--order",
                        help="skill order in the system block: request (the request's own "
                             "first), loaded (load order; later skills compiled behind turn "
                             "0's), or appended (skills loaded after turn 0 come after the "
                             "record)")


def _variants_option() -> Any:
    return typer.Option(True, "--variants/--no-variants",
                        help="compile every other skill behind each opening of the prompt "
                             "(about 70 library entries, minutes on first use; about half the "
                             "splice error)")


def _carry_option() -> Any:
    return typer.Option(True, "--carry-record/--no-carry-record",
                        help="splice the record's last-turn notes when the skills before it "
                             "change, instead of prefilling it again (faster turns, inexact "
                             "record notes: the guard recomputes from them on)")


def _compiling(done: int, total: int, name: str, compiled: bool) -> None:
    if compiled:
        typer.echo(f"skills: compiled {name} ({done}/{total} ready)", err=True)


@app.command("agent-bench")
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
    guard: float | None = _guard_option(),
    anchored: bool = typer.Option(True, "--anchor/--no-anchor",
                                  help="compile skills behind the agent's system header (and "
                                       "the fixed tools skill)"),
    history: int = typer.Option(0, "--history", min=-1,
                                help="past exchanges kept in the prompt (-1: all)"),
    order: str = _order_option(),
    variants: bool = _variants_option(),
    repair: float = typer.Option(0.0, "--repair", min=0.0,
                                 help="recompute this many first tokens of each inexact splice "
                                      "(< 1: a fraction of the skill)"),
    carry_record: bool = _carry_option(),
    first: int = typer.Option(0, "--first", min=0,
                              help="first scripted episode (a later range is a held-out set "
                                   "to choose settings such as --guard on)"),
) -> None:
    """Decision identity and latency: the kvnotes agent against the recompute agent.

    Writes agent-bench.json, report.md and latency.png into --out (after every episode, so an
    interrupted run keeps what it measured).
    """
    from kvnotes.apps.agent import AgentConfig
    from kvnotes.bench.agent.run import AgentBenchConfig

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
        from kvnotes.bench.agent.run import run_bench, write_outputs

        engine = self.model.load()
        summary = run_bench(engine, self.bench, progress=lambda line: typer.echo(line, err=True),
                            on_episode=lambda partial: write_outputs(partial, self.out),
                            on_skill=_compiling)
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


HELP = """Type a customer request, or:
  /set FIELD VALUE   change a field of the record (rewritten before the next request)
  /state             show the record        /fields   list the fields
  /skills            list the skills        /quit     end (Ctrl-D too)"""


@app.command("agent")
def agent_interactive(
    model: str = typer.Option(..., "--model", "-m", help="model alias, HF folder or .gguf file"),
    episode: int = typer.Option(0, "--episode", help="scripted episode whose record starts"),
    tool_calls: bool = typer.Option(False, "--tool-calls", help="also write a tool call"),
    skills_dir: Path | None = typer.Option(None, "--skills-dir", help="skill library folder"),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    guard: float | None = _guard_option(),
    order: str = _order_option(),
    variants: bool = _variants_option(),
    carry_record: bool = _carry_option(),
) -> None:
    """One interactive episode: requests and state changes typed in the terminal."""
    from kvnotes.apps.agent import AgentConfig, KvnotesAgent, SkillBook, scripted_episode

    try:
        config = AgentConfig(order=order, tool_calls=tool_calls, guard=guard, variants=variants,
                             carry_record=carry_record)
        engine = ModelOptions(model, device, dtype, threads or None).load()
        book = SkillBook(engine, skills_dir)
        agent = KvnotesAgent(engine, book, config)
        agent.prepare(progress=_compiling)  # all it splices, ready before the first request
        agent.start(scripted_episode(episode, 1).state)
    except KvnotesError as err:
        fail(err)
        return
    typer.echo(f"{engine!r}; skills ready ({book.library.hits} loaded, "
               f"{book.library.misses} compiled).\n{HELP}")
    _session(agent, book)
    sys.stdout.flush()


def _session(agent: KvnotesAgent, book: SkillBook) -> None:
    """Read lines until /quit or end of input: a slash command, or a customer request."""
    pending: list[Event] = []
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            typer.echo("")
            return
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        try:
            if line.startswith("/"):
                _slash_command(line, agent, book, pending)
            else:
                _request(line, agent, pending)
                pending = []
        except KvnotesError as err:
            typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)


def _slash_command(line: str, agent: KvnotesAgent, book: SkillBook,
                   pending: list[Event]) -> None:
    """``/state``, ``/fields``, ``/skills``, ``/set FIELD VALUE`` (queued in ``pending``)."""
    from kvnotes.apps.agent import FIELDS, Event

    if line == "/state":
        state = agent.state.apply(pending) if agent.state else None
        typer.echo(state.render() if state else "(no record)")
    elif line == "/fields":
        typer.echo(", ".join(FIELDS))
    elif line == "/skills":
        typer.echo(", ".join(book.names))
    elif line.startswith("/set"):
        parts = line.split(maxsplit=2)
        if len(parts) < 3:
            typer.echo("usage: /set FIELD VALUE")
            return
        pending.append(Event(parts[1], parts[2], "typed"))
        typer.echo(f"queued: {parts[1]} = {parts[2]} (the record is rewritten at the next "
                   "request)")
    else:
        typer.echo(HELP)


def _request(line: str, agent: KvnotesAgent, pending: list[Event]) -> None:
    """One customer request, with the record changes queued before it: its decision."""
    from kvnotes.apps.agent import route

    request = route(line)
    result = agent.turn(request, pending)
    d = result.decision
    scores = ", ".join(f"{k} {v:.2f}" for k, v in d.scores.items())
    typer.echo(f"decision: {d.answer}   [{request.kind}; log-probs {scores}]")
    if d.guard is not None and d.guard.fired:
        changed = f", changed from {d.guard.fast_answer}" if d.guard.changed else ""
        typer.echo(f"guard: margin {d.guard.fast_margin:.2f} < {d.guard.tau}; re-decided on "
                   f"exact notes ({d.guard.tokens} tokens recomputed{changed})")
    if result.tool_call is not None:
        tc = result.tool_call
        typer.echo(f"tool call: {tc.tool} {tc.args}" if tc.ok
                   else f"tool call malformed: {tc.error}\n  raw: {tc.raw!r}")
    typer.echo(f"reused {result.tokens_reused} tokens, computed {result.tokens_computed}, "
               f"notebook {result.notebook_len} tokens, {result.latency_s * 1000:.0f} ms")
