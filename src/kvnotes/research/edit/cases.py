"""The prompt of one case, and which cases a run takes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvnotes.core.chat import chat_turn, has_template, turn_frame
from kvnotes.core.document import Document
from kvnotes.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.eval.tasks.base import EditCase

COT_INSTRUCTION = "Think step by step, then finish with 'Final answer: <answer>'."


def case_prompt(engine: Engine, case: EditCase, *, cot: bool = False) -> tuple[Document, str]:
    """The document to prefill and the query to ask for one case.

    Chat models: the record is one user turn (part of the document, so edits see the same
    frame), the question a second user turn followed by the opened assistant turn. Base models:
    the record, then ``Question: ... Answer:``.
    """
    question = f"{case.question} {COT_INSTRUCTION}" if cot else case.question
    tok = engine.tokenizer
    if has_template(tok):
        head, tail = turn_frame(tok, "user")
        doc = Document([head, *case.document.parts, tail])
        return doc, chat_turn(tok, "user", question, generation_prompt=True)
    return case.document, f"\nQuestion: {question}\n" + ("Reasoning:" if cot else "Answer:")


def spread(cases: Sequence[EditCase], per_family: int) -> list[EditCase]:
    """``per_family`` cases of each family, evenly spaced through it (so they cover its value
    pairs rather than repeating the first one), taken round-robin across families (so a run
    stopped early still covers every family)."""
    by_family: dict[str, list[EditCase]] = {}
    for c in cases:
        by_family.setdefault(c.family, []).append(c)
    picked = [[g[i * len(g) // min(per_family, len(g))] for i in range(min(per_family, len(g)))]
              for g in by_family.values()]
    return [g[i] for i in range(per_family) for g in picked if i < len(g)]


def take_shard(cases: Sequence[EditCase], shard: str) -> list[EditCase]:
    """``"K/N"``: every N-th case starting at the K-th (1-based), so N processes together run
    each case once."""
    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InvalidArgumentError(f"bad shard {shard!r}; write K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise InvalidArgumentError(f"bad shard {shard!r}: K must be between 1 and N")
    return list(cases[k - 1::n])
