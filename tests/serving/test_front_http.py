"""The front as an HTTP server: bad input, upstream faults, load, keys and tenants.

A real front (uvicorn on 127.0.0.1, a free port) over :class:`FakeVLLM`, with small limits so
each case is quick. Every case ends by checking that the front still serves.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import openai
import psutil
import pytest
from _front_fakes import BLOCK, HEADER, MODEL, REFUNDS, USER, FakeVLLM
from conftest import make_tiny_engine

from kvnotes.serving.front.app import STATS_PATH, Front, FrontConfig
from kvnotes.serving.front.proxy import REASON_HEADER
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.skills import ServingSkills

PROMPT = HEADER + REFUNDS + USER
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    lib = ServingSkills(tmp_path_factory.mktemp("front-http-skills"),
                        make_tiny_engine("llama", tokenizer))
    lib.add(HEADER, name="header")
    lib.add(REFUNDS, name="refunds", after=HEADER)
    return lib


@pytest.fixture
def make_front(fake, published, tokenizer):
    fronts: list[Front] = []

    def make(**settings: Any) -> Front:
        settings = {"upstream": fake.url, "max_body_bytes": LIMIT, "body_timeout": 1.0,
                    "timeout": 2.0, **settings}
        front = Front(FrontConfig(**settings), SkillCatalog(published.folder, tokenizer))
        fronts.append(front.start())
        return front

    yield make
    for front in fronts:
        front.stop()


@pytest.fixture
def front(make_front):
    return make_front()


def completion(front: Front, body: dict[str, Any] | None = None, **kw: Any) -> httpx2.Response:
    return httpx2.post(front.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **(body or {})},
                       **kw)


def still_serving(front: Front) -> None:
    resp = completion(front)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "spliced answer"
    assert httpx2.get(front.url + "/health", timeout=10).status_code == 200


def raw_request(front: Front, data: bytes, *, read: bool = True, wait: float = 5.0) -> bytes:
    """``data`` sent on a fresh connection; what comes back before it closes (or ``wait``)."""
    with socket.create_connection(("127.0.0.1", front.port), timeout=wait) as s:
        out = b""
        try:
            s.sendall(data)
            if not read:
                return b""
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b"connection: close" not in out.lower() \
                        and len(out) > 200:
                    break
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            pass
        return out


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def error_of(resp: httpx2.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status_code
    return err


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "x", "stop": [1]}', "stop"),
    (b'{"prompt": "x"', None),
    (b"\xff\xfe\x00", None),
    (b"[1, 2]", None),
    (b"[" * 30_000 + b"]" * 30_000, None),
    (b'{"prompt": ' + b'{"a": ' * 200 + b"1" + b"}" * 201, None),
    ('{"prompt": "x", "kvnotes": {"tenänt": "acme"}}'.encode(), "kvnotes.tenänt"),
    ('{"prompt": "x", "kvnotes": {"tenant": "äcme"}}'.encode(), "kvnotes.tenant"),
    (b'{"prompt": "x", "kvnotes": {"repair": -1}}', "kvnotes.repair"),
])
def test_bad_bodies_are_400s(front, fake, raw, param):
    resp = httpx2.post(front.url + "/v1/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert error_of(resp)["param"] == param
    assert fake.posted() == []
    still_serving(front)


def test_chat_wrong_types_are_400s(front):
    resp = httpx2.post(front.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": "hello"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "messages"


def test_an_oversized_body_is_a_413_without_reading_it(front):
    claimed = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: 10000000000\r\n\r\n{")
    rss = psutil.Process().memory_info().rss
    assert status_of(raw_request(front, claimed)) == 413
    assert psutil.Process().memory_info().rss - rss < 100 << 20  # nothing was reserved
    big = {"model": MODEL, "prompt": "x" * (2 * LIMIT)}
    resp = httpx2.post(front.url + "/v1/completions", json=big, timeout=30)
    assert resp.status_code == 413 and error_of(resp)["type"] == "RequestTooLarge"

    def chunks():  # no length given: counted as it arrives
        for _ in range(4):
            yield b" " * LIMIT

    resp = httpx2.post(front.url + "/v1/completions", content=chunks(), timeout=30)
    assert resp.status_code == 413
    still_serving(front)


def test_slow_and_truncated_bodies(make_front):
    front = make_front(body_timeout=3.0)
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", front.port)) as slow:
        slow.sendall(head + b'{"pro')  # a client that holds its body back blocks nobody else
        t0 = time.perf_counter()
        still_serving(front)
        assert time.perf_counter() - t0 < 2.5  # answered before the slow body's 408
    t0 = time.perf_counter()
    reply = raw_request(front, head + b'{"prompt": ')  # then nothing: a slow client
    assert status_of(reply) == 408 and time.perf_counter() - t0 < 8
    raw_request(front, head + b'{"pro', read=False)  # truncated: the client leaves
    for bad in (b"content-length: abc\r\n", b"content-length: 5\r\ncontent-length: 6\r\n",
                b"transfer-encoding: chunked\r\n"):
        reply = raw_request(front, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + bad
                            + b"\r\nzz\r\n")
        assert status_of(reply) in (0, 400)  # h11 refuses it, or drops the connection
    still_serving(front)


def test_an_oversized_head_is_refused(front):
    reply = raw_request(front, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (1 << 20)
                        + b"\r\n\r\n")
    assert status_of(reply) in (0, 400, 431)
    still_serving(front)


@pytest.mark.parametrize("target", [b"@127.0.0.1:{port}/x", b"//127.0.0.1:{port}/health",
                                    b"/v1/../health", b"http://evil/v1/models", b"/%0d%0ax"])
def test_odd_request_targets_never_reach_another_host(front, fake, target):
    target = target.replace(b"{port}", str(fake.server.server_address[1]).encode())
    reply = raw_request(front, b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_of(reply) in (0, 400, 404), reply[:200]
    assert all(p in ("/health", "/v1/models", "/metrics") for _, p, _ in fake.requests)
    still_serving(front)


def test_non_latin1_and_crlf_never_reach_a_header(front, fake):
    for field in ("tenänt", "温度", "x\r\nset-cookie: a=1", "\u2028"):
        resp = completion(front, {field: 1})
        assert resp.status_code == 200, resp.text
        reason = resp.headers[REASON_HEADER]
        assert reason.startswith("forwarded: unmodelled_field") and reason.isascii()
        assert "\r" not in reason and "\n" not in reason and "set-cookie" not in resp.headers
    resp = completion(front, {"prompt": "ünïcödé " + PROMPT + " 温度"})
    assert resp.status_code == 200
    assert len(fake.posted()) >= 4
    still_serving(front)


def test_a_burst_of_connections_is_answered(front):
    async def burst() -> list[int]:
        limits = httpx2.Limits(max_connections=300)
        async with httpx2.AsyncClient(timeout=60, limits=limits) as client:
            got = await asyncio.gather(*[client.get(front.url + "/metrics")
                                         for _ in range(300)], return_exceptions=True)
        return [r.status_code if isinstance(r, httpx2.Response) else 0 for r in got]

    assert asyncio.run(burst()) == [200] * 300


def test_memory_stays_bounded_under_the_corpus(front):
    proc = psutil.Process()
    before = proc.memory_info().rss
    with httpx2.Client(timeout=30) as client:
        for i in range(200):
            client.post(front.url + "/v1/completions",  # a new unknown field name each time
                        json={"model": MODEL, "prompt": "no skill", f"field_{i}_ü": i})
            client.post(front.url + "/v1/completions", content=b'{"prompt": [' * 50)
            try:  # answered 413 before it is read: the connection may be reset under it
                client.post(front.url + "/v1/completions", content=b"x" * (LIMIT + 1))
            except httpx2.TransportError:
                pass
    stats = httpx2.get(front.url + STATS_PATH, timeout=10).json()
    assert set(stats) == {"requests", "outcomes", "forwarded"}
    assert set(stats["forwarded"]) == {"unmodelled_field"}  # no key per field name
    metrics = httpx2.get(front.url + "/metrics", timeout=10).text
    assert "field_" not in metrics
    after = proc.memory_info().rss
    print(f"RSS before {before / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB")
    assert after - before < 150 << 20
    still_serving(front)


# ---- upstream faults -----------------------------------------------------------------------------
def test_upstream_down_at_start_then_up(make_front, published):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = make_front(upstream=f"http://127.0.0.1:{port}")
    resp = completion(front)
    assert resp.status_code == 502 and "not reachable" in error_of(resp)["message"]
    assert error_of(resp)["message"].endswith("not reachable (ConnectError)")  # no more: the log
    assert httpx2.get(front.url + "/health", timeout=10).status_code == 502
    late = FakeVLLM(port)
    try:
        still_serving(front)  # the block size and model are read once it answers
    finally:
        late.close()


def test_upstream_500_passes_through(front, fake):
    fake.fail = (500, {"error": {"message": "engine dead", "type": "InternalServerError",
                                 "code": 500}})
    resp = completion(front)
    assert resp.status_code == 500 and "engine dead" in resp.text
    fake.fail = None
    still_serving(front)
    assert front.stats["upstream_error"] + front.stats["phase_failed"] >= 1


def test_a_hung_upstream_is_a_504(front, fake):
    fake.fault = "hang"
    t0 = time.perf_counter()
    resp = completion(front)
    assert resp.status_code == 504 and error_of(resp)["type"] == "GatewayTimeout"
    assert time.perf_counter() - t0 < 10
    fake.fault = None
    still_serving(front)


@pytest.mark.parametrize("fault", ["cut", "bad_json"])
def test_a_broken_stream_ends_with_an_error_event_and_done(front, fake, fault):
    fake.fault = fault
    with httpx2.stream("POST", front.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][5:])
    fake.fault = None
    still_serving(front)
    assert front.stats["upstream_error"] >= 1


def test_a_hung_metrics_read_never_serializes_requests(make_front, fake):
    fake.hang_metrics = True
    front = make_front(discover_timeout=1.0, block_size=None)
    t0 = time.perf_counter()

    async def many() -> list[httpx2.Response]:
        async with httpx2.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*[client.post(front.url + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 2}) for _ in range(8)])

    got = asyncio.run(many())
    assert [r.status_code for r in got] == [200] * 8
    assert all("block_size_unknown" in r.headers[REASON_HEADER] for r in got)
    assert time.perf_counter() - t0 < 6  # one shared wait, not eight in a row


def test_a_client_leaving_cancels_its_upstream_request(make_front, fake):
    fake.fault = "slow"
    front = make_front(timeout=30.0)
    with httpx2.stream("POST", front.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 10
    while front.stats["disconnected"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert front.stats["disconnected"] == 1
    assert front.service.in_flight == 0
    fake.fault = None
    still_serving(front)


def test_requests_past_the_bound_get_429(make_front, fake):
    fake.fault = "hang"
    front = make_front(max_concurrent=2, timeout=3.0)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(completion(front).status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2.5  # both admitted (a loaded machine may take a while)
    while front.service.in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    resp = completion(front)
    assert resp.status_code == 429 and error_of(resp)["type"] == "RateLimitError"
    for t in threads:
        t.join()
    assert results == [504, 504]
    fake.fault = None
    still_serving(front)


def test_64_concurrent_streams_all_complete(front, fake):
    async def one(client: openai.AsyncOpenAI, chat: bool) -> str:
        if chat:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": HEADER + REFUNDS},
                                       {"role": "user", "content": "hi"}],
                max_tokens=2, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0,
                                    timeout=60)
        try:
            return await asyncio.gather(*[one(client, i % 2 == 1) for i in range(64)])
        finally:
            await client.close()

    assert asyncio.run(run()) == ["spliced answer"] * 64
    assert front.stats["spliced"] == 64


# ---- keys and tenants ------------------------------------------------------------------------
@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"sk-acme": {"tenant": "acme"},
                                         "sk-globex": {"tenant": "globex"}, "sk-ops": {}}}))
    return path


def test_keys_are_required_on_v1_and_kvnotes(make_front, key_file):
    front = make_front(key_file=key_file, api_key="sk-admin")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "sk-acme"}):
        resp = completion(front, headers=headers)
        assert resp.status_code == 401 and error_of(resp)["type"] == "AuthenticationError"
        assert httpx2.get(front.url + STATS_PATH, headers=headers, timeout=10).status_code == 401
        assert httpx2.get(front.url + "/v1/models", headers=headers,
                          timeout=10).status_code == 401
    for key in ("sk-acme", "sk-ops", "sk-admin"):
        auth = {"authorization": f"Bearer {key}"}
        assert completion(front, headers=auth).status_code == 200
        assert httpx2.get(front.url + STATS_PATH, headers=auth, timeout=10).status_code == 200
    assert httpx2.get(front.url + "/health", timeout=10).status_code == 200  # open, as vLLM's
    assert httpx2.get(front.url + "/metrics", timeout=10).status_code == 401  # the operator's
    assert httpx2.get(front.url + "/metrics", timeout=10,
                      headers={"authorization": "Bearer sk-admin"}).status_code == 200


def test_a_tenant_comes_from_its_key(make_front, fake, key_file):
    front = make_front(key_file=key_file)
    salts = {}
    for key in ("sk-acme", "sk-globex"):
        fake.requests.clear()
        client = openai.OpenAI(base_url=front.url + "/v1", api_key=key, max_retries=0)
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        salts[key] = {b["cache_salt"] for b in fake.posted()}
        # naming another tenant is refused; naming its own is allowed
        with pytest.raises(openai.BadRequestError, match="not this key's tenant"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      extra_body={"kvnotes": {"tenant": "other"}})
        own = key.removeprefix("sk-")
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"kvnotes": {"tenant": own}})
    assert len(salts["sk-acme"]) == 1 and "acme" in next(iter(salts["sk-acme"]))
    assert salts["sk-acme"].isdisjoint(salts["sk-globex"])  # never each other's blocks


def test_a_tenants_exact_requests_are_its_own_too(make_front, fake, key_file):
    front = make_front(key_file=key_file)
    auth = {"authorization": "Bearer sk-acme"}
    completion(front, {"prompt": "no skill here"}, headers=auth)
    completion(front, {"cache_salt": "kvnotes-splice:globex+f32a16", "x_unknown": 1},
               headers=auth)
    salts = [b["cache_salt"] for b in fake.posted()]
    assert salts == ["kvnotes-tenant:acme", "kvnotes-tenant:acme:kvnotes-splice:globex+f32a16"]
    resp = completion(front, {"cache_salt": "kvnotes-splice:globex"},
                      headers={"authorization": "Bearer sk-ops"})  # the shared tenant
    assert resp.status_code == 400 and error_of(resp)["param"] == "cache_salt"


def test_vllms_key_is_sent_on_every_request_the_front_builds(make_front, fake):
    front = make_front(api_key="sk-front", upstream_api_key="sk-vllm", model=None)
    auth = {"authorization": "Bearer sk-front"}
    assert completion(front, headers=auth).status_code == 200
    assert completion(front, {"x_unknown": 1}, headers=auth).status_code == 200
    assert httpx2.get(front.url + "/v1/models", headers=auth, timeout=10).status_code == 200
    assert len(fake.headers) >= 4
    assert {h.get("authorization") for h in fake.headers} == {"Bearer sk-vllm"}


# ---- metrics -----------------------------------------------------------------------------------
def test_metrics_count_outcomes_reasons_and_tokens(front):
    completion(front)
    completion(front, {"prompt": "no skill here"})
    text = httpx2.get(front.url + "/metrics", timeout=10).text
    assert 'kvnotes_front_requests_total{outcome="spliced",route="completion"} 1.0' in text
    assert 'kvnotes_front_forwarded_total{reason="no_skill"} 1.0' in text
    assert 'kvnotes_front_prompt_tokens_total{kind="spliced"}' in text
    assert "kvnotes_front_overhead_seconds_bucket" in text
    assert "kvnotes_front_ttft_seconds_count" in text
    assert f"block_size={BLOCK}" not in text


def test_one_log_line_per_request(front, caplog):
    caplog.set_level("INFO", logger="kvnotes.serving.front")
    completion(front, headers={"x-request-id": "req-1\u00e9".encode("latin-1")})
    completion(front, {"prompt": "no skill here"})
    lines = [json.loads(r.getMessage().removeprefix("request ")) for r in caplog.records
             if r.name == "kvnotes.serving.front"]
    assert [(x["outcome"], x["reason"]) for x in lines] == [("spliced", None),
                                                           ("forwarded", "no_skill")]
    assert lines[0]["id"] == "req-1\\u00e9" and lines[0]["plan"]["skills"] == ["header",
                                                                               "refunds"]
    assert lines[0]["status"] == 200 and lines[1]["tenant"] is None


def test_planning_threads_share_one_tokenizer_and_plan_as_one_thread_does(make_front, fake):
    front = make_front(plan_workers=4)
    bodies = [{"prompt": PROMPT + f" Order {i}: " + "item, " * (i * 7)} for i in range(12)]

    def prompts_sent() -> list[str]:
        return sorted(json.dumps(b["prompt"]) for b in fake.posted()[-len(bodies):])

    for body in bodies:
        assert completion(front, body).status_code == 200
    alone = prompts_sent()
    barrier = threading.Barrier(len(bodies))

    def send(body: dict[str, Any]) -> int:
        barrier.wait(timeout=10)
        return completion(front, body).status_code

    threads_out: list[int] = []
    workers = [threading.Thread(target=lambda b=b: threads_out.append(send(b))) for b in bodies]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert threads_out == [200] * len(bodies)
    assert prompts_sent() == alone and len(set(alone)) == len(bodies)
    assert front.stats["spliced"] == 2 * len(bodies)  # planned on the threads, not forwarded


def test_a_planning_failure_is_answered_exactly(make_front, fake, monkeypatch):
    front = make_front()

    def broken(*args: Any) -> Any:
        raise RuntimeError("Already borrowed")

    monkeypatch.setattr(front.service, "_plan", broken)
    resp = completion(front)
    assert resp.status_code == 200
    assert resp.headers[REASON_HEADER].startswith("forwarded: plan_error")
    (sent,) = fake.posted()
    assert sent["prompt"] == PROMPT and "kvnotes" not in sent  # the client's request, exactly
    monkeypatch.undo()
    still_serving(front)  # and plans again once planning works


def test_an_answer_closes_its_upstream_response_even_before_its_stream_starts():
    import asyncio

    from kvnotes.serving.front.call import Reply

    class Upstream:
        closed = 0

        async def aclose(self) -> None:
            Upstream.closed += 1

    async def chunks() -> Any:
        try:
            yield b"data: {}\n\n"
        finally:  # never reached: the generator is closed before its first step
            Upstream.closed += 100

    reply = Reply(200, stream=chunks(), upstream=Upstream())
    asyncio.run(reply.close())
    assert Upstream.closed == 1


# ---- the front's shape -----------------------------------------------------------------------
def test_the_front_holds_its_service_and_its_routes_ask_it(front, monkeypatch):
    from kvnotes.serving.front.call import Reply
    from kvnotes.serving.front.service import FrontService

    assert isinstance(front.service, FrontService) and not isinstance(front, FrontService)
    assert front.config is front.service.config

    async def models(authorization: str | None) -> Reply:
        return Reply(200, {"content-type": "application/json"}, b'{"data": []}')

    # a route is a call of the service's public method: replace the method, the route follows
    monkeypatch.setattr(front.service, "models", models)
    assert httpx2.get(front.url + "/v1/models", timeout=10).json() == {"data": []}


def test_a_client_with_its_answer_sees_it_counted_and_its_slot_back(front):
    for n in range(1, 4):
        resp = completion(front)
        assert resp.status_code == 200, resp.text
        # the admission exited before the last bytes went out: nothing to wait for
        assert front.service.in_flight == 0
        assert front.stats["spliced"] == n


def test_in_flight_changes_only_in_the_admission():
    import re

    import kvnotes.serving.front as package

    folder = Path(package.__file__).parent
    pattern = re.compile(r"\.(take|give_back|release)\(\)")
    assert [p.name for p in sorted(folder.glob("*.py"))
            if pattern.search(p.read_text("utf-8"))] == ["admission.py"]
