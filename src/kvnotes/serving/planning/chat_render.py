"""A chat request rendered by the front itself, as ordered parts: text, and the request's chunks.

:func:`render_chat_parts` renders a chat's ``messages`` (and ``tools``) to the prompt text vLLM
would see, split into :class:`ChatPart` s whose concatenation is that text. Each entry of
``tools`` and each text part of a message's list content is a *chunk* (kind ``"tool"`` or
``"content"``, :data:`~kvnotes.serving.planning.chunks.CHUNK_KINDS`); the rest is text.
:func:`lay_out_chat` then tokenizes the parts as ``engine.compose`` lays a prompt out (BOS
first when the tokenizer adds it, then each part encoded alone), so a chunk's token ids are the
same whatever surrounds it, and gives each chunk as a
:class:`~kvnotes.serving.planning.chunks.SeenChunk`.

Three layouts (:data:`LAYOUTS`), chosen per request:

- ``"template"``: the model's chat template renders ``tools`` (rendering with a probe tool
  differs from rendering without, :func:`kvnotes.core.chat.renders_tools`); the messages and
  ``tools`` go to the template as they are (tool call arguments as objects, as vLLM passes
  them). How the template writes each tool is read from the template itself
  (:func:`tool_writings`: rendered with a probe tool, then with each tool added in turn, each
  render diffed with the one before), whatever it writes (JSON, indented JSON, a line of
  prose), and that writing is the tool's chunk.
- ``"kvnotes_tools"``: the template ignores tools: :func:`tool_block` (one tool JSON per line,
  the call format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is added to the
  system turn (after the first system message's text, or as a system turn of its own), an
  assistant message's ``tool_calls`` are written in that format after its text, and a
  ``tool`` message becomes a user turn ``<tool_response>\\n...\\n</tool_response>``.
- ``"default"``: the tokenizer has no chat template (a base model):
  :data:`DEFAULT_LAYOUT` (roles as plain prefixes), tools as in ``"kvnotes_tools"``; unless
  the client sends ``stop``, the answer stops at :data:`DEFAULT_STOP` (a user turn).

A message's list content is its text parts joined with ``"\\n"`` (how vLLM joins them for a
template that takes string content); any other part (an image, audio) makes the request
:class:`~kvnotes.serving.planning.request.Unplannable` (``chat_shape``: forwarded as it came).
Pure functions, no HTTP.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvnotes.core.chat import has_template, render, renders_tools
from kvnotes.core.document import added_bos
from kvnotes.serving.json_types import ChatMessage, JsonValue, ToolSpec
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.layout import part_ids
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.spans import sweep

LAYOUTS = ("template", "kvnotes_tools", "default")
CONTENT_JOIN = "\n"  # vLLM's join of a message's text parts (string-content templates)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_BLOCK_HEAD = ("# Tools\n\nYou may call one or more functions to help with the request. "
                   "The functions, one JSON object per line:\n<tools>\n")
TOOL_BLOCK_TAIL = ("\n</tools>\n\nTo call a function, answer with one line per call:\n"
                   f'{CALL_OPEN}{{"name": <function name>, "arguments": '
                   f"<the arguments as a JSON object>}}{CALL_CLOSE}")
# the layout of a chat for a tokenizer without chat template: each message as
# "<Role>: <text>", messages separated by a blank line, then the assistant's turn opened
DEFAULT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
DEFAULT_SEPARATOR = "\n\n"
DEFAULT_GENERATION = "Assistant:"
DEFAULT_STOP = ("\n\nUser:",)  # the default stop of a chat in the default layout
DEFAULT_LAYOUT = ("System: <system text>\\n\\nUser: <user text>\\n\\nAssistant: <answer>"
                  "\\n\\n...\\n\\nAssistant:")
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


class ChatShapeError(ValueError):
    """The chat is one the front does not render (``code``: a reason of
    :data:`~kvnotes.serving.planning.request.REASONS`); the request is forwarded as it came."""

    def __init__(self, message: str, code: str = "chat_shape") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ChatPart:
    """One part of a rendered chat: text, a chunk (``kind`` ``"tool"`` or ``"content"``), or
    (once laid out against the catalog) a registered skill's text (``"skill"``);
    ``token_ids``: the part encoded alone (filled by :func:`lay_out_chat`)."""

    text: str
    kind: str = "text"
    token_ids: tuple[int, ...] = ()

    @property
    def is_chunk(self) -> bool:
        return self.kind in ("tool", "content")


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A chat rendered part by part (see the module docstring)."""

    parts: tuple[ChatPart, ...]
    layout: str  # one of LAYOUTS
    has_tools: bool  # the request sent tools
    structured: bool  # tools, list content, tool calls/results, or no template: the front
    # sends the exact counterpart itself (same part-wise ids), never vLLM's chat endpoint

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)


@dataclass(frozen=True, slots=True)
class LaidOut:
    """A rendered chat's token layout: the BOS part (when the tokenizer adds it), each part
    with its ids, and the chunks as seen."""

    lead_ids: tuple[int, ...]
    parts: tuple[ChatPart, ...]
    chunks: tuple[SeenChunk, ...]

    @property
    def ids(self) -> list[int]:
        return [*self.lead_ids, *(t for p in self.parts for t in p.token_ids)]


def strip_bos_text(tokenizer: Any, text: str) -> str:
    """A chat template's rendered text without its leading BOS text when the tokenizer adds
    BOS itself (the BOS is then the layout's first part, as in a completion prompt)."""
    bos_text = getattr(tokenizer, "bos_token", None)
    if added_bos(tokenizer) is not None and isinstance(bos_text, str) and bos_text \
            and text.startswith(bos_text):
        return text[len(bos_text):]
    return text


def tool_json(tool: ToolSpec) -> str:
    """A tool as a chat template's ``tojson`` writes it (``json.dumps``, non-ASCII kept)."""
    return json.dumps(tool, ensure_ascii=False)


def tool_block(tools: Sequence[ToolSpec]) -> tuple[str, list[str]]:
    """``(block, lines)``: the kvnotes tool block for a template that ignores tools, and the
    tool lines in it (each a chunk)."""
    lines = [tool_json(t) for t in tools]
    return TOOL_BLOCK_HEAD + "\n".join(lines) + TOOL_BLOCK_TAIL, lines


def call_text(name: str, arguments: JsonValue) -> str:
    """One tool call in the kvnotes block's format (the hermes format)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}" \
           f"{CALL_CLOSE}"


# ---- reading the request ---------------------------------------------------------------------
def _check_tools(tools: object) -> list[ToolSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatShapeError("tools must be a list")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or tool.get("type", "function") != "function":
            raise ChatShapeError("each tool must be {\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}")
    return [cast(ToolSpec, dict(t)) for t in tools]  # checked above


def _content(m: Mapping[str, object]) -> tuple[str, list[str]]:
    """``(text, chunks)`` of a message's content: a string as it is; a list of text parts
    joined, each part a chunk."""
    content = m.get("content")
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ChatShapeError("message content must be a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ChatShapeError("only text content parts are planned")
        texts.append(part["text"])
    return CONTENT_JOIN.join(texts), texts


def _calls(m: Mapping[str, object]) -> list[tuple[str, JsonValue]]:
    """An assistant message's tool calls as ``(name, arguments)``, arguments parsed when they
    are a JSON text (as vLLM passes them to a template)."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list) or m.get("role") != "assistant":
        raise ChatShapeError("tool_calls must be a list, on an assistant message")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatShapeError("each tool call must have a function with a name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        out.append((fn["name"], args))
    return out


@dataclass
class _Message:
    role: str
    text: str
    chunks: list[str]
    calls: list[tuple[str, JsonValue]]
    raw: ChatMessage


def _read_messages(messages: object) -> list[_Message]:
    if not isinstance(messages, list) or not messages:
        raise ChatShapeError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or set(m) - _MESSAGE_KEYS:
            raise ChatShapeError("only messages of role, content, name, tool_calls and "
                                 "tool_call_id are planned")
        if m.get("name") is not None and not isinstance(m.get("name"), str):
            raise ChatShapeError("a message's name must be a string")
        text, chunks = _content(m)
        calls = _calls(m)
        if m.get("content") is None and not calls:
            raise ChatShapeError("a message without content must carry tool_calls")
        out.append(_Message(m["role"], text, chunks, calls, cast(ChatMessage, m)))  # checked
    return out


# ---- rendering -------------------------------------------------------------------------------
def _template_messages(msgs: Sequence[_Message]) -> list[ChatMessage]:
    """The messages as a template that renders tools gets them (vLLM's shape)."""
    out = []
    for m in msgs:
        d = cast(ChatMessage, {k: v for k, v in m.raw.items()
                               if k not in ("content", "tool_calls")})
        d["content"] = m.text if m.raw.get("content") is not None or not m.calls else None
        if m.calls:
            d["tool_calls"] = [{**c, "function": {**c["function"], "arguments": args}}
                               for c, (_, args) in zip(m.raw.get("tool_calls") or [], m.calls,
                                                       strict=True)]
        out.append(d)
    return out


def _plain_text(m: _Message) -> str:
    """A message's text with its tool calls written in the kvnotes block's format."""
    calls = "\n".join(call_text(name, args) for name, args in m.calls)
    return m.text + ("\n" if m.text and calls else "") + calls


def _with_block(msgs: Sequence[_Message], block: str | None) -> list[tuple[str, str]]:
    """``(role, text)`` per message for the kvnotes layouts: calls written out, tool results
    as user turns (for a template), the tool block in the system turn."""
    out = [(m.role, _plain_text(m)) for m in msgs]
    if block is not None:
        if out and out[0][0] == "system":
            out[0] = ("system", out[0][1] + ("\n\n" if out[0][1] else "") + block)
        else:
            out.insert(0, ("system", block))
    return out


def _default_text(turns: Sequence[tuple[str, str]]) -> str:
    lines = [f"{DEFAULT_ROLES.get(role, role.capitalize())}: {text}" for role, text in turns]
    return DEFAULT_SEPARATOR.join([*lines, DEFAULT_GENERATION])


def _render_template(tokenizer: Any, messages: Sequence[ChatMessage],
                     tools: Sequence[ToolSpec] | None) -> str:
    try:
        text = render(tokenizer, messages, generation_prompt=True, tools=tools)
    except Exception as err:  # noqa: BLE001 -- a template's own failure: vLLM answers it
        raise ChatShapeError(f"the chat template failed: {type(err).__name__}: {err}",
                             "chat_template") from err
    if not isinstance(text, str) or not text:
        raise ChatShapeError("the chat template rendered no text", "chat_template")
    return text


_MARK = "\u2063KVC{}\u2063"  # invisible separators around a number: never real content


def _render_text(tokenizer: Any, msgs: Sequence[_Message], tools: list[ToolSpec],
                 layout: str) -> str:
    """The prompt text of ``msgs`` and ``tools`` in ``layout``."""
    if layout == "template":
        return _render_template(tokenizer, _template_messages(msgs), tools or None)
    block = tool_block(tools)[0] if tools else None
    turns = _with_block(msgs, block)
    if layout == "default":
        return _default_text(turns)
    plain: list[ChatMessage] = [{"role": "user" if role == "tool" else role,
                                 "content": f"<tool_response>\n{text}\n</tool_response>"
                                 if role == "tool" else text} for role, text in turns]
    return _render_template(tokenizer, plain, None)


def _content_spans(tokenizer: Any, msgs: Sequence[_Message], tools: list[ToolSpec],
                   layout: str, text: str) -> list[tuple[int, int]]:
    """Where each content part is in ``text``: rendered again with a marker in place of each
    part, kept when putting the parts back gives ``text`` itself (a template that changes
    content, e.g. trims it, gives no span: its parts are then searched in message order)."""
    contents = [c for m in msgs for c in m.chunks]
    if not contents or any(_MARK.split("{")[0] in c for c in contents):
        return []
    marked, n = [], 0
    for m in msgs:
        marks = [_MARK.format(n + i) for i in range(len(m.chunks))]
        n += len(m.chunks)
        marked.append(_Message(m.role, CONTENT_JOIN.join(marks), m.chunks, m.calls, m.raw)
                      if m.chunks else m)
    try:
        template = _render_text(tokenizer, marked, tools, layout)
    except ChatShapeError:
        return _searched(text, contents)
    spans, out, pos, length = [], [], 0, 0  # length: of "".join(out), kept as it grows
    for i, chunk in enumerate(contents):
        at = template.find(_MARK.format(i), pos)
        if at < 0:
            return _searched(text, contents)
        out.append(template[pos:at])
        start = length + at - pos
        out.append(chunk)
        length = start + len(chunk)
        spans.append((start, length))
        pos = at + len(_MARK.format(i))
    out.append(template[pos:])
    return spans if "".join(out) == text else _searched(text, contents)


def _searched(text: str, contents: Sequence[str]) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for chunk in contents:
        at = text.find(chunk, cursor)
        if at >= 0:
            spans.append((at, at + len(chunk)))
            cursor = at + len(chunk)
    return spans


def _locate(text: str, tool_texts: Sequence[Sequence[str]],
            content_spans: Sequence[tuple[int, int]]) -> list[ChatPart]:
    """``text`` split at its chunks: the content parts at their spans, each tool at its first
    writing found after the previous tool's, outside the content parts."""
    spans = [(a, b, "content") for a, b in content_spans if text[a:b].strip()]
    taken = sorted((a, b) for a, b, _ in spans)  # the content parts: in order, disjoint
    starts = [a for a, _ in taken]

    def free(a: int, b: int) -> bool:
        i = bisect.bisect_left(starts, b)  # the content parts starting before b
        return i == 0 or taken[i - 1][1] <= a

    cursor = 0
    for candidates in tool_texts:
        for cand in candidates:
            at = text.find(cand, cursor)
            while at >= 0 and not free(at, at + len(cand)):
                at = text.find(cand, at + 1)
            if at >= 0:
                spans.append((at, at + len(cand), "tool"))
                cursor = at + len(cand)
                break
    spans.sort(key=lambda s: (s[0], -s[1]))
    return [ChatPart(text[a:b], kind or "text") for a, b, kind in sweep(len(text), spans)]


# ---- how a template writes tools ---------------------------------------------------------
# the tool every probe render lists first; its description comes last and ends in a character
# no tool ends with, so a tool added after it is placed unambiguously (see inserted)
PROBE_TOOL: ToolSpec = {"type": "function", "function": {
    "name": "kvnotes_probe", "parameters": {"type": "object", "properties": {}},
    "description": "A probe.\u2063"}}
MAX_WRITINGS = 1024  # (template, tool) writings kept: a client's tools repeat
_writings: OrderedDict[tuple[str, str], str] = OrderedDict()
_writings_lock = threading.Lock()


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))  # compared by halves: C-speed slices, not a char loop
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _border(text: str, a: int, b: int) -> int:
    """How many ends of ``text[a:b]`` sit at a line break or at an end of ``text``."""
    return (a == 0 or text[a - 1] in "\r\n") + (b == len(text) or text[b] in "\r\n")


def inserted(before: str, after: str) -> str | None:
    r"""The text ``after`` holds that ``before`` does not, when ``after`` is ``before`` with one
    run of text inserted (else None), without its edge whitespace.

    An insertion next to text it repeats can be placed several ways (``"x\n"`` to
    ``"x\ny\n"`` adds ``"y\n"`` or ``"\ny"``): the placement kept is the one whose text,
    stripped, has the most ends at a line break, the rightmost among equals.

    Example:
        >>> inserted("<t>\nA\n</t>", "<t>\nA\n<x>\n</t>")
        '<x>'
        >>> inserted("<a>one</a>", "<b>two</b>") is None
        True
    """
    n = len(after) - len(before)
    p = _common_prefix(before, after)
    if n <= 0 or after[p + n:] != before[p:]:
        return None
    best: tuple[int, int, int] | None = None  # (score, start, end)
    for shift in range(n + 1):
        a, b = p - shift, p + n - shift
        if shift and (a < 0 or after[a] != after[b]):
            break  # a placement one further left holds other text
        a2, b2 = a, b
        while a2 < b2 and after[a2].isspace():
            a2 += 1
        while b2 > a2 and after[b2 - 1].isspace():
            b2 -= 1
        score = _border(after, a2, b2)
        if best is None or score > best[0]:
            best = (score, a2, b2)
    assert best is not None
    return after[best[1]:best[2]] or None


def tool_writings(tokenizer: Any, msgs: Sequence[_Message], tools: Sequence[ToolSpec]
                  ) -> list[str | None]:
    """How the chat template writes each of ``tools``: the text that rendering ``msgs`` with
    :data:`PROBE_TOOL` and the tool adds to the render with the probe alone
    (:func:`inserted`; None: the template did more than insert it). The probe comes first so
    that the tool is added to a list, as in a request (a template writes a block around its
    tools when it has some), after a writing no tool's resembles."""
    messages = _template_messages(msgs)
    base = _render_template(tokenizer, messages, [PROBE_TOOL])
    return [inserted(base, _render_template(tokenizer, messages, [PROBE_TOOL, tool]))
            for tool in tools]


def _tools_written(tokenizer: Any, msgs: Sequence[_Message], tools: Sequence[ToolSpec],
                   text: str) -> list[list[str]]:
    """Each tool's writing (:func:`tool_writings`) as a list of candidates: the one last read
    for this template and tool when ``text`` holds it, else the one read from this request."""
    template = str(getattr(tokenizer, "chat_template", ""))
    keys = [(template, json.dumps(t, ensure_ascii=False, sort_keys=True)) for t in tools]
    with _writings_lock:
        known = [_writings.get(k) for k in keys]
    stale = [i for i, w in enumerate(known) if w is None or w not in text]
    if stale:
        try:
            fresh = tool_writings(tokenizer, msgs, [tools[i] for i in stale])
        except ChatShapeError:  # the template refuses the probe: those tools stay text
            return [[w] if w and w in text else [] for w in known]
        with _writings_lock:
            for i, w in zip(stale, fresh, strict=True):
                known[i] = _writings[keys[i]] = w or ""
                _writings.move_to_end(keys[i])
            while len(_writings) > MAX_WRITINGS:
                _writings.popitem(last=False)
    return [[w] if w else [] for w in known]


def render_chat_parts(tokenizer: Any, messages: object, tools: object = None) -> RenderedChat:
    """``messages`` and ``tools`` rendered as the front sends them (see the module docstring);
    :class:`ChatShapeError` for a chat the front does not render."""
    msgs = _read_messages(messages)
    tool_list = _check_tools(tools)
    tooling = any(m.calls or m.role == "tool" for m in msgs)
    structured = bool(tool_list) or any(isinstance(m.raw.get("content"), list) for m in msgs) \
        or tooling or not has_template(tokenizer)
    if not has_template(tokenizer):
        layout = "default"
    elif not (tool_list or tooling) or renders_tools(tokenizer):
        layout = "template"
    else:
        layout = "kvnotes_tools"
    text = _render_text(tokenizer, msgs, tool_list, layout)
    if layout == "template":
        tool_texts = _tools_written(tokenizer, msgs, tool_list, text)
    else:
        tool_texts = [[line] for line in tool_block(tool_list)[1]] if tool_list else []
    parts = _locate(text, tool_texts, _content_spans(tokenizer, msgs, tool_list, layout, text))
    return RenderedChat(tuple(parts), layout, bool(tool_list), structured)


# ---- token layout ----------------------------------------------------------------------------
# SkillCatalog.find: parts with .text and .skill (None, or a Skill with its .token_ids)
Find = Callable[[str], Sequence[Any]]


def lay_out_chat(tokenizer: Any, parts: Sequence[ChatPart], find: Find | None = None,
                 cache: PartTokenCache | None = None) -> LaidOut:
    """``parts`` tokenized as sent: the template's BOS text dropped when the tokenizer adds BOS
    itself (then BOS is a part of its own), text parts split at the registered skills ``find``
    finds in them (each a ``"skill"`` part, with its registered ids), every other part encoded
    alone (:func:`~kvnotes.serving.planning.layout.part_ids`, through ``cache`` when given);
    each chunk as seen."""
    parts = list(parts)
    if parts and not parts[0].is_chunk:
        parts[0] = ChatPart(strip_bos_text(tokenizer, parts[0].text), parts[0].kind)
    split: list[tuple[ChatPart, Sequence[int] | None]] = []  # with a skill's registered ids
    for part in parts:
        if part.is_chunk or find is None:
            split.append((part, None))
            continue
        split += [(ChatPart(p.text, "text" if p.skill is None else "skill"),
                   None if p.skill is None else p.skill.token_ids) for p in find(part.text)]
    split = [(p, known) for p, known in split if p.text]
    ids = part_ids(tokenizer, [p.text for p, _ in split], cache=cache,
                   known=[known for _, known in split])
    lead = tuple(t for tokens in ids[:len(ids) - len(split)] for t in tokens)
    laid: list[ChatPart] = []
    starts: list[tuple[ChatPart, int]] = []
    at = len(lead)
    for (part, _), tokens in zip(split, ids[len(ids) - len(split):], strict=True):
        token_ids = tuple(tokens)
        laid.append(ChatPart(part.text, part.kind, token_ids))
        if part.is_chunk and token_ids:
            starts.append((laid[-1], at))
        at += len(token_ids)
    every = lead + tuple(t for p in laid for t in p.token_ids)  # shared by the chunks
    chunks = tuple(SeenChunk(p.kind, p.text, p.token_ids, every, start) for p, start in starts)
    return LaidOut(lead, tuple(laid), chunks)
