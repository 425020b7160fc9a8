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
- ``GET /metrics``: the front's Prometheus metrics (:mod:`~kvnotes.serving.front.prometheus`);
- ``GET /kvnotes/stats``: the front's counters;
- ``POST /kvnotes/skills``: registers skills, compiled by the server
  (:mod:`~kvnotes.serving.front.skill_desk`; a front given a desk only, as ``kvnotes serve``'s
  is, whose ``/health`` is then a 503 until its configured skills are written);
  any other route is a 404.

Per request, ``extra_body={"kvnotes": {...}}``
(:class:`~kvnotes.serving.planning.request.FrontOptions`): ``splice`` (false: answered exactly;
a prompt the front lays out itself, a completion text with a registered skill or a structured
chat, is sent as the same part-wise ids unspliced), ``tenant``, ``repair`` (first tokens),
``guard`` (tau). A wrong body (bad JSON, a field of the wrong type, an unknown or invalid
kvnotes option) is a 400 naming the field. A valid request the front cannot plan (no skill
found, a field it does not model, a template that fails) is forwarded to vLLM exactly (a prompt
the front lays out itself: sent exactly as its part-wise ids); the reason is in the
``x-kvnotes`` response header and in ``kvnotes_front_forwarded_total{reason}``. vLLM's errors
come back with their status and body.

Keys and tenants (:mod:`~kvnotes.serving.front.config`): with keys on, ``/v1`` and
``/kvnotes`` need one (401), a request's tenant is its key's (a ``kvnotes.tenant`` naming
another is a 400), and a tenant's exact requests are salted as its own too.

Planning runs on a small thread pool sharing one tokenizer (encoding only reads it; no lock);
the client leaving cancels its request: the planning wait, the phases and the upstream stream.

The guard: the spliced request asks the first answer token's top-2 log-probs; when their margin
is under tau, the answer is the exact request's (the same ids). A stream holds its first token
back until the guard has decided.

This module is the HTTP side (the routes, the answer that watches for the client leaving,
serving in a thread): :class:`Front` *holds* a :class:`~kvnotes.serving.front.service.FrontService`
(keys and tenants, counting, planning) and its routes call the service's public methods. A
request's slot and ending are its :class:`~kvnotes.serving.front.admission.Admission`'s alone:
taken when the context is entered, given back (and the request counted) when it exits, just
before the answer's last bytes are sent, so a client that has its answer sees it counted. The
rest, lowest first: :mod:`~kvnotes.serving.front.call` (a request's record and reply),
:mod:`~kvnotes.serving.front.body` (reading and checking the body),
:mod:`~kvnotes.serving.front.proxy` (forwarding, spliced requests, streams).

Example:
    >>> front = Front(FrontConfig(upstream="http://127.0.0.1:8001", port=8000),  # doctest: +SKIP
    ...               SkillCatalog(skills.folder, engine.tokenizer))
    >>> with front:                                                             # doctest: +SKIP
    ...     openai.OpenAI(base_url=front.url + "/v1", api_key="-").completions.create(...)
    >>> front.service.stats["spliced"]                                          # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request  # FastAPI reads the routes' annotations at run time
from starlette.responses import Response as StarletteResponse

from kvnotes.core.errors import ServingError
from kvnotes.serving.front.body import parse_body, read_body
from kvnotes.serving.front.call import Call, Reply, error_reply
from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError, error_body, header_value
from kvnotes.serving.front.format import DONE, sse
from kvnotes.serving.front.limits import check_bounds
from kvnotes.serving.front.service import FrontService
from kvnotes.serving.front.vllm_client import HEALTH, MODELS
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.protocol import Outcome

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvnotes.serving.front.skill_desk import SkillDesk
    from kvnotes.serving.learning import Learner

__all__ = ["STATS_PATH", "Front", "FrontConfig", "FrontService", "build_app"]

STATS_PATH = "/kvnotes/stats"
REQUEST_ID_HEADER = "x-request-id"
log = logging.getLogger("kvnotes.serving.front")


class Front:
    """The HTTP front (see the module docstring): an app over one :class:`FrontService`
    (:attr:`service`); ``with front:`` serves it in a thread."""

    def __init__(self, config: FrontConfig, catalog: SkillCatalog,
                 learner: Learner | None = None, desk: SkillDesk | None = None) -> None:
        self.service = FrontService(config, catalog, learner)
        self.desk = desk
        self.app = build_app(self.service, desk)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.connections: Any = None  # the ConnectionGuard of a started front

    @property
    def config(self) -> FrontConfig:
        return self.service.config

    @property
    def stats(self) -> Counter[str]:
        """Requests by outcome (a copy; the service's)."""
        return self.service.stats

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

        from kvnotes.serving.front.connections import ConnectionGuard, guarded_protocol

        if self._thread is not None:
            raise ServingError("this front is already started")
        c = self.config
        self._sock = sock = _listening(c)
        self.connections = ConnectionGuard(c.head_timeout, c.max_connections_per_ip)
        settings = uvicorn.Config(
            self.app, http=guarded_protocol(self.connections), loop="asyncio", lifespan="on",
            log_level="warning",
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


def _listening(c: FrontConfig) -> socket.socket:
    """The front's listening socket, bound to ``c.host:c.port``."""
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
    return sock


# ---- one /v1 request ---------------------------------------------------------------------------
class _Answer(StarletteResponse):
    """One ``POST /v1/...`` request from its admission on: the body read and checked, the
    answer sent while watching for the client to leave (a client that disconnects cancels the
    work: planning wait, phases, upstream stream), all inside the service's
    :class:`~kvnotes.serving.front.admission.Admission`; the answer's last bytes are sent once
    it has exited (the slot back, the request counted)."""

    def __init__(self, service: FrontService, call: Call, request: Request,
                 key_tenant: str | None, auth: str | None) -> None:  # noqa: D107
        # not Response.__init__: the status and headers are known only once the work is done
        self.service, self.call, self.request = service, call, request
        self.key_tenant, self.auth = key_tenant, auth
        self.background = None
        self._started = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        last: bytes | None
        try:
            async with self.service.admission(self.call):
                last = await self._answer(receive, send)
        except ApiError as err:  # no slot free: a 429, counted as rejected
            last = await self._head(error_reply(err), send)
        if last is not None:
            await send({"type": "http.response.body", "body": last})

    async def _answer(self, receive: Any, send: Any) -> bytes | None:
        """The answer, sent but for its last bytes (returned; None: nothing more to send)."""
        service, call = self.service, self.call
        try:
            try:
                data = parse_body(await read_body(self.request, service.config), call.route,
                                  service.config)
                check_bounds(call.route, data, service.config)
            except ApiError:
                call.outcome = Outcome.BAD_REQUEST
                raise
            work = service.answer(call.route, data, call, self.key_tenant, self.auth)
            return await self._watched(work, receive, send)
        except ApiError as err:
            return None if self._started else await self._head(error_reply(err), send)
        except Exception:  # noqa: BLE001 -- a fault answers 500, its text in the log
            log.exception("request %s failed", call.id)
            call.outcome = Outcome.INTERNAL_ERROR
            if self._started:
                return None
            return await self._head(error_reply(internal_error(call)), send)

    async def _watched(self, work: Any, receive: Any, send: Any) -> bytes | None:
        task = asyncio.ensure_future(self._send(work, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                self.call.outcome = Outcome.DISCONNECTED
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
            return await task
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()

    async def _head(self, reply: Reply, send: Any) -> bytes:
        """Start a whole answer; its body is the caller's to send."""
        self.call.status = reply.status
        await self._start(reply, send, len(reply.body))
        self.service.first_bytes(self.call)
        return reply.body

    async def _start(self, reply: Reply, send: Any, length: int | None) -> None:
        headers = [(k.encode("latin-1"), header_value(v, 500).encode("latin-1"))
                   for k, v in reply.headers.items()]
        headers.append((REQUEST_ID_HEADER.encode(), self.call.id.encode("latin-1")))
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        self._started = True
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})

    async def _send(self, work: Any, send: Any) -> bytes:
        """Send the answer ``work`` computes but for its last bytes (returned)."""
        deadline = asyncio.get_running_loop().time() + self.service.config.request_timeout
        reply = await self._reply_of(work, deadline)
        if reply.stream is None:
            return await self._head(reply, send)
        self.call.status = reply.status
        try:  # from the start of the answer on: a client leaving at any await closes upstream
            await self._start(reply, send, None)
            await self._stream(reply, send, deadline)
        finally:
            await reply.close()
        return b""

    async def _reply_of(self, work: Any, deadline: float) -> Reply:
        """What ``work`` answers, or the error reply it ends in."""
        try:
            async with asyncio.timeout_at(deadline):
                reply: Reply = await work
                return reply
        except TimeoutError:
            self.call.outcome = Outcome.UPSTREAM_ERROR
            return error_reply(self._too_long())
        except ApiError as err:
            if not self.call.outcome or self.call.outcome == Outcome.FORWARDED:
                self.call.outcome = Outcome.UPSTREAM_ERROR if err.status >= 500 else Outcome.BAD_REQUEST
            return error_reply(err)
        except Exception:  # noqa: BLE001 -- a fault answers 500, its text only in the log
            log.exception("request %s failed", self.call.id)
            self.call.outcome = Outcome.INTERNAL_ERROR
            return error_reply(internal_error(self.call))

    async def _stream(self, reply: Reply, send: Any, deadline: float) -> None:
        """A streamed answer's chunks; a fault ends an event stream with an error event."""
        assert reply.stream is not None
        first, fault = True, None
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in reply.stream:
                    if chunk:
                        if first:
                            first = False
                            self.service.first_bytes(self.call)
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
        except TimeoutError:
            self.call.outcome = Outcome.UPSTREAM_ERROR
            fault = self._too_long()
        except Exception:  # noqa: BLE001 -- the stream ends with an error event, not a cut
            log.exception("request %s: its stream failed", self.call.id)
            self.call.outcome = Outcome.INTERNAL_ERROR
            fault = internal_error(self.call)
        if fault is not None and reply.headers.get("content-type", "").startswith(
                "text/event-stream"):
            await send({"type": "http.response.body", "more_body": True,
                        "body": sse(error_body(fault.status, str(fault))) + DONE})

    def _too_long(self) -> ApiError:
        return ApiError(504, f"the answer took longer than {self.service.config.request_timeout:g}"
                        " s (FrontConfig.request_timeout)")


def internal_error(call: Call) -> ApiError:
    """The 500 of a fault in the front: what happened is in the log, under the request id."""
    return ApiError(500, f"the kvnotes front failed on this request; its log has the details "
                    f"under request id {call.id}")


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- the ASGI app ------------------------------------------------------------------------------
def build_app(service: FrontService, desk: SkillDesk | None = None) -> FastAPI:
    """The FastAPI app serving ``service`` (and ``desk``'s registrations): its error shapes,
    lifespan and routes."""
    app = _new_app(service)
    _add_routes(app, service, desk)
    if desk is not None:
        _add_desk(app, service, desk)
    return app


def _new_app(service: FrontService) -> FastAPI:
    """A FastAPI app with ``service``'s lifespan, the head limit and OpenAI-shaped errors."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    from kvnotes.serving.front.connections import HeadLimit

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await service.opened()
        try:
            yield
        finally:
            await service.closed()

    settings = functools.partial(FastAPI, lifespan=lifespan, docs_url=None, redoc_url=None,
                                 openapi_url=None)
    try:  # FastAPI's own OpenTelemetry hooks cost a context lookup per request: the front has
        # its own metrics
        app = settings(telemetry={"tracing": False, "metrics": False})
    except TypeError:  # a FastAPI without telemetry
        app = settings()

    def error(err: ApiError) -> Response:
        headers = {"connection": "close"} if err.status in (408, 413) else None
        return JSONResponse(error_body(err.status, str(err), err.param), err.status,
                            headers=headers)

    app.add_middleware(HeadLimit, limit=service.config.max_header_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return error(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return error(ApiError(err.status_code, f"{what}: the front serves /v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics and "
                              f"{STATS_PATH}"))

    return app


def _add_routes(app: FastAPI, service: FrontService, desk: SkillDesk | None) -> None:
    """The front's routes, each a call of one public method of ``service``."""
    from fastapi.responses import JSONResponse, Response

    def passed(reply: Reply) -> Response:
        return Response(reply.body, reply.status, media_type=reply.headers["content-type"])

    async def post(request: Request, kind: str) -> Any:
        auth = _auth(request)
        call, key_tenant = service.open_call(kind, request.headers.get(REQUEST_ID_HEADER), auth,
                                             request.client.host if request.client else "")
        return _Answer(service, call, request, key_tenant, auth)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await post(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await post(request, "chat")

    @app.get(MODELS)
    async def models(request: Request) -> Response:
        return passed(await service.models(_auth(request)))

    @app.get(HEALTH)
    async def health() -> Response:
        if desk is not None and not desk.ready.is_set():
            return JSONResponse(error_body(503, "the server is compiling its skills"), 503)
        return passed(await service.health())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(service.metrics_text(_auth(request)),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(STATS_PATH)
    async def stats(request: Request) -> Response:
        return JSONResponse(service.stats_for(_auth(request)))


def _add_desk(app: FastAPI, service: FrontService, desk: SkillDesk) -> None:
    """``POST /kvnotes/skills``: skills registered through ``desk``."""
    from fastapi.responses import JSONResponse, Response

    from kvnotes.serving.front.skill_desk import SKILLS_PATH

    @app.post(SKILLS_PATH)
    async def register(request: Request) -> Response:
        desk.authorize(service.config, service.keys, _auth(request))
        body = await read_body(request, service.config)
        return JSONResponse(await asyncio.to_thread(desk.register, body))


def _auth(request: Request) -> str | None:
    return request.headers.get("authorization")
