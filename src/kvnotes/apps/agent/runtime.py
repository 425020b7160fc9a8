"""The two agents: the kvnotes agent (splice skills, reuse every note still valid, prefill the
rest) and the recompute agent (prefill everything from scratch each turn), with the same prompt
(:mod:`kvnotes.apps.agent.prompt`) and the same decision rule.

A decision is a constrained choice among the request's options at the decision position (after
``Decision:``): each option is scored by its log-probability, and the best one wins. When the
decision acts (the request's ``acts``), the agent may then write a tool call, which is parsed
and validated (:mod:`kvnotes.apps.agent.toolcall`); a malformed call is reported, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvnotes.apps.agent.build import build
from kvnotes.apps.agent.config import AgentConfig
from kvnotes.apps.agent.episodes import REQUESTS, Request, Turn
from kvnotes.apps.agent.layout import FIXED_SKILLS, Anchors, Layout
from kvnotes.apps.agent.prompt import DECISION, Piece, Prompt
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.apps.agent.state import Event, State, label
from kvnotes.apps.agent.toolcall import TOOL_CALL_PREFIX, ToolCall, parse_tool_call
from kvnotes.core.chat import ChatFormat
from kvnotes.core.engine import Engine
from kvnotes.core.errors import ArgumentTypeError, KvnotesError
from kvnotes.core.notebook import Notebook
from kvnotes.core.records import Json, checked
from kvnotes.ops.decisions import Decision, answer_ids, guarded
from kvnotes.ops.edit import erratum_turn

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
    tokens_reused: int  # notes reused: kept from the last turn, spliced skills, carried record
    notebook_len: int
    events: tuple[Event, ...] = field(default_factory=tuple)
    flops: float = 0.0  # arithmetic of every model call this turn (kvnotes.core.work)
    guard_flops: float = 0.0  # the part spent by the decision guard's recompute

    def to_dict(self) -> Json:
        """The turn as agent-bench's records hold it (the decision flattened, no logits)."""
        return {"turn": self.turn, "kind": self.kind, "choice": self.decision.answer,
                "scores": dict(self.decision.scores), "margin": self.decision.margin,
                "guard": checked(self.decision.guard.to_dict()) if self.decision.guard else None,
                "tool_call": self.tool_call.to_dict() if self.tool_call else None,
                "latency_s": self.latency_s, "tokens_computed": self.tokens_computed,
                "tokens_reused": self.tokens_reused, "notebook_len": self.notebook_len,
                "flops": self.flops, "guard_flops": self.guard_flops,
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


_PROBE = Request("x", (), ("a", "b"))


@dataclass(frozen=True, slots=True)
class WrittenCall:
    """A tool call written after a decision, and the tokens writing it cost."""

    call: ToolCall | None
    tokens: int = 0


class Agent:
    """What both agents share: skills, the prompt layout, the state and the history."""

    name = "agent"

    def __init__(self, engine: Engine, skills: SkillBook, config: AgentConfig | None = None
                 ) -> None:
        if skills.engine is not engine:
            raise KvnotesError("the skill book was made for another engine; make one per engine")
        self.config = AgentConfig() if config is None else config
        if not isinstance(self.config, AgentConfig):
            raise ArgumentTypeError(f"config must be an AgentConfig, got "
                                    f"{type(self.config).__name__}; pass AgentConfig(...) from "
                                    "kvnotes.apps.agent")
        self.engine = engine
        self.skills = skills
        self.prompt = Prompt(ChatFormat.from_tokenizer(engine.tokenizer))
        self.updates = "rewrite"  # the reference reads the current record; see KvnotesAgent
        self.state: State | None = None
        self.turns: list[TurnResult] = []
        self._shown: State | None = None  # the record as written (the first one unless rewritten)
        self._errata: list[tuple[str, str]] = []
        self._exchanges: list[tuple[int, Request, str]] = []
        self._loaded: list[str] = []
        self._opening: list[str] = []  # the skills loaded at turn 0: they anchor later ones

    @property
    def fixed_skills(self) -> list[str]:
        """Skills every prompt opens with (right after the header)."""
        return [s for s in FIXED_SKILLS if s in self.skills.names]

    def start(self, state: State) -> None:
        """Begin an episode with ``state`` as the customer record."""
        self.state = state
        self._shown = state
        self._errata = []
        self._exchanges = []
        self._loaded = []
        self._opening = []
        self.turns = []
        self._start()

    def _start(self) -> None:
        pass

    def _check(self, request: Request) -> None:
        if self.state is None:
            raise KvnotesError("call start(state) before the first turn")
        for name in request.skills:
            self.skills.check(name)

    def _advance(self, request: Request, events: Sequence[Event]) -> list[Piece]:
        """Apply ``events`` and load ``request``'s skills; the pieces of this turn's prompt."""
        assert self.state is not None and self._shown is not None
        index = len(self.turns)
        for e in events:
            old = self.state[e.field]
            self.state = self.state.apply([e])
            if self.updates == "errata" and old != e.value:
                self._errata.append((f"t{index}.erratum.{e.field}",
                                     erratum_turn(self.engine, label(e.field).lower(), old,
                                                  e.value,
                                                  template=self.config.erratum_template)))
        if self.updates == "rewrite":
            self._shown = self.state
        wanted = [*self.fixed_skills, *request.skills] if index == 0 else list(request.skills)
        self._loaded += [s for s in dict.fromkeys(wanted)
                         if s in self.skills.names and s not in self._loaded]
        if index == 0:
            self._opening = list(self._loaded)  # what the system block opens with for good
        skills, later = self._loaded, None
        order, history = self.config.order, self.config.history
        if order == "request":  # fixed skills, the request's own, then the others loaded
            first = [s for s in dict.fromkeys([*self.fixed_skills, *request.skills])
                     if s in self._loaded]
            skills = first + [s for s in self._loaded if s not in first]
        elif order == "appended":  # turn 0's skills, the record, then later ones
            skills, later = self._opening, self._loaded[len(self._opening):]
        kept = (self._exchanges if history is None
                else self._exchanges[len(self._exchanges) - history:] if history
                else [])
        return self.prompt.pieces(skills=skills, record=self._shown.render(),
                                  errata=self._errata, history=kept, request=request,
                                  turn=index, later=later)

    def _ids(self, piece: Piece) -> list[int]:
        """The token ids of one piece (a skill's: exactly those its notes hold)."""
        if piece.kind == "skill":
            return self.skills.token_ids(piece.text)
        return self.engine.encode(piece.text)

    def _tool_call(self, nb: Notebook, request: Request, decision: Decision) -> WrittenCall:
        if not (self.config.tool_calls and request.tool and decision.answer in request.acts):
            return WrittenCall(None)
        gen = self.engine.greedy(nb, f" {decision.answer}" + TOOL_CALL_PREFIX,
                                 self.config.max_tool_tokens, stop=("}}", "\n"))
        raw = TOOL_CALL_OPEN + gen.text
        return WrittenCall(parse_tool_call(raw, expected=request.tool),
                           len(gen.notebook) - len(nb) + 1)

    def _record(self, result: TurnResult, request: Request) -> TurnResult:
        assert result.decision.answer is not None
        self._exchanges.append((result.turn, request, result.decision.answer))
        self.turns.append(result)
        return result

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        """Apply ``events`` to the record, then decide on ``request``."""
        raise NotImplementedError


class KvnotesAgent(Agent):
    """Reuses every note that is still valid, splices precompiled skills, and prefills only the
    rest, reading the same prompt as the recompute agent (:meth:`Prompt.pieces`).

    Per turn it lays out the whole prompt, keeps its notebook up to the first token that differs
    from it (notes there depend on those tokens alone: the kept prefix is what a prefix cache
    would reuse, exactly), then rebuilds the rest in as few forwards as the splices allow: text
    (a rewritten record's tail, the kept exchanges, the request) is prefilled in place, skills
    are re-rotated and spliced (:mod:`kvnotes.apps.agent.build`). A state change is therefore
    applied exactly, as a rewrite of the record from the changed field on; the only difference
    from recompute left is the splice (a skill's notes never attended to the skills spliced
    before it).

    How it does so is its :class:`AgentConfig`:

    * ``anchored`` compiles every skill behind the text that really precedes it where that text
      is fixed: ``tools`` behind the system header, the request's own skills (which open the
      skill block with ``order="request"``) behind the header, ``tools`` and the request's
      earlier skills. Those are spliced exactly where they were compiled, so their notes equal
      a recompute's; :meth:`prepare` compiles them all once per model (a skill compiled during a
      turn counts as computed).
    * ``variants`` (with ``anchored``) compiles every other skill behind the fixed run that
      opens the prompt, one variant per opening: the header, ``tools`` and the request's own
      skills with ``order="request"``, or turn 0's skills with ``"loaded"`` and ``"appended"``.
      The first such skill then sits exactly where it was compiled (except in ``"appended"``,
      where the record comes before it) and each later one misses only the other skills before
      it. The variants are the same for the three layouts: on SmolLM2-135M 71 of them, compiled
      once per model. Without variants every other skill is compiled behind the header and
      ``tools`` only: a faster first start and a larger splice error (measured figures:
      docs/results/areas/agent.md).
    * ``repair``: after splicing a skill that is not already exact, recompute its first tokens
      in context, as :meth:`Engine.compose`'s ``repair=`` does (:meth:`Engine.recompute`).
    * ``guard=tau`` makes each decision know when it is not sure: when the margin between the
      two best options is below ``tau`` and some note is not exact, the notes from the first
      inexact one on are recomputed (:func:`kvnotes.ops.decisions.guarded`), the decision is
      taken again on them (it is then the recompute agent's, up to float error) and the agent
      goes on with the exact notes; ``decision.guard`` says whether it fired and what it cost
      (in the turn's latency and tokens).
    * ``carry_record`` composes the conversation's own state too: when the skills before the
      record change (a request of another kind reorders them, a new skill is loaded), the
      record is not prefilled again but its last-turn notes are re-rotated and spliced (the
      leading ids it still shares; a rewritten tail is prefilled after them). A turn then feeds
      little more than its request (about 60 tokens instead of 140 on SmolLM2), at the price of
      a record whose notes saw the last turn's skills: not exact, so the guard recomputes from
      it on.
    * ``updates``: ``"rewrite"`` writes the current record; ``"errata"`` keeps the first record
      and appends a correction per state change, an ablation whose prompt differs from the
      recompute agent's; ``"ignore"`` keeps the first record (the stale-record ablation).

    Example:
        >>> import tempfile
        >>> from kvnotes.apps.agent import scripted_episode
        >>> book = SkillBook(engine, tempfile.mkdtemp())  # default folder: the kvnotes home's
        >>> agent = KvnotesAgent(engine, book, AgentConfig(guard=0.25, variants=False))
        >>> episode = scripted_episode(0, turns=2)
        >>> agent.start(episode.state)
        >>> first = agent.turn(episode.turns[0].request, episode.turns[0].events)
        >>> first.decision.answer in episode.turns[0].request.options
        True
        >>> second = agent.turn(episode.turns[1].request, episode.turns[1].events)
        >>> second.tokens_reused > 0 and second.decision.guard.tau  # notes kept or spliced, guarded
        0.25
    """

    name = "kvnotes"

    def __init__(self, engine: Engine, skills: SkillBook, config: AgentConfig | None = None
                 ) -> None:
        super().__init__(engine, skills, config)
        self.updates = self.config.updates
        self.anchors = Anchors(engine, skills, self.prompt, self.config)
        self.notebook: Notebook | None = None
        self.exact = 0  # notes [0, exact) equal a recompute's: the guard redoes only the rest

    def _start(self) -> None:
        self.notebook = None
        self.exact = 0

    def _layout(self, pieces: Sequence[Piece]) -> Layout:
        return Layout.of(self.engine, pieces, self._ids)

    def prepare(self, requests: Sequence[Request] | None = None, *,
                progress: Callable[[int, int, str, bool], None] | None = None) -> int:
        """Compile (or load) what this agent splices, so that no turn compiles: the header,
        every skill behind the default anchor, and each request kind's skills behind their
        true prefix (``requests``: default one of each kind in :data:`REQUESTS`); with
        ``variants`` also every other skill behind each of those openings (on SmolLM2-135M: 71
        more entries, the same for the three layouts, compiled once per model: docs/guide/agent.md
        says how long). ``progress(done, total, name, compiled)`` is called after each entry
        (``compiled``: it was not in the library yet). Returns how many entries were compiled."""
        anchors = self.anchors
        todo: list[tuple[Piece, list[int] | None]] = [
            (Piece("header", "header", self.prompt.head()), None)]
        todo += [(Piece("skill", name, name), None) for name in self.skills.names]
        for skills in ([r.skills for r in requests] if requests is not None
                       else [spec[1] for spec in REQUESTS.values()]):
            loaded = list(dict.fromkeys([*anchors.fixed, *skills]))
            # every other skill may later follow this opening (and the record, when appended)
            others = [n for n in self.skills.names if n not in loaded] if anchors.variants else []
            order = self.config.order
            pieces = (self.prompt.pieces(skills=loaded + others, record="", request=_PROBE,
                                         turn=0) if order in ("loaded", "request") else
                      self.prompt.pieces(skills=loaded, record="", request=_PROBE, turn=0,
                                         later=others if order == "appended" else None))
            layout = self._layout(pieces)
            todo += [(layout.parts[i].piece, anchor) for i, anchor
                     in anchors.lead(layout, skills, opening=loaded).items()]
        compiled = 0
        for done, (piece, anchor) in enumerate(todo, 1):
            fresh = anchors.notes(piece, anchor).compiled
            compiled += fresh
            if progress is not None:
                progress(done, len(todo), piece.name, fresh)
        return compiled

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request)
        engine, config = self.engine, self.config
        work = engine.work.snapshot()
        t0 = time.perf_counter()
        layout = self._layout(self._advance(request, events))
        plan = self.anchors.plan(layout, self.notebook, request.skills, self._opening)
        built = build(engine, plan, self.notebook, self.exact, self.anchors, config)
        before_guard = engine.work.snapshot()
        decision, nb = guarded(  # decide_on(fed) reuses the logits the feed already has
            engine, built.notebook,
            lambda n: choose(engine, n, built.logits if n is built.notebook else
                             engine.next_logits(n), request.options),
            tau=config.guard, exact_from=built.exact)
        guard_work = engine.work.since(before_guard)
        fired = decision.guard is not None and decision.guard.fired
        self.exact = len(nb) if fired else built.exact
        tool = self._tool_call(nb, request, decision)
        latency = time.perf_counter() - t0
        self.notebook = nb
        redone = decision.guard.tokens if decision.guard else 0
        counts = built.counts
        return self._record(TurnResult(
            len(self.turns), request.kind, decision, tool.call, latency,
            tokens_computed=counts.computed + tool.tokens + redone,
            tokens_reused=counts.reused, notebook_len=len(nb), events=tuple(events),
            flops=engine.work.since(work).flops, guard_flops=guard_work.flops), request)


class RecomputeAgent(Agent):
    """The reference: every turn the whole prompt (the same pieces as the kvnotes agent's, with
    the current record) prefilled from scratch in one forward; nothing reused. Of its
    :class:`AgentConfig` it reads the prompt's fields (``order``, ``history``, ``tool_calls``,
    ``max_tool_tokens``)."""

    name = "recompute"
    notebook: Notebook | None = None  # the last turn's prompt, prefilled

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request)
        engine = self.engine
        work = engine.work.snapshot()
        t0 = time.perf_counter()
        ids = [engine.bos_id] if engine.bos_id is not None else []  # the model adds one
        for piece in self._advance(request, events):
            ids += self._ids(piece)
        step = engine.forward(engine.empty(0), ids)  # one forward over everything
        self.notebook = step.notebook
        decision = choose(engine, step.notebook, step.logits, request.options)
        tool = self._tool_call(step.notebook, request, decision)
        latency = time.perf_counter() - t0
        return self._record(TurnResult(
            len(self.turns), request.kind, decision, tool.call, latency,
            tokens_computed=len(ids) + tool.tokens, tokens_reused=0, notebook_len=len(ids),
            events=tuple(events), flops=engine.work.since(work).flops), request)


def run_episode(agent: Agent, state: State, turns: Sequence[Turn]) -> list[TurnResult]:
    """Run one scripted episode (turns with ``request`` and ``events``) with ``agent``."""
    agent.start(state)
    return [agent.turn(t.request, t.events) for t in turns]
