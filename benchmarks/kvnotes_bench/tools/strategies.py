"""How a case's prompt is turned into notes: the exact prompt, or composed skills with a lever.

Strategy names (``--strategies``), each a :class:`Strategy`:

- ``exact``: the same token ids prefilled from scratch (the reference);
- ``splice``: skills compiled behind the header and spliced, no repair (``repair=0``);
- ``first:F`` / ``kvdev:F``: the same with ``repair=F`` of the spliced tokens recomputed in
  context, each skill's first tokens / the tokens whose layer-1 notes deviate most;
- ``anchor`` / ``anchor+first:F`` / ``anchor+kvdev:F``: skills compiled behind the header and a
  neutral stand-in tool (:data:`~kvnotes_bench.tools.prompt.STAND_IN`, its notes dropped), so no
  spliced skill is compiled as the first one listed;
- ``pred`` / ``pred+epic:K``: variants behind the actual predecessor: each skill compiled
  behind the header and the skill that precedes it in the case's order (the first one behind
  the header alone), one compiled variant per (predecessor, skill) pair, reused by every case
  with the same pair, as a variant library would;
- ``epic:K`` / ``anchor+epic:K`` / ``pred+epic:K``: a fixed first ``K`` tokens of every skill
  recomputed in context (EPIC's choice), whatever the skill's length, before the question is
  prefilled (``Repair(first=K)``);
- ``epic:K@F``: the share floor: each skill's first ``max(K, ceil(F * len))`` tokens
  (``Repair(first=K, share=F)``), so a long manual gets more than a short tool;
- ``epic:K~T`` (or ``epic:K@F~T``): the adaptive rule: the region grows 32 tokens at a time
  while the last recomputed tokens' notes moved by more than ``T`` (relative L2 of keys and
  values), up to a quarter of the skill (``Repair(first=K, adapt=T)``);
- ``ape:T`` / ``ape:T+epic:K``: the splice (or ``epic:K``) with APE's temperature on the spliced
  keys: before the question is prefilled, the keys of every spliced token that was not
  recomputed are divided by ``T`` in every layer (a copy of the notes; values untouched), so
  every later query scores them ``q.k / T`` (``T > 1`` flattens the attention they get,
  ``T < 1`` sharpens it; ``T = 1`` is the plain strategy);
- ``default``: ``engine.compose([header, *skills, question])`` with the engine's default repair;
- ``library``: the same with ``library=`` a :class:`~kvnotes.SkillLibrary` (a temporary folder)
  that holds each skill compiled behind the header and, as variants, behind the header and the
  skill that precedes it in the case (``pred``'s, stored by ``library.get(text, after=...)``):
  compose swaps in the variant the prompt ranks first, as a server's library does;
- ``guard:BASE`` / ``guard:BASE@TAU``: BASE's decision, re-decided on notes recomputed exactly
  when its margin is under TAU (``decide``'s guard, :func:`kvnotes.ops.decisions.guarded`);
  without ``@TAU`` it is calibrated on the calibration half of the cases.

The engine does not repair a skill spliced exactly where it was compiled (the first tool right
after the header it was compiled behind, without ``anchor``): its notes are already the exact
prompt's, so ``epic:K`` recomputes ``K`` tokens of every tool but that one. With ``pred`` the
second tool is exactly placed too (compiled behind the header and the first tool, the whole
prefix it sits behind), so ``pred+epic:K`` recomputes ``K`` tokens of the third tool on; every
later one was compiled behind its predecessor alone, not the whole prefix, and is repaired.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.notebook import LayerKV, Notebook
from kvnotes.core.repair import Repair
from kvnotes.ops.store import SkillLibrary
from kvnotes_bench.tools.prompt import STAND_IN, CasePrompt, skill_text

DEFAULT_STRATEGIES = ("exact", "splice", "first:0.1", "first:0.3", "kvdev:0.1", "anchor",
                      "anchor+first:0.1", "guard:splice", "guard:first:0.1")
_COMPOSE = re.compile(r"^(anchor)?(?:\+?(first|kvdev):([0-9.]+))?$")
_EPIC = re.compile(r"^(?:(anchor|pred)\+)?epic:([0-9]+)(?:@([0-9.]+))?(?:~([0-9.]+))?$")
_APE = re.compile(r"^ape:([0-9]*\.?[0-9]+)(?:\+(.+))?$")
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
    predecessor: bool = False  # ``pred``: each skill compiled behind the one before it
    base: str = ""  # guard: the strategy whose decision is guarded
    tau: float | None = None  # guard: fixed threshold (None: calibrated)
    temperature: float = 1.0  # APE: spliced, not recomputed keys divided by this
    engine_default: bool = False  # ``default``: compose's own default repair
    share: float = 0.0  # ``epic:K@F``: each skill's first max(K, ceil(F * len)) tokens
    adapt: float | None = None  # ``epic:K~T``: grown while the notes moved by more than T
    library: bool = False  # ``library``: compose's defaults with a variants library


def parse_strategy(spec: str) -> Strategy:
    """A strategy from its name; a clear error listing the forms otherwise."""
    spec = spec.strip()
    if spec == "exact":
        return Strategy("exact", "exact")
    if spec == "default":
        return Strategy("default", "compose", engine_default=True)
    if spec == "library":
        return Strategy("library", "compose", engine_default=True, library=True)
    if spec.startswith("guard:"):
        rest = spec.removeprefix("guard:")
        # the last @ is the threshold: a share-floor base (epic:K@F) carries its own @
        base, _, tau = rest.rpartition("@") if rest.count("@") > 1 else rest.partition("@")
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
    ape = _APE.match(spec)
    if ape:
        inner = parse_strategy(ape.group(2) or "splice")
        temperature = float(ape.group(1))
        if not (inner.first_k or inner.name == "splice") or inner.anchor or inner.predecessor:
            raise InvalidArgumentError(f"strategy {spec!r}: APE's temperature goes on the "
                                       "splice or on epic:K (ape:T or ape:T+epic:K)")
        if not 0.05 <= temperature <= 20:
            raise InvalidArgumentError(f"strategy {spec!r}: the temperature T must be in "
                                       "[0.05, 20], e.g. ape:1.2")
        return replace(inner, name=spec, temperature=temperature)
    if spec == "splice":
        return Strategy("splice", "compose")
    if spec == "pred":
        return Strategy("pred", "compose", predecessor=True)
    epic = _EPIC.match(spec)
    if epic:
        strategy = Strategy(spec, "compose", anchor=epic.group(1) == "anchor",
                            predecessor=epic.group(1) == "pred", first_k=int(epic.group(2)),
                            share=float(epic.group(3) or 0),
                            adapt=float(epic.group(4)) if epic.group(4) else None)
        try:
            repair_of(strategy)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"strategy {spec!r}: {err} (epic:K@F takes a share F in "
                                       "[0, 1], epic:K~T a threshold T >= 0)") from err
        return strategy
    if spec.startswith("pred"):
        raise InvalidArgumentError(f"strategy {spec!r}: variants behind the predecessor go "
                                   "alone or with EPIC's repair: pred or pred+epic:K (K a "
                                   "token count, e.g. pred+epic:32)")
    m = _COMPOSE.match(spec)
    if m and (m.group(1) or m.group(2)):
        repair = float(m.group(3)) if m.group(3) else 0.0
        if not 0.0 <= repair <= 1.0:
            raise InvalidArgumentError(f"strategy {spec!r}: the repair fraction must be in "
                                       "[0, 1], e.g. first:0.1")
        return Strategy(spec, "compose", repair, _SELECT[m.group(2) or "first"],
                        anchor=bool(m.group(1)))
    raise InvalidArgumentError(
        f"unknown strategy {spec!r}; use exact, default, library, splice, first:F, kvdev:F, "
        "epic:K, epic:K@F, epic:K~T, anchor, anchor+first:F, anchor+kvdev:F, anchor+epic:K, pred, "
        "pred+epic:K, ape:T, ape:T+epic:K, "
        "guard:BASE or guard:BASE@TAU (F a fraction in [0, 1], K a token count, T a "
        "temperature)")


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


@dataclass(frozen=True, slots=True)
class Variant:
    """One compiled form of a skill: its text compiled behind the header and ``behind`` (the
    text between them when it was compiled: empty for the header alone, the stand-in tool for
    ``anchor``, the preceding skill for ``pred``)."""

    text: str
    header: str
    behind: str = ""


def variants(prompt: CasePrompt, strategy: Strategy) -> list[Variant]:
    """The compiled variants ``strategy`` splices for ``prompt``'s skills, in order."""
    if strategy.anchor:
        stand_in = skill_text(STAND_IN, prompt.opening)
        return [Variant(text, prompt.header, stand_in) for text in prompt.skills]
    plain = [Variant(text, prompt.header) for text in prompt.skills]
    if strategy.predecessor or strategy.library:
        before = ("", *prompt.skills[:-1])
        pred = [Variant(text, prompt.header, b) for b, text in zip(before, prompt.skills,
                                                                    strict=True)]
        # the library holds both: the header-anchored skills spliced, their variants swapped in
        return pred if strategy.predecessor else plain + [v for v in pred if v.behind]
    return plain


class SkillCache:
    """Compiled skill variants of one run: each compiled once and reused by every case and
    strategy that splices the same variant (as a deployment's library would). ``record`` keeps,
    per strategy, which variants and skill texts it has used, to count the library it needs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._skills: dict[Variant, Notebook] = {}
        self._used: dict[str, tuple[set[Variant], set[str]]] = {}
        self.seconds = 0.0
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._library: SkillLibrary | None = None
        self._stored: set[Variant] = set()

    def library(self, stored: Sequence[Variant]) -> SkillLibrary:
        """The run's variants library (a temporary folder), holding ``stored`` (compiled once,
        counted in :attr:`seconds`)."""
        if self._library is None:
            self._folder = tempfile.TemporaryDirectory(prefix="kvnotes-variants-")
            self._library = SkillLibrary(self._folder.name, self.engine)
        for v in stored:
            if v not in self._stored:
                t0 = time.perf_counter()
                self._library.get(v.text, name="tool", after=self._after(v))
                self.seconds += time.perf_counter() - t0
                self._stored.add(v)
        return self._library

    def _after(self, variant: Variant) -> str | list[int]:
        if not variant.behind:
            return variant.header
        return [*self.engine.anchor_ids(variant.header), *self.engine.encode(variant.behind)]

    @property
    def compiled(self) -> int:
        """Variants compiled so far (all strategies together)."""
        return len(self._skills)

    def get(self, variant: Variant) -> Notebook:
        if variant not in self._skills:
            t0 = time.perf_counter()
            self._skills[variant] = self.engine.compile(variant.text, name="tool",
                                                        after=self._after(variant))
            self.seconds += time.perf_counter() - t0
        return self._skills[variant]

    def record(self, library: str, used: Sequence[Variant]) -> tuple[int, int]:
        """Marks ``used`` as spliced by ``library`` (a strategy's name); how many of those
        variants, and of their skill texts, it had not used before."""
        seen, texts = self._used.setdefault(library, (set(), set()))
        new = set(used) - seen
        new_texts = {v.text for v in used} - texts
        seen |= new
        texts |= new_texts
        return len(new), len(new_texts)


def exact_ids(engine: Engine, prompt: CasePrompt) -> tuple[list[int], int]:
    """The prompt's token ids exactly as :meth:`Engine.compose` lays them out (BOS when the
    tokenizer adds one, then each part encoded on its own), and where the first skill starts."""
    ids = [engine.bos_id] if engine.adds_bos and engine.bos_id is not None else []
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
    if strategy.library:
        every = variants(prompt, strategy)
        lib = skills.library([v for v in every if v.behind])
        compiled = [skills.get(v) for v in every if not v.behind]
        return engine.compose([prompt.header, *compiled, prompt.question], library=lib)
    compiled = [skills.get(v) for v in variants(prompt, strategy)]
    if strategy.engine_default:
        return engine.compose([prompt.header, *compiled, prompt.question])
    plan = repair_of(strategy)
    if strategy.temperature == 1.0:
        return engine.compose([prompt.header, *compiled, prompt.question], repair=plan)
    # APE: the temperature goes on the skills' notes before the question reads them
    nb = engine.compose([prompt.header, *compiled], repair=plan)
    nb = spliced_temperature(nb, _kept(nb, compiled), strategy.temperature)
    return _with_question(engine, nb, prompt.question, strategy.temperature)


def repair_of(strategy: Strategy) -> Repair:
    """The engine's repair plan of a composed strategy: ``epic:K`` recomputes each skill's
    first K tokens (``Repair(first=K)``, exact placements skipped), ``first:F`` / ``kvdev:F``
    a shared budget F chosen by ``select``, ``splice`` nothing; ``epic:K@F`` adds the share
    floor, ``epic:K~T`` the adaptive rule."""
    return Repair(first=strategy.first_k, budget=strategy.repair or 0, select=strategy.select,
                  share=strategy.share, adapt=strategy.adapt)


def _kept(nb: Notebook, compiled: list[Notebook]) -> list[int]:
    """Indices of the spliced tokens compose did not recompute (the skills end ``nb``)."""
    start = len(nb) - sum(len(c) for c in compiled)
    done = {i for a, b in nb.meta.get("compose", {}).get("regions", []) for i in range(a, b)}
    return [i for i in range(start, len(nb)) if i not in done]


def spliced_temperature(nb: Notebook, indices: list[int], temperature: float) -> Notebook:
    """A copy of ``nb`` whose keys at ``indices`` are divided by ``temperature`` in every layer
    (values untouched): every later query scores those tokens ``q.k / temperature``, APE's
    temperature on parallel-encoded context. ``temperature=1`` copies the notes unchanged."""
    scale = torch.ones(len(nb), dtype=torch.float32)
    scale[torch.as_tensor(indices, dtype=torch.long)] = 1.0 / temperature
    layers = []
    for layer in nb.layers:
        s = scale.to(device=layer.keys.device, dtype=layer.keys.dtype)
        layers.append(LayerKV(layer.keys * s[None, None, :, None], layer.values.clone()))
    return nb.with_layers(layers)


def _with_question(engine: Engine, nb: Notebook, question: str, temperature: float
                   ) -> Notebook:
    """``question`` prefilled on top of the composed skills, counted as computed."""
    stats = dict(nb.meta.get("compose", {}))
    computed = int(stats.get("computed", 0)) + len(engine.encode(question))
    nb = engine.extend(nb, question)
    return nb.with_meta(compose={**stats, "computed": computed,
                                 "select": f"{stats.get('select', 'first')}, spliced keys / "
                                           f"{temperature:g}"})
