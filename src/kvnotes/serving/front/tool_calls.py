"""The model's tool calls in an answer, as OpenAI ``tool_calls`` (what vLLM's hermes parser does).

A call is written ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the hermes
format: the one the kvnotes tool block asks for, and the one of templates such as Qwen's); a
call left open at the answer's end counts too, and ``"parameters"`` is read as
``"arguments"``. An answer that is one bare JSON object with a ``"name"`` and
``"arguments"`` (or ``"parameters"``) is one call too. When any call is not such JSON, the
answer is plain content, no call (as vLLM does): never an error.

:func:`parse_tool_calls` reads a whole answer; :class:`ToolCallStream` reads a streamed one:
text is passed on until a call may start, then held to the end, where the calls are parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvnotes.serving.json_types import JsonValue, ToolCallOut
from kvnotes.serving.planning.chat_render import CALL_CLOSE, CALL_OPEN

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE) + "|"
                   + re.escape(CALL_OPEN) + r"(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: its id (``call_<hex>``), the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> ToolCallOut:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    """An answer split into its content (the text outside the calls; None when blank) and its
    calls (none: the answer is plain content)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def _call(obj: JsonValue) -> ToolCall | None:
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already JSON text: kept when it is an object's
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name,
                    json.dumps(args, ensure_ascii=False))


def _loads(text: str) -> JsonValue:
    try:
        return json.loads(text.strip())
    except (ValueError, RecursionError):
        return None


def parse_tool_calls(text: str, *, parallel: bool = True) -> ParsedAnswer:
    """``text``'s calls and content (see the module docstring); ``parallel`` False keeps the
    first call only.

    Example:
        >>> a = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
        >>> a.content, a.calls[0].name, a.calls[0].arguments
        (None, 'f', '{"x": 1}')
        >>> parse_tool_calls('<tool_call>{"name": "f", oops</tool_call>').calls
        ()
    """
    if CALL_OPEN in text:
        calls = []
        for m in _CALL.finditer(text):
            call = _call(_loads(m.group(1) if m.group(1) is not None else m.group(2)))
            if call is None:
                return ParsedAnswer(text)
            calls.append(call)
        content = _CALL.sub("", text).strip()
        return ParsedAnswer(content or None, tuple(calls[:1] if not parallel else calls))
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        call = _call(_loads(stripped))
        if call is not None:
            return ParsedAnswer(None, (call,))
    return ParsedAnswer(text)


def _partial_open(text: str) -> int:
    """How many of ``text``'s last characters may begin a call marker."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """A streamed answer's text: :meth:`feed` gives what may be sent now (nothing once a call
    may have started: a call marker, or an answer opening with ``{``); :meth:`finish` gives
    the rest of the content and the calls."""

    def __init__(self, *, parallel: bool = True) -> None:
        self.parallel = parallel
        self.text = ""
        self.sent = 0
        self.holding = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(CALL_OPEN, self.sent)
        if at >= 0:
            self.holding = True
        elif not self.text[:self.sent].strip() and self.text.lstrip().startswith("{"):
            self.holding, at = True, self.sent
        else:
            at = len(self.text) - _partial_open(self.text[self.sent:])
        out = self.text[self.sent:at]
        self.sent = at
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """``(content not sent yet, calls)`` at the answer's end."""
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        parsed = parse_tool_calls(rest, parallel=self.parallel)
        if not parsed.calls:
            return rest, ()
        return (parsed.content or ""), parsed.calls
