"""Reading one OpenAI request for the front: can it be planned, and what does it ask.

:func:`read_request` turns a client's JSON body for ``/v1/completions`` or
``/v1/chat/completions`` into a :class:`FrontRequest`: the prompt (text, or token ids; a
completion text containing a registered skill laid out part by part,
:func:`read_completion_text`, the ids the front sends spliced or not), the
sampling fields passed on to vLLM's completions endpoint, streaming, what the client asked of
``usage`` and ``logprobs``, and the per-request kvnotes options (``extra_body={"kvnotes":
{...}}``: :class:`FrontOptions`). A chat's messages (and ``tools``) are rendered by the front
part by part (:mod:`~kvnotes.serving.planning.chat_render`: the tokenizer's chat template with
``add_generation_prompt=True``, the text vLLM itself would tokenize; the kvnotes tool block for
a template that ignores tools; the default layout without a template), each tool and each text
content part a chunk, and laid out in token ids part by part.

A body that is wrong (a field of the wrong type, a number that is not finite, an unknown or
invalid kvnotes option) raises :class:`BadRequest` naming the field: the front answers 400.
A valid request the front does not model exactly raises :class:`Unplannable` with a reason code
from :data:`REASONS` and a message (a field outside :data:`COMPLETION_FIELDS` /
:data:`CHAT_FIELDS`, several prompts or choices, a client ``cache_salt``, non-text chat content,
a template that fails): the front then forwards the request to vLLM as it came.
Pure functions, no HTTP.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, cast

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from kvnotes.serving.json_types import RequestBody, SamplingFields
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.chat_render import (
    DEFAULT_STOP,
    ChatPart,
    ChatShapeError,
    Find,
    lay_out_chat,
    render_chat_parts,
)
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.layout import part_ids
from kvnotes.serving.planning.part_tokens import PartTokenCache

OPTIONS_KEY: Final = "kvnotes"
ENDPOINTS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

# fields passed on to vLLM's completions endpoint unchanged: sampling and output controls that
# mean the same on both endpoints
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "user",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "logit_bias", "bad_words", "allowed_token_ids", "priority",
    "request_id", "session_id", "length_penalty",
})
# fields the front reads itself (then leaves out or rewrites)
_COMMON_OWN = frozenset({"stream", "stream_options", "n", OPTIONS_KEY})
COMPLETION_FIELDS = SAMPLING_FIELDS | _COMMON_OWN | {"prompt", "logprobs", "echo",
                                                      "add_special_tokens"}
CHAT_FIELDS = SAMPLING_FIELDS | _COMMON_OWN | {"messages", "logprobs", "top_logprobs",
                                                "max_completion_tokens", "add_generation_prompt",
                                                "tools", "tool_choice", "parallel_tool_calls"}
OPTION_NAMES = ("splice", "tenant", "repair", "guard")


# why a valid request is forwarded exactly: a fixed vocabulary (metric labels stay bounded)
REASONS = ("opted_out", "unmodelled_field", "choices", "stream_options", "echo",
           "special_tokens", "prompt_shape", "chat_shape", "chat_template", "no_skill",
           "nothing_left", "block_size_unknown", "model_unknown", "phase_failed", "not_planned",
           "plan_error", "no_chunk", "tool_choice")


class Unplannable(Exception):
    """The request is forwarded exactly; ``code`` (one of :data:`REASONS`) and ``str(err)``
    say why (sent back in the ``x-kvnotes`` header)."""

    def __init__(self, message: str, code: str = "not_planned") -> None:
        super().__init__(message)
        self.code = code if code in REASONS else "not_planned"


class BadRequest(Exception):
    """The body is wrong: ``param`` names the field (``kvnotes.repair``), ``str(err)`` says how
    (the front answers 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# the type of each field both endpoints know, checked before anything is planned or forwarded
_INT, _REAL, _BOOL, _STR = "an integer", "a finite number", "true or false", "a string"
FIELD_TYPES = {
    **dict.fromkeys(("max_tokens", "min_tokens", "top_k", "seed", "n", "top_logprobs",
                     "max_completion_tokens", "priority"), _INT),
    **dict.fromkeys(("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"), _REAL),
    **dict.fromkeys(("stream", "echo", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output",
                     "add_special_tokens", "add_generation_prompt"), _BOOL),
    **dict.fromkeys(("model", "user", "cache_salt", "request_id", "suffix"), _STR),
}


# the range of each numeric field, as vLLM's sampling parameters check it (None: unbounded),
# and whether the low end is excluded; checked with the types, so no field reaches vLLM out of it
FIELD_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "temperature": (0, None, False), "top_p": (0, 1, True), "min_p": (0, 1, False),
    "top_k": (-1, None, False), "presence_penalty": (-2, 2, False),
    "frequency_penalty": (-2, 2, False), "repetition_penalty": (0, None, True),
    "max_tokens": (1, None, False), "max_completion_tokens": (1, None, False),
    "min_tokens": (0, None, False), "n": (1, None, False), "top_logprobs": (0, 20, False),
}


def _is_type(value: object, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _REAL:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(float(value))
        except OverflowError:  # an integer beyond any float
            return False
    if kind == _BOOL:
        return isinstance(value, bool)
    return isinstance(value, str)


def check_body(kind: str, body: object) -> RequestBody:
    """``body`` when its known fields have the right types; :class:`BadRequest` otherwise.

    Example:
        >>> check_body("completion", {"prompt": "hi", "temperature": 0.5})["temperature"]
        0.5
        >>> check_body("completion", {"prompt": "hi", "max_tokens": "5"})
        Traceback (most recent call last):
        ...
        kvnotes.serving.planning.request.BadRequest: max_tokens must be an integer, got '5'
    """
    if not isinstance(body, dict):
        raise BadRequest("", "the body must be a JSON object")
    for key, value in body.items():
        want = FIELD_TYPES.get(key)
        if want is not None and value is not None and not _is_type(value, want):
            raise BadRequest(key, f"{key} must be {want}, got {_short(value)}")
        if key in FIELD_RANGES and value is not None:
            _check_range(key, value)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise BadRequest("stop", f"stop must be a string or a list of strings, got {_short(stop)}")
    if kind == "completion":
        if not isinstance(body.get("prompt"), (str, list)):
            raise BadRequest("prompt", "prompt must be a string, a list of strings, or token ids")
        lp = body.get("logprobs")
        if lp is not None and (not _is_type(lp, _INT) or not 0 <= lp <= 20):
            raise BadRequest("logprobs", f"logprobs must be an integer from 0 to 20, got "
                             f"{_short(lp)}")
    elif kind == "chat":
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("messages", "messages must be a non-empty list")
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise BadRequest("logprobs", f"logprobs must be true or false, got {_short(lp)}")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise BadRequest("stream_options", "stream_options must be an object")
    read_options(body.get(OPTIONS_KEY))
    return cast(RequestBody, body)  # its fields as checked above (RequestBody's types)


def _check_range(name: str, value: float) -> None:
    low, high, open_low = FIELD_RANGES[name]
    below = low is not None and (value <= low if open_low else value < low)
    if below or (high is not None and value > high):
        bounds = [] if low is None else [f"{'>' if open_low else '>='} {low:g}"]
        bounds += [] if high is None else [f"<= {high:g}"]
        raise BadRequest(name, f"{name} must be {' and '.join(bounds)}, got {_short(value)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _tenant(tenant: str) -> str:
    splice_salt(tenant)  # the tenant's spelling rule (InvalidArgumentError: a ValueError)
    return tenant


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class FrontOptions:
    """Per-request options (``extra_body={"kvnotes": {...}}``); None: the front's default.

    - ``splice``: False forwards the request exactly (no skill is spliced).
    - ``tenant``: the request's splice salt is this tenant's (``kvnotes-splice:<tenant>``).
    - ``repair``: the first tokens of each spliced skill recomputed in context (0: none).
    - ``guard``: tau; when the first answer token's top-2 log-prob margin is under it, the
      answer comes from an exact request (0: never).
    """

    splice: StrictBool = True
    tenant: Annotated[StrictStr, AfterValidator(_tenant)] | None = None
    repair: Annotated[StrictInt, Field(ge=0)] | None = None  # a token count
    guard: Annotated[float, Strict(), Field(ge=0.0, allow_inf_nan=False)] | None = None


_OPTIONS = TypeAdapter(FrontOptions)


def read_options(raw: object) -> FrontOptions:
    """The ``kvnotes`` object of a body as options; a bad one raises :class:`BadRequest` naming
    the option.

    Example:
        >>> try:
        ...     read_options({"tenat": "acme"})
        ... except BadRequest as err:
        ...     print(err.param, "|", err)
        kvnotes.tenat | unknown kvnotes option 'tenat': use splice, tenant, repair, guard
        >>> try:
        ...     read_options({"repair": True})
        ... except BadRequest as err:
        ...     print(err.param, "|", err)
        kvnotes.repair | kvnotes.repair: input should be a valid integer, got True
    """
    if raw is None:
        return FrontOptions()
    if not isinstance(raw, Mapping):
        raise BadRequest(OPTIONS_KEY, f"{OPTIONS_KEY} must be an object of "
                         f"{', '.join(OPTION_NAMES)}")
    try:
        return _OPTIONS.validate_python(raw)
    except ValidationError as err:
        error = err.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else ""
        param = f"{OPTIONS_KEY}.{name}"[:80]
        if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            message = f"unknown {OPTIONS_KEY} option {_short(name)}: use {', '.join(OPTION_NAMES)}"
        elif error["type"] == "value_error":  # the tenant's spelling: its own message
            message = str(error.get("ctx", {}).get("error", error["msg"]))
        else:
            message = (f"{param}: {error['msg'][:1].lower()}{error['msg'][1:]}, got "
                       f"{_short(error.get('input'))}")
        raise BadRequest(param, message) from None


@dataclass
class FrontRequest:
    """One plannable request: prompt, what to pass on, what the client expects back."""

    kind: str  # "completion" or "chat"
    options: FrontOptions
    sampling: SamplingFields  # passed on to vLLM's /v1/completions
    text: str | None = None  # the prompt's text (chat: rendered), when it came as text
    ids: list[int] | None = None  # the prompt's token ids, when it came as ids
    stream: bool = False
    include_usage: bool = False  # streaming: the client asked for the usage chunk
    logprobs: int | None = None  # top log-probs per token the client asked for (None: none)
    # a chat, laid out part by part (chat_render.lay_out_chat): the BOS part when the tokenizer
    # adds it, then each part (text, "skill", "tool", "content") with its ids; the chunks
    parts: tuple[ChatPart, ...] = ()
    lead_ids: tuple[int, ...] = ()
    chunks: tuple[SeenChunk, ...] = ()
    layout: str | None = None  # a chat's layout: one of chat_render.LAYOUTS
    # tools, list content, tool calls or results, or no chat template: the exact counterpart
    # is these same ids sent by the front, never the request forwarded to vLLM's chat endpoint
    structured: bool = False
    tool_calls: bool = False  # the answer's tool calls are parsed (tools sent, choice not none)
    parallel_tool_calls: bool = True

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids as laid out (the BOS part, then every part's): a chat's, or a
        completion text's split at the registered skills it contains."""
        return [*self.lead_ids, *(t for p in self.parts for t in p.token_ids)]

    @property
    def sent_as_ids(self) -> bool:
        """Whether the front sends this prompt as its own laid-out ids however it is answered
        (spliced, guarded, opted out, not planned): a structured chat, a chat whose text holds
        a registered skill, or a completion text that contains one. Its exact counterpart is
        then these same ids, never the request forwarded for vLLM to render or tokenize."""
        return self.structured or any(p.kind == "skill" for p in self.parts)


def _check_fields(body: RequestBody, allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise Unplannable(f"{what} field(s) {_short(unknown)} are passed to vLLM as they are",
                          "unmodelled_field")


def _stream_fields(body: RequestBody) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise Unplannable("stream must be true or false", "stream_options")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, Mapping) or set(opts) - {"include_usage"}:
        raise Unplannable("stream_options other than include_usage are passed to vLLM as "
                          "they are", "stream_options")
    return stream, bool(opts.get("include_usage")) and stream


def _one_choice(body: RequestBody) -> None:
    if body.get("n", 1) not in (1, None):
        raise Unplannable("n > 1 is passed to vLLM as it is", "choices")


def render_chat(tokenizer: Any, messages: object, tools: object = None) -> str:
    """The prompt text of a chat as the front renders it (see
    :func:`~kvnotes.serving.planning.chat_render.render_chat_parts`); :class:`Unplannable`
    for a chat it does not render."""
    try:
        return render_chat_parts(tokenizer, messages, tools).text
    except ChatShapeError as err:
        raise Unplannable(str(err), err.code) from err


TOOL_CHOICES = ("auto", "none", "required")


def _tool_choice(body: RequestBody) -> bool:
    """Whether the answer's tool calls are parsed: tools sent and ``tool_choice`` ``auto`` (or
    absent). ``"required"`` and a named function constrain decoding, which vLLM does for its own
    chat route (structured outputs): such a request is :class:`Unplannable` and forwarded
    exactly, so it is answered as vLLM answers it."""
    choice = body.get("tool_choice")
    named = isinstance(choice, Mapping) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), Mapping) \
        and isinstance(choice["function"].get("name"), str)
    if choice is not None and choice not in TOOL_CHOICES and not named:
        raise Unplannable("tool_choice must be auto, none, required or a named function",
                          "chat_shape")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise Unplannable("parallel_tool_calls must be true or false", "chat_shape")
    if body.get("tools") and (named or choice == "required"):
        raise Unplannable("tool_choice required or named: vLLM constrains the answer's "
                          "decoding", "tool_choice")
    return bool(body.get("tools")) and choice != "none"


def read_chat(req: FrontRequest, body: RequestBody, tokenizer: Any,
              find: Find | None, cache: PartTokenCache | None = None) -> None:
    """Render and lay out a chat into ``req`` (``find``: the catalog's registered texts, which
    split the text parts; None: none; ``cache``: parts' ids kept by their text). An opted-out
    chat that is neither structured nor holds a registered skill raises :class:`Unplannable`
    (it is forwarded as it came); one that holds a skill is sent as the same laid-out ids as
    its spliced counterpart (:attr:`FrontRequest.sent_as_ids`)."""
    try:
        rendered = render_chat_parts(tokenizer, body.get("messages"), body.get("tools"))
    except ChatShapeError as err:
        raise Unplannable(str(err), err.code) from err
    laid = lay_out_chat(tokenizer, rendered.parts, find, cache)
    req.text, req.layout, req.structured = rendered.text, rendered.layout, rendered.structured
    req.parts, req.lead_ids, req.chunks = laid.parts, laid.lead_ids, laid.chunks
    if not req.options.splice and not req.sent_as_ids:
        raise Unplannable(f"{OPTIONS_KEY}.splice is false", "opted_out")
    req.tool_calls = _tool_choice(body)
    req.parallel_tool_calls = body.get("parallel_tool_calls") is not False
    if req.tool_calls:
        # as vLLM's tool parsers ask: a call marker may be a special token of the model
        req.sampling.setdefault("skip_special_tokens", False)
    if rendered.layout == "default":  # a base model: its answer ends where a user turn would
        req.sampling.setdefault("stop", list(DEFAULT_STOP))


def read_completion_text(req: FrontRequest, tokenizer: Any, find: Find,
                         cache: PartTokenCache | None = None) -> None:
    """Lay a completion's text prompt out into ``req`` when it contains a registered skill
    (``find``: the catalog's registered texts): the text split at them, BOS first when the
    tokenizer adds one, then each part tokenized alone
    (:func:`~kvnotes.serving.planning.layout.part_ids`, the layout ``engine.compose`` and the
    skills' compiles use), each skill a ``"skill"`` part with its registered ids (not
    tokenized again), the other parts through ``cache`` when given. These ids are what the front sends,
    spliced or not (:attr:`FrontRequest.sent_as_ids`). No skill found: :class:`Unplannable`
    (``no_skill``, or ``opted_out`` for ``kvnotes.splice`` false); the request is forwarded as
    it came, and vLLM tokenizes its text.

    Why part-wise, not the ids vLLM computes for the whole text: tokenizing across a part's
    edge merges tokens there, so a skill's ids would often not occur in the whole text's ids
    at all and could not be spliced. The bundled SmolLM2's byte-level BPE tokenizes a part
    ending in a blank line (``"...\n\n"``) as one ``"\n\n"`` token alone but as two
    ``"\n"`` tokens before a letter in the whole text: in a prompt laid out as a header and
    skills, each ending in a blank line, not one part's ids occur in the whole text's.
    The exact counterpart (``splice`` false, the guard's, an unplanned request's) is sent as
    the same ids instead, so a spliced answer differs from the exact one only by the KV it
    reuses.
    """
    found = find(req.text or "")
    if not any(p.skill is not None for p in found):
        if not req.options.splice:
            raise Unplannable(f"{OPTIONS_KEY}.splice is false", "opted_out")
        raise Unplannable("no registered skill in the prompt", "no_skill")
    found = [p for p in found if p.text]
    ids = part_ids(tokenizer, [p.text for p in found], cache=cache,
                   known=[None if p.skill is None else p.skill.token_ids for p in found])
    lead = len(ids) - len(found)  # the BOS part, when the tokenizer adds one
    req.lead_ids = tuple(t for tokens in ids[:lead] for t in tokens)
    req.parts = tuple(ChatPart(p.text, "text" if p.skill is None else "skill", tuple(tokens))
                      for p, tokens in zip(found, ids[lead:], strict=True))


def read_request(kind: str, body: RequestBody, tokenizer: Any, find: Find | None = None,
                 cache: PartTokenCache | None = None) -> FrontRequest:
    """A :class:`FrontRequest` of a client's body (``kind``: a value of :data:`ENDPOINTS`);
    :class:`Unplannable` when it must be forwarded as it came. ``find``: the catalog's
    registered texts (a chat's text parts and a completion's text are split at them; None: not
    split, and a completion text is laid out by the planner). ``cache``: the prompt's parts'
    ids kept by their text (:class:`~kvnotes.serving.planning.part_tokens.PartTokenCache`;
    None: every part is tokenized). A structured chat
    (:attr:`FrontRequest.structured`) and a completion text containing a registered skill with
    ``kvnotes.splice`` false are read all the same: their exact counterpart is sent by the
    front as the same ids (:attr:`FrontRequest.sent_as_ids`)."""
    if not isinstance(body, dict):
        raise Unplannable("the body is not a JSON object", "prompt_shape")
    options = read_options(body.get(OPTIONS_KEY))
    if not options.splice and kind != "chat" and (kind != "completion" or find is None):
        raise Unplannable(f"{OPTIONS_KEY}.splice is false", "opted_out")
    _one_choice(body)
    stream, include_usage = _stream_fields(body)
    # the fields SamplingFields names, of the types check_body checked
    sampling = cast(SamplingFields, {k: v for k, v in body.items() if k in SAMPLING_FIELDS})
    req = FrontRequest(kind, options, sampling, stream=stream, include_usage=include_usage)
    if kind == "completion":
        # an opted-out request's own cache_salt is kept (nothing of it is spliced)
        _check_fields(body, COMPLETION_FIELDS | ({"cache_salt"} if not options.splice
                                                 else frozenset()), "completion")
        if body.get("echo"):
            raise Unplannable("echo is passed to vLLM as it is", "echo")
        if body.get("add_special_tokens", True) is not True:
            raise Unplannable("add_special_tokens=false is passed to vLLM as it is",
                              "special_tokens")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            req.text = prompt
            if find is not None:
                read_completion_text(req, tokenizer, find, cache)
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            if not options.splice:  # token ids mean the same to vLLM: sent as they came
                raise Unplannable(f"{OPTIONS_KEY}.splice is false", "opted_out")
            req.ids = [int(t) for t in prompt]
        else:
            raise Unplannable("the prompt is not one text or one list of token ids",
                              "prompt_shape")
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise Unplannable("logprobs must be a count", "prompt_shape")
        req.logprobs = lp
    elif kind == "chat":
        _check_fields(body, CHAT_FIELDS, "chat")
        if body.get("add_generation_prompt", True) is not True:
            raise Unplannable("add_generation_prompt=false is passed to vLLM as it is",
                              "special_tokens")
        read_chat(req, body, tokenizer, find, cache)
        max_completion = body.get("max_completion_tokens")
        if isinstance(max_completion, int):  # checked: an integer, or null
            sampling["max_tokens"] = max_completion
        sampling.setdefault("max_tokens", None)  # chat's default: up to the context's end
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise Unplannable("top_logprobs must be a count", "chat_shape")
            req.logprobs = top
    else:
        raise Unplannable(f"no plan for {kind!r} requests", "not_planned")
    return req
