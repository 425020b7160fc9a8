"""The two agents: the kvnotes agent (splice skills, append errata, grow one notebook) and the
recompute agent (prefill everything from scratch each turn), with the same decision rule.

A decision is a constrained choice among the request's options at the decision position (after
``Decision:``): each option is scored by its log-probability, and the best one wins. When the
decision acts (the request's ``acts``), the agent may then write a tool call, which is parsed
and validated (:mod:`kvnotes.apps.agent.toolcall`); a malformed call is reported, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvnotes.apps.agent.episodes import Request
from kvnotes.apps.agent.prompt import DECISION, Prompt
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.apps.agent.state import Event, State, label
from kvnotes.apps.agent.toolcall import TOOL_CALL_PREFIX, ToolCall, parse_tool_call
from kvnotes.core.chat import ChatFormat
from kvnotes.core.engine import Engine
from kvnotes.core.errors import KvnotesError
from kvnotes.core.notebook import Notebook, Span
from kvnotes.ops.decisions import Decision, answer_ids, guarded
from kvnotes.ops.edit import DEFAULT_ERRATUM, erratum_turn

TOOL_CALL_OPEN = '{"tool": "'


@dataclass(frozen=True, slots=True)
class TurnResult:
    """What one agent did in one turn, and what it cost."""

    turn: int
    kind: str
    decision: Decision
    tool_call: ToolCall | None
    latency_s: float  # request (and pending state changes) in -> decision (and tool call) out
    tokens_computed: int  # tokens run through the model this turn
    tokens_reused: int  # notes reused: the notebook kept from before + spliced skills
    notebook_len: int
    events: tuple[Event, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "kind": self.kind, "choice": self.decision.answer,
                "scores": self.decision.scores, "margin": self.decision.margin,
                "guard": self.decision.guard.to_dict() if self.decision.guard else None,
                "tool_call": self.tool_call.to_dict() if self.tool_call else None,
                "latency_s": self.latency_s, "tokens_computed": self.tokens_computed,
                "tokens_reused": self.tokens_reused, "notebook_len": self.notebook_len,
                "events": [[e.field, e.value] for e in self.events]}


def choose(engine: Engine, nb: Notebook, logits: torch.Tensor, options: Sequence[str]) -> Decision:
    """Constrained choice: the option with the highest log-probability after ``nb``.

    ``logits`` are the next-token logits at the decision position. Options whose first tokens
    differ are scored by that token alone, so the choice costs no forward beyond the one that
    produced ``logits``; otherwise every option is scored by the sum of its tokens'
    log-probabilities, one forward per option (:meth:`Engine.probe`, which keeps nothing, so
    ``nb`` is still extended in place afterwards).
    """
    ids = [answer_ids(engine, o, after=DECISION) for o in options]
    logp = torch.log_softmax(logits.double(), dim=-1)
    firsts = [i[0] for i in ids]
    if len(set(firsts)) == len(firsts):
        scores = [float(logp[f]) for f in firsts]
    else:
        scores = []
        for option_ids in ids:
            total = float(logp[option_ids[0]])
            if len(option_ids) > 1:  # row k-1: the log-probs after option_ids[:k]
                rows = torch.log_softmax(engine.probe(nb, option_ids[:-1]).double(), dim=-1)
                total += sum(float(rows[k - 1, option_ids[k]]) for k in range(1, len(option_ids)))
            scores.append(total)
    order = sorted(range(len(options)), key=lambda i: -scores[i])
    margin = scores[order[0]] - scores[order[1]]
    return Decision(options[order[0]], dict(zip(options, scores, strict=True)), margin)


class _Agent:
    """What both agents share: skills, prompt pieces, the state and the history."""

    name = "agent"

    def __init__(self, engine: Engine, skills: SkillBook, *, tool_calls: bool = False,
                 max_tool_tokens: int = 48) -> None:
        if skills.engine is not engine:
            raise KvnotesError("the skill book was made for another engine; make one per engine")
        self.engine = engine
        self.skills = skills
        self.prompt = Prompt(ChatFormat.from_tokenizer(engine.tokenizer))
        self.tool_calls = tool_calls
        self.max_tool_tokens = max_tool_tokens
        self.state: State | None = None
        self.turns: list[TurnResult] = []

    def start(self, state: State) -> None:
        """Begin an episode with ``state`` as the customer record."""
        self.state = state
        self.turns = []
        self._start()

    def _start(self) -> None:
        raise NotImplementedError

    def _check(self, request: Request, events: Sequence[Event]) -> None:
        if self.state is None:
            raise KvnotesError("call start(state) before the first turn")
        for name in request.skills:
            self.skills.check(name)

    def _tool_call(self, nb: Notebook, request: Request, decision: Decision
                   ) -> tuple[ToolCall | None, int]:
        if not (self.tool_calls and request.tool and decision.answer in request.acts):
            return None, 0
        gen = self.engine.greedy(nb, f" {decision.answer}" + TOOL_CALL_PREFIX, self.max_tool_tokens,
                                 stop=("}}", "\n"))
        raw = TOOL_CALL_OPEN + gen.text
        return parse_tool_call(raw, expected=request.tool), len(gen.notebook) - len(nb) + 1

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        """Apply ``events`` to the record, then decide on ``request``."""
        raise NotImplementedError


class KvnotesAgent(_Agent):
    """Composes precompiled skills by splicing, applies state changes as errata, and grows one
    notebook append-only across turns (so a serving prefix cache stays aligned).

    Per turn, the text it must compute (the previous answer, one erratum per state change, the
    policy opener, the request and decision cue) is fed in as few forwards as the splices
    allow: one when no new skill is needed, two otherwise. Each piece keeps its own span
    (errata are ``kind="erratum"`` spans named ``t{turn}.erratum.{field}``).

    ``erratum_template`` names a wording of :data:`kvnotes.ops.edit.ERRATUM_TEMPLATES` (or is a
    format string). ``errata=False`` is an ablation: the agent ignores state changes (a stale record).

    ``anchored`` compiles every skill behind the agent's real header (``after=`` the system
    header every notebook opens with), so a spliced skill's notes were written attending to
    the text that really precedes it. ``guard=tau`` makes each decision know when it is not
    sure: when the margin between the two best options is below ``tau``, the notebook is
    recomputed exactly from its tokens, the decision is taken again on it, and the agent goes
    on with the exact notes (``decision.guard`` says whether it fired; the recompute is in the
    turn's latency and tokens).

    Example:
        >>> agent = KvnotesAgent(engine, SkillBook(engine))          # doctest: +SKIP
        >>> agent.start(episode.state)                                # doctest: +SKIP
        >>> agent.turn(episode.turns[0].request).decision.answer      # doctest: +SKIP
        'travel credit'
    """

    name = "kvnotes"

    def __init__(self, engine: Engine, skills: SkillBook, *, errata: bool = True,
                 erratum_template: str = DEFAULT_ERRATUM, anchored: bool = True,
                 guard: float | None = None, **options: Any) -> None:
        super().__init__(engine, skills, **options)
        self.errata = errata
        self.erratum_template = erratum_template
        self.after = self.prompt.head() if anchored else None  # what skills are compiled behind
        self.guard = guard
        self.notebook: Notebook | None = None
        self._loaded: list[str] = []
        self._pending: str | None = None  # the previous answer, written at the next turn
        self._exact = 0  # notes [0, _exact) equal a recompute's: the guard redoes only the rest

    def _start(self) -> None:
        self.notebook = None
        self._loaded = []
        self._pending = None
        self._exact = 0

    def _feed(self, nb: Notebook, pieces: list[tuple[str, str, str]], *, decide: bool
              ) -> tuple[Notebook, torch.Tensor | None]:
        """Prefill ``(text, kind, name)`` pieces on top of ``nb`` in one forward, each piece
        tokenized alone and given its own span; with ``decide``, also the next-token logits."""
        ids: list[int] = []
        spans: list[Span] = []
        for text, kind, name in pieces:
            piece = self.engine.encode(text)
            spans.append(Span(name, kind, len(nb) + len(ids), len(nb) + len(ids) + len(piece)))
            ids += piece
        if decide:
            step = self.engine.forward(nb, ids)
            longer, logits = step.notebook, step.logits
        else:
            longer, logits = self.engine.extend(nb, ids), None
        return longer.with_spans([*nb.spans, *spans]), logits

    def _splice(self, nb: Notebook, names: Sequence[str]) -> Notebook:
        """Compiled skills re-rotated to follow ``nb`` and spliced on, in one concatenation."""
        parts = [nb]
        for name in names:
            parts.append(self.skills.notes(name, after=self.after)
                         .moved_to(parts[-1].next_position))
            self._loaded.append(name)
        return Notebook.concat(parts, meta=nb.meta)

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request, events)
        assert self.state is not None
        index = len(self.turns)
        t0 = time.perf_counter()
        pieces: list[tuple[str, str, str]] = []
        if self.notebook is None:  # first turn: header and skills spliced, then the record
            first = [s for s in dict.fromkeys(["tools", *request.skills]) if s in self.skills.names]
            header = self.skills.header(self.prompt.head())
            nb = self.engine.compose([header, *(self.skills.notes(s, after=self.after)
                                                for s in first)])
            self._loaded = list(first)
            before, spliced = 0, int(nb.meta["compose"]["reused"])
            # exact so far: BOS, the header (a skill at its own positions) and, when anchored
            # behind that header, the first skill (spliced exactly where it was compiled)
            exact = int(self.engine.adds_bos) + len(header)
            if self.after is not None and first:
                exact += len(self.skills.notes(first[0], after=self.after))
            clean = exact == len(nb)
            pieces.append((self.prompt.record(self.state.render()), "text", "record"))
            close_policy = False
        else:
            nb = self.notebook
            before, spliced = len(nb), 0
            exact, clean = self._exact, self._exact == len(nb)
            if self._pending:
                pieces.append((self._pending, "text", f"t{index - 1}.answer"))
            for e in events:
                old = self.state[e.field]
                self.state = self.state.apply([e])
                if self.errata and old != e.value:
                    text = erratum_turn(self.engine, label(e.field).lower(), old, e.value,
                                        template=self.erratum_template)
                    pieces.append((text, "erratum", f"t{index}.erratum.{e.field}"))
            new = [s for s in dict.fromkeys(request.skills) if s not in self._loaded]
            close_policy = bool(new)
            if new:
                pieces.append((self.prompt.more_policy(), "text", f"t{index}.policy"))
                nb, _ = self._feed(nb, pieces, decide=False)
                pieces = []
                n0 = len(nb)
                nb = self._splice(nb, new)
                spliced += len(nb) - n0
                if clean:  # text fed on exact notes is exact; the spliced skills are not
                    exact, clean = n0, False
        pieces.append((self.prompt.query(request, close_policy=close_policy), "query",
                       f"t{index}.request"))
        nb, logits = self._feed(nb, pieces, decide=True)
        assert logits is not None
        if clean:
            exact = len(nb)
        fed = nb
        decision, nb = guarded(  # decide_on(fed) reuses the logits the feed already has
            self.engine, nb, lambda n: choose(self.engine, n, logits if n is fed else
                                              self.engine.next_logits(n), request.options),
            tau=self.guard, exact_from=exact)
        self._exact = len(nb) if decision.guard and decision.guard.fired else exact
        tool, tool_tokens = self._tool_call(nb, request, decision)
        latency = time.perf_counter() - t0
        self.notebook = nb
        self._pending = self.prompt.answer(decision.answer)
        computed = len(nb) - before - spliced
        redone = decision.guard.tokens if decision.guard else 0
        result = TurnResult(index, request.kind, decision, tool, latency,
                            computed + tool_tokens + redone, before + spliced, len(nb),
                            tuple(events))
        self.turns.append(result)
        return result


class RecomputeAgent(_Agent):
    """The reference: every turn prefilled from scratch with the current record written in
    place, the same skills at the same places, and the history; no errata, nothing reused."""

    name = "recompute"

    def _start(self) -> None:
        self._history: list[int] = []  # token ids after the record, through the last answer
        self._loaded: list[str] = []
        self._head: list[str] = []

    def _ids(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request, events)
        assert self.state is not None
        index = len(self.turns)
        t0 = time.perf_counter()
        self.state = self.state.apply(events)
        if index == 0:
            self._head = [s for s in dict.fromkeys(["tools", *request.skills])
                          if s in self.skills.names]
            self._loaded = list(self._head)
            turn_ids: list[int] = []
            close_policy = False
        else:
            new = [s for s in dict.fromkeys(request.skills) if s not in self._loaded]
            turn_ids = self._ids(self.prompt.more_policy()) if new else []
            for s in new:
                turn_ids += self.skills.token_ids(s)
            self._loaded += new
            close_policy = bool(new)
        turn_ids += self._ids(self.prompt.query(request, close_policy=close_policy))
        ids = [self.engine.bos_id] if self.engine.adds_bos else []
        ids += self._ids(self.prompt.head())
        for s in self._head:
            ids += self.skills.token_ids(s)
        ids += self._ids(self.prompt.record(self.state.render()))
        ids += self._history + turn_ids
        step = self.engine.forward(self.engine.empty(0), ids)  # one forward over everything
        decision = choose(self.engine, step.notebook, step.logits, request.options)
        tool, tool_tokens = self._tool_call(step.notebook, request, decision)
        latency = time.perf_counter() - t0
        self._history += turn_ids + self._ids(self.prompt.answer(decision.answer))
        result = TurnResult(index, request.kind, decision, tool, latency,
                            len(ids) + tool_tokens, 0, len(ids), tuple(events))
        self.turns.append(result)
        return result


def run_episode(agent: _Agent, state: State, turns: Sequence[Any]) -> list[TurnResult]:
    """Run one scripted episode (turns with ``request`` and ``events``) with ``agent``."""
    agent.start(state)
    return [agent.turn(t.request, t.events) for t in turns]
