"""The soak's records and result: one request with its answer and verdict
(:class:`SoakRecord`), everything one soak measured (:class:`SoakResult`, the ``result.json``
schema) and its figures (:func:`summarize`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.serving.soak_check import KINDS, Prompt, Verdict
from kvnotes_bench.serving.soak_client import Answer
from kvnotes_bench.serving.soak_events import EventRecord
from kvnotes_bench.serving.soak_workload import RequestSpec, SoakConfig

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import LaunchRecord
    from kvnotes_bench.serving.corun import CorunResult


@dataclass
class SoakRecord:
    """One request of the soak, with its answer and, once checked, its verdict."""

    index: int
    client: int
    spec: RequestSpec
    sent_s: float  # seconds after the run started
    answer: Answer
    verdict: Verdict | None = None
    after_damage: bool = False

    def to_dict(self) -> dict[str, Any]:
        a = self.answer
        p = self.spec.prompt
        return {"index": self.index, "client": self.client, "kind": self.spec.kind,
                "skills": list(p.skills), "user": p.user, "max_tokens": p.max_tokens,
                "volatile_at": p.volatile_at, "tenant": self.spec.tenant,
                "close_after": self.spec.close_after,
                "volatile": self.spec.volatile, "after_damage": self.after_damage,
                "sent_s": round(self.sent_s, 3), "ok": a.ok, "disconnected": a.disconnected,
                "error": a.error, "error_kind": a.error_kind, "ttft_s": a.ttft_s,
                "total_s": a.total_s, "prompt_tokens": a.prompt_tokens,
                "cached_tokens": a.cached_tokens, "finish_reason": a.finish_reason,
                "token_ids": a.token_ids,
                "top": [{str(k): v for k, v in d.items()} for d in a.top],
                "verdict": None if self.verdict is None else self.verdict.to_dict()}


    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SoakRecord:
        """Read back :meth:`to_dict`, its verdict included."""
        prompt = Prompt(tuple(d["skills"]), d["user"], d["max_tokens"], d["volatile_at"])
        spec = RequestSpec(d["kind"], prompt, d["tenant"], d["close_after"], d["volatile"])
        answer = Answer(ok=d["ok"], error=d["error"], error_kind=d["error_kind"],
                        disconnected=d["disconnected"], token_ids=list(d["token_ids"]),
                        top=[{int(k): v for k, v in t.items()} for t in d["top"]],
                        finish_reason=d["finish_reason"], prompt_tokens=d["prompt_tokens"],
                        cached_tokens=d["cached_tokens"], ttft_s=d["ttft_s"],
                        total_s=d["total_s"])
        verdict = d.get("verdict")
        return cls(d["index"], d["client"], spec, d["sent_s"], answer,
                   Verdict.from_dict(verdict) if verdict else None,
                   bool(d.get("after_damage", False)))


@dataclass
class SoakResult:
    """Everything one soak measured; :meth:`to_dict` is the ``result.json`` schema."""

    config: SoakConfig
    machine: MachineRecord
    records: list[SoakRecord]
    events: list[EventRecord]
    wall_s: float
    preemptions_before: float | None
    preemptions_after: float | None
    server_log: dict[str, int]
    references: int
    how: str = ""
    threads: int | None = None
    launch: LaunchRecord | None = None
    corun: CorunResult | None = None
    started: str = ""

    def summary(self) -> SoakSummary:
        return summarize(self.records, self.wall_s, self.preemptions_before,
                         self.preemptions_after)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workload": "soak", "started": self.started, "how": self.how,
            "config": asdict(self.config), "machine": self.machine.to_dict(),
            "threads": self.threads, "summary": self.summary().to_dict(),
            "events": [asdict(e) for e in self.events],
            "wall_s": self.wall_s, "preemptions_before": self.preemptions_before,
            "preemptions_after": self.preemptions_after, "server_log": self.server_log,
            "references_computed": self.references,
            "corun": None if self.corun is None else self.corun.to_dict(),
            "requests": [r.to_dict() for r in self.records]}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SoakResult:
        """Read back :meth:`to_dict` (a stored ``result.json``), verdicts included."""
        from kvnotes.serving.launch.launcher import LaunchRecord
        from kvnotes_bench.serving.corun import CorunResult

        config: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in d["config"].items()}
        launch = d.get("launch")
        corun = d.get("corun")
        return cls(config=SoakConfig(**config),
                   machine=MachineRecord.from_dict(d.get("machine") or {}),
                   records=[SoakRecord.from_dict(r) for r in d.get("requests", [])],
                   events=[EventRecord.from_dict(e) for e in d.get("events", [])],
                   wall_s=d.get("wall_s", 0.0), preemptions_before=d.get("preemptions_before"),
                   preemptions_after=d.get("preemptions_after"),
                   server_log=dict(d.get("server_log") or {}),
                   references=d.get("references_computed", 0), how=d.get("how", ""),
                   threads=d.get("threads"),
                   launch=LaunchRecord(**{f.name: launch[f.name]
                                          for f in dataclasses.fields(LaunchRecord)})
                   if launch else None,
                   corun=CorunResult.from_dict(corun) if corun else None,
                   started=d.get("started", ""))


@dataclass(frozen=True)
class SoakSummary:
    """The soak's figures (:func:`summarize`); ``matched`` counts, per request kind, what each
    checked answer equalled."""

    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    disconnects: int
    by_kind: dict[str, int]
    checked: int
    wrong: int
    near_ties: int
    matched: dict[str, dict[str, int]]
    preemptions: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_per_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(recs: Sequence[SoakRecord], wall_s: float, preemptions_before: float | None,
              preemptions_after: float | None) -> SoakSummary:
    """The soak's figures from its records."""
    ok = [r for r in recs if r.answer.ok]
    failed = [r for r in recs if not r.answer.ok and not r.answer.disconnected]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.answer.error_kind or "other"] = errors.get(r.answer.error_kind or "other",
                                                            0) + 1
    verdicts: dict[str, int] = {}
    matched: dict[str, dict[str, int]] = {}
    for r in ok:
        if r.verdict is None:
            continue
        verdicts[r.verdict.status] = verdicts.get(r.verdict.status, 0) + 1
        key = r.spec.kind + (" after damage" if r.after_damage else "")
        row = matched.setdefault(key, {})
        label = (r.verdict.matched or r.verdict.status).split("@")[0]
        row[label] = row.get(label, 0) + 1
    lat = [r.answer.total_s for r in ok if r.answer.total_s is not None]
    ttft = [r.answer.ttft_s for r in ok if r.answer.ttft_s is not None]
    pre = (None if preemptions_before is None or preemptions_after is None
           else preemptions_after - preemptions_before)
    return SoakSummary(
        requests=len(recs), completed=len(ok), failed=len(failed),
        errors=dict(sorted(errors.items())),
        disconnects=sum(r.answer.disconnected for r in recs),
        by_kind={k: sum(r.spec.kind == k for r in recs) for k in KINDS},
        checked=sum(r.verdict is not None for r in ok),
        wrong=verdicts.get("wrong", 0), near_ties=verdicts.get("near_tie", 0),
        matched=matched, preemptions=pre,
        latency_p50_s=percentile(lat, 50), latency_p99_s=percentile(lat, 99),
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        requests_per_s=len(ok) / wall_s if wall_s > 0 else None)
