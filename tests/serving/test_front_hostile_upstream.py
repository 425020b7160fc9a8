"""A misbehaving upstream (issue #46, item 6): answers of the wrong shape are a 502 naming what
is wrong, a stream that breaks or carries a wrong event ends with an error event and
``[DONE]``, and an answer trickled byte by byte is cut at the request's total deadline."""

from __future__ import annotations

import json
import time

import httpx2
import pytest
from _front_fakes import MODEL
from _hostile import PROMPT, chat_body, completion, error_of, healthy, serve

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.planning.match import SkillCatalog

TOTAL = 1.5  # request_timeout: the trickle's cut


@pytest.fixture(scope="module")
def front(upstream, published, tokenizer):
    config = FrontConfig(upstream=upstream.url, block_size=16, model=MODEL, timeout=3.0,
                         request_timeout=TOTAL)
    with serve(config, SkillCatalog(published.folder, tokenizer)) as f:
        yield f


@pytest.fixture(autouse=True)
def clean(upstream):
    upstream.fault = None
    yield
    upstream.fault = None


def no_python(text: str) -> None:
    for word in ("AttributeError", "TypeError", "KeyError", "Traceback", "NoneType"):
        assert word not in text, text


def stream_lines(front: Front, route: str, body: dict) -> tuple[int, list[str], float]:
    t0 = time.perf_counter()
    with httpx2.stream("POST", front.url + route, timeout=30, json={**body, "stream": True}
                       ) as resp:
        lines = [line for line in resp.iter_lines() if line]
    return resp.status_code, lines, time.perf_counter() - t0


BODIES = {"/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
          "/v1/chat/completions": chat_body()}


@pytest.mark.parametrize("route", list(BODIES))
def test_a_wrong_shaped_answer_is_a_502_saying_what_is_wrong(front, upstream, route):
    upstream.fault = "wrong_shape"
    resp = httpx2.post(front.url + route, json=BODIES[route], timeout=30)
    assert resp.status_code == 502, resp.text
    message = error_of(resp)["message"]
    assert "not a completion" in message and "choices.0.text" in message
    no_python(resp.text)
    upstream.fault = None
    healthy(front)


@pytest.mark.parametrize("route", list(BODIES))
@pytest.mark.parametrize("fault", ["wrong_shape", "cut", "bad_json"])
def test_a_broken_stream_ends_with_an_error_event(front, upstream, route, fault):
    upstream.fault = fault
    status, lines, _ = stream_lines(front, route, BODIES[route])
    assert status == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][5:])["error"]
    assert error["code"] == 502 and "vLLM server" in error["message"]
    no_python("\n".join(lines))
    upstream.fault = None
    healthy(front)


def test_a_trickled_answer_is_cut_at_the_deadline(front, upstream):
    upstream.fault = "trickle"
    t0 = time.perf_counter()
    resp = completion(front)
    assert resp.status_code == 504 and "request_timeout" in error_of(resp)["message"]
    assert time.perf_counter() - t0 < TOTAL + 2
    status, lines, took = stream_lines(front, "/v1/completions", BODIES["/v1/completions"])
    assert status == 200 and lines[-1] == "data: [DONE]" and took < TOTAL + 2
    assert json.loads(lines[-2][5:])["error"]["code"] == 504
    upstream.fault = None
    healthy(front)
