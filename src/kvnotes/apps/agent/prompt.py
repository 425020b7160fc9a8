"""The agent's prompt, piece by piece, shared by the kvnotes agent and the recompute agent.

Both agents lay out the same pieces (:meth:`Prompt.pieces`) in the same order, each piece
tokenized on its own, so with ``updates="rewrite"`` (the default) they read exactly the same
token ids every turn:

    [BOS] system( HEADER, skill 1 .. skill n, record )  [errata]
          [user(request t-h) assistant(Decision: c)] ... [the last h exchanges]
          user(request t)  assistant(Decision:

The system block holds every skill loaded so far (in the order they were first needed) and
then the customer record, written with its current values: the state block is the last thing
before the conversation, so a state change or a new skill only invalidates what follows it (the
record, and the few exchanges kept after it). ``history`` keeps the last ``h`` exchanges
(``None``: all of them; 0: none, each request is decided on the policies and the record alone).
The record renders its fields that never change first (:data:`kvnotes.apps.agent.state.FIELDS`),
so a changed field invalidates only the record's tail.

The ``"appended"`` skill order (``later=`` in :meth:`Prompt.pieces`) keeps the skills of turn 0
before the record and writes every skill loaded later after it, closing the system block in a
piece of its own:

    [BOS] system( HEADER, turn 0's skills, record, later skills )  ...  user(request t) ...

so loading a skill re-prefills nothing (the record stays), at the price of re-splicing the later
skills when a state change rewrites the record before them.

``updates="errata"`` (an ablation) keeps the record of the first turn and writes one correction
per state change after it (:func:`kvnotes.ops.edit.erratum_turn`, a user turn for chat models);
``"ignore"`` (the stale-record ablation) keeps the first record and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.apps.agent.episodes import Request
from kvnotes.core.chat import ChatFormat

HEADER = ("You are the customer service agent of Skyline Airways. Follow the policies below "
          "exactly; they are the only rules you may apply. The customer record is the source of "
          "truth for every fact about the customer.\n\n")
DECISION = "Decision:"


@dataclass(frozen=True, slots=True)
class Piece:
    """One prompt piece: ``kind`` is ``"header"`` or ``"skill"`` (notes a kvnotes agent
    splices; ``text`` is then the skill's name for ``"skill"``, the header text for
    ``"header"``), or ``"text"``, ``"erratum"``, ``"query"`` (text prefilled in place). ``name``
    names its span."""

    kind: str
    name: str
    text: str

    @property
    def spliced(self) -> bool:
        return self.kind in ("header", "skill")


class Prompt:
    """The text of every prompt piece for one chat format, and their layout."""

    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt

    def head(self) -> str:
        return self.fmt.system[0] + HEADER

    def record(self, state_text: str) -> str:
        return state_text + self.fmt.system[1]

    def query(self, request: Request) -> str:
        """The request and the decision cue."""
        options = ", ".join(request.options)
        return (self.fmt.user[0] + f"{request.text}\nAnswer with one of: {options}."
                + self.fmt.user[1] + self.fmt.assistant[0] + DECISION)

    def answer(self, choice: str) -> str:
        return f" {choice}" + self.fmt.assistant[1]

    def pieces(self, *, skills: Sequence[str], record: str,
               errata: Sequence[tuple[str, str]] = (),
               history: Sequence[tuple[int, Request, str]] = (),
               request: Request, turn: int, later: Sequence[str] | None = None) -> list[Piece]:
        """The whole prompt of turn ``turn``: the header, ``skills`` (names), the record (its
        rendered text), ``errata`` (``(span name, text)``), the kept ``history`` exchanges
        (``(turn, request, answer)``) and ``request``.

        ``later`` (the ``"appended"`` layout): skills written after the record, still inside
        the system block, which then closes in a piece of its own (``system.end``) after them.
        """
        out = [Piece("header", "header", self.head())]
        out += [Piece("skill", name, name) for name in skills]
        if later is None:
            out.append(Piece("text", "record", self.record(record)))
        else:
            out.append(Piece("text", "record", record))
            out += [Piece("skill", name, name) for name in later]
            out.append(Piece("text", "system.end", self.fmt.system[1]))
        out += [Piece("erratum", name, text) for name, text in errata]
        for t, req, answer in history:
            out.append(Piece("query", f"t{t}.request", self.query(req)))
            out.append(Piece("text", f"t{t}.answer", self.answer(answer)))
        out.append(Piece("query", f"t{turn}.request", self.query(request)))
        return out
