"""Agent traffic through the front against a fake vLLM: chats with ``tools``, documents sent as
content parts, tool calls in the answer, and chats on a model without chat template.

The fake records every body: a spliced request and its ``splice: false`` counterpart must send
the same prompt ids to ``/v1/completions``; a structured chat the front does not splice is sent
exactly by the front as its own ids; only `tool_choice` required or named goes to vLLM's chat
endpoint, which constrains decoding (with the tool parser `kvnotes serve` starts it with)."""

from __future__ import annotations

import json

import openai
import pytest
from _front_fakes import BLOCK, MODEL, FakeVLLM
from conftest import make_tiny_engine
from test_chat_render import gemma_tokenizer  # noqa: F401 -- a fixture

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.proxy import REASON_HEADER
from kvnotes.serving.planning.chat_render import tool_json
from kvnotes.serving.planning.request import read_request
from kvnotes.serving.skills import ServingSkills

LOOKUP = {"type": "function", "function": {
    "name": "lookup_booking",
    "description": ("Looks a booking up by its six-letter code and returns the passenger's "
                    "name, the flights with their dates, times and seats, the fare class, the "
                    "checked bags allowed, whether the ticket can still be refunded in full, "
                    "and any open request the passenger made about meals or assistance."),
    "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "the six-letter booking code"},
        "include_history": {"type": "boolean", "description": "also list past changes"}},
        "required": ["code"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
DOC = ("Fjord Air baggage rules. One cabin bag of up to eight kilograms is free on every "
       "flight. A checked bag costs thirty euros when it is added online and fifty euros at the "
       "airport. A bag that arrives torn is repaired or paid for when the damage is reported "
       "within seven days of the flight, with the tag number and a photo of the damage.")
QUESTION = "Can I get my booking ABCDEF refunded?"
CALL = ['<tool_call>{"name": "lookup_booking", ', '"arguments": {"code": "ABCDEF"}}</tool_call>']


def messages(question: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are the assistant of Fjord Air."},
            {"role": "user", "content": question}]


def content_parts() -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "text", "text": DOC},
                                         {"type": "text", "text": "How much is a checked bag?"}]}]


@pytest.fixture(scope="module")
def library(tmp_path_factory, tokenizer):
    lib = ServingSkills(tmp_path_factory.mktemp("tool-skills"),
                        make_tiny_engine("llama", tokenizer))
    lib.add(tool_json(LOOKUP), name="lookup")
    lib.add(DOC, name="baggage-doc")
    return lib


@pytest.fixture
def front(fake, library, tokenizer):
    from kvnotes.serving.planning.match import SkillCatalog

    with Front(FrontConfig(upstream=fake.url), SkillCatalog(library.folder, tokenizer)) as f:
        yield f


@pytest.fixture
def client(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=30)


def kvnotes_usage(usage) -> dict:
    return usage.model_extra["kvnotes"]


# ---- spliced and exact see the same tokens -------------------------------------------------------
def test_a_registered_tool_is_spliced_and_splice_false_sends_the_same_ids(front, fake, client,
                                                                          tokenizer):
    got = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), tools=[WEATHER, LOOKUP], max_tokens=4)
    assert got.headers[REASON_HEADER].startswith("spliced")
    assert kvnotes_usage(got.parse().usage)["plan"]["skills"] == ["lookup"]
    real = fake.posted()[-1]
    assert real["cache_salt"].startswith("kvnotes-splice")
    exact = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), tools=[WEATHER, LOOKUP], max_tokens=4,
        extra_body={"kvnotes": {"splice": False}})
    assert exact.headers[REASON_HEADER].startswith("exact: opted_out")
    assert exact.parse().choices[0].message.content == "exact answer"
    sent = fake.posted()[-1]
    assert "cache_salt" not in sent
    assert sent["prompt"] == real["prompt"]
    body = {"model": MODEL, "messages": messages(), "tools": [WEATHER, LOOKUP]}
    assert sent["prompt"] == read_request("chat", body, tokenizer).prompt_ids
    assert fake.posted("/v1/chat/completions") == []


def test_a_tool_is_spliced_wherever_it_comes_in_the_list(front, fake, client):
    for tools in ([LOOKUP, WEATHER], [WEATHER, LOOKUP]):
        got = client.chat.completions.create(model=MODEL, messages=messages(), tools=tools)
        assert kvnotes_usage(got.usage)["plan"]["skills"] == ["lookup"]
        assert kvnotes_usage(got.usage)["spliced_tokens"] > 0


def test_tools_without_a_known_chunk_are_sent_exactly_as_ids(front, fake, client, tokenizer):
    got = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), tools=[WEATHER], max_tokens=4)
    assert got.headers[REASON_HEADER].startswith("exact: no_chunk")
    assert got.parse().choices[0].message.content == "exact answer"
    [sent] = fake.posted()
    body = {"model": MODEL, "messages": messages(), "tools": [WEATHER]}
    assert sent["prompt"] == read_request("chat", body, tokenizer).prompt_ids
    assert "cache_salt" not in sent and sent["max_tokens"] == 4
    assert fake.posted("/v1/chat/completions") == []
    assert front.stats["exact"] == 1


def test_a_document_sent_as_a_content_part_is_spliced(front, fake, client):
    got = client.chat.completions.create(model=MODEL, messages=content_parts())
    assert kvnotes_usage(got.usage)["plan"]["skills"] == ["baggage-doc"]
    real = fake.posted()[-1]
    client.chat.completions.create(model=MODEL, messages=content_parts(),
                                   extra_body={"kvnotes": {"splice": False}})
    assert fake.posted()[-1]["prompt"] == real["prompt"]


def test_a_plain_chat_opted_out_is_still_forwarded_as_it_came(front, fake, client):
    client.chat.completions.create(model=MODEL, messages=messages(),
                                   extra_body={"kvnotes": {"splice": False}})
    assert fake.posted("/v1/chat/completions")[0]["messages"] == messages()
    assert fake.posted() == []


# ---- tool calls in the answer --------------------------------------------------------------------
def test_the_models_call_comes_back_as_tool_calls(front, fake, client):
    fake.words = CALL
    got = client.chat.completions.create(model=MODEL, messages=messages(),
                                         tools=[WEATHER, LOOKUP])
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "lookup_booking"
    assert json.loads(call.function.arguments) == {"code": "ABCDEF"}


def test_a_streamed_call_comes_back_as_a_tool_calls_delta(front, fake, client):
    fake.words = ["Checking. ", *CALL]
    stream = client.chat.completions.create(model=MODEL, messages=messages(),
                                            tools=[WEATHER, LOOKUP], stream=True)
    chunks = [c for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Checking. "
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] \
        == [(0, "lookup_booking", {"code": "ABCDEF"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_malformed_call_is_plain_content_never_an_error(front, fake, client):
    fake.words = ['<tool_call>{"name": "lookup_booking", ', '"arguments": {oops</tool_call>']
    got = client.chat.completions.create(model=MODEL, messages=messages(), tools=[LOOKUP])
    assert got.choices[0].message.content == "".join(fake.words)
    assert not got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=MODEL, messages=messages(), tools=[LOOKUP],
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(fake.words)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_tool_choice_none_renders_tools_but_returns_no_calls(front, fake, client):
    fake.words = CALL
    got = client.chat.completions.create(model=MODEL, messages=messages(), tools=[LOOKUP],
                                         tool_choice="none")
    assert got.choices[0].message.content == "".join(CALL)
    assert not got.choices[0].message.tool_calls


# ---- a model without chat template (Gemma 3 270M) ------------------------------------------------
@pytest.fixture(scope="module")
def gemma_library(tmp_path_factory, gemma_tokenizer):  # noqa: F811
    lib = ServingSkills(tmp_path_factory.mktemp("gemma-tool-skills"),
                        make_tiny_engine("gemma3_text", gemma_tokenizer))
    lib.add(tool_json(LOOKUP), name="lookup")
    return lib


def test_gemma_chats_are_planned_with_the_default_layout(gemma_library, gemma_tokenizer):  # noqa: F811
    from kvnotes.serving.planning.match import SkillCatalog

    fake = FakeVLLM()
    try:
        catalog = SkillCatalog(gemma_library.folder, gemma_tokenizer)
        with Front(FrontConfig(upstream=fake.url, block_size=BLOCK), catalog) as front:
            client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
            got = client.chat.completions.create(model=MODEL, messages=messages(),
                                                 tools=[WEATHER, LOOKUP])
            assert kvnotes_usage(got.usage)["plan"]["skills"] == ["bos", "lookup"]
            real = fake.posted()[-1]
            body = {"model": MODEL, "messages": messages(), "tools": [WEATHER, LOOKUP]}
            req = read_request("chat", body, gemma_tokenizer)
            assert req.layout == "default" and real["prompt"] == req.prompt_ids
            assert real["prompt"][0] == gemma_tokenizer.bos_token_id
            plain = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages())  # no tool: nothing known, sent exactly
            assert plain.headers[REASON_HEADER].startswith("exact: no_skill")
            assert fake.posted()[-1]["prompt"] == read_request(
                "chat", {"messages": messages()}, gemma_tokenizer).prompt_ids
            assert fake.posted("/v1/chat/completions") == []
    finally:
        fake.close()


def test_a_planning_failure_on_a_structured_chat_is_answered_exactly(front, fake, client,
                                                                     monkeypatch):
    import kvnotes.serving.front.service as service

    def fails(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "plan_request", fails)
    got = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages(),
                                                           tools=[LOOKUP])
    assert got.headers[REASON_HEADER].startswith("exact: plan_error")
    assert got.parse().choices[0].message.content == "exact answer"
    assert fake.posted("/v1/chat/completions") == []


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "lookup_booking"}}])
def test_required_and_named_tool_choice_are_left_to_vllm(front, fake, client, choice):
    # they constrain decoding, which vLLM's own chat route does (structured outputs): the front
    # forwards the request as it came, spliced never
    got = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), tools=[WEATHER, LOOKUP], tool_choice=choice,
        max_tokens=4)
    assert got.headers[REASON_HEADER].startswith("forwarded: tool_choice")
    assert got.parse().choices[0].message.content == "vllm chat"
    forwarded = fake.posted("/v1/chat/completions")[-1]
    assert forwarded["tool_choice"] == choice and forwarded["tools"] == [WEATHER, LOOKUP]
