"""Tools located from what the chat template does with them, for any template: Qwen2.5's own
template (JSON lines), the default layout of a tokenizer without template, and a template that
writes tools as prose, which a search for JSON renderings never found."""

from __future__ import annotations

import copy

import pytest
from conftest import make_tiny_engine
from test_chat_render import BOOK, MESSAGES, TOOLS, WEATHER
from transformers import AutoTokenizer

from kvnotes.core.document import encode
from kvnotes.core.models import kvnotes_home
from kvnotes.core.repair import Repair
from kvnotes.serving.planning import chat_render
from kvnotes.serving.planning.chat_render import (
    inserted,
    lay_out_chat,
    render_chat_parts,
    tool_block,
    tool_json,
    tool_writings,
)
from kvnotes.serving.planning.front_plan import plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.request import read_request
from kvnotes.serving.skills import ServingSkills

# tools as prose lines: no JSON anywhere
PROSE = ("{% if tools %}Tools you may call:\n{% for t in tools %}* {{ t.function.name }}: "
         "{{ t.function.description }}\n{% endfor %}\n{% endif %}"
         "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
CHAT = [{"role": "system", "content": "You are the assistant of Fjord Air."},
        {"role": "user", "content": "Will it rain in Oslo?"}]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    folder = kvnotes_home() / "models" / "qwen2.5-coder-0.5b"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("Qwen2.5-Coder-0.5B is not converted here (`make models-qwen`)")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def prose_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = PROSE
    return tok


def tools_of(chat) -> list[str]:
    return [p.text for p in chat.parts if p.kind == "tool"]


def check_layout(tok, chat) -> None:
    """Parts make the prompt; every chunk's ids are its text encoded alone, at its offset."""
    assert "".join(p.text for p in chat.parts) == chat.text
    laid = lay_out_chat(tok, chat.parts)
    at, pos = {}, len(laid.lead_ids)
    for p in laid.parts:
        at[p.text] = pos
        pos += len(p.token_ids)
    for chunk in laid.chunks:
        assert chunk.token_ids == tuple(encode(tok, chunk.text))
        assert chunk.after_ids == tuple(laid.ids[:at[chunk.text]])


def test_qwen25_template_tools_are_its_json_lines(qwen_tokenizer):
    chat = render_chat_parts(qwen_tokenizer, CHAT, TOOLS)
    assert chat.layout == "template"
    assert chat.text == qwen_tokenizer.apply_chat_template(
        CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tools_of(chat) == [tool_json(WEATHER), tool_json(BOOK)]
    check_layout(qwen_tokenizer, chat)
    listed = render_chat_parts(qwen_tokenizer, MESSAGES, TOOLS[::-1])  # order, content parts
    assert tools_of(listed) == [tool_json(BOOK), tool_json(WEATHER)]
    check_layout(qwen_tokenizer, listed)


def test_the_default_layout_tools_are_the_block_lines(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    chat = render_chat_parts(tok, CHAT, TOOLS)
    assert chat.layout == "default"
    assert tools_of(chat) == tool_block(TOOLS)[1] == [tool_json(t) for t in TOOLS]
    check_layout(tok, chat)


def test_a_template_writing_tools_as_prose_gets_tool_chunks(prose_tokenizer):
    chat = render_chat_parts(prose_tokenizer, CHAT, TOOLS)
    assert chat.layout == "template"
    assert tool_json(WEATHER) not in chat.text  # what a JSON search looked for
    assert tools_of(chat) == ["* get_weather: The weather of a city, today or tomorrow.",
                              "* book_flight: Books a flight from one city to another (é)."]
    check_layout(prose_tokenizer, chat)
    assert tools_of(render_chat_parts(prose_tokenizer, CHAT, TOOLS[::-1])) == \
        tools_of(chat)[::-1]


def test_a_prose_tool_registered_is_spliced(prose_tokenizer, tmp_path):
    lib = ServingSkills(tmp_path, make_tiny_engine("llama", prose_tokenizer))
    [weather] = tool_writings(prose_tokenizer, chat_render._read_messages(CHAT), [WEATHER])
    assert weather is not None
    lib.add(weather, name="weather-tool")
    req = read_request("chat", {"model": "m", "messages": CHAT, "tools": TOOLS},
                       prose_tokenizer)
    fp = plan_request(req, SkillCatalog(lib.folder, prose_tokenizer), Repair(first=0), 1, None)
    assert fp.skills == ["weather-tool"] and fp.plan.ranges


def test_a_tool_the_template_numbers_is_a_chunk_only_where_it_is_written_so(tokenizer):
    # read beside the probe, each tool is written "2. <name>": the second tool of the request
    # is, the first is text (never a chunk the prompt does not hold)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for t in tools or [] %}{{ loop.index }}. {{ t.function.name }}\n"
                         "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n"
                         "{% endfor %}<assistant>")
    chat = render_chat_parts(tok, CHAT, TOOLS)
    assert "1. get_weather" in chat.text and tools_of(chat) == ["2. book_flight"]
    check_layout(tok, chat)


@pytest.mark.parametrize("before, after, expected", [
    ("<t>\nA\n</t>", "<t>\nA\nB\n</t>", "B"),  # a line added: the line, not "\nB" or "B\n"
    ("<t>\n<i>A</i>\n</t>", "<t>\n<i>A</i>\n<i>B</i>\n</t>", "<i>B</i>"),  # "<" is shared
    ("[a]", "[a, b]", ", b"),
    ("x", "x", None),
    ("abc", "axc", None),
])
def test_inserted_finds_the_one_insertion(before, after, expected):
    assert inserted(before, after) == expected


def test_a_template_that_refuses_the_probe_leaves_tools_as_text(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% if tools and tools | length > 1 and tools[0].function.name == 'kvnotes_probe' %}"
        "{{ raise_exception('no probes') }}{% endif %}"
        "{% for t in tools or [] %}- {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
    chat = render_chat_parts(tok, CHAT, TOOLS)
    assert chat.text.startswith("- get_weather\n- book_flight\n") and tools_of(chat) == []
