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
from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.core.errors import ArgumentTypeError, InvalidArgumentError, UnknownNameError

# The first tokens of each spliced skill recomputed by default: on BFCL live_multiple (38 cases
# per bundled model) this kept the tool choice identical to the exact prompt in 92% (SmolLM2)
# and 95% (Gemma) of cases, against 68% and 66% for a bare splice, at 15-16% of the spliced
# tokens recomputed (docs/results.md, "Tool-choice fidelity on BFCL").
DEFAULT_FIRST = 32


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
    return ",".join(str(int(i)) for i in ids).encode()


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

    Every field is checked when the Repair is made (:data:`REPAIR_SELECTORS` for ``select``).

    Example:
        >>> Repair().first, Repair(first=0).is_noop, Repair(first=32, align=16).tag()
        (32, True, 'f32a16')
    """

    first: int = DEFAULT_FIRST
    align: int = 1
    skip_exact: bool = True
    budget: float | int = 0
    select: str = "first"

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

    @property
    def is_noop(self) -> bool:
        """True when nothing is recomputed (a bare splice)."""
        return self.first == 0 and not self.budget

    def tag(self) -> str:
        """A short name of this repair for cache namespaces: ``f<first>a<align>`` (plus
        ``e`` when exact placements are repaired too, ``b<budget><select>`` with a budget)."""
        tag = f"f{self.first}a{self.align}" + ("" if self.skip_exact else "e")
        if self.budget:
            tag += f"b{self.budget}{self.select}"
        return tag


NO_REPAIR = Repair(first=0)
DEFAULT_REPAIR = Repair()


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


def repaired_end(start: int, end: int, first: int, align: int = 1) -> int:
    """Where the recomputed region ``[start, r)`` of a skill spliced at ``[start, end)`` ends:
    ``start + first`` rounded up to a multiple of ``align``, capped at ``end`` (``start`` when
    ``first`` is 0: nothing recomputed).

    Example:
        >>> repaired_end(40, 300, 32), repaired_end(40, 300, 32, align=16), repaired_end(40, 60, 32)
        (72, 80, 60)
    """
    if not 0 <= start <= end:
        raise InvalidArgumentError(f"a skill's span must have 0 <= start <= end, got [{start}, "
                                   f"{end})")
    if first <= 0 or start == end:
        return start
    r = start + first
    r = -(-r // align) * align
    return min(r, end)
