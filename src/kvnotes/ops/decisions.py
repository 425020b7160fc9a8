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

from kvnotes.core.engine import Engine
from kvnotes.core.errors import KvnotesError
from kvnotes.core.notebook import Notebook


@dataclass(frozen=True, slots=True)
class Decision:
    """The decision read at the decision position (and, with CoT, the reasoning text)."""

    answer: str | None
    logits: torch.Tensor  # FloatTensor[vocab] at the decision position (first generated token)
    answer_logits: tuple[float, ...]  # first-token logit of each answer choice
    text: str = ""
    first_seconds: float = 0.0  # feeding the query: time to the first token's logits
    seconds: float = 0.0  # everything, reasoning included


def answer_token_ids(engine: Engine, answers: Sequence[str], *, leading_space: bool) -> list[int]:
    """The first token of each answer as it would follow the query; they must differ."""
    firsts = [engine.encode((" " if leading_space else "") + a)[0] for a in answers]
    if len(set(firsts)) != len(firsts):
        raise KvnotesError(f"answers {list(answers)} share a first token; decisions without CoT "
                           "compare first-token logits, so choose answers that start differently")
    return firsts


@torch.inference_mode()
def decide(engine: Engine, nb: Notebook, query: str, answers: Sequence[str], *,
           cot: bool = False, budget: int = 96,
           parse: Callable[[str], str | None] | None = None) -> Decision:
    """The model's decision after ``query`` on top of ``nb``.

    Without CoT: the answer whose first token has the highest logit at the decision position
    (a leading space is assumed when the query does not end in whitespace). With CoT: greedy
    decoding up to ``budget`` tokens, then ``parse(text)`` (default :func:`parse_answer`).
    """
    t0 = time.perf_counter()
    ids = answer_token_ids(engine, answers, leading_space=not query[-1:].isspace())
    q_ids, q_spans = engine.tokens_of(query, bos=False, kind="query", name="query")
    step = engine.forward(nb, q_ids, spans=q_spans)
    logits = step.logits
    first_seconds = time.perf_counter() - t0
    scores = tuple(float(logits[i]) for i in ids)
    if not cot:
        answer = answers[max(range(len(answers)), key=lambda j: scores[j])]
        return Decision(answer, logits, scores, "", first_seconds, first_seconds)
    first = logits
    text = engine.continue_greedy(step.notebook, logits, budget).text
    answer = (parse or (lambda t: parse_answer(t, answers)))(text)
    return Decision(answer, first, scores, text, first_seconds, time.perf_counter() - t0)


def parse_answer(text: str, answers: Sequence[str]) -> str | None:
    """The first answer named after the last "answer:" in ``text`` (else anywhere in it)."""
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
