"""Which skill variants a planned request would have wanted, and how often each variant is used.

A request's spans (:func:`~kvnotes.serving.planning.phases.sent_spans`) say, for each spliced
skill, which entry was chosen and what it was compiled behind. A skill that follows another
skill (its *predecessor*) but was spliced from an entry compiled elsewhere is repaired; a
variant compiled behind the request's lead (the header the skill's entry was compiled behind)
and that predecessor would rank first for such prompts
(:func:`kvnotes.core.variants.variant_rank`), and be exactly placed in the second slot.
:func:`variant_candidates` names those (predecessor, skill) pairs; whoever counts them (the
learner) compiles the ones seen often enough, e.g. ``ServingSkills.add(text, after=c.after)``.

:class:`VariantHits` counts, per entry, how often a plan spliced it and how often it was
exactly placed (nothing repaired): the hit rate of each variant. Pure: no vLLM, no engine.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvnotes.core.variants import exactly_placed
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.planning.layout import SentPart
from kvnotes.serving.planning.phases import PartSpan


@dataclass(frozen=True, slots=True)
class VariantCandidate:
    """A variant worth compiling: skill ``name`` (its ``token_ids``, placed at token ``start``
    of the request) compiled behind ``after`` (token ids, BOS included: the lead its entry was
    compiled behind, then its predecessor, ``predecessor``, up to the skill)."""

    after: tuple[int, ...]
    name: str
    token_ids: tuple[int, ...]
    start: int
    predecessor: str = ""

    def to_dict(self) -> JsonObject:
        return {"after": list(self.after), "name": self.name, "tokens": len(self.token_ids),
                "start": self.start, "predecessor": self.predecessor}


def variant_candidates(spans: Sequence[PartSpan], ids: Sequence[int]) -> list[VariantCandidate]:
    """The (predecessor, skill) variants the request laid out as ``spans`` (over ``ids``) would
    have spliced exactly or better than the entries it got, in prompt order.

    For each piece span after another piece span (the predecessor; text between them is part
    of it) whose entry is not exactly placed: the *lead* is the prompt up to the last part
    boundary that the entry's ``behind`` shares with the prompt (the header it was compiled
    behind), and the candidate is compiled behind ``lead + ids[predecessor.start:start]``.
    Left out: entries that record no ``behind`` (nothing says what they were compiled behind),
    a candidate equal to the chosen entry's ``behind`` (the variant is already there), and a
    predecessor inside the lead. Spans need their ``ids`` (``sent_spans`` gives them).

    Example:
        >>> spans = [PartSpan(0, 1, 0, "bos", (1,), ()), PartSpan(1, 3, 1, "header", (5, 6), (1,)),
        ...          PartSpan(3, 5, 3, "a", (7, 8), (1, 5, 6)),
        ...          PartSpan(5, 7, 3, "b", (9, 9), (1, 5, 6)), PartSpan(7, 8, None, "", (4,))]
        >>> [(c.name, c.after) for c in variant_candidates(spans, [1, 5, 6, 7, 8, 9, 9, 4])]
        [('b', (1, 5, 6, 7, 8))]
    """
    ids = tuple(int(t) for t in ids)
    bounds = [s.start for s in spans]
    out: list[VariantCandidate] = []
    pred: PartSpan | None = None  # the latest piece span before the current one
    for span in spans:
        if not span.is_piece:
            continue
        prev, pred = pred, span
        behind = span.behind
        if prev is None or not behind or exactly_placed(behind, span.origin or 0, ids,
                                                        span.start):
            continue
        shared = _common_prefix(behind, ids[:span.start])
        lead = max((b for b in bounds if b <= shared), default=0)
        if prev.start < lead:
            continue  # the predecessor is part of the lead this entry already saw
        after = ids[:lead] + ids[prev.start:span.start]
        if after == behind:
            continue
        out.append(VariantCandidate(after, span.name, ids[span.start:span.end], span.start,
                                    prev.name))
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: slices compared by bisection (C-level
    comparisons, not a Python loop per token: this runs on every planned request when
    learning is on)."""
    n = min(len(a), len(b))
    x, y = tuple(a[:n]), tuple(b[:n])
    if x == y:
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo], x[:hi] != y[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x[:mid] == y[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class VariantHits:
    """Per-entry counts of what plans spliced: ``used`` (the entry was chosen for a skill) and
    ``exact`` (it was exactly placed: nothing repaired), and each entry's name. Thread-safe;
    call :meth:`record` with each planned request's parts (``SentPart``, as the front lays them
    out), :meth:`forget` an entry that is gone (its counts are then dropped). At most
    ``max_entries`` entries are counted: beyond it, the one least recently spliced is
    dropped (the counts are the front's memory, bounded whatever the library holds)."""

    max_entries: int = 4096
    used: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, parts: Sequence[SentPart]) -> tuple[list[str], list[str]]:
        """Count one plan's parts; returns the keys it spliced and those exactly placed."""
        pos = 0
        ids: list[int] = []
        used: list[str] = []
        exact: list[str] = []
        for part in parts:
            piece = part.piece
            if piece is not None:
                used.append(piece.key)
                if exactly_placed(piece.behind, piece.origin, ids, pos):
                    exact.append(piece.key)
            ids.extend(part.token_ids)
            pos += len(part.token_ids)
        with self._lock:
            for part in parts:
                if part.piece is not None:
                    self.names[part.piece.key] = part.piece.name
            for key in used:  # re-inserted: the dict's order is the order of last use
                self.used[key] = self.used.pop(key, 0) + 1
            for key in exact:
                self.exact[key] = self.exact.get(key, 0) + 1
            while len(self.used) > self.max_entries:
                oldest = next(iter(self.used))
                for counts in (self.used, self.exact, self.names):
                    counts.pop(oldest, None)
        return used, exact

    def forget(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                for counts in (self.used, self.exact, self.names):
                    counts.pop(key, None)

    def rows(self) -> list[tuple[str, str, int, int]]:
        """``(key, name, used, exact)`` of each entry counted (a snapshot)."""
        with self._lock:
            return [(k, self.names.get(k, ""), n, self.exact.get(k, 0))
                    for k, n in self.used.items()]

    def rate(self, key: str) -> float:
        """The share of this entry's uses that were exactly placed (0 when never used)."""
        with self._lock:
            n = self.used.get(key, 0)
            return self.exact.get(key, 0) / n if n else 0.0

    def to_dict(self) -> JsonObject:
        with self._lock:
            return {key: {"used": n, "exact": self.exact.get(key, 0)}
                    for key, n in self.used.items()}
