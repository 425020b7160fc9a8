"""The prompt of a tool case, as parts: system header, one skill per tool set, the question.

``header + skill_1 + ... + skill_k + question`` is the system turn (header and the tools'
JSON descriptions, each skill on its own line), the user turn and the opened assistant turn
of the tokenizer's chat template (a plain-text frame for base models). The decision is read
after :data:`CALL_OPENING` fed on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvnotes.core.chat import chat_frame
from kvnotes.eval.tools.data import ToolCase

SYSTEM = ("You are an expert in composing functions. You are given a question and a set of "
          "possible functions. Based on the question, call the one function that achieves "
          "the purpose. Reply with a JSON object {\"name\": ..., \"arguments\": {...}}.\n"
          "Here is a list of functions in JSON format that you can invoke:")
CALL_OPENING = '{"name": "'
# a neutral tool of the same kind, compiled in front of each skill by the "anchor" strategies
STAND_IN = ('{"name": "example_tool", "description": "An example tool that does nothing.", '
            '"parameters": {"type": "dict", "properties": {}, "required": []}}')


@dataclass(frozen=True, slots=True)
class CasePrompt:
    """A case's prompt as text parts (each skill starts with a newline: its own line)."""

    header: str
    skills: tuple[str, ...]
    question: str
    query: str  # fed on top of the composed prompt; the decision is read after it


def skill_text(text: str) -> str:
    return "\n" + text


def case_prompt(tokenizer: Any, case: ToolCase) -> CasePrompt:
    """The parts of ``case``'s prompt in ``tokenizer``'s chat frame."""
    head, middle, tail = chat_frame(tokenizer)
    user = f"{case.system}\n\n{case.question}" if case.system else case.question
    query = CALL_OPENING if not tail or tail[-1].isspace() else " " + CALL_OPENING
    return CasePrompt(head + SYSTEM, tuple(skill_text(s.text) for s in case.skills),
                      middle + user + tail, query)
