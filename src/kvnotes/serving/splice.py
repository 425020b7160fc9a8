"""Splice planning for a serving engine: which prompt tokens known pieces can supply, and where.

A *piece* is a compiled skill as the server will use it: its token ids, the position its first
token was prefilled at (``origin``) and its per-layer keys/values. A request's prompt is matched
from token 0 against the registered pieces; the longest run of consecutive pieces is the
*leading run*, and only that run can be supplied from outside the model (vLLM asks a connector
once, for one contiguous run right after its local prefix-cache hit; see docs/serving.md).

Nothing here imports vLLM: matching and slot arithmetic are pure functions over token ids,
tested without a server. Keys are post-RoPE; moving a piece from ``origin`` to ``start`` is one
more rotation by ``start - origin`` (:attr:`Placement.delta`) with the model's inverse
frequencies, done where the keys are written (:mod:`kvnotes.serving.kv_writer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Index key length: pieces are looked up by the hash of their first KEY_TOKENS tokens, so a
# position costs one dict lookup plus a full compare of the (few) candidates, whatever the
# number of pieces. Pieces shorter than this are keyed by all their tokens.
KEY_TOKENS = 8


@dataclass(frozen=True, slots=True)
class PieceInfo:
    """What matching needs to know about a piece (its KV stays on disk until a load)."""

    key: str  # content address (file stem)
    name: str
    token_ids: tuple[int, ...]
    origin: int  # position of the piece's first token when it was prefilled

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
    """Hashed lookup of pieces by their leading tokens; longest match first.

    Memory is the token ids of the pieces plus one dict entry per piece.

    Example:
        >>> idx = PieceIndex()
        >>> idx.add(PieceInfo("a", "header", (1, 2, 3), 0))
        >>> [p.piece.name for p in leading_run([1, 2, 3, 9], idx)]
        ['header']
    """

    _by_head: dict[tuple[int, ...], list[PieceInfo]] = field(default_factory=dict)
    _keys: dict[str, PieceInfo] = field(default_factory=dict)
    _short_lengths: set[int] = field(default_factory=set)  # lengths below KEY_TOKENS in use

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def get(self, key: str) -> PieceInfo | None:
        return self._keys.get(key)

    def add(self, piece: PieceInfo) -> None:
        if not piece.token_ids:
            raise ValueError(f"piece {piece.name!r} has no tokens")
        if piece.key in self._keys:
            return
        head = piece.token_ids[:KEY_TOKENS]
        bucket = self._by_head.setdefault(head, [])
        bucket.append(piece)
        bucket.sort(key=len, reverse=True)  # longest first: a piece that extends another wins
        if len(head) < KEY_TOKENS:
            self._short_lengths.add(len(head))
        self._keys[piece.key] = piece

    def remove(self, key: str) -> None:
        piece = self._keys.pop(key, None)
        if piece is None:
            return
        head = piece.token_ids[:KEY_TOKENS]
        bucket = [p for p in self._by_head.get(head, []) if p.key != key]
        if bucket:
            self._by_head[head] = bucket
        else:
            self._by_head.pop(head, None)
        self._short_lengths = {len(h) for h in self._by_head if len(h) < KEY_TOKENS}

    def match_at(self, tokens: Sequence[int], pos: int) -> PieceInfo | None:
        """The longest piece whose tokens are exactly ``tokens[pos:pos + len]``, if any.

        Among pieces with the same tokens (one skill compiled behind different prefixes), the
        one prefilled at ``pos`` itself wins (it moves by 0 and its notes saw a context of that
        length, e.g. the header it was compiled behind), then the one prefilled latest.
        """
        best: PieceInfo | None = None
        heads = [tuple(tokens[pos:pos + KEY_TOKENS])]
        heads += [tuple(tokens[pos:pos + n]) for n in sorted(self._short_lengths, reverse=True)]
        for head in heads:
            for piece in self._by_head.get(head, ()):
                n = len(piece)
                if best is not None and n < len(best):
                    break  # the bucket is sorted longest first
                if tuple(tokens[pos:pos + n]) != piece.token_ids:
                    continue
                if best is None or n > len(best) or _rank(piece, pos) > _rank(best, pos):
                    best = piece
        return best


def _rank(piece: PieceInfo, pos: int) -> tuple[bool, int]:
    return piece.origin == pos, piece.origin


def leading_run(tokens: Sequence[int], index: PieceIndex, *, max_pieces: int = 1024
                ) -> list[Placement]:
    """The pieces that tile ``tokens`` from token 0 without a gap, greedily longest first.

    The run ends at the first position where no piece matches: a piece after text nothing has
    cached cannot be supplied (one contiguous external run per request).
    """
    run: list[Placement] = []
    pos = 0
    while pos < len(tokens) and len(run) < max_pieces:
        piece = index.match_at(tokens, pos)
        if piece is None:
            break
        run.append(Placement(piece, pos))
        pos += len(piece)
    return run


def external_tokens(run: Sequence[Placement], prompt_len: int, local_hit: int) -> int:
    """How many tokens past ``local_hit`` the run supplies; at least one prompt token is left
    for the model to compute (its logits start the answer)."""
    if not run:
        return 0
    end = min(run[-1].end, prompt_len - 1)
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
