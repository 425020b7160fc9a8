"""The JSON types name the fields the front checks and passes on, and a checked body is the
very object that came (the types add no copy, no conversion); the per-request kvnotes options
are read strictly, a bad one refused naming the option."""

from __future__ import annotations

import pytest

from kvnotes.serving.json_types import ChatBody, CompletionBody, SamplingFields
from kvnotes.serving.planning.request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FIELD_TYPES,
    SAMPLING_FIELDS,
    BadRequest,
    FrontOptions,
    check_body,
    read_options,
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


@pytest.mark.parametrize("raw, param, message", [
    ({"repair": True}, "kvnotes.repair",
     "kvnotes.repair: input should be a valid integer, got True"),
    ({"repair": 2.0}, "kvnotes.repair", "kvnotes.repair: input should be a valid integer, got 2.0"),
    ({"repair": -1}, "kvnotes.repair",
     "kvnotes.repair: input should be greater than or equal to 0, got -1"),
    ({"guard": False}, "kvnotes.guard",
     "kvnotes.guard: input should be a valid number, got False"),
    ({"guard": float("inf")}, "kvnotes.guard",
     "kvnotes.guard: input should be a finite number, got inf"),
    ({"splice": 0}, "kvnotes.splice", "kvnotes.splice: input should be a valid boolean, got 0"),
    ({"tenant": 7}, "kvnotes.tenant", "kvnotes.tenant: input should be a valid string, got 7"),
    ({"tenant": "a b"}, "kvnotes.tenant", "tenant 'a b': use 1-64 letters, digits, '_', '.' or "
                                          "'-' (it becomes part of the request's cache_salt)"),
    ({"splice": True, "mode": "all"}, "kvnotes.mode",
     "unknown kvnotes option 'mode': use splice, tenant, repair, guard"),
])
def test_the_kvnotes_options_are_read_strictly(raw, param, message):
    with pytest.raises(BadRequest) as err:
        read_options(raw)
    assert (err.value.param, str(err.value)) == (param, message)


def test_the_kvnotes_options_default_and_convert():
    assert read_options(None) == FrontOptions()
    opts = read_options({"splice": False, "tenant": "acme", "repair": 16, "guard": 1})
    assert opts == FrontOptions(False, "acme", 16, 1.0) and isinstance(opts.guard, float)
