"""Finding a server's registered skills in a prompt's text: what the OpenAI front splices.

The front receives text (a completion prompt, or chat messages rendered with the model's chat
template), not the part list a :class:`~kvnotes.serving.compose_client.ComposeClient` sends.
:class:`SkillCatalog` follows a serving-skills folder (the same one the connector reads) and
knows each entry's tokens; a skill's text is its tokens decoded, kept only when encoding that
text alone gives the same tokens back (otherwise the per-part ids could never match the piece).
:func:`find_skills` splits a prompt's text into parts at the registered texts it contains,
leftmost first and, among texts starting at the same character, longest first (through a
:class:`~kvnotes.serving.library.prefix_index.PrefixIndex` of the texts, built once per
catalog change: the cost of a match follows the prompt's length, not the catalog's size); each part is
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.document import added_bos, encode
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.prefix_index import PrefixIndex
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, preferred, visible
from kvnotes.serving.planning.layout import SentPart, part_ids
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.spans import sweep

MAX_VIEWS = 256  # tenants' views kept at once (rebuilt on demand beyond it)


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
TEXT_BLOCK = 16  # characters per block of the skill texts' trie (see PrefixIndex)
SkillIndex = PrefixIndex[Skill]


def skill_index(skills: Iterable[Skill]) -> SkillIndex:
    """``skills`` indexed by text, for :func:`find_skills`."""
    index: SkillIndex = PrefixIndex(block=TEXT_BLOCK)
    for skill in skills:
        index.add(skill.text, skill)
    return index


def find_skills(text: str, skills: SkillIndex | Iterable[Skill]) -> list[Part]:
    """``text`` split at the registered texts it contains: leftmost match first; at one
    character, the longest; matches never overlap. No skill found: one part, the whole text.
    ``skills``: a :func:`skill_index` (built once per catalog change), or the skills
    themselves. Its cost grows with the text's length, not with how many skills there are.

    Example:
        >>> s = Skill("POLICY", (1,), (PieceInfo("k", "policy", (1,), 0),))
        >>> [(p.text, p.skill is not None) for p in find_skills("Hi POLICY there", [s])]
        [('Hi ', False), ('POLICY', True), (' there', False)]
    """
    index = skills if isinstance(skills, PrefixIndex) else skill_index(skills)

    def found() -> Iterator[tuple[int, int, Skill]]:
        end = 0
        for at in index.starts(text):
            if at < end:
                continue  # inside the match before: the sweep would drop it
            hit = index.longest_at(text, at)
            if hit is not None:
                end = at + len(hit[1].text)
                yield at, end, hit[1]

    parts = [Part(text[a:b], skill) for a, b, skill in sweep(len(text), found())]
    return parts or [Part(text)]


def lay_out(tokenizer: Any, found: Sequence[Part], bos_pieces: Sequence[PieceInfo],
            registered: PieceIndex, cache: PartTokenCache | None = None) -> list[SentPart]:
    """``found`` (a :func:`find_skills` result) as sent: laid out by
    :func:`~kvnotes.serving.planning.layout.part_ids` (BOS first when the tokenizer adds one,
    then each part encoded alone: a skill's registered ids, the others through ``cache`` when
    given), each skill with the piece it is at its position (the
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
    ids = part_ids(tokenizer, [p.text for p in parts], cache=cache,
                   known=[None if p.skill is None else p.skill.token_ids for p in parts])
    lead = len(ids) - len(parts)  # the BOS part, when the tokenizer adds one
    out = [sent(tokens, bos_pieces) for tokens in ids[:lead]]
    for part, tokens in zip(parts, ids[lead:], strict=True):
        out.append(sent(tokens, () if part.skill is None else part.skill.pieces))
    return out


@dataclass(frozen=True, slots=True)
class _View:
    """What one tenant's requests are matched against: the shared entries and its own."""

    skills: list[Skill]
    matcher: SkillIndex  # the skills by text
    index: PieceIndex
    bos: tuple[PieceInfo, ...]  # the one-token BOS entries
    left_out: list[str]


class SkillCatalog:
    """The registered skills of one model's serving folder, as texts; follows the folder.

    Args:
        folder: ``ROOT/<fingerprint id>`` (``ServingSkills.folder``), holding ``serving.json``.
        tokenizer: the served model's tokenizer (the one the skills were compiled with).
        rescan_s: how often, at most, the folder's modification time is checked.

    Tenancy: :meth:`find`, :meth:`skills`, :meth:`index` and :meth:`lay_out` take the
    request's ``tenant`` and see the shared entries (tenant None) and that tenant's own, never
    another tenant's; ``tenant=None`` sees the shared entries only.

    Thread-safe: :meth:`skills` may be called from every request's thread.
    """

    def __init__(self, folder: str | os.PathLike[str], tokenizer: Any, *,
                 rescan_s: float = 0.25) -> None:
        # the scheduler's own index of the folder: the front plans with what it will splice
        self._setup(tokenizer, PieceStore(Path(folder), rescan_s=rescan_s))
        self.refresh(force=True)

    @classmethod
    def of_pieces(cls, tokenizer: Any, pieces: Iterable[PieceInfo]) -> SkillCatalog:
        """A catalog of ``pieces`` held in memory, following no folder: planning without a
        disk (benchmarks, tests). Its :attr:`folder` is None."""
        catalog = cls.__new__(cls)
        catalog._setup(tokenizer, None)
        catalog._snapshot(pieces)
        return catalog

    def _setup(self, tokenizer: Any, store: PieceStore | None) -> None:
        self.folder = None if store is None else store.folder
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._store = store
        self._pieces: dict[str, PieceInfo] = {}  # file stem -> piece
        self._by_tokens: dict[tuple[int, ...], tuple[PieceInfo, ...]] = {}
        self._views: dict[str | None, _View] = {}  # tenant -> its view, at this generation
        self._generation = -1  # the store's generation the snapshot above was built from

    def _snapshot(self, pieces: Iterable[PieceInfo]) -> None:
        """Hold ``pieces`` as the catalog's entries (every view rebuilt on demand)."""
        by_key = {p.key: p for p in pieces}
        by_tokens: dict[tuple[int, ...], list[PieceInfo]] = {}
        for piece in by_key.values():
            by_tokens.setdefault(piece.token_ids, []).append(piece)
        self._pieces = by_key
        self._by_tokens = {ids: tuple(ps) for ids, ps in by_tokens.items()}
        self._views = {}

    @property
    def left_out(self) -> list[str]:
        """The shared entries never matched by text (see :func:`skill_texts`)."""
        return self._view(None).left_out

    def refresh(self, *, force: bool = False) -> None:
        if self._store is None:
            return
        with self._lock:
            self._store.refresh(force=force)
            if force or self._store.generation != self._generation:
                self._generation = self._store.generation
                self._snapshot(self._store.index.pieces())

    def _view(self, tenant: str | None) -> _View:
        """``tenant``'s view of the folder as indexed now (built once per change)."""
        with self._lock:
            view = self._views.get(tenant)
            if view is not None:
                return view
            generation = self._generation
            pieces = [p for p in self._pieces.values() if visible(p, tenant)]
        index = PieceIndex()
        for piece in pieces:
            index.add(piece)
        skills, left_out = skill_texts(self.tokenizer, pieces)
        bos = added_bos(self.tokenizer)
        view = _View(skills, skill_index(skills), index, tuple(sorted(
            (p for p in pieces if bos is not None and p.token_ids == (bos,)),
            key=lambda p: (p.origin, p.key))), left_out)
        with self._lock:
            if generation == self._generation:  # not one the folder has changed since
                if len(self._views) >= MAX_VIEWS:
                    self._views.clear()
                self._views[tenant] = view
        return view

    def skills(self, tenant: str | None = None) -> list[Skill]:
        """The matchable skills ``tenant`` sees now, longest text first."""
        self.refresh()
        return self._view(tenant).skills

    def pieces(self) -> list[PieceInfo]:
        """Every indexed entry, every tenant's (the BOS piece and unmatchable ones included)."""
        self.refresh()
        return list(self._pieces.values())

    def index(self, tenant: str | None = None) -> PieceIndex:
        """The entries ``tenant`` sees, indexed by tokens (a snapshot: a rescan builds a new
        one)."""
        self.refresh()
        return self._view(tenant).index

    def keys_of(self, token_ids: Sequence[int], tenant: str | None = None) -> list[str]:
        """The keys of every entry ``tenant`` sees whose tokens are ``token_ids`` (one skill's
        anchorings). Takes no lock (the map is replaced whole at a rescan), so the serving loop
        may call it."""
        pieces = self._by_tokens.get(tuple(token_ids), ())
        return [p.key for p in pieces if visible(p, tenant)]

    def find(self, text: str, tenant: str | None = None) -> list[Part]:
        self.refresh()
        return find_skills(text, self._view(tenant).matcher)

    def lay_out(self, found: Sequence[Part], tokenizer: Any = None,
                tenant: str | None = None, cache: PartTokenCache | None = None
                ) -> list[SentPart]:
        """``found`` (a :meth:`find` result) as sent, its pieces checked against ``tenant``'s
        view of the folder as indexed now (:func:`lay_out`). ``tokenizer``: the catalog's, or
        a copy of it; ``cache``: the text parts' ids kept by their text."""
        self.refresh()
        view = self._view(tenant)
        return lay_out(self.tokenizer if tokenizer is None else tokenizer, found, view.bos,
                       view.index, cache)
