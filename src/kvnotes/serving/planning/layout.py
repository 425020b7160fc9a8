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


@dataclass(frozen=True, slots=True)
class SentPart:
    """One part of a prompt as sent: its token ids, and the registered piece they are at their
    position (None: text the server computes)."""

    token_ids: tuple[int, ...]
    piece: PieceInfo | None = None


def part_ids(tokenizer: Any, parts: Sequence[str]) -> list[list[int]]:
    """Each part's token ids as ``engine.compose`` lays them out: BOS first, as a part of its
    own, when the tokenizer adds one, then each part encoded alone (no special tokens)."""
    if isinstance(parts, str):
        raise TypeError("parts is a list of strings (header, skills, user text), not one string")
    out: list[list[int]] = []
    bos = added_bos(tokenizer)  # the engine's BOS rule
    if bos is not None:
        out.append([bos])
    out += [list(encode(tokenizer, part)) for part in parts]
    return out


def prompt_ids(tokenizer: Any, parts: Sequence[str]) -> list[int]:
    """Token ids of ``parts`` as ``engine.compose`` lays them out."""
    return [t for ids in part_ids(tokenizer, parts) for t in ids]
