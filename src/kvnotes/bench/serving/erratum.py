"""serve-bench: erratum vs in-place vs cold on an OpenAI-compatible vLLM server.

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

import asyncio
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvnotes.bench.serving.metrics import (
    HISTOGRAMS,
    PrefixCacheCounters,
    agreement,
    info_labels,
    parse_prometheus,
    percentile,
    ttft_breakdown,
)
from kvnotes.bench.serving.report import _fmt, _pct, markdown_table, ratios, write_outputs
from kvnotes.bench.serving.workload import (
    DEFAULT_ERRATA,
    ERRATA_FORMS,
    POLICIES,
    QUESTIONS,
    Session,
    make_sessions,
)
from kvnotes.core.errors import InvalidArgumentError, ServingError, UnknownNameError
from kvnotes.core.machine import cpu_flags, cpu_model, load_average
from kvnotes.ops.decisions import parse_answer
from kvnotes.serving.client import Client, StreamResult, stream_chat

__all__ = ["BenchConfig", "PhaseSummary", "RequestRecord", "machine_state", "markdown_table", "ratios",
           "matrix_config", "run_benchmark", "validate_block_size", "write_outputs"]

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
class BenchConfig:
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

    def sessions_for(self, concurrency: int) -> int:
        """Sessions of a row at this concurrency."""
        return max(self.sessions, concurrency, math.ceil(self.requests_per_row / self.edits))

    def total_requests(self, contexts: int | None = None) -> int:
        """An upper bound on the requests a run sends (warm-ups included)."""
        n = 0
        for c in self.concurrency:
            s = self.sessions_for(c)
            for p in self.policies:
                n += s * self.edits + (0 if p == "cold" else s)
        return n * (len(self.context_tokens) if contexts is None else contexts)


def matrix_config(**overrides: Any) -> BenchConfig:
    """The full matrix of issue 15: contexts 1k/4k/8k (16k where the model allows it),
    concurrency 1/4/16, in-place/erratum/cold, at least 16 measured requests per row."""
    base: dict[str, Any] = dict(context_tokens=MATRIX_CONTEXTS,
                                optional_contexts=MATRIX_OPTIONAL_CONTEXTS,
                                concurrency=MATRIX_CONCURRENCY, policies=POLICIES,
                                requests_per_row=MATRIX_REQUESTS_PER_ROW)
    return BenchConfig(**{**base, **overrides})


@dataclass
class RequestRecord:
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


@dataclass
class PhaseSummary:
    """Per (context, concurrency, policy): latency, cache, error and decision figures."""

    context_tokens: int
    concurrency: int
    policy: str
    requests: int
    ok: int
    failed: int  # measured requests the server failed (kinds in ``errors``)
    skipped: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    hit_rate: float | None  # from /metrics deltas
    hit_rate_usage: float | None  # sum(cached_tokens) / sum(prompt_tokens) from the responses
    queries_tokens: float | None
    hits_tokens: float | None
    requests_per_s: float | None
    wall_s: float
    mean_prompt_tokens: float | None
    decisions: dict[str, int] = field(default_factory=dict)
    accuracy: float | None = None  # decision == the right answer for the new value
    # decision == the original value's answer, over the edits whose right answer differs
    # from it (the edits were missed)
    stale_rate: float | None = None
    agreement_with_in_place: float | None = None
    agreement_n: int = 0
    ttft_mean_s: float | None = None
    errors: dict[str, int] = field(default_factory=dict)  # measured failures by kind
    warmup_failed: int = 0
    warmup_errors: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, Any] | None = None  # where the mean TTFT went (vLLM's histograms)
    load_before: list[float] | None = None  # 1/5/15-minute load average around the phase
    load_after: list[float] | None = None
    metrics_error: str | None = None


class _Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at


def _load() -> list[float]:
    return [round(x, 2) for x in load_average()]


def machine_state() -> dict[str, Any]:
    """CPUs, CPU model and SIMD flags of this machine (the server runs here too), load now."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "load_average": _load()}


def _snapshot(client: Client) -> tuple[dict[str, float] | None, str | None]:
    try:
        return parse_prometheus(client.metrics_text()), None
    except ServingError as err:
        return None, str(err)


def _observed(before: dict[str, float] | None, after: dict[str, float] | None) -> float:
    """Requests whose prefill time vLLM observed between two snapshots (inf: not exported)."""
    name = f"{HISTOGRAMS['prefill_s']}_count"
    if before is None or after is None or name not in after:
        return math.inf
    return after[name] - before.get(name, 0.0)


async def _pool(items: Sequence[Any], concurrency: int,
                job: Callable[[Any], Any]) -> None:
    """``job(item)`` for every item, at most ``concurrency`` at a time (workers take the next
    item when they finish one)."""
    it = iter(items)

    async def worker() -> None:
        for item in it:  # one iterator shared by the workers (one thread: no lock needed)
            await job(item)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))


async def _phase(client: Client, sessions: Sequence[Session], policy: str, *,
                 config: BenchConfig, concurrency: int, context_tokens: int,
                 deadline: _Deadline) -> tuple[list[RequestRecord], list[StreamResult], Any]:
    records: list[RequestRecord] = []
    warm: list[StreamResult] = []
    api = client.async_openai(timeout=config.request_timeout_s)

    async def send(prompt: str) -> StreamResult:
        salt = secrets.token_hex(16) if policy == "cold" else None
        return await stream_chat(api, config.model, prompt, max_tokens=config.max_tokens,
                                 cache_salt=salt, timeout=config.request_timeout_s)

    async def warm_up(s: Session) -> None:
        if not deadline.passed():
            warm.append(await send(s.warmup_prompt()))

    async def stream(s: Session) -> None:
        for turn in s.turns:
            base = dict(context_tokens=context_tokens, concurrency=concurrency, policy=policy,
                        session=s.session_id, turn=turn.index,
                        expected=s.expected(turn.index), stale=s.stale)
            if deadline.passed():
                records.append(RequestRecord(**base, ok=False, ttft_s=None, total_s=None,
                                             prompt_tokens=None, cached_tokens=None, text="",
                                             decision=None, error="time budget exhausted",
                                             skipped=True))
                continue
            r = await send(s.prompt(policy, turn.index))
            records.append(RequestRecord(
                **base, ok=r.ok, ttft_s=r.ttft_s, total_s=r.total_s,
                prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens, text=r.text,
                decision=parse_answer(r.text, s.answers) if r.ok else None, error=r.error,
                error_kind=r.error_kind))

    try:
        if policy != "cold":
            await _pool(sessions, concurrency, warm_up)
        before = await asyncio.to_thread(_snapshot, client)
        t0 = time.perf_counter()
        await _pool(sessions, concurrency, stream)
        wall = time.perf_counter() - t0
        after = await asyncio.to_thread(_snapshot, client)
        # vLLM observes a finished request's histograms just after its last chunk leaves: wait
        # (briefly) until every answered request is counted, so the phase owns its deltas
        answered = sum(1 for r in records if r.ttft_s is not None)
        for _ in range(20):
            if _observed(before[0], after[0]) >= answered:
                break
            await asyncio.sleep(0.05)
            after = await asyncio.to_thread(_snapshot, client)
    finally:
        await api.close()
    return records, warm, (before, after, wall)


def run_phase(client: Client, sessions: Sequence[Session], policy: str, *, config: BenchConfig,
              concurrency: int, context_tokens: int, deadline: _Deadline,
              log: Callable[[str], None] = lambda s: None) -> tuple[PhaseSummary,
                                                                   list[RequestRecord]]:
    """Warm-up (cache-using policies), then the measured edit streams of one policy."""
    load_before = _load()
    records, warm, ((m0, err0), (m1, err1), wall) = asyncio.run(_phase(
        client, sessions, policy, config=config, concurrency=concurrency,
        context_tokens=context_tokens, deadline=deadline))
    records.sort(key=lambda r: (r.session, r.turn))
    delta = None
    if m0 is not None and m1 is not None:
        try:
            delta = PrefixCacheCounters.from_metrics(m1) - PrefixCacheCounters.from_metrics(m0)
        except KeyError as err:
            err0 = err0 or str(err.args[0])
    summary = summarize(records, policy=policy, concurrency=concurrency,
                        context_tokens=context_tokens, wall_s=wall, delta=delta)
    if m0 is not None and m1 is not None:
        summary.breakdown = ttft_breakdown(m0, m1, client_ttft_mean_s=summary.ttft_mean_s)
    summary.metrics_error = err0 or err1
    failed_warm = [r for r in warm if not r.ok]
    summary.warmup_failed = len(failed_warm)
    summary.warmup_errors = _count_kinds(failed_warm)
    summary.load_before, summary.load_after = load_before, _load()
    for r in failed_warm[:3]:
        log(f"  warm-up failed ({r.error_kind}): {r.error}")
    for r in [r for r in records if not r.ok and not r.skipped][:3]:
        log(f"  request failed ({r.error_kind}): {r.error}")
    return summary, records


def _count_kinds(items: Sequence[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in items:
        key = r.error_kind or "other"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def summarize(records: Sequence[RequestRecord], *, policy: str, concurrency: int,
              context_tokens: int, wall_s: float,
              delta: PrefixCacheCounters | None) -> PhaseSummary:
    """The figures of one phase from its request records and its /metrics delta."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    usage = [r for r in ok if r.prompt_tokens and r.cached_tokens is not None]
    failed = [r for r in records if not r.ok and not r.skipped]
    changed = [r for r in ok if r.stale is not None and r.stale != r.expected]
    decisions: dict[str, int] = {}
    for r in ok:
        key = r.decision or "unparsed"
        decisions[key] = decisions.get(key, 0) + 1
    return PhaseSummary(
        context_tokens=context_tokens, concurrency=concurrency, policy=policy,
        requests=len(records), ok=len(ok), failed=len(failed),
        skipped=sum(1 for r in records if r.skipped),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        hit_rate=delta.hit_rate if delta else None,
        hit_rate_usage=(sum(r.cached_tokens for r in usage) / sum(r.prompt_tokens for r in usage)
                        if usage else None),
        queries_tokens=delta.queries if delta else None, hits_tokens=delta.hits if delta else None,
        requests_per_s=len(ok) / wall_s if wall_s > 0 and ok else None, wall_s=wall_s,
        mean_prompt_tokens=(sum(r.prompt_tokens for r in ok if r.prompt_tokens) / len(ok)
                            if ok and all(r.prompt_tokens for r in ok) else None),
        decisions=decisions,
        accuracy=sum(1 for r in ok if r.decision == r.expected) / len(ok) if ok else None,
        stale_rate=(sum(1 for r in changed if r.decision == r.stale) / len(changed)
                    if changed else None),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
        errors=_count_kinds(failed))


TEMPLATE_MARGIN = 48  # chat-template tokens around the user message (SmolLM2's adds 30)


def _longest_prompt(sessions: Sequence[Session], config: BenchConfig,
                    count_tokens: Callable[[str], int]) -> int:
    """Tokens the longest request of these sessions needs: its prompt (the last edit, erratum or
    in-place), the chat template and the answer."""
    last = config.edits - 1
    return max(count_tokens(s.prompt(p, last)) for s in sessions
               for p in ("erratum", "in-place")) + TEMPLATE_MARGIN + config.max_tokens


def _plan(config: BenchConfig, limit: int | None, run_id: str,
          count_tokens: Callable[[str], int]) -> tuple[list[tuple[int, dict[int, list[Session]]]],
                                                      list[dict[str, Any]]]:
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
        skipped.append({"context_tokens": ctx, "reason": reason})
    return plan, skipped


def run_benchmark(client: Client, config: BenchConfig, *,
                  count_tokens: Callable[[str], int] | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every (context, concurrency, policy) phase; returns the JSON-ready result."""
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

    limit = client.max_model_len(config.model)
    run_id = secrets.token_hex(3)
    plan, skipped_contexts = _plan(config, limit, run_id, count_tokens)
    contexts = [ctx for ctx, _ in plan]
    for sk in skipped_contexts:
        log(f"context {sk['context_tokens']} skipped: {sk['reason']}")
    metrics_text = ""
    try:
        metrics_text = client.metrics_text()
    except ServingError as err:
        log(f"/metrics unreadable ({err}): hit rates and the TTFT breakdown will be missing")
    cache_info = info_labels(metrics_text)
    server_block = cache_info.get("block_size")
    deadline = _Deadline(config.time_budget_s)
    summaries: list[PhaseSummary] = []
    records: list[RequestRecord] = []
    sessions_meta: list[dict[str, Any]] = []
    machine = machine_state()
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
                    f"{config.edits} edits (load {_load()})")
                summary, recs = run_phase(client, sessions, policy, config=config,
                                          concurrency=conc, context_tokens=ctx,
                                          deadline=deadline, log=log)
                summaries.append(summary)
                records += recs
                by_policy[policy] = recs
                errs = ", ".join(f"{k} {v}" for k, v in summary.errors.items()) or "none"
                log(f"  ok {summary.ok}/{summary.requests}  ttft p50 {_fmt(summary.ttft_p50_s)}"
                    f"  p90 {_fmt(summary.ttft_p90_s)}  hit rate {_pct(summary.hit_rate)}"
                    f"  errors: {errs}")
            ref = {(r.session, r.turn): r.decision for r in by_policy.get("in-place", []) if r.ok}
            for summary in summaries[-len(config.policies):]:
                if summary.policy == "in-place" or not ref:
                    continue
                mine = {(r.session, r.turn): r.decision for r in by_policy[summary.policy]
                        if r.ok}
                same, n = agreement(mine, ref)
                summary.agreement_with_in_place = same / n if n else None
                summary.agreement_n = n
    machine["load_average_end"] = _load()
    return {
        "config": asdict(config),
        "contexts": contexts,
        "contexts_skipped": skipped_contexts,
        "server": {"url": client.url, "version": client.version(), "models": served,
                   "max_model_len": limit,
                   "block_size": int(server_block) if server_block else config.block_size,
                   "cache_config": cache_info},
        "machine": machine,
        "run_id": run_id,
        "wall_s": time.perf_counter() - t_start,
        "summaries": [asdict(s) for s in summaries],
        "errors": _total_errors(summaries),
        "ratios": ratios(summaries),
        "sessions": sessions_meta,
        "requests": [asdict(r) for r in records],
    }


def _total_errors(summaries: Sequence[PhaseSummary]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in summaries:
        for src in (s.errors, s.warmup_errors):
            for k, v in src.items():
                out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))
