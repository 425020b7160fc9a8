"""The peers benchmark's result: one row per case and method, one summary per workload and
method, the run's circumstances; ``peers.json`` is :meth:`PeersResult.to_dict`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvnotes_bench.kit.plots import panels
from kvnotes_bench.kit.records import Record
from kvnotes_bench.kit.stats import percentile


@dataclass
class CaseRow(Record):
    """One case under one method. ``first_ok``/``greedy_ok``: its first token / its first
    ``greedy_tokens`` greedy tokens equal recompute's; ``correct``: the task's answer is in
    its greedy text (None: no answer); ``ttft_s``: the median of the timed rounds;
    ``same_ids``: the method tokenized the prompt as recompute did."""

    case: str
    workload: str
    method: str
    prompt_tokens: int
    first_ok: bool
    greedy_ok: bool
    correct: bool | None
    ttft_s: float
    ttfts: list[float]
    reused: int
    fed: int
    same_ids: bool = True
    text: str = ""


@dataclass
class MethodRow(Record):
    """One method on one workload, over its cases (shares are means of per-case shares)."""

    workload: str
    method: str
    cases: int
    first_token_identity: float
    greedy_identity: float
    accuracy: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    reused_share: float
    computed_share: float
    same_ids_share: float
    peak_rss_mb: float | None


def answer_ok(workload: str, text: str, answers: Sequence[str]) -> bool | None:
    """The tool name opens the call (the text after ``{"name": "``); a number is anywhere."""
    if not answers:
        return None
    if workload.startswith("tools"):
        return any(text.startswith(a) for a in answers)
    return any(a in text for a in answers)


def summarize(rows: Sequence[CaseRow], rss: Mapping[str, float]) -> list[MethodRow]:
    """Every (workload, method) of ``rows`` in the order first met; ``rss`` by method."""
    keys = list(dict.fromkeys((r.workload, r.method) for r in rows))
    out = []
    for workload, method in keys:
        rs = [r for r in rows if r.workload == workload and r.method == method]
        graded = [r.correct for r in rs if r.correct is not None]
        out.append(MethodRow(
            workload, method, len(rs),
            first_token_identity=statistics.fmean(r.first_ok for r in rs),
            greedy_identity=statistics.fmean(r.greedy_ok for r in rs),
            accuracy=statistics.fmean(graded) if graded else None,
            ttft_p50_s=percentile([r.ttft_s for r in rs], 50),
            ttft_p90_s=percentile([r.ttft_s for r in rs], 90),
            reused_share=statistics.fmean(r.reused / r.prompt_tokens for r in rs),
            computed_share=statistics.fmean(r.fed / r.prompt_tokens for r in rs),
            same_ids_share=statistics.fmean(r.same_ids for r in rs),
            peak_rss_mb=rss.get(method)))
    return out


@dataclass
class PeersResult:
    """What one run measured, and where and how (``machine``: kit's MachineRecord)."""

    date: str
    command: str
    model: str
    model_dir: str
    split: str
    cases_per_workload: int
    reps: int
    greedy_tokens: int
    best_policy: str
    torch_threads: int
    machine: dict[str, Any]
    methods: dict[str, Any]
    summary: list[MethodRow]
    rows: list[CaseRow]
    kvboost_version: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": [r.to_dict() for r in self.summary],
                "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeersResult:
        known = {f.name for f in fields(cls)} - {"summary", "rows"}
        return cls(**{k: d[k] for k in known if k in d},
                   summary=[MethodRow.from_dict(r) for r in d["summary"]],
                   rows=[CaseRow.from_dict(r) for r in d["rows"]])

    def table(self) -> str:
        head = ("workload", "method", "n", "first", "greedy", "acc", "p50 ms", "p90 ms",
                "reused", "fed", "rss MB")
        lines = [" | ".join(head)]
        for r in self.summary:
            acc = "-" if r.accuracy is None else f"{r.accuracy:.2f}"
            ms = ["-" if x is None else f"{1000 * x:.0f}" for x in (r.ttft_p50_s, r.ttft_p90_s)]
            rss = "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"
            lines.append(" | ".join((r.workload, r.method, str(r.cases),
                                     f"{r.first_token_identity:.2f}", f"{r.greedy_identity:.2f}",
                                     acc, *ms, f"{r.reused_share:.2f}", f"{r.computed_share:.2f}",
                                     rss)))
        return "\n".join(lines)


def plot(result: PeersResult, path: Path) -> None:
    """Greedy identity against TTFT p50, one point per method, one panel per workload."""
    workloads = list(dict.fromkeys(r.workload for r in result.summary))
    methods = list(dict.fromkeys(r.method for r in result.summary))
    with panels(path, len(workloads), size=(max(7.0, 4.2 * len(workloads)), 4.4),
                title=f"{result.model}: {result.greedy_tokens}-token greedy identity vs TTFT "
                      f"p50\n({result.split} split, {result.torch_threads} threads)",
                title_size=10) as axes:
        for ax, workload in zip(axes, workloads, strict=True):
            for i, method in enumerate(methods):
                row = next((r for r in result.summary
                            if r.workload == workload and r.method == method), None)
                if row is None or row.ttft_p50_s is None:
                    continue
                ax.scatter([1000 * row.ttft_p50_s], [row.greedy_identity], label=method,
                           marker="os^vD<>p*"[i % 9], s=50)
            ax.set_title(workload, fontsize=10)
            ax.set_xlabel("TTFT p50 (ms)")
            ax.set_ylim(-0.05, 1.05)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("greedy identity with recompute")
        axes[-1].legend(fontsize=7)
