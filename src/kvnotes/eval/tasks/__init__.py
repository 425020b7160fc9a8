"""The field -> decision task suite used by edit evaluation and tracing.

:class:`~kvnotes.eval.tasks.base.EditCase` is one case; the families live in their own modules
(``families``, ``recall``, ``routing``) and register in ``FAMILIES``; :func:`load_suite` picks
cases by family. Seeded families (``routing``) have development and held-out seeds; the suite
holds their held-out cases unless ``split="dev"`` asks for the development ones.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvnotes.core.errors import UnknownNameError
from kvnotes.eval.tasks import families as _families  # noqa: F401  (registers the edit families)
from kvnotes.eval.tasks import recall as _recall  # noqa: F401  (registers capital_recall)
from kvnotes.eval.tasks import routing as _routing  # noqa: F401  (registers routing)
from kvnotes.eval.tasks.base import (
    FAMILIES,
    SEEDED_FAMILIES,
    SPLITS,
    EditCase,
    register_family,
)

__all__ = ["EditCase", "FAMILIES", "SEEDED_FAMILIES", "SPLITS", "load_suite", "register_family"]


def load_suite(families: Iterable[str] | None = None, split: str = "heldout") -> list[EditCase]:
    """All cases of the named families (all families when None); unknown names list the valid
    ones. ``split`` picks a seeded family's seeds (``"heldout"`` or ``"dev"``); the other
    families have one fixed set of cases."""
    names = list(FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise UnknownNameError("family", unknown[0], sorted(FAMILIES))
    if split not in SPLITS:
        raise UnknownNameError("seed split", split, SPLITS)
    return [case for n in names for case in
            (SEEDED_FAMILIES[n].cases(split) if n in SEEDED_FAMILIES else FAMILIES[n]())]
