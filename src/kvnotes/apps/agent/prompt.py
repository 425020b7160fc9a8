"""The agent's prompt, piece by piece, shared by the kvnotes agent and the recompute agent.

Both agents lay out the same pieces in the same order, each piece tokenized on its own:

    [BOS] system( HEADER, skills of turn 0, record )  user(request 0)  assistant(Decision: c0)
          [system(correction)]* [system(more policy, new skills)]  user(request 1)  ...

The kvnotes agent keeps the record of turn 0 and appends a correction per state change (worded
by :func:`kvnotes.ops.edit.erratum_text`, a user turn for chat models); the recompute agent writes
the current record in place and has no corrections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvnotes.apps.agent.episodes import Request

HEADER = ("You are the customer service agent of Skyline Airways. Follow the policies below "
          "exactly; they are the only rules you may apply. The customer record is the source of "
          "truth for every fact about the customer.\n\n")
MORE_POLICY = "Additional policy for the next request:\n\n"
DECISION = "Decision:"

_SENTINEL = "\u2063KVNOTES\u2063"


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Opening and closing text of a system, user and assistant turn."""

    system: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]

    @classmethod
    def plain(cls) -> ChatFormat:
        return cls(("", "\n"), ("Customer: ", "\n"), ("Agent: ", "\n\n"))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """The tokenizer's chat template, read turn by turn; plain text when it has none."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain()
        try:
            return cls(*(_turn(tokenizer, role) for role in ("system", "user", "assistant")))
        except Exception:  # templates that refuse a role: fall back to plain text
            return cls.plain()


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _turn(tokenizer: Any, role: str) -> tuple[str, str]:
    """(open, close) of one ``role`` turn after a first system turn: the difference of renders."""
    first = [{"role": "system", "content": "Z"}]
    before = _render(tokenizer, first)
    after = _render(tokenizer, [*first, {"role": role, "content": _SENTINEL}])
    if not after.startswith(before) or after.count(_SENTINEL) != 1:
        raise ValueError("chat template is not concatenative")
    open_, close = after[len(before):].split(_SENTINEL)
    return open_, close


class Prompt:
    """The text of every prompt piece for one chat format."""

    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt

    def head(self) -> str:
        return self.fmt.system[0] + HEADER

    def record(self, state_text: str) -> str:
        return state_text + self.fmt.system[1]

    def more_policy(self) -> str:
        return self.fmt.system[0] + MORE_POLICY

    def query(self, request: Request, *, close_policy: bool) -> str:
        """The request and the decision cue; closes a policy block opened just before."""
        options = ", ".join(request.options)
        return ((self.fmt.system[1] if close_policy else "")
                + self.fmt.user[0] + f"{request.text}\nAnswer with one of: {options}."
                + self.fmt.user[1] + self.fmt.assistant[0] + DECISION)

    def answer(self, choice: str) -> str:
        return f" {choice}" + self.fmt.assistant[1]
