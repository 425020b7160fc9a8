"""The one repair plan: which spliced tokens are recomputed, for any layout of a prompt.

A prompt is laid out as parts, in order: :class:`Text` (tokens computed in place, or notes
already there) and :class:`Piece` (compiled notes spliced in, with where they were compiled).
:func:`plan_repair` turns that layout and a :class:`~kvnotes.core.repair.Repair` into a
:class:`RepairPlan`: the pieces spliced as they are because exactly placed, and for each other
piece the region recomputed as its first tokens and its share of the further budget.
:meth:`Engine.compose <kvnotes.core.engine.Engine.compose>`, the serving phases
(:mod:`kvnotes.serving.planning.phases`) and the agent's turn builder only execute it.

The exactness rule: a piece holds exactly the notes a prefill writes where it lands when it
sits at the very position it was compiled at, right after the very prefix it was compiled
behind (its ``prefix_len`` and :func:`~kvnotes.core.repair.prefix_digest`), with every note
before it exact (text computed on exact notes, or pieces so placed, or pieces recomputed
whole). A server's registered pieces carry no digest; they are trusted (``trust_chain``) when
every part before them is a piece so placed, from token 0 on.

Pure: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import PrefixHasher, Repair, repair_budget, repaired_end, split_budget


@dataclass(frozen=True, slots=True)
class Text:
    """``length`` tokens computed in place (``exact``: their notes are a prefill's when every
    note before them is; False for notes already there that are not, e.g. an approximate
    notebook's kept prefix). ``ids``: their token ids, needed only to match a later piece's
    compile prefix (None: unknown, no later piece can match its digest)."""

    length: int
    ids: tuple[int, ...] | None = None
    exact: bool = True


@dataclass(frozen=True, slots=True)
class Piece:
    """``length`` compiled notes spliced in, compiled at position ``origin`` behind a prefix of
    ``prefix_len`` tokens (default: ``origin``) whose :func:`prefix_digest` is
    ``prefix_digest`` (None: not known). ``consecutive``: its positions follow one another (not
    so for image tokens of an M-RoPE prefill: its ids alone cannot recompute it, it is spliced
    as it is). ``trust_chain``: with no digest, exact at its origin behind a chain of exactly
    placed pieces from token 0 (a server's registered pieces)."""

    length: int
    origin: int
    ids: tuple[int, ...] | None = None
    consecutive: bool = True
    prefix_len: int | None = None
    prefix_digest: str | None = None
    trust_chain: bool = False


Part = Text | Piece


@dataclass(frozen=True, slots=True)
class PieceRepair:
    """One repaired piece: layout part ``index`` at tokens ``[start, end)``; ``[start,
    first_end)`` is recomputed as its first tokens, then ``budget`` more tokens of ``[first_end,
    end)`` chosen by the selector."""

    index: int
    start: int
    end: int
    first_end: int
    budget: int = 0

    @property
    def region(self) -> tuple[int, int]:
        return (self.start, self.first_end)

    @property
    def rest(self) -> int:
        """Tokens after the first tokens' region (what the budget chooses among)."""
        return self.end - self.first_end

    @property
    def repaired(self) -> int:
        return self.first_end - self.start + self.budget


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """What a layout's repair recomputes (token indices count from the layout's first token).

    - ``pieces``: each repaired piece, in order (budget shares included);
    - ``exact``: the indices of the parts spliced as they are because exactly placed;
    - ``opaque``: the indices of pieces spliced as they are because their ids cannot
      recompute them;
    - ``length``: the layout's tokens.
    """

    repair: Repair
    pieces: tuple[PieceRepair, ...]
    exact: tuple[int, ...]
    opaque: tuple[int, ...]
    length: int

    @property
    def regions(self) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges recomputed as pieces' first tokens (empty ones left
        out), in order."""
        return [p.region for p in self.pieces if p.first_end > p.start]

    @property
    def repaired(self) -> int:
        return sum(p.repaired for p in self.pieces)

    def by_index(self) -> dict[int, PieceRepair]:
        return {p.index: p for p in self.pieces}

    def select_tokens(self, num_layers: int, layer: int = 1) -> float:
        """What choosing the budget's tokens costs, in token-equivalents of a forward:
        ``"kv_deviation"`` runs ``layer + 1`` of ``num_layers`` layers over each piece's rest
        (where its share is not 0); ``"first"`` is free."""
        if self.repair.select == "first":
            return 0.0
        return sum(p.rest * (layer + 1) / num_layers for p in self.pieces if p.budget)

    def exact_prefix(self, parts: Sequence[Part]) -> int:
        """How many leading notes equal a prefill's once the plan is executed (``parts``: the
        layout planned): text and exact placements extend it, a piece repaired from its first
        token extends it to the end of its region (and of its budget's tokens with ``"first"``,
        which follow the region)."""
        repaired = self.by_index()
        exact = set(self.exact)
        pos = 0
        for i, part in enumerate(parts):
            if isinstance(part, Text):
                if not part.exact:
                    return pos
            elif i not in exact:
                p = repaired.get(i)
                if p is None:
                    return pos
                end = p.first_end + (p.budget if self.repair.select == "first" else 0)
                if end < p.end:
                    return end
            pos += part.length
        return pos

    def to_dict(self) -> dict[str, object]:
        return {"repair": self.repair.tag(), "regions": [list(r) for r in self.regions],
                "exact": list(self.exact), "opaque": list(self.opaque),
                "budgets": [p.budget for p in self.pieces], "repaired": self.repaired}


def plan_repair(parts: Sequence[Part], repair: Repair, *, start: int = 0) -> RepairPlan:
    """The repair plan of a layout whose first token sits at position ``start``.

    Each piece not exactly placed (see the module docstring) is recomputed on ``[at, r)``
    with ``r`` = :func:`~kvnotes.core.repair.repaired_end` in absolute positions
    (``repair.first`` tokens, or ``repair.share`` of the piece when more, on a multiple of
    ``repair.align``); ``repair.budget`` is then shared among the repaired pieces in
    proportion to the tokens their regions leave (:func:`~kvnotes.core.repair.split_budget`).

    Example:
        >>> from kvnotes.core.repair import prefix_digest
        >>> header = Piece(40, origin=1, ids=tuple(range(40)), prefix_len=1,
        ...                prefix_digest=prefix_digest([7]))
        >>> skill = Piece(100, origin=41, prefix_len=41, prefix_digest="elsewhere")
        >>> p = plan_repair([Text(1, (7,)), header, Text(3, (1, 2, 3)), skill], Repair(first=32))
        >>> p.exact, p.regions
        ((1,), [(44, 76)])
    """
    if not isinstance(repair, Repair):
        raise InvalidArgumentError(f"plan_repair needs a Repair, got {type(repair).__name__}")
    hasher: PrefixHasher | None = PrefixHasher()
    exact_so_far = True  # every note before the next part is a prefill's
    chain = True  # every part so far is a piece placed exactly (a trusted chain from token 0)
    at = 0
    pieces: list[PieceRepair] = []
    exact: list[int] = []
    opaque: list[int] = []
    for i, part in enumerate(parts):
        if part.length < 1:
            raise InvalidArgumentError(f"layout part {i} is empty: every part has a token")
        end = at + part.length
        if isinstance(part, Text):
            exact_so_far = exact_so_far and part.exact
            chain = False
        elif repair.skip_exact and exact_so_far and _placed_exactly(part, at, start, chain,
                                                                    hasher):
            exact.append(i)
        elif not part.consecutive:
            opaque.append(i)
            exact_so_far = chain = False
        else:
            r = repaired_end(start + at, start + end, repair.first, repair.align,
                             repair.share) - start
            pieces.append(PieceRepair(i, at, end, r))
            exact_so_far = exact_so_far and r == end
            chain = False
        if hasher is not None:
            if part.ids is None:
                hasher = None  # the prefix's ids are unknown from here on
            else:
                hasher.update(part.ids)
        at = end
    rest = [p.rest for p in pieces]
    shares = split_budget(repair_budget(repair.budget, sum(rest)), rest)
    pieces = [PieceRepair(p.index, p.start, p.end, p.first_end, k)
              for p, k in zip(pieces, shares, strict=True)]
    return RepairPlan(repair, tuple(pieces), tuple(exact), tuple(opaque), at)


def _placed_exactly(piece: Piece, at: int, start: int, chain: bool,
                    hasher: PrefixHasher | None) -> bool:
    """Whether ``piece`` at token ``at`` (position ``start + at``) sits where and behind what
    it was compiled (the notes before it being exact is the caller's check)."""
    prefix_len = piece.origin if piece.prefix_len is None else piece.prefix_len
    if piece.origin != start + at or prefix_len != at:
        return False
    if piece.prefix_digest is None:
        return piece.trust_chain and chain
    return hasher is not None and hasher.digest() == piece.prefix_digest
