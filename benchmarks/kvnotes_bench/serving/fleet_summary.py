"""``serve-bench fleet``'s figures from a :class:`~kvnotes_bench.serving.fleet.FleetResult`
(read through :class:`FleetFigures`, what of it they need): the ``share`` part's summary, the
soak's windows between faults, and the shared store's goals, each with its value and whether
it is met (None: not measured)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Protocol

from kvnotes_bench.serving.fleet_parts import (
    MISS_GOAL,
    SHARE_GOAL,
    TTFT_GOAL,
    FetchCost,
    ShareCase,
    TtftRun,
    ttft_overhead,
)
from kvnotes_bench.serving.fleet_soak import FaultEvent, Window, windows

HIT_GOAL = 0.9  # the soak's hit rate in every window between faults

if TYPE_CHECKING:
    from kvnotes_bench.serving.agent_traffic_soak import SoakRecord, SoakSummary


class FleetFigures(Protocol):
    """What the figures read of a fleet run's result (a ``FleetResult``)."""

    share: list[ShareCase]
    compiles: dict[str, dict[str, int]]
    ttft: list[TtftRun]
    fetch: FetchCost | None
    miss: Any  # agent_traffic_overhead.Timing | None
    soak_records: list[SoakRecord]
    faults: list[FaultEvent]
    soak: dict[str, Any]

    def soak_summary(self) -> SoakSummary | None: ...



def share_summary(result: FleetFigures) -> dict[str, Any]:
    """The ``share`` part: share spliced on host B (mean, min), identical answers, entries that
    reached B before its request, and compiles against the new chunks (one each, fleet-wide)."""
    cases = result.share
    shares = [s for c in cases if (s := c.share) is not None]
    same = [i for c in cases if (i := c.identical) is not None]
    by_host: dict[str, int] = {}
    for c in cases:
        for host, n in c.compiles.items():
            by_host[host] = by_host.get(host, 0) + n
    end = {h: int(v.get("compiles", 0)) for h, v in result.compiles.items()}
    return {"cases": len(cases), "measured": len(shares),
            "share_mean": statistics.fmean(shares) if shares else None,
            "share_min": min(shares) if shares else None,
            "identical": sum(same) / len(same) if same else None,
            "learned": sum(c.learned for c in cases),
            "mirrored": sum(c.mirrored for c in cases),
            "expected_compiles": sum(c.expected for c in cases),
            "compiles_in_cases": by_host,
            "compiles": sum(end.values()) if end else None, "compiles_by_host": end}


def soak_windows(result: FleetFigures) -> list[Window]:
    return windows(result.soak_records, result.faults) if result.soak_records else []


def _goal(value: Any, goal: str, met: bool | None) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": met}


def goals(result: FleetFigures) -> dict[str, dict[str, Any]]:
    """The shared store's goals: each ``{"value", "goal", "met"}``."""
    out: dict[str, dict[str, Any]] = {}
    if result.share:
        s = share_summary(result)
        mean, same = s["share_mean"], s["identical"]
        out["share_spliced"] = _goal(mean, f">= {SHARE_GOAL:.0%} of prompt tokens spliced on B",
                                     None if mean is None else mean >= SHARE_GOAL)
        out["share_identical"] = _goal(same, "B's answers identical to splice: false",
                                       None if same is None else same == 1.0)
        compiles = s["compiles"]
        out["share_compiles"] = _goal(
            compiles, f"one compile per new chunk for the fleet ({s['expected_compiles']})",
            None if compiles is None else compiles == s["expected_compiles"])
    for c in sorted({r.concurrency for r in result.ttft}):
        ov = ttft_overhead(result.ttft, c)
        out[f"ttft_c{c}"] = _goal(ov, f"p90 TTFT through Redis within {TTFT_GOAL:.0%} of the "
                                  "folder store", None if ov is None else ov <= TTFT_GOAL)
    if result.miss is not None:
        ov = result.miss.overhead
        out["miss"] = _goal(ov, f"a miss <= {MISS_GOAL:.0%} TTFT over splice: false",
                            None if ov is None else ov <= MISS_GOAL)
    if result.fetch is not None:
        out["fetch_s_per_mb"] = _goal(result.fetch.s_per_mb, "reported", None)
    summary = result.soak_summary()
    if summary is not None:
        out["soak_failed"] = _goal(summary.failed, "0 failed", summary.failed == 0)
        out["soak_wrong"] = _goal(summary.wrong, "0 wrong (checked against the engine)",
                                  summary.wrong == 0)
        # an answer that could not be checked is no evidence either way: said apart
        out["soak_unchecked"] = _goal(summary.unchecked, "every answer checked",
                                      summary.unchecked == 0)
        done = sum(e.ok for e in result.faults)
        out["soak_faults"] = _goal(done, f"{len(result.faults)} faults done",
                                   done == len(result.faults))
        low = [w.label for w in soak_windows(result)
               if w.hit_rate_compiled is not None and w.hit_rate_compiled < HIT_GOAL]
        out["soak_hit_rate"] = _goal(low, f"hit rate >= {HIT_GOAL:.0%} in every window between "
                                     "faults, over requests sent after one of their tools was "
                                     "compiled (the windows below it named)", not low)
        lost = (result.soak or {}).get("published_lost") or {}
        if lost:
            out["soak_lost"] = _goal(lost.get("lost"), f"0 of the {lost.get('published')} "
                                     "entries published after the last destructive fault "
                                     "lost", lost.get("lost") == 0)
    return out
