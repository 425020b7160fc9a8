"""The guard's calibration arithmetic: what a threshold ``tau`` on the first answer token's
top-2 log-prob margin buys (identity with the exact prompt) and costs (requests answered
exactly), read offline from one measurement per case.

A case (:class:`GuardCase`) holds the composed answer's first-token margin, whether its first
token and its greedy continuation equal the exact prompt's, and its token counts. A guard at
``tau`` fires where the margin is under it (as the front's ``guard_fires``): that request is
answered by the exact prompt, so it is identical, and it pays for the exact prefill on top of
the composed one. :func:`curve` gives one :class:`TauRow` per threshold; :func:`choose_default`
picks a model's default from its rows on every development set.

Nothing here imports torch or a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvnotes.core.errors import InvalidArgumentError

# thresholds every calibration reports (nats; the front's ``kvnotes.guard`` takes the same)
TAUS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
FIRE_BUDGET = 0.2  # the largest share of requests a default guard may answer exactly


@dataclass(frozen=True, slots=True)
class GuardCase:
    """One request measured both ways (composed with the default repair, and exact).

    ``margin``: the composed answer's first token, top-1 minus top-2 log-prob (nan: unknown,
    the guard fires). ``first_same`` / ``greedy_same`` / ``choice_same``: its first token, its
    greedy continuation, and the decision read from it (None where the set reads none) equal
    the exact prompt's. ``tokens``: the prompt's; ``spliced``: the skills' tokens;
    ``repaired``: spliced tokens recomputed by the repair; ``prefix``: the leading tokens an
    exact request finds cached (BOS and header), so a fired guard computes ``tokens - prefix``.
    """

    id: str
    set: str
    margin: float
    exact_margin: float
    first_same: bool
    greedy_same: bool
    choice_same: bool | None
    tokens: int
    spliced: int
    repaired: int
    prefix: int

    def fires(self, tau: float) -> bool:
        """Whether a guard at ``tau`` answers this request exactly (``tau`` 0: never)."""
        return tau > 0 and (math.isnan(self.margin) or self.margin < tau)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardCase:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class TauRow:
    """The guard at ``tau`` over ``cases`` requests of one set.

    ``spliced_share``: spliced tokens recomputed (the repair's, plus every spliced token of a
    fired request) over the spliced tokens, summed over the requests; ``computed_share``: the
    prompt tokens run through the model (the composed request's, plus ``tokens - prefix`` for
    each fired one) over the prompt tokens.
    """

    tau: float
    cases: int
    fires: int
    first_same: int
    greedy_same: int
    choice_same: int | None
    choice_cases: int
    spliced_share: float
    computed_share: float

    @property
    def fire_rate(self) -> float:
        return self.fires / self.cases if self.cases else 0.0

    @property
    def greedy_identity(self) -> float:
        return self.greedy_same / self.cases if self.cases else 0.0

    @property
    def first_identity(self) -> float:
        return self.first_same / self.cases if self.cases else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fire_rate": self.fire_rate,
                "first_identity": self.first_identity, "greedy_identity": self.greedy_identity}


def row(cases: Sequence[GuardCase], tau: float) -> TauRow:
    """The guard at ``tau`` over ``cases`` (see :class:`TauRow`)."""
    if not (tau >= 0 and math.isfinite(tau)):
        raise InvalidArgumentError(f"guard tau must be a finite margin >= 0, got {tau!r}")
    fires = [c.fires(tau) for c in cases]
    decided = [(c, f) for c, f in zip(cases, fires, strict=True) if c.choice_same is not None]
    spliced = sum(c.spliced for c in cases)
    recomputed = sum(c.repaired + (c.spliced if f else 0) for c, f in zip(cases, fires,
                                                                           strict=True))
    tokens = sum(c.tokens for c in cases)
    computed = sum(c.tokens - c.spliced + c.repaired + ((c.tokens - c.prefix) if f else 0)
                   for c, f in zip(cases, fires, strict=True))
    return TauRow(
        tau=tau, cases=len(cases), fires=sum(fires),
        first_same=sum(f or c.first_same for c, f in zip(cases, fires, strict=True)),
        greedy_same=sum(f or c.greedy_same for c, f in zip(cases, fires, strict=True)),
        choice_same=sum(bool(f or c.choice_same) for c, f in decided) if decided else None,
        choice_cases=len(decided),
        spliced_share=recomputed / spliced if spliced else 0.0,
        computed_share=computed / tokens if tokens else 0.0)


def curve(cases: Sequence[GuardCase], taus: Sequence[float] = TAUS) -> list[TauRow]:
    """One :class:`TauRow` per threshold, in ``taus``' order."""
    return [row(cases, t) for t in taus]


@dataclass(frozen=True, slots=True)
class GuardChoice:
    """A model's default guard: ``tau`` (0: off) and why, with what it measured at that tau
    on each development set (``rows``, by set name)."""

    tau: float
    reason: str
    rows: dict[str, TauRow]

    def to_dict(self) -> dict[str, Any]:
        return {"tau": self.tau, "reason": self.reason,
                "rows": {k: v.to_dict() for k, v in self.rows.items()}}


def choose_default(curves: Mapping[str, Sequence[TauRow]], *,
                   budget: float = FIRE_BUDGET) -> GuardChoice:
    """The threshold a model ships with, from its :func:`curve` on each development set (the
    same ``taus`` in each).

    Only thresholds whose fire rate stays within ``budget`` on every set are candidates; of
    those, the one with the most first answer tokens identical to the exact prompt's (what the
    guard reads and fixes), then the most identical greedy continuations, summed over the sets
    (the smallest such tau). When no candidate makes a first token identical that was not, the
    guard ships off: a continuation that a fired request happens to fix is not what the guard
    is for, and a model whose first tokens are near ties would pay for an exact prefill on most
    requests to fix its decisions.
    """
    if not curves:
        raise InvalidArgumentError("choose_default needs the curve of at least one set")
    taus = [r.tau for r in next(iter(curves.values()))]
    if any([r.tau for r in rows] != taus for rows in curves.values()):
        raise InvalidArgumentError("every set's curve must list the same thresholds")
    if 0.0 not in taus:
        raise InvalidArgumentError("the curves must include tau 0 (the guard off)")
    by_tau = {t: {name: rows[i] for name, rows in curves.items()} for i, t in enumerate(taus)}
    off = by_tau[0.0]

    def gain(t: float) -> tuple[int, int]:
        return (sum(by_tau[t][s].first_same - off[s].first_same for s in curves),
                sum(by_tau[t][s].greedy_same - off[s].greedy_same for s in curves))

    within = [t for t in taus if all(r.fire_rate <= budget for r in by_tau[t].values())]
    best = max(sorted(within), key=gain)  # max keeps the first (smallest) of equal gains
    over = {s: next((r.fire_rate for r in rows if r.tau > 0 and r.first_same
                     > off[s].first_same), None) for s, rows in curves.items()}
    if gain(best)[0] <= 0:
        costly = ", ".join(f"{s} {f:.0%}" for s, f in over.items() if f is not None)
        reason = (f"off: no threshold fixes a first token while answering at most "
                  f"{budget:.0%} of requests exactly"
                  + (f" (the first that fixes one fires on {costly})" if costly else ""))
        return GuardChoice(0.0, reason, off)
    sets = ", ".join(
        f"{s} first tokens +{by_tau[best][s].first_same - off[s].first_same}, 16 tokens "
        f"+{by_tau[best][s].greedy_same - off[s].greedy_same} of {off[s].cases} at "
        f"{by_tau[best][s].fire_rate:.0%} fired" for s in curves)
    return GuardChoice(best, f"most first tokens fixed within {budget:.0%} fired: {sets}",
                       by_tau[best])
