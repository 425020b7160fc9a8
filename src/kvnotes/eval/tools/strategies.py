"""How a case's prompt is turned into notes: the exact prompt, or composed skills with a lever.

Strategy names (``--strategies``), each a :class:`Strategy`:

- ``exact``: the same token ids prefilled from scratch (the reference);
- ``splice``: skills compiled behind the header and spliced, no repair (``repair=0``);
- ``first:F`` / ``kvdev:F``: the same with ``repair=F`` of the spliced tokens recomputed in
  context, each skill's first tokens / the tokens whose layer-1 notes deviate most;
- ``anchor`` / ``anchor+first:F`` / ``anchor+kvdev:F``: skills compiled behind the header and a
  neutral stand-in tool (:data:`~kvnotes.eval.tools.prompt.STAND_IN`, its notes dropped), so no
  spliced skill is compiled as the first one listed;
- ``epic:K`` / ``anchor+epic:K``: a fixed first ``K`` tokens of every skill recomputed in
  context (EPIC's choice), whatever the skill's length, before the question is prefilled;
- ``guard:BASE`` / ``guard:BASE@TAU``: BASE's decision, re-decided on notes recomputed exactly
  when its margin is under TAU (``decide``'s guard, :func:`kvnotes.ops.decisions.guarded`);
  without ``@TAU`` it is calibrated on the calibration half of the cases.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.notebook import Notebook
from kvnotes.eval.tools.prompt import STAND_IN, CasePrompt, skill_text

DEFAULT_STRATEGIES = ("exact", "splice", "first:0.1", "first:0.3", "kvdev:0.1", "anchor",
                      "anchor+first:0.1", "guard:splice", "guard:first:0.1")
_COMPOSE = re.compile(r"^(anchor)?(?:\+?(first|kvdev):([0-9.]+))?$")
_EPIC = re.compile(r"^(anchor\+)?epic:([0-9]+)$")
_SELECT = {"first": "first", "kvdev": "kv_deviation"}


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to build a case's notes (see the module doc for the names)."""

    name: str
    kind: str  # "exact" | "compose" | "guard"
    repair: float = 0.0
    select: str = "first"
    first_k: int = 0  # EPIC: this many first tokens of every skill recomputed (0: off)
    anchor: bool = False
    base: str = ""  # guard: the strategy whose decision is guarded
    tau: float | None = None  # guard: fixed threshold (None: calibrated)


def parse_strategy(spec: str) -> Strategy:
    """A strategy from its name; a clear error listing the forms otherwise."""
    spec = spec.strip()
    if spec == "exact":
        return Strategy("exact", "exact")
    if spec.startswith("guard:"):
        rest = spec.removeprefix("guard:")
        base, _, tau = rest.partition("@")
        inner = parse_strategy(base)
        if inner.kind != "compose":
            raise InvalidArgumentError(f"strategy {spec!r}: a guard guards a composed strategy "
                                       "(splice, first:F, kvdev:F, anchor...), not "
                                       f"{inner.name!r}")
        try:
            fixed = float(tau) if tau else None
        except ValueError as err:
            raise InvalidArgumentError(f"strategy {spec!r}: TAU after @ must be a number, "
                                       "e.g. guard:splice@0.5") from err
        return Strategy(spec, "guard", base=inner.name, tau=fixed)
    if spec == "splice":
        return Strategy("splice", "compose")
    epic = _EPIC.match(spec)
    if epic:
        return Strategy(spec, "compose", anchor=bool(epic.group(1)), first_k=int(epic.group(2)))
    m = _COMPOSE.match(spec)
    if m and (m.group(1) or m.group(2)):
        repair = float(m.group(3)) if m.group(3) else 0.0
        if not 0.0 <= repair <= 1.0:
            raise InvalidArgumentError(f"strategy {spec!r}: the repair fraction must be in "
                                       "[0, 1], e.g. first:0.1")
        return Strategy(spec, "compose", repair, _SELECT[m.group(2) or "first"],
                        anchor=bool(m.group(1)))
    raise InvalidArgumentError(
        f"unknown strategy {spec!r}; use exact, splice, first:F, kvdev:F, epic:K, anchor, "
        "anchor+first:F, anchor+kvdev:F, anchor+epic:K, guard:BASE or guard:BASE@TAU (F a "
        "fraction in [0, 1], K a token count)")


def parse_strategies(specs: list[str]) -> list[Strategy]:
    """Strategies in order, ``exact`` first and every guard's base included (added when
    missing: a guard reads its base's decision)."""
    chosen = [parse_strategy(s) for s in specs if s.strip()]
    names = [s.name for s in chosen]
    for s in list(chosen):
        if s.kind == "guard" and s.base not in names:
            chosen.append(parse_strategy(s.base))
            names.append(s.base)
    if "exact" not in names:
        chosen.append(parse_strategy("exact"))
    # exact, then composed strategies, then guards (which read their base's result)
    order = {"exact": 0, "compose": 1, "guard": 2}
    return sorted(dict((s.name, s) for s in chosen).values(), key=lambda s: order[s.kind])


class SkillCache:
    """Compiled skills of one run, keyed by text and anchoring: compiled once, reused by
    every case that lists the same tool (as a deployment would)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._skills: dict[tuple[str, str, bool], Notebook] = {}
        self.seconds = 0.0

    def get(self, text: str, header: str, *, anchor: bool) -> Notebook:
        key = (text, header, anchor)
        if key not in self._skills:
            t0 = time.perf_counter()
            after: str | list[int] = header
            if anchor:
                after = [*self.engine.anchor_ids(header),
                         *self.engine.encode(skill_text(STAND_IN))]
            self._skills[key] = self.engine.compile(text, name="tool", after=after)
            self.seconds += time.perf_counter() - t0
        return self._skills[key]


def exact_ids(engine: Engine, prompt: CasePrompt) -> tuple[list[int], int]:
    """The prompt's token ids exactly as :meth:`Engine.compose` lays them out (BOS when the
    tokenizer adds one, then each part encoded on its own), and where the first skill starts."""
    ids = [engine.bos_id] if engine.adds_bos else []
    ids += engine.encode(prompt.header)
    first_skill = len(ids)
    for text in (*prompt.skills, prompt.question):
        ids += engine.encode(text)
    return [int(i) for i in ids], first_skill


def build(engine: Engine, prompt: CasePrompt, strategy: Strategy, skills: SkillCache
          ) -> Notebook:
    """The case's notes by ``strategy`` (exact or composed); guards are run by the runner."""
    if strategy.kind == "exact":
        return engine.prefill(exact_ids(engine, prompt)[0])
    if strategy.kind != "compose":
        raise InvalidArgumentError(f"build() makes exact or composed notes, not {strategy.kind}")
    compiled = [skills.get(text, prompt.header, anchor=strategy.anchor) for text in prompt.skills]
    if strategy.first_k:
        return _first_k_per_skill(engine, prompt, compiled, strategy.first_k)
    repair: float | int = strategy.repair if strategy.repair else 0
    return engine.compose([prompt.header, *compiled, prompt.question], repair=repair,
                          select=strategy.select)


def _first_k_per_skill(engine: Engine, prompt: CasePrompt, compiled: list[Notebook], k: int
                       ) -> Notebook:
    """EPIC's plan with the public API: splice the skills, recompute each one's first ``k``
    tokens in context (in order, each run on top of the repaired notes before it), then
    prefill the question on top of the repaired notes."""
    nb = engine.compose([prompt.header, *compiled], repair=0)
    at = len(nb) - sum(len(c) for c in compiled)
    chosen: list[int] = []
    for c in compiled:
        chosen += range(at, at + min(k, len(c)))
        at += len(c)
    nb = engine.recompute(nb, chosen)
    stats = dict(nb.meta.get("compose", {}))
    computed = int(stats.get("computed", 0)) + len(engine.encode(prompt.question))
    nb = engine.extend(nb, prompt.question)
    return nb.with_meta(compose={**stats, "reused": int(stats.get("reused", 0)) - len(chosen),
                                 "repaired": len(chosen), "computed": computed,
                                 "select": f"first {k} per skill"})
