"""What the tool benchmark measures, as typed results: frozen pydantic dataclasses, read and
written at the JSON edge by :class:`~kvnotes.core.records.JsonRecord`."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic import computed_field, model_validator
from pydantic.dataclasses import dataclass as record

from kvnotes.core.records import JsonRecord, adapter


@record(frozen=True, slots=True)
class Outcome(JsonRecord):
    """One strategy on one case, against the exact prompt and against BFCL's answer.

    Token counts cover the prompt and the call opening fed after it (``tokens_total``):
    ``reused`` were spliced and kept, ``computed`` prefilled (text parts, the opening, the
    exact prompt), ``repaired`` spliced then recomputed; ``select_tokens`` (the KV-deviation
    pass) and ``guard_tokens`` (a fired guard's recompute) are extra work in token-equivalents.
    ``exact_skills`` were spliced as they are because exactly placed (compose's own count);
    ``variants_new`` / ``skills_new``: compiled variants and skill texts this strategy spliced
    here for the first time in the run (its library grows by them; None where nothing is
    spliced from a library of its own: the exact prompt, a guard).
    """

    strategy: str
    choice: str
    exact_choice: str
    correct: bool
    margin: float  # the decision's margin (min gap over the steps that had a choice)
    first_token_agree: bool  # argmax of the next-token logits equals the exact prompt's
    kl: float  # KL(exact || this) at the decision position, nats
    cosine: float
    exact_top2_margin: float  # the exact prompt's gap between its two best tokens
    tokens_total: int
    reused: int
    computed: int
    repaired: int
    select_tokens: float
    guard_tokens: int
    spliced: int  # tokens that came from compiled skills (reused + repaired)
    ttft_s: float  # building the notes + feeding the opening (contended machine: see load)
    greedy_text: str | None = None
    greedy_identical: bool | None = None
    guard_fired: bool | None = None
    guard_tau: float | None = None
    exact_skills: int | None = None
    variants_new: int | None = None
    skills_new: int | None = None
    # BFCL's AST checker on the call the longer greedy answer writes (None: not run)
    call_parsed: bool | None = None
    call_valid: bool | None = None

    # derived: written beside the fields, recomputed on reading
    @computed_field  # type: ignore[prop-decorator]
    @property
    def identical(self) -> bool:
        return self.choice == self.exact_choice

    @computed_field  # type: ignore[prop-decorator]
    @property
    def compute_fraction(self) -> float:
        work = self.computed + self.repaired + self.select_tokens + self.guard_tokens
        return work / max(1, self.tokens_total)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def recompute_share(self) -> float:
        """Work spent on spliced tokens (repair, selection, guard) as a share of them."""
        return (self.repaired + self.select_tokens + self.guard_tokens) / max(1, self.spliced)


@record(frozen=True, slots=True)
class CaseResult(JsonRecord):
    """One case: its size, which half it belongs to, and every strategy's outcome."""

    id: str
    half: str  # "calibrate" | "evaluate" (guards are calibrated on one, reported on the other)
    candidates: int
    skills: int
    tokens: int
    exact_prefix: int  # leading tokens whose notes are exact in every strategy (BOS, header)
    answers: tuple[str, ...]
    outcomes: tuple[Outcome, ...]

    def outcome(self, strategy: str) -> Outcome | None:
        return next((o for o in self.outcomes if o.strategy == strategy), None)


@record(frozen=True, slots=True)
class Skipped(JsonRecord):
    id: str
    reason: str
    tokens: int


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


@record(frozen=True, slots=True)
class StrategySummary(JsonRecord):
    """One strategy over the cases it ran on."""

    strategy: str
    cases: int
    identical: int
    correct: int
    exact_correct: int  # the exact prompt's accuracy on the same cases
    first_token_agree: int
    kl_median: float
    kl_mean: float
    flip_margin_max: float  # the largest exact-prompt decision margin among flipped cases
    greedy_cases: int
    greedy_identical: int
    compute_fraction: float  # mean over cases
    recompute_share: float  # mean share of spliced tokens recomputed (repair + select + guard)
    ttft_ratio_median: float  # exact's TTFT / this one's, per case (contended: see load)
    guard_fires: int
    guard_tau: float | None
    # the library the strategy spliced from over these cases: compiled variants, skill texts
    variants: int | None = None
    distinct_skills: int | None = None
    # BFCL's AST checker where the answer parses as a call (None: not run)
    calls_checked: int | None = None
    calls_parsed: int | None = None
    calls_valid: int | None = None
    exact_calls_valid: int | None = None

    @classmethod
    def of(cls, strategy: str, cases: Sequence[CaseResult]) -> StrategySummary:
        pairs: list[tuple[CaseResult, Outcome, Outcome]] = []
        for c in cases:
            o, e = c.outcome(strategy), c.outcome("exact")
            if o is not None and e is not None:
                pairs.append((c, o, e))
        outs = [o for _, o, _ in pairs]
        greedy = [o for o in outs if o.greedy_identical is not None]
        flips = [e.margin for _, o, e in pairs if not o.identical]
        taus = {o.guard_tau for o in outs if o.guard_tau is not None}
        library = [o for o in outs if o.variants_new is not None]
        checked = [(o, e) for _, o, e in pairs if o.call_parsed is not None]
        return cls(
            strategy=strategy, cases=len(outs), identical=sum(o.identical for o in outs),
            correct=sum(o.correct for o in outs),
            exact_correct=sum(e.correct for _, _, e in pairs),
            first_token_agree=sum(o.first_token_agree for o in outs),
            kl_median=_median([o.kl for o in outs]), kl_mean=_mean([o.kl for o in outs]),
            flip_margin_max=max((m for m in flips if not math.isnan(m)), default=math.nan),
            greedy_cases=len(greedy), greedy_identical=sum(bool(o.greedy_identical)
                                                           for o in greedy),
            compute_fraction=_mean([o.compute_fraction for o in outs]),
            recompute_share=_mean([o.recompute_share for o in outs]),
            ttft_ratio_median=_median([e.ttft_s / o.ttft_s for _, o, e in pairs if o.ttft_s]),
            guard_fires=sum(bool(o.guard_fired) for o in outs),
            guard_tau=taus.pop() if len(taus) == 1 else None,
            variants=sum((o.variants_new or 0) for o in library) if library else None,
            distinct_skills=sum((o.skills_new or 0) for o in library) if library else None,
            calls_checked=len(checked) if checked else None,
            calls_parsed=sum(bool(o.call_parsed) for o, _ in checked) if checked else None,
            calls_valid=sum(bool(o.call_valid) for o, _ in checked) if checked else None,
            exact_calls_valid=sum(bool(e.call_valid) for _, e in checked) if checked else None,
        )


@record(frozen=True, slots=True)
class GuardPoint(JsonRecord):
    """The guard at one threshold, read offline from a base strategy's margins: a fired guard
    decides on notes recomputed exactly (the exact prompt's decision, up to float error)."""

    base: str
    tau: float
    cases: int
    identical: int
    fires: int
    compute_fraction: float
    recompute_share: float = math.nan  # work on spliced tokens (a fire: all of them) / them


@record(frozen=True, slots=True)
class BenchResult(JsonRecord):
    """A whole run: settings, machine, every case, the skipped ones, per-strategy summaries."""

    # in the order of the JSON: the settings and summaries before the long case list
    model: str
    set: str
    strategies: tuple[str, ...]
    decision: str
    settings: dict[str, Any] = field(default_factory=dict)  # the command line's, as given
    taus: dict[str, float] = field(kw_only=True)
    machine: dict[str, Any] = field(kw_only=True)  # kvnotes.core.machine.machine_info
    summaries: tuple[StrategySummary, ...] = field(kw_only=True)
    guard_curve: tuple[GuardPoint, ...] = field(kw_only=True)
    skipped: tuple[Skipped, ...] = field(kw_only=True)
    cases: tuple[CaseResult, ...] = field(kw_only=True)


@record(frozen=True, slots=True)
class StoredRun:
    """A finished run's summaries read back from its ``results.json`` (what a report that
    cites the stored results needs: model, set, when, how, the load, each strategy's row)."""

    folder: str  # the bundle's folder name
    model: str
    set: str
    date: str
    command: str
    load_1min: float
    summaries: tuple[StrategySummary, ...]

    @property
    def cases(self) -> int:
        """The cases the run measured (its exact row's)."""
        return max((s.cases for s in self.summaries), default=0)

    @model_validator(mode="before")
    @classmethod
    def _from_results(cls, data: object) -> object:
        """A ``results.json`` (with ``folder`` added): date and command from its settings, the
        1-minute load from its machine record."""
        if isinstance(data, dict) and "load_1min" not in data:
            settings, machine = data.get("settings") or {}, data.get("machine") or {}
            load = machine.get("load_average") or [math.nan]
            return {**data, "date": str(settings.get("date", "")),
                    "command": str(settings.get("command", "")), "load_1min": load[0]}
        return data


def stored_runs(root: Path, model: str) -> list[StoredRun]:
    """Every run of ``model`` stored under ``root`` (one ``<folder>/results.json`` each);
    none when ``root`` is missing. An unreadable file is skipped."""
    runs = []
    for path in sorted(root.glob("*/results.json")) if root.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("model") == model:
                runs.append(adapter(StoredRun).validate_python({**data, "folder": path.parent.name}))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return runs
