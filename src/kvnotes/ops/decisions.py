"""Decisions at the decision position: an answer's first token, a constrained choice, parsing.

Without chain of thought the decision is the answer whose first token has the highest logit;
with ``cot=True`` the model reasons greedily up to a budget and the answer is parsed from text.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvnotes.core import validate
from kvnotes.core.errors import AnswerTokenError, EmptyAnswerError, InvalidArgumentError
from kvnotes.core.notebook import Notebook

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine


@dataclass(frozen=True, slots=True)
class Guard:
    """What a decision guard did (see :func:`guarded`).

    The decision read from reused notes (a composed or edited notebook) has margin
    ``fast_margin``; below ``tau`` the guard ``fired`` and the decision was taken again on notes
    recomputed exactly from the same tokens, at the cost of ``tokens`` tokens and ``seconds``.
    """

    tau: float
    fired: bool
    fast_answer: str | None
    fast_margin: float
    exact_answer: str | None = None  # the re-decision's answer when the guard fired
    tokens: int = 0
    seconds: float = 0.0

    @property
    def changed(self) -> bool:
        """The exact re-decision differs from the fast one (what the guard caught)."""
        return self.fired and self.fast_answer != self.exact_answer

    def to_dict(self) -> dict[str, object]:
        return {"tau": self.tau, "fired": self.fired, "fast_answer": self.fast_answer,
                "fast_margin": self.fast_margin, "exact_answer": self.exact_answer,
                "changed": self.changed, "tokens": self.tokens, "seconds": self.seconds}


@dataclass(frozen=True, slots=True)
class Decision:
    """A decision read at the decision position: the answer, every choice's score, the margin.

    ``scores`` maps each answer choice to its score: :func:`decide` uses the logit of the
    choice's first token, the agent's constrained choice its log-probability. ``margin`` is the
    best score minus the runner-up's. With CoT, ``answer`` is parsed from ``text`` and may
    differ from the best-scoring choice (or be None when the text names none).
    """

    answer: str | None
    scores: dict[str, float]
    margin: float
    logits: torch.Tensor | None = None  # FloatTensor[vocab] at the decision position
    text: str = ""
    first_seconds: float = 0.0  # feeding the query: time to the first token's logits
    seconds: float = 0.0  # everything, reasoning included
    guard: Guard | None = None  # set when the decision was guarded (``guard=``)


def margin_of(scores: Sequence[float]) -> float:
    """Best score minus the runner-up's (nan for fewer than two scores)."""
    top = sorted(scores, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("nan")


def guarded(engine: Engine, nb: Notebook, decide_on: Callable[[Notebook], Decision], *,
            tau: float | None, extra_tokens: int = 0, exact_from: int = 0
            ) -> tuple[Decision, Notebook]:
    """A decision that knows when it is not sure: ``decide_on(nb)``, and when its margin is
    below ``tau``, ``decide_on`` again on ``nb``'s notes recomputed exactly from its tokens.

    ``nb`` holds reused notes (spliced skills, errata, kept turns) whose decision is close to
    but not always that of a recompute; a margin under ``tau`` marks the near-ties where a
    small splice error can flip the choice, and those (only those) pay for a recompute
    (:meth:`Engine.recompute` of every token: exact up to float error). ``extra_tokens``: what
    ``decide_on`` feeds on top of ``nb`` (a query), counted in the guard's cost when it fires.
    ``tau=None`` decides once, unguarded. A decision with no runner-up (margin nan) is never
    re-decided. ``exact_from``: the notes before this index already equal a recompute's (an
    exact prefix, a header skill spliced at its own position), so only the rest is recomputed;
    when it is ``len(nb)`` the fast decision is exact and nothing is redone. Returns the
    decision (with :class:`Guard` in ``decision.guard``) and the
    notebook it was read from (the recomputed one when the guard fired).
    """
    fast = decide_on(nb)
    if tau is None:
        return fast, nb
    if not tau >= 0:
        raise InvalidArgumentError(f"guard tau must be a margin >= 0, got {tau!r}; "
                                   "give e.g. guard=0.5 (or None for no guard)")
    if not fast.margin < tau or exact_from >= len(nb):  # clear, nothing to compare, or exact
        return replace(fast, guard=Guard(tau, False, fast.answer, fast.margin)), nb
    t0 = time.perf_counter()
    exact_nb = engine.recompute(nb, range(max(0, exact_from), len(nb)))
    exact = decide_on(exact_nb)
    guard = Guard(tau, True, fast.answer, fast.margin, exact.answer,
                  len(nb) - max(0, exact_from) + extra_tokens, time.perf_counter() - t0)
    return replace(exact, guard=guard), exact_nb


# ---- the first token(s) of an answer --------------------------------------------------------------
def leading_space(after: str) -> bool:
    """The space rule: an answer written after ``after`` starts with one space, unless ``after``
    is empty or ends in whitespace (a chat template's assistant prefix ends in a newline;
    ``"Answer:"`` does not)."""
    return bool(after) and not after[-1].isspace()


def answer_ids(engine: Engine, answer: str, *, after: str) -> list[int]:
    """Token ids of ``answer`` as the model would write it right after the text ``after``.

    The answer's own leading whitespace is replaced by the :func:`leading_space` rule, so
    ``"yes"`` and ``" yes"`` give the same ids. Raises :class:`EmptyAnswerError` for an answer
    with no tokens.
    """
    text = answer.lstrip()
    ids = engine.encode((" " if leading_space(after) else "") + text) if text else []
    if not ids:
        raise EmptyAnswerError(f"answer {answer!r} has no tokens; decisions read an answer's "
                               "first token, so give non-empty answer choices")
    return ids


def first_token_ids(engine: Engine, answers: Sequence[str | int], *, after: str) -> list[int]:
    """The first token of each answer after ``after`` (ints are taken as token ids already).

    Raises :class:`AnswerTokenError` when two answers share a first token: a decision without
    CoT compares first-token logits and could not tell them apart.
    """
    validate.answers(engine, answers)
    firsts = [a if isinstance(a, int) else answer_ids(engine, a, after=after)[0] for a in answers]
    if len(set(firsts)) != len(firsts):
        shared = next(f for f in firsts if firsts.count(f) > 1)
        raise AnswerTokenError(
            f"answers {list(answers)} share their first token {engine.decode([shared])!r}; "
            "decisions without CoT compare first-token logits, so choose answers that start "
            "differently")
    return firsts


@torch.inference_mode()
def decide(engine: Engine, nb: Notebook, query: str, answers: Sequence[str], *,
           cot: bool = False, budget: int = 96,
           parse: Callable[[str], str | None] | None = None,
           guard: float | None = None) -> Decision:
    """The model's decision after ``query`` on top of ``nb``.

    Without CoT: the answer whose first token has the highest logit at the decision position
    (first tokens by :func:`first_token_ids`, after the query). With CoT: greedy
    decoding up to ``budget`` tokens, then ``parse(text)`` (default :func:`parse_answer`).
    ``guard=tau``: when the margin between the two best answers is below ``tau``, decide again
    on ``nb`` recomputed exactly (:func:`guarded`); ``decision.guard`` says whether it fired.
    """
    if guard is not None:
        n_query = len(engine.tokens_of(query, bos=False)[0])
        return guarded(engine, nb, lambda n: decide(engine, n, query, answers, cot=cot,
                                                    budget=budget, parse=parse),
                       tau=guard, extra_tokens=n_query)[0]
    t0 = time.perf_counter()
    ids = first_token_ids(engine, answers, after=query)
    q_ids, q_spans = engine.tokens_of(query, bos=False, kind="query", name="query")
    step = engine.forward(nb, q_ids, spans=q_spans)
    logits = step.logits
    first_seconds = time.perf_counter() - t0
    scores = {a: float(logits[i]) for a, i in zip(answers, ids, strict=True)}
    margin = margin_of(list(scores.values()))
    if not cot:
        best = max(answers, key=lambda a: scores[a])
        return Decision(best, scores, margin, logits, "", first_seconds, first_seconds)
    first = logits
    text = engine.continue_greedy(step.notebook, logits, budget).text
    parsed = (parse or (lambda t: parse_answer(t, answers)))(text)
    return Decision(parsed, scores, margin, first, text, first_seconds,
                    time.perf_counter() - t0)


@torch.inference_mode()
def decide_batch(engine: Engine, notebooks: Sequence[Notebook], query: str,
                 answers: Sequence[str], *, cot: bool = False, budget: int = 96,
                 parse: Callable[[str], str | None] | None = None) -> list[Decision]:
    """:func:`decide` on each notebook, the chains of thought decoded as one batch.

    The query is fed on each notebook alone (so each row's ``first_seconds`` is its own time to
    the first token, as with :func:`decide`); with ``cot=True`` the reasoning of every row is
    then decoded together by :meth:`Engine.continue_greedy_batch`, one forward per token for
    the batch, and each row's ``seconds`` is its first-token time plus an equal share of the batch's
    decode time. Each decision equals :func:`decide`'s up to float error (greedy text can part
    only on a near-tie of two tokens).
    """
    if not cot:
        return [decide(engine, nb, query, answers, budget=budget, parse=parse)
                for nb in notebooks]
    if not notebooks:
        return []
    ids = first_token_ids(engine, answers, after=query)
    q_ids, q_spans = engine.tokens_of(query, bos=False, kind="query", name="query")
    steps, firsts = [], []
    for nb in notebooks:
        t0 = time.perf_counter()
        steps.append(engine.forward(nb, q_ids, spans=q_spans))
        firsts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    texts = [c.text for c in engine.continue_greedy_batch([s.notebook for s in steps],
                                                 torch.stack([s.logits for s in steps]),
                                                 budget)]
    shared = (time.perf_counter() - t0) / len(steps)
    pick = parse or (lambda t: parse_answer(t, answers))
    out = []
    for step, text, first_seconds in zip(steps, texts, firsts, strict=True):
        scores = {a: float(step.logits[i]) for a, i in zip(answers, ids, strict=True)}
        out.append(Decision(pick(text), scores, margin_of(list(scores.values())), step.logits,
                            text, first_seconds, first_seconds + shared))
    return out


def parse_answer(text: str, answers: Sequence[str]) -> str | None:
    """The answer choice a model's text names: the first one (as a whole word, any case) after
    the last "answer:" / "answer is" in ``text``, else the first one anywhere in it; None when
    it names none. The one parser for CoT decisions, task cases and served responses.

    Example:
        >>> parse_answer("Yes at first, but the final answer: no.", ("yes", "no"))
        'no'
    """
    marks = list(re.finditer(r"answer\s*(?:is)?\s*[:\-]?", text, flags=re.IGNORECASE))
    tail = text[marks[-1].end():] if marks else text
    for segment in (tail, text):
        best: tuple[int, str] | None = None
        for a in answers:
            m = re.search(rf"(?<![\w]){re.escape(a)}(?![\w])", segment, flags=re.IGNORECASE)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), a)
        if best:
            return best[1]
    return None
