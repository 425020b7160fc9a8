"""Bounded work per request (issue #46, item 3): too many tools, content parts or messages,
tools nested too deep and prompts too long are refused at the door; planning stops at its
deadline and when its client leaves; one client never holds every planning thread; a request
at the bounds costs memory of a small multiple of its body."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import psutil
import pytest
from _front_fakes import MODEL
from _hostile import chat_body, error_of, healthy, post_raw, serve, settled, started

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.planning.match import SkillCatalog

CHAT = "/v1/chat/completions"


@pytest.fixture
def make_front(upstream, published, tokenizer):
    fronts: list[Front] = []

    def make(**settings: Any) -> Front:
        config = FrontConfig(**{"upstream": upstream.url, "block_size": 16, "model": MODEL,
                                "timeout": 3.0, **settings})
        fronts.append(started(Front(config, SkillCatalog(published.folder, tokenizer)).start()))
        return fronts[-1]

    yield make
    for front in fronts:
        front.stop()


@pytest.fixture(scope="module")
def front(upstream, published, tokenizer):
    config = FrontConfig(upstream=upstream.url, block_size=16, model=MODEL, timeout=3.0)
    with serve(config, SkillCatalog(published.folder, tokenizer)) as f:
        yield f


def tool(i: int, depth: int = 1) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}.",
                                             "parameters": schema}}


def parts(n: int, text: str = "x") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": f"{text}{i}"}
                                         for i in range(n)]}]


# ---- refused at the door ---------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status", "param"), [
    (chat_body(tools=[tool(i) for i in range(10_000)]), 400, "tools"),
    (chat_body(tools=[tool(i) for i in range(129)]), 400, "tools"),
    (chat_body(tools=[tool(0, depth=8)]), 400, "tools[0]"),
    (chat_body(messages=parts(10_000)), 400, "messages[0].content"),
    (chat_body(messages=[{"role": "user", "content": "hi"}] * 1025), 400, "messages"),
])
def test_too_much_in_a_chat_is_refused_before_any_work(front, upstream, body, status, param):
    raw = json.dumps(body).encode()
    rss = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    resp = post_raw(front, CHAT, raw)
    assert resp.status_code == status, resp.text
    assert error_of(resp)["param"] == param and "FrontConfig.max_" in error_of(resp)["message"]
    # refused at the door: planning 10,000 tools would take minutes; 10 s leaves room for a
    # loaded 2-core machine reading the 1 MB body
    assert time.perf_counter() - t0 < 10
    assert psutil.Process().memory_info().rss - rss < max(64 * len(raw), 64 << 20)
    healthy(front)


def test_a_prompt_too_long_is_a_413(make_front):
    front = make_front(max_prompt_tokens=300)
    resp = httpx2.post(front.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": list(range(301)), "max_tokens": 2})
    assert resp.status_code == 413 and error_of(resp)["param"] == "prompt"
    resp = post_raw(front, CHAT, json.dumps(chat_body(messages=parts(40, "word " * 10))
                                            ).encode())
    assert resp.status_code == 413, resp.text
    assert "max_prompt_tokens" in error_of(resp)["message"]
    healthy(front)


def test_a_chat_at_the_bounds_is_served_in_bounded_memory(front):
    body = chat_body(tools=[tool(i, depth=4) for i in range(128)])
    body["messages"] += parts(512, "a longer content part of a document, number ")[0:1]
    raw = json.dumps(body).encode()
    proc = psutil.Process()
    before = proc.memory_info().rss
    resp = post_raw(front, CHAT, raw)
    assert resp.status_code == 200, resp.text
    grown = proc.memory_info().rss - before
    print(f"body {len(raw) / 2**10:.0f} KiB, RSS grew {grown / 2**20:.1f} MiB")
    assert grown < 64 * len(raw)
    healthy(front)


# ---- planning: deadline, clients leaving, fairness ---------------------------------------------
MANY = json.dumps(chat_body(messages=parts(100_000))).encode()  # ~3 MB, ~20 s to plan
SOME = json.dumps(chat_body(messages=parts(30_000))).encode()  # ~1 MB, ~6 s to plan


def test_planning_stops_at_its_deadline(make_front):
    front = make_front(max_content_parts=200_000, plan_timeout=0.3, plan_workers=1)
    t0 = time.perf_counter()
    resp = post_raw(front, CHAT, MANY)
    assert resp.status_code == 413 and "plan_timeout" in error_of(resp)["message"]
    assert time.perf_counter() - t0 < 5
    healthy(front)  # the one planning thread is free again


def test_planning_stops_when_its_client_leaves(make_front):
    front = make_front(max_content_parts=200_000, plan_timeout=120.0, plan_workers=1)
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(SOME)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(head + SOME)
        time.sleep(1.5)  # read, checked, planning
    settled(front)
    healthy(front)  # served on the one planning thread: the abandoned plan has stopped


def test_one_client_never_holds_every_planning_thread(make_front, tmp_path: Path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-bad": {"tenant": "bad"}, "sk-good": {}}}))
    front = make_front(max_content_parts=200_000, plan_timeout=2.0, plan_workers=2,
                       max_plans_per_client=1, key_file=keys)
    statuses: list[int] = []

    def attack() -> None:
        statuses.append(post_raw(front, CHAT, SOME, authorization="Bearer sk-bad").status_code)

    attackers = [threading.Thread(target=attack) for _ in range(3)]
    for t in attackers:
        t.start()
    bad = front.service.client_of("Bearer sk-bad", "")
    deadline = time.monotonic() + 5
    while front.service.plan_turns.planning(bad) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # read and checked: the first attack plans, the others wait their turn
    assert front.service.plan_turns.planning(bad) == 3
    healthy(front, headers={"authorization": "Bearer sk-good"}, during=True)
    for t in attackers:
        t.join()
    assert statuses == [413] * 3
    settled(front)
