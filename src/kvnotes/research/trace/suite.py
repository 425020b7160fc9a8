"""Notes tracing over a task suite: one :func:`kvnotes.ops.trace.trace` per case, then aggregates.

**Decision position.** Each :class:`~kvnotes.eval.tasks.EditCase` becomes a document and a query
(:func:`case_inputs`). With a chat template (SmolLM2-Instruct) the document sits inside the
user turn, and the query is the rest of that turn (the question), the assistant prefix
``<|im_start|>assistant\\n`` and a started reply ``Answer:``. Without it the chat model's first
word is mostly a preamble ("The capital of ... is"), so its first-token logits say little about
the decision (SmolLM2, capital recall: |m_new - m_old| 0.3-2.8 at the bare assistant prefix,
5.4-5.5 after ``Answer:``). Without a chat template (Gemma 3 base) the query is
``"\\n\\n" + question + "\\nAnswer:"``. Either way the decision position is the token after
``Answer:``; answers are put in sentence case (``yes`` -> ``Yes``) with a leading space, and the
metric is the logit difference of their first tokens (new answer minus old answer).

**Aggregates.** Cases whose old/new values differ in token length, or whose answers share a
first token, are skipped and counted. Cases with ``|m_new - m_old| < min_denominator`` are
*insensitive*: their ratios are noise, so they are counted but kept out of every mean. Means
come with percentile bootstrap confidence intervals over cases.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field  # `field` names a result's figure below
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass as record

from kvnotes.core.chat import has_template, turn_frame
from kvnotes.core.document import Document
from kvnotes.core.errors import KvnotesError, TraceLengthError
from kvnotes.core.records import Json, JsonRecord, NullableFloat
from kvnotes.eval.tasks import EditCase
from kvnotes.ops.trace import TraceOptions, TraceResult, _finite, trace

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine


def _is_none(value: object) -> bool:
    return value is None


@record(frozen=True, slots=True)
class Estimate:
    """A mean over cases with its percentile bootstrap confidence interval (JSON: non-finite
    values as null; a missing estimate reads as none measured)."""

    mean: NullableFloat = math.nan
    lo: NullableFloat = math.nan
    hi: NullableFloat = math.nan
    n: int = 0

    def __str__(self) -> str:
        if self.n == 0:
            return "n/a"
        return f"{self.mean:.2f} [{self.lo:.2f}, {self.hi:.2f}]"


def _none_measured(value: object) -> object:
    return {} if value is None else value


# an estimate a stored summary may hold as null
StoredEstimate = Annotated[Estimate, BeforeValidator(_none_measured)]


def bootstrap_mean(values: Sequence[float], *, n_boot: int = 2000, level: float = 0.95,
                   seed: int = 0) -> Estimate:
    """Mean of ``values`` and a percentile bootstrap CI (NaN values are dropped)."""
    x = np.asarray([v for v in values if v == v], dtype=float)
    if x.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return Estimate(float(x.mean()), float(lo), float(hi), int(x.size))


@dataclass(frozen=True, slots=True)
class CaseTrace:
    """One case of the suite: its trace, or why it was skipped."""

    family: str
    case_id: str
    status: str  # "traced" | "skipped"
    reason: str = ""
    seconds: float = 0.0
    result: TraceResult | None = None

    def to_dict(self) -> Json:
        """The case as the trace log holds it (non-finite numbers as null)."""
        d = {k: v for k, v in asdict(self).items() if k != "result"}
        d["result"] = self.result.to_dict() if self.result else None
        out: Json = _finite(d)
        return out


def case_inputs(engine: Engine, case: EditCase) -> tuple[Document, str, tuple[str, str]]:
    """``(document, query, (new_answer, old_answer))`` for one case (see the module docstring)."""
    if case.expected_old is None or case.expected_new is None:
        raise KvnotesError(f"{case.case_id}: tracing needs expected_old and expected_new answers")
    if has_template(engine.tokenizer):
        head, close = turn_frame(engine.tokenizer, "user", generation_prompt=True)
        query = f"\n\n{case.question}{close}Answer:"
        doc = Document([head, *case.document.parts]) if head else case.document
    else:
        doc, query = case.document, f"\n\n{case.question}\nAnswer:"
    return doc, query, (_sentence(case.expected_new), _sentence(case.expected_old))


def _sentence(answer: str) -> str:
    return answer[:1].upper() + answer[1:]


@dataclass(frozen=True, slots=True)
class Picked:
    """The cases a trace run takes, and each family's equal-length pool they came from."""

    cases: tuple[EditCase, ...]
    pool: dict[str, tuple[int, int]]  # family (and "all") -> (equal-length cases, all cases)


def pick_cases(engine: Engine, cases: Sequence[EditCase], per_family: int) -> Picked:
    """Up to ``per_family`` cases of each family, spread out, among those whose old and new
    values have equal token lengths with this tokenizer (patching needs them)."""
    picked: list[EditCase] = []
    pool: dict[str, tuple[int, int]] = {}
    for fam in dict.fromkeys(c.family for c in cases):
        mine = [c for c in cases if c.family == fam]
        equal = [c for c in mine
                 if len(engine.encode(c.old_value)) == len(engine.encode(c.new_value))]
        pool[fam] = (len(equal), len(mine))
        k = min(per_family, len(equal))
        picked += [equal[i * len(equal) // k] for i in range(k)] if k else []
    pool["all"] = (sum(p[0] for p in pool.values()), sum(p[1] for p in pool.values()))
    return Picked(tuple(picked), pool)


def trace_cases(engine: Engine, cases: Sequence[EditCase], options: TraceOptions | None = None,
                *, progress: Callable[[CaseTrace], None] | None = None) -> list[CaseTrace]:
    """Trace every case; unequal token lengths and indistinguishable answers are skipped."""
    out = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            doc, query, answers = case_inputs(engine, case)
            if answers[0] == answers[1]:
                raise KvnotesError("old and new values lead to the same answer")
            result = trace(engine, doc, field=case.field, new_value=case.new_value, query=query,
                           answers=answers, options=options)
            item = CaseTrace(case.family, case.case_id, "traced",
                             seconds=time.perf_counter() - t0, result=result)
        except TraceLengthError as err:
            item = CaseTrace(case.family, case.case_id, "skipped", f"unequal length: {err}")
        except KvnotesError as err:
            item = CaseTrace(case.family, case.case_id, "skipped", str(err))
        out.append(item)
        if progress:
            progress(item)
    return out


@record(frozen=True, slots=True)
class FamilySummary(JsonRecord):
    """Share of the decision carried by the field KV vs the notes, over one family's cases."""

    family: str
    n_cases: int
    n_skipped_length: int
    n_skipped_other: int
    n_insensitive: int  # traced, |m_new - m_old| < min_denominator: kept out of the means
    n_sensitive: int
    n_flips: int  # sensitive cases whose preferred answer flips between old and new runs
    median_abs_denominator: NullableFloat
    field: StoredEstimate  # denoising: new field KV in the old notebook
    notes: StoredEstimate  # denoising: new notes, old field KV
    noising_field: StoredEstimate  # share lost when only the field is reverted
    noising_notes: StoredEstimate  # share lost when only the notes are reverted
    field_by_layer: list[NullableFloat] = dataclass_field(default_factory=list)  # denoising means
    notes_by_layer: list[NullableFloat] = dataclass_field(default_factory=list)
    # denoising, binned positions
    notes_by_position: list[NullableFloat] = dataclass_field(default_factory=list)
    grid: list[list[NullableFloat]] = dataclass_field(default_factory=list)  # denoising mean grid
    noising_grid: list[list[NullableFloat]] = dataclass_field(default_factory=list)


@record(frozen=True, slots=True)
class CaseOutcome(JsonRecord):
    """One traced (or skipped) case in brief: the effects without the per-layer detail."""

    case_id: str
    family: str
    status: str  # "traced" | "skipped"
    reason: str = ""
    # below: None for a skipped case (then left out of the JSON)
    denominator: float | None = Field(default=None, exclude_if=_is_none)  # m_new - m_old
    sensitive: bool | None = Field(default=None, exclude_if=_is_none)
    field: float | None = Field(default=None, exclude_if=_is_none)  # effect of the field's KV
    notes: float | None = Field(default=None, exclude_if=_is_none)  # effect of the notes

    @classmethod
    def of(cls, t: CaseTrace) -> CaseOutcome:
        r = t.result
        if r is None:
            return cls(t.case_id, t.family, t.status, t.reason[:120])
        return cls(t.case_id, t.family, t.status, t.reason[:120], denominator=r.denominator,
                   sensitive=r.sensitive, field=r.field_effect, notes=r.notes_effect)


@record(frozen=True, slots=True)
class TraceSuiteResult(JsonRecord):
    """A traced suite in brief: one :class:`FamilySummary` per family (then ``all``) and one
    :class:`CaseOutcome` per case."""

    model: str
    families: tuple[FamilySummary, ...]
    cases: tuple[CaseOutcome, ...]

    @model_validator(mode="before")
    @classmethod
    def _older_files(cls, data: object) -> object:
        """Older files name no model."""
        return {"model": "", **data} if isinstance(data, dict) else data

    @classmethod
    def of(cls, model: str, traces: Sequence[CaseTrace],
           rows: Sequence[FamilySummary]) -> TraceSuiteResult:
        return cls(model, tuple(rows), tuple(CaseOutcome.of(t) for t in traces))

    def overall(self) -> FamilySummary | None:
        """The summary over every traced family (``all``, or the only family)."""
        return next((r for r in self.families if r.family == "all"),
                    self.families[-1] if self.families else None)



def summarize(traces: Sequence[CaseTrace], *, min_denominator: float = 1.0, n_boot: int = 2000,
              seed: int = 0, families: Sequence[str] = ()) -> list[FamilySummary]:
    """One :class:`FamilySummary` per family (in first-seen order), then ``"all"``.

    ``families`` names families to list even when none of their cases was traced.
    """
    families = list(dict.fromkeys([*families, *(t.family for t in traces)]))
    rows = [_summary(f, [t for t in traces if t.family == f], min_denominator, n_boot, seed)
            for f in families]
    if len(families) > 1:
        rows.append(_summary("all", list(traces), min_denominator, n_boot, seed))
    return rows


def _summary(family: str, traces: list[CaseTrace], min_denominator: float, n_boot: int,
             seed: int) -> FamilySummary:
    traced = [t.result for t in traces if t.result is not None]
    sens = [r for r in traced if abs(r.denominator) >= min_denominator]
    den = [r.denoising for r in sens if r.denoising is not None]
    noi = [r.noising for r in sens if r.noising is not None]

    def est(xs: list[float]) -> Estimate:
        return bootstrap_mean(xs, n_boot=n_boot, seed=seed)

    return FamilySummary(
        family=family, n_cases=len(traces),
        n_skipped_length=sum(t.reason.startswith("unequal length") for t in traces),
        n_skipped_other=sum(t.status == "skipped" and not t.reason.startswith("unequal length")
                            for t in traces),
        n_insensitive=len(traced) - len(sens), n_sensitive=len(sens),
        n_flips=sum(r.flips for r in sens),
        median_abs_denominator=float(np.median([abs(r.denominator) for r in traced]))
        if traced else float("nan"),
        field=est([e.field for e in den]), notes=est([e.notes for e in den]),
        noising_field=est([e.field for e in noi]), noising_notes=est([e.notes for e in noi]),
        field_by_layer=_mean_rows([e.field_by_layer for e in den]),
        notes_by_layer=_mean_rows([e.notes_by_layer for e in den]),
        notes_by_position=_mean_rows([e.notes_by_position for e in den]),
        grid=_mean_grid([e.grid for e in den]), noising_grid=_mean_grid([e.grid for e in noi]),
    )


def _mean_rows(rows: list[list[float]]) -> list[float]:
    rows = [r for r in rows if r]
    if not rows or len({len(r) for r in rows}) != 1:
        return []
    return [float(v) for v in np.nanmean(np.asarray(rows, dtype=float), axis=0)]


def _mean_grid(grids: list[list[list[float]]]) -> list[list[float]]:
    grids = [g for g in grids if g]
    if not grids or len({np.shape(g) for g in grids}) != 1:
        return []
    return np.nanmean(np.asarray(grids, dtype=float), axis=0).tolist()
