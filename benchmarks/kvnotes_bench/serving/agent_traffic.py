"""``kvnotes-bench serve agent``: what an agent's traffic gets from kvnotes with no registration.

Agent traffic is sent as an agent framework sends it (the ``openai`` SDK's chat completions,
:mod:`~kvnotes_bench.serving.agent_traffic_client`) to kvnotes' OpenAI front with learning on
(:func:`learning_launch`): tools as ``tools=``, documents as content parts
(:mod:`~kvnotes_bench.serving.agent_traffic_requests`). Four parts, each optional:

- ``tools``: BFCL ``live_multiple`` development cases through the fidelity protocol
  (:mod:`~kvnotes_bench.serving.agent_traffic_protocol`): seen twice, learned, then measured in
  another order against ``splice: false`` (share spliced, tool choice, first token, 16 greedy
  tokens);
- ``documents``: the same for the airline policy documents sent as content parts;
- ``overhead``: TTFT of a first-sight request against ``splice: false`` and of a request beside
  a background compile against one without (:mod:`~kvnotes_bench.serving.agent_traffic_overhead`;
  timings: run on an idle machine);
- ``soak``: a second server whose library is capped below the working set, several clients
  sending random tool subsets, every answer checked against the engine
  (:mod:`~kvnotes_bench.serving.agent_traffic_soak`).

The result (:class:`AgentResult`) records the date, the command, the machine and its load, the
torch threads and the launched servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.config import DEFAULT_COMPILE_NICE, front_repair
from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.serving.agent_traffic_overhead import Timing
from kvnotes_bench.serving.agent_traffic_protocol import (
    CaseRecord,
    FidelitySummary,
    ProtocolConfig,
    summarize,
)
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig, SoakRecord, SoakSummary

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.serving.launch.launcher import Launch, LaunchConfig
    from kvnotes.serving.planning.chunks import SeenChunk

PARTS = ("tools", "documents", "overhead", "soak")


@dataclass(frozen=True)
class AgentBenchConfig:
    """What ``serve-bench agent`` runs.

    Args:
        model: the model alias (its served name once launched).
        parts: which of :data:`PARTS` run.
        cases: BFCL ``live_multiple`` development cases (spread over the file).
        docs: document requests; ``docs_k`` documents each.
        protocol: the fidelity protocol's settings (sightings, tokens, learning timeout).
        repeats: pairs per timing of the ``overhead`` part.
        learn: serve with learning on (off: today's front, every request forwarded or planned
            from registered skills only; a baseline, and the smoke run of the client code).
        library_cap_bytes: the soak server's library cap (smaller than the working set).
        soak: the soak's traffic.
        tenant: sent as ``kvnotes.tenant`` (None: the front's default tenant).
        max_context: prompts longer than this (tokens, as the tokenizer counts the request's
            text) are left out and listed.
        repair: the launched front's repair as ``kvnotes serve --repair`` spells it (``K`` or
            ``K@F``; None: the front's default).
        compile_nice: the learner's compile thread nice value (``kvnotes serve
            --learn-compile-nice``).
        guard: the launched front's guard as ``kvnotes serve --guard`` spells it (``auto``:
            the model's calibrated default, :mod:`kvnotes.core.model_defaults`). The soak's
            server runs without one: its answers are checked against the engine's splice.
    """

    model: str = "smollm2-135m"
    parts: tuple[str, ...] = PARTS
    cases: int = 40
    docs: int = 20
    docs_k: int = 3
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    repeats: int = 10
    learn: bool = True
    library_cap_bytes: int = 64 << 20
    soak: AgentSoakConfig = field(default_factory=AgentSoakConfig)
    tenant: str | None = None
    max_context: int = 3500
    repair: str | None = None
    compile_nice: int = DEFAULT_COMPILE_NICE
    guard: str = "auto"

    def __post_init__(self) -> None:
        from kvnotes.serving.front.guard_defaults import parse_guard

        parse_guard(self.guard)
        unknown = set(self.parts) - set(PARTS)
        if unknown or not self.parts:
            raise InvalidArgumentError(f"--parts {','.join(self.parts)}: use some of "
                                       f"{', '.join(PARTS)}")
        if self.cases < 0 or self.docs < 0 or self.repeats < 1:
            raise InvalidArgumentError("--cases and --docs must be >= 0, --repeats >= 1")
        if self.library_cap_bytes < 1:
            raise InvalidArgumentError("--library-cap must be a positive size")
        if self.repair is not None:
            front_repair(self.repair)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentBenchConfig:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        if "parts" in kw:
            kw["parts"] = tuple(kw["parts"])
        if isinstance(kw.get("protocol"), dict):
            proto = dict(kw["protocol"])
            proto["repairs"] = tuple(proto.get("repairs") or ())
            kw["protocol"] = ProtocolConfig(**proto)
        if isinstance(kw.get("soak"), dict):
            kw["soak"] = AgentSoakConfig(**kw["soak"])
        return cls(**kw)


def learning_launch(base: LaunchConfig, skills: Path, *, cap_bytes: int | None = None,
                    after: int = 2, learn: bool = True, timeout: float = 600.0,
                    repair: str | None = None,
                    compile_nice: int = DEFAULT_COMPILE_NICE,
                    guard: float = 0.0) -> LaunchConfig:
    """``base`` with the connector over ``skills`` and the OpenAI front in front of it.

    With ``learn``, the front learns on sight (``kvnotes serve --learn``): a
    :class:`~kvnotes.serving.front.config.LearnConfig` with ``after`` (a chunk is compiled once
    seen that many times, per tenant) and ``library_cap=cap_bytes`` (``--library-cap``; None: no
    cap). Without it, the front is today's: it splices only registered skills. ``repair``:
    the front's repair (``K`` or ``K@F``; None: its default). ``compile_nice``: the learner's
    compile thread nice value. ``guard``: the front's tau (0: off).
    """
    from kvnotes.serving.front.config import FrontConfig, LearnConfig

    front = FrontConfig(timeout=timeout, guard=guard)
    if repair is not None:
        front = dataclasses.replace(front, repair=front_repair(repair))
    if learn:
        front = dataclasses.replace(front, learn=LearnConfig(after=after, library_cap=cap_bytes,
                                                              compile_nice=compile_nice))
    return dataclasses.replace(base, skills=skills, front=front)


@dataclass
class AgentResult:
    """Everything one ``serve-bench agent`` run measured; :meth:`to_dict` is its JSON."""

    config: AgentBenchConfig
    machine: MachineRecord
    started: str = ""
    finished: str = ""
    command: str = ""
    threads: dict[str, int] = field(default_factory=dict)  # torch and Python threads
    launches: dict[str, Any] = field(default_factory=dict)  # "main", "soak": LaunchRecord dicts
    cases: dict[str, list[CaseRecord]] = field(default_factory=dict)  # "tools", "documents"
    skipped: list[dict[str, Any]] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    guard_tau: float | None = None  # the main server's front guard (None: not launched)
    soak_records: list[SoakRecord] = field(default_factory=list)
    soak: dict[str, Any] = field(default_factory=dict)  # summary, evictions, library bytes
    notes: list[str] = field(default_factory=list)

    def summaries(self) -> list[FidelitySummary]:
        """Per set, the front's repair, then each ``kvnotes.repair`` variant measured."""
        return [summarize(kind, recs, repair) for kind, recs in self.cases.items()
                for repair in (None, *self.config.protocol.repairs)]

    def soak_summary(self) -> SoakSummary | None:
        from kvnotes_bench.serving.agent_traffic_soak import summarize as soak_summarize

        return soak_summarize(self.soak_records) if self.soak_records else None

    def to_dict(self) -> dict[str, Any]:
        soak = self.soak_summary()
        return {"workload": "agent", "config": self.config.to_dict(), "started": self.started,
                "finished": self.finished, "command": self.command,
                "machine": self.machine.to_dict(), "threads": self.threads,
                "launches": self.launches, "guard_tau": self.guard_tau,
                "summaries": [s.to_dict() for s in self.summaries()],
                "timings": [t.to_dict() for t in self.timings],
                "soak": {**self.soak, "summary": None if soak is None else soak.to_dict()},
                "notes": self.notes, "skipped": self.skipped,
                "cases": {k: [r.to_dict() for r in v] for k, v in self.cases.items()},
                "soak_requests": [r.to_dict() for r in self.soak_records]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentResult:
        """Read back :meth:`to_dict`."""
        return cls(config=AgentBenchConfig.from_dict(d.get("config") or {}),
                   machine=MachineRecord.from_dict(d.get("machine") or {}),
                   started=d.get("started", ""), finished=d.get("finished", ""),
                   command=d.get("command", ""), threads=dict(d.get("threads") or {}),
                   launches=dict(d.get("launches") or {}), guard_tau=d.get("guard_tau"),
                   cases={k: [CaseRecord.from_dict(r) for r in v]
                          for k, v in (d.get("cases") or {}).items()},
                   skipped=list(d.get("skipped") or []),
                   timings=[Timing.from_dict(t) for t in d.get("timings") or []],
                   soak_records=[SoakRecord.from_dict(r) for r in d.get("soak_requests") or []],
                   soak={k: v for k, v in (d.get("soak") or {}).items() if k != "summary"},
                   notes=list(d.get("notes") or []))


def utc_minute() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def thread_counts() -> dict[str, int]:
    """The benchmark process's torch threads and Python threads (timings depend on both)."""
    import torch

    return {"torch": torch.get_num_threads(), "torch_interop": torch.get_num_interop_threads(),
            "python": threading.active_count()}


# ---- the requests -----------------------------------------------------------------------------
def _fits(tokenizer: Any, request: AgentRequest, limit: int) -> int | None:
    """The request's token count when it fits ``limit`` (its messages' and tools' text, the
    template's few tokens aside), else None."""
    import json

    text = json.dumps(request.body(), ensure_ascii=False)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    return n if n <= limit else None


def tool_set(config: AgentBenchConfig, tokenizer: Any
             ) -> tuple[list[AgentRequest], list[dict[str, Any]]]:
    """The tools part's requests (BFCL ``live_multiple`` development cases, spread over the
    file) and the cases left out for length."""
    from kvnotes_bench.serving.agent_traffic_requests import tool_requests
    from kvnotes_bench.tools.data import load_cases, spread

    kept: list[AgentRequest] = []
    skipped: list[dict[str, Any]] = []
    for r in tool_requests(spread(load_cases("live_multiple"), config.cases * 2)):
        if len(kept) >= config.cases:
            break
        if _fits(tokenizer, r, config.max_context) is None:
            skipped.append({"id": r.id, "why": f"over {config.max_context} tokens"})
        else:
            kept.append(r)
    return kept, skipped


def document_set(config: AgentBenchConfig) -> list[AgentRequest]:
    """The documents part's requests (airline policy documents as content parts)."""
    from kvnotes_bench.serving.agent_traffic_requests import document_requests
    from kvnotes_bench.serving.prompt_sets import skill_texts

    return document_requests(skill_texts(), config.docs, config.docs_k, config.protocol.seed)


# ---- the run ----------------------------------------------------------------------------------
def run_agent(config: AgentBenchConfig, base: LaunchConfig, engine: Engine, *, out: Path,
              request_timeout_s: float = 600.0, command: str = "",
              say: Callable[[str], None] = print) -> AgentResult:
    """Every part of ``config`` on servers launched from ``base`` (see the module docstring)."""
    from kvnotes.serving.launch import launcher

    notes = []
    if not config.learn:
        notes.append("learning off (--no-learn): the front splices registered skills only, "
                     "and no compile runs beside the compile timing's probes; the figures are "
                     "today's front's, not the feature's")
        # nothing is learned: waiting for it would only idle
        config = dataclasses.replace(config, protocol=dataclasses.replace(
            config.protocol, learn_timeout_s=0.0))
    result = AgentResult(config=config, machine=MachineRecord.now(), started=utc_minute(),
                         command=command, threads=thread_counts(), notes=notes)
    tokenizer = engine.tokenizer
    tools, skipped = tool_set(config, tokenizer) if (
        "tools" in config.parts or "soak" in config.parts) else ([], [])
    result.skipped = skipped
    main_parts = [p for p in config.parts if p != "soak"]
    if main_parts:
        from kvnotes.serving.front.guard_defaults import resolve_guard

        guard_tau, why = resolve_guard(config.guard, config.model)
        result.guard_tau = guard_tau
        say(f"guard: {why}")
        launch = launcher.prepare(learning_launch(
            base, out / "skills", cap_bytes=None, after=config.protocol.sightings,
            learn=config.learn, timeout=request_timeout_s, repair=config.repair,
            compile_nice=config.compile_nice, guard=guard_tau), engine)
        say(f"starting vLLM ({launch.model.dtype}) with the connector and the front"
            f"{' (learning)' if config.learn else ''}; log: {launch.server.log_path}")
        with launch:
            say(f"server up at {launch.url} after {launch.server.startup_s:.0f} s")
            asyncio.run(_main_parts(config, launch, tools, result, request_timeout_s, say,
                                    tokenizer))
        result.launches["main"] = launch.record().to_dict()
        attach_breakdowns(result, tokenizer)
    if "soak" in config.parts:
        _soak_part(config, base, engine, tools, result, out=out,
                   request_timeout_s=request_timeout_s, say=say)
    result.machine.finish()
    result.finished = utc_minute()
    return result


def laid_chunks(tokenizer: Any, request: AgentRequest) -> list[SeenChunk]:
    """A request's chunks as the front lays them out (the ones its learner counts)."""
    from kvnotes.serving.planning.chat_render import lay_out_chat, render_chat_parts

    return list(lay_out_chat(tokenizer, render_chat_parts(tokenizer, request.messages(),
                                                          request.tools()).parts).chunks)


def learnable_chunks(tokenizer: Any) -> Callable[[AgentRequest], list[tuple[int, ...]]]:
    """A request's chunks' token ids as the front lays them out (:func:`laid_chunks`)."""
    return lambda request: [c.token_ids for c in laid_chunks(tokenizer, request)]


def attach_breakdowns(result: AgentResult, tokenizer: Any) -> None:
    """Each measured answer's :class:`~.agent_traffic_share.ShareBreakdown`: the request
    (rebuilt from the run's config) laid out as the front does, against the plan the answer
    reports. Works on a result read back from its JSON too."""
    from kvnotes_bench.serving.agent_traffic_share import answer_breakdown, chunk_spans

    config = result.config
    tools = tool_set(config, tokenizer)[0] if "tools" in result.cases else []
    docs = document_set(config) if config.docs and "documents" in result.cases else []
    by_id = {r.id: r for r in (*tools, *docs)}
    for records in result.cases.values():
        for rec in records:
            request = by_id.get(rec.id)
            if request is None:
                continue
            layout = chunk_spans(request.reordered(config.protocol.seed), tokenizer)
            rec.breakdown = answer_breakdown(rec.spliced, layout)
            for v in rec.variants:
                v.breakdown = answer_breakdown(v.answer, layout)


async def _main_parts(config: AgentBenchConfig, launch: Launch, tools: Sequence[AgentRequest],
                      result: AgentResult, timeout: float, say: Callable[[str], None],
                      tokenizer: Any) -> None:
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender
    from kvnotes_bench.serving.agent_traffic_overhead import compile_overhead, miss_overhead
    from kvnotes_bench.serving.agent_traffic_protocol import run_cases

    sender = OpenAISender(launch.url, launch.server.served_name, timeout=timeout,
                          tenant=config.tenant)
    try:
        if "tools" in config.parts and tools:
            say(f"tools: {len(tools)} BFCL live_multiple cases (load {load_now()})")
            result.cases["tools"] = await run_cases(sender, tools, config.protocol,
                                                    learnable=learnable_chunks(tokenizer),
                                                    log=say)
        docs = document_set(config) if config.docs and (
            "documents" in config.parts or "overhead" in config.parts) else []
        if "documents" in config.parts and docs:
            say(f"documents: {len(docs)} requests of {config.docs_k} documents "
                f"(load {load_now()})")
            result.cases["documents"] = await run_cases(sender, docs, config.protocol,
                                                        learnable=learnable_chunks(tokenizer),
                                                        log=say)
        if "overhead" in config.parts:
            bases = list(tools) or docs
            if not bases:
                result.notes.append("overhead: no requests to time (--cases and --docs 0)")
                return
            say(f"overhead: {config.repeats} pairs per timing (load {load_now()})")
            result.timings.append(await miss_overhead(sender, bases, config.repeats, log=say))
            result.timings.append(await compile_overhead(
                sender, bases, config.repeats, sightings=config.protocol.sightings, log=say))
    finally:
        await sender.close()


def _soak_part(config: AgentBenchConfig, base: LaunchConfig, engine: Engine,
               tools: Sequence[AgentRequest], result: AgentResult, *, out: Path,
               request_timeout_s: float, say: Callable[[str], None]) -> None:
    import random

    from kvnotes.serving.launch import launcher
    from kvnotes.serving.vllm_endpoints import Client
    from kvnotes_bench.serving.agent_traffic_check import AgentOracle, CheckConfig, KeptEntries
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender
    from kvnotes_bench.serving.agent_traffic_records import RECORDS_NAME, write_records
    from kvnotes_bench.serving.agent_traffic_requests import tool_pool
    from kvnotes_bench.serving.agent_traffic_soak import (
        EntryKeeper,
        check_records,
        evictions,
        soak_clients,
    )

    everything = tool_pool(tools)
    pool = random.Random(f"kvnotes-agent-pool:{config.soak.seed}").sample(
        everything, min(config.soak.pool, len(everything)))
    questions = sorted({r.question for r in tools})
    if len(pool) < config.soak.tools_max or not questions:
        result.notes.append(f"soak: a pool of {len(pool)} tools is too small")
        return
    base = dataclasses.replace(base, log_path=out / "server-soak.log")
    launch = launcher.prepare(learning_launch(
        base, out / "soak-skills", cap_bytes=config.library_cap_bytes,
        after=config.soak.sightings, learn=config.learn, timeout=request_timeout_s,
        compile_nice=config.compile_nice), engine)
    assert launch.skills is not None  # learning_launch sets the skill folder
    keeper = EntryKeeper(launch.skills.folder, out / "soak-entries")
    say(f"soak: {config.soak.requests} requests from {config.soak.clients} clients over "
        f"{len(pool)} tools, library cap {config.library_cap_bytes} bytes; log: "
        f"{launch.server.log_path}")

    def metrics_texts() -> list[str]:
        texts = []
        for url in dict.fromkeys((launch.url, launch.server.url)):
            try:
                texts.append(Client(url).metrics_text())
            except Exception as err:  # noqa: BLE001  # a missing /metrics only loses a figure
                result.notes.append(f"soak: /metrics of {url} unreadable: {err}")
        return texts

    async def clients() -> tuple[list[tuple[SoakRecord, AgentRequest]], float]:
        sender = OpenAISender(launch.url, launch.server.served_name, timeout=request_timeout_s,
                              tenant=config.tenant)
        stop = asyncio.Event()
        keeping = asyncio.create_task(keeper.run(stop))
        try:
            return await soak_clients(sender, pool, questions, config.soak, say=say)
        finally:
            stop.set()
            await keeping
            await sender.close()

    with launch:
        say(f"server up at {launch.url} after {launch.server.startup_s:.0f} s")
        before = evictions(metrics_texts())
        records, wall = asyncio.run(clients())
        after = evictions(metrics_texts())
    result.launches["soak"] = launch.record().to_dict()
    result.soak = {"wall_s": round(wall, 2), "pool_tools": len(pool),
                   "library_cap_bytes": config.library_cap_bytes,
                   "library_bytes_published": keeper.bytes_kept(),
                   "entries_published": len(keeper.kept),
                   "evictions": None if after is None else after - (before or 0.0)}
    if after is None:
        result.notes.append("soak: the server's /metrics export no eviction counter (no "
                            "series named *evict*): evictions are not reported")
    say(f"soak: {len(records)} requests in {wall:.0f} s; checking every answer against the "
        "engine")
    from kvnotes.serving.library.manifest import ServingManifest

    entries = KeptEntries(keeper.keep, ServingManifest.read(launch.skills.folder).fingerprint_obj)
    check = CheckConfig(max_tokens=config.soak.max_tokens, eos=tuple(sorted(engine.eos_ids)),
                        tie_tau=config.soak.tie_tau, drift_tau=config.soak.drift_tau)
    oracle = AgentOracle(engine, entries)
    rows = check_records(records, oracle, engine.tokenizer, check, tenant=config.tenant, say=say)
    result.soak["references"] = oracle.computed  # one per checked answer
    result.soak["records"] = write_records(rows, out / RECORDS_NAME).name
    result.soak_records = [r for r, _ in records]
