"""A turn's prompt laid out as token ids, and the plan for its notes: what each spliced piece
is compiled behind (its anchor), and how much of the last turn's notebook is kept.

A skill's notes equal a recompute's only where it sits behind exactly the tokens it was
compiled behind. :class:`Anchors` decides those tokens: the fixed header opens every prompt;
``tools`` (:data:`FIXED_SKILLS`) follows it; the request's own skills open the skill block in
the ``"request"`` order; with variants every other skill is compiled behind the opening of the
prompt (the lead run, or turn 0's skills), one library entry per opening.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.prompt import Piece, Prompt
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.core.engine import Engine
from kvnotes.core.notebook import Notebook, Span

FIXED_SKILLS = ("tools",)  # loaded first in every episode, right after the header


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of the prompt with its token ids, starting at token ``start``."""

    piece: Piece
    ids: list[int]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    def span(self) -> Span:
        p = self.piece
        kind = (p.kind if p.kind in ("skill", "erratum", "query")
                else "skill" if p.kind == "header" else "text")
        return Span(p.name, kind, self.start, self.end)


@dataclass(frozen=True, slots=True)
class Layout:
    """A whole prompt as parts (a leading BOS part when the model adds one) and token ids."""

    parts: tuple[Part, ...]
    token_ids: list[int]

    @classmethod
    def of(cls, engine: Engine, pieces: Sequence[Piece],
           ids_of: Callable[[Piece], list[int]]) -> Layout:
        parts: list[Part] = []
        at = 0
        pairs = [(p, ids_of(p)) for p in pieces]
        if engine.bos_id is not None:  # the model adds one: it opens every prompt
            pairs.insert(0, (Piece("text", "bos", ""), [engine.bos_id]))
        for piece, ids in pairs:
            parts.append(Part(piece, ids, at))
            at += len(ids)
        return cls(tuple(parts), [i for p in parts for i in p.ids])

    def spans(self) -> list[Span]:
        return [p.span() for p in self.parts]


@dataclass(frozen=True, slots=True)
class AnchoredNotes:
    """A spliced piece's compiled notes, the token ids they were compiled behind, and whether
    getting them compiled them."""

    notes: Notebook
    anchor: list[int]
    compiled: bool


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """How a turn's notebook is made: its ``layout``; ``anchors``, part index -> the prefix that
    part's notes are compiled behind where that is not the default; ``keep``, the leading notes
    of the last turn's notebook kept as they are (a splice is kept whole or redone whole, and
    the last token is always fed: its logits decide)."""

    layout: Layout
    anchors: dict[int, list[int]]
    keep: int


class Anchors:
    """What each spliced piece of one agent's prompt is compiled behind."""

    def __init__(self, engine: Engine, skills: SkillBook, prompt: Prompt,
                 config: AgentConfig) -> None:
        self.engine = engine
        self.skills = skills
        self.order = config.order
        self.variants = config.uses_variants
        self.after = prompt.head() if config.anchored else None  # the text skills follow
        # skills that open every prompt (right after the header) are compiled behind the header;
        # every other skill behind the header and those (the fixed part of every prompt), so the
        # skill spliced right after them is exact and later ones saw the text before them
        self.fixed = [s for s in FIXED_SKILLS if s in skills.names] if config.anchored else []
        self._default: dict[str, list[int]] = {"header": engine.anchor_ids(None)}
        if self.after is not None:
            head = engine.anchor_ids(self.after)
            fixed = head + [i for s in self.fixed for i in skills.token_ids(s)]
            self._default.update({s: head for s in self.fixed})
            self._default.update({s: fixed for s in skills.names if s not in self.fixed})

    def notes(self, piece: Piece, anchor: list[int] | None = None) -> AnchoredNotes:
        """A spliced piece's compiled notes: behind ``anchor`` when given (the skill's true
        prefix), else behind the default for that piece."""
        if piece.kind == "header":
            got = self.skills.header_entry(piece.text)
            return AnchoredNotes(got.notes, self._default["header"], got.compiled)
        if self.after is None:
            got = self.skills.entry(piece.text)
            return AnchoredNotes(got.notes, self.engine.anchor_ids(None), got.compiled)
        if piece.text in self.fixed:
            got = self.skills.entry(piece.text, after=self.after)
            return AnchoredNotes(got.notes, self._default[piece.text], got.compiled)
        anchor = self._default[piece.text] if anchor is None else anchor
        got = self.skills.entry(piece.text, after=anchor)
        return AnchoredNotes(got.notes, anchor, got.compiled)

    def lead(self, layout: Layout, request_skills: Sequence[str], opening: Sequence[str]
             ) -> dict[int, list[int]]:
        """Part index -> the prefix its notes are compiled behind, where that is not the
        default: the request's skills in the run of spliced pieces that opens the prompt
        (header, fixed skills, then the request's own) map to exactly what precedes them, so
        they splice exactly. With variants every other skill maps to the opening: that lead run
        (``"request"`` order), or turn 0's skills, ``opening`` (``"loaded"``: everything before
        the first skill loaded later; ``"appended"``: everything before the record)."""
        out: dict[int, list[int]] = {}
        if self.after is None:
            return out
        flat = layout.token_ids
        at = 0
        for i, part in enumerate(layout.parts):
            p = part.piece
            if p.kind == "header" or (p.kind == "skill" and p.text in self.fixed):
                pass
            elif p.kind == "skill" and p.text in request_skills:
                out[i] = flat[:part.start]
            elif p.name != "bos":
                break
            at = part.end
        if not self.variants:
            return out
        behind: list[int] | None = flat[:at] if self.order == "request" else None
        for i, part in enumerate(layout.parts):
            p = part.piece
            if self.order == "appended" and p.name == "record":
                behind = flat[:part.start]
            elif (self.order == "loaded" and behind is None and p.kind == "skill"
                  and opening and p.text not in opening):
                behind = flat[:part.start]
            if p.kind == "skill" and behind is not None and i not in out \
                    and p.text not in self.fixed:
                out[i] = behind  # one variant per opening, as the agent's prepare() compiles
        return out

    def plan(self, layout: Layout, old: Notebook | None, request_skills: Sequence[str],
             opening: Sequence[str]) -> TurnPlan:
        """The plan of a turn whose prompt is ``layout``, after the notebook ``old``."""
        flat = layout.token_ids
        keep = common_prefix(old.token_ids.tolist(), flat) if old is not None else 0
        keep = min(keep, len(flat) - 1)
        for part in layout.parts:
            if part.piece.spliced and part.start < keep < part.end:
                keep = part.start
                break
        return TurnPlan(layout, self.lead(layout, request_skills, opening), keep)
