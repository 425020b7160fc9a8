"""What vLLM's ``/v1/completions`` sends, as pydantic models: every answer the front reads is
checked against them before any of it is used.

Only the fields the front reads are modelled (extra fields pass through untouched), with the
types vLLM's ``CompletionResponse`` and ``CompletionStreamResponse`` give them. An answer of
another shape is vLLM misbehaving (or something else on its port): :func:`check_completion`
and :func:`check_chunk` say where it differs, and the front answers 502 (or, in a stream,
ends with an error event) instead of failing on it.

Example:
    >>> check_completion({"choices": [{"index": 0, "text": "hi"}]})["choices"][0]["text"]
    'hi'
    >>> try:
    ...     check_completion({"choices": [{"text": 5}]})
    ... except WrongShape as err:
    ...     print(err)
    choices.0.text: Input should be a valid string
"""

from __future__ import annotations

from typing import cast

from pydantic import BaseModel, ConfigDict, ValidationError

import kvnotes.serving.json_types as jt


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Logprobs(_Open):
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


class Choice(_Open):
    index: int = 0
    text: str
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int | None = None
    total_tokens: int | None = None


class Completion(_Open):
    choices: list[Choice]
    usage: Usage | None = None


class CompletionChunk(_Open):
    choices: list[Choice] = []
    usage: Usage | None = None


class WrongShape(ValueError):
    """An upstream answer that is not what vLLM sends (``str(err)``: where, and how)."""


def _checked(model: type[BaseModel], data: object) -> dict[str, object]:
    try:
        model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        raise WrongShape(f"{where}: {first['msg']}") from None
    if not isinstance(data, dict):  # a model validates objects only: never taken
        raise WrongShape("the answer is not an object")
    return dict(data)


def check_completion(data: object) -> jt.Completion:
    """``data`` when it is a completion as vLLM sends it; :class:`WrongShape` otherwise."""
    return cast(jt.Completion, _checked(Completion, data))  # its fields as Completion checks


def check_chunk(data: object) -> jt.CompletionChunk:
    """``data`` when it is a streamed completion chunk; :class:`WrongShape` otherwise."""
    return cast(jt.CompletionChunk, _checked(CompletionChunk, data))
