"""``kvnotes-bench divergence``: what limits 16-token greedy identity with the exact prompt.

For each BFCL case the greedy continuation after ``{"name": "`` is decoded from the exact
notes and from each composed strategy's (``epic:32``, the default repair, and ``pred+epic:32``,
skills compiled behind their predecessor). Per strategy: the first token that differs and
where it sits (the first token, which is the decision; the rest of the function name; the
arguments), and whether the continuation is identical when the first token is.

Which skill's splice causes a divergence is measured by an oracle: for every case where the
first strategy's continuation differs, each spliced skill in turn has all its notes recomputed
in context (the others left as spliced, the tail recomputed on top) and the continuation is
decoded again; a skill *restores* the case when that alone makes the 16 tokens equal the exact
prompt's. Each skill's notes deviation from the exact notes (relative L2 over its tokens,
keys and values, averaged over layers) is kept beside it, to see whether the skill that
deviates most is the one that matters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.notebook import Notebook
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.tools.guard_measure import (
    GREEDY_TOKENS,
    Reading,
    Request,
    decode,
    first_divergence,
    notes_of,
    read,
    requests,
    skill_ids,
)
from kvnotes_bench.tools.strategies import SkillCache, parse_strategy

Progress = Callable[[str], None]
WHERE = ("first token", "rest of the name", "arguments")


@dataclass(frozen=True, slots=True)
class StrategyRead:
    """One strategy's continuation on one case, against the exact prompt's."""

    strategy: str
    first_same: bool
    greedy_same: bool
    diverges_at: int | None  # first differing token (None: identical)
    where: str | None  # one of WHERE (None: identical)
    text: str


@dataclass(frozen=True, slots=True)
class SkillOracle:
    """One spliced skill of a case: its place (0 = first listed), tokens, notes deviation from
    the exact notes, and whether recomputing all of it restores the 16 tokens (and the first)."""

    index: int
    tokens: int
    deviation: float
    restores: bool
    restores_first: bool


@dataclass(frozen=True, slots=True)
class DivergenceCase:
    """One case: each strategy's read, and the oracle over the first strategy's skills (empty
    when its continuation is identical)."""

    id: str
    skills: int
    exact_text: str
    name_tokens: int  # tokens of the exact answer up to and with its closing quote
    reads: tuple[StrategyRead, ...]
    oracle: tuple[SkillOracle, ...] = ()

    def read_of(self, strategy: str) -> StrategyRead:
        return next(r for r in self.reads if r.strategy == strategy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DivergenceCase:
        return cls(d["id"], d["skills"], d["exact_text"], d["name_tokens"],
                   tuple(StrategyRead(**r) for r in d["reads"]),
                   tuple(SkillOracle(**o) for o in d["oracle"]))


@dataclass(frozen=True, slots=True)
class DivergenceConfig:
    """What ``kvnotes-bench divergence`` runs."""

    set: str = "live_multiple"
    cases: int = 40
    strategies: tuple[str, ...] = ("epic:32", "pred+epic:32")
    oracle: bool = True
    max_context: int = 2048
    settings: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.set not in ("live_multiple", "multi_turn"):
            raise InvalidArgumentError(f"--set {self.set!r}: the divergence is read on BFCL's "
                                       "development sets, live_multiple or multi_turn")
        if not self.strategies:
            raise InvalidArgumentError("give at least one composed strategy, e.g. epic:32")
        for s in self.strategies:
            if parse_strategy(s).kind != "compose":
                raise InvalidArgumentError(f"strategy {s!r}: give composed strategies, e.g. "
                                           "epic:32 or pred+epic:32")


def where_of(position: int, name_tokens: int) -> str:
    """Where a divergence at ``position`` sits in an answer whose name (with its closing
    quote) is the first ``name_tokens`` tokens.

    Example:
        >>> where_of(0, 4), where_of(2, 4), where_of(4, 4)
        ('first token', 'rest of the name', 'arguments')
    """
    if position == 0:
        return WHERE[0]
    return WHERE[1] if position < name_tokens else WHERE[2]


def name_length(engine: Engine, ids: Sequence[int]) -> int:
    """Tokens up to and with the one that closes the name (all of them when none does)."""
    for i in range(len(ids)):
        if '"' in engine.decode(list(ids[:i + 1])):
            return i + 1
    return len(ids)


def deviation(a: Notebook, b: Notebook, start: int, end: int) -> float:
    """Relative L2 distance of ``a``'s notes from ``b``'s over tokens ``[start, end)``, keys
    and values, averaged over layers."""
    out = []
    for la, lb in zip(a.layers, b.layers, strict=True):
        for x, y in ((la.keys, lb.keys), (la.values, lb.values)):
            xs, ys = x[..., start:end, :].float(), y[..., start:end, :].float()
            out.append(float(torch.linalg.vector_norm(xs - ys)
                             / torch.linalg.vector_norm(ys).clamp_min(1e-12)))
    return sum(out) / len(out)


def _read_of(engine: Engine, name: str, r: Reading, exact: Reading, name_tokens: int
             ) -> StrategyRead:
    at = first_divergence(r.greedy, exact.greedy)
    return StrategyRead(name, r.first == exact.first, at is None, at,
                        None if at is None else where_of(at, name_tokens),
                        engine.decode(r.greedy))


def oracle(engine: Engine, req: Request, composed: Reading, exact: Reading, *,
           n: int = GREEDY_TOKENS) -> tuple[SkillOracle, ...]:
    """Each spliced skill of ``req`` recomputed alone in ``composed``'s notes (see the module
    doc); the first skill, spliced where it was compiled (behind the header), is exact
    already and is left out."""
    _, spans = skill_ids(engine, req.prompt)
    reads = []
    for a, b in spans[1:]:
        reads.append(read(engine, req, engine.recompute(composed.notes, range(a, b))))
    decode(engine, reads, n)
    return tuple(SkillOracle(i + 1, b - a, deviation(composed.notes, exact.notes, a, b),
                             r.greedy == exact.greedy, r.first == exact.first)
                 for i, ((a, b), r) in enumerate(zip(spans[1:], reads, strict=True)))


def divergence_case(engine: Engine, req: Request, exact: Reading,
                    reads: Sequence[tuple[str, Reading]], *, oracle_on: bool = True
                    ) -> DivergenceCase:
    """One case's record from its decoded readings (the oracle on the first strategy's
    notes, when its continuation differs and ``oracle_on``)."""
    n_name = name_length(engine, exact.greedy)
    rows = tuple(_read_of(engine, name, r, exact, n_name) for name, r in reads)
    checks = (oracle(engine, req, reads[0][1], exact, n=len(exact.greedy))
              if oracle_on and not rows[0].greedy_same else ())
    return DivergenceCase(req.id, len(req.prompt.skills), engine.decode(exact.greedy), n_name,
                          rows, checks)


def run_divergence(engine: Engine, config: DivergenceConfig, *, progress: Progress | None = None
                   ) -> list[DivergenceCase]:
    """Every case of ``config`` (see the module doc)."""
    strategies = [parse_strategy(s) for s in config.strategies]
    exact_s = parse_strategy("exact")
    skills = SkillCache(engine)
    out = []
    found = requests(engine, config.set, config.cases, max_context=config.max_context)
    for i, req in enumerate(found):
        if progress:
            progress(f"{config.set} {i + 1}/{len(found)} {req.id}")
        exact = read(engine, req, notes_of(engine, req, exact_s, skills))
        reads = [read(engine, req, notes_of(engine, req, s, skills)) for s in strategies]
        decode(engine, [exact, *reads], GREEDY_TOKENS)
        out.append(divergence_case(engine, req, exact,
                                   [(s.name, r) for s, r in zip(strategies, reads, strict=True)],
                                   oracle_on=config.oracle))
    return out


@dataclass(frozen=True, slots=True)
class DivergenceSummary:
    """One strategy over the cases: identity, identity given the first token, where the
    continuations part."""

    strategy: str
    cases: int
    first_same: int
    greedy_same: int
    greedy_given_first: int  # identical continuations among first-token-identical cases
    where: dict[str, int]
    positions: list[int]  # first differing token of each divergent case

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(cases: Sequence[DivergenceCase], strategy: str) -> DivergenceSummary:
    reads = [c.read_of(strategy) for c in cases]
    return DivergenceSummary(
        strategy, len(reads), sum(r.first_same for r in reads), sum(r.greedy_same for r in reads),
        sum(r.greedy_same for r in reads if r.first_same),
        {w: sum(r.where == w for r in reads) for w in WHERE},
        sorted(r.diverges_at for r in reads if r.diverges_at is not None))


@dataclass(frozen=True, slots=True)
class OracleSummary:
    """The oracle over the divergent cases: how many one skill's recompute restores, whether
    that skill is the last one listed (right before the question) or the one whose notes
    deviate most, and which place restores most often."""

    divergent: int
    restored: int
    restored_by_last: int
    restored_by_most_deviating: int
    last_is_most_deviating: int
    by_place_from_end: dict[str, int]  # "1" = the last skill; how many cases each restores

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_oracle(cases: Sequence[DivergenceCase]) -> OracleSummary:
    checked = [c for c in cases if c.oracle]
    places: dict[str, int] = {}
    restored = by_last = by_dev = last_dev = 0
    for c in checked:
        most = max(c.oracle, key=lambda o: o.deviation)
        last = max(c.oracle, key=lambda o: o.index)
        last_dev += most.index == last.index
        fixes = [o for o in c.oracle if o.restores]
        restored += bool(fixes)
        by_last += last.restores
        by_dev += most.restores
        for o in fixes:
            key = str(c.skills - o.index)
            places[key] = places.get(key, 0) + 1
    return OracleSummary(len(checked), restored, by_last, by_dev, last_dev,
                         dict(sorted(places.items(), key=lambda kv: int(kv[0]))))


def markdown(model: str, cases: Sequence[DivergenceCase], strategies: Sequence[str]) -> str:
    lines = [f"# What limits 16-token identity: {model}, {len(cases)} cases", "",
             "| strategy | first token = exact | 16 tokens = exact | 16 = exact given first = "
             "exact | diverges at: first token / rest of name / arguments |",
             "|---|---|---|---|---|"]
    for s in strategies:
        m = summarize(cases, s)
        lines.append(f"| {s} | {m.first_same}/{m.cases} | {m.greedy_same}/{m.cases} | "
                     f"{m.greedy_given_first}/{m.first_same} | "
                     f"{' / '.join(str(m.where[w]) for w in WHERE)} |")
    o = summarize_oracle(cases)
    if o.divergent:
        lines += ["", f"Oracle over the {o.divergent} cases where {strategies[0]} diverges: one "
                  f"skill recomputed in full restores the 16 tokens in {o.restored}; the last "
                  f"skill (right before the question) in {o.restored_by_last}; the skill whose "
                  f"notes deviate most in {o.restored_by_most_deviating} (it is the last one in "
                  f"{o.last_is_most_deviating}). Restoring skill by place from the end "
                  f"(1 = last): {o.by_place_from_end}."]
    return "\n".join(lines) + "\n"


def plot(model: str, cases: Sequence[DivergenceCase], strategies: Sequence[str], path: Path
         ) -> Path:
    """Left: the first differing token's position per strategy; right: how often recomputing
    the skill at each place from the end restores the continuation."""
    with panels(path, 2, size=(11, 4)) as (a1, a2):
        for s in strategies:
            m = summarize(cases, s)
            counts = [m.positions.count(i) for i in range(GREEDY_TOKENS)]
            a1.plot(range(GREEDY_TOKENS), counts, "o-", label=f"{s} ({m.greedy_same}/{m.cases} "
                                                               "identical)")
        a1.set_xlabel("first differing greedy token (0 = the decision)")
        a1.set_ylabel("cases")
        a1.set_title(f"{model}: where continuations part")
        a1.legend(fontsize=8)
        checked = [c for c in cases if c.oracle]
        places = range(1, max((c.skills for c in checked), default=2))
        tried = [sum(1 for c in checked if c.skills - p >= 1) for p in places]
        fixed = [sum(1 for c in checked for o in c.oracle if o.restores and c.skills - o.index == p)
                 for p in places]
        a2.bar([str(p) for p in places], tried, color="lightgrey", label="cases with a skill there")
        a2.bar([str(p) for p in places], fixed, label="its recompute restores 16 tokens")
        a2.set_xlabel("recomputed skill's place from the end (1 = right before the question)")
        a2.set_title(f"oracle over {len(checked)} divergent cases ({strategies[0]})")
        a2.legend(fontsize=8)
    return path
