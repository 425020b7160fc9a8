"""``kvnotes agent``: one interactive episode of the kvnotes agent in the terminal (its
benchmark against the recompute agent is ``kvnotes-bench agent``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvnotes.cli.app import app, fail
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import KvnotesError

if TYPE_CHECKING:  # the CLI starts fast: the agent is imported when a command runs
    from kvnotes.apps.agent import Event, KvnotesAgent, SkillBook


def guard_option() -> Any:
    return typer.Option(None, "--guard", min=0.0,
                        help="re-decide on exactly recomputed notes when the top-two margin "
                             "(log-prob) is below this")


def order_option() -> Any:
    return typer.Option("request", "--order",
                        help="skill order in the system block: request (the request's own "
                             "first), loaded (load order; later skills compiled behind turn "
                             "0's), or appended (skills loaded after turn 0 come after the "
                             "record)")


def variants_option() -> Any:
    return typer.Option(True, "--variants/--no-variants",
                        help="compile every other skill behind each opening of the prompt "
                             "(about 70 library entries, minutes on first use; about half the "
                             "splice error)")


def carry_option() -> Any:
    return typer.Option(True, "--carry-record/--no-carry-record",
                        help="splice the record's last-turn notes when the skills before it "
                             "change, instead of prefilling it again (faster turns, inexact "
                             "record notes: the guard recomputes from them on)")


def compiling(done: int, total: int, name: str, compiled: bool) -> None:
    if compiled:
        typer.echo(f"skills: compiled {name} ({done}/{total} ready)", err=True)


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
    guard: float | None = guard_option(),
    order: str = order_option(),
    variants: bool = variants_option(),
    carry_record: bool = carry_option(),
) -> None:
    """One interactive episode: requests and state changes typed in the terminal."""
    from kvnotes.apps.agent import AgentConfig, KvnotesAgent, SkillBook, scripted_episode

    try:
        config = AgentConfig(order=order, tool_calls=tool_calls, guard=guard, variants=variants,
                             carry_record=carry_record)
        engine = ModelOptions(model, device, dtype, threads or None).load()
        book = SkillBook(engine, skills_dir)
        agent = KvnotesAgent(engine, book, config)
        agent.prepare(progress=compiling)  # all it splices, ready before the first request
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
