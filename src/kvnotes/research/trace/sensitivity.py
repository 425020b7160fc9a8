"""Field sensitivity: does the field move the decision at all, per case and per family?

A normalized patching effect or a recovery rate has a denominator only when the field moves the
decision, so before tracing or editing a model this measures, per case, both prompts the suites
use, exactly recomputed for the old and for the new value:

- the **edit prompt** (:func:`kvnotes.research.edit.cases.case_prompt`): the decision the edit
  suite reads (:func:`kvnotes.ops.decisions.decide`); ``changed`` when it differs between old
  and new, and ``delta`` = the change of m = logit(new answer's first token) - logit(old
  answer's first token), new minus old;
- the **trace prompt** (:func:`kvnotes.research.trace.suite.case_inputs`): the trace's
  denominator ``d = m_new - m_old``; ``trace_sensitive`` when ``|d| >= min_denominator``.

Old and new answers are the task author's (``expected_old`` / ``expected_new``). Two prefills
per prompt and value, no patching: about a tenth of a trace's cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic.dataclasses import dataclass as record

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.records import JsonRecord, adapter

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.eval.tasks.base import EditCase


@record(frozen=True, slots=True)
class CaseSensitivity(JsonRecord):
    """One case: recompute's decisions for the old and new value and how far the field moves m."""

    case_id: str
    family: str
    decision_old: str | None
    decision_new: str | None
    changed: bool  # the edit prompt's decision differs between old and new
    delta: float  # edit prompt: m(new value) - m(old value)
    trace_delta: float | None  # trace prompt: m_new - m_old (None: not measured)
    intended: bool  # both decisions equal the task author's answers


@record(frozen=True, slots=True)
class FamilySensitivity(JsonRecord):
    """One family's counts: how many cases the field moves, by each prompt's criterion."""

    family: str
    n: int
    n_changed: int  # edit prompt: the decision changes
    n_trace_sensitive: int  # trace prompt: |d| >= min_denominator
    n_intended: int  # recompute decides as the task author intends, old and new
    median_abs_delta: float
    median_abs_trace_delta: float | None


@record(frozen=True, slots=True)
class SensitivityResult(JsonRecord):
    """A sensitivity run: the model, the seeds' split, the threshold, per family, per case."""

    model: str
    split: str
    min_denominator: float
    seconds: float
    families: tuple[FamilySensitivity, ...]
    cases: tuple[CaseSensitivity, ...]

    @classmethod
    def from_dict(cls, data: object) -> SensitivityResult:
        """Read back :meth:`to_dict`, the family rows counted again from the cases."""
        read: SensitivityResult = adapter(cls).validate_python(data)
        return replace(read, families=tuple(summarize(read.cases, read.min_denominator)))


def summarize(cases: Sequence[CaseSensitivity], min_denominator: float = 1.0
              ) -> list[FamilySensitivity]:
    """One row per family in first-seen order, then ``all`` when there are several."""
    names = list(dict.fromkeys(c.family for c in cases))
    groups = [(n, [c for c in cases if c.family == n]) for n in names]
    if len(names) > 1:
        groups.append(("all", list(cases)))
    rows = []
    for name, mine in groups:
        traced = [abs(c.trace_delta) for c in mine if c.trace_delta is not None]
        rows.append(FamilySensitivity(
            family=name, n=len(mine), n_changed=sum(c.changed for c in mine),
            n_trace_sensitive=sum(d >= min_denominator for d in traced),
            n_intended=sum(c.intended for c in mine),
            median_abs_delta=statistics.median(abs(c.delta) for c in mine) if mine else 0.0,
            median_abs_trace_delta=statistics.median(traced) if traced else None))
    return rows


def _margin(scores: dict[str, float], new: str, old: str) -> float:
    return scores[new] - scores[old]


def case_sensitivity(engine: Engine, case: EditCase, *, trace_prompt: bool = True
                     ) -> CaseSensitivity:
    """Recompute the case for its old and its new value at the edit (and trace) prompt."""
    from kvnotes.ops.decisions import decide
    from kvnotes.ops.trace import answer_token_ids
    from kvnotes.research.edit.cases import case_prompt
    from kvnotes.research.trace.suite import case_inputs

    if case.expected_old is None or case.expected_new is None:
        raise InvalidArgumentError(f"{case.case_id}: sensitivity needs expected_old and "
                                   "expected_new answers")
    doc, query = case_prompt(engine, case)
    old = decide(engine, engine.prefill(doc), query, case.answers)
    new = decide(engine, engine.prefill(doc.with_value(case.field, case.new_value)), query,
                 case.answers)
    delta = (_margin(new.scores, case.expected_new, case.expected_old)
             - _margin(old.scores, case.expected_new, case.expected_old))
    trace_delta = None
    if trace_prompt:
        tdoc, tquery, answers = case_inputs(engine, case)
        ids = answer_token_ids(engine, tquery, answers)
        m = []
        for d in (tdoc, tdoc.with_value(case.field, case.new_value)):
            logits = engine.next_logits(engine.prefill(d), tquery)
            m.append(float(logits[ids[0]] - logits[ids[1]]))
        trace_delta = m[1] - m[0]
    return CaseSensitivity(
        case_id=case.case_id, family=case.family, decision_old=old.answer,
        decision_new=new.answer, changed=old.answer != new.answer, delta=delta,
        trace_delta=trace_delta,
        intended=old.answer == case.expected_old and new.answer == case.expected_new)


def measure_sensitivity(engine: Engine, cases: Sequence[EditCase], *, split: str = "heldout",
                        min_denominator: float = 1.0, trace_prompt: bool = True,
                        progress: Callable[[CaseSensitivity], None] | None = None
                        ) -> SensitivityResult:
    """:func:`case_sensitivity` for every case, then the per-family counts."""
    t0 = time.perf_counter()
    out = []
    for case in cases:
        item = case_sensitivity(engine, case, trace_prompt=trace_prompt)
        out.append(item)
        if progress:
            progress(item)
    return SensitivityResult(engine.name, split, min_denominator, time.perf_counter() - t0,
                             tuple(summarize(out, min_denominator)), tuple(out))


def sensitivity_table(result: SensitivityResult) -> str:
    """The markdown table: per family, the cases whose decision the field moves."""
    lines = [f"| family | cases | decision changes (edit prompt) | abs(d) >= "
             f"{result.min_denominator:g} (trace prompt) | as intended old+new | "
             "median abs(delta m) edit | median abs(d) trace |", "|---|---|---|---|---|---|---|"]
    for r in result.families:
        trace = "-" if r.median_abs_trace_delta is None else f"{r.median_abs_trace_delta:.2f}"
        lines.append(f"| {r.family} | {r.n} | {r.n_changed} | {r.n_trace_sensitive} | "
                     f"{r.n_intended} | {r.median_abs_delta:.2f} | {trace} |")
    return "\n".join(lines)


def sensitivity_markdown(result: SensitivityResult, *, command: str = "",
                         machine: str = "") -> str:
    """``sensitivity.md``: what was measured, the table, one line per case."""
    md = [f"# Field sensitivity: {result.model}", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    if machine:
        md += [machine, ""]
    md += [f"Seed split: **{result.split}** (seeded families only; the others have one fixed "
           f"set of cases). {len(result.cases)} cases in {result.seconds:.0f} s.", "",
           "Per case, the old and new value recomputed exactly. Edit prompt: the decision the "
           "edit suite reads, and delta m = change of logit(new answer) - logit(old answer). "
           "Trace prompt: the trace's denominator d = m_new - m_old.", "",
           sensitivity_table(result), "", "| case | old -> new decision | changed | delta m | d "
           "(trace) |", "|---|---|---|---|---|"]
    for c in result.cases:
        d = "-" if c.trace_delta is None else f"{c.trace_delta:+.2f}"
        md.append(f"| {c.case_id} | {c.decision_old} -> {c.decision_new} | "
                  f"{'yes' if c.changed else 'no'} | {c.delta:+.2f} | {d} |")
    return "\n".join(md) + "\n"
