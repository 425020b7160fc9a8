"""Boundary repair of spliced skills: which spliced tokens are recomputed in context.

A skill compiled once and spliced elsewhere carries notes written in another context; its first
tokens differ most (they sat right after the compile prefix), so recomputing a fixed number of
them in the new context (EPIC's choice) removes most of the splice error. :class:`Repair` says
how much, and :func:`repaired_end` is the one rule for where a skill's recomputed region ends.
The selector vocabulary (:data:`REPAIR_SELECTORS`), the budget arithmetic
(:func:`repair_budget`, :func:`split_budget`) and the compile prefix's digest
(:func:`prefix_digest`) live here too; :mod:`kvnotes.core.repair_plan` turns a layout and a
``Repair`` into the plan the engine, the serving phases and the agent execute.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.core.errors import ArgumentTypeError, InvalidArgumentError, UnknownNameError

# The first tokens of each spliced skill recomputed by default: on BFCL live_multiple (38 cases
# per bundled model) this kept the tool choice identical to the exact prompt in 92% (SmolLM2)
# and 95% (Gemma) of cases, against 68% and 66% for a bare splice, at 15-16% of the spliced
# tokens recomputed (docs/results.md, "Tool-choice fidelity on BFCL").
DEFAULT_FIRST = 32
# The share floor of the default repair: each spliced skill's first max(DEFAULT_FIRST,
# ceil(DEFAULT_SHARE * len)) tokens are recomputed. On BFCL multi_turn (two API manuals of
# 1.7k-3.2k tokens, 4 cases per bundled model) a fixed 32 kept 4 of 8 tool choices and 0.1 kept
# all 8 (0.05: 5 of 8); on live_multiple it changed no choice, the tools being short
# (docs/results.md, "Repair that sizes itself").
DEFAULT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class RepairSelector:
    """A way to choose which notes a repair recomputes, and the operations that take it:
    ``"edit"`` (the ``repair`` strategy of :func:`kvnotes.edit`) and ``"compose"`` (boundary
    repair of spliced skills, :class:`Repair`)."""

    name: str
    operations: tuple[str, ...]
    summary: str


# the one vocabulary of repair selectors (edit strategies and compose repair)
REPAIR_SELECTORS: dict[str, RepairSelector] = {s.name: s for s in (
    RepairSelector("first", ("compose",), "the first tokens of each spliced skill (free)"),
    RepairSelector("attention", ("edit",),
                   "the tokens after the field that attend to it most at prefill"),
    RepairSelector("kv_deviation", ("edit", "compose"),
                   "the tokens whose notes at an early layer deviate most from a recompute "
                   "(CacheBlend's choice)"),
)}
REPAIR_OPERATIONS = ("edit", "compose")


def selectors_for(operation: str) -> tuple[str, ...]:
    """The repair selectors ``operation`` (``"edit"`` or ``"compose"``) takes, in order."""
    if operation not in REPAIR_OPERATIONS:
        raise UnknownNameError("repair operation", operation, REPAIR_OPERATIONS)
    return tuple(n for n, s in REPAIR_SELECTORS.items() if operation in s.operations)


def repair_selector(name: object, operation: str, where: str = "") -> str:
    """``name`` checked as a repair selector of ``operation``; the error lists the selectors
    ``operation`` takes and says which of the others serve only another operation.

    Example:
        >>> repair_selector("kv_deviation", "compose")
        'kv_deviation'
        >>> repair_selector("first", "edit")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kvnotes.core.errors.UnknownNameError: unknown repair selector 'first'; ... compose only)
    """
    valid = selectors_for(operation)
    if isinstance(name, str) and name in valid:
        return name
    others = "; ".join(f"{n} applies to {' and '.join(s.operations)} only"
                       for n, s in REPAIR_SELECTORS.items() if n not in valid)
    raise UnknownNameError("repair selector", name, valid,
                           "; ".join(h for h in (others, where) if h))


def check_budget(budget: object, what: str = "Repair(budget") -> float | int:
    """``budget`` when it is a fraction in [0, 1] (a float) or a token count >= 0 (an int);
    ``what`` names it in the error (``Repair(budget=...)`` by default).

    Example:
        >>> check_budget(0.1), check_budget(16)
        (0.1, 16)
    """
    shown = f"{what}={budget!r}" + (")" if what.endswith("(budget") else "")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ArgumentTypeError(
            f"{shown}: give a fraction of the spliced tokens (a float in (0, 1]) or a token "
            f"count (an int), got {type(budget).__name__}")
    if isinstance(budget, numbers.Integral):
        if budget < 0:
            raise InvalidArgumentError(f"{shown} is a negative token count; give a count >= 0 "
                                       "(0: none) or a fraction in (0, 1]")
        return int(budget)
    if not 0.0 <= float(budget) <= 1.0:  # nan fails too
        raise InvalidArgumentError(
            f"{shown} is not a fraction in (0, 1]; give e.g. 0.05 to recompute 5% of the "
            "spliced tokens, or an int token count such as 16")
    return float(budget)


def repair_budget(budget: float | int, spliced: int) -> int:
    """How many of ``spliced`` tokens a budget recomputes (:func:`check_budget`'s values).

    A float in [0, 1] is a fraction of them, rounded up (any positive fraction repairs at least
    one); an int >= 0 is a token count, capped at ``spliced``. ``1.0`` is all, ``1`` is one.

    Example:
        >>> repair_budget(0.1, 45), repair_budget(16, 10), repair_budget(1.0, 7)
        (5, 10, 7)
    """
    budget = check_budget(budget, "budget")
    if isinstance(budget, int):
        return min(budget, spliced)
    return min(spliced, math.ceil(budget * spliced - 1e-9))


def split_budget(k: int, sizes: Sequence[int]) -> list[int]:
    """``k`` tokens shared among parts of ``sizes`` in proportion to their size (largest
    remainders get the rest), never more than a part has.

    Example:
        >>> split_budget(10, [10, 40]), split_budget(5, [10, 20])
        ([2, 8], [2, 3])
    """
    total = sum(sizes)
    if not total or not k:
        return [0] * len(sizes)
    exact = [k * s / total for s in sizes]
    out = [min(s, int(e)) for s, e in zip(sizes, exact, strict=True)]
    order = sorted(range(len(sizes)), key=lambda i: out[i] - exact[i])
    for i in order:
        if sum(out) >= k:
            break
        if out[i] < sizes[i]:
            out[i] += 1
    return out


def _digest_feed(ids: Sequence[int]) -> bytes:
    """The bytes :func:`prefix_digest` hashes for ``ids`` after others (comma-joined)."""
    return ",".join(map(str, map(int, ids))).encode()


class PrefixHasher:
    """:func:`prefix_digest` of a growing prefix, fed part by part (one pass over the ids, not
    one per digest asked for).

    Example:
        >>> h = PrefixHasher(); h.update([1, 2]); h.update([3]); h.digest() == prefix_digest([1, 2, 3])
        True
    """

    __slots__ = ("_hash", "_empty")

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._empty = True

    def update(self, ids: Sequence[int]) -> None:
        if not len(ids):
            return
        self._hash.update((b"" if self._empty else b",") + _digest_feed(ids))
        self._empty = False

    def digest(self) -> str:
        return self._hash.copy().hexdigest()[:16]


def prefix_digest(ids: Sequence[int]) -> str:
    """A short digest of token ids: what :meth:`Engine.compile` records of the prefix a skill
    was compiled behind (``meta["prefix_digest"]``), so compose can tell a skill placed right
    after that very prefix without keeping the prefix's ids.

    Example:
        >>> prefix_digest([1, 2, 3]) == prefix_digest([1, 2, 3]) != prefix_digest([1, 2])
        True
    """
    return hashlib.sha256(_digest_feed(ids)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Repair:
    """How :meth:`Engine.compose` repairs spliced skills.

    - ``first``: each spliced skill's first ``first`` tokens are recomputed in context, in
      order (each on top of the repaired notes before it), capped at the skill's length.
    - ``align``: a recomputed region ends on a multiple of ``align`` (absolute positions), the
      rule of a paged server whose prefix cache holds whole blocks: ``align`` = its block size.
    - ``skip_exact``: a skill placed at the very position it was compiled at, right after the
      very prefix it was compiled behind, holds exactly the notes a prefill writes there and is
      not repaired (a server that cannot see the compile prefix sets this False).
    - ``budget``: a further budget of spliced tokens recomputed after those first tokens, chosen
      by ``select`` (``"first"``: the tokens right after each skill's first ``first``;
      ``"kv_deviation"``: those whose notes deviate most, CacheBlend's choice) among the tokens
      not yet repaired (exact placements excluded) and shared among the skills in proportion to
      them: a float in (0, 1] is a fraction of those tokens (rounded up), an int a token count
      (0: none).
    - ``share``: a floor in proportion to the skill: each skill's first ``max(first,
      ceil(share * len))`` tokens are recomputed (:func:`first_tokens`), so a long skill gets
      more than a short one (a float in [0, 1]; 0: the fixed ``first``).
    - ``adapt``: the adaptive rule, engine only (a threshold >= 0; None: off). After the first
      region, the notes of its last ``adapt_step`` tokens before and after the recompute are
      compared (:func:`relative_change`, keys and values of every layer); while they moved by
      more than ``adapt`` the next ``adapt_step`` tokens are recomputed too (one more forward
      each, measured the same way), up to ``adapt_cap`` of the skill (:func:`adapt_end`). The
      repaired tokens measure how far the context moved this skill's notes. A server cannot
      run it: it plans every phase before the request runs, and the decision needs the
      recomputed notes read back.

    Every field is checked when the Repair is made (:data:`REPAIR_SELECTORS` for ``select``).

    Example:
        >>> Repair().first, Repair(first=0).is_noop, Repair(first=32, align=16).tag()
        (32, True, 'f32a16')
        >>> Repair(first=32, share=0.1).tag(), Repair(first=32, adapt=0.2).tag()
        ('f32a1s0.1', 'f32a1t0.2k32c0.25')
    """

    first: int = DEFAULT_FIRST
    align: int = 1
    skip_exact: bool = True
    budget: float | int = 0
    select: str = "first"
    share: float = 0.0
    adapt: float | None = None
    adapt_step: int = 32
    adapt_cap: float = 0.25

    def __post_init__(self) -> None:
        for name in ("first", "align"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ArgumentTypeError(f"Repair({name}={value!r}): give an int token count, got "
                                        f"{type(value).__name__}")
        if self.first < 0:
            raise InvalidArgumentError(f"Repair(first={self.first!r}): give a token count >= 0 "
                                       "(0 repairs no skill's first tokens)")
        if self.align < 1:
            raise InvalidArgumentError(f"Repair(align={self.align!r}): give a positive token "
                                       "count (1: no alignment; a server's block size)")
        if not isinstance(self.skip_exact, bool):
            raise ArgumentTypeError(f"Repair(skip_exact={self.skip_exact!r}): give True or False")
        check_budget(self.budget)
        if not isinstance(self.select, str):
            raise ArgumentTypeError(f"Repair(select={self.select!r}): give a selector name such "
                                    "as 'first' or 'kv_deviation'")
        repair_selector(self.select, "compose")
        _check_fraction(self.share, "share", "e.g. share=0.1 recomputes at least 10% of each "
                        "skill")
        self._check_adapt()

    def _check_adapt(self) -> None:
        if self.adapt is None:
            return
        if isinstance(self.adapt, bool) or not isinstance(self.adapt, numbers.Real) \
                or not 0.0 <= float(self.adapt) < math.inf:  # nan fails too
            raise InvalidArgumentError(
                f"Repair(adapt={self.adapt!r}): give a threshold >= 0 on the relative change of "
                "the repaired notes (e.g. 0.2), or None for no adaptive repair")
        step = self.adapt_step
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
            raise InvalidArgumentError(f"Repair(adapt_step={step!r}): give a positive token "
                                       "count (the tokens each extra forward recomputes)")
        _check_fraction(self.adapt_cap, "adapt_cap", "the most of each skill the adaptive "
                        "rule recomputes, e.g. 0.25")
        if self.first == 0 and self.share == 0:
            raise InvalidArgumentError(
                f"Repair(adapt={self.adapt!r}) measures the notes of each skill's first tokens: "
                "give first > 0 or share > 0")
        if self.budget:
            raise InvalidArgumentError(
                f"Repair(adapt={self.adapt!r}, budget={self.budget!r}): the adaptive rule sizes "
                "each skill's region itself; give one of adapt or budget")

    @property
    def is_noop(self) -> bool:
        """True when nothing is recomputed (a bare splice)."""
        return self.first == 0 and self.share == 0 and not self.budget

    def tag(self) -> str:
        """This repair's name in a cache namespace (a splice salt, a result's record):
        ``f<first>a<align>`` (plus ``e`` when exact placements are repaired too, ``s<share>``
        with a share floor, ``t<adapt>k<adapt_step>c<adapt_cap>`` with the adaptive rule,
        ``b<budget><select>`` with a budget). Not a spelling to write: it names every field
        (blocks of one alignment never serve another) in a salt's characters, and nothing
        parses it; a person spells a repair :func:`parse_repair`'s way."""
        tag = f"f{self.first}a{self.align}" + ("" if self.skip_exact else "e")
        if self.share:
            tag += f"s{self.share:g}"
        if self.adapt is not None:
            tag += f"t{self.adapt:g}k{self.adapt_step}c{self.adapt_cap:g}"
        if self.budget:
            tag += f"b{self.budget}{self.select}"
        return tag


def _check_fraction(value: object, name: str, hint: str) -> None:
    """``Repair(<name>=value)`` checked as a float in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"Repair({name}={value!r}): give a fraction of the skill (a "
                                f"float in [0, 1]), {hint}")
    if not 0.0 <= float(value) <= 1.0:  # nan fails too
        raise InvalidArgumentError(f"Repair({name}={value!r}) is not a fraction in [0, 1]; "
                                   f"{hint}")


NO_REPAIR = Repair(first=0)
DEFAULT_REPAIR = Repair(first=DEFAULT_FIRST, share=DEFAULT_SHARE)
# the default a server runs (``kvnotes serve --repair``), aligned to its block there
SERVER_REPAIR = Repair(first=DEFAULT_FIRST, share=DEFAULT_SHARE)


def as_repair(value: Repair | float | int) -> Repair:
    """``value`` as a :class:`Repair`, the one meaning of ``repair=`` everywhere: a Repair as it
    is; an int ``K`` the first ``K`` tokens of each spliced skill (``Repair(first=K)``; 0 the
    bare splice); a float in (0, 1] that fraction of the spliced tokens, shared among the
    skills (``Repair(first=0, budget=f)``). A token-count budget is spelled out:
    ``Repair(first=0, budget=N)``.

    Example:
        >>> as_repair(0) == NO_REPAIR, as_repair(16) == Repair(first=16), as_repair(0.1).budget
        (True, True, 0.1)
    """
    if isinstance(value, Repair):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"repair must be a Repair, a token count per skill (an int) or a fraction of the "
            f"spliced tokens (a float in (0, 1]), got {value!r} ({type(value).__name__})")
    if isinstance(value, numbers.Integral):
        return Repair(first=int(value))
    if value == 0:
        return NO_REPAIR
    if not 0.0 < float(value) <= 1.0:  # nan fails too
        raise InvalidArgumentError(
            f"repair={value!r} is not a fraction in (0, 1]; give e.g. repair=0.05 to recompute "
            "5% of the spliced tokens, or an int such as repair=16 for each skill's first 16")
    return Repair(first=0, budget=float(value))


def first_tokens(length: int, first: int, share: float = 0.0) -> int:
    """How many first tokens of a skill of ``length`` tokens are recomputed: ``max(first,
    ceil(share * length))`` (the share floor), before alignment and capping at ``length``.

    Example:
        >>> first_tokens(200, 32, 0.1), first_tokens(5800, 32, 0.1), first_tokens(5800, 32)
        (32, 580, 32)
    """
    floor = math.ceil(share * length - 1e-9) if share else 0
    return max(first, floor)


_SPELLING = re.compile(r"^([0-9]+)(?:@([0-9]*\.?[0-9]+))?(?:~([0-9]*\.?[0-9]+))?$")


def parse_repair(spec: str | int) -> Repair:
    """A repair from its one text spelling (``kvnotes serve --repair``, the config file's
    ``repair``, the front's settings): ``K`` each skill's first ``K`` tokens; ``K@F`` with the
    share floor (the first ``max(K, ceil(F * len))``); ``K~T`` with the adaptive rule at
    threshold ``T`` (engine only); ``K@F~T`` both. :func:`repair_spelling` writes it.

    Example:
        >>> parse_repair("32") == Repair(first=32), parse_repair("32@0.1").tag()
        (True, 'f32a1s0.1')
        >>> repair_spelling(parse_repair("32@0.1~0.2"))
        '32@0.1~0.2'
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, numbers.Integral)):
        raise ArgumentTypeError(f"a repair spelling is text such as '32' or '32@0.1', got "
                                f"{spec!r} ({type(spec).__name__})")
    m = _SPELLING.match(str(spec).strip())
    if not m:
        raise InvalidArgumentError(
            f"repair {spec!r}: spell it K (each skill's first K tokens), K@F (at least the "
            "share F of each skill, e.g. 32@0.1), K~T (grown while the notes moved by more "
            "than T, engine only) or K@F~T")
    return Repair(first=int(m.group(1)), share=float(m.group(2) or 0),
                  adapt=float(m.group(3)) if m.group(3) else None)


def repair_spelling(repair: Repair) -> str:
    """``repair``'s first tokens, share floor and adaptive threshold as :func:`parse_repair`
    reads them (alignment, budget and the adaptive rule's step and cap are not spelled)."""
    out = str(repair.first)
    if repair.share:
        out += f"@{repair.share:g}"
    if repair.adapt is not None:
        out += f"~{repair.adapt:g}"
    return out


def repaired_end(start: int, end: int, first: int, align: int = 1, share: float = 0.0) -> int:
    """Where the recomputed region ``[start, r)`` of a skill spliced at ``[start, end)`` ends:
    ``start +`` :func:`first_tokens` ``(end - start, first, share)`` rounded up to a multiple
    of ``align``, capped at ``end`` (``start`` when that is 0: nothing recomputed).

    Example:
        >>> repaired_end(40, 300, 32), repaired_end(40, 300, 32, align=16), repaired_end(40, 60, 32)
        (72, 80, 60)
        >>> repaired_end(40, 1040, 32, share=0.1), repaired_end(40, 1040, 32, 16, share=0.1)
        (140, 144)
    """
    if not 0 <= start <= end:
        raise InvalidArgumentError(f"a skill's span must have 0 <= start <= end, got [{start}, "
                                   f"{end})")
    first = first_tokens(end - start, first, share)
    if first <= 0 or start == end:
        return start
    r = start + first
    r = -(-r // align) * align
    return min(r, end)


def adapt_end(start: int, end: int, repair: Repair) -> int:
    """How far the adaptive rule may extend the region of a skill spliced at ``[start, end)``:
    ``repair.adapt_cap`` of the skill (rounded up to ``repair.align``), never less than its
    first region, capped at ``end``.

    Example:
        >>> adapt_end(0, 1000, Repair(first=32, adapt=0.1)), adapt_end(0, 100, Repair(adapt=0.1))
        (250, 32)
    """
    first = repaired_end(start, end, repair.first, repair.align, repair.share)
    cap = repaired_end(start, end, 0, repair.align, repair.adapt_cap)
    return max(first, cap)


def relative_change(sums: Sequence[tuple[float, float]]) -> float:
    """The relative L2 change of notes from per-layer sums ``(|new - old|^2, |old|^2)``:
    ``sqrt(sum diff) / sqrt(sum old)`` (0 when there is nothing).

    Example:
        >>> relative_change([(1.0, 100.0), (3.0, 300.0)])
        0.1
    """
    diff = sum(d for d, _ in sums)
    norm = sum(o for _, o in sums)
    return math.sqrt(diff / norm) if norm > 0 else 0.0
