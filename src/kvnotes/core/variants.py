"""Which variant of a skill a prompt splices: the one rule the engine and the server share.

A skill may be compiled behind several prefixes (the header alone, or the header and a skill
that often precedes it): its *variants*, entries with the same tokens and a different
``behind`` (the ids it was prefilled behind, BOS included: ``meta["prefix_ids"]``). Placed at
token ``pos`` of a prompt ``ids``, the preferred variant is, in order:

1. the one whose ``behind`` shares the longest common suffix with ``ids[:pos]`` (its
   predecessor is the one in the prompt; a variant whose whole ``behind`` is ``ids[:pos]`` is
   *exactly placed*: its notes are a prefill's there, nothing to repair);
2. then the one prefilled at ``pos`` itself (it moves by 0 positions);
3. then the one prefilled latest (the first of equals in the order given).

:func:`variant_rank` is that order as a sort key; ``Engine.compose`` with a library
(:class:`VariantSource`), the front's plan and the connector's index
(:mod:`kvnotes.serving.library.splice`) all rank with it, so they pick the same entry for the
same prompt. Pure: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvnotes.core.notebook import Notebook


def shared_suffix(behind: Sequence[int], ids: Sequence[int], pos: int) -> int:
    """How many of ``behind``'s last tokens equal the last tokens of ``ids[:pos]``.

    Suffixes are compared slice by slice (doubling, then halving), so a long shared suffix
    costs a few C-level comparisons, not a Python loop per token.

    Example:
        >>> shared_suffix((1, 7, 8, 9), [5, 8, 9, 4], 3), shared_suffix((1, 2), [1, 2, 3], 2)
        (2, 2)
    """
    m = min(len(behind), max(0, pos))
    if m == 0:
        return 0
    tail = tuple(behind)

    def same(k: int) -> bool:
        return tuple(ids[pos - k:pos]) == tail[len(tail) - k:]

    if same(m):
        return m
    lo, k = 0, 1  # same(lo) holds; find the first k that fails
    while k < m and same(k):
        lo, k = k, k * 2
    hi = min(k, m)  # same(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid
    return lo


def variant_rank(behind: Sequence[int], origin: int, ids: Sequence[int], pos: int,
                 position: int | None = None) -> tuple[int, bool, int]:
    """The sort key of a variant compiled behind ``behind`` (first token prefilled at
    ``origin``) placed at token ``pos`` of ``ids``: higher is preferred (module docstring).
    ``position``: the absolute position of token ``pos`` when ``ids`` does not start at 0."""
    at = pos if position is None else position
    return shared_suffix(behind, ids, pos), origin == at, origin


def exactly_placed(behind: Sequence[int], origin: int, ids: Sequence[int], pos: int) -> bool:
    """Whether a variant placed at token ``pos`` sits behind the very ids it was compiled
    behind, at the very position (``origin``) it was prefilled at. An empty ``behind`` (not
    recorded) is never exact: nothing says what the notes saw."""
    return bool(behind) and origin == pos == len(behind) and shared_suffix(behind, ids,
                                                                           pos) == pos


class VariantSource(Protocol):
    """Where ``Engine.compose`` finds a skill's variants (``SkillLibrary`` is one)."""

    def variant(self, skill: Notebook, ids: Sequence[int], position: int) -> Notebook | None:
        """The stored variant of ``skill`` (same tokens) to splice at absolute ``position``,
        behind ``ids`` (the composed prompt's ids before it, BOS included), when one ranks
        above ``skill`` itself by :func:`variant_rank`; None to keep ``skill``."""
        ...
