"""``kvnotes-bench serve spliceable``: how soon a tool list an agent repeats is spliced.

A learning front (``kvnotes serve --learn``) compiles a chunk at its ``after``-th sighting, in
the background, by vLLM's own prefill; it never waits for the compile. What a user gets from it
is whether the compile is done by the request that comes next. Per case, a new tool list (a BFCL
``live_multiple`` development case with at least ``tools`` functions, its first ``tools``,
tagged so no server has seen them):

1. **exact**: the same list under another tag with ``splice: false``, ``max_tokens`` 1: the time
   of one exact request of that prompt, its prefill and first token (vLLM's prefix cache reuses
   only the shared system header);
2. the list sent ``after - 1`` times, then its due sighting. From the due sighting's send, the
   front's learner counters (``/kvnotes/stats``) are polled every ``poll_s`` until the list's
   new chunks are compiled: **time to spliceable** (vLLM arm);
3. **third request**: sent as soon as the due sighting's answer (``answer_tokens`` greedy
   tokens, a tool call's length) is complete, as an agent's next call is: its share of the
   prompt spliced and its time;
4. **ready**: once learned (or timed out), the request again: the share with entries ready;
5. **engine arm**: the same new chunks compiled by kvnotes' engine in this process, each behind
   its prefix as the request showed it (``ServingSkills.add``, what the learner ran before its
   compiles moved into vLLM), timed beside the same traffic.

Rounds: ``background`` clients (0: the measured client alone, c1; 4: beside c4 traffic) send
fresh tool lists of other cases for the whole round, each seen once (nothing else compiles).
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, NonNegativeInt

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.kit.stats import median, percentile
from kvnotes_bench.serving.agent_traffic import (
    AgentBenchConfig,
    laid_chunks,
    learning_launch,
    tool_set,
    utc_minute,
)
from kvnotes_bench.serving.agent_traffic_client import OpenAISender
from kvnotes_bench.serving.agent_traffic_protocol import ProtocolConfig, wait_learned
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes.serving.planning.chunks import SeenChunk

SHARE_GOAL = 0.5  # of the third request's prompt spliced (the goal, on the 1.5B)


class SpliceableConfig(BaseModel):
    """What one run measures (see the module docstring)."""

    model: str = "smollm2-135m"
    cases: int = Field(default=8, ge=1, description="new tool lists per round")
    tools: int = Field(default=4, ge=1, description="tools per list (cases with fewer are skipped)")
    background: tuple[NonNegativeInt, ...] = Field(default=(0, 4), min_length=1,
                                                   description="background clients per round")
    after: int = Field(default=2, ge=2, description="the server's --learn-after")
    answer_tokens: int = Field(default=16, ge=1, description="greedy tokens of each sighting's "
                               "answer (an agent's tool call; the third request waits for it)")
    poll_s: float = Field(default=0.1, gt=0)
    learn_timeout_s: float = Field(default=120.0, gt=0)
    engine: bool = Field(default=True, description="also time the engine's compile of the same chunks")
    min_tokens: int = 32  # the front's LearnConfig.min_tokens: shorter chunks are not learned


class SpliceableCase(BaseModel):
    """One new tool list (times in seconds; None: not measured or not reached)."""

    id: str
    prompt_tokens: int | None = None
    new_chunks: int = 0
    exact_s: float | None = None
    spliceable_s: float | None = None  # due sighting's send -> its chunks compiled (vLLM)
    due_s: float | None = None  # the due sighting's own round trip
    failures: int = 0  # compiles the learner counted as failed meanwhile
    third_share: float | None = None
    third_s: float | None = None
    ready_share: float | None = None
    engine_s: float | None = None  # the same chunks compiled by the engine in this process
    load: list[float] = Field(default_factory=list)


class SpliceableRound(BaseModel):
    background: int
    cases: list[SpliceableCase] = Field(default_factory=list)
    background_requests: int = 0
    background_errors: int = 0

    def summary(self) -> dict[str, float | int | None]:
        """Medians and rates over the round's cases (the report's row)."""
        cs = self.cases

        def vals(name: str) -> list[float]:
            return [v for c in cs if (v := getattr(c, name)) is not None]

        def rate(ok: Callable[[SpliceableCase], bool]) -> float | None:
            return sum(map(ok, cs)) / len(cs) if cs else None

        shares, ready = vals("third_share"), vals("ready_share")
        return {
            "cases": len(cs), "exact_p50_s": median(vals("exact_s")),
            **{f"{k}_p{q}_s": percentile(vals(f"{k}_s"), q) for k in ("spliceable", "engine")
               for q in (50, 90)},
            "vllm_within_exact": rate(lambda c: (c.spliceable_s or 1e9) <= (c.exact_s or 0)),
            "engine_within_exact": rate(lambda c: (c.engine_s or 1e9) <= (c.exact_s or 0)),
            "third_share_mean": sum(shares) / len(shares) if shares else None,
            "third_at_goal": rate(lambda c: (c.third_share or 0.0) >= SHARE_GOAL),
            "ready_share_mean": sum(ready) / len(ready) if ready else None,
            "third_p50_s": median(vals("third_s")),
        }


class SpliceableResult(BaseModel):
    config: SpliceableConfig
    command: str = ""
    started: str = ""
    finished: str = ""
    machine: dict[str, Any] = Field(default_factory=dict)
    launch: dict[str, Any] = Field(default_factory=dict)
    rounds: list[SpliceableRound] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)


# ---- the cases --------------------------------------------------------------------------------
def tool_lists(config: SpliceableConfig, tokenizer: Any
               ) -> tuple[list[AgentRequest], list[AgentRequest], list[str]]:
    """``(measured, background, skipped)``: development cases with at least ``tools`` tools cut
    to their first ``tools`` (measured), the cases after the first ``cases`` (background)."""
    n = config.cases * (1 + len(config.background))
    kept, _ = tool_set(AgentBenchConfig(model=config.model, parts=("tools",), cases=4 * n),
                       tokenizer)
    fit = [dataclasses.replace(r, chunks=r.chunks[:config.tools]) for r in kept
           if len(r.chunks) >= config.tools]
    skipped = [r.id for r in kept if len(r.chunks) < config.tools]
    if len(fit) < config.cases:
        raise InvalidArgumentError(f"only {len(fit)} development cases have {config.tools} "
                                   f"tools or more; ask for fewer --cases or --tools")
    return fit[:config.cases], kept[config.cases:] or fit, skipped


def new_chunks(tokenizer: Any, request: AgentRequest, min_tokens: int,
               known: set[tuple[int, ...]]) -> list[SeenChunk]:
    """The request's chunks the learner will compile (long enough, not learned before)."""
    return [c for c in laid_chunks(tokenizer, request) if len(c.token_ids) >= min_tokens
            and c.token_ids not in known]


def engine_compile_s(engine: Engine, chunks: Sequence[SeenChunk]) -> float:
    """Seconds the engine takes to compile ``chunks`` (each behind its prefix) into a fresh
    folder: the engine producer's time to spliceable."""
    from kvnotes.serving.skills import ServingSkills

    with tempfile.TemporaryDirectory(prefix="kvnotes-engine-compile-") as folder:
        skills = ServingSkills(folder, engine)
        t0 = time.perf_counter()
        for c in chunks:
            skills.add(c.text, name=f"{c.kind}-timed", after=list(c.after_ids) or None,
                       capped=False)
        return time.perf_counter() - t0


def _share(answer: Any) -> float | None:
    p = answer.prompt_tokens
    return answer.spliced_tokens / p if answer.ok and p else None


async def measure_case(sender: OpenAISender, base: AgentRequest, tag: str,
                       config: SpliceableConfig, tokenizer: Any, known: set[tuple[int, ...]],
                       engine: Engine | None) -> SpliceableCase:
    """Steps 1-5 of the module docstring for one tool list."""
    request = base.variant(tag)
    case = SpliceableCase(id=request.id, load=load_now())
    exact = await sender.send(base.variant(tag + "x"), splice=False, max_tokens=1)
    case.exact_s = exact.total_s if exact.ok else None
    chunks = new_chunks(tokenizer, request, config.min_tokens, known)
    case.new_chunks = len(chunks)
    before = await sender.learner()
    for _ in range(config.after - 1):
        await sender.send(request, splice=True, max_tokens=config.answer_tokens)
    watch = asyncio.create_task(wait_learned(sender, before, len(chunks), ProtocolConfig(
        learn_timeout_s=config.learn_timeout_s, poll_s=config.poll_s)))
    t0 = time.monotonic()
    await sender.send(request, splice=True, max_tokens=config.answer_tokens)
    case.due_s = time.monotonic() - t0
    third = await sender.send(request, splice=True, max_tokens=1)
    case.third_share, case.third_s = _share(third), third.total_s
    case.prompt_tokens = third.prompt_tokens
    learned, waited, _, counts = await watch
    case.spliceable_s, case.failures = round(waited, 3) if learned else None, counts["failures"]
    known.update(c.token_ids for c in chunks)
    case.ready_share = _share(await sender.send(request, splice=True, max_tokens=1))
    if engine is not None and chunks:
        case.engine_s = round(await asyncio.to_thread(engine_compile_s, engine, chunks), 3)
    return case


async def _background(sender: OpenAISender, bases: Sequence[AgentRequest], client: int,
                      stop: asyncio.Event, counts: list[int]) -> None:
    n = 0
    while not stop.is_set():
        base = bases[(client + n * 7) % len(bases)]
        answer = await sender.send(base.variant(f"bg{client}-{n}"), splice=True, max_tokens=16)
        counts[0] += 1
        counts[1] += 0 if answer.ok else 1
        n += 1


async def run_round(sender: OpenAISender, cases: Sequence[AgentRequest],
                    background: Sequence[AgentRequest], clients: int, config: SpliceableConfig,
                    tokenizer: Any, known: set[tuple[int, ...]], engine: Engine | None,
                    say: Callable[[str], None]) -> SpliceableRound:
    """One round: ``clients`` background clients running while ``cases`` are measured."""
    out = SpliceableRound(background=clients)
    stop, counts = asyncio.Event(), [0, 0]
    tasks = [asyncio.create_task(_background(sender, background, k, stop, counts))
             for k in range(clients)]
    try:
        if clients:
            await asyncio.sleep(3.0)  # the background reaches its steady state
        for i, base in enumerate(cases):
            c = await measure_case(sender, base, f"c{clients}-{i}", config, tokenizer, known,
                                   engine)
            out.cases.append(c)
            say(f"  c{clients} {i + 1}/{len(cases)} {c.id}: exact {c.exact_s}, "
                f"spliceable {c.spliceable_s} s, engine {c.engine_s} s, third request "
                f"{c.third_share if c.third_share is None else f'{c.third_share:.0%}'} "
                f"spliced, ready {c.ready_share}")
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    out.background_requests, out.background_errors = counts
    return out


def run_spliceable(config: SpliceableConfig, base: LaunchConfig, engine: Engine, *, out: Path,
                   command: str = "", request_timeout_s: float = 600.0,
                   say: Callable[[str], None] = print) -> SpliceableResult:
    """Every round on one learning server launched from ``base``."""
    from kvnotes.serving.launch import launcher

    machine = MachineRecord.now()
    result = SpliceableResult(config=config, command=command,
                              started=utc_minute())
    measured, background, result.skipped = tool_lists(config, engine.tokenizer)
    launch = launcher.prepare(learning_launch(base, out / "skills", after=config.after,
                                              timeout=request_timeout_s), engine)
    say(f"starting vLLM with the learning front; log: {launch.server.log_path}")

    async def rounds() -> None:
        sender = OpenAISender(launch.url, launch.server.served_name, timeout=request_timeout_s)
        known: set[tuple[int, ...]] = set()
        try:
            for clients in config.background:
                say(f"round beside {clients} background clients (load {load_now()})")
                result.rounds.append(await run_round(
                    sender, measured, background, clients, config, engine.tokenizer, known,
                    engine if config.engine else None, say))
        finally:
            await sender.close()

    with launch:
        say(f"server up at {launch.url} after {launch.server.startup_s:.0f} s")
        asyncio.run(rounds())
    result.launch = launch.record().to_dict()
    machine.finish()
    result.machine = machine.to_dict()
    result.finished = utc_minute()
    return result


# ---- the report -------------------------------------------------------------------------------
def _s(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(result: SpliceableResult) -> str:
    cfg = result.config
    lines = [f"# Time to spliceable: {cfg.model}", "",
             f"- Command: `{result.command}`", f"- Date: {result.started} - {result.finished} UTC",
             f"- Machine: {result.machine.get('cpus')} CPUs, {result.machine.get('cpu_model')}; "
             f"load {result.machine.get('load_average')} to {result.machine.get('load_average_end')}",
             f"- {cfg.cases} new {cfg.tools}-tool lists per round; compiled at sighting "
             f"{cfg.after}; the third request sent as the due sighting's answer "
             f"({cfg.answer_tokens} tokens) completes", "",
             "| round | one exact request p50 | to spliceable, vLLM p50 / p90 | engine compile p50 / "
             "p90 | within one exact request: vLLM / engine | third request spliced (mean, "
             f">= {SHARE_GOAL:.0%}) | ready share |", "|---|---|---|---|---|---|---|"]
    for r in result.rounds:
        s = r.summary()
        lines.append(
            f"| c1{'' if not r.background else f' beside c{r.background}'} "
            f"| {_s(s['exact_p50_s'])} s | {_s(s['spliceable_p50_s'])} / "
            f"{_s(s['spliceable_p90_s'])} s | {_s(s['engine_p50_s'])} / {_s(s['engine_p90_s'])} s "
            f"| {_s(s['vllm_within_exact'], '.0%')} / {_s(s['engine_within_exact'], '.0%')} "
            f"| {_s(s['third_share_mean'], '.0%')}, {_s(s['third_at_goal'], '.0%')} of cases "
            f"| {_s(s['ready_share_mean'], '.0%')} |")
    return "\n".join(lines) + "\n"


def plot(result: SpliceableResult, path: Path) -> None:
    from kvnotes_bench.kit.plots import grouped_bars, panels

    labels = [f"c1 + {r.background} bg" for r in result.rounds]
    sums = [r.summary() for r in result.rounds]
    with panels(path, 2, size=(11.0, 4.0),
                title=f"Time to spliceable, {result.config.model}") as (a, b):
        grouped_bars(a, labels, {k: [float(s[f] or 0.0) for s in sums] for k, f in (
            ("one exact request", "exact_p50_s"), ("to spliceable (vLLM)",
                                                         "spliceable_p50_s"),
            ("engine compile", "engine_p50_s"))})
        a.set_ylabel("seconds (median)")
        a.legend(fontsize=8)
        grouped_bars(b, labels, {"third request": [float(s["third_share_mean"] or 0.0)
                                                   for s in sums],
                                 "ready": [float(s["ready_share_mean"] or 0.0) for s in sums]})
        b.axhline(SHARE_GOAL, color="grey", linestyle="--", linewidth=1)
        b.set_ylabel("share of the prompt spliced")
        b.set_ylim(0, 1)
        b.legend(fontsize=8)


def write_outputs(result: SpliceableResult, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "result.json", "report": out / "report.md",
             "plot": out / "spliceable.png"}
    paths["json"].write_text(result.model_dump_json(indent=2) + "\n")
    paths["report"].write_text(report(result))
    plot(result, paths["plot"])
    return paths
