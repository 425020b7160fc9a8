"""The kvnotes agent's notebook for one turn, made from a :class:`~kvnotes.apps.agent.layout.TurnPlan`:
the kept prefix of the last notebook, then text prefilled in place and skills re-rotated and
spliced, in as few forwards as the splices allow.

Which spliced notes are recomputed, and how many leading notes are exact (equal a recompute's,
so the decision guard recomputes only the rest), is the turn's repair plan
(:func:`~kvnotes.core.repair_plan.plan_repair`, the rule ``engine.compose`` follows): the
builder lays the turn out, plans it and executes the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.layout import AnchoredNotes, Anchors, Part, TurnPlan, common_prefix
from kvnotes.core.compose import execute_piece_repair
from kvnotes.core.engine import Engine
from kvnotes.core.notebook import Notebook
from kvnotes.core.repair import prefix_digest
from kvnotes.core.repair_plan import Part as LayoutPart
from kvnotes.core.repair_plan import Piece as LayoutPiece
from kvnotes.core.repair_plan import PieceRepair, Text, plan_repair

MIN_CARRY = 8  # a shorter shared run of the record is fed again (a splice has a fixed cost)


@dataclass(slots=True)
class TurnCounts:
    """The tokens of one turn's notebook, by how they got there."""

    kept: int = 0  # the last notebook's prefix, kept as it is
    fed: int = 0  # run through the model (prefilled)
    spliced: int = 0  # compiled notes spliced in (a repaired part included)
    repaired: int = 0  # spliced notes recomputed in context
    selected: int = 0  # token-equivalents spent choosing which notes to repair
    compiled: int = 0  # tokens of skills compiled during the turn (anchor included)
    carried: int = 0  # the record's last-turn notes, spliced where it now sits

    @property
    def computed(self) -> int:
        """Tokens of model work this build did."""
        return self.fed + self.repaired + self.selected + self.compiled

    @property
    def reused(self) -> int:
        """Notes reused rather than computed: kept, spliced (less the repaired) and carried."""
        return self.kept + self.spliced - self.repaired + self.carried


@dataclass(frozen=True, slots=True)
class Built:
    """A turn's notebook, the logits after its last token, how many leading notes are exact
    and how its tokens got there."""

    notebook: Notebook
    logits: torch.Tensor
    exact: int
    counts: TurnCounts


def carried_record(old: Notebook | None, part: Part) -> Notebook | None:
    """The last turn's notes of the record for the leading ids it still shares with ``part``
    (this turn's record), when at least :data:`MIN_CARRY` are shared; else None (the record is
    prefilled). They were written behind the last turn's skills, so once spliced behind other
    ones they are not exact."""
    if old is None or part.piece.name != "record":
        return None
    span = old.span("record")  # every notebook a build makes has one
    common = common_prefix(old.token_ids[span.start:span.end].tolist(), part.ids)
    return old.slice(span.start, span.start + common) if common >= MIN_CARRY else None


class _Builder:
    """The notebook under construction: text waits in ``pending`` until a splice (or the end)
    needs the notebook, so consecutive text is fed in one forward."""

    def __init__(self, engine: Engine, notebook: Notebook, counts: TurnCounts) -> None:
        self.engine = engine
        self.nb = notebook
        self.counts = counts
        self.pending: list[int] = []
        self.logits: torch.Tensor | None = None

    def feed(self, ids: list[int]) -> None:
        self.pending += ids

    def flush(self) -> None:
        if not self.pending:
            return
        step = self.engine.forward(self.nb, self.pending)
        self.nb, self.logits = step.notebook, step.logits
        self.counts.fed += len(self.pending)
        self.pending = []

    def splice_carried(self, notes: Notebook) -> None:
        self.flush()
        self.nb = self.nb.splice(notes)
        self.counts.carried += len(notes)
        self.logits = None

    def splice_skill(self, got: AnchoredNotes, part: Part, repair: PieceRepair | None,
                     config: AgentConfig) -> None:
        """Splice ``got`` (the notes of ``part``) and do its planned repair (None: spliced as
        it is, exactly placed)."""
        self.flush()
        if got.compiled:  # compiled during the turn: it counts as computed
            self.counts.compiled += len(got.anchor) + len(part.ids)
        self.nb = self.nb.splice(got.notes)  # re-rotated to follow nb (moved only when it must be)
        if repair is not None:
            self.nb, cost = execute_piece_repair(self.engine, self.nb, repair,
                                                 select=config.select, layer=config.select_layer)
            self.counts.selected += int(cost)
            self.counts.repaired += repair.repaired
        self.counts.spliced += len(part.ids)
        self.logits = None


def _skill_part(part: Part, got: AnchoredNotes) -> LayoutPiece:
    """A spliced part as the repair plan sees it: where and behind what it was compiled."""
    return LayoutPiece(len(part.ids), int(got.notes.positions[0]), tuple(part.ids),
                       prefix_len=len(got.anchor), prefix_digest=prefix_digest(got.anchor))


def build(engine: Engine, plan: TurnPlan, old: Notebook | None, exact: int, anchors: Anchors,
          config: AgentConfig) -> Built:
    """The notebook of ``plan`` after ``old`` (whose notes ``[0, exact)`` are exact)."""
    layout, keep = plan.layout, plan.keep
    flat = layout.token_ids
    # the turn laid out for its repair plan: the kept notes (exact up to ``exact``), then each
    # part from ``keep`` on as it will be made (fed, carried or spliced)
    exact = min(exact, keep)
    parts: list[LayoutPart] = [Text(n, tuple(flat[a:b]), exact=a < exact)
                               for a, b, n in ((0, exact, exact), (exact, keep, keep - exact)) if n]
    steps: list[tuple[int, Part, AnchoredNotes | Notebook | None]] = []
    for i, part in enumerate(layout.parts):
        if part.end <= keep:
            continue
        if part.piece.spliced:
            notes = anchors.notes(part.piece, plan.anchors.get(i))
            steps.append((len(parts), part, notes))
            parts.append(_skill_part(part, notes))
            continue
        carried = (carried_record(old, part) if config.carry_record and part.start >= keep
                   else None)
        steps.append((len(parts), part, carried))
        fed = part.ids[max(0, keep - part.start):]
        if carried is not None:  # the record's old notes (its leading ids) spliced, not exact
            parts.append(Text(len(carried), tuple(fed[:len(carried)]), exact=False))
            fed = fed[len(carried):]
        if fed:
            parts.append(Text(len(fed), tuple(fed)))
    todo = plan_repair(parts, config.repair_plan)
    repairs = todo.by_index()
    # one store sized for the whole prompt: the kept notes are copied once (the old notebook
    # is never written), and every splice and feed after them writes in place
    nb = engine.empty(0, capacity=len(flat) + 64)
    if old is not None and keep:
        nb = Notebook.concat([nb, old.slice(0, keep)])
    b = _Builder(engine, nb, TurnCounts(kept=keep))
    for index, part, made in steps:
        if isinstance(made, AnchoredNotes):
            b.splice_skill(made, part, repairs.get(index), config)
        elif made is None:
            b.feed(part.ids[max(0, keep - part.start):])
        else:
            b.splice_carried(made)
            b.feed(part.ids[len(made):])
    b.flush()
    assert b.logits is not None, "the last piece is text, fed every turn"
    return Built(b.nb.with_spans(layout.spans()), b.logits, todo.exact_prefix(parts), b.counts)
