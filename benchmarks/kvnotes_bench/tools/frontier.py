"""How far composed answers get from the exact prompt's at each cost: the guard swept over a
strategy's stored margins, read from ``kvnotes-bench tools`` bundles (no model is run).

A guard at ``tau`` answers a case exactly when the strategy's decision margin is under ``tau``
(:func:`~kvnotes_bench.tools.runner.guard_curve`): a fired case's tool choice and greedy
continuation are the exact prompt's, and it costs every token after the exact prefix. Sweeping
``tau`` over every margin in the run gives the staircase from the strategy alone (``tau = 0``)
to the exact prompt; where it crosses the identity goals tells how much recompute they cost.

Two readings of the threshold are reported, because picking it on the very cases it is read on
flatters it: ``best`` is the smallest ``tau`` that reaches the identity goals on all cases
(in-sample; whether its recompute is within the budget is reported beside it),
``calibrated`` the one :func:`~kvnotes_bench.tools.runner.calibrate_tau` picks on the
calibration half (every decision identical there), read on the evaluation half only.

Usage::

    python -m kvnotes_bench.tools.frontier docs/results/tools/*-live_multiple-40-anchoring \\
        --base pred+epic:32 --base epic:32 --out docs/results/tools/frontier
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, KvnotesError
from kvnotes.research.tool_runs import CaseResult
from kvnotes_bench.tools.runner import calibrate_tau, guard_curve

CHOICE_GOAL = 0.99  # tool choice identical to the exact prompt's
GREEDY_GOAL = 0.90  # 16-token greedy continuation identical
BUDGET = 0.15  # recompute of spliced tokens


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """The guard on ``base`` at ``tau`` over ``cases``: identical counts and cost."""

    tau: float
    cases: int
    fires: int
    choice_identical: int
    greedy_identical: int | None  # None: the bundle ran no greedy continuation
    recompute_share: float  # work on spliced tokens (repair, a fire's recompute) / them
    compute_fraction: float  # tokens run through the model / prompt tokens

    @property
    def choice_rate(self) -> float:
        return self.choice_identical / max(1, self.cases)

    @property
    def greedy_rate(self) -> float | None:
        return None if self.greedy_identical is None else self.greedy_identical / max(1, self.cases)

    def identical_enough(self, choice_goal: float = CHOICE_GOAL,
                         greedy_goal: float = GREEDY_GOAL) -> bool:
        """Both identity goals met (the greedy one where the bundle ran continuations)."""
        greedy = self.greedy_rate
        return (self.choice_rate >= choice_goal - 1e-9
                and (greedy is None or greedy >= greedy_goal - 1e-9))

    @property
    def within_budget(self) -> bool:
        return self.recompute_share <= BUDGET + 1e-9

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "choice_rate": self.choice_rate, "greedy_rate": self.greedy_rate}


@dataclass(frozen=True, slots=True)
class Frontier:
    """One model and base strategy: the swept staircase and its two chosen thresholds."""

    model: str
    set: str
    base: str
    bundle: str
    points: tuple[FrontierPoint, ...]  # by tau, the first at 0 (the strategy alone)
    best: FrontierPoint | None  # smallest tau meeting the identity goals on all cases
    calibrated_tau: float
    calibrated: FrontierPoint  # that tau on the evaluation half only

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "set": self.set, "base": self.base, "bundle": self.bundle,
                "points": [p.to_dict() for p in self.points],
                "best": self.best.to_dict() if self.best else None,
                "calibrated_tau": self.calibrated_tau,
                "calibrated": self.calibrated.to_dict()}


def point(cases: Sequence[CaseResult], base: str, tau: float) -> FrontierPoint:
    """The guard on ``base`` at ``tau``: :func:`guard_curve`'s choice and cost, plus the greedy
    continuations (a fired case's is the exact prompt's)."""
    curve = guard_curve(cases, base, [tau])[0]
    outs = [o for c in cases if (o := c.outcome(base)) is not None]
    greedy: int | None = None
    if outs and all(o.greedy_identical is not None for o in outs):
        greedy = sum(bool(o.greedy_identical) or (not math.isnan(o.margin) and o.margin < tau)
                     for o in outs)
    return FrontierPoint(tau, curve.cases, curve.fires, curve.identical, greedy,
                         curve.recompute_share, curve.compute_fraction)


def sweep_taus(cases: Sequence[CaseResult], base: str) -> list[float]:
    """0, then just above each distinct margin of ``base``: every step of the staircase."""
    margins = sorted({round(o.margin, 6) for c in cases if (o := c.outcome(base)) is not None
                      and not math.isnan(o.margin)})
    return [0.0, *(m + 1e-4 for m in margins)]


def frontier(cases: Sequence[CaseResult], base: str, *, model: str, set_name: str,
             bundle: str) -> Frontier:
    """The staircase of ``base`` over ``cases`` and its in-sample and calibrated thresholds."""
    if not any(c.outcome(base) for c in cases):
        raise InvalidArgumentError(f"{bundle}: no case holds strategy {base!r}")
    points = tuple(point(cases, base, tau) for tau in sweep_taus(cases, base))
    best = next((p for p in points if p.identical_enough()), None)
    tau = calibrate_tau([c for c in cases if c.half == "calibrate"], base, 1.0)
    held = point([c for c in cases if c.half == "evaluate"], base, tau)
    return Frontier(model, set_name, base, bundle, points, best, tau, held)


def read_bundle(folder: Path) -> tuple[str, str, list[CaseResult]]:
    """A ``kvnotes-bench tools`` bundle's model, set and cases."""
    path = folder / "results.json"
    if not path.is_file():
        raise InvalidArgumentError(f"{folder}: no results.json (a `kvnotes-bench tools` --out)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data["model"], data["set"], [CaseResult.from_dict(c) for c in data["cases"]]
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidArgumentError(f"{path}: not a `kvnotes-bench tools` result "
                                   f"({type(err).__name__}: {err})") from err


def frontiers_of(bundles: Sequence[tuple[Path, str, str, list[CaseResult]]],
                 bases: Sequence[str]) -> list[Frontier]:
    """Every base's frontier in every bundle that ran it (bundles of one model may hold
    different strategies); a base no bundle ran is an error."""
    out = []
    for base in bases:
        found = [frontier(cases, base, model=model, set_name=set_name, bundle=str(folder))
                 for folder, model, set_name, cases in bundles
                 if any(c.outcome(base) for c in cases)]
        if not found:
            raise InvalidArgumentError(f"no bundle holds strategy {base!r}")
        out += found
    return out


def plot(frontiers: Sequence[Frontier], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    models = sorted({f.model for f in frontiers})
    bases = sorted({f.base for f in frontiers}, key=lambda b: (len(b), b), reverse=True)
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    styles = {b: ("-", "--", ":", "-.")[i % 4] for i, b in enumerate(bases)}
    panels = [("tool choice identical to exact (%)", CHOICE_GOAL, "choice_rate"),
              ("16-token greedy identical to exact (%)", GREEDY_GOAL, "greedy_rate")]
    for ax, (label, goal, attr) in zip(axes, panels, strict=True):
        for f in frontiers:
            pts = [(p.recompute_share, getattr(p, attr)) for p in f.points]
            if any(y is None for _, y in pts):
                continue
            xs = [x for x, _ in pts]
            ys = [100 * y for _, y in pts]
            ax.step(xs, ys, where="post", color=colors[f.model], ls=styles[f.base],
                    label=f"{f.model}, guard on {f.base}")
            ax.plot(xs[:1], ys[:1], "o", color=colors[f.model])
        ax.axhline(100 * goal, color="grey", ls="--", lw=0.8)
        ax.axvline(BUDGET, color="grey", ls=":", lw=0.8)
        ax.set_xlim(0, 0.6)
        ax.set_xlabel("recompute of spliced tokens (repair + guard fires)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    sets = sorted({f.set for f in frontiers})
    fig.suptitle(f"BFCL {', '.join(sets)}: identity vs recompute, the guard swept over each "
                 f"strategy's margins (dot: no guard; goals {CHOICE_GOAL:.0%} / "
                 f"{GREEDY_GOAL:.0%} at <= {BUDGET:.0%})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(p: FrontierPoint | None) -> str:
    if p is None:
        return "not reached"
    greedy = "-" if p.greedy_identical is None else f"{p.greedy_identical}/{p.cases}"
    return (f"tau {p.tau:.3f}: choice {p.choice_identical}/{p.cases}, 16 tokens {greedy}, "
            f"fired {p.fires}, recompute {p.recompute_share:.1%}"
            + ("" if p.within_budget else f" (over {BUDGET:.0%})"))


def report(frontiers: Sequence[Frontier]) -> str:
    lines = ["| model | base | alone (tau 0) | smallest tau meeting the identity goals (all cases) | "
             "calibrated on one half, read on the other |", "|---|---|---|---|---|"]
    for f in frontiers:
        lines.append(f"| {f.model} | {f.base} | {_fmt(f.points[0])} | {_fmt(f.best)} | "
                     f"{_fmt(f.calibrated)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("bundles", nargs="+", type=Path, help="kvnotes-bench tools --out folders")
    parser.add_argument("--base", action="append", default=None,
                        help="strategy the guard guards (repeatable; default pred+epic:32)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    bases = args.base or ["pred+epic:32"]
    frontiers = frontiers_of([(folder, *read_bundle(folder)) for folder in args.bundles], bases)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"goals": {"choice": CHOICE_GOAL, "greedy": GREEDY_GOAL, "budget": BUDGET},
           "command": "python -m kvnotes_bench.tools.frontier "
                      + " ".join(str(b) for b in args.bundles)
                      + "".join(f" --base {b}" for b in bases) + f" --out {args.out}",
           "frontiers": [f.to_dict() for f in frontiers]}
    (args.out / "frontier.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (args.out / "report.md").write_text(report(frontiers), encoding="utf-8")
    plot(frontiers, args.out / "frontier.png")
    print(report(frontiers), end="")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KvnotesError as err:  # a bad bundle or strategy: one line, not a traceback
        raise SystemExit(f"error: {err}") from None
