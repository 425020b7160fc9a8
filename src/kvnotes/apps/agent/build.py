"""The kvnotes agent's notebook for one turn, made from a :class:`~kvnotes.apps.agent.layout.TurnPlan`:
the kept prefix of the last notebook, then text prefilled in place and skills re-rotated and
spliced, in as few forwards as the splices allow.

Alongside the notes it tracks ``exact``: notes ``[0, exact)`` equal a recompute's (text fed on
exact notes is exact; a skill is exact where it sits behind exactly what it was compiled
behind), so the decision guard recomputes only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.layout import AnchoredNotes, Anchors, Part, TurnPlan, common_prefix
from kvnotes.core.engine import Engine, repair_budget
from kvnotes.core.notebook import Notebook

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

    def __init__(self, engine: Engine, notebook: Notebook, exact: int, counts: TurnCounts) -> None:
        self.engine = engine
        self.nb = notebook
        self.exact = exact
        self.counts = counts
        self.pending: list[int] = []
        self.logits: torch.Tensor | None = None

    def feed(self, ids: list[int]) -> None:
        self.pending += ids

    def flush(self) -> None:
        if not self.pending:
            return
        step = self.engine.forward(self.nb, self.pending)
        if self.exact == len(self.nb):  # text fed on exact notes is exact
            self.exact = len(step.notebook)
        self.nb, self.logits = step.notebook, step.logits
        self.counts.fed += len(self.pending)
        self.pending = []

    def splice_carried(self, notes: Notebook) -> None:
        self.flush()
        self.nb = self.nb.splice(notes)
        self.counts.carried += len(notes)
        self.logits = None

    def splice_skill(self, got: AnchoredNotes, part: Part, prefix: list[int],
                     config: AgentConfig) -> None:
        """Splice ``got`` (the notes of ``part``, whose prompt before it is ``prefix``); repair
        its first tokens when it is not exact where it lands."""
        self.flush()
        if got.compiled:  # compiled during the turn: it counts as computed
            self.counts.compiled += len(got.anchor) + len(part.ids)
        n0 = len(self.nb)
        self.nb = self.nb.splice(got.notes)  # re-rotated to follow nb (moved only when it must be)
        in_place = (self.exact == n0 and int(got.notes.positions[0]) == n0
                    and prefix == got.anchor)
        if in_place:  # compiled behind exactly what precedes it, where it now sits
            self.exact = len(self.nb)
        else:
            k = repair_budget(config.repair, len(part.ids))
            chosen, cost = self.engine.repair_choice(self.nb, n0, k, select=config.select,
                                                     layer=config.select_layer)
            self.counts.selected += int(cost)
            if chosen:
                self.nb = self.engine.recompute(self.nb, chosen)
                self.counts.repaired += k
                if self.exact == n0 and chosen[-1] == n0 + k - 1:  # the skill's first k tokens
                    self.exact = n0 + k
        self.counts.spliced += len(part.ids)
        self.logits = None


def build(engine: Engine, plan: TurnPlan, old: Notebook | None, exact: int, anchors: Anchors,
          config: AgentConfig) -> Built:
    """The notebook of ``plan`` after ``old`` (whose notes ``[0, exact)`` are exact)."""
    layout, keep = plan.layout, plan.keep
    flat = layout.token_ids
    # one store sized for the whole prompt: the kept notes are copied once (the old notebook
    # is never written), and every splice and feed after them writes in place
    nb = engine.empty(0, capacity=len(flat) + 64)
    if old is not None and keep:
        nb = Notebook.concat([nb, old.slice(0, keep)])
    b = _Builder(engine, nb, min(exact, keep), TurnCounts(kept=keep))
    for i, part in enumerate(layout.parts):
        if part.end <= keep:
            continue
        if part.piece.spliced:
            b.splice_skill(anchors.notes(part.piece, plan.anchors.get(i)), part,
                           flat[:part.start], config)
            continue
        carried = (carried_record(old, part) if config.carry_record and part.start >= keep
                   else None)
        if carried is None:
            b.feed(part.ids[max(0, keep - part.start):])
        else:  # the record's old notes (its leading ids) spliced, the rest fed
            b.splice_carried(carried)
            b.feed(part.ids[len(carried):])
    b.flush()
    assert b.logits is not None, "the last piece is text, fed every turn"
    return Built(b.nb.with_spans(layout.spans()), b.logits, b.exact, b.counts)
