"""An OpenAI-compatible front for a kvnotes server: any client gets spliced, repaired skills.

``kvnotes serve`` runs a stock vLLM (with kvnotes' connector) on a loopback port and this front
on the port users are given. The front answers the OpenAI endpoints:

- ``POST /v1/completions`` (a text prompt, or token ids) and ``POST /v1/chat/completions``
  (messages rendered with the model's chat template), streamed or not: registered skills found
  in the prompt's text are spliced (:mod:`~kvnotes.serving.planning.match`), the prompt is sent
  part by part as ``engine.compose`` lays it out, each spliced skill's first tokens are
  recomputed in context through phases (:mod:`~kvnotes.serving.planning.phases`), and the answer comes
  back in the client's format with ``usage.kvnotes`` (:mod:`~kvnotes.serving.front.format`);
- ``GET /v1/models``, ``/health`` and every other path: passed to vLLM as they are;
- ``GET /kvnotes/stats``: the front's counters.

Per request, ``extra_body={"kvnotes": {...}}`` (:class:`~kvnotes.serving.planning.request.FrontOptions`):
``splice`` (false: forwarded exactly), ``tenant``, ``repair`` (first tokens), ``guard`` (tau).
A request the front cannot plan (no skill found, a field it does not model, a template that
fails) is forwarded to vLLM exactly as it came, never refused; the reason is in the
``x-kvnotes`` response header. vLLM's errors come back with their status and body.

The guard: the spliced request asks the first answer token's top-2 log-probs; when their margin
is under tau, the answer is the exact request's (the same ids, no salt). A stream holds its
first token back until the guard has decided.

Example:
    >>> front = Front(FrontConfig(upstream="http://127.0.0.1:8001", port=8000),  # doctest: +SKIP
    ...               SkillCatalog(skills.folder, engine.tokenizer))
    >>> with front:                                                             # doctest: +SKIP
    ...     openai.OpenAI(base_url=front.url + "/v1", api_key="-").completions.create(...)
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import Counter
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, KvnotesError, ServingError
from kvnotes.core.repair import DEFAULT_FIRST, Repair, as_repair
from kvnotes.serving.front.format import DONE, Shaper, first_top_logprobs, parse_sse_line, sse
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.planning.front_plan import FrontPlan, exact_body, phase_bodies, plan_request, real_body
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.phases import check_tau, guard_fires
from kvnotes.serving.planning.request import (
    ENDPOINTS,
    OPTIONS_KEY,
    FrontRequest,
    Unplannable,
    read_request,
)
from kvnotes.serving.upstream import check_loopback_url

STATS_PATH = "/kvnotes/stats"
REASON_HEADER = "x-kvnotes"
_BLOCK_SIZE = re.compile(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"')
# hop-by-hop headers (RFC 9110 7.6.1) and those the front sets itself
_DROP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                 "proxy-authenticate", "proxy-authorization", "content-length", "host",
                 "content-encoding", "accept-encoding"}


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """How the front runs.

    Args:
        upstream: the vLLM server's URL (loopback only; None in a ``LaunchConfig``, whose
            launcher fills in the server it starts).
        port: the front's port (None: a free one).
        host: the address it listens on.
        repair: the first tokens of each spliced skill recomputed (a request's
            ``kvnotes.repair`` overrides it; 0: a bare splice).
        guard: tau, the first token's top-2 log-prob margin under which the exact answer is
            sent instead (a request's ``kvnotes.guard`` overrides it; 0: never).
        tenant: the tenant of requests that name none (None: the shared splice salt).
        block_size: the server's KV block size (None: read from its ``/metrics``).
        timeout: seconds one upstream request may take.
    """

    upstream: str | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    repair: int = DEFAULT_FIRST
    guard: float = 0.0
    tenant: str | None = None
    block_size: int | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.upstream is not None:
            check_loopback_url(self.upstream)
        Repair(first=self.repair)  # checks the count
        check_tau(self.guard)
        splice_salt(self.tenant)  # checks the spelling
        if self.block_size is not None and (isinstance(self.block_size, bool)
                                            or self.block_size < 1):
            raise InvalidArgumentError(f"block_size {self.block_size!r}: give the server's KV "
                                       "block size in tokens, or None to read it")


@dataclass
class Reply:
    """An answer to write: a whole body, or a stream of byte chunks."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: Iterable[bytes] | None = None


def _json_reply(status: int, obj: Any, **headers: str) -> Reply:
    return Reply(status, {"content-type": "application/json", **headers},
                 json.dumps(obj).encode())


class Front:
    """The HTTP front (see the module docstring); ``with front:`` serves in a thread."""

    def __init__(self, config: FrontConfig, catalog: SkillCatalog) -> None:
        import httpx2

        if config.upstream is None:
            raise InvalidArgumentError("FrontConfig.upstream is None: give the vLLM server's URL")
        self.config, self.catalog = config, catalog
        self.upstream = config.upstream.rstrip("/")
        self._http = httpx2.Client(trust_env=False, timeout=config.timeout)
        self._plan_lock = threading.Lock()  # the tokenizer is not used from two threads at once
        self._stats_lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._block_size = config.block_size
        self._model: str | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- running ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is None:
            raise ServingError("the front is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> Front:
        """Listen and serve in a background thread (returns at once)."""
        if self._server is not None:
            raise ServingError("this front is already started")
        front = self

        class Handler(_Handler):
            owner = front

        try:
            self._server = _FrontServer((self.config.host, self.config.port or 0), Handler)
        except OSError as err:
            raise ServingError(f"the front cannot listen on {self.config.host}:"
                               f"{self.config.port}: {err} (choose another --port)") from err
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvnotes-front",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening, and close the upstream connections."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._http.close()

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    # ---- upstream --------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        resp = self._http.post(self.upstream + path, json=body)
        return resp.status_code, resp.content

    def block_size(self) -> int:
        """The server's KV block size (``vllm:cache_config_info`` in its ``/metrics``)."""
        if self._block_size is None:
            resp = self._http.get(self.upstream + "/metrics")
            m = _BLOCK_SIZE.search(resp.text) if resp.status_code == 200 else None
            if m is None:
                raise Unplannable("the server's block size is unknown (no "
                                  "vllm:cache_config_info in /metrics): set FrontConfig.block_size")
            self._block_size = int(m.group(1))
        return self._block_size

    def model_name(self) -> str:
        if self._model is None:
            resp = self._http.get(self.upstream + "/v1/models")
            data = resp.json().get("data") if resp.status_code == 200 else None
            if not data:
                raise Unplannable("the server lists no model")
            self._model = str(data[0]["id"])
        return self._model

    def forward(self, method: str, path: str, body: bytes, headers: dict[str, str],
                reason: str | None = None) -> Reply:
        """The request passed to vLLM as it is; its answer streamed back as it comes."""
        import httpx2

        request = self._http.build_request(method, self.upstream + path, content=body or None,
                                           headers=headers)
        try:
            resp = self._http.send(request, stream=True)
        except httpx2.HTTPError as err:
            return self._unreachable(err)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}
        if reason is not None:
            out[REASON_HEADER] = f"forwarded: {reason}"[:500]

        def chunks() -> Iterator[bytes]:
            try:
                yield from resp.iter_bytes()  # decoded: content-encoding is not passed on
            finally:
                resp.close()

        return Reply(resp.status_code, out, stream=chunks())

    def _unreachable(self, err: BaseException) -> Reply:
        self._count("upstream_unreachable")
        return _json_reply(502, {"error": {"message": f"the vLLM server at {self.upstream} is "
                                           f"not reachable: {err!r}", "type": "BadGateway",
                                           "code": 502}})

    # ---- requests --------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Reply:
        """The answer to one HTTP request."""
        route = path.split("?", 1)[0]
        if method == "GET" and route == STATS_PATH:
            with self._stats_lock:
                return _json_reply(200, {"stats": dict(self.stats),
                                         "fallbacks": dict(self.fallbacks)})
        kind = ENDPOINTS.get(route)
        if method != "POST" or kind is None:
            return self.forward(method, path, body, headers)
        self._count("requests")
        try:
            data = json.loads(body)
        except ValueError:
            return self._fallback(method, path, body, headers, "the body is not JSON")
        if isinstance(data, dict) and OPTIONS_KEY in data:
            # the kvnotes options are the front's: vLLM gets the request without them
            rest = {k: v for k, v in data.items() if k != OPTIONS_KEY}
            exact = json.dumps(rest).encode()
        else:
            exact = body
        try:
            with self._plan_lock:
                req = read_request(kind, data, self.catalog.tokenizer)
                opts = req.options
                repair = as_repair(self.config.repair if opts.repair is None else opts.repair)
                fp = plan_request(req, self.catalog, repair, self.block_size(),
                                  opts.tenant if opts.tenant is not None else self.config.tenant)
            tau = self.config.guard if opts.guard is None else opts.guard
            model = str(req.sampling.get("model") or self.model_name())
        except Unplannable as err:
            return self._fallback(method, path, exact, headers, str(err))
        except (KvnotesError, ValueError) as err:
            return self._fallback(method, path, exact, headers, f"not planned: {err}")
        except Exception as err:  # noqa: BLE001 -- httpx2 errors reading /metrics or /v1/models
            return self._fallback(method, path, exact, headers, f"{type(err).__name__}: {err}")
        return self._spliced(req, fp, model, tau, (method, path, exact, headers))

    def _fallback(self, method: str, path: str, body: bytes, headers: dict[str, str],
                  reason: str) -> Reply:
        self._count("forwarded")
        with self._stats_lock:
            self.fallbacks[reason.split(":")[0][:80]] += 1
        return self.forward(method, path, body, headers, reason)

    def _spliced(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float,
                 original: tuple[str, str, bytes, dict[str, str]]) -> Reply:
        import httpx2

        info: dict[str, Any] = {"spliced_tokens": fp.plan.spliced_tokens, "phases": 0,
                                "guard_fired": False, "plan": fp.to_dict()}
        try:
            for body in phase_bodies(fp, model):
                status, data = self._post("/v1/completions", body)
                if status != 200:
                    return self._fallback(*original, f"a phase failed: HTTP {status}: "
                                          f"{data[:200].decode(errors='replace')}")
                info["phases"] += 1
        except httpx2.HTTPError as err:
            return self._unreachable(err)
        self._count("spliced")
        self._count("phases", info["phases"])
        shaper = Shaper(req.kind, req.logprobs, req.include_usage)
        headers = {REASON_HEADER: f"spliced {','.join(fp.skills)}"[:500]}
        if req.stream:
            return self._stream(req, fp, model, tau, info, shaper, headers)
        try:
            status, data = self._post("/v1/completions", real_body(fp, req, model, tau))
            if status != 200:
                return Reply(status, {"content-type": "application/json"}, data)
            answer = json.loads(data)
            if guard_fires(first_top_logprobs(answer), tau):
                info["guard_fired"] = True
                self._count("guard_fired")
                status, data = self._post("/v1/completions", exact_body(fp.ids, req, model))
                if status != 200:
                    return Reply(status, {"content-type": "application/json"}, data)
                answer = json.loads(data)
        except httpx2.HTTPError as err:
            return self._unreachable(err)
        return _json_reply(200, shaper.body(answer, info), **headers)

    def _open_stream(self, body: dict[str, Any]) -> Any:
        request = self._http.build_request("POST", self.upstream + "/v1/completions", json=body)
        return self._http.send(request, stream=True)

    def _begin_stream(self, body: dict[str, Any]) -> Any:
        """The upstream's streaming response to ``body``, or the :class:`Reply` that ends the
        request: 502 when vLLM is unreachable, vLLM's own error passed through."""
        import httpx2

        try:
            resp = self._open_stream(body)
        except httpx2.HTTPError as err:
            return self._unreachable(err)
        if resp.status_code != 200:
            data = resp.read()
            resp.close()
            return Reply(resp.status_code, {"content-type": "application/json"}, data)
        return resp

    def _stream(self, req: FrontRequest, fp: FrontPlan, model: str, tau: float,
                info: dict[str, Any], shaper: Shaper, headers: dict[str, str]) -> Reply:
        resp = self._begin_stream(real_body(fp, req, model, tau))
        if isinstance(resp, Reply):
            return resp
        events = _events(resp)
        held: list[Any] = []
        if tau > 0:
            # hold the stream until the first token's log-probs have come
            for event in events:
                held.append(event)
                if not isinstance(event, dict) or first_top_logprobs(event) is not None \
                        or any(c.get("finish_reason") for c in event.get("choices") or []):
                    break  # [DONE], an error, the first token's log-probs, or the end
            top = next((t for t in map(first_top_logprobs, held) if t is not None), None)
            if guard_fires(top, tau):
                events.close()
                info["guard_fired"] = True
                self._count("guard_fired")
                resp = self._begin_stream(exact_body(fp.ids, req, model))
                if isinstance(resp, Reply):
                    return resp
                events, held = _events(resp), []

        def chunks() -> Iterator[bytes]:
            try:
                for event in _chain(held, events):
                    if event is DONE:
                        yield DONE
                        return
                    if not isinstance(event, dict) or "error" in event:
                        yield sse(event)
                        continue
                    for out in shaper.chunk(event, info):
                        yield sse(out)
            finally:
                events.close()

        return Reply(200, {"content-type": "text/event-stream", "cache-control": "no-cache",
                           **headers}, stream=chunks())


def _events(resp: Any) -> Generator[Any, None, None]:
    """The JSON events of an upstream SSE response (closing it when done or closed)."""
    try:
        for line in resp.iter_lines():
            event = parse_sse_line(line)
            if event is not None:
                yield event
    finally:
        resp.close()


def _chain(held: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from held
    yield from rest


class _FrontServer(ThreadingHTTPServer):
    """The front's listener: a client resetting or closing its keep-alive connection (the
    openai SDK drops idle pooled connections) is how HTTP ends, not an error to print."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """One connection: reads the request, asks the front, writes its :class:`Reply`."""

    owner: Front
    protocol_version = "HTTP/1.1"  # keep-alive; streams are sent chunked

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the stdlib's name
        return  # quiet: the front's counters and vLLM's log say what happened

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""

    def _serve(self) -> None:
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROP_HEADERS}
        try:
            reply = self.owner.handle(self.command, self.path, body, headers)
        except Exception as err:  # noqa: BLE001 -- a bug must not kill the connection silently
            reply = _json_reply(500, {"error": {"message": f"kvnotes front: {type(err).__name__}:"
                                                f" {err}", "type": "InternalServerError",
                                                "code": 500}})
        self.send_response(reply.status)
        for k, v in reply.headers.items():
            self.send_header(k, v)
        if reply.stream is None:
            self.send_header("content-length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        stream = iter(reply.stream)
        try:
            for chunk in stream:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left: the upstream stream is closed below
        except Exception:  # noqa: BLE001 -- vLLM dropped the stream: the client sees it cut short
            self.close_connection = True
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve  # noqa: N815 -- the stdlib's names
