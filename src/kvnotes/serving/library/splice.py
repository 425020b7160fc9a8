"""Splice planning for a serving engine: which prompt tokens known pieces can supply, and where.

A *piece* is a compiled skill as the server will use it: its token ids, the position its first
token was prefilled at (``origin``) and its per-layer keys/values. vLLM asks a connector once per
admission for one contiguous run right after its local prefix-cache hit (docs/design.md,
"Serving architecture"), so what can be supplied is decided one of two ways:

- without instructions, the prompt is matched from token 0 against the registered pieces and the
  longest run of consecutive pieces (the *leading run*) is supplied;
- with splice ranges from the client (:class:`SpliceRange`, sent in a
  :class:`~kvnotes.serving.protocol.SpliceRequest`), only tokens inside those ranges are supplied, from
  the local hit on (:func:`range_run`): a client that has vLLM compute a piece's first tokens
  in context (:mod:`kvnotes.serving.planning.phases`) names the rest of the piece as a range.

Nothing here imports vLLM: matching and slot arithmetic are pure functions over token ids,
tested without a server. Keys are post-RoPE; moving a piece from ``origin`` to ``start`` is one
more rotation by ``start - origin`` (:attr:`Placement.delta`) with the model's inverse
frequencies, done where the keys are written (:mod:`kvnotes.serving.vllm.kv_writer`).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.variants import variant_rank
from kvnotes.serving.library.prefix_index import PrefixIndex

# The trie's block length for token ids: a position costs one dict lookup per block of
# KEY_TOKENS tokens a piece shares with the prompt plus a compare of the pieces ending in the next
# block, whatever the number of pieces (:class:`~kvnotes.serving.library.prefix_index.PrefixIndex`).
KEY_TOKENS = 8


@dataclass(frozen=True, slots=True)
class PieceInfo:
    """What matching needs to know about a piece (its KV stays on disk until a load)."""

    key: str  # content address (file stem)
    name: str
    token_ids: tuple[int, ...]
    origin: int  # position of the piece's first token when it was prefilled
    # whose entry this is: None for the operator's (every tenant splices it), else only requests
    # salted with this tenant's splice salt may splice it (learned chunks are per tenant)
    tenant: str | None = None
    # the token ids it was prefilled behind (the compiled prefix, BOS included; () when unknown):
    # one skill's variants differ here, and the planner prefers the one whose prefix the prompt
    # ends with before the piece
    behind: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Placement:
    """One piece placed in a prompt: tokens ``[start, start + len)`` come from ``piece``."""

    piece: PieceInfo
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.piece)

    @property
    def delta(self) -> int:
        """How far the piece's keys turn: its prompt position minus where it was prefilled."""
        return self.start - self.piece.origin


@dataclass
class PieceIndex:
    """Pieces by their token ids; the longest match first, at a cost independent of how many
    pieces there are (:class:`~kvnotes.serving.library.prefix_index.PrefixIndex`).

    One skill's variants (the same tokens compiled behind different prefixes) share one entry,
    in the order added; :func:`preferred` picks among them.

    Example:
        >>> idx = PieceIndex()
        >>> idx.add(PieceInfo("a", "header", (1, 2, 3), 0))
        >>> [p.piece.name for p in leading_run([1, 2, 3, 9], idx)]
        ['header']
    """

    _groups: PrefixIndex[list[PieceInfo]] = field(
        default_factory=lambda: PrefixIndex(block=KEY_TOKENS))
    _keys: dict[str, PieceInfo] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def get(self, key: str) -> PieceInfo | None:
        return self._keys.get(key)

    def pieces(self) -> list[PieceInfo]:
        """Every indexed piece, in the order added."""
        return list(self._keys.values())

    def add(self, piece: PieceInfo) -> None:
        if not piece.token_ids:
            raise ValueError(f"piece {piece.name!r} has no tokens")
        if piece.key in self._keys:
            return
        group = self._groups.get(piece.token_ids)
        if group is None:
            self._groups.add(piece.token_ids, [piece])
        else:
            group.append(piece)
        self._keys[piece.key] = piece

    def remove(self, key: str) -> None:
        piece = self._keys.pop(key, None)
        if piece is None:
            return
        group = [p for p in self._groups.get(piece.token_ids) or () if p.key != key]
        if group:
            self._groups.add(piece.token_ids, group)
        else:
            self._groups.remove(piece.token_ids)

    def starts(self, tokens: Sequence[int]) -> list[int]:
        """The positions of ``tokens`` where a piece may start, ascending (every one where a
        piece does, and a few where only the hash of its first tokens matches)."""
        return self._groups.starts(tokens)

    def match_at(self, tokens: Sequence[int], pos: int) -> PieceInfo | None:
        """The longest piece whose tokens are exactly ``tokens[pos:pos + len]``, if any.

        Among pieces with the same tokens (one skill's variants, compiled behind different
        prefixes), :func:`preferred`'s rule decides, against the prompt's own ``tokens[:pos]``:
        the one whose prefix the prompt ends with (longest shared suffix), then the one
        prefilled at ``pos`` itself, then the one prefilled latest. ``tokens`` as a tuple saves
        a copy per call.
        """
        seq = tokens if isinstance(tokens, tuple) else tuple(tokens)
        hit = self._groups.longest_at(seq, pos)
        return None if hit is None else preferred(hit[1], pos, seq)

    def match_exact(self, tokens: Sequence[int], start: int, end: int) -> PieceInfo | None:
        """The piece whose tokens are exactly ``tokens[start:end]``, if any (the same
        preference as :meth:`match_at` among pieces with the same tokens)."""
        if end - start <= 0 or start < 0 or end > len(tokens):
            return None
        return preferred(self._groups.get(tuple(tokens[start:end])) or (), start, tokens)


def preferred(pieces: Iterable[PieceInfo], pos: int, ids: Sequence[int] = ()
              ) -> PieceInfo | None:
    """Which of ``pieces`` (one skill's variants: its tokens compiled behind different
    prefixes) is placed at token ``pos`` of a prompt whose ids are ``ids`` (at least its first
    ``pos``): :func:`kvnotes.core.variants.variant_rank`'s order, the one rule the engine, the
    front and the connector share: the piece whose ``behind`` shares the longest suffix with
    ``ids[:pos]``, then the one prefilled at ``pos`` itself, then the one prefilled latest (the
    first of equals in ``pieces``' order); None when there is none.

    Example:
        >>> a, b = PieceInfo("a", "s", (5,), 0), PieceInfo("b", "s", (5,), 40)
        >>> preferred([a, b], 0).key, preferred([a, b], 7).key
        ('a', 'b')
        >>> c = PieceInfo("c", "s", (5,), 3, behind=(1, 2, 3))
        >>> preferred([a, b, c], 7, [9, 9, 9, 9, 9, 2, 3]).key
        'c'
    """
    best: PieceInfo | None = None
    best_rank: tuple[int, bool, int] | None = None
    for piece in pieces:
        rank = _rank(piece, ids, pos)
        if best_rank is None or rank > best_rank:
            best, best_rank = piece, rank
    return best


def _rank(piece: PieceInfo, ids: Sequence[int], pos: int) -> tuple[int, bool, int]:
    return variant_rank(piece.behind, piece.origin, ids, pos)


def leading_run(tokens: Sequence[int], index: PieceIndex, *, max_pieces: int = 1024
                ) -> list[Placement]:
    """The pieces that tile ``tokens`` from token 0 without a gap, greedily longest first.

    The run ends at the first position where no piece matches: a piece after text nothing has
    cached cannot be supplied (one contiguous external run per request).
    """
    run: list[Placement] = []
    pos = 0
    tokens = tuple(tokens)  # one copy, not one per position
    while pos < len(tokens) and len(run) < max_pieces:
        piece = index.match_at(tokens, pos)
        if piece is None:
            break
        run.append(Placement(piece, pos))
        pos += len(piece)
    return run


@dataclass(frozen=True, slots=True)
class SpliceRange:
    """Prompt tokens ``[start, end)`` supplied from the piece placed at ``piece_start``
    (``start > piece_start`` when the piece's first tokens are computed in context).

    Its JSON form is ``[piece_start, start, end]``.

    Example:
        >>> SpliceRange(40, 64, 300).to_list(), SpliceRange.from_value([40, 64, 300]).offset
        ([40, 64, 300], 24)
    """

    piece_start: int
    start: int
    end: int

    @property
    def offset(self) -> int:
        """How many of the piece's first tokens the range leaves out."""
        return self.start - self.piece_start

    def __len__(self) -> int:
        return self.end - self.start

    def to_list(self) -> list[int]:
        return [self.piece_start, self.start, self.end]

    @classmethod
    def from_value(cls, value: object) -> SpliceRange:
        """A range from its JSON form; :class:`InvalidArgumentError` unless it is three integers
        with ``0 <= piece_start <= start < end``."""
        if (not isinstance(value, (list, tuple)) or len(value) != 3
                or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                           for v in value)):
            raise InvalidArgumentError(f"a splice range is [piece_start, start, end] (three "
                                       f"integers), got {value!r}")
        piece_start, start, end = (int(v) for v in value)
        if not 0 <= piece_start <= start < end:
            raise InvalidArgumentError(f"splice range {list(value)!r}: need 0 <= piece_start <= "
                                       "start < end")
        return cls(piece_start, start, end)


@dataclass(frozen=True, slots=True)
class CheckedRanges:
    """The valid leading part of a request's splice ranges, each with its piece, and why the
    rest (if any) was dropped."""

    ranges: tuple[SpliceRange, ...]
    pieces: tuple[PieceInfo, ...]
    dropped: int = 0
    reason: str | None = None


def check_ranges(tokens: Sequence[int], index: PieceIndex, value: object,
                 keys: object = None) -> CheckedRanges:
    """Validate ``value`` (a request's splice ranges as JSON) against the prompt, in order.

    A range is valid when it is well formed, starts at or after the previous range's end, lies
    inside the prompt, and a registered piece holds exactly the prompt's tokens
    ``[piece_start, end)``: with ``keys`` (the request's entry keys, one per
    range), the very entry the planner chose, else the one :meth:`PieceIndex.match_exact`
    prefers. A planner and a server whose views of the library differ for a moment (an entry
    published or evicted between the plan and the match) then never splice another variant
    than the one planned: the range is computed instead. The first invalid range and every
    range after it are dropped.
    """
    if not isinstance(value, (list, tuple)):
        return CheckedRanges((), (), 0, f"splice ranges must be a list of [piece_start, "
                                        f"start, end], got {type(value).__name__}")
    if keys is not None and (not isinstance(keys, (list, tuple)) or len(keys) != len(value)
                             or not all(isinstance(k, str) for k in keys)):
        return CheckedRanges((), (), len(value), "splice keys must be a list of entry "
                                                 "keys, one per splice range")
    ranges: list[SpliceRange] = []
    pieces: list[PieceInfo] = []
    for i, item in enumerate(value):
        try:
            r = SpliceRange.from_value(item)
        except InvalidArgumentError as err:
            reason = str(err)
        else:
            piece = None
            if ranges and r.piece_start < ranges[-1].end:
                reason = f"range {r.to_list()} overlaps the one before it"
            elif r.end > len(tokens):
                reason = f"range {r.to_list()} ends past the prompt's {len(tokens)} tokens"
            elif keys is not None:
                key = str(keys[i])
                found = index.get(key)
                piece = found if found is not None and found.token_ids == tuple(
                    tokens[r.piece_start:r.end]) else None
                reason = (f"entry {key} is not in the library or does not hold the prompt's "
                          f"tokens [{r.piece_start}, {r.end})")
            else:
                piece = index.match_exact(tokens, r.piece_start, r.end)
                reason = (f"no registered piece holds the prompt's tokens [{r.piece_start}, "
                          f"{r.end})")
            if piece is not None:
                ranges.append(r)
                pieces.append(piece)
                continue
        return CheckedRanges(tuple(ranges), tuple(pieces), len(value) - i, reason)
    return CheckedRanges(tuple(ranges), tuple(pieces))


def range_run(checked: CheckedRanges, local_hit: int) -> tuple[list[Placement], int]:
    """The placements and the end of the ranges that hold ``local_hit``: the range with
    ``start <= local_hit < end`` and those contiguous after it (a range joins when it starts
    where the one before it ends and supplies its piece from the piece's first token: a
    range that leaves out its piece's first tokens needs a local hit of its own).
    ``([], local_hit)`` when no range holds it: nothing is supplied.
    """
    rs = checked.ranges
    first = next((i for i, r in enumerate(rs) if r.start <= local_hit < r.end), None)
    if first is None:
        return [], local_hit
    last = first
    while (last + 1 < len(rs) and rs[last + 1].start == rs[last].end
           and rs[last + 1].offset == 0):
        last += 1
    run = [Placement(checked.pieces[i], rs[i].piece_start) for i in range(first, last + 1)]
    return run, rs[last].end


def external_tokens(run: Sequence[Placement], prompt_len: int, local_hit: int,
                    end: int | None = None) -> int:
    """How many tokens past ``local_hit`` the run supplies (up to ``end``, by default the run's
    own end); at least one prompt token is left for the model to compute (its logits start the
    answer)."""
    if not run:
        return 0
    end = min(run[-1].end if end is None else end, prompt_len - 1)
    return max(0, end - local_hit)


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """LongTensor[end - start]: the paged-cache slot of each token ``t`` in ``[start, end)``,
    ``block_ids[t // block_size] * block_size + t % block_size``."""
    if start < 0 or end < start:
        raise ValueError(f"bad token range [{start}, {end})")
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {end} need {-(-end // block_size)} blocks of "
                         f"{block_size}; the request has {len(block_ids)}")
    t = torch.arange(start, end)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    return blocks[t // block_size] * block_size + t % block_size


def visible(piece: PieceInfo, tenant: str | None) -> bool:
    """Whether a request of ``tenant`` may splice ``piece``: the operator's pieces (tenant
    None) are every tenant's, a tenant's own only its own.

    Example:
        >>> p = PieceInfo("k", "tool", (5,), 0, tenant="acme")
        >>> visible(p, "acme"), visible(p, "globex"), visible(p, None)
        (True, False, False)
    """
    return piece.tenant is None or piece.tenant == tenant
