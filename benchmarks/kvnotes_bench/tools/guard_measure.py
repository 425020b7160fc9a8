"""Requests of the development sets read both ways in the engine: composed (skills compiled
behind the header, spliced, a repair) and exact (the same token ids prefilled), each with the
first answer token's logits and a greedy continuation.

A request (:class:`Request`) is a header, skills and a tail: BFCL's question and the call
opening ``{"name": "`` (``live_multiple``, ``multi_turn``: the decision is the function name
the answer writes), or an airline customer's message (the front's airline prompts: no
decision, tokens compared). :func:`read` builds a strategy's notes and answers;
:func:`guard_case` turns a composed and an exact reading into the
:class:`~kvnotes_bench.tools.guard_calib.GuardCase` the calibration reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.notebook import Notebook
from kvnotes_bench.tools.data import load_cases, spread
from kvnotes_bench.tools.guard_calib import GuardCase
from kvnotes_bench.tools.prompt import CasePrompt, case_prompt
from kvnotes_bench.tools.strategies import SkillCache, Strategy, repair_of, variants

GUARD_SETS = ("live_multiple", "multi_turn", "airline")
GREEDY_TOKENS = 16
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Request:
    """One development request: ``prompt``'s header, skills (spliced) and tail (``question``
    then ``query``, computed on top); ``decides``: whether the answer names a function."""

    id: str
    set: str
    prompt: CasePrompt
    decides: bool

    def tail(self, engine: Engine) -> list[int]:
        ids = engine.encode(self.prompt.question)
        return [*ids, *engine.encode(self.prompt.query)] if self.prompt.query else ids


# ``(n, k, seed)`` -> airline prompts as parts (header, k policies, the customer's message):
# ``kvnotes_bench.serving.prompt_sets.make_requests``, given by the caller (that package
# imports this one)
AirlinePrompts = Callable[[int, int, int], list[list[str]]]


def requests(engine: Engine, set_name: str, n: int, *, max_context: int = 2048,
             seed: int = 0, k: int = 4, airline: AirlinePrompts | None = None
             ) -> list[Request]:
    """Requests of a development set: ``n`` BFCL cases spread over the file, less those longer
    than ``max_context`` tokens (as ``bench tools`` picks and skips them), or ``n`` airline prompts (the
    agent's header, ``k`` of its policies in random order, a customer's message)."""
    if set_name not in GUARD_SETS:
        raise InvalidArgumentError(f"unknown development set {set_name!r}; use one of "
                                   f"{', '.join(GUARD_SETS)}")
    if set_name == "airline":
        if airline is None:
            raise InvalidArgumentError("the airline set needs its prompt maker: pass "
                                       "airline=kvnotes_bench.serving.prompt_sets.make_requests")
        out = []
        for i, parts in enumerate(airline(n, k, seed)):
            prompt = CasePrompt(parts[0], tuple(parts[1:-1]), parts[-1], "")
            out.append(Request(f"airline-{i}", "airline", prompt, False))
        return out
    found = []
    for case in spread(load_cases(set_name), n):  # the cases ``bench tools --cases n`` meets
        prompt = case_prompt(engine.tokenizer, case)
        req = Request(case.id, set_name, prompt, True)
        if len(skill_ids(engine, prompt)[0]) + len(req.tail(engine)) + GREEDY_TOKENS \
                <= max_context:
            found.append(req)
    return found


def skill_ids(engine: Engine, prompt: CasePrompt) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt's ids up to its last skill, as compose lays them out (BOS when the tokenizer
    adds one, each part encoded on its own), and each skill's ``[start, end)`` in them."""
    ids = [engine.bos_id] if engine.adds_bos and engine.bos_id is not None else []
    ids += engine.encode(prompt.header)
    spans = []
    for text in prompt.skills:
        part = engine.encode(text)
        spans.append((len(ids), len(ids) + len(part)))
        ids += part
    return [int(i) for i in ids], spans


@dataclass(slots=True)
class Reading:
    """A strategy's notes for one request (up to the last skill), the tail fed on them, the
    first answer token's logits and the greedy continuation (filled by :func:`decode`)."""

    notes: Notebook
    step: Notebook
    logits: torch.Tensor
    greedy: list[int]

    @property
    def margin(self) -> float:
        """Top-1 minus top-2 log-prob of the first answer token (the logits' gap)."""
        top = torch.topk(self.logits.float(), 2).values
        return float(top[0] - top[1])

    @property
    def first(self) -> int:
        return int(self.logits.argmax())


def notes_of(engine: Engine, req: Request, strategy: Strategy, skills: SkillCache) -> Notebook:
    """``req``'s notes up to its last skill by ``strategy`` (exact, or composed)."""
    if strategy.kind == "exact":
        return engine.prefill(skill_ids(engine, req.prompt)[0])
    if strategy.kind != "compose" or strategy.temperature != 1.0 or strategy.engine_default:
        raise InvalidArgumentError(f"strategy {strategy.name!r}: the guard's measurements take "
                                   "exact or a composed strategy with a repair (epic:K, "
                                   "pred+epic:K, first:F, ...)")
    compiled = [skills.get(v) for v in variants(req.prompt, strategy)]
    return engine.compose([req.prompt.header, *compiled], repair=repair_of(strategy))


def read(engine: Engine, req: Request, notes: Notebook) -> Reading:
    """The tail fed on ``notes``: the first answer token's logits (no decode yet)."""
    step = engine.forward(notes, req.tail(engine))
    return Reading(notes, step.notebook, step.logits, [])


def decode(engine: Engine, readings: Sequence[Reading], n: int = GREEDY_TOKENS) -> None:
    """Each reading's greedy continuation, ``n`` tokens, each decoded alone: a batch's shape
    changes the float rounding, and a near-tie could then part two rows whose notes agree."""
    for r in readings:
        r.greedy = [int(t) for t in engine.continue_greedy(r.step, r.logits, n).token_ids[:n]]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two continuations differ (None: identical).

    Example:
        >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2])
        (2, None)
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def named(engine: Engine, ids: Sequence[int]) -> str:
    """The function name an answer written after ``{"name": "`` names (its text up to the
    closing quote; the whole text when it has none)."""
    return engine.decode(list(ids)).partition('"')[0].strip()


def guard_case(engine: Engine, req: Request, composed: Reading, exact: Reading) -> GuardCase:
    """The calibration's record of one request (see :class:`GuardCase`)."""
    stats = composed.notes.meta.get("compose", {})
    ids, spans = skill_ids(engine, req.prompt)
    tail = len(req.tail(engine))
    spliced = sum(b - a for a, b in spans)
    repaired = int(stats.get("repaired", 0))
    margin = composed.margin
    return GuardCase(
        id=req.id, set=req.set, margin=margin if math.isfinite(margin) else math.nan,
        exact_margin=exact.margin, first_same=composed.first == exact.first,
        greedy_same=composed.greedy == exact.greedy,
        choice_same=(named(engine, composed.greedy) == named(engine, exact.greedy)
                     if req.decides else None),
        tokens=len(ids) + tail, spliced=spliced, repaired=repaired,
        prefix=spans[0][0] if spans else len(ids))
