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
from typing import Any

import torch

from kvnotes.apps.agent.episodes import REQUESTS, Request
from kvnotes.apps.agent.prompt import DECISION, Piece, Prompt
from kvnotes.apps.agent.skills import SkillBook
from kvnotes.apps.agent.state import Event, State, label
from kvnotes.apps.agent.toolcall import TOOL_CALL_PREFIX, ToolCall, parse_tool_call
from kvnotes.core.chat import ChatFormat
from kvnotes.core.engine import COMPOSE_SELECTORS, Engine, repair_budget
from kvnotes.core.errors import KvnotesError, UnknownNameError
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
    flops: float = 0.0  # arithmetic of every model call this turn (kvnotes.core.work)
    guard_flops: float = 0.0  # the part spent by the decision guard's recompute

    def to_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "kind": self.kind, "choice": self.decision.answer,
                "scores": self.decision.scores, "margin": self.decision.margin,
                "guard": self.decision.guard.to_dict() if self.decision.guard else None,
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


UPDATES = ("rewrite", "errata", "ignore")
FIXED_SKILLS = ("tools",)  # loaded first in every episode, right after the header
ORDERS = ("request", "loaded", "appended")
MIN_CARRY = 8  # a shorter shared run of the record is fed again (a splice has a fixed cost)
_PROBE = Request("x", (), ("a", "b"))


class _Agent:
    """What both agents share: skills, the prompt layout, the state and the history."""

    name = "agent"
    updates = "rewrite"

    def __init__(self, engine: Engine, skills: SkillBook, *, tool_calls: bool = False,
                 max_tool_tokens: int = 48, history: int | None = 0,
                 order: str = "request") -> None:
        if skills.engine is not engine:
            raise KvnotesError("the skill book was made for another engine; make one per engine")
        if history is not None and (isinstance(history, bool) or not isinstance(history, int)
                                    or history < 0):
            raise KvnotesError(f"history must be a number of past exchanges >= 0 or None (all), "
                               f"got {history!r}")
        self.engine = engine
        self.skills = skills
        self.prompt = Prompt(ChatFormat.from_tokenizer(engine.tokenizer))
        self.tool_calls = tool_calls
        self.max_tool_tokens = max_tool_tokens
        self.history = history
        if order not in ORDERS:
            raise UnknownNameError("skill order", order, ORDERS)
        self.order = order
        self.erratum_template = DEFAULT_ERRATUM
        self.state: State | None = None
        self.turns: list[TurnResult] = []
        self._opening: list[str] = []  # the skills loaded at turn 0 (see start())

    @property
    def fixed_skills(self) -> list[str]:
        """Skills every prompt opens with (right after the header)."""
        return [s for s in FIXED_SKILLS if s in self.skills.names]

    def start(self, state: State) -> None:
        """Begin an episode with ``state`` as the customer record."""
        self.state = state
        self._shown = state  # the record as written (the first one unless updates="rewrite")
        self._errata: list[tuple[str, str]] = []
        self._exchanges: list[tuple[int, Request, str]] = []
        self._loaded: list[str] = []
        self._opening: list[str] = []  # anchors later skills ("loaded", "appended")
        self.turns = []
        self._start()

    def _start(self) -> None:
        pass

    def _check(self, request: Request, events: Sequence[Event]) -> None:
        if self.state is None:
            raise KvnotesError("call start(state) before the first turn")
        for name in request.skills:
            self.skills.check(name)

    def _advance(self, request: Request, events: Sequence[Event]) -> list[Piece]:
        """Apply ``events`` and load ``request``'s skills; the pieces of this turn's prompt."""
        assert self.state is not None
        index = len(self.turns)
        for e in events:
            old = self.state[e.field]
            self.state = self.state.apply([e])
            if self.updates == "errata" and old != e.value:
                self._errata.append((f"t{index}.erratum.{e.field}",
                                     erratum_turn(self.engine, label(e.field).lower(), old,
                                                  e.value, template=self.erratum_template)))
        if self.updates == "rewrite":
            self._shown = self.state
        wanted = [*self.fixed_skills, *request.skills] if index == 0 else list(request.skills)
        self._loaded += [s for s in dict.fromkeys(wanted)
                         if s in self.skills.names and s not in self._loaded]
        if index == 0:
            self._opening = list(self._loaded)  # what the system block opens with for good
        skills, later = self._loaded, None
        if self.order == "request":  # fixed skills, the request's own, then the others loaded
            first = [s for s in dict.fromkeys([*self.fixed_skills, *request.skills])
                     if s in self._loaded]
            skills = first + [s for s in self._loaded if s not in first]
        elif self.order == "appended":  # turn 0's skills, the record, then later ones
            skills, later = self._opening, self._loaded[len(self._opening):]
        kept = (self._exchanges if self.history is None
                else self._exchanges[len(self._exchanges) - self.history:] if self.history
                else [])
        return self.prompt.pieces(skills=skills, record=self._shown.render(),
                                  errata=self._errata, history=kept, request=request,
                                  turn=index, later=later)

    def _ids(self, piece: Piece) -> list[int]:
        """The token ids of one piece (a skill's: exactly those its notes hold)."""
        if piece.kind == "skill":
            return self.skills.token_ids(piece.text)
        return self.engine.encode(piece.text)

    def _tool_call(self, nb: Notebook, request: Request, decision: Decision
                   ) -> tuple[ToolCall | None, int]:
        if not (self.tool_calls and request.tool and decision.answer in request.acts):
            return None, 0
        gen = self.engine.greedy(nb, f" {decision.answer}" + TOOL_CALL_PREFIX, self.max_tool_tokens,
                                 stop=("}}", "\n"))
        raw = TOOL_CALL_OPEN + gen.text
        return parse_tool_call(raw, expected=request.tool), len(gen.notebook) - len(nb) + 1

    def _record(self, request: Request, events: Sequence[Event], decision: Decision,
                tool: ToolCall | None, latency: float, computed: int, reused: int,
                length: int, flops: float, guard_flops: float = 0.0) -> TurnResult:
        index = len(self.turns)
        assert decision.answer is not None
        self._exchanges.append((index, request, decision.answer))
        result = TurnResult(index, request.kind, decision, tool, latency, computed, reused,
                            length, tuple(events), flops, guard_flops)
        self.turns.append(result)
        return result

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        """Apply ``events`` to the record, then decide on ``request``."""
        raise NotImplementedError


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KvnotesAgent(_Agent):
    """Reuses every note that is still valid, splices precompiled skills, and prefills only the
    rest, reading the same prompt as the recompute agent (:meth:`Prompt.pieces`).

    Per turn it lays out the whole prompt, keeps its notebook up to the first token that differs
    from it (notes there depend on those tokens alone: the kept prefix is what a prefix cache
    would reuse, exactly), then rebuilds the rest in as few forwards as the splices allow: text
    (a rewritten record's tail, the kept exchanges, the request) is prefilled in place, skills
    are re-rotated and spliced. A state change is therefore applied exactly, as a rewrite of
    the record from the changed field on; the only difference from recompute left is the
    splice (a skill's notes never attended to the skills spliced before it).

    ``repair``: after splicing a skill that is not already exact, recompute its first tokens in
    context (an int: that many tokens per skill; a float in (0, 1]: that fraction of each
    skill), as :meth:`Engine.compose`'s ``repair=`` does (:meth:`Engine.recompute`).

    ``anchored`` compiles every skill behind the text that really precedes it where that text
    is fixed: ``tools`` behind the system header, the request's own skills (which open the skill
    block with ``order="request"``) behind the header, ``tools`` and the request's earlier
    skills. Those are spliced exactly where they were compiled, so their notes equal a
    recompute's; :meth:`prepare` compiles them all once per model (a skill compiled during a
    turn counts as computed).

    ``variants`` (with ``anchored``, the default) compiles every other skill behind the fixed
    run that opens the prompt, one variant per opening: the header, ``tools`` and the
    request's own skills with ``order="request"``, or turn 0's skills with ``"loaded"`` and
    ``"appended"``. The first such skill then sits exactly where it was compiled (except in
    ``"appended"``, where the record comes before it) and each later one misses only the other
    skills before it (and the record, in ``"appended"``). The variants are the same for the
    three layouts: on SmolLM2-135M 71 of them, about 3 minutes and 1.2 GB once per model.
    ``variants=False`` compiles every other skill behind the header and ``tools`` only: a
    faster first start, and about twice the splice error.

    ``guard=tau`` makes each decision know when it is not sure: when the margin between the two
    best options is below ``tau`` and some note is not exact, the notes from the first inexact
    one on are recomputed (:func:`kvnotes.ops.decisions.guarded`), the decision is taken again
    on them (it is then the recompute agent's, up to float error) and the agent goes on with
    the exact notes; ``decision.guard`` says whether it fired and what it cost (in the turn's
    latency and tokens).

    ``carry_record`` (the default) composes the conversation's own state too: when the skills
    before the record change (a request of another kind reorders them, a new skill is loaded),
    the record is not prefilled again but its last-turn notes are re-rotated and spliced (the
    leading ids it still shares; a rewritten tail is prefilled after them). A turn then feeds
    little more than its request (about 60 tokens instead of 140 on SmolLM2), at the price of
    a record whose notes saw the last turn's skills: not exact, so the guard recomputes from
    it on.
    ``carry_record=False`` prefills the record again whenever it moves.

    ``updates``: ``"rewrite"`` (the default) writes the current record; ``"errata"`` keeps the
    first record and appends a correction per state change (``erratum_template`` names a wording
    of :data:`kvnotes.ops.edit.ERRATUM_TEMPLATES`), an ablation whose prompt differs from the
    recompute agent's; ``"ignore"`` keeps the first record (the stale-record ablation).
    ``errata=False`` is the old spelling of ``updates="ignore"``. ``history``: past exchanges
    kept in the prompt (see :mod:`kvnotes.apps.agent.prompt`).

    Example:
        >>> agent = KvnotesAgent(engine, SkillBook(engine))          # doctest: +SKIP
        >>> agent.start(episode.state)                                # doctest: +SKIP
        >>> agent.turn(episode.turns[0].request).decision.answer      # doctest: +SKIP
        'travel credit'
    """

    name = "kvnotes"

    def __init__(self, engine: Engine, skills: SkillBook, *, updates: str = "rewrite",
                 errata: bool = True, erratum_template: str = DEFAULT_ERRATUM,
                 anchored: bool = True, variants: bool = True, guard: float | None = None,
                 repair: float | int = 0,
                 select: str = "first", select_layer: int = 1,
                 carry_record: bool = True, **options: Any) -> None:
        super().__init__(engine, skills, **options)
        if not isinstance(carry_record, bool):
            raise KvnotesError(f"carry_record must be True or False, got {carry_record!r}")
        self.carry_record = carry_record
        if updates not in UPDATES:
            raise UnknownNameError("state update mode", updates, UPDATES)
        self.updates = updates if errata else "ignore"
        self.erratum_template = erratum_template
        self.after = self.prompt.head() if anchored else None  # what skills are compiled behind
        self.variants = variants and anchored  # other skills behind the prompt's opening
        # skills that open every prompt (right after the header) are compiled behind the header;
        # every other skill behind the header and those (the fixed part of every prompt), so the
        # skill spliced right after them is exact and later ones saw the text before them
        self.fixed = [s for s in FIXED_SKILLS if s in skills.names] if anchored else []
        self._anchors: dict[str, list[int]] = {"header": engine.anchor_ids(None)}
        if self.after is not None:
            head = engine.anchor_ids(self.after)
            fixed = head + [i for s in self.fixed for i in skills.token_ids(s)]
            self._anchors.update({s: head for s in self.fixed})
            self._anchors.update({s: fixed for s in skills.names if s not in self.fixed})
        self.guard = guard
        repair_budget(repair, 1)  # validated here, not at the first splice
        self.repair = repair
        if select not in COMPOSE_SELECTORS:
            raise UnknownNameError("repair selector", select, COMPOSE_SELECTORS)
        self.select, self.select_layer = select, select_layer
        self.notebook: Notebook | None = None
        self._exact = 0  # notes [0, _exact) equal a recompute's: the guard redoes only the rest

    def _start(self) -> None:
        self.notebook = None
        self._exact = 0

    def _notes(self, piece: Piece, anchor: list[int] | None = None
               ) -> tuple[Notebook, list[int]]:
        """A spliced piece's compiled notes and the token ids they were compiled behind:
        ``anchor`` when given (the skill's true prefix), else the agent's default."""
        if piece.kind == "header":
            return self.skills.header(piece.text), self._anchors["header"]
        if self.after is None:
            return self.skills.notes(piece.text), self.engine.anchor_ids(None)
        if piece.text in self.fixed:
            return self.skills.notes(piece.text, after=self.after), self._anchors[piece.text]
        anchor = self._anchors[piece.text] if anchor is None else anchor
        return self.skills.notes(piece.text, after=anchor), anchor

    def _lead_anchors(self, flat: list[int], parts: list[tuple[list[int], Piece]],
                      request_skills: Sequence[str], opening: Sequence[str] | None = None
                      ) -> dict[int, list[int]]:
        """Part index -> the prefix its notes are compiled behind, where that is not the
        agent's default: the current request's skills in the run of spliced pieces that opens
        the prompt (header, fixed skills, then the request's own) map to exactly what precedes
        them, so they splice exactly. With ``variants`` every other skill maps to the opening:
        that lead run (``request`` layout), or turn 0's skills (``loaded``: everything before
        the first skill loaded later; ``appended``: everything before the record).
        ``opening``: the skills loaded at turn 0 (default: this episode's)."""
        out: dict[int, list[int]] = {}
        if self.after is None:
            return out
        at = 0
        for i, (ids, p) in enumerate(parts):
            if p.kind == "header" or (p.kind == "skill" and p.text in self.fixed):
                pass
            elif p.kind == "skill" and p.text in request_skills:
                out[i] = flat[:at]
            elif p.name != "bos":
                break
            at += len(ids)
        if not self.variants:
            return out
        opening = self._opening if opening is None else opening
        behind: list[int] | None = flat[:at] if self.order == "request" else None
        at = 0
        for i, (ids, p) in enumerate(parts):
            if self.order == "appended" and p.name == "record":
                behind = flat[:at]
            elif (self.order == "loaded" and behind is None and p.kind == "skill"
                  and opening and p.text not in opening):
                behind = flat[:at]
            if p.kind == "skill" and behind is not None and i not in out \
                    and p.text not in self.fixed:
                out[i] = behind  # one variant per opening, as prepare() compiles them
            at += len(ids)
        return out

    def prepare(self, requests: Sequence[Request] | None = None, *,
                progress: Callable[[int, int, str, bool], None] | None = None) -> int:
        """Compile (or load) what this agent splices, so that no turn compiles: the header,
        every skill behind the default anchor, and each request kind's skills behind their
        true prefix (``requests``: default one of each kind in :data:`REQUESTS`); with
        ``variants`` also every other skill behind each of those openings (on SmolLM2-135M: 71
        more entries, the same for the three layouts, about 3 minutes and 1.2 GB once per
        model). ``progress(done, total, name, compiled)`` is called after
        each entry (``compiled``: it was not in the library yet). Returns how many entries
        were compiled."""
        todo: list[tuple[Piece, list[int] | None]] = [(Piece("header", "header", ""), None)]
        todo += [(Piece("skill", name, name), None) for name in self.skills.names]
        for skills in ([r.skills for r in requests] if requests is not None
                       else [spec[1] for spec in REQUESTS.values()]):
            loaded = list(dict.fromkeys([*self.fixed, *skills]))
            # every other skill may later follow this opening (and the record, when appended)
            others = [n for n in self.skills.names if n not in loaded] if self.variants else []
            pieces = (self.prompt.pieces(skills=loaded + others, record="", request=_PROBE,
                                         turn=0) if self.order in ("loaded", "request") else
                      self.prompt.pieces(skills=loaded, record="", request=_PROBE, turn=0,
                                         later=others if self.order == "appended" else None))
            parts = self._parts(pieces)
            flat = [i for ids, _ in parts for i in ids]
            todo += [(parts[i][1], anchor) for i, anchor
                     in self._lead_anchors(flat, parts, skills, opening=loaded).items()]
        compiled = 0
        for done, (piece, anchor) in enumerate(todo, 1):
            misses = self.skills.library.misses
            if piece.kind == "header":
                self.skills.header(self.prompt.head())
            else:
                self._notes(piece, anchor)
            fresh = self.skills.library.misses > misses
            compiled += fresh
            if progress is not None:
                progress(done, len(todo), piece.name, fresh)
        return compiled

    def _parts(self, pieces: list[Piece]) -> list[tuple[list[int], Piece]]:
        parts = [([self.engine.bos_id], Piece("text", "bos", ""))] if self.engine.adds_bos else []
        return parts + [(self._ids(p), p) for p in pieces]

    def _carried(self, old: Notebook | None, piece: Piece, ids: list[int]) -> Notebook | None:
        """With ``carry_record``, the last turn's notes of the record for the leading ids it
        still shares with this turn's (``ids``), when at least :data:`MIN_CARRY` are shared;
        else None (the piece is prefilled). They were written behind the last turn's skills,
        so once spliced behind other ones they are not exact."""
        if old is None or not self.carry_record or piece.name != "record":
            return None
        span = old.span("record")  # every notebook _build makes has one
        common = _common_prefix(old.token_ids[span.start:span.end].tolist(), ids)
        return old.slice(span.start, span.start + common) if common >= MIN_CARRY else None

    def _build(self, pieces: list[Piece], request: Request
               ) -> tuple[Notebook, torch.Tensor, dict[str, int]]:
        """The notebook of ``pieces``: the old one's valid prefix, then splices and prefills.
        Returns it, the logits after its last token and the counts (kept, fed, spliced,
        repaired); ``self._exact`` is updated."""
        engine = self.engine
        parts = self._parts(pieces)
        flat = [i for ids, _ in parts for i in ids]
        lead = self._lead_anchors(flat, parts, request.skills)
        old = self.notebook
        cut = _common_prefix(old.token_ids.tolist(), flat) if old is not None else 0
        cut = min(cut, len(flat) - 1)  # at least the last token is fed: its logits decide
        spans: list[Span] = []
        at = 0
        for ids, p in parts:  # a splice is kept whole or redone whole
            if p.spliced and at < cut < at + len(ids):
                cut = at
            spans.append(Span(p.name, p.kind if p.kind in ("skill", "erratum", "query")
                              else "skill" if p.kind == "header" else "text",
                              at, at + len(ids)))
            at += len(ids)
        # one store sized for the whole prompt: the kept notes are copied once (the old
        # notebook is never written), and every splice and feed after them writes in place
        nb = engine.empty(0, capacity=len(flat) + 64)
        if old is not None and cut:
            nb = Notebook.concat([nb, old.slice(0, cut)])
        exact = min(self._exact, cut)
        counts = {"kept": cut, "fed": 0, "spliced": 0, "repaired": 0, "selected": 0,
                  "compiled": 0, "carried": 0}
        pending: list[int] = []
        logits: torch.Tensor | None = None

        def flush() -> None:
            nonlocal nb, exact, logits, pending
            if pending:
                step = engine.forward(nb, pending)
                if exact == len(nb):  # text fed on exact notes is exact
                    exact = len(step.notebook)
                nb, logits = step.notebook, step.logits
                counts["fed"] += len(pending)
                pending = []

        at = 0
        for i, (ids, p) in enumerate(parts):
            start, at = at, at + len(ids)
            if at <= cut:
                continue
            if not p.spliced:
                carried = self._carried(old, p, ids) if start >= cut else None
                if carried is None:
                    pending += ids[max(0, cut - start):]
                    continue
                flush()  # the piece's old notes (its leading ids) spliced, the rest fed
                nb = nb.splice(carried)
                counts["carried"] += len(carried)
                pending += ids[len(carried):]
                logits = None
                continue
            flush()
            misses = self.skills.library.misses
            notes, anchor = self._notes(p, lead.get(i))
            if self.skills.library.misses > misses:  # compiled in this turn: it counts
                counts["compiled"] += len(anchor) + len(ids)
            n0 = len(nb)
            nb = nb.splice(notes)  # re-rotated to follow nb (moved only when it must be)
            in_place = (exact == n0 and int(notes.positions[0]) == n0
                        and flat[:n0] == anchor)
            if in_place:  # compiled behind exactly what precedes it, where it now sits
                exact = len(nb)
            else:
                k = repair_budget(self.repair, len(ids))
                chosen, cost = engine.repair_choice(nb, n0, k, select=self.select,
                                                    layer=self.select_layer)
                counts["selected"] += int(cost)
                if chosen:
                    nb = engine.recompute(nb, chosen)
                    counts["repaired"] += k
                    if exact == n0 and chosen[-1] == n0 + k - 1:  # the skill's first k tokens
                        exact = n0 + k
            counts["spliced"] += len(ids)
            logits = None
        flush()
        assert logits is not None, "the last piece is text, fed every turn"
        self._exact = exact
        return nb.with_spans(spans), logits, counts

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request, events)
        work = self.engine.work.snapshot()
        t0 = time.perf_counter()
        pieces = self._advance(request, events)
        nb, logits, counts = self._build(pieces, request)
        fed = nb
        before_guard = self.engine.work.snapshot()
        decision, nb = guarded(  # decide_on(fed) reuses the logits the feed already has
            self.engine, nb, lambda n: choose(self.engine, n, logits if n is fed else
                                              self.engine.next_logits(n), request.options),
            tau=self.guard, exact_from=self._exact)
        guard_flops = self.engine.work.since(before_guard)[2]
        if decision.guard and decision.guard.fired:
            self._exact = len(nb)
        tool, tool_tokens = self._tool_call(nb, request, decision)
        latency = time.perf_counter() - t0
        self.notebook = nb
        redone = decision.guard.tokens if decision.guard else 0
        spliced = counts["spliced"] - counts["repaired"]
        return self._record(request, events, decision, tool, latency,
                            counts["fed"] + counts["repaired"] + counts["selected"]
                            + counts["compiled"] + tool_tokens
                            + redone,
                            counts["kept"] + spliced + counts["carried"], len(nb),
                            self.engine.work.since(work)[2], guard_flops)


class RecomputeAgent(_Agent):
    """The reference: every turn the whole prompt (the same pieces as the kvnotes agent's, with
    the current record) prefilled from scratch in one forward; nothing reused."""

    name = "recompute"
    notebook: Notebook | None = None  # the last turn's prompt, prefilled

    def turn(self, request: Request, events: Sequence[Event] = ()) -> TurnResult:
        self._check(request, events)
        work = self.engine.work.snapshot()
        t0 = time.perf_counter()
        ids = [self.engine.bos_id] if self.engine.adds_bos else []
        for piece in self._advance(request, events):
            ids += self._ids(piece)
        step = self.engine.forward(self.engine.empty(0), ids)  # one forward over everything
        self.notebook = step.notebook
        decision = choose(self.engine, step.notebook, step.logits, request.options)
        tool, tool_tokens = self._tool_call(step.notebook, request, decision)
        latency = time.perf_counter() - t0
        return self._record(request, events, decision, tool, latency, len(ids) + tool_tokens,
                            0, len(ids), self.engine.work.since(work)[2])


def run_episode(agent: _Agent, state: State, turns: Sequence[Any]) -> list[TurnResult]:
    """Run one scripted episode (turns with ``request`` and ``events``) with ``agent``."""
    agent.start(state)
    return [agent.turn(t.request, t.events) for t in turns]
