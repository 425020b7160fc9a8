"""The serving benchmarks' shared kit: phase runner, summary, ratios, formats, records."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from kvnotes_bench.kit.failures import count_kinds
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving import kit
from kvnotes_bench.serving.kit import PhaseSummary, p90_ratios, run_phase, summarize


@dataclass
class Rec:
    ok: bool
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_kind: str | None = None
    skipped: bool = False


def test_summary_counts_failures_apart_from_skipped():
    records = [Rec(True, 0.1, 100, 90), Rec(True, 0.3, 100, 50), Rec(False, error_kind="timeout"),
               Rec(False), Rec(False, skipped=True)]
    s = summarize(records, policy="p", concurrency=2, wall_s=2.0)
    assert (s.requests, s.ok, s.failed, s.skipped) == (5, 2, 2, 1)
    assert s.ttft_p50_s == pytest.approx(0.2) and s.ttft_mean_s == pytest.approx(0.2)
    assert s.hit_rate_usage == pytest.approx(0.7) and s.hit_rate is None
    assert s.errors == {"other": 1, "timeout": 1} and s.requests_per_s == 1.0
    assert s.mean_prompt_tokens == 100.0
    assert "context_tokens" not in s.to_dict()
    assert count_kinds([Rec(False, error_kind="b"), Rec(False, error_kind="a")]) == {"a": 1,
                                                                                   "b": 1}


def _metrics(queries: float, hits: float, prefills: int) -> str:
    return (f"vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\n"
            f"vllm:request_prefill_time_seconds_count {prefills}\n"
            f"vllm:request_prefill_time_seconds_sum {0.5 * prefills}\n")


def test_run_phase_pools_warms_and_reads_metrics_around_the_measured_part():
    counters = {"queries": 0.0, "hits": 0.0, "n": 0}
    inflight = {"now": 0, "max": 0}
    order: list[str] = []

    async def send(item: int) -> list[Rec]:
        inflight["now"] += 1
        inflight["max"] = max(inflight["max"], inflight["now"])
        await asyncio.sleep(0.01)
        inflight["now"] -= 1
        counters["queries"] += 100
        counters["hits"] += 80
        counters["n"] += 1
        order.append(f"send {item}")
        return [Rec(True, 0.01 * item, 100, 80)]

    async def warm(item: int) -> Rec:
        counters["queries"] += 100  # before the first snapshot: not the phase's
        order.append(f"warm {item}")
        return Rec(item != 2, error_kind=None if item != 2 else "http_5xx", error="boom")

    closed = []

    async def cleanup() -> None:
        closed.append(True)

    run = run_phase([1, 2, 3, 4], 2, send, warmup=warm, cleanup=cleanup,
                    metrics_text=lambda: _metrics(counters["queries"], counters["hits"],
                                                  counters["n"]))
    assert inflight["max"] == 2 and closed == [True]
    assert all(o.startswith("warm") for o in order[:4])
    s = summarize(run.records, policy="p", concurrency=2, wall_s=run.wall_s, run=run)
    assert s.hit_rate == pytest.approx(0.8) and s.queries_tokens == 400
    assert s.warmup_failed == 1 and s.warmup_errors == {"http_5xx": 1}
    assert s.breakdown["prefill_s"] == pytest.approx(0.5) and s.breakdown["n"] == 4
    assert len(s.load_before) == len(s.load_after) == 3 and s.metrics_error is None
    assert kit.failure_lines(run) == ["  warm-up failed (http_5xx): boom"]


def test_run_phase_without_metrics_says_so():
    async def send(item: int) -> list[Rec]:
        return [Rec(True, 0.1, 10, 0)]

    run = run_phase([1], 1, send)
    s = summarize(run.records, policy="p", concurrency=1, wall_s=run.wall_s, run=run)
    assert s.hit_rate is None and s.breakdown is None and s.metrics_error == "no /metrics reader"


def _row(policy: str, p90: float | None, conc: int = 1, ctx: int | None = None) -> PhaseSummary:
    return PhaseSummary(policy=policy, concurrency=conc, context_tokens=ctx, requests=1, ok=1,
                        failed=0, skipped=0, ttft_p50_s=p90, ttft_p90_s=p90, ttft_p99_s=p90,
                        ttft_mean_s=p90, hit_rate=None, hit_rate_usage=None,
                        queries_tokens=None, hits_tokens=None, requests_per_s=None, wall_s=1.0,
                        mean_prompt_tokens=None)


def test_p90_ratios_per_row():
    rows = [_row("erratum", 0.5, 1, 8000), _row("in-place", 20.0, 1, 8000),
            _row("erratum", 1.0, 4, 8000), _row("cold", None, 4, 8000),
            _row("in-place", 3.0, 1, 1000)]  # no erratum at 1000: no row
    ratios = p90_ratios(rows, reference="erratum", others=("in-place", "cold"))
    assert [r.to_dict() for r in ratios] == [
        {"context_tokens": 8000, "concurrency": 1, "in-place_over_erratum_p90": 40.0},
        {"context_tokens": 8000, "concurrency": 4, "cold_over_erratum_p90": None}]


def test_machine_record():
    m = MachineRecord.now()
    assert m.cpus and len(m.load_average) == 3 and m.load_average_end is None
    m.finish()
    assert set(m.to_dict()) == {"cpus", "cpu_model", "cpu_flags", "load_average",
                                "load_average_end"}
