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

Planning runs on a small thread pool (each thread with its own tokenizer copy, no global lock);
the client leaving cancels its request: the planning wait, the phases and the upstream stream.

The guard: the spliced request asks the first answer token's top-2 log-probs; when their margin
is under tau, the answer is the exact request's (the same ids). A stream holds its first token
back until the guard has decided.

This module is the HTTP side (the routes, the answer that watches for the client leaving,
serving in a thread); the rest, lowest first: :mod:`~kvnotes.serving.front.call` (a request's
record and reply), :mod:`~kvnotes.serving.front.body` (reading and checking the body),
:mod:`~kvnotes.serving.front.proxy` (forwarding, spliced requests, streams),
:mod:`~kvnotes.serving.front.service` (keys and tenants, counting, planning).

Example:
    >>> front = Front(FrontConfig(upstream="http://127.0.0.1:8001", port=8000),  # doctest: +SKIP
    ...               SkillCatalog(skills.folder, engine.tokenizer))
    >>> with front:                                                             # doctest: +SKIP
    ...     openai.OpenAI(base_url=front.url + "/v1", api_key="-").completions.create(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request  # FastAPI reads the routes' annotations at run time
from starlette.responses import Response as StarletteResponse

from kvnotes.core.errors import ServingError
from kvnotes.serving.front.admission import Admission
from kvnotes.serving.front.body import parse_body, read_body
from kvnotes.serving.front.call import JSON, Call, Reply, error_reply
from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError, error_body, header_value
from kvnotes.serving.front.format import DONE, sse
from kvnotes.serving.front.limits import check_bounds
from kvnotes.serving.front.service import FrontService
from kvnotes.serving.front.upstream import HEALTH, MODELS
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.protocol import Outcome

if TYPE_CHECKING:
    from kvnotes.serving.front.learner import Learner

__all__ = ["STATS_PATH", "Front", "FrontConfig"]

STATS_PATH = "/kvnotes/stats"
REQUEST_ID_HEADER = "x-request-id"
log = logging.getLogger("kvnotes.serving.front")


class Front(FrontService):
    """The HTTP front (see the module docstring); ``with front:`` serves in a thread."""

    def __init__(self, config: FrontConfig, catalog: SkillCatalog,
                 learner: Learner | None = None) -> None:
        super().__init__(config, catalog, learner)
        self.app = build_app(self)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.connections: Any = None  # the ConnectionGuard of a started front

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


# ---- the ASGI app ------------------------------------------------------------------------------
class _Answer(StarletteResponse):
    """One ``POST /v1/...`` request from its admission on: the slot taken, the body read and
    checked, the answer sent while watching for the client to leave (a client that disconnects
    cancels the work: planning wait, phases, upstream stream), all inside one
    :class:`~kvnotes.serving.front.admission.Admission`, so the slot comes back however it
    ends."""

    def __init__(self, front: Front, call: Call, request: Request, key_tenant: str | None,
                 auth: str | None) -> None:  # noqa: D107
        # not Response.__init__: the status and headers are known only once the work is done
        self.front, self.call, self.request = front, call, request
        self.key_tenant, self.auth = key_tenant, auth
        self.background = None
        self.admitted: Admission | None = None
        self._started = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        front, call = self.front, self.call
        try:
            async with front.admission(call) as self.admitted:
                try:
                    try:
                        data = parse_body(await read_body(self.request, front.config),
                                          call.route, front.config)
                        check_bounds(call.route, data, front.config)
                    except ApiError:
                        call.outcome = Outcome.BAD_REQUEST
                        raise
                    await self._watched(front.answer(call.route, data, call, self.key_tenant,
                                                     self.auth), receive, send)
                except ApiError as err:
                    if not self._started:
                        await self._reply(error_reply(err), send)
                except Exception:  # noqa: BLE001 -- a fault answers 500, its text in the log
                    log.exception("request %s failed", call.id)
                    call.outcome = Outcome.INTERNAL_ERROR
                    if not self._started:
                        await self._reply(error_reply(internal_error(call)), send)
        except ApiError as err:  # no slot free: a 429, counted as rejected
            await self._reply(error_reply(err), send)

    async def _watched(self, work: Any, receive: Any, send: Any) -> None:
        task = asyncio.ensure_future(self._send(work, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                task.cancel()
                self.call.outcome = Outcome.DISCONNECTED
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                await task
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()

    async def _reply(self, reply: Reply, send: Any) -> None:
        """A whole answer (the call finished before its last bytes: a client that has its
        answer sees it counted)."""
        self.call.status = reply.status
        await self._start(reply, send, len(reply.body))
        self.front.metrics.ttft.labels(self.call.route).observe(
            time.perf_counter() - self.call.t0)
        if self.admitted is not None:
            self.admitted.release()
        await send({"type": "http.response.body", "body": reply.body})

    async def _start(self, reply: Reply, send: Any, length: int | None) -> None:
        headers = [(k.encode("latin-1"), header_value(v, 500).encode("latin-1"))
                   for k, v in reply.headers.items()]
        headers.append((REQUEST_ID_HEADER.encode(), self.call.id.encode("latin-1")))
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        self._started = True
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})

    async def _send(self, work: Any, send: Any) -> None:
        deadline = asyncio.get_running_loop().time() + self.front.config.request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                reply: Reply = await work
        except TimeoutError:
            self.call.outcome = Outcome.UPSTREAM_ERROR
            reply = error_reply(self._too_long())
        except ApiError as err:
            if not self.call.outcome or self.call.outcome == Outcome.FORWARDED:
                self.call.outcome = (Outcome.UPSTREAM_ERROR if err.status >= 500
                                     else Outcome.BAD_REQUEST)
            reply = error_reply(err)
        except Exception:  # noqa: BLE001 -- a fault answers 500, its text only in the log
            log.exception("request %s failed", self.call.id)
            self.call.outcome = Outcome.INTERNAL_ERROR
            reply = error_reply(internal_error(self.call))
        if reply.stream is None:
            await self._reply(reply, send)
            return
        self.call.status = reply.status
        first = True
        try:  # from the start of the answer on: a client leaving at any await closes upstream
            await self._start(reply, send, None)
            sse_stream = reply.headers.get("content-type", "").startswith("text/event-stream")
            fault: ApiError | None = None
            try:
                async with asyncio.timeout_at(deadline):
                    async for chunk in reply.stream:
                        if chunk:
                            if first:
                                first = False
                                self.front.metrics.ttft.labels(self.call.route).observe(
                                    time.perf_counter() - self.call.t0)
                            await send({"type": "http.response.body", "body": chunk,
                                        "more_body": True})
            except TimeoutError:
                self.call.outcome = Outcome.UPSTREAM_ERROR
                fault = self._too_long()
            except Exception:  # noqa: BLE001 -- the stream ends with an error event, not a cut
                log.exception("request %s: its stream failed", self.call.id)
                self.call.outcome = Outcome.INTERNAL_ERROR
                fault = internal_error(self.call)
            if fault is not None and sse_stream:
                await send({"type": "http.response.body", "more_body": True,
                            "body": sse(error_body(fault.status, str(fault))) + DONE})
        finally:
            await reply.close()
        if self.admitted is not None:
            self.admitted.release()
        await send({"type": "http.response.body", "body": b""})


    def _too_long(self) -> ApiError:
        return ApiError(504, f"the answer took longer than {self.front.config.request_timeout:g} "
                        "s (FrontConfig.request_timeout)")


def internal_error(call: Call) -> ApiError:
    """The 500 of a fault in the front: what happened is in the log, under the request id."""
    return ApiError(500, f"the kvnotes front failed on this request; its log has the details "
                    f"under request id {call.id}")


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(front: Front) -> Any:
    """The FastAPI app of ``front`` (its routes, error shapes and lifespan)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException

    from kvnotes.serving.front.connections import HeadLimit

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

    app.add_middleware(HeadLimit, limit=front.config.max_header_bytes)

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
        call.client = front.client_of(auth, request.client.host if request.client else "")
        return _Answer(front, call, request, key_tenant, auth)

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
        return Response(data, status, media_type=ctype or JSON)

    @app.get(HEALTH)
    async def health() -> Response:
        status, data, ctype = await front.up.get(HEALTH, timeout=front.config.discover_timeout)
        return Response(data, status, media_type=ctype or "text/plain")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        front.authorize_metrics(request.headers.get("authorization"))
        return Response(front.metrics.exposition(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(STATS_PATH)
    async def stats(request: Request) -> Response:
        front.authenticate(request.headers.get("authorization"))
        return JSONResponse(front.metrics.stats())

    return app
