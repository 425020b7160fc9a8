"""The agent soak's prompts, rendered independently of the front.

:func:`rendered_prompt` gives the token ids a chat request should reach the engine as, built
from the request and the tokenizer alone, in the layout kvnotes documents for each kind of
model (``docs/guide/serving.md``, "Tools and content parts"):

- ``"template"``: the model's chat template renders the tools (rendering with them differs
  from rendering without): ``apply_chat_template(messages, tools=...)``;
- ``"kvnotes_tools"``: the template ignores tools: the kvnotes tool block (its head, one tool
  JSON per line, its tail) ends the first system message (after a blank line), or is a system
  turn of its own; an assistant's tool calls follow its text one per line as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; a ``tool`` message is a user
  turn ``<tool_response>\\n...\\n</tool_response>``; the template renders that, without tools;
- ``"default"``: no chat template: each turn as ``"<Role>: <text>"``, turns joined by a blank
  line, ``"Assistant:"`` last; unless the request sends ``stop``, the answer stops at a new
  user turn.

The text is then cut before and after each tool as the layout writes it, each text part of a
message's content and each text in ``cuts`` (the entries a report names), and each part is
tokenized alone after BOS (when the tokenizer adds one): the layout ``Engine.compose`` uses.
Only the layout's fixed strings (the tool block's head and tail, the call tags, the default
stop) come from the front's module: they are the documented format. A front that renders or
tokenizes a request otherwise sends another prompt, and its answers show as ``wrong``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.errors import KvnotesError
from kvnotes.serving.planning.chat_render import (
    CALL_CLOSE,
    CALL_OPEN,
    DEFAULT_STOP,
    TOOL_BLOCK_HEAD,
    TOOL_BLOCK_TAIL,
)
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

CONTENT_JOIN = "\n"  # how an OpenAI server joins a message's text parts for the template
ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


@dataclass(frozen=True)
class Rendered:
    """A chat request as the check renders it: its prompt ``ids``, the ``stop`` strings the
    answer ends at, and the layout it was rendered in (``source``)."""

    ids: list[int]
    stop: tuple[str, ...] = ()
    source: str = "template"


class NotRendered(KvnotesError, ValueError):
    """A chat the check cannot render as sent (the answer is unchecked)."""


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return CONTENT_JOIN.join(str(p["text"]) for p in content)
    return "" if content is None else str(content)


def _template_writings(tool: Mapping[str, Any]) -> list[str]:
    """How a chat template's ``tojson`` may write a tool (compact or indented, the tool or its
    ``function``)."""
    inner = tool.get("function")
    objs = [tool, inner] if isinstance(inner, Mapping) else [tool]
    return [json.dumps(o, ensure_ascii=False, indent=i) for i in (None, 4) for o in objs]


def _call_lines(message: Mapping[str, Any]) -> list[str]:
    lines = []
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        lines.append(CALL_OPEN + body + CALL_CLOSE)
    return lines


def kvnotes_turns(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
                  ) -> list[tuple[str, str]]:
    """``(role, text)`` of each turn in the kvnotes layouts: calls written after the text, the
    tool block in the system turn."""
    turns = []
    for m in messages:
        text, calls = _text(m), "\n".join(_call_lines(m))
        turns.append((str(m["role"]), text + ("\n" if text and calls else "") + calls))
    if tools:
        block = TOOL_BLOCK_HEAD + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) \
            + TOOL_BLOCK_TAIL
        if turns and turns[0][0] == "system":
            head = turns[0][1]
            turns[0] = ("system", head + "\n\n" + block if head else block)
        else:
            turns.insert(0, ("system", block))
    return turns


def _kvnotes_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]], templated: bool) -> str:
    turns = kvnotes_turns(messages, tools)
    if not templated:
        return "\n\n".join([*(f"{ROLE_NAMES.get(r, r.capitalize())}: {t}" for r, t in turns),
                            "Assistant:"])
    plain = [{"role": "user", "content": f"<tool_response>\n{t}\n</tool_response>"}
             if r == "tool" else {"role": r, "content": t} for r, t in turns]
    return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True))


def _layout_text(tokenizer: Any, request: AgentRequest) -> tuple[str, str]:
    """``(layout, text)``: the request's prompt text and the layout it is in."""
    messages = request.messages()
    tools = request.tools() or []
    if not getattr(tokenizer, "chat_template", None):
        return "default", _kvnotes_text(tokenizer, messages, tools, templated=False)
    joined = [{**m, "content": _text(m)} if isinstance(m.get("content"), list) else m
              for m in messages]
    text = str(tokenizer.apply_chat_template(joined, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True))
    if tools and text == str(tokenizer.apply_chat_template(joined, tokenize=False,
                                                           add_generation_prompt=True)):
        return "kvnotes_tools", _kvnotes_text(tokenizer, messages, tools, templated=True)
    return "template", text


def _cut(text: str, pieces: Sequence[Sequence[str]]) -> list[str]:
    """``text`` cut before and after each piece (the first writing of each found, in order
    after the previous one); the parts join back to ``text``."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for writings in pieces:
        for w in writings:
            at = text.find(w, cursor) if w else -1
            if at >= 0:
                spans.append((at, at + len(w)))
                cursor = at + len(w)
                break
    out, pos = [], 0
    for a, b in spans:
        out += [text[pos:a], text[a:b]]
        pos = b
    out.append(text[pos:])
    return [p for p in out if p]


def rendered_prompt(tokenizer: Any, request: AgentRequest, cuts: Sequence[str] = ()
                    ) -> Rendered:
    """``request`` rendered in its model's layout (see the module docstring), cut at its tools,
    its content parts and ``cuts``, each part tokenized alone after BOS. The stop strings are
    the request's own (the default layout's when it sends none). :class:`NotRendered` when the
    template fails on the chat."""
    from kvnotes.core.document import added_bos, encode

    try:
        layout, text = _layout_text(tokenizer, request)
    except Exception as err:  # noqa: BLE001 -- a template's own failure: the answer is unchecked
        raise NotRendered(f"the chat template failed: {type(err).__name__}: {err}") from err
    bos = added_bos(tokenizer)
    bos_text = getattr(tokenizer, "bos_token", None)
    if bos is not None and isinstance(bos_text, str) and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]
    tools = request.tools() or []
    pieces = [_template_writings(t) if layout == "template"
              else [json.dumps(t, ensure_ascii=False)] for t in tools]
    pieces += [[p["text"]] for m in request.messages() if isinstance(m.get("content"), list)
               for p in m["content"]]
    parts = _cut(text, pieces)
    for c in cuts:  # an entry's text inside a part: cut that part again
        parts = [q for p in parts for q in (_cut(p, [[c]]) if c and c in p and c != p else [p])]
    ids = [] if bos is None else [bos]
    for part in parts:
        ids += encode(tokenizer, part)
    stop = request.body().get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not stops and layout == "default":
        stops = tuple(DEFAULT_STOP)
    return Rendered(ids, stops, layout)
