"""The OpenAI front against a fake vLLM: what it sends upstream, and what its clients get back.

The fake records every request body and answers like vLLM's completions endpoint (streamed
too): "spliced answer" for a request carrying a splice salt, "exact answer" for one without,
so a test sees which request an answer came from; the first token's top-2 log-prob margin is
set per kind, so the guard can be made to fire. Skills are published with a tiny random model
and the real SmolLM2 tokenizer (its chat template renders the chats).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from typing import Any

import httpx2
import openai
import pytest
from _front_fakes import BAGGAGE, BLOCK, HEADER, MODEL, REFUNDS, USER
from conftest import make_tiny_engine

from kvnotes.core.errors import ServingError
from kvnotes.core.repair import SERVER_REPAIR, Repair, as_repair
from kvnotes.serving.front.app import STATS_PATH, Front, FrontConfig
from kvnotes.serving.front.proxy import REASON_HEADER
from kvnotes.serving.planning.front_plan import plan_request
from kvnotes.serving.planning.layout import part_ids
from kvnotes.serving.planning.match import Part, SkillCatalog
from kvnotes.serving.planning.phases import part_spans, plan_phases, server_repair
from kvnotes.serving.planning.request import read_request, render_chat
from kvnotes.serving.protocol import (
    LoadedRange,
    SpliceReport,
    SpliceRequest,
    UsageKvnotes,
)
from kvnotes.serving.skills import ServingSkills


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    lib = ServingSkills(tmp_path_factory.mktemp("front-skills"),
                        make_tiny_engine("llama", tokenizer))
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE)):
        lib.add(text, name=name, after=HEADER)
    return lib


@pytest.fixture
def front(fake, published, tokenizer):
    catalog = SkillCatalog(published.folder, tokenizer)
    with Front(FrontConfig(upstream=fake.url), catalog) as f:
        yield f


@pytest.fixture
def client(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0, timeout=30)


def expected_plan(tokenizer, catalog, texts, tenant=None, first=None):
    """The plan the front makes: its default repair, or a request's ``kvnotes.repair=first``."""
    parts = part_ids(tokenizer, texts)
    spans = part_spans(parts, catalog.index())
    ids = [t for p in parts for t in p]
    repair = SERVER_REPAIR if first is None else Repair(first=first)
    return ids, plan_phases(spans, repair, BLOCK, tenant=tenant)


def kvnotes_usage(usage: Any) -> dict[str, Any]:
    return usage.model_extra["kvnotes"] if hasattr(usage, "model_extra") else usage["kvnotes"]


# ---- completions -------------------------------------------------------------------------------
def test_completion_sends_phases_then_the_spliced_request(front, fake, client, tokenizer):
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    got = client.completions.create(model=MODEL, prompt="".join(texts), max_tokens=5,
                                    temperature=0.0)
    ids, plan = expected_plan(tokenizer, front.service.catalog, texts)
    assert plan.phase_ends  # the second skill's repaired region needs a phase
    sent = fake.posted()
    phases, real = sent[:-1], sent[-1]
    assert phases == plan.phase_bodies(ids, MODEL)  # in order, each a prefix of the prompt
    assert real["prompt"] == ids
    assert real["cache_salt"] == plan.salt
    assert real["kv_transfer_params"] == plan.splice_request().to_params()
    assert real["max_tokens"] == 5 and real["temperature"] == 0.0 and "logprobs" not in real
    assert got.choices[0].text == "spliced answer"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 2
    assert got.usage.prompt_tokens_details.cached_tokens == 7
    info = kvnotes_usage(got.usage)
    assert info["phases"] == len(plan.phase_ends)
    assert info["spliced_tokens"] == plan.spliced_tokens > 0
    assert info["guard_fired"] is False
    assert info["plan"]["ranges"] == [r.to_list() for r in plan.ranges]
    assert info["plan"]["skills"] == ["header", "baggage", "refunds"]


def connector_report(body: dict[str, Any]) -> dict[str, Any]:
    """What the connector reports for a request body: every range asked, from its entry."""
    asked = SpliceRequest.from_params(body["kv_transfer_params"])
    assert asked is not None
    keys = asked.keys or ("",) * len(asked.ranges)
    return SpliceReport(len(body["prompt"]), asked.ranges[0].start if asked.ranges else 0,
                        tuple(LoadedRange(r.piece_start, r.start, r.end, k)
                              for r, k in zip(asked.ranges, keys, strict=True))).to_params()


def test_usage_kvnotes_is_typed_and_carries_the_connectors_reports(front, fake, client):
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    fake.report = connector_report
    got = client.completions.create(model=MODEL, prompt="".join(texts), max_tokens=3)
    usage = UsageKvnotes.from_dict(kvnotes_usage(got.usage))
    sent = fake.posted()
    assert usage.plan is not None and usage.plan.repair == server_repair(
        SERVER_REPAIR, BLOCK)
    assert kvnotes_usage(got.usage)["plan"]["repair"] == {
        "first": SERVER_REPAIR.first, "align": BLOCK, "share": SERVER_REPAIR.share,
        "skip_exact": True}
    assert usage.phases == len(sent) - 1 == len(usage.phase_reports) > 0
    assert usage.report == SpliceReport.from_params(connector_report(sent[-1]))
    assert [r.prompt_tokens for r in usage.reports] == [len(b["prompt"]) for b in sent]
    # the report reaches the client as usage.kvnotes.report only
    assert "kv_transfer_params" not in (got.model_extra or {})


def test_a_report_the_front_cannot_read_is_left_out_and_logged(front, fake, client, caplog):
    fake.report = lambda body: {"kvnotes": {"v": 9, "prompt_tokens": 1}}
    with caplog.at_level(logging.WARNING, logger="kvnotes.front"):
        got = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER,
                                        max_tokens=2)
    usage = UsageKvnotes.from_dict(kvnotes_usage(got.usage))
    assert usage.report is None and usage.spliced_tokens > 0
    assert "the connector's report was refused: kvnotes splice report: version 9; this " \
           "kvnotes reads version 1" in caplog.text
    assert usage.no_report == "refused"


def test_a_stop_string_answer_is_vllms_text_and_says_why_it_has_no_report(front, fake, client):
    fake.report = connector_report
    got = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER,
                                    max_tokens=3, stop=["xyz", "ans"])
    assert fake.posted()[-1]["stop"] == ["xyz", "ans"]  # vLLM applies it, as asked
    assert got.choices[0].text == "spliced "  # vLLM's text, cut where vLLM cut it
    assert got.choices[0].finish_reason == "stop"
    usage = UsageKvnotes.from_dict(kvnotes_usage(got.usage))
    assert usage.report is None and usage.no_report == "stop_string"
    assert usage.spliced_tokens > 0 and usage.plan is not None
    got = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER, max_tokens=3)
    usage = UsageKvnotes.from_dict(kvnotes_usage(got.usage))
    assert usage.report is not None and usage.no_report is None


def test_a_stream_ends_with_the_plan_and_says_the_report_is_not_streamed(front, fake, client):
    fake.report = connector_report
    stream = client.completions.create(model=MODEL, prompt=HEADER + BAGGAGE + REFUNDS + USER,
                                       max_tokens=3, stream=True,
                                       stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.choices == []
    usage = UsageKvnotes.from_dict(kvnotes_usage(last.usage))
    assert usage.plan is not None and usage.plan.skills == ("header", "baggage", "refunds")
    assert usage.spliced_tokens > 0 and usage.phases == len(usage.phase_reports) > 0
    assert all(r is not None for r in usage.phase_reports)  # the phases are not streamed
    assert usage.report is None and usage.no_report == "stream"


def test_completion_without_max_tokens_keeps_vllms_default(front, fake, client):
    client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER)
    real = fake.posted()[-1]
    assert "max_tokens" not in real and "temperature" not in real


def test_token_id_prompt_is_split_where_pieces_occur(front, fake, tokenizer):
    texts = [HEADER, REFUNDS, USER]
    ids, plan = expected_plan(tokenizer, front.service.catalog, texts)
    resp = httpx2.post(front.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert fake.posted()[-1]["kv_transfer_params"] == plan.splice_request().to_params()
    assert resp.json()["usage"]["kvnotes"]["spliced_tokens"] == plan.spliced_tokens


def test_tenant_and_repair_options_set_salt_and_plan(front, fake, client, tokenizer):
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    client.completions.create(model=MODEL, prompt="".join(texts), max_tokens=2,
                              extra_body={"kvnotes": {"tenant": "acme", "repair": 16}})
    ids, plan = expected_plan(tokenizer, front.service.catalog, texts, tenant="acme", first=16)
    assert "acme" in plan.salt
    sent = fake.posted()
    assert {b["cache_salt"] for b in sent} == {plan.salt}
    assert sent[-1]["kv_transfer_params"] == plan.splice_request().to_params()
    assert "kvnotes" not in sent[-1]


@pytest.mark.parametrize("block", [1, BLOCK])
def test_a_front_request_with_repair_16_recomputes_what_compose_with_repair_16_does(
        published, tokenizer, block):
    """One meaning of ``repair=16``: each spliced skill's first 16 tokens, in the engine and
    through the front (whose regions end on its block size: ``align`` = the block)."""
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    req = read_request("completion", {"model": MODEL, "prompt": "".join(texts),
                                      "kvnotes": {"repair": 16}}, tokenizer)
    assert req.options.repair == 16
    fp = plan_request(req, SkillCatalog(published.folder, tokenizer),
                      as_repair(req.options.repair), block, None)
    lib, engine = published.library, published.engine
    parts = [lib.get(HEADER, name="header"), lib.get(BAGGAGE, name="baggage", after=HEADER),
             lib.get(REFUNDS, name="refunds", after=HEADER), USER]
    repair = 16 if block == 1 else Repair(first=16, align=block)
    nb = engine.compose(parts, repair=repair)
    stats = nb.meta["compose"]
    assert fp.ids == nb.token_ids.tolist()
    assert [list(r) for r in fp.plan.regions] == stats["regions"] != []
    assert stats["exact"] == [0, 1]  # the header and the skill right behind it


def test_a_skill_removed_between_match_and_plan_is_computed_not_spliced(
        published, tokenizer, tmp_path, monkeypatch):
    """The plan is built from the match's pieces, each checked against the folder as indexed
    when planning: an entry gone in between leaves its part to vLLM (text), never a range."""
    folder = tmp_path / published.folder.name
    shutil.copytree(published.folder, folder)
    catalog = SkillCatalog(folder, tokenizer, rescan_s=0.0)
    refunds = next(p for p in catalog.pieces() if p.name == "refunds")
    find = catalog.find

    def find_then_remove(text: str, tenant: str | None = None) -> list[Part]:
        found = find(text, tenant)
        assert "refunds" in [p.skill.name for p in found if p.skill]
        (folder / f"{refunds.key}.safetensors").unlink()
        return found

    monkeypatch.setattr(catalog, "find", find_then_remove)
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    req = read_request("completion", {"model": MODEL, "prompt": "".join(texts)}, tokenizer)
    fp = plan_request(req, catalog, Repair(first=16), BLOCK, None)
    assert fp.skills == ["header", "baggage"]
    at = sum(map(len, part_ids(tokenizer, texts[:2])))  # where the removed skill's text starts
    gone = next(s for s in fp.spans if s.start == at)
    assert not gone.is_piece and len(gone) == len(refunds)
    assert all(r.end <= gone.start or r.start >= gone.end for r in fp.plan.ranges)
    assert (fp.ids, fp.plan) == expected_plan(tokenizer, catalog, texts, first=16)


# ---- chat --------------------------------------------------------------------------------------
def chat_messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": HEADER + REFUNDS},
            {"role": "user", "content": "I cancelled after two days. What do I get back?"}]


def test_chat_is_rendered_matched_and_answered_as_chat(front, fake, client, tokenizer):
    got = client.chat.completions.create(model=MODEL, messages=chat_messages(), temperature=0)
    text = render_chat(tokenizer, chat_messages())
    found = front.service.catalog.find(text)
    assert [p.skill.name for p in found if p.skill] == ["header", "refunds"]
    real = fake.posted()[-1]
    assert real["prompt"] == [t for p in part_ids(tokenizer, [p.text for p in found]) for t in p]
    assert real["max_tokens"] is None  # chat's default: up to the context's end
    assert fake.posted("/v1/chat/completions") == []
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == "spliced answer"
    assert got.choices[0].finish_reason == "length"
    assert kvnotes_usage(got.usage)["plan"]["skills"] == ["header", "refunds"]


def test_chat_streams_in_openai_format(front, fake, client):
    stream = client.chat.completions.create(model=MODEL, messages=chat_messages(),
                                            max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == "spliced answer"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert kvnotes_usage(chunks[-1].usage)["phases"] >= 0
    assert fake.posted()[-1]["stream"] is True


def test_raw_stream_ends_with_done_and_usage_only_when_asked(front, fake):
    body = {"model": MODEL, "prompt": HEADER + REFUNDS + USER, "max_tokens": 2, "stream": True}
    with httpx2.stream("POST", front.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == "spliced answer"
    assert all(e["choices"] and e["usage"] is None for e in events)  # no usage chunk


# ---- the guard ---------------------------------------------------------------------------------
def test_guard_fires_and_the_exact_answer_is_sent(front, fake, client):
    fake.margin["spliced"] = 0.1
    got = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER, max_tokens=4,
                                    extra_body={"kvnotes": {"guard": 0.5}})
    real, exact = fake.posted()[-2:]
    assert real["logprobs"] == 2 and real["cache_salt"]
    assert exact["prompt"] == real["prompt"]
    assert "cache_salt" not in exact and "kv_transfer_params" not in exact
    assert got.choices[0].text == "exact answer"
    assert got.choices[0].logprobs is None  # the client asked for none
    assert kvnotes_usage(got.usage)["guard_fired"] is True
    assert front.stats["guard_fired"] == 1


def test_guard_holds_a_stream_until_it_decides(front, fake, client):
    fake.margin["spliced"] = 0.1
    stream = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER,
                                       max_tokens=4, stream=True,
                                       extra_body={"kvnotes": {"guard": 0.5}})
    assert "".join(c.choices[0].text for c in stream if c.choices) == "exact answer"
    assert "cache_salt" not in fake.posted()[-1]
    fake.margin["spliced"] = 3.0  # a clear first token: the spliced stream is relayed
    stream = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER,
                                       max_tokens=4, stream=True,
                                       extra_body={"kvnotes": {"guard": 0.5}})
    assert "".join(c.choices[0].text for c in stream if c.choices) == "spliced answer"
    assert fake.posted()[-1]["cache_salt"]


def test_client_logprobs_are_trimmed_to_what_it_asked(front, fake, client):
    got = client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER, max_tokens=2,
                                    logprobs=1, extra_body={"kvnotes": {"guard": 0.5}})
    assert fake.posted()[-1]["logprobs"] == 2
    assert [len(t) for t in got.choices[0].logprobs.top_logprobs] == [1, 1]


# ---- forwarded exactly -------------------------------------------------------------------------
def test_an_opted_out_chat_without_skills_is_forwarded_exactly(front, fake, client):
    messages = [{"role": "user", "content": "I cancelled after two days. What do I get back?"}]
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=3, extra_body={"kvnotes": {"splice": False}})
    assert resp.parse().choices[0].message.content == "vllm chat"
    assert resp.headers[REASON_HEADER].startswith("forwarded")
    assert fake.posted("/v1/chat/completions") == [
        {"model": MODEL, "messages": messages, "max_tokens": 3}]
    assert fake.posted() == []


def test_a_chat_with_a_skill_is_sent_as_the_same_ids_spliced_or_not(front, fake, client):
    # vLLM's chat endpoint would render and tokenize the chat whole; the front sends the
    # opted-out chat as the laid-out ids its spliced counterpart is planned on
    sent: dict[bool, list[int]] = {}
    for splice in (True, False):
        resp = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat_messages(), max_tokens=3, temperature=0,
            extra_body={"kvnotes": {"splice": splice}})
        sent[splice] = fake.posted()[-1]["prompt"]
        if not splice:
            assert resp.headers[REASON_HEADER].startswith("exact: opted_out")
            assert resp.parse().choices[0].message.content == "exact answer"
            assert "cache_salt" not in fake.posted()[-1]
    assert sent[True] == sent[False]
    assert fake.posted("/v1/chat/completions") == []


def test_a_completion_text_is_sent_as_the_same_ids_spliced_or_not(front, fake, tokenizer):
    """Tokenized whole, this text merges tokens at a skill's edge (SmolLM2: the skill's
    closing "." and the user text's opening ".." become one "..."); the front sends its
    part-wise ids both ways, so the two answers differ only by the KV spliced."""
    texts = [HEADER, REFUNDS, ".." + USER]
    text = "".join(texts)
    ids = [t for p in part_ids(tokenizer, texts) for t in p]
    assert tokenizer(text)["input_ids"] != ids  # what vLLM would compute for the text
    sent: dict[str, list[int]] = {}
    for splice in (True, False):
        resp = httpx2.post(front.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": text, "max_tokens": 3, "temperature": 0,
            "kvnotes": {"splice": splice}})
        assert resp.status_code == 200, resp.text
        sent[str(splice)] = fake.posted()[-1]["prompt"]
        if not splice:
            assert resp.headers[REASON_HEADER].startswith("exact: opted_out")
            assert resp.json()["choices"][0]["text"] == "exact answer"
            assert resp.json()["usage"]["kvnotes"]["exact"] == "opted_out"
            assert "kv_transfer_params" not in fake.posted()[-1]
            assert "cache_salt" not in fake.posted()[-1]
    assert sent["True"] == sent["False"] == ids


def test_an_opted_out_completion_text_streams_in_openai_format(front, fake, client, tokenizer):
    texts = [HEADER, REFUNDS, USER]
    stream = client.completions.create(model=MODEL, prompt="".join(texts), max_tokens=3,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"kvnotes": {"splice": False}})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "exact answer"
    assert kvnotes_usage(chunks[-1].usage)["exact"] == "opted_out"
    assert fake.posted()[-1]["prompt"] == [t for p in part_ids(tokenizer, texts) for t in p]


def test_an_opted_out_completion_keeps_its_salt_and_one_without_skills_is_forwarded(
        front, fake):
    text = HEADER + REFUNDS + USER
    resp = httpx2.post(front.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": text, "cache_salt": "mine", "kvnotes": {"splice": False}})
    assert resp.headers[REASON_HEADER].startswith("exact: opted_out")
    assert fake.posted()[-1]["cache_salt"] == "mine"
    for prompt in ("no registered skill here", [1, 2, 3]):
        body = {"model": MODEL, "prompt": prompt, "kvnotes": {"splice": False}}
        resp = httpx2.post(front.url + "/v1/completions", timeout=30, json=body)
        assert resp.headers[REASON_HEADER].startswith("forwarded: opted_out")
        assert fake.posted()[-1] == {k: v for k, v in body.items() if k != "kvnotes"}


def test_a_completion_text_not_planned_is_answered_as_its_part_wise_ids(front, fake,
                                                                        tokenizer):
    texts = ["Hello.", REFUNDS, ".." + USER]  # no header: the skill is all repaired
    resp = httpx2.post(front.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "".join(texts), "kvnotes": {"repair": 10_000}})
    assert resp.headers[REASON_HEADER].startswith("exact: nothing_left")
    assert fake.posted()[-1]["prompt"] == [t for p in part_ids(tokenizer, texts) for t in p]


@pytest.mark.parametrize("body", [
    {"prompt": "no registered skill here", "max_tokens": 2},
    {"prompt": HEADER + REFUNDS + USER, "suffix": "x"},
    {"prompt": HEADER + REFUNDS + USER, "n": 2},
    {"prompt": HEADER + REFUNDS + USER, "cache_salt": "mine"},
    {"prompt": [HEADER + REFUNDS, HEADER + BAGGAGE]},
])
def test_unplannable_completion_is_forwarded_as_it_came(front, fake, body):
    raw = json.dumps({"model": MODEL, **body}).encode()
    resp = httpx2.post(front.url + "/v1/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
    assert resp.status_code == 200
    assert resp.headers[REASON_HEADER].startswith("forwarded")
    assert fake.posted() == [json.loads(raw)]


@pytest.mark.parametrize(("kvnotes", "param"), [
    ({"colour": "red"}, "kvnotes.colour"), ({"tenat": "acme"}, "kvnotes.tenat"),
    ({"tenant": "a b"}, "kvnotes.tenant"), ({"guard": -1}, "kvnotes.guard"),
    ({"repair": -1}, "kvnotes.repair"), ({"splice": "no"}, "kvnotes.splice"),
    ("on", "kvnotes")])
def test_bad_options_are_a_400_naming_the_field(front, fake, client, kvnotes, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER, max_tokens=2,
                                  extra_body={"kvnotes": kvnotes})
    assert caught.value.body["param"] == param
    assert fake.posted() == []


def test_chat_the_front_cannot_render_is_forwarded(front, fake, client):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": HEADER + REFUNDS},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    resp = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
    assert resp.headers[REASON_HEADER].startswith("forwarded: chat_shape")
    assert fake.posted("/v1/chat/completions")[0]["messages"] == messages
    assert fake.posted() == []
    assert front.stats["forwarded"] == 1


def test_upstream_errors_pass_through_with_their_status(front, fake, client):
    fake.fail = (400, {"error": {"message": "prompt too long", "type": "BadRequestError",
                                 "code": 400}})
    with pytest.raises(openai.BadRequestError, match="prompt too long"):
        client.completions.create(model=MODEL, prompt=HEADER + REFUNDS + USER)
    with pytest.raises(openai.BadRequestError, match="prompt too long"):
        client.completions.create(model=MODEL, prompt="no skill", stream=True)


def test_other_endpoints_are_proxied_or_404(front, fake):
    assert httpx2.get(front.url + "/health", timeout=10).status_code == 200
    assert httpx2.get(front.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    missing = httpx2.get(front.url + "/nowhere", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert ("GET", "/nowhere", None) not in fake.requests  # never passed on
    stats = httpx2.get(front.url + STATS_PATH, timeout=10).json()
    assert stats["requests"] == 0  # proxied GETs are no requests of the front's own


def test_front_stops_cleanly(fake, published, tokenizer):
    front = Front(FrontConfig(upstream=fake.url, block_size=BLOCK),
                  SkillCatalog(published.folder, tokenizer)).start()
    url = front.url
    assert httpx2.get(url + "/health", timeout=10).status_code == 200
    front.stop()
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(url + "/health", timeout=5)


def test_a_tokenizer_without_chat_template_gets_the_default_layout(tokenizer):
    bare = copy.copy(tokenizer)
    bare.chat_template = None  # Gemma 3 270M base ships none
    messages = chat_messages()
    assert render_chat(bare, messages) == (f"System: {messages[0]['content']}\n\n"
                                           f"User: {messages[1]['content']}\n\nAssistant:")


def test_a_taken_port_fails_at_start_and_an_absent_vllm_is_a_502(fake, published, tokenizer):
    catalog = SkillCatalog(published.folder, tokenizer)
    with pytest.raises(ServingError, match="choose another --port"):
        Front(FrontConfig(upstream=fake.url, port=fake.server.server_address[1]), catalog).start()
    with Front(FrontConfig(upstream="http://127.0.0.1:9", block_size=BLOCK), catalog) as front:
        resp = httpx2.post(front.url + "/v1/completions", timeout=10,
                           json={"model": MODEL, "prompt": HEADER + REFUNDS + USER})
        assert resp.status_code == 502 and "not reachable" in resp.json()["error"]["message"]
        assert httpx2.get(front.url + "/health", timeout=10).status_code == 502


def test_a_client_resetting_its_connection_leaves_no_traceback(front, capfd):
    """The openai SDK drops idle pooled connections: a reset is how a connection ends."""
    import socket
    import struct

    capfd.readouterr()
    host, port = front.url.removeprefix("http://").split(":")
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        s.close()
    assert httpx2.get(front.url + "/health", timeout=30).status_code in (200, 502)
    time.sleep(0.2)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err
