"""A serving folder's skills grouped with their variants: what each costs on disk, and the cap.

Variants of one skill are entries with the same tokens (and the same owner: the operator, or
one tenant) compiled behind different prefixes (``PieceInfo.behind``). :func:`skill_variants`
groups a folder's entries so (``kvnotes skills list``), each with its bytes on disk;
:func:`cap_variants` bounds a skill's variants (oldest entry dropped first, by modification
time), which ``ServingSkills.add`` applies after each publish. Entries are read by header
(:func:`~kvnotes.serving.library.piece_store.index_entry`), never their tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvnotes.core.errors import InvalidArgumentError, KvnotesError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import entry_paths
from kvnotes.serving.library.piece_store import index_entry
from kvnotes.serving.library.splice import PieceInfo

# Variants kept per skill by default: the header-anchored entry and three predecessors.
DEFAULT_MAX_VARIANTS = 4


@dataclass(frozen=True, slots=True)
class StoredVariant:
    """One entry of a skill: its piece, its file's size and modification time."""

    piece: PieceInfo
    bytes: int
    mtime_ns: int

    def to_dict(self) -> JsonObject:
        return {"key": self.piece.key, "origin": self.piece.origin,
                "behind_tokens": len(self.piece.behind), "bytes": self.bytes}


@dataclass(frozen=True, slots=True)
class SkillVariants:
    """A skill's entries (oldest first): its tokens compiled behind each prefix."""

    name: str
    token_ids: tuple[int, ...]
    tenant: str | None
    variants: tuple[StoredVariant, ...]

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.variants)

    def to_dict(self) -> JsonObject:
        return {"name": self.name, "tokens": len(self.token_ids), "tenant": self.tenant,
                "bytes": self.bytes, "variants": [v.to_dict() for v in self.variants]}


def skill_variants(folder: str | os.PathLike[str], fingerprint: ModelFingerprint
                   ) -> list[SkillVariants]:
    """The folder's readable entries grouped by (tokens, tenant), in order of each group's
    oldest entry; entries that cannot be read are left out (the server skips them too)."""
    groups: dict[tuple[tuple[int, ...], str | None], list[StoredVariant]] = {}
    for path in entry_paths(folder):
        try:
            st = path.stat()
            piece, _ = index_entry(Path(path), fingerprint)
        except (KvnotesError, OSError):
            continue
        groups.setdefault((piece.token_ids, piece.tenant), []).append(
            StoredVariant(piece, int(st.st_size), int(st.st_mtime_ns)))
    out = []
    for (ids, tenant), entries in groups.items():
        entries.sort(key=lambda v: (v.mtime_ns, v.piece.key))
        out.append(SkillVariants(entries[-1].piece.name, ids, tenant, tuple(entries)))
    out.sort(key=lambda g: (g.variants[0].mtime_ns, g.name))
    return out


def cap_variants(folder: str | os.PathLike[str], fingerprint: ModelFingerprint,
                 token_ids: tuple[int, ...], tenant: str | None, max_variants: int, *,
                 keep: str | None = None) -> list[str]:
    """Delete the oldest entries of the skill ``(token_ids, tenant)`` beyond ``max_variants``
    (never ``keep``, the entry just published); returns the deleted keys. A running server
    drops a deleted entry at its next rescan (a request already planned with it computes
    those tokens instead: never a wrong one)."""
    if isinstance(max_variants, bool) or not isinstance(max_variants, int) or max_variants < 1:
        raise InvalidArgumentError(f"max_variants must be at least 1, got {max_variants!r}")
    group = next((g for g in skill_variants(folder, fingerprint)
                  if g.token_ids == token_ids and g.tenant == tenant), None)
    if group is None or len(group.variants) <= max_variants:
        return []
    extra = len(group.variants) - max_variants
    dropped: list[str] = []
    for v in group.variants:
        if len(dropped) == extra:
            break
        if v.piece.key == keep:
            continue
        (Path(folder) / f"{v.piece.key}.safetensors").unlink(missing_ok=True)
        dropped.append(v.piece.key)
    return dropped
