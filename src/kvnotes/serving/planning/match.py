"""Finding a server's registered skills in a prompt's text: what the OpenAI front splices.

The front receives text (a completion prompt, or chat messages rendered with the model's chat
template), not the part list a :class:`~kvnotes.serving.compose_client.ComposeClient` sends.
:class:`SkillCatalog` follows a serving-skills folder (the same one the connector reads) and
knows each entry's tokens; a skill's text is its tokens decoded, kept only when encoding that
text alone gives the same tokens back (otherwise the per-part ids could never match the piece).
:func:`find_skills` splits a prompt's text into parts at the registered texts it contains,
leftmost first and, among texts starting at the same character, longest first; each part is
then tokenized alone (``layout.prompt_ids``), so a skill's tokens in the request are
exactly its piece's, whatever the text around it (Gemma's tokenizer would merge a ``"\\n"``
ending the header with one opening a skill into a single token if the whole text were encoded
at once). :func:`lay_out` then gives each found skill the piece it is at its position, so the
plan is built from this one match (no second lookup by tokens).

Entries are read lightly: the safetensors header, the ``token_ids`` and the first of the
``positions``, never the KV tensors (the connector checks every entry fully before it splices;
a wrong guess here costs a computed token, never a wrong one). No vLLM, no engine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.document import added_bos, encode
from kvnotes.core.errors import KvnotesError, NotebookFileError, NotebookMismatchError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.serving.library.piece_store import PieceStore, index_entry
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, preferred
from kvnotes.serving.planning.layout import SentPart, part_ids


@dataclass(frozen=True, slots=True)
class Skill:
    """A registered text: its tokens, and every entry with those tokens (one per anchoring)."""

    text: str
    token_ids: tuple[int, ...]
    pieces: tuple[PieceInfo, ...]

    @property
    def name(self) -> str:
        return self.pieces[0].name


@dataclass(frozen=True, slots=True)
class Part:
    """A slice of the prompt's text: a registered skill's text, or text between skills."""

    text: str
    skill: Skill | None = None


# ---- reading entries -------------------------------------------------------------------------
def read_piece_info(path: str | os.PathLike[str], fingerprint: dict[str, Any]) -> PieceInfo:
    """``PieceInfo`` of one library entry from its header and token ids alone (the scheduler's
    reader, :func:`kvnotes.serving.library.piece_store.index_entry`).

    Raises :class:`NotebookFileError` for a file that is not an entry of ``fingerprint``'s
    model (another format, another model, unreadable).
    """
    path = Path(path)
    try:
        want = ModelFingerprint.from_dict(fingerprint)
    except ValueError as err:  # no entry is written under a fingerprint that is not one
        raise NotebookFileError(f"{path}: written by another model ({err})") from err
    try:
        piece, _ = index_entry(path, want)
    except NotebookMismatchError as err:
        raise NotebookFileError(f"{path}: written by another model ({err})") from err
    except (KvnotesError, OSError) as err:
        raise NotebookFileError(f"{path}: unreadable skill entry ({err})") from err
    return piece


def skill_texts(tokenizer: Any, pieces: Iterable[PieceInfo]) -> tuple[list[Skill], list[str]]:
    """``(skills, left_out)``: the pieces grouped by tokens, each with its text; the names of
    pieces whose decoded text does not encode back to their tokens (never matchable by text),
    and of the one-token BOS piece (the front places it by the BOS rule, not by text)."""
    groups: dict[tuple[int, ...], list[PieceInfo]] = {}
    for p in pieces:
        groups.setdefault(p.token_ids, []).append(p)
    bos = added_bos(tokenizer)
    skills, left_out = [], []
    for ids, group in groups.items():
        group.sort(key=lambda p: (p.origin, p.key))
        if bos is not None and ids == (bos,):
            left_out.append(group[0].name)
            continue
        text = tokenizer.decode(list(ids), skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        if not text or tuple(encode(tokenizer, text)) != ids:
            left_out.append(group[0].name)
            continue
        skills.append(Skill(text, ids, tuple(group)))
    skills.sort(key=lambda s: (-len(s.text), s.text))
    return skills, left_out


# ---- matching --------------------------------------------------------------------------------
def find_skills(text: str, skills: Sequence[Skill]) -> list[Part]:
    """``text`` split at the registered texts it contains: leftmost match first; at one
    character, the longest; matches never overlap. No skill found: one part, the whole text.

    Example:
        >>> s = Skill("POLICY", (1,), (PieceInfo("k", "policy", (1,), 0),))
        >>> [(p.text, p.skill is not None) for p in find_skills("Hi POLICY there", [s])]
        [('Hi ', False), ('POLICY', True), (' there', False)]
    """
    found: list[tuple[int, int, Skill]] = []  # (start, -length, skill)
    for skill in skills:
        at = text.find(skill.text)
        while at >= 0:
            found.append((at, -len(skill.text), skill))
            at = text.find(skill.text, at + 1)
    found.sort(key=lambda f: (f[0], f[1]))
    parts: list[Part] = []
    pos = 0
    for start, neg_len, skill in found:
        if start < pos:
            continue
        if start > pos:
            parts.append(Part(text[pos:start]))
        parts.append(Part(skill.text, skill))
        pos = start - neg_len
    if pos < len(text) or not parts:
        parts.append(Part(text[pos:]))
    return parts


def lay_out(tokenizer: Any, found: Sequence[Part], bos_pieces: Sequence[PieceInfo],
            registered: PieceIndex) -> list[SentPart]:
    """``found`` (a :func:`find_skills` result) as sent: laid out by
    :func:`~kvnotes.serving.planning.layout.part_ids` (BOS first when the tokenizer adds one,
    then each part encoded alone), each skill with the piece it is at its position (the
    :func:`~kvnotes.serving.library.splice.preferred` one among its variants, ranked against
    the prompt's ids before it: the connector's rule, so both pick the same entry), the BOS
    with one of ``bos_pieces``. Only pieces still in ``registered`` count: a skill removed since the
    match (or whose tokens differ from its part's) is text, computed, never spliced.
    """
    before: list[int] = []  # the prompt's ids so far: what a variant's prefix is matched to

    def sent(tokens: Sequence[int], pieces: Sequence[PieceInfo]) -> SentPart:
        ids = tuple(tokens)
        piece = preferred((p for p in pieces if p.token_ids == ids
                           and registered.get(p.key) == p), len(before), before)
        before.extend(ids)
        return SentPart(ids, piece)

    parts = [p for p in found if p.text]
    ids = part_ids(tokenizer, [p.text for p in parts])
    lead = len(ids) - len(parts)  # the BOS part, when the tokenizer adds one
    out = [sent(tokens, bos_pieces) for tokens in ids[:lead]]
    for part, tokens in zip(parts, ids[lead:], strict=True):
        out.append(sent(tokens, () if part.skill is None else part.skill.pieces))
    return out


class SkillCatalog:
    """The registered skills of one model's serving folder, as texts; follows the folder.

    Args:
        folder: ``ROOT/<fingerprint id>`` (``ServingSkills.folder``), holding ``serving.json``.
        tokenizer: the served model's tokenizer (the one the skills were compiled with).
        rescan_s: how often, at most, the folder's modification time is checked.

    Thread-safe: :meth:`skills` may be called from every request's thread.
    """

    def __init__(self, folder: str | os.PathLike[str], tokenizer: Any, *,
                 rescan_s: float = 0.25) -> None:
        self.folder = Path(folder)
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        # the scheduler's own index of the folder: the front plans with what it will splice
        self._store = PieceStore(self.folder, rescan_s=rescan_s)
        self._pieces: dict[str, PieceInfo] = {}  # file stem -> piece
        self._skills: list[Skill] = []
        self._bos: tuple[PieceInfo, ...] = ()  # the one-token BOS entries
        self._index = PieceIndex()
        self._generation = -1  # the store's generation the snapshot above was built from
        self.left_out: list[str] = []
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> None:
        with self._lock:
            self._store.refresh(force=force)
            if force or self._store.generation != self._generation:
                self._generation = self._store.generation
                pieces = {p.key: p for p in self._store.index.pieces()}
                index = PieceIndex()
                for piece in pieces.values():
                    index.add(piece)
                self._pieces, self._index = pieces, index
                self._skills, self.left_out = skill_texts(self.tokenizer, pieces.values())
                bos = added_bos(self.tokenizer)
                self._bos = tuple(sorted((p for p in pieces.values()
                                          if bos is not None and p.token_ids == (bos,)),
                                         key=lambda p: (p.origin, p.key)))

    def skills(self) -> list[Skill]:
        """The matchable skills now, longest text first."""
        self.refresh()
        return self._skills

    def pieces(self) -> list[PieceInfo]:
        """Every indexed entry (the BOS piece and unmatchable ones included)."""
        self.refresh()
        return list(self._pieces.values())

    def index(self) -> PieceIndex:
        """Every entry, indexed by tokens (a snapshot: a rescan builds a new one)."""
        self.refresh()
        return self._index

    def find(self, text: str) -> list[Part]:
        return find_skills(text, self.skills())

    def lay_out(self, found: Sequence[Part], tokenizer: Any = None) -> list[SentPart]:
        """``found`` (a :meth:`find` result) as sent, its pieces checked against the folder as
        indexed now (:func:`lay_out`). ``tokenizer``: the catalog's, or a copy of it."""
        self.refresh()
        with self._lock:
            bos, index = self._bos, self._index
        return lay_out(self.tokenizer if tokenizer is None else tokenizer, found, bos, index)
