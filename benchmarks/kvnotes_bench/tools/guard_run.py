"""``kvnotes-bench guard``: the guard's calibration for one model on the development sets.

Each request is read composed (``strategy``, the default repair ``epic:32``) and exact; the
composed answer's first-token margin, first token, greedy continuation and decision are kept
per request (:class:`~kvnotes_bench.tools.guard_calib.GuardCase`), and the guard's curve
(fire rate, identity, cost per ``tau``) and the default it implies are read from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.tools.divergence import DivergenceCase, divergence_case
from kvnotes_bench.tools.divergence import markdown as divergence_markdown
from kvnotes_bench.tools.guard_calib import (
    FIRE_BUDGET,
    TAUS,
    GuardCase,
    GuardChoice,
    TauRow,
    choose_default,
    curve,
)
from kvnotes_bench.tools.guard_measure import (
    GREEDY_TOKENS,
    AirlinePrompts,
    decode,
    guard_case,
    notes_of,
    read,
    requests,
)
from kvnotes_bench.tools.strategies import SkillCache, parse_strategy

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class GuardBenchConfig:
    """What ``kvnotes-bench guard`` measures: ``cases`` requests of each set in ``sets``,
    composed by ``strategy``; the default is chosen within ``budget`` fired."""

    sets: tuple[str, ...] = ("live_multiple", "airline")
    cases: int = 40
    strategy: str = "epic:32"
    max_context: int = 2048
    budget: float = FIRE_BUDGET
    taus: tuple[float, ...] = TAUS
    # BFCL sets: also the divergence of 16 greedy tokens (these strategies besides
    # ``strategy``, and the one-skill recompute oracle; empty: none)
    divergence: tuple[str, ...] = ()
    part: tuple[int, int] = (0, 1)  # (i, n): every n-th request from the i-th (runs split)
    settings: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if parse_strategy(self.strategy).kind != "compose":
            raise InvalidArgumentError(f"--strategy {self.strategy!r}: the guard guards a "
                                       "composed strategy, e.g. epic:32")
        if isinstance(self.cases, bool) or self.cases < 1:
            raise InvalidArgumentError(f"--cases must be a positive count, got {self.cases!r}")
        if not 0 < self.budget <= 1:
            raise InvalidArgumentError(f"the fire budget must be in (0, 1], got {self.budget!r}")
        if 0.0 not in self.taus:
            raise InvalidArgumentError("the thresholds must include 0 (the guard off)")
        for name in self.divergence:
            if parse_strategy(name).kind != "compose":
                raise InvalidArgumentError(f"--divergence {name!r}: give composed strategies, "
                                           "e.g. pred+epic:32")
        i, n = self.part
        if not 0 <= i < n:
            raise InvalidArgumentError(f"--part {i}/{n}: give I/N with 0 <= I < N, e.g. 0/2")


@dataclass(frozen=True, slots=True)
class GuardBenchResult:
    """Per set: the requests measured and the guard's curve; the default they imply."""

    model: str
    strategy: str
    cases: dict[str, list[GuardCase]]
    curves: dict[str, list[TauRow]]
    choice: GuardChoice
    settings: dict[str, object]
    divergence: dict[str, list[DivergenceCase]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "strategy": self.strategy, "settings": self.settings,
                "choice": self.choice.to_dict(),
                "curves": {s: [r.to_dict() for r in rows] for s, rows in self.curves.items()},
                "margins": {s: margin_summary(cs) for s, cs in self.cases.items()},
                "cases": {s: [c.to_dict() for c in cs] for s, cs in self.cases.items()},
                "divergence": {s: [c.to_dict() for c in cs]
                               for s, cs in self.divergence.items()}}

    @classmethod
    def from_dicts(cls, runs: Sequence[dict[str, Any]], *, budget: float | None = None
                   ) -> GuardBenchResult:
        """Runs of one model and strategy (parts of one calibration, or sets measured
        apart) as one result: their requests pooled per set, the curves and default read
        again."""
        if not runs:
            raise InvalidArgumentError("give at least one guard.json")
        first = runs[0]
        if any((r["model"], r["strategy"]) != (first["model"], first["strategy"])
               for r in runs):
            raise InvalidArgumentError("the runs pooled must share their model and strategy")
        cases: dict[str, list[GuardCase]] = {}
        div: dict[str, list[DivergenceCase]] = {}
        for r in runs:
            for s, cs in r["cases"].items():
                cases.setdefault(s, []).extend(GuardCase.from_dict(c) for c in cs)
            for s, cs in r.get("divergence", {}).items():
                div.setdefault(s, []).extend(DivergenceCase.from_dict(c) for c in cs)
        taus = tuple(row["tau"] for row in next(iter(first["curves"].values())))
        limit = float(budget if budget is not None
                      else first["settings"].get("fire_budget", FIRE_BUDGET))
        curves = {s: curve(cs, taus) for s, cs in cases.items()}
        settings = {**first["settings"], "fire_budget": limit, "pooled_runs": len(runs),
                    "commands": [r["settings"].get("command") for r in runs]}
        return cls(first["model"], first["strategy"], cases, curves,
                   choose_default(curves, budget=limit), settings, div)


def margin_summary(cases: Sequence[GuardCase]) -> dict[str, float | int]:
    """Quantiles of the composed first-token margins, and of the exact prompt's."""
    def q(values: list[float], p: float) -> float:
        found = percentile(values, 100 * p)
        return math.nan if found is None else found
    comp, ex = [c.margin for c in cases], [c.exact_margin for c in cases]
    return {"n": len(cases), "composed_p10": q(comp, 0.1), "composed_p50": q(comp, 0.5),
            "exact_p10": q(ex, 0.1), "exact_p50": q(ex, 0.5),
            "under_0.5": sum(m < 0.5 for m in comp), "under_1": sum(m < 1.0 for m in comp)}


def run_guard_bench(engine: Engine, config: GuardBenchConfig, *, model: str,
                    progress: Progress | None = None, airline: AirlinePrompts | None = None
                    ) -> GuardBenchResult:
    """The calibration of ``config`` on ``engine`` (see the module doc); ``airline`` makes the
    airline set's prompts (:data:`~kvnotes_bench.tools.guard_measure.AirlinePrompts`)."""
    strategy, exact = parse_strategy(config.strategy), parse_strategy("exact")
    others = [parse_strategy(s) for s in config.divergence]
    skills = SkillCache(engine)
    cases: dict[str, list[GuardCase]] = {}
    div: dict[str, list[DivergenceCase]] = {}
    at, every = config.part
    for set_name in config.sets:
        found = requests(engine, set_name, config.cases, max_context=config.max_context,
                         airline=airline)
        found = found[at::every]
        out = []
        for i, req in enumerate(found):
            if progress:
                progress(f"{set_name} {i + 1}/{len(found)} {req.id}")
            composed = read(engine, req, notes_of(engine, req, strategy, skills))
            reference = read(engine, req, notes_of(engine, req, exact, skills))
            extra = ([read(engine, req, notes_of(engine, req, s, skills)) for s in others]
                     if req.decides else [])
            decode(engine, [composed, reference, *extra], GREEDY_TOKENS)
            out.append(guard_case(engine, req, composed, reference))
            if others and req.decides:
                div.setdefault(set_name, []).append(divergence_case(
                    engine, req, reference, [(strategy.name, composed),
                                             *zip(config.divergence, extra, strict=True)]))
        cases[set_name] = out
    curves = {s: curve(cs, config.taus) for s, cs in cases.items()}
    return GuardBenchResult(model, config.strategy, cases, curves,
                            choose_default(curves, budget=config.budget),
                            {**config.settings, "sets": list(config.sets),
                             "cases_asked": config.cases, "max_context": config.max_context,
                             "part": list(config.part), "fire_budget": config.budget,
                             "greedy_tokens": GREEDY_TOKENS,
                             "divergence": list(config.divergence)}, div)


def markdown(result: GuardBenchResult) -> str:
    """The curve per set as tables, and the default chosen."""
    lines = [f"# Guard calibration: {result.model}, {result.strategy} vs exact", "",
             f"Default: tau {result.choice.tau:g} ({result.choice.reason}).", ""]
    for set_name, rows in result.curves.items():
        m = margin_summary(result.cases[set_name])
        lines += [f"## {set_name} ({m['n']} requests; composed first-token margin p10 "
                  f"{m['composed_p10']:.2f}, median {m['composed_p50']:.2f}; exact p10 "
                  f"{m['exact_p10']:.2f}, median {m['exact_p50']:.2f})", "",
                  "| tau | fired | first token = exact | 16 tokens = exact | decision = exact "
                  "| spliced recomputed | prompt computed |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            choice = (f"{r.choice_same}/{r.choice_cases}" if r.choice_same is not None
                      else "-")
            lines.append(f"| {r.tau:g} | {r.fires}/{r.cases} ({r.fire_rate:.0%}) | "
                         f"{r.first_same}/{r.cases} | {r.greedy_same}/{r.cases} | {choice} | "
                         f"{r.spliced_share:.1%} | {r.computed_share:.1%} |")
        lines.append("")
    for set_name, found in result.divergence.items():
        names = [r.strategy for r in found[0].reads] if found else []
        lines += [f"## 16 greedy tokens on {set_name}", "",
                  divergence_markdown(result.model, found, names)]
    return "\n".join(lines)


def plot(result: GuardBenchResult, path: Path) -> Path:
    """Identity (16 tokens, first token) and fire rate against tau, one panel per set."""
    sets = list(result.curves)
    with panels(path, len(sets), size=(5.5 * len(sets), 4)) as axes:
        for ax, set_name in zip(axes, sets, strict=True):
            rows = result.curves[set_name]
            taus = [r.tau for r in rows]
            ax.plot(taus, [r.greedy_identity for r in rows], "o-", label="16 tokens = exact")
            ax.plot(taus, [r.first_identity for r in rows], "s--", label="first token = exact")
            ax.plot(taus, [r.fire_rate for r in rows], "^:", label="fired (answered exactly)")
            ax.axhline(result.settings.get("fire_budget", FIRE_BUDGET),
                       color="grey", lw=0.8)
            if result.choice.tau > 0:
                ax.axvline(result.choice.tau, color="green", lw=0.8)
            ax.set_title(f"{result.model}: {set_name} ({rows[0].cases} requests)")
            ax.set_xlabel("tau (first-token top-2 log-prob margin)")
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=8, loc="lower right")
    return path
