"""``kvnotes-bench serve erratum``: erratum vs in-place vs cold on an OpenAI-compatible vLLM server.

For every context length and concurrency level, fresh sessions are generated (their ids carry a
run tag, so no run finds another run's prompts in the prefix cache). Each cache-using policy
first sends every session's original prompt once (warm-up, not measured: the server has seen
the context before the edits arrive), then the measured stream of edits: ``concurrency``
asyncio workers, each taking one session at a time and sending its edits in order through
``openai.AsyncOpenAI``. ``/metrics`` is read just before and after the measured stream; phases
never overlap, so the deltas of the prefix-cache counters (hit rate) and of vLLM's per-request
histograms (where the time to first token went) belong to one policy. Server failures (HTTP
errors, dropped connections, timeouts) are counted per phase by kind, never raised.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError, ServingError, UnknownNameError
from kvnotes.ops.decisions import parse_answer
from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving import kit
from kvnotes_bench.serving.client import Client, StreamResult, open_client, stream_chat
from kvnotes_bench.serving.kit import (
    P90Ratio,
    PhaseSummary,
    ServerRecord,
    failure_lines,
    p90_ratios,
    phase_line,
    summarize,
)
from kvnotes_bench.serving.metrics import agreement
from kvnotes_bench.serving.workload import (
    DEFAULT_ERRATA,
    ERRATA_FORMS,
    POLICIES,
    QUESTIONS,
    Session,
    make_sessions,
)

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import LaunchRecord

__all__ = ["Answers", "ErratumBenchConfig", "ErratumPhase", "ErratumResult", "RequestRecord",
           "matrix_config", "run_benchmark", "validate_block_size"]

CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend takes block sizes in steps of 32
MATRIX_CONTEXTS = (1000, 4000, 8000)
MATRIX_OPTIONAL_CONTEXTS = (16000,)  # run when the model's context allows it
MATRIX_CONCURRENCY = (1, 4, 16)
MATRIX_REQUESTS_PER_ROW = 16


def validate_block_size(block_size: int | None) -> int | None:
    """``block_size`` when a launched CPU server accepts it (a positive multiple of 32)."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or block_size % CPU_BLOCK_MULTIPLE:
        raise InvalidArgumentError(
            f"--block-size must be a positive multiple of {CPU_BLOCK_MULTIPLE} (vLLM's CPU "
            f"backend), got {block_size!r}: try 32, 64 or 128")
    return block_size


@dataclass
class ErratumBenchConfig:
    """What one serve-bench run measures (all requests bounded in number and time).

    ``optional_contexts`` run only when the server's context limit allows them (the rest are
    listed as skipped). A row (context, concurrency, policy) measures ``sessions_for(c) x
    edits`` requests: at least ``sessions``, one session per concurrent stream, and enough
    sessions for ``requests_per_row``. ``block_size`` is the KV block size of a server that
    kvnotes launches (None: vLLM's default); a running server's is read from its /metrics.
    """

    model: str = "smollm2-135m"
    context_tokens: tuple[int, ...] = (1000, 4000, 8000)
    field_depth: float = 0.1
    sessions: int = 4
    edits: int = 4
    concurrency: tuple[int, ...] = (1, 4, 16)
    policies: tuple[str, ...] = POLICIES
    max_tokens: int = 8
    request_timeout_s: float = 600.0
    time_budget_s: float | None = None
    seed: int = 0
    requests_per_row: int = 0
    optional_contexts: tuple[int, ...] = ()
    block_size: int | None = None
    question: str = "decision"  # what each request asks (workload.QUESTIONS)
    errata: str = DEFAULT_ERRATA  # how the erratum policy writes its corrections (ERRATA_FORMS)

    def __post_init__(self) -> None:
        if self.question not in QUESTIONS:
            raise UnknownNameError("question", self.question, QUESTIONS)
        if self.errata not in ERRATA_FORMS:
            raise UnknownNameError("errata form", self.errata, ERRATA_FORMS)
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise UnknownNameError("policy", bad[0], POLICIES)
        if not self.context_tokens or min(self.context_tokens + self.optional_contexts) < 64:
            raise InvalidArgumentError("context lengths must be at least 64 tokens")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError("concurrency levels must be at least 1")
        if self.sessions < 1 or self.edits < 1:
            raise InvalidArgumentError("need at least one session and one edit")
        if self.requests_per_row < 0:
            raise InvalidArgumentError(f"--requests-per-row must be 0 or more, got "
                                       f"{self.requests_per_row}")
        if self.max_tokens < 1:
            raise InvalidArgumentError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.request_timeout_s <= 0:
            raise InvalidArgumentError("--request-timeout must be positive")
        validate_block_size(self.block_size)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ErratumBenchConfig:
        """Read back ``asdict(config)``; a run stored before ``errata`` existed appended its
        corrections."""
        names = {f.name for f in fields(cls)}
        options: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                   for k, v in d.items() if k in names}
        return cls(**{"errata": "append", **options})

    def sessions_for(self, concurrency: int) -> int:
        """Sessions of a row at this concurrency."""
        return max(self.sessions, concurrency, math.ceil(self.requests_per_row / self.edits))


def matrix_config(**overrides: Any) -> ErratumBenchConfig:
    """The full matrix: contexts 1k/4k/8k (16k where the model allows it), concurrency 1/4/16,
    in-place/erratum/cold, at least 16 measured requests per row; ``overrides`` win."""
    base: dict[str, Any] = dict(context_tokens=MATRIX_CONTEXTS,
                                optional_contexts=MATRIX_OPTIONAL_CONTEXTS,
                                concurrency=MATRIX_CONCURRENCY, policies=POLICIES,
                                requests_per_row=MATRIX_REQUESTS_PER_ROW)
    return ErratumBenchConfig(**{**base, **overrides})


@dataclass
class RequestRecord(Record):
    """One measured request."""

    context_tokens: int
    concurrency: int
    policy: str
    session: str
    turn: int
    ok: bool
    ttft_s: float | None
    total_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str
    decision: str | None
    expected: str
    error: str | None = None
    skipped: bool = False
    error_kind: str | None = None
    stale: str | None = None  # the answer the session's original value gives


class _Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at


@dataclass
class Answers:
    """What one phase's answers say: parsed decisions, accuracy, stale answers, agreement."""

    decisions: dict[str, int] = field(default_factory=dict)
    accuracy: float | None = None  # decision == the right answer for the new value
    # decision == the original value's answer, over the edits whose right answer differs
    # from it (the edits were missed)
    stale_rate: float | None = None
    agreement_with_in_place: float | None = None
    agreement_n: int = 0

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> Answers:
        ok = [r for r in records if r.ok]
        changed = [r for r in ok if r.stale is not None and r.stale != r.expected]
        decisions: dict[str, int] = {}
        for r in ok:
            key = r.decision or "unparsed"
            decisions[key] = decisions.get(key, 0) + 1
        return cls(decisions=decisions,
                   accuracy=sum(1 for r in ok if r.decision == r.expected) / len(ok)
                   if ok else None,
                   stale_rate=(sum(1 for r in changed if r.decision == r.stale) / len(changed)
                               if changed else None))


@dataclass
class ErratumPhase:
    """One row of the erratum benchmark: the shared figures and what the answers say."""

    phase: PhaseSummary
    answers: Answers

    def to_dict(self) -> dict[str, Any]:
        return {**self.phase.to_dict(), **asdict(self.answers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ErratumPhase:
        """Read back :meth:`to_dict` (one flat row: the shared figures and the answers')."""
        answers = {f.name: d[f.name] for f in fields(Answers) if f.name in d}
        return cls(PhaseSummary.from_dict(d), Answers(**answers))


@dataclass
class SkippedContext:
    context_tokens: int
    reason: str


@dataclass
class ErratumResult:
    """Everything one erratum run measured; :meth:`to_dict` is the ``result.json`` schema."""

    config: ErratumBenchConfig
    contexts: list[int]
    contexts_skipped: list[SkippedContext]
    server: ServerRecord
    machine: MachineRecord
    run_id: str
    wall_s: float
    phases: list[ErratumPhase]
    sessions: list[dict[str, Any]]
    requests: list[RequestRecord]
    launch: LaunchRecord | None = None  # set when kvnotes started the server
    how: str | None = None  # the command that ran it, when it was not `kvnotes-bench serve`

    def ratios(self) -> list[P90Ratio]:
        """p90 TTFT of in-place and cold over the erratum's, per (context, concurrency)."""
        return p90_ratios([p.phase for p in self.phases], reference="erratum",
                          others=("in-place", "cold"))

    def errors(self) -> dict[str, int]:
        """Failed requests and warm-ups of the whole run, by kind."""
        out: dict[str, int] = {}
        for p in self.phases:
            for src in (p.phase.errors, p.phase.warmup_errors):
                for k, v in src.items():
                    out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        out = {"config": asdict(self.config), "contexts": self.contexts,
               "contexts_skipped": [asdict(s) for s in self.contexts_skipped],
               "server": self.server.to_dict(), "machine": self.machine.to_dict(),
               "run_id": self.run_id, "wall_s": self.wall_s,
               "summaries": [p.to_dict() for p in self.phases], "errors": self.errors(),
               "ratios": [r.to_dict() for r in self.ratios()], "sessions": self.sessions,
               "requests": [asdict(r) for r in self.requests]}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        if self.how is not None:
            out["how"] = self.how
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ErratumResult:
        """Read back :meth:`to_dict` (a stored ``result.json``)."""
        config = ErratumBenchConfig.from_dict(d["config"])
        launch = d.get("launch")
        return cls(config=config, contexts=list(d.get("contexts") or config.context_tokens),
                   contexts_skipped=[SkippedContext(s["context_tokens"], s["reason"])
                                     for s in d.get("contexts_skipped") or []],
                   server=ServerRecord.from_dict(d["server"]),
                   machine=MachineRecord.from_dict(d.get("machine") or {}),
                   run_id=d.get("run_id", ""), wall_s=d["wall_s"],
                   phases=[ErratumPhase.from_dict(s) for s in d["summaries"]],
                   sessions=[dict(s) for s in d.get("sessions") or []],
                   requests=[RequestRecord.from_dict(r) for r in d.get("requests") or []],
                   launch=_launch_record(launch) if launch else None, how=d.get("how"))


def _launch_record(d: Mapping[str, Any]) -> LaunchRecord:
    """A stored launch record; the shorter notes the quiet-machine scripts wrote read with
    neutral values for the fields they lack (no model folder, no process)."""
    from kvnotes.serving.launch.launcher import LaunchRecord

    command = d.get("command")
    return LaunchRecord(model_dir=d.get("model_dir", ""), dtype=d.get("dtype", "?"),
                        block_size=d.get("block_size"), max_model_len=d.get("max_model_len", 0),
                        kv_cache_gib=d.get("kv_cache_gib", 0),
                        connector=d.get("connector", False),
                        command=command if isinstance(command, list) else
                        [command] if command else [],
                        startup_s=d.get("startup_s"), pid=d.get("pid"),
                        stopped=d.get("stopped", True))


def run_phase(client: Client, sessions: Sequence[Session], policy: str, *, config: ErratumBenchConfig,
              concurrency: int, context_tokens: int, deadline: _Deadline,
              log: Callable[[str], None] = lambda s: None) -> tuple[ErratumPhase,
                                                                   list[RequestRecord]]:
    """Warm-up (cache-using policies), then the measured edit streams of one policy: one worker
    per concurrent stream, each sending one session's edits in order."""
    api = open_client(client.url, timeout=config.request_timeout_s)

    async def send(prompt: str) -> StreamResult:
        salt = secrets.token_hex(16) if policy == "cold" else None
        return await stream_chat(api, config.model, prompt, max_tokens=config.max_tokens,
                                 cache_salt=salt, timeout=config.request_timeout_s)

    async def warm_up(s: Session) -> StreamResult | None:
        return None if deadline.passed() else await send(s.warmup_prompt())

    async def stream(s: Session) -> list[RequestRecord]:
        out = []
        for turn in s.turns:
            base: dict[str, Any] = dict(context_tokens=context_tokens, concurrency=concurrency, policy=policy,
                        session=s.session_id, turn=turn.index,
                        expected=s.expected(turn.index), stale=s.stale)
            if deadline.passed():
                out.append(RequestRecord(**base, ok=False, ttft_s=None, total_s=None,
                                         prompt_tokens=None, cached_tokens=None, text="",
                                         decision=None, error="time budget exhausted",
                                         skipped=True))
                continue
            r = await send(s.prompt(policy, turn.index))
            out.append(RequestRecord(
                **base, ok=r.ok, ttft_s=r.ttft_s, total_s=r.total_s,
                prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, text=r.text,
                decision=parse_answer(r.text, s.answers) if r.ok else None, error=r.error,
                error_kind=r.error_kind))
        return out

    run = kit.run_phase(sessions, concurrency, stream,
                        warmup=None if policy == "cold" else warm_up,
                        metrics_text=client.metrics_text, cleanup=api.close)
    records = sorted(run.records, key=lambda r: (r.session, r.turn))
    summary = summarize(records, policy=policy, concurrency=concurrency, wall_s=run.wall_s,
                        run=run, context_tokens=context_tokens)
    for line in failure_lines(run):
        log(line)
    return ErratumPhase(summary, Answers.of(records)), records


TEMPLATE_MARGIN = 48  # chat-template tokens around the user message (SmolLM2's adds 30)


def _longest_prompt(sessions: Sequence[Session], config: ErratumBenchConfig,
                    count_tokens: Callable[[str], int]) -> int:
    """Tokens the longest request of these sessions needs: its prompt (the last edit, erratum or
    in-place), the chat template and the answer."""
    last = config.edits - 1
    return max(count_tokens(s.prompt(p, last)) for s in sessions
               for p in ("erratum", "in-place")) + TEMPLATE_MARGIN + config.max_tokens


def _plan(config: ErratumBenchConfig, limit: int | None, run_id: str,
          count_tokens: Callable[[str], int]) -> tuple[list[tuple[int, dict[int, list[Session]]]],
                                                      list[SkippedContext]]:
    """The sessions of every (context, concurrency), built before anything is measured, and
    the optional contexts the server's context limit leaves out. A required context that does
    not fit raises, before any request is sent."""
    plan, skipped = [], []
    for ctx in sorted(set(config.context_tokens) | set(config.optional_contexts)):
        required = ctx in config.context_tokens
        reason = f"the server's max model length is {limit} tokens"
        if limit is not None and ctx + TEMPLATE_MARGIN + config.max_tokens > limit:
            need = ctx + TEMPLATE_MARGIN + config.max_tokens  # no need to build the sessions
        else:
            rows = {conc: make_sessions(config.sessions_for(conc), context_tokens=ctx,
                                        depth=config.field_depth, edits=config.edits,
                                        count_tokens=count_tokens,
                                        tag=f"{run_id}-c{ctx}-k{conc}", seed=config.seed,
                                        question=config.question,
                                        errata=config.errata)
                    for conc in config.concurrency}
            need = max(_longest_prompt(v, config, count_tokens) for v in rows.values())
            if limit is None or need <= limit:
                plan.append((ctx, rows))
                continue
            reason += f" (the longest prompt needs about {need})"
        if required:
            raise ServingError(f"{reason}, too short for {ctx}-token contexts with "
                               f"{config.edits} edits (about {need} tokens): lower "
                               "--context-tokens or --edits, or start the server with a larger "
                               "--max-model-len")
        skipped.append(SkippedContext(ctx, reason))
    return plan, skipped


def run_benchmark(client: Client, config: ErratumBenchConfig, *,
                  count_tokens: Callable[[str], int] | None = None,
                  log: Callable[[str], None] = print) -> ErratumResult:
    """Run every (context, concurrency, policy) phase of ``config`` on the server ``client``
    talks to."""
    served = client.models()
    if config.model not in served:
        raise ServingError(f"the server at {client.url} does not serve {config.model!r}; it "
                           f"serves {served} (pass --model with one of these)")
    if count_tokens is None:
        memo: dict[str, int] = {}

        def count_tokens(text: str) -> int:
            if text not in memo:
                memo[text] = client.count_tokens(config.model, text)
            return memo[text]

    server = ServerRecord.read(client, config.model, block_size=config.block_size, log=log)
    run_id = secrets.token_hex(3)
    plan, skipped_contexts = _plan(config, server.max_model_len, run_id, count_tokens)
    for sk in skipped_contexts:
        log(f"context {sk.context_tokens} skipped: {sk.reason}")
    deadline = _Deadline(config.time_budget_s)
    phases: list[ErratumPhase] = []
    records: list[RequestRecord] = []
    sessions_meta: list[dict[str, Any]] = []
    machine = MachineRecord.now()
    t_start = time.perf_counter()
    for ctx, rows in plan:
        for conc, sessions in rows.items():
            sessions_meta += [dict(session=s.session_id, context_tokens=s.context_tokens,
                                   field_token_depth=round(s.field_token_depth, 4),
                                   initial=s.initial, edits=[t.new for t in s.turns])
                              for s in sessions]
            by_policy: dict[str, list[RequestRecord]] = {}
            for policy in config.policies:
                log(f"context {ctx}, concurrency {conc}, {policy}: {len(sessions)} sessions x "
                    f"{config.edits} edits (load {load_now()})")
                phase, recs = run_phase(client, sessions, policy, config=config,
                                        concurrency=conc, context_tokens=ctx,
                                        deadline=deadline, log=log)
                phases.append(phase)
                records += recs
                by_policy[policy] = recs
                log(phase_line(phase.phase))
            _agree_with_in_place(phases[-len(config.policies):], by_policy)
    machine.finish()
    return ErratumResult(config=config, contexts=[ctx for ctx, _ in plan],
                         contexts_skipped=skipped_contexts, server=server, machine=machine,
                         run_id=run_id, wall_s=time.perf_counter() - t_start, phases=phases,
                         sessions=sessions_meta, requests=records)


def _agree_with_in_place(phases: Sequence[ErratumPhase],
                         by_policy: dict[str, list[RequestRecord]]) -> None:
    """Each policy's decisions against in-place's for the same session and edit."""
    ref = {(r.session, r.turn): r.decision for r in by_policy.get("in-place", []) if r.ok}
    for p in phases:
        if p.phase.policy == "in-place" or not ref:
            continue
        mine = {(r.session, r.turn): r.decision for r in by_policy[p.phase.policy] if r.ok}
        same, n = agreement(mine, ref)
        p.answers.agreement_with_in_place = same / n if n else None
        p.answers.agreement_n = n
