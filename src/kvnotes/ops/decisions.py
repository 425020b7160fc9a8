"""Decisions at the decision position: an answer's first token, a constrained choice, parsing.

Without chain of thought the decision is the answer whose first token has the highest logit;
with ``cot=True`` the model reasons greedily up to a budget and the answer is parsed from text.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvnotes.core import validate
from kvnotes.core.engine import Engine
from kvnotes.core.errors import AnswerTokenError, EmptyAnswerError
from kvnotes.core.notebook import Notebook


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


def margin_of(scores: Sequence[float]) -> float:
    """Best score minus the runner-up's (nan for fewer than two scores)."""
    top = sorted(scores, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("nan")


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
           parse: Callable[[str], str | None] | None = None) -> Decision:
    """The model's decision after ``query`` on top of ``nb``.

    Without CoT: the answer whose first token has the highest logit at the decision position
    (first tokens by :func:`first_token_ids`, after the query). With CoT: greedy
    decoding up to ``budget`` tokens, then ``parse(text)`` (default :func:`parse_answer`).
    """
    t0 = time.perf_counter()
    ids = first_token_ids(engine, answers, after=query)
    q_ids, q_spans = engine.tokens_of(query, bos=False, kind="query", name="query")
    step = engine.forward(nb, q_ids, spans=q_spans)
    logits = step.logits
    first_seconds = time.perf_counter() - t0
    scores = {a: float(logits[i]) for a, i in zip(answers, ids, strict=True)}
    margin = margin_of(list(scores.values()))
    if not cot:
        answer = max(answers, key=lambda a: scores[a])
        return Decision(answer, scores, margin, logits, "", first_seconds, first_seconds)
    first = logits
    text = engine.continue_greedy(step.notebook, logits, budget).text
    answer = (parse or (lambda t: parse_answer(t, answers)))(text)
    return Decision(answer, scores, margin, first, text, first_seconds,
                    time.perf_counter() - t0)


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
