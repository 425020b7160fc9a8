"""Chat framing: the one place that reads a tokenizer's chat template.

Everything that wraps text in chat turns goes through here: a single turn (:func:`chat_turn`),
its opening and closing text (:func:`turn_frame`), the system + user frame of a composed prompt
(:func:`chat_frame`) and the per-role turn format the agent lays its pieces out with
(:class:`ChatFormat`). Tokenizers without a chat template (base models) get plain text.

BOS is never part of the rendered text when the tokenizer adds it itself: the engine decides
about BOS (see docs/design.md, "Beginning of sequence").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.document import added_bos
from kvnotes.core.errors import UnsupportedModelError

_SENTINEL = "\u2063KVNOTES\u2063"  # invisible separator: never part of real text


def has_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a chat template (instruct models) or not (base models)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, messages: Sequence[Mapping[str, object]], *,
           generation_prompt: bool = False, tools: Sequence[Mapping[str, object]] | None = None
           ) -> str:
    """The chat template applied to ``messages`` (and ``tools``, for a template that renders
    them), as text (the only call of the template)."""
    if tools:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


_PROBE_TOOL = {"type": "function", "function": {
    "name": "kvnotes_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[str, bool] = {}  # chat template -> whether it renders tools


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a request's ``tools`` (rendering one user
    turn with a probe tool differs from rendering it without); False without a template or
    when the template fails with tools. Cached per template text."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        return False
    known = _RENDERS_TOOLS.get(template)
    if known is None:
        turn = [{"role": "user", "content": "x"}]
        try:
            known = render(tokenizer, turn, generation_prompt=True, tools=[_PROBE_TOOL]) \
                != render(tokenizer, turn, generation_prompt=True)
        except Exception:  # noqa: BLE001 -- a template that fails with tools does not render them
            known = False
        _RENDERS_TOOLS[template] = known
    return known


def chat_turn(tokenizer: Any, role: str, text: str, *, generation_prompt: bool = False) -> str:
    """``text`` wrapped as one chat turn by the tokenizer's chat template, without any BOS.

    Falls back to ``text`` unchanged for tokenizers without a chat template (base models).
    """
    if not has_template(tokenizer):
        return text
    rendered = render(tokenizer, [{"role": role, "content": text}],
                      generation_prompt=generation_prompt)
    rendered = _strip_added_bos(tokenizer, rendered)
    # Some templates insert a default system turn before the first user turn; keep only ours.
    marker = rendered.rfind(text)
    if marker > 0 and role != "system":
        rendered = rendered[_last_turn_start(rendered[:marker], role):]
    return rendered


def turn_frame(tokenizer: Any, role: str, *, generation_prompt: bool = False) -> tuple[str, str]:
    """``(open, close)``: what :func:`chat_turn` puts before and after a turn's text."""
    open_, close = chat_turn(tokenizer, role, _SENTINEL,
                             generation_prompt=generation_prompt).split(_SENTINEL, 1)
    return open_, close


def chat_frame(tokenizer: Any) -> tuple[str, str, str]:
    """``(head, middle, tail)``: the chat template around one system turn and one user turn.

    ``head + system_text + middle + user_text + tail`` is what the template renders for a
    system message and a user message with the assistant's turn opened. Without a chat
    template (base models) it is a plain-text frame. BOS is left out (the engine adds it).
    """
    if not has_template(tokenizer):
        return "", "\n\n", "\nAnswer:"
    s, u = "\x00SYSTEM\x00", "\x00USER\x00"
    rendered = render(tokenizer, [{"role": "system", "content": s}, {"role": "user", "content": u}],
                      generation_prompt=True)
    head, rest = rendered.split(s, 1)
    middle, tail = rest.split(u, 1)
    return _strip_added_bos(tokenizer, head), middle, tail


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Opening and closing text of a system, user and assistant turn that follows a first system
    turn (so per-piece prompts concatenate to what the template renders for a conversation)."""

    system: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]

    @classmethod
    def plain(cls) -> ChatFormat:
        return cls(("", "\n"), ("Customer: ", "\n"), ("Agent: ", "\n\n"))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """The tokenizer's chat template, read turn by turn; plain text when it has none."""
        if not has_template(tokenizer):
            return cls.plain()
        try:
            return cls(*(_later_turn(tokenizer, role) for role in ("system", "user", "assistant")))
        except Exception:  # noqa: BLE001 -- templates that refuse a role: fall back to plain text
            return cls.plain()


def _later_turn(tokenizer: Any, role: str) -> tuple[str, str]:
    """(open, close) of one ``role`` turn after a first system turn: the difference of renders."""
    first = [{"role": "system", "content": "Z"}]
    before = render(tokenizer, first)
    after = render(tokenizer, [*first, {"role": role, "content": _SENTINEL}])
    if not after.startswith(before) or after.count(_SENTINEL) != 1:
        raise UnsupportedModelError("this chat template does not render a conversation as the "
                                    "concatenation of its turns; the agent uses plain text")
    open_, close = after[len(before):].split(_SENTINEL)
    return open_, close


def _last_turn_start(head: str, role: str) -> int:
    idx = head.rfind(role)
    if idx <= 0:
        return 0
    # walk back to the start of the special token that opens this turn (e.g. "<|im_start|>")
    open_idx = head.rfind("<", 0, idx)
    return open_idx if open_idx >= 0 else 0


def _strip_added_bos(tokenizer: Any, rendered: str) -> str:
    """Drop a leading BOS only when the tokenizer adds BOS itself (then the engine adds it).

    SmolLM2's ``bos_token`` is ``<|im_start|>``, which its tokenizer never adds: there the
    template's first token is real text and must stay.
    """
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not rendered.startswith(bos):
        return rendered
    return rendered[len(bos):] if added_bos(tokenizer) is not None else rendered
