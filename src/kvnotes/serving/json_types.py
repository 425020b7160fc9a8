"""JSON values, and the OpenAI-shaped JSON objects the serving side reads and writes, as types.

:data:`JsonValue` is any value ``json.loads`` gives (and ``json.dumps`` takes);
:data:`JsonObject` a JSON object. The ``TypedDict`` s are the OpenAI shapes, modelled on the
``openai`` SDK's own (``openai.types.chat``: ``*Param`` for what a client sends), with the
fields kvnotes reads typed as far as it checks them where they enter, and the rest left as
:data:`JsonValue`:

- a client's request body (:data:`RequestBody`: :class:`CompletionBody` or :class:`ChatBody`),
  as :func:`kvnotes.serving.planning.request.check_body` leaves it; a chat's messages and tools
  are read as :class:`ChatMessage` and :class:`ToolSpec` by
  :mod:`~kvnotes.serving.planning.chat_render` (one it cannot read is forwarded as it came);
- the ``/v1/completions`` body kvnotes sends vLLM, a prompt of token ids
  (:class:`UpstreamBody`);
- vLLM's completion answers (:class:`Completion`, :class:`CompletionChunk`), as
  :mod:`~kvnotes.serving.front.answers` checks them;
- the chat answers the front writes (:class:`ChatCompletion`, :class:`ChatCompletionChunk`) and
  its error bodies (:class:`ErrorBody`).

A body may carry fields its type does not name (they are passed on as they came); the types
say what the code may rely on. Types only: nothing here runs.
"""

from __future__ import annotations

from typing import Literal, Required, TypeAlias, TypedDict

JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"
JsonObject: TypeAlias = "dict[str, JsonValue]"


# ---- a client's request body ----------------------------------------------------------------
class SamplingFields(TypedDict, total=False):
    """The fields both endpoints take that the front passes on to vLLM's ``/v1/completions``
    unchanged (``request.SAMPLING_FIELDS``); the typed ones are checked (``request.FIELD_TYPES``,
    ``FIELD_RANGES``), None where the client sent ``null``."""

    model: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: JsonValue
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    user: str | None
    ignore_eos: bool | None
    min_tokens: int | None
    skip_special_tokens: bool | None
    spaces_between_special_tokens: bool | None
    include_stop_str_in_output: bool | None
    logit_bias: JsonValue
    bad_words: JsonValue
    allowed_token_ids: JsonValue
    priority: int | None
    request_id: str | None
    session_id: JsonValue
    length_penalty: float | None


class _ClientFields(SamplingFields, total=False):
    stream: bool | None
    stream_options: JsonObject | None
    n: int | None
    cache_salt: str | None
    kvnotes: JsonValue  # the per-request options (request.read_options reads them)


class CompletionBody(_ClientFields, total=False):
    """A client's ``/v1/completions`` body (SDK: ``CompletionCreateParams``): the prompt a
    text, token ids, or any list (as a client sends it: ``request.read_request`` reads its
    items)."""

    prompt: Required[str | list[int] | list[JsonValue]]
    logprobs: int | None
    echo: bool | None
    add_special_tokens: bool | None
    suffix: str | None


class ChatBody(_ClientFields, total=False):
    """A client's ``/v1/chat/completions`` body (SDK: ``CompletionCreateParams`` of
    ``openai.types.chat``): ``messages`` non-empty, each read as a :class:`ChatMessage` and
    ``tools`` as :class:`ToolSpec` s by the renderer."""

    messages: Required[list[JsonValue]]
    logprobs: bool | None
    top_logprobs: int | None
    max_completion_tokens: int | None
    add_generation_prompt: bool | None
    tools: JsonValue
    tool_choice: JsonValue
    parallel_tool_calls: JsonValue


RequestBody: TypeAlias = "CompletionBody | ChatBody"


# ---- a chat's messages and tools, as the renderer reads them ---------------------------------
class TextPart(TypedDict):
    """A text part of a message's list content (SDK: ``ChatCompletionContentPartTextParam``)."""

    type: Literal["text"]
    text: str


class CalledFunction(TypedDict, total=False):
    """The function of a tool call a message carries (SDK: ``Function``): its arguments as
    JSON text, or (as vLLM also takes them) a JSON value."""

    name: Required[str]
    arguments: JsonValue


class ToolCallParam(TypedDict, total=False):
    """A tool call an assistant message carries (SDK:
    ``ChatCompletionMessageFunctionToolCallParam``)."""

    id: JsonValue
    type: JsonValue
    function: Required[CalledFunction]


class ChatMessage(TypedDict, total=False):
    """One message (SDK: ``ChatCompletionMessageParam``, its roles' fields together):
    content a string, text parts or None (then it carries ``tool_calls``)."""

    role: Required[str]
    content: str | list[TextPart] | None
    name: str | None
    tool_calls: list[ToolCallParam] | None
    tool_call_id: JsonValue


class FunctionSpec(TypedDict, total=False):
    """A tool's function (SDK: ``FunctionDefinition``)."""

    name: Required[str]
    description: JsonValue
    parameters: JsonValue
    strict: JsonValue


class ToolSpec(TypedDict, total=False):
    """One entry of ``tools`` (SDK: ``ChatCompletionFunctionToolParam``; ``type`` absent means
    a function too)."""

    type: Literal["function"]
    function: Required[FunctionSpec]


# ---- what kvnotes sends vLLM ------------------------------------------------------------------
class UpstreamBody(SamplingFields, total=False):
    """A ``/v1/completions`` body of token ids, as the front and ``ComposeClient`` send vLLM
    (a phase, the spliced request, the exact one): the client's sampling fields laid over."""

    prompt: Required[list[int]]
    logprobs: int
    stream: bool
    stream_options: JsonObject
    cache_salt: str
    kv_transfer_params: JsonObject


# ---- vLLM's completion answers, as the front checks them --------------------------------------
class CompletionLogprobs(TypedDict, total=False):
    """A completion choice's ``logprobs`` (vLLM's ``CompletionLogProbs``)."""

    tokens: list[str] | None
    token_logprobs: list[float | None] | None
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int] | None


class CompletionChoice(TypedDict, total=False):
    """One choice of a completion or a streamed chunk (SDK: ``CompletionChoice``)."""

    index: int
    text: Required[str]
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class Usage(TypedDict, total=False):
    """An answer's ``usage`` (SDK: ``CompletionUsage``), with the front's ``kvnotes``
    (``UsageKvnotes.to_dict()``)."""

    prompt_tokens: int
    completion_tokens: int | None
    total_tokens: int | None
    prompt_tokens_details: JsonValue
    kvnotes: JsonObject


class Completion(TypedDict, total=False):
    """A whole ``/v1/completions`` answer (SDK: ``Completion``; vLLM's ``kv_transfer_params``
    carry the connector's report)."""

    id: JsonValue
    object: JsonValue
    created: JsonValue
    model: JsonValue
    choices: Required[list[CompletionChoice]]
    usage: Usage | None
    kv_transfer_params: JsonValue


class CompletionChunk(TypedDict, total=False):
    """One streamed ``/v1/completions`` chunk (its last one: no choices, the usage)."""

    id: JsonValue
    object: JsonValue
    created: JsonValue
    model: JsonValue
    choices: list[CompletionChoice]
    usage: Usage | None


class ErrorEvent(TypedDict):
    """An error event of vLLM's stream, passed on as it came."""

    error: JsonValue


# ---- the chat answers the front writes ---------------------------------------------------------
class TopLogprob(TypedDict):
    """SDK: ``TopLogprob``."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TypedDict):
    """SDK: ``ChatCompletionTokenLogprob``."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    """A chat choice's ``logprobs`` (SDK: ``ChoiceLogprobs``)."""

    content: list[TokenLogprob]


class FunctionCallOut(TypedDict):
    """SDK: ``Function`` of ``ChatCompletionMessageFunctionToolCall``."""

    name: str
    arguments: str


class ToolCallOut(TypedDict):
    """A call in an answer (SDK: ``ChatCompletionMessageFunctionToolCall``)."""

    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """A call in a streamed answer (SDK: ``ChoiceDeltaToolCall``)."""

    index: int


class AssistantMessage(TypedDict, total=False):
    """A chat answer's message (SDK: ``ChatCompletionMessage``)."""

    role: Required[Literal["assistant"]]
    content: Required[str | None]
    tool_calls: list[ToolCallOut]


class ChatChoice(TypedDict):
    """SDK: ``Choice`` of ``ChatCompletion`` (with vLLM's ``stop_reason``)."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    stop_reason: int | str | None


class ChatCompletion(TypedDict):
    """A whole chat answer (SDK: ``ChatCompletion``)."""

    id: str
    object: Literal["chat.completion"]
    created: JsonValue
    model: JsonValue
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(TypedDict, total=False):
    """SDK: ``ChoiceDelta``."""

    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallDelta]


class ChatChunkChoice(TypedDict, total=False):
    """SDK: ``Choice`` of ``ChatCompletionChunk`` (with vLLM's ``stop_reason``)."""

    index: Required[int]
    delta: Required[ChatDelta]
    logprobs: Required[ChatLogprobs | None]
    finish_reason: Required[str | None]
    stop_reason: int | str | None


class ChatCompletionChunk(TypedDict, total=False):
    """One streamed chat chunk (SDK: ``ChatCompletionChunk``)."""

    id: Required[str]
    object: Required[Literal["chat.completion.chunk"]]
    created: Required[JsonValue]
    model: Required[JsonValue]
    choices: list[ChatChunkChoice]
    usage: Usage


class ErrorInfo(TypedDict):
    """SDK: ``ErrorObject``, with the HTTP status as ``code``."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(TypedDict):
    """Every error the front answers: ``{"error": {...}}``."""

    error: ErrorInfo
