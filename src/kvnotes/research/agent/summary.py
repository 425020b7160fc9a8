"""agent-bench's figures as typed values: per-turn records of every agent, and the summary read
off them (decision identity, flips, latency, tokens, arithmetic, the guard's work).

:meth:`BenchSummary.to_dict` is the JSON the benchmark writes (``agent-bench.json``);
:meth:`BenchSummary.from_dict` reads such a file's figures back (its records stay in the JSON:
they hold the agents' full decisions). The figures are frozen pydantic dataclasses
(:class:`~kvnotes.core.records.JsonRecord`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import ConfigDict, Field, SkipValidation, model_validator
from pydantic.dataclasses import dataclass as record

from kvnotes.apps.agent.runtime import TurnResult
from kvnotes.core.records import Json, JsonRecord

SWEEP_TAUS = (1.0, 0.75, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _is_none(value: object) -> bool:
    return value is None


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One turn of one episode: the request, the state changes so far, and each agent's turn."""

    episode: str
    turn: int
    kind: str
    request: str
    events_so_far: tuple[tuple[str, str], ...]
    kvnotes: TurnResult
    recompute: TurnResult
    stale: TurnResult | None = None

    def to_dict(self) -> Json:
        out: Json = {
            "episode": self.episode, "turn": self.turn, "kind": self.kind,
            "request": self.request, "events_so_far": [list(e) for e in self.events_so_far],
            "kvnotes": self.kvnotes.to_dict(), "recompute": self.recompute.to_dict()}
        if self.stale is not None:
            out["stale"] = self.stale.to_dict()
        return out


def _same(a: TurnResult, b: TurnResult) -> bool:
    return a.decision.answer == b.decision.answer


@record(frozen=True, slots=True)
class Flip(JsonRecord):
    """A decision where the kvnotes agent chose otherwise than the recompute agent."""

    episode: str
    turn: int
    kind: str
    kvnotes: str | None
    recompute: str | None
    kvnotes_margin: float
    recompute_margin: float
    recompute_scores: dict[str, float]
    kvnotes_scores: dict[str, float]
    events_so_far: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, r: TurnRecord) -> Flip:
        k, c = r.kvnotes.decision, r.recompute.decision
        return cls(r.episode, r.turn, r.kind, k.answer, c.answer, k.margin, c.margin,
                   dict(c.scores), dict(k.scores), r.events_so_far)


@record(frozen=True, slots=True)
class TurnStats:
    """The figures of one turn index across episodes."""

    turn: int
    n: int
    identity: float
    kvnotes_latency_s: float
    recompute_latency_s: float
    ratio: float
    kvnotes_tokens_computed: float
    recompute_tokens_computed: float
    flop_ratio: float = float("nan")  # nan: read from a summary without FLOP counts
    # None: the stale ablation did not run (then left out of the JSON)
    stale_identity: float | None = Field(default=None, exclude_if=_is_none)


@record(frozen=True, slots=True)
class LatencyStats:
    kvnotes_total_s: float
    recompute_total_s: float
    ratio: float  # recompute / kvnotes
    kvnotes_mean_turn_s: float
    recompute_mean_turn_s: float


@record(frozen=True, slots=True)
class TokenStats:
    kvnotes_computed: int
    kvnotes_reused: int
    recompute_computed: int


@record(frozen=True, slots=True)
class ComputeStats:
    """The arithmetic each agent did (:mod:`kvnotes.core.work`) and the latency ratio it allows:
    on a compute-bound machine the latency ratio cannot beat the FLOP ratio by much, so the
    FLOP ratio is the workload's ceiling and latency ÷ FLOP ratio (``kept``) is how much of it
    is kept. ``fast_*``: without the guard's recomputes."""

    kvnotes_flops: float
    recompute_flops: float
    guard_flops: float
    flop_ratio: float
    fast_flop_ratio: float
    fast_latency_ratio: float
    kept: float


@record(frozen=True, slots=True)
class GuardStats:
    """How often the kvnotes agent's decision guard fired, what it caught and what it cost."""

    tau: float
    decisions: int
    fired: int
    fired_rate: float
    changed: int  # re-decisions that differ from the fast one
    tokens: int
    seconds: float  # included in the kvnotes latency
    would_flip_without: int  # fast decisions that differ from recompute's


@record(frozen=True, slots=True, config=ConfigDict(populate_by_name=True))
class MarginErrorStats:
    """The fast decision's margin error against recompute (:func:`fast_margin_errors`)."""

    median: float
    p90: float
    max: float
    under_0_001: int = Field(alias="under_0.001")  # decisions on exact notes


@record(frozen=True, slots=True)
class SweepRow:
    """What the run would have cost with guard threshold ``tau`` (see :func:`guard_sweep`)."""

    tau: float
    fired: int
    missed_flips: int
    latency_ratio: float
    flop_ratio: float


@record(frozen=True, slots=True)
class SkillStats:
    names: tuple[str, ...]
    tokens: dict[str, int]
    compiled_now: int  # library entries compiled by this run
    library_hits: int
    prepare_s: float


@record(frozen=True, slots=True)
class StaleStats:
    """The stale-record ablation (state changes ignored) against recompute."""

    identity: float
    identity_after_state_change: float
    kvnotes_identity_after_state_change: float
    decisions_after_state_change: int


@record(frozen=True, slots=True)
class ToolCallStats:
    turns_with_a_call: int
    kvnotes_valid: int
    recompute_valid: int
    identical_raw: int


@record(frozen=True, slots=True)
class BenchSettings:
    """The agent settings and episodes of a run."""

    order: str
    history: int | None
    anchored: bool
    variants: bool
    guard: float | None
    repair: float | int
    carry_record: bool
    episodes: tuple[str, ...]


# figures an older summary may lack (read as None)
_MAY_LACK = ("settings", "compute", "guard", "fast_margin_error", "guard_sweep")


# a figure a stored summary may lack: left out of the JSON when None
_UNSET_LEFT_OUT = Field(exclude_if=_is_none)


@record(frozen=True, slots=True, config=ConfigDict(arbitrary_types_allowed=True))
class BenchSummary(JsonRecord):
    """agent-bench's result: the run's settings, its figures and every turn's record.

    ``settings``, ``compute`` and ``fast_margin_error`` are None only when read
    (:meth:`from_dict`) from a stored summary that does not hold them; :func:`run_bench
    <kvnotes.research.agent.run.run_bench>` always fills them in.
    """

    settings: Annotated[BenchSettings | None, _UNSET_LEFT_OUT]
    model: str
    episodes: int
    turns_per_episode: int
    decisions: int
    identity: float
    flips: tuple[Flip, ...]
    per_turn: tuple[TurnStats, ...]
    latency: LatencyStats
    tokens: TokenStats
    compute: Annotated[ComputeStats | None, _UNSET_LEFT_OUT]
    recompute_margin_median: float
    guard: GuardStats | None
    fast_margin_error: Annotated[MarginErrorStats | None, _UNSET_LEFT_OUT]
    guard_sweep: tuple[SweepRow, ...] | None
    skills: SkillStats
    tool_calls: bool
    # the agents' full decisions: written, never read back (they hold logits)
    records: SkipValidation[tuple[TurnRecord, ...]] = Field(default=(), exclude=True)
    stale: StaleStats | None = Field(default=None, exclude_if=_is_none)
    tool_call_stats: ToolCallStats | None = Field(default=None, exclude_if=_is_none)
    # kvnotes.core.machine's record, before and after
    machine: dict[str, Any] | None = Field(default=None, exclude_if=_is_none)

    @property
    def flip_count(self) -> int:
        return len(self.flips)

    @model_validator(mode="before")
    @classmethod
    def _figures_only(cls, data: object) -> object:
        """A stored summary's records are left in the JSON (see the class docstring); older
        summaries lack some figures."""
        if isinstance(data, dict):
            return {**dict.fromkeys(_MAY_LACK), **{k: v for k, v in data.items() if k != "records"}}
        return data

    def to_dict(self, *, records: bool = True) -> Json:
        """The JSON of ``agent-bench.json`` (``records=False``: without the per-turn records)."""
        out: Json = {}
        for key, value in JsonRecord.to_dict(self).items():  # in the order readers know
            if key == "flips":
                out["flip_count"] = self.flip_count
            out[key] = value
            if key == "tool_calls" and records:
                out["records"] = [r.to_dict() for r in self.records]
        return out


# ---- figures read off the records -----------------------------------------------------------


def summarize(model: str, records: Sequence[TurnRecord], *, settings: BenchSettings,
              skills: SkillStats, tool_calls: bool) -> BenchSummary:
    """Aggregate per-turn records into the benchmark's figures."""
    same = [_same(r.kvnotes, r.recompute) for r in records]
    per_turn = tuple(_turn_stats(t, [r for r in records if r.turn == t])
                     for t in sorted({r.turn for r in records}))
    stale = None
    if records and records[0].stale is not None:
        changed = [r for r in records if r.events_so_far]
        stale = StaleStats(
            identity=_mean([_same(r.stale, r.recompute) for r in records if r.stale]),
            identity_after_state_change=_mean([_same(r.stale, r.recompute) for r in changed
                                               if r.stale]),
            kvnotes_identity_after_state_change=_mean([_same(r.kvnotes, r.recompute)
                                                       for r in changed]),
            decisions_after_state_change=len(changed))
    return BenchSummary(
        settings=settings, model=model, episodes=len({r.episode for r in records}),
        turns_per_episode=len(per_turn), decisions=len(records), identity=_mean(same),
        flips=tuple(Flip.of(r) for r, s in zip(records, same, strict=True) if not s),
        per_turn=per_turn, latency=latency_stats(records), tokens=token_stats(records),
        compute=compute_stats(records),
        recompute_margin_median=statistics.median(r.recompute.decision.margin
                                                  for r in records),
        guard=guard_stats(records), fast_margin_error=margin_error_stats(records),
        guard_sweep=(guard_sweep(records) if any(r.kvnotes.decision.guard for r in records)
                     else None),
        skills=skills, tool_calls=tool_calls, records=tuple(records), stale=stale,
        tool_call_stats=tool_call_stats(records) if tool_calls else None)


def _turn_stats(turn: int, rs: Sequence[TurnRecord]) -> TurnStats:
    k = [r.kvnotes.latency_s for r in rs]
    c = [r.recompute.latency_s for r in rs]
    return TurnStats(
        turn=turn, n=len(rs), identity=_mean([_same(r.kvnotes, r.recompute) for r in rs]),
        kvnotes_latency_s=_mean(k), recompute_latency_s=_mean(c),
        ratio=sum(c) / sum(k) if sum(k) else float("nan"),
        kvnotes_tokens_computed=_mean([r.kvnotes.tokens_computed for r in rs]),
        recompute_tokens_computed=_mean([r.recompute.tokens_computed for r in rs]),
        flop_ratio=_ratio(sum(r.recompute.flops for r in rs), sum(r.kvnotes.flops for r in rs)),
        stale_identity=(_mean([_same(r.stale, r.recompute) for r in rs if r.stale])
                        if rs[0].stale is not None else None))


def latency_stats(records: Sequence[TurnRecord]) -> LatencyStats:
    total_k = sum(r.kvnotes.latency_s for r in records)
    total_c = sum(r.recompute.latency_s for r in records)
    return LatencyStats(total_k, total_c, total_c / total_k if total_k else float("nan"),
                        _mean([r.kvnotes.latency_s for r in records]),
                        _mean([r.recompute.latency_s for r in records]))


def token_stats(records: Sequence[TurnRecord]) -> TokenStats:
    return TokenStats(sum(r.kvnotes.tokens_computed for r in records),
                      sum(r.kvnotes.tokens_reused for r in records),
                      sum(r.recompute.tokens_computed for r in records))


def compute_stats(records: Sequence[TurnRecord]) -> ComputeStats:
    """The arithmetic of each agent over ``records`` (see :class:`ComputeStats`)."""
    k = sum(r.kvnotes.flops for r in records)
    c = sum(r.recompute.flops for r in records)
    guard = sum(r.kvnotes.guard_flops for r in records)
    guards = [r.kvnotes.decision.guard for r in records]
    guard_s = sum(g.seconds for g in guards if g and g.fired)
    lat_k = sum(r.kvnotes.latency_s for r in records)
    lat_c = sum(r.recompute.latency_s for r in records)
    return ComputeStats(k, c, guard, flop_ratio=_ratio(c, k), fast_flop_ratio=_ratio(c, k - guard),
                        fast_latency_ratio=_ratio(lat_c, lat_k - guard_s),
                        kept=_ratio(_ratio(lat_c, lat_k), _ratio(c, k)))


def fast_margin_errors(records: Sequence[TurnRecord]) -> list[float]:
    """Per decision, how far the fast (unguarded) decision's margin is from recompute's: the
    fast margin counts positive when the fast choice is recompute's, negative otherwise, and
    the error is its distance from recompute's margin (exact for two options; with three, the
    runner-ups may differ). 0 on turns whose notes were all exact."""
    out = []
    for r in records:
        k, c = r.kvnotes.decision, r.recompute.decision
        g = k.guard
        answer, margin = (g.fast_answer, g.fast_margin) if g else (k.answer, k.margin)
        signed = margin if answer == c.answer else -margin
        out.append(abs(signed - c.margin))
    return out


def margin_error_stats(records: Sequence[TurnRecord]) -> MarginErrorStats:
    errors = sorted(fast_margin_errors(records))
    return MarginErrorStats(statistics.median(errors), errors[int(0.9 * (len(errors) - 1))],
                            errors[-1], sum(e < 1e-3 for e in errors))


def guard_sweep(records: Sequence[TurnRecord], taus: Sequence[float] = SWEEP_TAUS
                ) -> tuple[SweepRow, ...]:
    """What a lower guard threshold would have cost, read off a run's records (an estimate, not
    a run): a fire whose fast margin is at or above ``tau`` is dropped with its recompute time
    and FLOPs, and a fast flip it caught is counted as missed. Thresholds above the run's own
    are not estimated (the fires they add were never run). After a dropped fire the notes
    would have stayed inexact, so later turns could differ from the run's."""
    run_tau = next(r.kvnotes.decision.guard.tau for r in records if r.kvnotes.decision.guard)
    rec_s = sum(r.recompute.latency_s for r in records)
    rec_f = sum(r.recompute.flops for r in records)
    out = []
    for tau in taus:
        if tau > run_tau:
            continue
        kv_s = sum(r.kvnotes.latency_s for r in records)
        kv_f = sum(r.kvnotes.flops for r in records)
        fired = missed = 0
        for r in records:
            g = r.kvnotes.decision.guard
            if g is None or not g.fired:
                continue
            if g.fast_margin < tau:
                fired += 1
            else:
                kv_s -= g.seconds
                kv_f -= r.kvnotes.guard_flops
                missed += g.fast_answer != r.recompute.decision.answer
        out.append(SweepRow(tau, fired, missed, _ratio(rec_s, kv_s), _ratio(rec_f, kv_f)))
    return tuple(out)


def guard_stats(records: Sequence[TurnRecord]) -> GuardStats | None:
    """How often the kvnotes agent's decision guard fired, what it caught and what it cost."""
    pairs = [(r.kvnotes.decision.guard, r) for r in records]
    guards = [g for g, _ in pairs if g is not None]
    if not guards:
        return None
    fired = [g for g in guards if g.fired]
    return GuardStats(
        tau=guards[0].tau, decisions=len(pairs), fired=len(fired),
        fired_rate=len(fired) / len(pairs), changed=sum(g.changed for g in fired),
        tokens=sum(g.tokens for g in fired), seconds=sum(g.seconds for g in fired),
        would_flip_without=sum(g.fast_answer != r.recompute.decision.answer
                               for g, r in pairs if g is not None))


def tool_call_stats(records: Sequence[TurnRecord]) -> ToolCallStats:
    calls = [r for r in records if r.recompute.tool_call or r.kvnotes.tool_call]

    def valid(result: TurnResult) -> bool:
        return bool(result.tool_call and result.tool_call.ok)

    return ToolCallStats(
        turns_with_a_call=len(calls), kvnotes_valid=sum(valid(r.kvnotes) for r in calls),
        recompute_valid=sum(valid(r.recompute) for r in calls),
        identical_raw=sum(bool(r.kvnotes.tool_call and r.recompute.tool_call
                               and r.kvnotes.tool_call.raw == r.recompute.tool_call.raw)
                          for r in calls))
