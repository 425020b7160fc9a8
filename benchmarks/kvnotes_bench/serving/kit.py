"""What the serving workloads share: a measured phase, its summary, ratios between policies and
the server record (the machine record, failure kinds and number formats are
:mod:`kvnotes_bench.kit`'s).

A *phase* is one policy at one concurrency level (and, for the erratum, one context length):
``concurrency`` asyncio workers take the phase's items one at a time and send their requests;
``/metrics`` is read just before and after, so the deltas of vLLM's prefix-cache counters and
per-request histograms belong to that phase alone (phases never overlap). Each workload keeps its
own request record and adds its own figures (decisions, fidelity) next to the shared
:class:`PhaseSummary`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from kvnotes.core.errors import ServingError
from kvnotes.serving.vllm_endpoints import Client, info_labels
from kvnotes_bench.kit.failures import count_kinds
from kvnotes_bench.kit.formats import fmt_kinds, fmt_pct, fmt_s
from kvnotes_bench.kit.machine import load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.serving.metrics import (
    HISTOGRAMS,
    PrefixCacheCounters,
    parse_prometheus,
    ttft_breakdown,
)

__all__ = ["failure_lines", "Outcome", "p90_ratios", "P90Ratio", "phase_line", "PhaseRun",
           "PhaseSummary", "run_phase", "Sent", "ServerRecord", "summarize"]

Item = TypeVar("Item")
Rec = TypeVar("Rec", bound="Outcome")


# ---- one phase ------------------------------------------------------------------------------
class Sent(Protocol):
    """What the kit reads from any request's outcome (a warm-up's too)."""

    ok: bool
    error: str | None
    error_kind: str | None


class Outcome(Sent, Protocol):
    """What the shared summary reads from a workload's measured request record."""

    skipped: bool
    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass
class PhaseRun:
    """What a phase measured before it is summarized: records, warm-ups, /metrics around it."""

    records: list[Any]
    warmups: list[Any]
    wall_s: float
    metrics_before: dict[str, float] | None
    metrics_after: dict[str, float] | None
    metrics_error: str | None
    load_before: list[float]
    load_after: list[float]


def _snapshot(metrics_text: Callable[[], str] | None) -> tuple[dict[str, float] | None,
                                                               str | None]:
    if metrics_text is None:
        return None, "no /metrics reader"
    try:
        return parse_prometheus(metrics_text()), None
    except ServingError as err:
        return None, str(err)


def _observed(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> float:
    """Requests whose prefill time vLLM observed between two snapshots (inf: not exported)."""
    name = f"{HISTOGRAMS['prefill_s']}_count"
    if before is None or after is None or name not in after:
        return math.inf
    return after[name] - before.get(name, 0.0)


async def _pool(items: Sequence[Item], concurrency: int,
                job: Callable[[Item], Awaitable[None]]) -> None:
    """``job(item)`` for every item, at most ``concurrency`` at a time (workers take the next
    item when they finish one)."""
    it = iter(items)

    async def worker() -> None:
        for item in it:  # one iterator shared by the workers (one thread: no lock needed)
            await job(item)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))


async def _measure(items: Sequence[Item], concurrency: int,
                   send: Callable[[Item], Awaitable[Sequence[Any]]],
                   warmup: Callable[[Item], Awaitable[Any]] | None,
                   metrics_text: Callable[[], str] | None) -> PhaseRun:
    records: list[Any] = []
    warm: list[Any] = []

    async def warm_one(item: Item) -> None:
        out = await warmup(item)  # type: ignore[misc]  # only pooled when warmup is given
        if out is not None:
            warm.append(out)

    async def send_one(item: Item) -> None:
        records.extend(await send(item))

    load_before = load_now()
    if warmup is not None:
        await _pool(items, concurrency, warm_one)
    before, err0 = await asyncio.to_thread(_snapshot, metrics_text)
    t0 = time.perf_counter()
    await _pool(items, concurrency, send_one)
    wall = time.perf_counter() - t0
    after, err1 = await asyncio.to_thread(_snapshot, metrics_text)
    # vLLM observes a finished request's histograms just after its last chunk leaves: wait
    # (briefly) until every answered request is counted, so the phase owns its deltas
    answered = sum(1 for r in records if r.ttft_s is not None)
    for _ in range(20):
        if after is None or _observed(before, after) >= answered:
            break
        await asyncio.sleep(0.05)
        after, err1 = await asyncio.to_thread(_snapshot, metrics_text)
    return PhaseRun(records=records, warmups=warm, wall_s=wall, metrics_before=before,
                    metrics_after=after, metrics_error=err0 or err1, load_before=load_before,
                    load_after=load_now())


def run_phase(items: Sequence[Item], concurrency: int,
              send: Callable[[Item], Awaitable[Sequence[Rec]]], *,
              warmup: Callable[[Item], Awaitable[Sent | None]] | None = None,
              metrics_text: Callable[[], str] | None = None,
              cleanup: Callable[[], Awaitable[None]] | None = None) -> PhaseRun:
    """Measure one phase: every item's warm-up (not measured), then ``send(item)`` for every item
    with ``concurrency`` workers, /metrics read around the measured part.

    Args:
        items: what the workers take one at a time (the erratum's sessions, the skills' prompts).
        concurrency: workers (requests in flight at most).
        send: sends one item's requests, returns their records (each an :class:`Outcome`).
        warmup: sends one item's unmeasured request first (its outcome is counted apart).
        metrics_text: reads the server's ``/metrics`` text (None: no server-side figures).
        cleanup: awaited at the end, also on error (e.g. closing an async client).
    """
    async def main() -> PhaseRun:
        try:
            return await _measure(items, concurrency, send, warmup, metrics_text)
        finally:
            if cleanup is not None:
                await cleanup()

    return asyncio.run(main())


@dataclass
class PhaseSummary(Record):
    """The figures every serving workload reports for one phase.

    ``hit_rate`` comes from the delta of vLLM's prefix-cache counters (what its own prefix cache
    reused), ``hit_rate_usage`` from the responses' ``cached_tokens`` (which also counts tokens
    a KV connector supplied). ``breakdown`` says where the mean TTFT went (vLLM's histograms).
    ``context_tokens`` labels the row where a workload varies it (None otherwise).
    """

    policy: str
    concurrency: int
    requests: int
    ok: int
    failed: int  # measured requests the server failed (kinds in ``errors``)
    skipped: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    hit_rate: float | None
    hit_rate_usage: float | None
    queries_tokens: float | None
    hits_tokens: float | None
    requests_per_s: float | None
    wall_s: float
    mean_prompt_tokens: float | None
    context_tokens: int | None = None
    errors: dict[str, int] = field(default_factory=dict)
    warmup_failed: int = 0
    warmup_errors: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, Any] | None = None
    load_before: list[float] | None = None  # 1/5/15-minute load average around the phase
    load_after: list[float] | None = None
    metrics_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.context_tokens is None:
            del out["context_tokens"]
        return out


def _delta(run: PhaseRun) -> tuple[PrefixCacheCounters | None, str | None]:
    if run.metrics_before is None or run.metrics_after is None:
        return None, run.metrics_error
    try:
        after = PrefixCacheCounters.from_metrics(run.metrics_after)
        return after - PrefixCacheCounters.from_metrics(run.metrics_before), run.metrics_error
    except KeyError as err:
        return None, run.metrics_error or str(err.args[0])


def summarize(records: Sequence[Outcome], *, policy: str, concurrency: int, wall_s: float,
              run: PhaseRun | None = None, context_tokens: int | None = None) -> PhaseSummary:
    """The shared figures of one phase from its records and (when given) its :class:`PhaseRun`'s
    /metrics snapshots, warm-ups and load."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    usage = [r for r in ok if r.prompt_tokens and r.cached_tokens is not None]
    failed = [r for r in records if not r.ok and not r.skipped]
    delta, metrics_error = _delta(run) if run is not None else (None, None)
    summary = PhaseSummary(
        policy=policy, concurrency=concurrency, context_tokens=context_tokens,
        requests=len(records), ok=len(ok), failed=len(failed),
        skipped=sum(1 for r in records if r.skipped),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None,
        hit_rate=delta.hit_rate if delta else None,
        hit_rate_usage=(sum(r.cached_tokens or 0 for r in usage)
                        / sum(r.prompt_tokens or 0 for r in usage) if usage else None),
        queries_tokens=delta.queries if delta else None, hits_tokens=delta.hits if delta else None,
        requests_per_s=len(ok) / wall_s if wall_s > 0 and ok else None, wall_s=wall_s,
        mean_prompt_tokens=(sum(r.prompt_tokens or 0 for r in ok) / len(ok)
                            if ok and all(r.prompt_tokens for r in ok) else None),
        errors=count_kinds(failed), metrics_error=metrics_error)
    if run is not None:
        if run.metrics_before is not None and run.metrics_after is not None:
            summary.breakdown = ttft_breakdown(run.metrics_before, run.metrics_after,
                                               client_ttft_mean_s=summary.ttft_mean_s)
        failed_warm = [w for w in run.warmups if not w.ok]
        summary.warmup_failed = len(failed_warm)
        summary.warmup_errors = count_kinds(failed_warm)
        summary.load_before, summary.load_after = run.load_before, run.load_after
    return summary


def failure_lines(run: PhaseRun, limit: int = 3) -> list[str]:
    """The first failed warm-ups and requests of a phase, one line each, for the run's log."""
    warm = [f"  warm-up failed ({w.error_kind}): {w.error}" for w in run.warmups if not w.ok]
    sent = [f"  request failed ({r.error_kind}): {r.error}" for r in run.records
            if not r.ok and not r.skipped]
    return warm[:limit] + sent[:limit]


def phase_line(s: PhaseSummary) -> str:
    """One log line per finished phase."""
    return (f"  ok {s.ok}/{s.requests}  ttft p50 {fmt_s(s.ttft_p50_s)}  p90 {fmt_s(s.ttft_p90_s)}"
            f"  hit rate {fmt_pct(s.hit_rate)} (usage {fmt_pct(s.hit_rate_usage)})  errors: "
            f"{fmt_kinds(s.errors)}")


# ---- ratios ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class P90Ratio:
    """p90 TTFT of other policies over a reference policy's, for one row (concurrency and, where
    the workload varies it, context length). A missing or zero p90 gives None."""

    concurrency: int
    context_tokens: int | None
    reference: str
    over: dict[str, float | None]  # other policy -> its p90 / the reference's

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.context_tokens is None else {
            "context_tokens": self.context_tokens}
        out["concurrency"] = self.concurrency
        for other, value in self.over.items():
            out[f"{other}_over_{self.reference}_p90"] = value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> P90Ratio:
        """Read back :meth:`to_dict` (the reference is in the keys' names)."""
        over: dict[str, float | None] = {}
        reference = ""
        for key, value in d.items():
            if key.endswith("_p90") and "_over_" in key:
                other, _, reference = key[:-len("_p90")].partition("_over_")
                over[other] = value
        return cls(concurrency=d["concurrency"], context_tokens=d.get("context_tokens"),
                   reference=reference, over=over)


def p90_ratios(summaries: Sequence[PhaseSummary], *, reference: str,
               others: Sequence[str]) -> list[P90Ratio]:
    """One :class:`P90Ratio` per (context, concurrency) row that measured ``reference``."""
    table: dict[tuple[int, int], dict[str, PhaseSummary]] = {}
    for s in summaries:
        ctx = -1 if s.context_tokens is None else s.context_tokens
        table.setdefault((ctx, s.concurrency), {})[s.policy] = s
    out = []
    for (ctx, conc), row in sorted(table.items()):
        ref = row.get(reference)
        if ref is None:
            continue
        over: dict[str, float | None] = {}
        for other in others:
            o = row.get(other)
            if o is None:
                continue
            over[other] = (o.ttft_p90_s / ref.ttft_p90_s
                           if o.ttft_p90_s and ref.ttft_p90_s else None)
        out.append(P90Ratio(concurrency=conc, context_tokens=None if ctx < 0 else ctx,
                            reference=reference, over=over))
    return out


# ---- the server -----------------------------------------------------------------------------
@dataclass
class ServerRecord:
    """The server a run measured, as it reports itself (its block size from
    ``vllm:cache_config_info``, or the launched one when /metrics does not say)."""

    url: str
    version: str | None
    models: list[str]
    max_model_len: int | None
    block_size: int | None
    cache_config: dict[str, str]

    @classmethod
    def read(cls, client: Client, model: str, *, block_size: int | None = None,
             log: Callable[[str], None] = lambda s: None) -> ServerRecord:
        text = ""
        try:
            text = client.metrics_text()
        except ServingError as err:
            log(f"/metrics unreadable ({err}): hit rates and the TTFT breakdown will be missing")
        cache = info_labels(text)
        served = cache.get("block_size")
        return cls(url=client.url, version=client.version(), models=client.models(),
                   max_model_len=client.max_model_len(model),
                   block_size=int(served) if served else block_size, cache_config=cache)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServerRecord:
        """Read back :meth:`to_dict`."""
        return cls(url=d.get("url", ""), version=d.get("version"),
                   models=list(d.get("models", [])), max_model_len=d.get("max_model_len"),
                   block_size=d.get("block_size"), cache_config=dict(d.get("cache_config", {})))
