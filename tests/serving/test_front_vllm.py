"""The OpenAI front on a real vLLM server (CPU build, .venv-vllm): plain OpenAI clients get the
answer kvnotes' own phased client gets on the same plan.

On the session's server (``vllm_launch``): SmolLM2 in float32 with the connector, blocks of 32
tokens, the front in front of it (``LaunchConfig.front``). The openai SDK (sync, async,
streaming) and one raw HTTP request go through the front;
:class:`~kvnotes.serving.compose_client.ComposeClient` sends the same parts to vLLM directly with
the same repair; an opted-out request equals its part-wise ids (the spliced request's) sent to
vLLM itself.
"""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest
from conftest import wait_for_rescan

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.agent.skills import skill_text
from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeClient
from kvnotes.serving.planning.layout import prompt_ids
from kvnotes.serving.planning.request import render_chat

pytestmark = pytest.mark.vllm

BLOCK = 32
USER = ("\n\nCustomer Mei Lin (booking C48213) writes: my bag arrived torn and I want to cancel "
        "my return flight. What do I get?\nAgent:")
NAMES = ("refunds", "baggage")


@pytest.fixture(scope="module")
def served(vllm_launch):
    """The session's server (blocks of 32 tokens, the front in front of it) with this module's
    skills; its requests use the shared splice salt, which no other module uses."""
    launch = vllm_launch
    assert launch.config.block_size == BLOCK
    assert launch.skills is not None and launch.front is not None
    launch.skills.add(HEADER, name="header")
    for name in NAMES:
        launch.skills.add(skill_text(name), name=name, after=HEADER)
    wait_for_rescan()
    return launch


def test_openai_clients_through_the_front_get_the_phased_answer(served, smollm2):
    launch = served
    name = launch.server.served_name
    # the second skill is not where it was compiled: its first tokens are recomputed (a phase)
    parts = [HEADER, skill_text(NAMES[1]), skill_text(NAMES[0]), USER]
    prompt = "".join(parts)
    compose = ComposeClient(launch.server.url, name, smollm2.tokenizer,
                            skills=launch.skills.folder, block_size=BLOCK)
    want = compose.complete(parts, max_tokens=12, repair=Repair(first=32))
    assert want.ok, want.error
    assert want.phases >= 1 and want.spliced_tokens

    sync = openai.OpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0, timeout=300)
    got = sync.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    info = got.usage.model_extra["kvnotes"]
    assert got.choices[0].text == want.text
    assert want.plan is not None and info["plan"]["ranges"] == want.plan.to_dict()["ranges"]
    assert info["phases"] == want.phases and info["guard_fired"] is False
    assert info["spliced_tokens"] == want.spliced_tokens
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.prompt_tokens_details.cached_tokens >= info["spliced_tokens"]
    assert info["report"] is not None and "no_report" not in info

    # ended on a stop string: vLLM's text cut where vLLM cuts it, and the report's absence said
    stop = want.text[len(want.text) // 2:][:3]
    cut = sync.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                  stop=[stop])
    assert cut.choices[0].text == want.text[:want.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    cut_info = cut.usage.model_extra["kvnotes"]
    assert cut_info["report"] is None and cut_info["no_report"] == "stop_string"
    assert cut_info["plan"]["ranges"] == info["plan"]["ranges"]

    stream = sync.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                     stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.model_extra["kvnotes"]["plan"]["ranges"] == want.plan.to_dict()["ranges"]
    assert chunks[-1].usage.model_extra["kvnotes"]["no_report"] == "stream"

    async def through_async() -> str:
        client = openai.AsyncOpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0,
                                    timeout=300)
        out = await client.completions.create(model=name, prompt=prompt, max_tokens=12,
                                              temperature=0)
        await client.close()
        return out.choices[0].text

    assert asyncio.run(through_async()) == want.text

    raw = httpx2.post(launch.url + "/v1/completions", timeout=300, json={
        "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert raw.status_code == 200, raw.text
    assert raw.json()["choices"][0]["text"] == want.text

    # a chat: rendered by the template, matched, answered as the same prompt sent as text
    messages = [{"role": "system", "content": HEADER + skill_text(NAMES[0])},
                {"role": "user", "content": USER.strip()}]
    chat = sync.chat.completions.create(model=name, messages=messages, max_tokens=12,
                                        temperature=0)
    as_text = sync.completions.create(model=name, max_tokens=12, temperature=0,
                                      prompt=render_chat(smollm2.tokenizer, messages))
    assert chat.choices[0].message.content == as_text.choices[0].text
    assert chat.usage.model_extra["kvnotes"]["plan"]["skills"] == ["header", NAMES[0]]

    # opted out: the spliced request's very ids, computed exactly (this text tokenized whole
    # differs: SmolLM2 encodes each part's closing blank line otherwise before a letter)
    ids = prompt_ids(smollm2.tokenizer, parts)
    assert smollm2.tokenizer(prompt)["input_ids"] != ids
    direct = openai.OpenAI(base_url=launch.server.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    mine = sync.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                   logprobs=1, extra_body={"kvnotes": {"splice": False}})
    theirs = direct.completions.create(model=name, prompt=ids, max_tokens=12, temperature=0,
                                       logprobs=1)
    assert mine.choices[0].text == theirs.choices[0].text
    assert mine.choices[0].logprobs.token_logprobs == pytest.approx(
        theirs.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert mine.usage.model_extra["kvnotes"]["exact"] == "opted_out"
    assert mine.usage.prompt_tokens == got.usage.prompt_tokens == len(ids)


def test_bfcl_cases_through_the_front_are_planned_as_the_phased_client_plans_them(served, smollm2):
    """Public tool descriptions the benchmark publishes: the front finds every function of the
    case in the text prompt and answers as ComposeClient does with the same repair; the
    benchmark's fidelity reads the same decision from both."""
    from kvnotes_bench.serving.prompt_sets import BfclPrompts, bfcl_prompts
    from kvnotes_bench.serving.skills_clients import FrontClients
    from kvnotes_bench.serving.skills_fidelity import measure_fidelity

    launch = served
    name = launch.server.served_name
    every = bfcl_prompts(smollm2.tokenizer, cases=40, max_context=700)
    case = next(c for c in every.cases if len(c.parts) >= 4)  # two functions or more
    cases = BfclPrompts(cases=[case], header=every.header, skills={
        n: t for n, t in every.skills.items() if t in case.parts})
    cases.register(launch.skills, anchor=True, log=lambda s: None)
    parts = list(case.parts)
    vllm = ComposeClient(launch.server.url, name, smollm2.tokenizer,
                         skills=launch.skills.folder, block_size=BLOCK, tenant="repaired")
    front = FrontClients(plain=ComposeClient(launch.server.url, name, smollm2.tokenizer),
                         front=ComposeClient(launch.url, name, smollm2.tokenizer))
    want = vllm.complete(parts, max_tokens=16, repair=front.repair)  # the front's own repair
    assert want.ok, want.error
    got = front.send("repaired", parts, 16)
    assert got.ok, got.error
    assert got.plan is not None and want.plan is not None
    assert got.plan.ranges == want.plan.ranges
    assert len(got.plan.skills) == len(parts) - 1  # the header and every function
    assert got.text == want.text and got.phases == want.phases
    fid = measure_fidelity(front, [parts], 16, ("compose", "repaired"), prompt_set=cases)
    assert [f.samples for f in fid] == [1, 1] and [f.forwarded for f in fid] == [0, 0]
    assert fid[1].cases[0]["spliced"] == want.text
    assert fid[1].cases[0]["decision"] == cases.decision(want.text)
    assert fid[1].decision_identity is not None


def test_an_agents_chat_with_tools_is_answered_on_the_same_ids_spliced_or_not(served, smollm2):
    """A chat with ``tools`` (SmolLM2's template ignores them: the kvnotes tool block) gets a
    200 from the front, not vLLM's 400; a registered tool is spliced; the opted-out request is
    vLLM's own completion of the very ids the spliced one sent."""
    from kvnotes.serving.front.tool_calls import parse_tool_calls
    from kvnotes.serving.planning.chat_render import tool_json
    from kvnotes.serving.planning.request import read_request

    launch = served
    name = launch.server.served_name
    lookup = {"type": "function", "function": {
        "name": "lookup_booking", "description": (
            "Looks a booking up by its six-letter code and returns the passenger's name, the "
            "flights with their dates, times and seats, the fare class, the checked bags "
            "allowed, whether the ticket can still be refunded in full, and any open request "
            "the passenger made about meals or assistance at the airport."),
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the six-letter booking code"}},
            "required": ["code"]}}}
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    launch.skills.add(tool_json(lookup), name="lookup-tool")
    wait_for_rescan()
    messages = [{"role": "system", "content": "You are the assistant of Fjord Air."},
                {"role": "user", "content": "Please look up my booking ABCDEF."}]
    sync = openai.OpenAI(base_url=launch.url + "/v1", api_key="x", max_retries=0, timeout=300)
    ask = {"model": name, "messages": messages, "tools": [weather, lookup], "max_tokens": 16,
           "temperature": 0}
    spliced = sync.chat.completions.create(**ask)
    info = spliced.usage.model_extra["kvnotes"]
    assert "lookup-tool" in info["plan"]["skills"] and info["spliced_tokens"] > 0
    raw = sync.chat.completions.with_raw_response.create(
        **ask, extra_body={"kvnotes": {"splice": False}})
    assert raw.headers["x-kvnotes"].startswith("exact: opted_out")
    exact = raw.parse()
    assert exact.usage.prompt_tokens == spliced.usage.prompt_tokens

    ids = read_request("chat", {k: v for k, v in ask.items() if k != "max_tokens"},
                       smollm2.tokenizer).prompt_ids
    direct = openai.OpenAI(base_url=launch.server.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    theirs = direct.completions.create(model=name, prompt=ids, max_tokens=16, temperature=0,
                                       extra_body={"skip_special_tokens": False})
    parsed = parse_tool_calls(theirs.choices[0].text)
    message = exact.choices[0].message
    assert message.content == parsed.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] \
        == [(c.name, c.arguments) for c in parsed.calls]
