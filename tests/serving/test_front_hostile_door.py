"""Hostile traffic at the front's door (issue #46, items 1 and 2): numbers out of range, lone
surrogates, a fault at every step and clients that leave; each answered with its documented
status, never a 500 with the exception's text, and every slot given back."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx2
import pytest
from _front_fakes import MODEL
from _hostile import (
    PROMPT,
    chat_body,
    completion,
    error_of,
    healthy,
    post_raw,
    serve,
    settled,
)

from kvnotes.serving.front import app as front_app
from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.front.format import Shaper
from kvnotes.serving.planning.match import SkillCatalog

SLOTS = 4  # few: a request that leaks its slot shows within SLOTS + 4 of them
SECRET = "secret-3f9a"  # the text of the faults injected: never in an answer


@pytest.fixture(scope="module")
def front(upstream, published, tokenizer):
    config = FrontConfig(upstream=upstream.url, max_concurrent=SLOTS, max_body_bytes=1 << 20,
                         body_timeout=1.0, timeout=3.0, block_size=16, model=MODEL)
    with serve(config, SkillCatalog(published.folder, tokenizer)) as f:
        yield f


@pytest.fixture(autouse=True)
def clean_upstream(upstream):
    upstream.fault, upstream.fail = None, None
    upstream.requests.clear()
    yield
    upstream.fault, upstream.fail = None, None


def no_exception_text(resp: httpx2.Response) -> None:
    for word in (SECRET, "Traceback", "Error:", "RuntimeError", "AttributeError",
                 "TypeError", "OverflowError", "UnicodeEncodeError"):
        assert word not in resp.text, resp.text


# ---- numbers --------------------------------------------------------------------------------
HUGE = "1" + "0" * 400  # 10**400: an integer no float holds


@pytest.mark.parametrize(("field", "param"), [
    ('"temperature": HUGE', "temperature"), ('"top_p": HUGE', "top_p"),
    ('"presence_penalty": HUGE', "presence_penalty"), ('"seed": HUGE', "seed"),
    ('"kvnotes": {"guard": HUGE}', "kvnotes.guard"),
    ('"kvnotes": {"repair": HUGE}', "kvnotes.repair"),
    ('"temperature": -1', "temperature"), ('"top_p": 0', "top_p"), ('"top_p": 1.5', "top_p"),
    ('"presence_penalty": 3', "presence_penalty"), ('"max_tokens": 0', "max_tokens"),
    ('"top_logprobs": 100, "logprobs": true', "top_logprobs"),
    ('"logit_bias": {"5": 1e999}', "logit_bias.5"),
])
def test_numbers_out_of_range_are_400s_naming_the_field(front, upstream, field, param):
    head = json.dumps(chat_body())[:-1]
    raw = (head + ", " + field.replace("HUGE", HUGE) + "}").encode()
    for _ in range(SLOTS + 4):  # more than the slots: none may leak
        resp = post_raw(front, "/v1/chat/completions", raw)
        assert resp.status_code == 400, resp.text
        assert error_of(resp)["param"] == param
        no_exception_text(resp)
    assert upstream.posted() == [] and upstream.posted("/v1/chat/completions") == []
    healthy(front)


# ---- strings ----------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "description": "SURR",
                                         "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", chat_body(tools=[TOOL]), "tools[0].function.description"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "SURR"}]),
     "messages[0].content"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "SURR"}]}]),
     "messages[0].content[1].text"),
    ("/v1/completions", {"model": MODEL, "prompt": "SURR"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stop": ["SURR"]}, "stop[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kvnotes": {"tenant": "SURR"}},
     "kvnotes.tenant"),
])
def test_lone_surrogates_are_400s_naming_the_field(front, upstream, route, body, param):
    raw = json.dumps(body).replace("SURR", "a\\ud800b").encode()
    for _ in range(SLOTS + 4):
        resp = post_raw(front, route, raw)
        assert resp.status_code == 400, resp.text
        assert error_of(resp)["param"] == param
        assert "Unicode" in error_of(resp)["message"]
        no_exception_text(resp)
    assert upstream.requests == [] or all(m == "GET" for m, _, _ in upstream.requests)
    healthy(front)


def test_a_surrogate_in_a_key_and_a_pair_that_is_valid(front):
    raw = json.dumps(chat_body()).replace('"max_tokens"', '"\\udfffx": 1, "max_tokens"')
    resp = post_raw(front, "/v1/chat/completions", raw.encode())
    assert resp.status_code == 400 and "Unicode" in error_of(resp)["message"]
    # a surrogate pair is one valid character: served
    raw = json.dumps({"model": MODEL, "prompt": PROMPT + " PAIR", "max_tokens": 2})
    resp = post_raw(front, "/v1/completions", raw.replace("PAIR", "\\ud83d\\ude00").encode())
    assert resp.status_code == 200, resp.text
    healthy(front)


# ---- a fault at every step ------------------------------------------------------------------
def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(SECRET)


async def _aboom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(SECRET)


STEPS = {  # where a fault is injected: (what to patch, its name, stream, the status)
    "read_body": (front_app, "read_body", False, 500),
    "parse_body": (front_app, "parse_body", False, 500),
    "answer": ("front", "answer", False, 500),
    "spliced": ("proxy", "spliced", False, 500),
    "post_json": ("up", "post_json", False, 500),
    "open_stream": ("up", "open_stream", True, 500),
    "shaper_body": (Shaper, "body", False, 500),
    "shaper_chunk": (Shaper, "chunk", True, 200),  # after the answer began: an error event
    "counting": ("metrics", "outcome", False, 200),  # the ending fails: the answer stands
    "plan": ("front", "_plan", False, 200),  # planning is an optimization: answered exactly
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_fault_at_any_step_gives_its_slot_back(front, monkeypatch, step):
    where, name, stream, status = STEPS[step]
    target = {"front": front.service, "proxy": front.service.proxy, "up": front.service.up,
              "metrics": front.service.metrics}.get(where, where) if isinstance(where, str) else where
    original = getattr(target, name)
    is_async = asyncio.iscoroutinefunction(original)
    monkeypatch.setattr(target, name, _aboom if is_async else _boom)
    for _ in range(SLOTS + 4):
        if stream:
            with httpx2.stream("POST", front.url + "/v1/completions", timeout=30, json={
                    "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}) as resp:
                text = "".join(resp.iter_text())
            assert resp.status_code == status, text
            assert SECRET not in text
            if status == 200:
                assert text.rstrip().endswith("data: [DONE]") and '"error"' in text
        else:
            resp = completion(front)
            assert resp.status_code == status, resp.text
            no_exception_text(resp)
            if status == 500:
                assert front_app.REQUEST_ID_HEADER in resp.headers
                assert resp.headers[front_app.REQUEST_ID_HEADER] in error_of(resp)["message"]
    settled(front)
    monkeypatch.undo()
    healthy(front)


def test_the_log_keeps_the_fault_with_the_request_id(front, monkeypatch, caplog):
    monkeypatch.setattr(front.service.proxy, "spliced", _aboom)
    caplog.set_level("INFO", logger="kvnotes.serving.front")
    resp = completion(front, headers={"x-request-id": "req-fault-1"})
    assert resp.status_code == 500
    failed = [r for r in caplog.records if r.exc_info and "req-fault-1" in r.getMessage()]
    assert failed and SECRET in str(failed[0].exc_info[1])
    counted = [json.loads(r.getMessage().removeprefix("request ")) for r in caplog.records
               if r.getMessage().startswith("request {")]
    assert counted[-1]["outcome"] == "internal_error" and counted[-1]["status"] == 500


# ---- clients that leave ------------------------------------------------------------------------
def _send_and_leave(front: Front, data: bytes, after: float = 0.3) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as s:
        s.sendall(data)
        time.sleep(after)


def test_a_client_leaving_mid_body_or_mid_plan_gives_its_slot_back(front, monkeypatch):
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n")
    for _ in range(SLOTS + 4):
        _send_and_leave(front, head + b'{"prompt": "x', after=0.05)  # mid-body
    settled(front)
    started = threading.Event()
    plan = front.service._plan

    def slow_plan(*args: Any) -> Any:
        started.set()
        time.sleep(0.5)
        return plan(*args)

    monkeypatch.setattr(front.service, "_plan", slow_plan)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
    request = head.replace(b"1000", str(len(body)).encode()) + body
    for _ in range(4):  # mid-plan
        _send_and_leave(front, request, after=0.1)
    assert started.wait(5)
    settled(front)
    monkeypatch.undo()
    healthy(front)


def test_a_stream_cancelled_at_its_first_event_gives_its_slot_back(front, upstream):
    upstream.fault = "slow"
    for _ in range(SLOTS + 4):
        with httpx2.stream("POST", front.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}) as resp:
            next(resp.iter_lines())
    upstream.fault = None
    settled(front, timeout=10)
    healthy(front)
