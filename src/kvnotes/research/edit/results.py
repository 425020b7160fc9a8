"""Typed results of the edit suite and their aggregation.

:class:`StrategyRow` (one strategy on one case) <- :class:`CaseResult` (one case) <-
:class:`SuiteResult` (a run: settings, :class:`StrategySummary` per strategy and per family,
every case). ``to_dict`` writes the keys of ``results.json``; ``from_dict`` reads them back.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kvnotes.research.edit.strategies import parse_strategy

# logits: below this the field barely moves the decision (docs/design.md, Conventions)
MIN_FIELD_EFFECT = 1.0


@dataclass(frozen=True, slots=True)
class SuiteSettings:
    """What a run measures with: the strategies, and how decisions are taken.

    ``batch``: with ``cot``, decode each case's chains of thought as one batch (the results
    equal decoding each alone, up to float error).
    """

    strategies: tuple[str, ...]
    cot: bool = False
    budget: int = 96
    batch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", tuple(self.strategies))
        for s in self.strategies:
            parse_strategy(s)

    @property
    def recorded_budget(self) -> int | None:
        """The budget as ``results.json`` records it (None without CoT: it plays no part)."""
        return self.budget if self.cot else None


@dataclass(frozen=True, slots=True)
class StrategyRow:
    """One strategy on one case, measured against recompute of the new value."""

    strategy: str  # the spec, e.g. "repair:attention:32"
    family: str
    case_id: str
    decision: str | None
    identical: bool  # same decision as recompute(new)
    sensitive: bool  # recompute decides differently for the old and the new value
    recovered: bool  # sensitive and identical
    cosine: float
    kl: float
    top1_agree: bool
    margin: float  # first-token logit of recompute(new)'s answer minus the best other answer
    tokens_total: int
    tokens_recomputed: int
    tokens_appended: int
    compute_fraction: float
    select_tokens: float
    seconds: float
    ttft: float
    ttft_ratio: float  # (edit + question) / (recompute + question), wall clock
    text: str  # the CoT text ("" without CoT)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StrategyRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case: the reference decisions for the old and new value and one row per strategy."""

    case_id: str
    family: str
    field: str
    old_value: str
    new_value: str
    decision_old: str | None
    decision_new: str | None
    expected_old: str | None
    expected_new: str | None
    sensitive: bool
    tokens: int
    answer_logits_old: tuple[float, ...]  # first-token logit per answer, recompute(old)
    answer_logits_new: tuple[float, ...]
    answers: tuple[str, ...]
    text_old: str
    text_new: str
    rows: tuple[StrategyRow, ...]

    def row(self, strategy: str) -> StrategyRow | None:
        return next((r for r in self.rows if r.strategy == strategy), None)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(answer_logits_old=list(self.answer_logits_old),
                 answer_logits_new=list(self.answer_logits_new), answers=list(self.answers),
                 rows=[r.to_dict() for r in self.rows])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        """Read back :meth:`to_dict` (a ``results.json`` case; older files may lack answers,
        which are then taken from the bundled suite)."""
        answers = d.get("answers") or _suite_answers().get(d["case_id"], [])
        options: dict[str, Any] = {f.name: d.get(f.name) for f in fields(cls)}
        return cls(**{**options,
                      "answer_logits_old": tuple(d["answer_logits_old"]),
                      "answer_logits_new": tuple(d["answer_logits_new"]),
                      "answers": tuple(answers),
                      "rows": tuple(StrategyRow.from_dict(r) for r in d["rows"])})


@dataclass(frozen=True, slots=True)
class StrategySummary:
    """One strategy over a set of cases (all of a run's, or one family's)."""

    n: int
    n_field_moved: int  # cases where the field moves the margin by >= MIN_FIELD_EFFECT
    intended_new: float | None  # decision equal to the task author's answer for the new value
    effect_median: float | None  # normalized effect over the n_field_moved cases
    identity: float  # decision equal to recompute(new), over all cases
    flips: int
    n_sensitive: int
    recovery: float | None  # identity over the sensitive cases (None: there are none)
    cosine_mean: float
    cosine_median: float
    kl_mean: float
    kl_median: float
    top1_agree: float
    compute_fraction: float
    select_fraction: float
    ttft_ratio_median: float

    @property
    def recovered(self) -> int:
        """Sensitive cases whose decision equals recompute(new)'s."""
        return round((self.recovery or 0) * self.n_sensitive)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StrategySummary:
        optional = {"n_field_moved": 0, "intended_new": None, "effect_median": None,
                    "select_fraction": 0.0}
        options: dict[str, Any] = {f.name: d.get(f.name, optional.get(f.name))
                                   if f.name in optional else d[f.name] for f in fields(cls)}
        return cls(**options)


PerStrategy = dict[str, StrategySummary]


@dataclass(frozen=True, slots=True)
class ExpectedMatches:
    """Cases where recompute's decision equals the task author's intended answer."""

    old: int
    new: int


@dataclass(frozen=True, slots=True)
class SuiteResult:
    """A run of the suite (or a checkpoint of one): settings, aggregates and every case."""

    model: str
    cot: bool
    budget: int | None  # None without CoT
    cot_batched: bool
    strategies: tuple[str, ...]
    n_cases: int
    n_planned: int  # cases the run was asked for (n_cases < n_planned: a partial result)
    n_resumed: int  # cases taken from an earlier run instead of run again
    n_sensitive: int
    recompute_matches_expected: ExpectedMatches
    seconds: float  # this run's wall time (resumed cases not included)
    per_strategy: PerStrategy
    per_family: dict[str, PerStrategy]
    cases: tuple[CaseResult, ...]
    workers: int = 1  # worker processes (> 1: timings are not quiet-machine figures)

    @classmethod
    def of(cls, model: str, settings: SuiteSettings, cases: Sequence[CaseResult], *,
           planned: int, resumed: int, seconds: float, workers: int = 1) -> SuiteResult:
        """Aggregate ``cases`` (see :func:`aggregate`) into a run's result."""
        per_strategy, per_family = aggregates(cases, settings.strategies)
        return cls(
            model=model, cot=settings.cot, budget=settings.recorded_budget,
            cot_batched=settings.cot and settings.batch, strategies=tuple(settings.strategies),
            n_cases=len(cases), n_planned=planned, n_resumed=resumed,
            n_sensitive=sum(r.sensitive for r in cases),
            recompute_matches_expected=ExpectedMatches(
                old=sum(r.decision_old == r.expected_old for r in cases),
                new=sum(r.decision_new == r.expected_new for r in cases)),
            seconds=seconds, per_strategy=per_strategy, per_family=per_family,
            cases=tuple(cases), workers=workers)

    def reaggregated(self) -> SuiteResult:
        """The same cases aggregated again (after the metrics change, without re-running)."""
        per_strategy, per_family = aggregates(self.cases, self.strategies)
        return replace(self, per_strategy=per_strategy, per_family=per_family)

    def to_dict(self, *, cases: bool = True) -> dict[str, Any]:
        """The ``results.json`` keys (``cases=False``: the summary without the cases)."""
        d: dict[str, Any] = {
            "model": self.model, "cot": self.cot, "budget": self.budget,
            "cot_batched": self.cot_batched, "strategies": list(self.strategies),
            "n_cases": self.n_cases, "n_planned": self.n_planned, "n_resumed": self.n_resumed,
            "n_sensitive": self.n_sensitive,
            "recompute_matches_expected": {"old": self.recompute_matches_expected.old,
                                           "new": self.recompute_matches_expected.new},
            "seconds": self.seconds,
            "per_strategy": {s: a.to_dict() for s, a in self.per_strategy.items()},
            "per_family": {f: {s: a.to_dict() for s, a in agg.items()}
                           for f, agg in self.per_family.items()},
        }
        if cases:
            d["cases"] = [r.to_dict() for r in self.cases]
        if self.workers > 1:
            d["workers"] = self.workers
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SuiteResult:
        """Read back :meth:`to_dict` (a ``results.json``, a checkpoint or a repro stage)."""
        expected = d["recompute_matches_expected"]

        def per(agg: dict[str, Any]) -> PerStrategy:
            return {s: StrategySummary.from_dict(a) for s, a in agg.items()}

        return cls(
            model=d["model"], cot=bool(d["cot"]), budget=d["budget"],
            cot_batched=bool(d.get("cot_batched", False)), strategies=tuple(d["strategies"]),
            n_cases=d["n_cases"], n_planned=d.get("n_planned", d["n_cases"]),
            n_resumed=d.get("n_resumed", 0), n_sensitive=d["n_sensitive"],
            recompute_matches_expected=ExpectedMatches(old=expected["old"], new=expected["new"]),
            seconds=d["seconds"], per_strategy=per(d["per_strategy"]),
            per_family={f: per(agg) for f, agg in d["per_family"].items()},
            cases=tuple(CaseResult.from_dict(c) for c in d.get("cases", ())),
            workers=d.get("workers", 1))


def aggregates(results: Sequence[CaseResult], strategies: Sequence[str]
               ) -> tuple[PerStrategy, dict[str, PerStrategy]]:
    """:func:`aggregate` over every case, and within each family (sorted by name)."""
    return (aggregate(results, strategies),
            {fam: aggregate([r for r in results if r.family == fam], strategies)
             for fam in sorted({r.family for r in results})})


def aggregate(results: Sequence[CaseResult], strategies: Sequence[str]) -> PerStrategy:
    """One :class:`StrategySummary` per strategy that has rows among ``results``."""
    out = {}
    for s in strategies:
        rows = [row for r in results for row in r.rows if row.strategy == s]
        if not rows:
            continue
        sens = [row for row in rows if row.sensitive]
        effects = [e for r in results if (e := effect(r, s)) is not None]
        intended = [row.decision == r.expected_new for r in results for row in r.rows
                    if row.strategy == s and r.expected_new is not None]
        out[s] = StrategySummary(
            n=len(rows),
            n_field_moved=len(effects),
            intended_new=_mean(intended) if intended else None,
            effect_median=statistics.median(effects) if effects else None,
            identity=_mean(row.identical for row in rows),
            flips=sum(not row.identical for row in rows),
            n_sensitive=len(sens),
            recovery=_mean(row.identical for row in sens) if sens else None,
            cosine_mean=_mean(row.cosine for row in rows),
            cosine_median=statistics.median(row.cosine for row in rows),
            kl_mean=_mean(row.kl for row in rows),
            kl_median=statistics.median(row.kl for row in rows),
            top1_agree=_mean(row.top1_agree for row in rows),
            compute_fraction=_mean(row.compute_fraction for row in rows),
            select_fraction=_mean(row.select_tokens / row.tokens_total for row in rows),
            ttft_ratio_median=statistics.median(row.ttft_ratio for row in rows),
        )
    return out


def margin(scores: Sequence[float], answers: Sequence[str], target: str | None) -> float:
    """Logit of ``target`` minus the best other answer (first tokens); NaN without a target."""
    if target is None or target not in answers:
        return float("nan")
    i = list(answers).index(target)
    others = [s for j, s in enumerate(scores) if j != i]
    return scores[i] - max(others) if others else float("nan")


def effect(case: CaseResult, strategy: str) -> float | None:
    """Normalized effect of one strategy on one case, or None when the field barely moves it.

    With m the first-token logit margin of recompute(new)'s answer over the best other answer:
    (m_strategy - m_old) / (m_new - m_old); 1 = moved as far as recompute, 0 = still the old
    value. Only cases where |m_new - m_old| >= MIN_FIELD_EFFECT count.
    """
    row = case.row(strategy)
    if not case.answers or row is None:
        return None
    m_old = margin(case.answer_logits_old, case.answers, case.decision_new)
    m_new = margin(case.answer_logits_new, case.answers, case.decision_new)
    if not abs(m_new - m_old) >= MIN_FIELD_EFFECT:
        return None
    return (row.margin - m_old) / (m_new - m_old)


def _suite_answers() -> dict[str, list[str]]:
    from kvnotes.eval.tasks import load_suite

    return {c.case_id: list(c.answers) for c in load_suite()}


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")
