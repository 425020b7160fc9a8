"""How an agent reads its prompt and builds its notes: one frozen, validated dataclass.

Both agents take the same :class:`AgentConfig`, so a benchmark that gives them one config has
them read the same prompt; the recompute agent reads only the prompt's fields (``order``,
``history``, ``tool_calls``, ``max_tool_tokens``) and always writes the current record.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass

from kvnotes.core import validate
from kvnotes.core.errors import InvalidArgumentError, KvnotesError, UnknownNameError
from kvnotes.core.records import Json
from kvnotes.core.repair import Repair, as_repair, repair_selector
from kvnotes.ops.edit import DEFAULT_ERRATUM, erratum_text

UPDATES = ("rewrite", "errata", "ignore")
ORDERS = ("request", "loaded", "appended")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """An agent's settings; every field is checked when the config is made.

    Args:
        order: skill order in the system block (:mod:`kvnotes.apps.agent.prompt`):
            ``"request"`` (the request's own skills first), ``"loaded"`` (load order) or
            ``"appended"`` (skills loaded after turn 0 come after the record).
        history: past exchanges kept in the prompt (an int >= 0), or None for all of them.
        tool_calls: after a decision that acts, write a tool call and validate it.
        max_tool_tokens: the most tokens a tool call is given.
        updates: how the record follows state changes: ``"rewrite"`` writes the current record
            (the recompute agent's prompt); ``"errata"`` keeps the first record and appends a
            correction per change, worded by ``erratum_template`` (a name of
            :data:`kvnotes.ops.edit.ERRATUM_TEMPLATES` or a format string with ``{new}``);
            ``"ignore"`` keeps the first record (the stale-record ablation).
        anchored: compile each skill behind the text that really precedes it where that text
            is fixed (the header, ``tools``, the request's own skills), so those splice exactly.
        variants: with ``anchored``, also compile every other skill behind each opening of the
            prompt (about 70 library entries on SmolLM2-135M, compiled once per model; what
            they cost and buy: docs/guide/agent.md). Without ``anchored`` it has no effect.
        guard: re-decide on exactly recomputed notes when the top-two margin (log-prob) is
            below this and some note is inexact (:func:`kvnotes.ops.decisions.guarded`); None:
            never.
        repair: which notes of the skills spliced where they are not exact are recomputed in
            context, as ``engine.compose``'s ``repair=`` reads it
            (:func:`~kvnotes.core.repair.as_repair`): an int ``K`` each such skill's first
            ``K`` tokens, a float in (0, 1] that fraction of their tokens shared among them
            and chosen by ``select``; 0 none.
        select: which spliced tokens a fraction ``repair`` recomputes, a compose selector of
            :data:`kvnotes.core.repair.REPAIR_SELECTORS` (``"first"`` or ``"kv_deviation"``,
            :meth:`Engine.repair_choice`); ``select_layer``: the layer ``kv_deviation`` reads.
        carry_record: when the skills before the record change, splice the record's last-turn
            notes (re-rotated) instead of prefilling it again: faster turns, record notes that
            are not exact (the guard recomputes from them on).

    Example:
        >>> AgentConfig(order="appended", guard=0.25).guard
        0.25
        >>> try:
        ...     AgentConfig(order="random")
        ... except UnknownNameError as err:
        ...     print(err)
        unknown skill order 'random'; valid skill orders: request, loaded, appended
    """

    order: str = "request"
    history: int | None = 0
    tool_calls: bool = False
    max_tool_tokens: int = 48
    updates: str = "rewrite"
    erratum_template: str = DEFAULT_ERRATUM
    anchored: bool = True
    variants: bool = True
    guard: float | None = None
    repair: float | int = 0
    select: str = "first"
    select_layer: int = 1
    carry_record: bool = True

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise UnknownNameError("skill order", self.order, ORDERS)
        if self.history is not None and (isinstance(self.history, bool)
                                         or not isinstance(self.history, int)
                                         or self.history < 0):
            raise KvnotesError(f"history must be a number of past exchanges >= 0 or None (all), "
                               f"got {self.history!r}")
        for name in ("tool_calls", "anchored", "variants", "carry_record"):
            validate.flag(getattr(self, name), name)
        validate.integer(self.max_tool_tokens, "max_tool_tokens", minimum=1)
        if self.updates not in UPDATES:
            raise UnknownNameError("state update mode", self.updates, UPDATES)
        erratum_text("field", "old", "new", template=self.erratum_template)  # fails when unusable
        if self.guard is not None and (isinstance(self.guard, bool)
                                       or not isinstance(self.guard, numbers.Real)
                                       or not self.guard >= 0):
            raise InvalidArgumentError(f"guard must be a margin >= 0 (log-prob) or None (no "
                                       f"guard), got {self.guard!r}")
        as_repair(self.repair)  # the check compose's repair= makes
        repair_selector(self.select, "compose")
        if self.select != "first" and isinstance(self.repair, int) and self.repair:
            raise InvalidArgumentError(
                f"repair={self.repair} recomputes each skill's first {self.repair} tokens; "
                f"select={self.select!r} chooses a fraction's tokens: give repair as a float "
                "in (0, 1], or select='first'")
        validate.integer(self.select_layer, "select_layer", minimum=0)

    @property
    def repair_plan(self) -> Repair:
        """``repair`` and ``select`` as the :class:`~kvnotes.core.repair.Repair` a turn runs."""
        plan = as_repair(self.repair)
        return Repair(plan.first, plan.align, plan.skip_exact, plan.budget, self.select)

    @property
    def uses_variants(self) -> bool:
        """Whether other skills are compiled behind each opening (needs ``anchored``)."""
        return self.variants and self.anchored

    def to_dict(self) -> Json:
        out: Json = asdict(self)  # every setting is a plain JSON value
        return out
