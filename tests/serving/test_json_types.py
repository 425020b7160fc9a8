"""The JSON types name the fields the front checks and passes on, and a checked body is the
very object that came (the types add no copy, no conversion)."""

from __future__ import annotations

import pytest

from kvnotes.serving.json_types import ChatBody, CompletionBody, SamplingFields
from kvnotes.serving.planning.request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FIELD_TYPES,
    SAMPLING_FIELDS,
    BadRequest,
    check_body,
)


def test_the_body_types_name_the_fields_the_front_reads():
    assert SamplingFields.__optional_keys__ == SAMPLING_FIELDS
    # cache_salt and suffix: checked, then forwarded (the front plans neither)
    assert set(CompletionBody.__annotations__) <= COMPLETION_FIELDS | {"cache_salt", "suffix"}
    assert set(ChatBody.__annotations__) <= CHAT_FIELDS | {"cache_salt"}
    # every field whose type check_body checks is typed by one of them
    assert set(FIELD_TYPES) <= set(CompletionBody.__annotations__) | set(ChatBody.__annotations__)


def test_check_body_gives_the_body_itself_or_the_same_refusal():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "x": 1}
    assert check_body("chat", body) is body
    with pytest.raises(BadRequest, match="messages must be a non-empty list"):
        check_body("chat", {"messages": []})
    with pytest.raises(BadRequest, match="the body must be a JSON object"):
        check_body("completion", ["prompt"])
