"""An OpenAI-compatible front for a kvnotes server: any client gets spliced, repaired skills.

``kvnotes serve`` runs a stock vLLM (with kvnotes' connector) on a loopback port and this front
on the address users are given. It is a FastAPI (Starlette) app served by uvicorn, with one
pooled ``httpx2.AsyncClient`` (openai's own httpx) to vLLM: the stack vLLM's own OpenAI server
runs on, so HTTP parsing and its limits (head size, keep-alive, backlog, concurrency) are
h11's and uvicorn's, well kept and configured by name in :class:`FrontConfig`, not written
here. Routes:

- ``POST /v1/completions`` (a text prompt, or token ids) and ``POST /v1/chat/completions``
  (messages rendered with the model's chat template), streamed or not: registered skills found
  in the prompt's text are spliced (:mod:`~kvnotes.serving.planning.match`), the prompt is sent
  part by part as ``engine.compose`` lays it out, each spliced skill's first tokens are
  recomputed in context through phases (:mod:`~kvnotes.serving.planning.phases`), and the
  answer comes back in the client's format with ``usage.kvnotes``
  (:mod:`~kvnotes.serving.front.format`);
- ``GET /v1/models`` and ``GET /health``: vLLM's, passed on;
- ``GET /metrics``: the front's Prometheus metrics (:mod:`~kvnotes.serving.front.metrics`);
- ``GET /kvnotes/stats``: the front's counters; any other route is a 404.

Per request, ``extra_body={"kvnotes": {...}}``
(:class:`~kvnotes.serving.planning.request.FrontOptions`): ``splice`` (false: forwarded
exactly), ``tenant``, ``repair`` (first tokens), ``guard`` (tau). A wrong body (bad JSON, a
field of the wrong type, an unknown or invalid kvnotes option) is a 400 naming the field. A
valid request the front cannot plan (no skill found, a field it does not model, a template that
fails) is forwarded to vLLM exactly; the reason is in the ``x-kvnotes`` response header and in
``kvnotes_front_forwarded_total{reason}``. vLLM's errors come back with their status and body.

Keys and tenants (:mod:`~kvnotes.serving.front.config`): with keys on, ``/v1`` and
``/kvnotes`` need one (401), a request's tenant is its key's (a ``kvnotes.tenant`` naming
another is a 400), and a tenant's exact requests are salted as its own too.

Planning runs on a small thread pool (each thread with its own tokenizer copy, no global lock);
the client leaving cancels its request: the planning wait, the phases and the upstream stream.

The guard: the spliced request asks the first answer token's top-2 log-probs; when their margin
is under tau, the answer is the exact request's (the same ids). A stream holds its first token
back until the guard has decided.

Example:
    >>> front = Front(FrontConfig(upstream="http://127.0.0.1:8001", port=8000),  # doctest: +SKIP
    ...               SkillCatalog(skills.folder, engine.tokenizer))
    >>> with front:                                                             # doctest: +SKIP
    ...     openai.OpenAI(base_url=front.url + "/v1", api_key="-").completions.create(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request  # FastAPI reads the routes' annotations at run time
from starlette.responses import Response as StarletteResponse

from kvnotes.core.errors import KvnotesError, ServingError
from kvnotes.core.repair import Repair
from kvnotes.serving.front.config import FrontConfig, Keys
from kvnotes.serving.front.errors import ApiError, error_body, header_value
from kvnotes.serving.front.format import DONE, InvalidEvent, Shaper, first_top_logprobs, parse_sse_line, sse
from kvnotes.serving.front.metrics import FrontMetrics
from kvnotes.serving.front.upstream import COMPLETIONS, HEALTH, MODELS, ROUTES, Upstream
from kvnotes.serving.library.manifest import SPLICE_SALT
from kvnotes.serving.planning.front_plan import FrontPlan, exact_body, phase_bodies, plan_request, real_body
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.phases import guard_fires
from kvnotes.serving.planning.request import (
    OPTIONS_KEY,
    BadRequest,
    FrontOptions,
    FrontRequest,
    Unplannable,
    check_body,
    read_options,
    read_request,
)

__all__ = ["REASON_HEADER", "STATS_PATH", "Front", "FrontConfig"]

STATS_PATH = "/kvnotes/stats"
REASON_HEADER = "x-kvnotes"
REQUEST_ID_HEADER = "x-request-id"
TENANT_SALT = "kvnotes-tenant"  # a tenant's exact requests: kvnotes-tenant:<tenant>[:<salt>]
_TENANT_SALTS = (f"{SPLICE_SALT}:", f"{TENANT_SALT}:")
log = logging.getLogger("kvnotes.serving.front")
# headers of vLLM's answers not passed on: hop-by-hop (RFC 9110 7.6.1) and those uvicorn sets
_DROP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                 "proxy-authenticate", "proxy-authorization", "content-length", "content-encoding",
                 "date", "server"}
_JSON = "application/json"


@dataclass
class Reply:
    """An answer to send: a whole body, or a stream of byte chunks."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: AsyncGenerator[bytes, None] | None = None


def json_reply(status: int, obj: Any, **headers: str) -> Reply:
    return Reply(status, {"content-type": _JSON, **headers}, json.dumps(obj).encode())


def error_reply(err: ApiError) -> Reply:
    headers = {"connection": "close"} if err.status in (408, 413) else {}
    return json_reply(err.status, error_body(err.status, str(err), err.param), **headers)


@dataclass
class Call:
    """One request's record: what its log line and metrics say."""

    route: str
    id: str
    t0: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    outcome: str = ""
    reason: str | None = None
    status: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    first_upstream: float | None = None
    finished: bool = False

    def upstream_started(self) -> None:
        if self.first_upstream is None:
            self.first_upstream = time.perf_counter()


class Front:
    """The HTTP front (see the module docstring); ``with front:`` serves in a thread."""

    def __init__(self, config: FrontConfig, catalog: SkillCatalog) -> None:
        if config.upstream is None:
            raise ServingError("FrontConfig.upstream is None: give the vLLM server's URL")
        self.config, self.catalog = config, catalog
        self.upstream = config.upstream.rstrip("/")
        self.keys: Keys = config.keys  # read once: a bad key file fails here, not per request
        self.metrics = FrontMetrics()
        self.up = Upstream(config)
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._in_flight = 0
        self.app = build_app(self)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def stats(self) -> Counter[str]:
        """Requests by outcome (a copy)."""
        return Counter(self.metrics.counts)

    # ---- running ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._sock is None:
            raise ServingError("the front is not started")
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        return f"http://{host}:{self.port}"

    def start(self) -> Front:
        """Listen and serve in a background thread (returns once it accepts connections)."""
        import uvicorn

        if self._thread is not None:
            raise ServingError("this front is already started")
        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
        # so, and with it on, a reply's head and body written apart wait for a delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((c.host, c.port or 0))
            sock.listen(c.backlog)
        except OSError as err:
            sock.close()
            raise ServingError(f"the front cannot listen on {c.host}:{c.port}: {err} (choose "
                               "another --port)") from err
        self._sock = sock
        settings = uvicorn.Config(
            self.app, http="h11", loop="asyncio", lifespan="on", log_level="warning",
            access_log=False, backlog=c.backlog, timeout_keep_alive=c.keep_alive_s,  # type: ignore[arg-type]
            limit_concurrency=c.max_connections, h11_max_incomplete_event_size=c.max_header_bytes,
            timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(settings)
        server = self._server
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                                        name="kvnotes-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServingError("the front did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving, and close the upstream connections."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            self._thread = None
        self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def opened(self) -> None:
        """Inside the serving loop, before the first request."""
        self._pool = ThreadPoolExecutor(self.config.plan_workers, thread_name_prefix="kvnotes-plan")
        await self.up.open()
        with contextlib.suppress(Exception):  # vLLM may not be up yet: read again when needed
            await asyncio.wait_for(self.up.discover(), self.config.discover_timeout)

    async def closed(self) -> None:
        await self.up.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ---- keys ------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of a request's key; 401 when keys are on and it has none that is known."""
        if not self.keys.enabled:
            return self.config.tenant
        scheme, _, key = (authorization or "").partition(" ")
        known, tenant = self.keys.tenant_of(key.strip()) if scheme.lower() == "bearer" \
            else (False, None)
        if not known:
            raise ApiError(401, "a valid API key is needed: send Authorization: Bearer <key>")
        return tenant

    def tenant_of(self, opts: FrontOptions, key_tenant: str | None) -> str | None:
        """The request's tenant: its key's when keys are on (a different ``kvnotes.tenant`` is
        a 400), else the one it names, else the front's."""
        if self.keys.enabled:
            if opts.tenant is not None and opts.tenant != key_tenant:
                raise ApiError(400, f"{OPTIONS_KEY}.tenant {opts.tenant!r} is not this key's "
                               "tenant: leave it out (the key sets the tenant)",
                               f"{OPTIONS_KEY}.tenant")
            return key_tenant
        return opts.tenant if opts.tenant is not None else self.config.tenant

    def exact_salt(self, tenant: str | None, client_salt: object) -> str | None:
        """The ``cache_salt`` of an exact request when keys are on: the tenant's own (a client's
        salt inside it), so no tenant shares another's cached blocks; ``client_salt`` otherwise."""
        if not self.keys.enabled:
            return client_salt if isinstance(client_salt, str) else None
        if tenant is None:
            # the shared tenant may not name a tenant's salts (it would hit that tenant's blocks)
            if isinstance(client_salt, str) and client_salt.startswith(_TENANT_SALTS):
                raise ApiError(400, f"cache_salt values starting with {_TENANT_SALTS} are "
                               "the front's own", "cache_salt")
            return client_salt if isinstance(client_salt, str) else None
        base = f"{TENANT_SALT}:{tenant}"
        return base if not isinstance(client_salt, str) else f"{base}:{client_salt}"

    # ---- requests --------------------------------------------------------------------------
    def begin(self) -> None:
        self._in_flight += 1
        self.metrics.in_flight.inc()

    def end(self) -> None:
        self._in_flight -= 1
        self.metrics.in_flight.dec()

    def finish(self, call: Call) -> None:
        """A request's end: its metrics and its log line (once, before its last bytes are sent,
        so a client that has its answer sees it counted)."""
        if call.finished:
            return
        call.finished = True
        self.end()
        m = self.metrics
        if call.first_upstream is not None:
            m.overhead.labels(call.route).observe(call.first_upstream - call.t0)
        outcome = call.outcome or "upstream_error"
        m.outcome(call.route, outcome, call.reason)
        log.info("request %s", json.dumps({
            "id": call.id, "route": call.route, "tenant": call.tenant, "status": call.status,
            "outcome": outcome, "reason": call.reason, "plan": call.plan,
            "ms": round((time.perf_counter() - call.t0) * 1e3, 2)}))

    def new_call(self, route: str, request_id: str | None) -> Call:
        rid = header_value(request_id, 64) if request_id else ""
        return Call(route, rid or uuid.uuid4().hex)

    async def read_body(self, request: Request) -> bytes:
        """The body, at most ``max_body_bytes`` (413, checked as it comes) within
        ``body_timeout`` (408)."""
        from starlette.requests import ClientDisconnect

        limit = self.config.max_body_bytes
        claimed = request.headers.get("content-length")
        if claimed is not None and claimed.strip().isdigit() and int(claimed) > limit:
            raise ApiError(413, f"the body is larger than {limit} bytes")
        buf = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                buf.extend(chunk)
                if len(buf) > limit:
                    raise ApiError(413, f"the body is larger than {limit} bytes")

        try:
            await asyncio.wait_for(read(), self.config.body_timeout)
        except TimeoutError as err:
            raise ApiError(408, f"the body did not arrive within {self.config.body_timeout:g} s"
                           ) from err
        except ClientDisconnect as err:
            raise ApiError(400, "the client closed the connection before its body ended") from err
        return bytes(buf)

    def parse(self, raw: bytes, kind: str) -> dict[str, Any]:
        """The body's JSON object, checked (400 naming the field)."""
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except RecursionError as err:
            raise ApiError(400, "the body's JSON is nested too deeply") from err
        except ValueError as err:  # UnicodeDecodeError too
            raise ApiError(400, f"the body is not valid JSON: {str(err)[:200]}") from err
        if json_depth(data) > self.config.max_json_depth:
            raise ApiError(400, f"the body's JSON is nested deeper than "
                           f"{self.config.max_json_depth} levels")
        try:
            return check_body(kind, data)
        except BadRequest as err:
            raise ApiError(400, str(err), err.param or None) from err

    async def answer(self, kind: str, data: dict[str, Any], call: Call,
                     key_tenant: str | None, client_auth: str | None) -> Reply:
        """The answer to a checked body: spliced, or forwarded exactly with the reason."""
        opts = read_options(data.get(OPTIONS_KEY))
        tenant = call.tenant = self.tenant_of(opts, key_tenant)
        exact = {k: v for k, v in data.items() if k != OPTIONS_KEY}
        salt = self.exact_salt(tenant, exact.get("cache_salt"))
        if salt is not None:
            exact["cache_salt"] = salt
        try:
            if not opts.splice:
                raise Unplannable(f"{OPTIONS_KEY}.splice is false", "opted_out")
            block_size = await self.up.block_size()
            req, fp = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._plan, kind, data, opts, tenant, block_size)
            model = str(req.sampling.get("model") or await self.up.model())
        except Unplannable as err:
            return await self.forward(kind, exact, call, err, client_auth)
        except (KvnotesError, ValueError) as err:
            return await self.forward(kind, exact, call,
                                      Unplannable(f"not planned: {err}"), client_auth)
        tau = self.config.guard if opts.guard is None else opts.guard
        call.plan = {"skills": fp.skills, "phases": len(fp.plan.phase_ends),
                     "spliced_tokens": fp.plan.spliced_tokens}
        return await self.spliced(req, fp, model, tau, call, exact, salt)

    def _plan(self, kind: str, data: dict[str, Any], opts: FrontOptions, tenant: str | None,
              block_size: int) -> tuple[FrontRequest, FrontPlan]:
        tokenizer = self._tokenizer()
        req = read_request(kind, data, tokenizer)
        repair = Repair(first=self.config.repair if opts.repair is None else opts.repair)
        return req, plan_request(req, self.catalog, repair, block_size, tenant, tokenizer)

    def _tokenizer(self) -> Any:
        """This planning thread's own copy of the tokenizer (fast tokenizers are not meant to
        be shared by threads)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.catalog.tokenizer)
            except Exception:  # noqa: BLE001 -- a tokenizer that cannot be copied is shared
                tok = self.catalog.tokenizer
            self._local.tokenizer = tok
        return tok

    async def forward(self, kind: str, body: dict[str, Any], call: Call, why: Unplannable,
                      client_auth: str | None) -> Reply:
        """The request passed to vLLM as it is; its answer relayed as it comes."""
        call.outcome, call.reason = "forwarded", why.code
        call.upstream_started()
        resp = await self.up.open_stream("POST", ROUTES[kind], body,
                                         self.up.headers(self._passed_auth(client_auth)))
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}
        headers[REASON_HEADER] = header_value(f"forwarded: {why.code}: {why}")
        if resp.status_code >= 500:
            call.outcome = "upstream_error"
        sse_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
        return Reply(resp.status_code, headers, stream=self._relay(resp, sse_stream, call))

    def _passed_auth(self, client_auth: str | None) -> str | None:
        # the client's key is vLLM's only when the front checks none of its own
        return None if self.keys.enabled else client_auth

    async def _relay(self, resp: Any, sse_stream: bool, call: Call) -> AsyncGenerator[bytes, None]:
        import httpx2

        ended = False
        try:
            async for chunk in resp.aiter_bytes():
                ended = chunk.endswith(DONE) or ended and not chunk
                yield chunk
        except httpx2.HTTPError as err:
            call.outcome = "upstream_error"
            if sse_stream and not ended:
                yield sse(error_body(502, f"the vLLM server's stream broke: {type(err).__name__}"))
                yield DONE
        finally:
            await resp.aclose()

    async def spliced(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float, call: Call,
                      exact: dict[str, Any], salt: str | None) -> Reply:
        info: dict[str, Any] = {"spliced_tokens": fp.plan.spliced_tokens, "phases": 0,
                                "guard_fired": False, "plan": fp.to_dict()}
        call.upstream_started()
        for body in phase_bodies(fp, model):
            status, data = await self.up.post_json(COMPLETIONS, body)
            if status != 200:
                reply = await self.forward(req.kind, exact, call, Unplannable(
                    f"a phase failed: HTTP {status}: {data[:200].decode(errors='replace')}",
                    "phase_failed"), None)
                if call.outcome == "forwarded":
                    call.outcome = "phase_failed"
                return reply
            info["phases"] += 1
        shaper = Shaper(req.kind, req.logprobs, req.include_usage)
        headers = {REASON_HEADER: header_value(f"spliced {','.join(fp.skills)}")}
        exact_ids = exact_body(fp.ids, req, model)
        if salt is not None:
            exact_ids["cache_salt"] = salt
        if req.stream:
            return await self._stream(req, fp, model, tau, info, shaper, headers, call, exact_ids)
        status, data = await self.up.post_json(COMPLETIONS, real_body(fp, req, model, tau))
        if status != 200:
            return self._upstream_failed(status, data, call)
        answer = _loads(data)
        if guard_fires(first_top_logprobs(answer), tau):
            info["guard_fired"] = True
            status, data = await self.up.post_json(COMPLETIONS, exact_ids)
            if status != 200:
                return self._upstream_failed(status, data, call)
            answer = _loads(data)
        self._spliced_done(fp, info, call)
        return json_reply(200, shaper.body(answer, info), **headers)

    def _spliced_done(self, fp: FrontPlan, info: dict[str, Any], call: Call) -> None:
        call.outcome = "guard_fired" if info["guard_fired"] else "spliced"
        plan = fp.plan
        self.metrics.spliced_tokens(plan.spliced_tokens, plan.repaired_tokens,
                                    plan.prompt_len - plan.spliced_tokens - plan.repaired_tokens,
                                    info["phases"])

    def _upstream_failed(self, status: int, data: bytes, call: Call) -> Reply:
        call.outcome = "upstream_error"
        return Reply(status, {"content-type": _JSON}, data)

    async def _begin_stream(self, body: dict[str, Any], call: Call) -> Any:
        resp = await self.up.open_stream("POST", COMPLETIONS, body)
        if resp.status_code != 200:
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
            return self._upstream_failed(resp.status_code, data, call)
        return resp

    async def _stream(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float,
                      info: dict[str, Any], shaper: Shaper, headers: dict[str, str], call: Call,
                      exact_ids: dict[str, Any]) -> Reply:
        resp = await self._begin_stream(real_body(fp, req, model, tau), call)
        if isinstance(resp, Reply):
            return resp
        events = _events(resp)
        held: list[Any] = []
        try:
            if tau > 0:
                # hold the stream until the first token's log-probs have come
                async for event in events:
                    held.append(event)
                    if not isinstance(event, dict) or first_top_logprobs(event) is not None \
                            or any(c.get("finish_reason") for c in event.get("choices") or []):
                        break  # [DONE], an error, the first token's log-probs, or the end
                top = next((t for t in map(first_top_logprobs, held) if t is not None), None)
                if guard_fires(top, tau):
                    await events.aclose()
                    info["guard_fired"] = True
                    resp = await self._begin_stream(exact_ids, call)
                    if isinstance(resp, Reply):
                        return resp
                    events, held = _events(resp), []
        except BaseException:
            await events.aclose()
            raise
        return Reply(200, {"content-type": "text/event-stream", "cache-control": "no-cache",
                           **headers}, stream=self._shaped(held, events, shaper, info, fp, call))

    async def _shaped(self, held: list[Any], events: AsyncGenerator[Any, None], shaper: Shaper,
                      info: dict[str, Any], fp: FrontPlan, call: Call
                      ) -> AsyncGenerator[bytes, None]:
        """The client's events; a stream that breaks or sends what is not JSON ends with an
        error event and ``[DONE]``."""
        import httpx2

        failure = "the vLLM server's stream ended before [DONE]"
        try:
            async for event in _chain(held, events):
                if event is DONE:
                    self._spliced_done(fp, info, call)
                    yield DONE
                    return
                if isinstance(event, InvalidEvent):
                    failure = "the vLLM server sent an event that is not JSON"
                    break
                if not isinstance(event, dict) or "error" in event:
                    call.outcome = "upstream_error"
                    yield sse(event)
                    continue
                for out in shaper.chunk(event, info):
                    yield sse(out)
        except httpx2.HTTPError as err:
            failure = f"the vLLM server's stream broke: {type(err).__name__}"
        finally:
            await events.aclose()
        call.outcome = "upstream_error"
        yield sse(error_body(502, failure))
        yield DONE


async def _events(resp: Any) -> AsyncGenerator[Any, None]:
    """The events of an upstream SSE response (closing it when done or closed)."""
    try:
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            if event is not None:
                yield event
    finally:
        await resp.aclose()


async def _chain(held: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for event in held:
        yield event
    async for event in rest:
        yield event


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _loads(data: bytes) -> dict[str, Any]:
    try:
        out = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        raise ApiError(502, "the vLLM server answered with what is not JSON") from err
    if not isinstance(out, dict):
        raise ApiError(502, "the vLLM server answered with what is not a JSON object")
    return out


def json_depth(value: Any) -> int:
    """The nesting depth of a JSON value (a scalar: 0), without recursion.

    Example:
        >>> json_depth({"a": [1, {"b": 2}]}), json_depth(3)
        (3, 0)
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest


# ---- the ASGI app ------------------------------------------------------------------------------
class _Answer(StarletteResponse):
    """Runs one request's answer while watching for the client to leave: a client that
    disconnects cancels the work (planning wait, phases, upstream stream)."""

    def __init__(self, front: Front, call: Call, work: Any) -> None:  # noqa: D107
        # not Response.__init__: the status and headers are known only once the work is done
        self.front, self.call, self.work = front, call, work
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.ensure_future(self._send(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                self.call.outcome = "disconnected"
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            watch.cancel()
            self.front.finish(self.call)

    async def _send(self, send: Any) -> None:
        try:
            reply: Reply = await self.work
        except ApiError as err:
            if not self.call.outcome or self.call.outcome == "forwarded":
                self.call.outcome = "upstream_error" if err.status >= 500 else "bad_request"
            reply = error_reply(err)
        except Exception as err:  # noqa: BLE001 -- a bug answers 500, in the OpenAI shape
            log.exception("request %s failed", self.call.id)
            self.call.outcome = "upstream_error"
            reply = error_reply(ApiError(500, f"kvnotes front: {type(err).__name__}: {err}"))
        self.call.status = reply.status
        headers = [(k.encode("latin-1"), header_value(v, 500).encode("latin-1"))
                   for k, v in reply.headers.items()]
        headers.append((REQUEST_ID_HEADER.encode(), self.call.id.encode("latin-1")))
        if reply.stream is None:
            headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        if reply.stream is None:
            self.front.metrics.ttft.labels(self.call.route).observe(time.perf_counter() - self.call.t0)
            self.front.finish(self.call)
            await send({"type": "http.response.body", "body": reply.body})
            return
        first = True
        try:
            async for chunk in reply.stream:
                if chunk:
                    if first:
                        first = False
                        self.front.metrics.ttft.labels(self.call.route).observe(
                            time.perf_counter() - self.call.t0)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await reply.stream.aclose()
        self.front.finish(self.call)
        await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(front: Front) -> Any:
    """The FastAPI app of ``front`` (its routes, error shapes and lifespan)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await front.opened()
        try:
            yield
        finally:
            await front.closed()

    settings: dict[str, Any] = {"lifespan": lifespan, "docs_url": None, "redoc_url": None,
                                "openapi_url": None}
    try:  # FastAPI's own OpenTelemetry hooks cost a context lookup per request: the front has
        # its own metrics
        app = FastAPI(**settings, telemetry={"tracing": False, "metrics": False})
    except TypeError:  # a FastAPI without telemetry
        app = FastAPI(**settings)

    def error(err: ApiError) -> Response:
        headers = {"connection": "close"} if err.status in (408, 413) else None
        return JSONResponse(error_body(err.status, str(err), err.param), err.status,
                            headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return error(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return error(ApiError(err.status_code, f"{what}: the front serves /v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics and "
                              f"{STATS_PATH}"))

    async def post(request: Request, kind: str) -> Any:
        call = front.new_call(kind, request.headers.get(REQUEST_ID_HEADER))
        auth = request.headers.get("authorization")
        try:
            key_tenant = front.authenticate(auth)
        except ApiError:
            front.metrics.outcome(kind, "unauthorized")
            raise
        if front._in_flight >= front.config.max_concurrent:
            front.metrics.outcome(kind, "rejected")
            raise ApiError(429, f"the front is serving {front.config.max_concurrent} requests "
                           "(FrontConfig.max_concurrent): retry later")
        front.begin()
        try:
            data = front.parse(await front.read_body(request), kind)
        except ApiError:
            front.metrics.outcome(kind, "bad_request")
            front.end()
            raise
        return _Answer(front, call, front.answer(kind, data, call, key_tenant, auth))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await post(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await post(request, "chat")

    @app.get(MODELS)
    async def models(request: Request) -> Response:
        front.authenticate(request.headers.get("authorization"))
        auth = front._passed_auth(request.headers.get("authorization"))
        status, data, ctype = await front.up.get(MODELS, headers=front.up.headers(auth))
        return Response(data, status, media_type=ctype or _JSON)

    @app.get(HEALTH)
    async def health() -> Response:
        status, data, ctype = await front.up.get(HEALTH, timeout=front.config.discover_timeout)
        return Response(data, status, media_type=ctype or "text/plain")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(front.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(STATS_PATH)
    async def stats(request: Request) -> Response:
        front.authenticate(request.headers.get("authorization"))
        return JSONResponse(front.metrics.stats())

    return app
