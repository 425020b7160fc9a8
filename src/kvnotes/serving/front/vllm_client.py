"""The front's pooled async client to vLLM: fixed routes, timeouts, the key vLLM expects.

Every URL is ``upstream + route`` with ``route`` one of this module's constants, never a
client's request target. Connection failures become an :class:`~.errors.ApiError` (502 when
vLLM refuses or drops the connection, 504 past a timeout). The block size and the model name
are read once, by one task all waiting requests share, each wait bounded by
``discover_timeout``: a hung ``/metrics`` read delays only the requests that need it, by at
most that, and never serializes the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.json_types import RequestBody, UpstreamBody
from kvnotes.serving.planning.request import Unplannable
from kvnotes.serving.vllm_endpoints import CACHE_CONFIG, info_labels

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
HEALTH = "/health"
METRICS = "/metrics"
ROUTES = {"completion": COMPLETIONS, "chat": CHAT}
# httpcore scans every pooled connection of a client for each request it sends (a readability
# poll per connection): with 64 streams in flight that scan costs more than the rest of the
# front. Requests are spread over several smaller pools instead.
POOL_SHARDS = 8
# An idle pooled connection to vLLM is dropped well before vLLM's own keep-alive closes it
# (uvicorn's 5 s there by default, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): reusing a connection the server
# is closing at that moment fails the request with no response at all.
UPSTREAM_KEEPALIVE_S = 2.0
log = logging.getLogger("kvnotes.serving.front")


def upstream_error(err: BaseException, upstream: str) -> ApiError:
    """The answer to a failed upstream call: 504 past a timeout, else 502."""
    import httpx2

    if isinstance(err, httpx2.TimeoutException):
        return ApiError(504, f"the vLLM server at {upstream} did not answer in time "
                        f"({type(err).__name__})")
    # the transport's own text stays in the log: an answer names the kind of failure only
    log.warning("the vLLM server at %s: %s: %s", upstream, type(err).__name__, err)
    return ApiError(502, f"the vLLM server at {upstream} is not reachable "
                    f"({type(err).__name__})")


class Upstream:
    """One front's connection pool to vLLM (open and close it inside the serving loop)."""

    def __init__(self, config: FrontConfig) -> None:
        if config.upstream is None:
            raise ValueError("FrontConfig.upstream is None")
        self.config = config
        self.url = config.upstream.rstrip("/")
        self._clients: list[Any] = []
        self._next = 0
        self._block_size = config.block_size
        self._model = config.model
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    async def open(self) -> None:
        import httpx2

        c = self.config
        shards = min(POOL_SHARDS, c.upstream_connections)
        each = -(-c.upstream_connections // shards)
        self._clients = [httpx2.AsyncClient(
            trust_env=False, verify=False,  # plain http to loopback: no CA bundle to load
            timeout=httpx2.Timeout(c.timeout, connect=c.connect_timeout, pool=c.timeout),
            limits=httpx2.Limits(max_connections=each, max_keepalive_connections=each,
                                 keepalive_expiry=UPSTREAM_KEEPALIVE_S))
            for _ in range(shards)]

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for client in self._clients:
            await client.aclose()
        self._clients = []

    @property
    def _http(self) -> Any:
        """The next pool (round robin)."""
        self._next = (self._next + 1) % len(self._clients)
        return self._clients[self._next]

    def headers(self, client_auth: str | None = None) -> dict[str, str]:
        """The headers of a request to vLLM: the upstream key when there is one."""
        if self.config.upstream_api_key is not None:
            return {"authorization": f"Bearer {self.config.upstream_api_key}"}
        if client_auth is not None:
            return {"authorization": client_auth}
        return {}

    # ---- calls ---------------------------------------------------------------------------------
    async def post_json(self, route: str, body: UpstreamBody) -> tuple[int, bytes]:
        """``(status, body)`` of a POST to ``route`` (errors: :func:`upstream_error`)."""
        import httpx2

        try:
            resp = await self._http.post(self.url + route, json=body, headers=self.headers())
        except httpx2.HTTPError as err:
            raise upstream_error(err, self.url) from err
        return resp.status_code, resp.content

    async def open_stream(self, method: str, route: str,
                          body: RequestBody | UpstreamBody | None = None,
                          headers: dict[str, str] | None = None) -> Any:
        """The response to a request, its body not yet read (``aclose()`` it)."""
        import httpx2

        client = self._http
        request = client.build_request(method, self.url + route, json=body,
                                       headers=headers if headers is not None
                                       else self.headers())
        try:
            return await client.send(request, stream=True)
        except httpx2.HTTPError as err:
            raise upstream_error(err, self.url) from err

    async def get(self, route: str, *, timeout: float | None = None,
                  headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
        """``(status, body, content type)`` of a GET of ``route``."""
        import httpx2

        try:
            resp = await self._http.get(self.url + route, timeout=timeout,
                                        headers=headers if headers is not None
                                        else self.headers())
        except httpx2.HTTPError as err:
            raise upstream_error(err, self.url) from err
        return resp.status_code, resp.content, resp.headers.get("content-type", "")

    # ---- discovered once -----------------------------------------------------------------------
    async def block_size(self) -> int:
        """The server's KV block size (``vllm:cache_config_info`` in its ``/metrics``)."""
        if self._block_size is None:
            self._block_size = await self._once("block_size", self._read_block_size)
        return self._block_size

    async def model(self) -> str:
        """The first model the server lists."""
        if self._model is None:
            self._model = await self._once("model", self._read_model)
        return self._model

    async def discover(self) -> None:
        """Read the block size and model name now (at start; failures are retried later)."""
        for read in (self.block_size, self.model):
            try:
                await read()
            except Unplannable:
                pass

    async def _once(self, name: str, read: Callable[[], Awaitable[Any]]) -> Any:
        task = self._tasks.get(name)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._tasks[name] = asyncio.ensure_future(read())
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.config.discover_timeout)
        except (TimeoutError, ApiError, ValueError, KeyError, TypeError) as err:
            code = "block_size_unknown" if name == "block_size" else "model_unknown"
            raise Unplannable(f"the server's {name} is unknown ({type(err).__name__}: "
                              f"{err}); set FrontConfig.{name}", code) from err

    async def _read_block_size(self) -> int:
        status, data, _ = await self.get(METRICS, timeout=self.config.discover_timeout)
        labels = info_labels(data.decode(errors="replace")) if status == 200 else {}
        if not labels.get("block_size", "").isdigit():
            raise ValueError(f"no block_size in {CACHE_CONFIG} of /metrics (HTTP {status})")
        return int(labels["block_size"])

    async def _read_model(self) -> str:
        status, data, _ = await self.get(MODELS, timeout=self.config.discover_timeout)
        models = json.loads(data).get("data") if status == 200 else None
        if not models:
            raise ValueError(f"the server lists no model (HTTP {status})")
        return str(models[0]["id"])
