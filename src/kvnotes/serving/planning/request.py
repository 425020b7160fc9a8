"""Reading one OpenAI request for the front: can it be planned, and what does it ask.

:func:`read_request` turns a client's JSON body for ``/v1/completions`` or
``/v1/chat/completions`` into a :class:`FrontRequest`: the prompt (text, or token ids), the
sampling fields passed on to vLLM's completions endpoint, streaming, what the client asked of
``usage`` and ``logprobs``, and the per-request kvnotes options (``extra_body={"kvnotes":
{...}}``: :class:`FrontOptions`). A chat's messages are rendered with the tokenizer's chat
template (``add_generation_prompt=True``), the text vLLM itself would tokenize.

Anything the front does not model exactly raises :class:`Unplannable` with the reason (a field
outside :data:`COMPLETION_FIELDS` / :data:`CHAT_FIELDS`, several prompts or choices, a client
``cache_salt``, non-text chat content, tools, a template that fails, a bad kvnotes option):
the front then forwards the request to vLLM as it came. Pure functions, no HTTP.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvnotes.core.errors import KvnotesError
from kvnotes.serving.library.manifest import splice_salt

OPTIONS_KEY = "kvnotes"
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
                                                "max_completion_tokens", "add_generation_prompt"}
OPTION_NAMES = ("splice", "tenant", "repair", "guard")


class Unplannable(Exception):
    """The request is forwarded exactly; ``str(err)`` says why (sent back in a header)."""


@dataclass(frozen=True, slots=True)
class FrontOptions:
    """Per-request options (``extra_body={"kvnotes": {...}}``); None: the front's default.

    - ``splice``: False forwards the request exactly (no skill is spliced).
    - ``tenant``: the request's splice salt is this tenant's (``kvnotes-splice:<tenant>``).
    - ``repair``: the first tokens of each spliced skill recomputed in context (0: none).
    - ``guard``: tau; when the first answer token's top-2 log-prob margin is under it, the
      answer comes from an exact request (0: never).
    """

    splice: bool = True
    tenant: str | None = None
    repair: int | None = None
    guard: float | None = None


def read_options(raw: object) -> FrontOptions:
    """The ``kvnotes`` object of a body as options; a bad value raises :class:`Unplannable`."""
    if raw is None:
        return FrontOptions()
    if not isinstance(raw, Mapping):
        raise Unplannable(f"{OPTIONS_KEY} must be an object of {', '.join(OPTION_NAMES)}")
    unknown = sorted(set(raw) - set(OPTION_NAMES))
    if unknown:
        raise Unplannable(f"unknown {OPTIONS_KEY} option(s) {unknown}: use {OPTION_NAMES}")
    splice, tenant = raw.get("splice", True), raw.get("tenant")
    repair, guard = raw.get("repair"), raw.get("guard")
    if not isinstance(splice, bool):
        raise Unplannable(f"{OPTIONS_KEY}.splice must be true or false, got {splice!r}")
    if tenant is not None:
        try:
            splice_salt(tenant)  # the tenant's spelling rule
        except KvnotesError as err:
            raise Unplannable(str(err)) from err
    if repair is not None and (isinstance(repair, bool) or not isinstance(repair, int)
                               or repair < 0):
        raise Unplannable(f"{OPTIONS_KEY}.repair must be a token count >= 0, got {repair!r}")
    if guard is not None and (isinstance(guard, bool) or not isinstance(guard, numbers.Real)
                              or not 0 <= float(guard) < float("inf")):
        raise Unplannable(f"{OPTIONS_KEY}.guard must be a log-prob margin >= 0, got {guard!r}")
    return FrontOptions(splice, tenant, repair, None if guard is None else float(guard))


@dataclass
class FrontRequest:
    """One plannable request: prompt, what to pass on, what the client expects back."""

    kind: str  # "completion" or "chat"
    options: FrontOptions
    sampling: dict[str, Any]  # passed on to vLLM's /v1/completions
    text: str | None = None  # the prompt's text (chat: rendered), when it came as text
    ids: list[int] | None = None  # the prompt's token ids, when it came as ids
    stream: bool = False
    include_usage: bool = False  # streaming: the client asked for the usage chunk
    logprobs: int | None = None  # top log-probs per token the client asked for (None: none)


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise Unplannable(f"{what} field(s) {unknown} are passed to vLLM as they are")


def _stream_fields(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise Unplannable("stream must be true or false")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, Mapping) or set(opts) - {"include_usage"}:
        raise Unplannable("stream_options other than include_usage are passed to vLLM as "
                          "they are")
    return stream, bool(opts.get("include_usage")) and stream


def _one_choice(body: Mapping[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise Unplannable("n > 1 is passed to vLLM as it is")


def render_chat(tokenizer: Any, messages: object) -> str:
    """The prompt text of a chat, as vLLM renders it (the model's chat template,
    ``add_generation_prompt=True``); text content only, else :class:`Unplannable`."""
    if not isinstance(messages, list) or not messages:
        raise Unplannable("messages must be a non-empty list")
    plain = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) \
                or set(m) - {"role", "content", "name"}:
            raise Unplannable("only messages of role and text content are planned")
        if not isinstance(m.get("content"), str):
            raise Unplannable("only text content (a string) is planned")
        plain.append(dict(m))
    if not getattr(tokenizer, "chat_template", None):
        raise Unplannable("the tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 -- a template's own failure: vLLM answers it
        raise Unplannable(f"the chat template failed: {type(err).__name__}: {err}") from err
    if not isinstance(text, str) or not text:
        raise Unplannable("the chat template rendered no text")
    return text


def read_request(kind: str, body: object, tokenizer: Any) -> FrontRequest:
    """A :class:`FrontRequest` of a client's body (``kind``: a value of :data:`ENDPOINTS`);
    :class:`Unplannable` when it must be forwarded as it came."""
    if not isinstance(body, dict):
        raise Unplannable("the body is not a JSON object")
    options = read_options(body.get(OPTIONS_KEY))
    if not options.splice:
        raise Unplannable(f"{OPTIONS_KEY}.splice is false")
    _one_choice(body)
    stream, include_usage = _stream_fields(body)
    sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
    req = FrontRequest(kind, options, sampling, stream=stream, include_usage=include_usage)
    if kind == "completion":
        _check_fields(body, COMPLETION_FIELDS, "completion")
        if body.get("echo"):
            raise Unplannable("echo is passed to vLLM as it is")
        if body.get("add_special_tokens", True) is not True:
            raise Unplannable("add_special_tokens=false is passed to vLLM as it is")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            req.text = prompt
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
            req.ids = [int(t) for t in prompt]
        else:
            raise Unplannable("the prompt is not one text or one list of token ids")
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise Unplannable("logprobs must be a count")
        req.logprobs = lp
    elif kind == "chat":
        _check_fields(body, CHAT_FIELDS, "chat")
        if body.get("add_generation_prompt", True) is not True:
            raise Unplannable("add_generation_prompt=false is passed to vLLM as it is")
        req.text = render_chat(tokenizer, body.get("messages"))
        if body.get("max_completion_tokens") is not None:
            sampling["max_tokens"] = body["max_completion_tokens"]
        sampling.setdefault("max_tokens", None)  # chat's default: up to the context's end
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            if isinstance(top, bool) or not isinstance(top, int) or top < 0:
                raise Unplannable("top_logprobs must be a count")
            req.logprobs = top
    else:
        raise Unplannable(f"no plan for {kind!r} requests")
    return req
