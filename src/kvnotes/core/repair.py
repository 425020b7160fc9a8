"""Boundary repair of spliced skills: which spliced tokens are recomputed in context.

A skill compiled once and spliced elsewhere carries notes written in another context; its first
tokens differ most (they sat right after the compile prefix), so recomputing a fixed number of
them in the new context (EPIC's choice) removes most of the splice error. :class:`Repair` says
how much, and :func:`repaired_end` is the one rule for where a skill's recomputed region ends.
The engine (:meth:`kvnotes.core.engine.Engine.compose`) and the serving plan
(:mod:`kvnotes.serving.planning.phases`) both read it, so a server with the same ``Repair`` recomputes
exactly the tokens the engine does.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from kvnotes.core.errors import ArgumentTypeError, InvalidArgumentError

# The first tokens of each spliced skill recomputed by default: on BFCL live_multiple (38 cases
# per bundled model) this kept the tool choice identical to the exact prompt in 92% (SmolLM2)
# and 95% (Gemma) of cases, against 68% and 66% for a bare splice, at 15-16% of the spliced
# tokens recomputed (docs/results.md, "Tool-choice fidelity on BFCL").
DEFAULT_FIRST = 32


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
      (0: none). Its range and selector are checked by :meth:`Engine.compose`, which owns the
      selector vocabulary.

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
        if isinstance(self.budget, bool) or not isinstance(self.budget, numbers.Real):
            raise ArgumentTypeError(
                f"Repair(budget={self.budget!r}): give a fraction of the spliced tokens (a float "
                f"in (0, 1]) or a token count (an int), got {type(self.budget).__name__}")
        if not isinstance(self.select, str):
            raise ArgumentTypeError(f"Repair(select={self.select!r}): give a selector name such "
                                    "as 'first' or 'kv_deviation'")

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
    """``value`` as a :class:`Repair`: a Repair as it is; 0 a bare splice; any other number the
    shared ``budget`` of a repair that recomputes no fixed first tokens.

    Example:
        >>> as_repair(0) == NO_REPAIR, as_repair(0.1).budget, as_repair(16).first
        (True, 0.1, 0)
    """
    if isinstance(value, Repair):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"repair must be a Repair, a fraction of the spliced tokens (a float in (0, 1]) or "
            f"a token count (an int), got {value!r} ({type(value).__name__})")
    return NO_REPAIR if value == 0 else Repair(first=0, budget=value)


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
