"""The agent's prompt, piece by piece, shared by the kvnotes agent and the recompute agent.

Both agents lay out the same pieces in the same order, each piece tokenized on its own:

    [BOS] system( HEADER, skills of turn 0, record )  user(request 0)  assistant(Decision: c0)
          [system(correction)]* [system(more policy, new skills)]  user(request 1)  ...

The kvnotes agent keeps the record of turn 0 and appends a correction per state change (worded
by :func:`kvnotes.ops.edit.erratum_turn`, a user turn for chat models); the recompute agent writes
the current record in place and has no corrections.
"""

from __future__ import annotations

from kvnotes.apps.agent.episodes import Request
from kvnotes.core.chat import ChatFormat

HEADER = ("You are the customer service agent of Skyline Airways. Follow the policies below "
          "exactly; they are the only rules you may apply. The customer record is the source of "
          "truth for every fact about the customer.\n\n")
MORE_POLICY = "Additional policy for the next request:\n\n"
DECISION = "Decision:"


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
