"""A composed prompt's token layout, part by part, as ``engine.compose`` lays it out.

The front, the compose client and the benchmarks all send prompts built this way, so a server's
plan and the engine's composition see the same token ids at the same positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.document import added_bos, encode
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.planning.part_tokens import PartTokenCache


@dataclass(frozen=True, slots=True)
class SentPart:
    """One part of a prompt as sent: its token ids, and the registered piece they are at their
    position (None: text the server computes)."""

    token_ids: tuple[int, ...]
    piece: PieceInfo | None = None


def part_ids(tokenizer: Any, parts: Sequence[str], *, cache: PartTokenCache | None = None,
             known: Sequence[Sequence[int] | None] | None = None) -> list[list[int]]:
    """Each part's token ids as ``engine.compose`` lays them out: BOS first, as a part of its
    own, when the tokenizer adds one, then each part encoded alone (no special tokens).

    ``known``: per part, its ids when they are known already, else None (a registered skill's:
    its text encodes alone to exactly them, checked when the catalog was read), so it is not
    encoded again. ``cache``: the other parts' ids kept by their text (exact: each is encoded
    alone), encoded only when not kept."""
    if isinstance(parts, str):
        raise TypeError("parts is a list of strings (header, skills, user text), not one string")
    if known is not None and len(known) != len(parts):
        raise ValueError(f"known has {len(known)} entries for {len(parts)} parts")
    out: list[list[int]] = []
    bos = added_bos(tokenizer)  # the engine's BOS rule
    if bos is not None:
        out.append([bos])
    encoded = encode if cache is None else cache.encode
    # a tokenizer that bounds the plan's time (the front's) is asked at every part, since a
    # part whose ids are cached or known makes no tokenizer call
    check = getattr(tokenizer, "check_deadline", None)
    for i, part in enumerate(parts):
        if check is not None:
            check()
        ids = None if known is None else known[i]
        out.append(list(ids) if ids is not None else list(encoded(tokenizer, part)))
    return out


def prompt_ids(tokenizer: Any, parts: Sequence[str]) -> list[int]:
    """Token ids of ``parts`` as ``engine.compose`` lays them out."""
    return [t for ids in part_ids(tokenizer, parts) for t in ids]
