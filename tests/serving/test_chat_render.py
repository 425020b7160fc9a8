"""The front's chat renderer and tool-call parser, on the real tokenizers of both bundled models
(SmolLM2: a template that ignores tools; Gemma 3 270M: no template) and on SmolLM2's tokenizer
given a hermes-style template that renders tools (as Qwen's does)."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from kvnotes.core.chat import renders_tools
from kvnotes.core.document import encode
from kvnotes.core.models import BUNDLED, kvnotes_home
from kvnotes.serving.front.tool_calls import ToolCallStream, parse_tool_calls
from kvnotes.serving.planning.chat_render import (
    TOOL_BLOCK_HEAD,
    ChatShapeError,
    lay_out_chat,
    render_chat_parts,
    tool_json,
)
from kvnotes.serving.planning.request import Unplannable, read_request

# a template that renders tools and tool calls the way Qwen 2.5's does (hermes format)
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You help.{% endif %}
<tools>
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
</tools>
Call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city, today or tomorrow.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BOOK = {"type": "function", "function": {
    "name": "book_flight", "description": "Books a flight from one city to another (é).",
    "parameters": {"type": "object", "properties": {"from": {"type": "string"},
                                                    "to": {"type": "string"}}}}}
TOOLS = [WEATHER, BOOK]
MESSAGES = [
    {"role": "system", "content": "You are the assistant of Fjord Air."},
    {"role": "user", "content": [{"type": "text", "text": "Document one: bags."},
                                 {"type": "text", "text": "Document two: refunds."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    converted = kvnotes_home() / "models" / "gemma3-270m"
    if (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    try:
        gguf = BUNDLED["gemma3-270m"].locate_gguf()
    except Exception as err:  # noqa: BLE001 -- the model package is not installed here
        pytest.skip(f"Gemma's tokenizer is not available: {err}")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def hermes_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = HERMES
    return tok


@pytest.fixture(params=["smollm2", "gemma", "hermes"])
def any_tokenizer(request, tokenizer, gemma_tokenizer, hermes_tokenizer):
    return {"smollm2": tokenizer, "gemma": gemma_tokenizer,
            "hermes": hermes_tokenizer}[request.param]


# ---- rendering ---------------------------------------------------------------------------------
def test_parts_concatenate_to_the_prompt_and_chunks_encode_alone(any_tokenizer):
    tok = any_tokenizer
    chat = render_chat_parts(tok, MESSAGES, TOOLS)
    assert "".join(p.text for p in chat.parts) == chat.text
    assert [(p.kind, p.text) for p in chat.parts if p.is_chunk] == [
        ("tool", tool_json(WEATHER)), ("tool", tool_json(BOOK)),
        ("content", "Document one: bags."), ("content", "Document two: refunds.")]
    assert "Document one: bags.\nDocument two: refunds." in chat.text  # vLLM's join
    laid = lay_out_chat(tok, chat.parts)
    assert laid.ids == [*laid.lead_ids, *(t for p in laid.parts for t in encode(tok, p.text))]
    pos = len(laid.lead_ids)
    offsets = {}
    for p in laid.parts:
        offsets[p.text] = pos
        pos += len(p.token_ids)
    assert len(laid.chunks) == 4
    for chunk in laid.chunks:
        assert chunk.token_ids == tuple(encode(tok, chunk.text))
        assert chunk.after_ids == tuple(laid.ids[:offsets[chunk.text]])


def test_a_tools_chunk_ids_do_not_depend_on_the_order_of_tools(any_tokenizer):
    tok = any_tokenizer
    one = lay_out_chat(tok, render_chat_parts(tok, MESSAGES[:2], TOOLS).parts)
    other = lay_out_chat(tok, render_chat_parts(tok, MESSAGES[:2], TOOLS[::-1]).parts)
    tools = {c.text: c.token_ids for c in one.chunks if c.kind == "tool"}
    assert tools == {c.text: c.token_ids for c in other.chunks if c.kind == "tool"}
    assert one.ids != other.ids


def test_the_layout_follows_what_the_template_renders(tokenizer, gemma_tokenizer,
                                                      hermes_tokenizer):
    assert renders_tools(hermes_tokenizer) and not renders_tools(tokenizer)
    assert not renders_tools(gemma_tokenizer)
    hermes = render_chat_parts(hermes_tokenizer, MESSAGES, TOOLS)
    assert hermes.layout == "template" and TOOL_BLOCK_HEAD not in hermes.text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in hermes.text
    smol = render_chat_parts(tokenizer, MESSAGES, TOOLS)
    assert smol.layout == "kvnotes_tools"
    # the block is in the first system turn, after its text; calls and results are written out
    assert smol.text.startswith("<|im_start|>system\nYou are the assistant of Fjord Air.\n\n"
                                + TOOL_BLOCK_HEAD)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' \
        in smol.text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in smol.text
    # no system message: the block is a system turn of its own
    alone = render_chat_parts(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    assert alone.text.startswith("<|im_start|>system\n" + TOOL_BLOCK_HEAD)
    assert "SmolLM" not in alone.text


def test_a_content_part_is_found_where_it_is_not_where_its_text_first_occurs(any_tokenizer):
    messages = [{"role": "system", "content": "Paris is nice."},
                {"role": "user", "content": [{"type": "text", "text": "Paris is nice."},
                                             {"type": "text", "text": "Why?"}]}]
    chat = render_chat_parts(any_tokenizer, messages)
    at = {}
    pos = 0
    for p in chat.parts:
        if p.is_chunk:
            at[p.text] = pos
        pos += len(p.text)
    assert at["Paris is nice."] > chat.text.index("Paris is nice.")
    assert chat.text[at["Paris is nice."]:].startswith("Paris is nice.\nWhy?")


def test_a_template_that_changes_content_still_gives_parts_of_its_text(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}\n"
                         "{% endfor %}<assistant>")
    messages = [{"role": "user", "content": [{"type": "text", "text": "  padded doc "},
                                             {"type": "text", "text": "question"}]}]
    chat = render_chat_parts(tok, messages)
    assert chat.text == "<user>padded doc \nquestion\n<assistant>"
    assert "".join(p.text for p in chat.parts) == chat.text
    assert [p.text for p in chat.parts if p.is_chunk] == ["question"]


def test_a_tool_written_with_an_indent_is_found_too(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for t in tools or [] %}{{ t.function | tojson(indent=4) }}\n"
                         "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n"
                         "{% endfor %}<assistant>")
    chat = render_chat_parts(tok, [{"role": "user", "content": "hi"}], TOOLS)
    assert chat.layout == "template"
    assert [p.text for p in chat.parts if p.kind == "tool"] == [
        json.dumps(t["function"], ensure_ascii=False, indent=4) for t in TOOLS]


def test_a_plain_chat_is_the_templates_own_text_and_not_structured(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = render_chat_parts(tokenizer, messages)
    assert chat.text == tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
    assert not chat.structured and chat.layout == "template"
    assert [p.kind for p in chat.parts] == ["text"]


def test_no_template_gets_the_default_layout(gemma_tokenizer):
    chat = render_chat_parts(gemma_tokenizer, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert chat.layout == "default" and chat.structured
    assert chat.text == ("System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Bye"
                         "\n\nAssistant:")
    laid = lay_out_chat(gemma_tokenizer, chat.parts)
    assert laid.lead_ids == (gemma_tokenizer.bos_token_id,)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}],
    [{"role": "user", "content": "hi", "audio": {}}],
    [{"role": "user"}],
])
def test_chats_the_front_does_not_render(tokenizer, messages):
    with pytest.raises(ChatShapeError):
        render_chat_parts(tokenizer, messages)
    with pytest.raises(Unplannable) as caught:
        read_request("chat", {"messages": messages}, tokenizer)
    assert caught.value.code == "chat_shape"


def test_read_request_carries_parts_chunks_and_tool_choice(tokenizer):
    body = {"messages": MESSAGES[:2], "tools": TOOLS, "kvnotes": {"splice": False}}
    req = read_request("chat", body, tokenizer)
    assert req.structured and req.tool_calls and req.layout == "kvnotes_tools"
    assert [c.kind for c in req.chunks] == ["tool", "tool", "content", "content"]
    assert req.prompt_ids == [t for p in req.parts for t in encode(tokenizer, p.text)]
    assert not read_request("chat", {**body, "tool_choice": "none"}, tokenizer).tool_calls
    named = {"type": "function", "function": {"name": "get_weather"}}
    for constrained in (named, "required"):  # vLLM constrains the decoding: forwarded
        with pytest.raises(Unplannable) as caught:
            read_request("chat", {**body, "tool_choice": constrained}, tokenizer)
        assert caught.value.code == "tool_choice"
    with pytest.raises(Unplannable):
        read_request("chat", {**body, "tool_choice": "always"}, tokenizer)
    with pytest.raises(Unplannable) as caught:  # a plain chat opted out: forwarded as it came
        read_request("chat", {"messages": [{"role": "user", "content": "hi"}],
                              "kvnotes": {"splice": False}}, tokenizer)
    assert caught.value.code == "opted_out"


# ---- tool calls --------------------------------------------------------------------------------
def test_hermes_calls_become_openai_tool_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "book_flight", "parameters": {"to": "Bergen"}}'
            "</tool_call>")
    got = parse_tool_calls(text)
    assert got.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Oslo"}), ("book_flight", {"to": "Bergen"})]
    assert all(c.id.startswith("call_") for c in got.calls)
    assert len({c.id for c in got.calls}) == 2
    assert got.calls[0].to_dict()["type"] == "function"
    assert len(parse_tool_calls(text, parallel=False).calls) == 1


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),  # a bare JSON call
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}', [("f", {"a": 2})]),  # left open
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', []),  # malformed JSON
    ('<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),  # arguments not an object
    ('<tool_call>{"name": "f"} </tool_call> <tool_call>nope</tool_call>', []),  # one bad
    ("The answer is {a} and {b}", []),
    ("", []),
])
def test_anything_but_well_formed_calls_is_plain_content(text, calls):
    got = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls
    if not calls:
        assert got.content == text


def test_a_streamed_call_is_held_and_its_text_before_passed_on():
    stream = ToolCallStream()
    pieces = ["Sure", ". <", "tool", "_call>", '{"name": "f", ', '"arguments": {"x": 1}}',
              "</tool_call>"]
    sent = "".join(stream.feed(p) for p in pieces)
    assert sent == "Sure. "
    rest, calls = stream.finish()
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_a_streamed_answer_without_a_call_is_all_passed_on():
    stream = ToolCallStream()
    pieces = ["a < b", " and <tool", " is not", " a call"]
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert sent + rest == "".join(pieces) and calls == ()
    broken = ToolCallStream()
    held = "".join(broken.feed(p) for p in ["<tool_call>{oops", "</tool_call>"])
    assert held == "" and broken.finish() == ("<tool_call>{oops</tool_call>", ())
