"""The prompt of a tool case, as parts: system header, one skill per tool set, the question.

``header + skill_1 + ... + skill_k + question`` is the system turn (header and the tools'
JSON descriptions, each skill on its own line), the user turn and the opened assistant turn
of the tokenizer's chat template (a plain-text frame for base models). The decision is read
after :data:`CALL_OPENING` fed on top of it. A skill opening (``opening``, e.g.
:data:`SKILL_OPENING`) starts every skill's line with the same fixed text, in the exact prompt
and the composed one alike: it changes the prompt itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvnotes.core.chat import chat_frame
from kvnotes_bench.tools.data import ToolCase

SYSTEM = ("You are an expert in composing functions. You are given a question and a set of "
          "possible functions. Based on the question, call the one function that achieves "
          "the purpose. Reply with a JSON object {\"name\": ..., \"arguments\": {...}}.\n"
          "Here is a list of functions in JSON format that you can invoke:")
CALL_OPENING = '{"name": "'
# a neutral tool of the same kind, compiled in front of each skill by the "anchor" strategies
STAND_IN = ('{"name": "example_tool", "description": "An example tool that does nothing.", '
            '"parameters": {"type": "dict", "properties": {}, "required": []}}')

# a position-agnostic skill opening: the header's own word for what follows, on its own line,
# so it reads the same for any tool wherever it is listed and leaves the JSON's tokens as they are
SKILL_OPENING = "Function:\n"


@dataclass(frozen=True, slots=True)
class CasePrompt:
    """A case's prompt as text parts (each skill starts with a newline: its own line, then
    ``opening``, the same for every skill, when the run sets one)."""

    header: str
    skills: tuple[str, ...]
    question: str
    query: str  # fed on top of the composed prompt; the decision is read after it
    opening: str = ""


def skill_text(text: str, opening: str = "") -> str:
    """A skill's part of the prompt: its own line, ``opening`` first."""
    return "\n" + opening + text


def case_prompt(tokenizer: Any, case: ToolCase, opening: str = "") -> CasePrompt:
    """The parts of ``case``'s prompt in ``tokenizer``'s chat frame, every skill starting
    with ``opening`` after its newline."""
    head, middle, tail = chat_frame(tokenizer)
    user = f"{case.system}\n\n{case.question}" if case.system else case.question
    query = CALL_OPENING if not tail or tail[-1].isspace() else " " + CALL_OPENING
    return CasePrompt(head + SYSTEM, tuple(skill_text(s.text, opening) for s in case.skills),
                      middle + user + tail, query, opening)
