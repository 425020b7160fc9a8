"""Shaping vLLM's completion answers into what the front's client asked for.

The front always asks vLLM's ``/v1/completions`` (a prompt of token ids is the only way to
send per-part ids), with log-probs when the guard needs them; :class:`Shaper` turns each answer
(a whole body, or one streamed chunk) into the client's format: a completion as it came, or a
chat completion (``chat.completion``, ``chat.completion.chunk`` with a first ``role`` delta);
log-probs trimmed to what the client asked (none when it asked none); ``usage`` with a
``kvnotes`` object (:class:`~kvnotes.serving.protocol.UsageKvnotes`: spliced tokens, phases,
guard, plan, the connector's reports; vLLM's own ``kv_transfer_params``, where the report
came, are not passed on). A chat that sent tools gets the
model's calls as ``tool_calls`` (:mod:`~kvnotes.serving.front.tool_calls`; streamed: text is
held once a call may start, the calls come in one delta at the end). Pure functions over JSON
values.
"""

from __future__ import annotations

import json
from typing import NoReturn, TypeAlias, TypedDict

from kvnotes.serving.front.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from kvnotes.serving.json_types import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    JsonValue,
    TokenLogprob,
    Usage,
)
from kvnotes.serving.protocol import UsageKvnotes

DONE = b"data: [DONE]\n\n"
ClientChunk: TypeAlias = "CompletionChunk | ChatCompletionChunk"  # a streamed chunk as sent


class InvalidEvent(str):
    """A ``data:`` line whose payload is not JSON (the stream is then ended with an error)."""


def sse(obj: object) -> bytes:
    """One server-sent event carrying ``obj`` (anything ``json.dumps`` writes) as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def parse_sse_line(line: str) -> JsonValue | bytes | InvalidEvent:
    """The JSON of a ``data:`` line; ``DONE`` for ``[DONE]``; an :class:`InvalidEvent` for a
    payload that is not JSON; None for any other line.

    Example:
        >>> parse_sse_line('data: {"a": 1}'), parse_sse_line(": ping"), parse_sse_line("data: {")
        ({'a': 1}, None, '{')
    """
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return InvalidEvent(data[:200])


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def first_top_logprobs(answer: Completion | CompletionChunk | None) -> dict[str, float] | None:
    """The first generated token's top log-probs in a completion body or chunk (None: none)."""
    for choice in (answer or {}).get("choices") or []:
        lp = choice.get("logprobs") or {}
        tops = lp.get("top_logprobs") or []
        if tops and isinstance(tops[0], dict):
            return {str(k): float(v) for k, v in tops[0].items()}
    return None


def _trim_top(top: dict[str, float], k: int, chosen: str | None) -> dict[str, float]:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
    keep = dict(ranked)
    if chosen is not None and chosen in top:
        keep.setdefault(chosen, top[chosen])
    return keep


def trim_logprobs(logprobs: CompletionLogprobs | None, k: int | None
                  ) -> CompletionLogprobs | None:
    """A completion choice's ``logprobs`` as a client that asked for ``k`` sees it (vLLM was
    asked for at least 2 for the guard): None when it asked none."""
    if logprobs is None or k is None:
        return None
    tokens = logprobs.get("tokens") or []
    tops = logprobs.get("top_logprobs") or []
    trimmed = [_trim_top(t, k, tokens[i] if i < len(tokens) else None) if isinstance(t, dict)
               else t for i, t in enumerate(tops)]
    return {**logprobs, "top_logprobs": trimmed}


def chat_logprobs(logprobs: CompletionLogprobs | None, k: int | None) -> ChatLogprobs | None:
    """A completion choice's ``logprobs`` in the chat format (``content``: one entry per
    token with its ``top_logprobs``)."""
    if logprobs is None or k is None:
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content: list[TokenLogprob] = []
    for i, tok in enumerate(tokens):
        given = tops[i] if i < len(tops) else None
        top = given if isinstance(given, dict) else {}
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
        content.append({"token": tok, "logprob": values[i] if i < len(values) else None,
                        "bytes": list(str(tok).encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in ranked]})
    return {"content": content}


class _Message(TypedDict):
    """A chat choice's message and finish reason."""

    message: AssistantMessage
    finish_reason: str | None


class Shaper:
    """Turns vLLM completion answers into the client's format (one per request).

    Args:
        kind: ``completion`` or ``chat``.
        logprobs: the top log-probs per token the client asked for (None: none).
        include_usage: streaming: the client asked for the final usage chunk.
        tools: a chat whose answer's tool calls are parsed (``parallel``: more than one kept).
    """

    def __init__(self, kind: str, logprobs: int | None, include_usage: bool, *,
                 tools: bool = False, parallel: bool = True) -> None:
        self.kind, self.logprobs, self.include_usage = kind, logprobs, include_usage
        self.tools, self.parallel = tools and kind == "chat", parallel
        self._role_sent = False
        self._calls = ToolCallStream(parallel=parallel)

    def usage(self, usage: Usage | None, kvnotes: UsageKvnotes) -> Usage:
        out: Usage = usage.copy() if usage else {}
        out["kvnotes"] = kvnotes.to_dict()
        return out

    def _chat_id(self, answer: Completion | CompletionChunk) -> str:
        ident = str(answer.get("id") or "")
        return "chatcmpl-" + (ident[5:] if ident.startswith("cmpl-") else ident)

    def body(self, answer: Completion, kvnotes: UsageKvnotes) -> Completion | ChatCompletion:
        """A whole (non-streamed) answer."""
        usage = self.usage(answer.get("usage"), kvnotes)
        if self.kind == "completion":
            choices: list[CompletionChoice] = [
                {**c, "logprobs": trim_logprobs(c.get("logprobs"), self.logprobs)}
                for c in answer.get("choices") or []]
            out = answer.copy()  # vLLM's fields as they came, its kv_transfer_params left out
            out.pop("kv_transfer_params", None)
            out["choices"], out["usage"] = choices, usage
            return out
        chat: ChatCompletion = {
            "id": self._chat_id(answer), "object": "chat.completion",
            "created": answer.get("created"), "model": answer.get("model"),
            "choices": [{
                "index": c.get("index", 0), **self._message(c),
                "logprobs": chat_logprobs(c.get("logprobs"), self.logprobs),
                "stop_reason": c.get("stop_reason"),
            } for c in answer.get("choices") or []],
            "usage": usage,
        }
        return chat

    def _message(self, choice: CompletionChoice) -> _Message:
        """A chat choice's message and finish reason: its calls when tools were sent."""
        text = choice.get("text", "")
        if self.tools and isinstance(text, str):
            parsed = parse_tool_calls(text, parallel=self.parallel)
            if parsed.calls:
                return {"message": {"role": "assistant", "content": parsed.content,
                                    "tool_calls": [c.to_dict() for c in parsed.calls]},
                        "finish_reason": "tool_calls"}
        return {"message": {"role": "assistant", "content": text},
                "finish_reason": choice.get("finish_reason")}

    def chunk(self, chunk: CompletionChunk, kvnotes: UsageKvnotes
              ) -> list[ClientChunk]:
        """The client's chunks for one streamed vLLM chunk (the usage chunk gets ``kvnotes``;
        it is dropped when the client did not ask for usage)."""
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if not choices:
            if usage is None or not self.include_usage:
                return []
            if self.kind == "completion":
                return [{**chunk, "choices": [], "usage": self.usage(usage, kvnotes)}]
            return [{**self._chat_head(chunk), "choices": [], "usage": self.usage(usage, kvnotes)}]
        if self.kind == "completion":
            return [{**chunk, "usage": None,
                     "choices": [{**c, "logprobs": trim_logprobs(c.get("logprobs"),
                                                                 self.logprobs)}
                                 for c in choices]}]
        out: list[ClientChunk] = []
        if not self._role_sent:
            self._role_sent = True
            out.append({**self._chat_head(chunk), "choices": [{
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]})
        if self.tools:
            return out + self._tool_chunks(chunk, choices)
        out.append({**self._chat_head(chunk), "choices": [{
            "index": c.get("index", 0),
            "delta": {"content": c["text"]} if c.get("text") else {},
            "logprobs": chat_logprobs(c.get("logprobs"), self.logprobs),
            "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
        } for c in choices]})
        return out

    def _tool_chunks(self, chunk: CompletionChunk, choices: list[CompletionChoice]
                     ) -> list[ClientChunk]:
        """A streamed chunk of a chat with tools (one choice): the text that cannot be a call,
        and at the end the rest of the content and the calls."""
        c = choices[0]
        text = self._calls.feed(c.get("text") or "")
        finish = c.get("finish_reason")
        calls: tuple[ToolCall, ...] = ()
        if finish:
            rest, calls = self._calls.finish()
            text += rest
        lp = chat_logprobs(c.get("logprobs"), self.logprobs)
        if not text and not finish and lp is None:
            return []
        out: list[ClientChunk] = [{**self._chat_head(chunk), "choices": [{
            "index": 0, "delta": {"content": text} if text else {}, "logprobs": lp,
            "finish_reason": None if calls else finish,
            "stop_reason": None if calls else c.get("stop_reason")}]}]
        if calls:
            out.append({**self._chat_head(chunk), "choices": [{
                "index": 0, "delta": {"tool_calls": [{"index": i, **call.to_dict()}
                                                     for i, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]})
            if not text and lp is None:
                out.pop(0)
        return out

    def _chat_head(self, chunk: CompletionChunk) -> ChatCompletionChunk:
        return {"id": self._chat_id(chunk), "object": "chat.completion.chunk",
                "created": chunk.get("created"), "model": chunk.get("model")}
