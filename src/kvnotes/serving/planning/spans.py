"""The one overlap sweep: a line cut at spans, leftmost first, overlaps dropped, gaps kept.

Both ways the front cuts a prompt use it: :func:`~kvnotes.serving.planning.match.find_skills`
(registered texts in a text) and :mod:`~kvnotes.serving.planning.chat_render` (a chat's
chunks in its rendered text).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def sweep(length: int, spans: Iterable[tuple[int, int, T]]) -> list[tuple[int, int, T | None]]:
    """``[0, length)`` cut at ``spans`` (``(start, end, value)``, by start, the one to keep
    first at a start): a span is kept when it starts at or after the end of the one kept
    before it, the others are dropped; the gaps between are ``(start, end, None)``.

    Example:
        >>> sweep(10, [(2, 5, "a"), (3, 4, "b"), (6, 8, "c")])
        [(0, 2, None), (2, 5, 'a'), (5, 6, None), (6, 8, 'c'), (8, 10, None)]
    """
    out: list[tuple[int, int, T | None]] = []
    pos = 0
    for start, end, value in spans:
        if start < pos:
            continue
        if start > pos:
            out.append((pos, start, None))
        out.append((start, end, value))
        pos = end
    if pos < length:
        out.append((pos, length, None))
    return out
