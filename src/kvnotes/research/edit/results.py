"""Typed results of the edit suite and their aggregation.

:class:`StrategyRow` (one strategy on one case) <- :class:`CaseResult` (one case) <-
:class:`SuiteResult` (a run: settings, :class:`StrategySummary` per strategy and per family,
every case), frozen pydantic dataclasses: ``to_dict`` writes the keys of ``results.json`` and
``from_dict`` reads them back (:class:`~kvnotes.core.records.JsonRecord`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import model_validator
from pydantic.dataclasses import dataclass as record

from kvnotes.core.records import Json, JsonRecord
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


@record(frozen=True, slots=True)
class StrategyRow(JsonRecord):
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


@record(frozen=True, slots=True)
class CaseResult(JsonRecord):
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

    @model_validator(mode="before")
    @classmethod
    def _older_files(cls, data: object) -> object:
        """Older ``results.json`` cases lack answers: they are the bundled suite's."""
        if isinstance(data, dict) and not data.get("answers"):
            return {**data, "answers": _suite_answers().get(data["case_id"], [])}
        return data


@record(frozen=True, slots=True)
class StrategySummary(JsonRecord):
    """One strategy over a set of cases (all of a run's, or one family's)."""

    n: int
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
    ttft_ratio_median: float
    select_fraction: float = 0.0  # absent from older files
    # absent from older files
    n_field_moved: int = 0  # cases where the field moves the margin by >= MIN_FIELD_EFFECT
    intended_new: float | None = None  # decision equal to the task author's answer for the new
    effect_median: float | None = None  # normalized effect over the n_field_moved cases

    @property
    def recovered(self) -> int:
        """Sensitive cases whose decision equals recompute(new)'s."""
        return round((self.recovery or 0) * self.n_sensitive)


PerStrategy = dict[str, StrategySummary]


@record(frozen=True, slots=True)
class ExpectedMatches:
    """Cases where recompute's decision equals the task author's intended answer."""

    old: int
    new: int


@record(frozen=True, slots=True)
class SuiteResult(JsonRecord):
    """A run of the suite (or a checkpoint of one): settings, aggregates and every case."""

    model: str
    cot: bool
    budget: int | None  # None without CoT
    strategies: tuple[str, ...]
    n_cases: int
    n_sensitive: int
    recompute_matches_expected: ExpectedMatches
    seconds: float  # this run's wall time (resumed cases not included)
    per_strategy: PerStrategy
    per_family: dict[str, PerStrategy]
    # below: absent from older files or from a summary without its cases
    cases: tuple[CaseResult, ...] = ()
    # cases the run was asked for (n_cases < n_planned: a partial result)
    n_planned: int = field(kw_only=True)
    n_resumed: int = field(default=0, kw_only=True)  # cases taken from an earlier run
    cot_batched: bool = field(default=False, kw_only=True)
    # worker processes (> 1: timings are not quiet-machine figures)
    workers: int = field(default=1, kw_only=True)

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

    @model_validator(mode="before")
    @classmethod
    def _older_files(cls, data: object) -> object:
        """Files from before ``n_planned`` was recorded planned every case they hold."""
        if isinstance(data, dict) and "n_planned" not in data:
            return {**data, "n_planned": data["n_cases"]}
        return data

    def to_dict(self, *, cases: bool = True) -> Json:
        """The ``results.json`` keys (``cases=False``: the summary without the cases; workers
        only when more than one)."""
        d = JsonRecord.to_dict(self)
        if not cases:
            del d["cases"]
        if self.workers <= 1:
            del d["workers"]
        return d


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
