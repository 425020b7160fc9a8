"""The field -> decision task suite used by edit evaluation and tracing.

:class:`~kvnotes.eval.tasks.base.EditCase` is one case; the families live in their own modules
(``families``, ``recall``) and register in ``FAMILIES``; :func:`load_suite` picks cases by family.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvnotes.core.errors import UnknownNameError
from kvnotes.eval.tasks import families as _families  # noqa: F401  (registers the edit families)
from kvnotes.eval.tasks import recall as _recall  # noqa: F401  (registers capital_recall)
from kvnotes.eval.tasks.base import FAMILIES, EditCase, register_family

__all__ = ["EditCase", "FAMILIES", "load_suite", "register_family"]


def load_suite(families: Iterable[str] | None = None) -> list[EditCase]:
    """All cases of the named families (all families when None); unknown names list the valid ones."""
    names = list(FAMILIES) if families is None else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise UnknownNameError("family", unknown[0], sorted(FAMILIES))
    return [case for n in names for case in FAMILIES[n]()]
