"""One case, every strategy: the edits, the decisions, and one row per strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvnotes.core.metrics import compare_logits
from kvnotes.ops.decisions import decide, decide_batch
from kvnotes.ops.edit import EditReport, edit
from kvnotes.research.edit.cases import case_prompt
from kvnotes.research.edit.results import CaseResult, StrategyRow, SuiteSettings, margin
from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES, parse_strategy

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.eval.tasks.base import EditCase


def evaluate_case(engine: Engine, case: EditCase, settings: SuiteSettings) -> CaseResult:
    """One case: the reference decisions and one row per strategy (see the package docstring).

    Every strategy's edit is made first; the question is then asked on each notebook. With
    ``cot`` and ``batch`` the chains of thought of all of them (old value, recompute and every
    strategy) are decoded as one batch (:func:`decide_batch`): one forward per reasoning token
    instead of one per strategy and token. Each edit and each first token is still timed
    alone, so the TTFT columns mean the same either way.
    """
    cot, budget = settings.cot, settings.budget
    doc, query = case_prompt(engine, case, cot=cot)
    nb_old = engine.prefill(doc)
    ref_nb, ref_report = edit(engine, nb_old, case.field, case.new_value, strategy="recompute")
    edits: list[tuple[str, Notebook, EditReport]] = []
    memo: dict[Any, Any] = {}  # repair selection scores, shared by the budgets k
    for label in settings.strategies:
        name, options = parse_strategy(label)
        if name == "recompute":
            edits.append((label, ref_nb, ref_report))
            continue
        shared = memo if name == "repair" else None
        edits.append((label, *edit(engine, nb_old, case.field, case.new_value, strategy=name,
                                   memo=shared, **options)))
    asked = [nb_old, ref_nb, *(nb for _, nb, _ in edits if nb is not ref_nb)]
    decisions = iter(decide_batch(engine, asked, query, case.answers, cot=cot, budget=budget)
                     if settings.batch else
                     [decide(engine, nb, query, case.answers, cot=cot, budget=budget)
                      for nb in asked])
    d_old, d_new = next(decisions), next(decisions)
    ttft_ref = ref_report.seconds + d_new.first_seconds
    sensitive = d_old.answer != d_new.answer
    rows = []
    for label, nb, report in edits:
        d = d_new if nb is ref_nb else next(decisions)
        assert d_new.logits is not None and d.logits is not None  # decide() always keeps them
        cmp = compare_logits(d_new.logits, d.logits)
        ttft = report.seconds + d.first_seconds
        rows.append(StrategyRow(
            strategy=label, family=case.family, case_id=case.case_id, decision=d.answer,
            identical=d.answer == d_new.answer, sensitive=sensitive,
            recovered=sensitive and d.answer == d_new.answer,
            cosine=cmp.cosine, kl=cmp.kl, top1_agree=cmp.top1_agree,
            margin=margin(list(d.scores.values()), case.answers, d_new.answer),
            tokens_total=report.tokens_total, tokens_recomputed=report.tokens_recomputed,
            tokens_appended=report.tokens_appended, compute_fraction=report.compute_fraction,
            select_tokens=report.select_tokens, seconds=report.seconds,
            ttft=ttft, ttft_ratio=ttft / ttft_ref if ttft_ref else float("nan"), text=d.text,
        ))
    return CaseResult(
        case_id=case.case_id, family=case.family, field=case.field,
        old_value=case.old_value, new_value=case.new_value,
        decision_old=d_old.answer, decision_new=d_new.answer,
        expected_old=case.expected_old, expected_new=case.expected_new,
        sensitive=sensitive, tokens=len(ref_nb),
        answer_logits_old=tuple(d_old.scores.values()),
        answer_logits_new=tuple(d_new.scores.values()),
        answers=tuple(case.answers), text_old=d_old.text, text_new=d_new.text, rows=tuple(rows),
    )


def compare_strategies(engine: Engine, case: EditCase, strategies: Sequence[str] | None = None,
                       *, cot: bool = False) -> tuple[StrategyRow, ...]:
    """Every strategy on one :class:`~kvnotes.eval.tasks.EditCase`, side by side (for the demo):
    one :class:`StrategyRow` per strategy, compared with recompute of the new value."""
    settings = SuiteSettings(tuple(strategies or DEFAULT_STRATEGIES), cot=cot)
    return evaluate_case(engine, case, settings).rows
