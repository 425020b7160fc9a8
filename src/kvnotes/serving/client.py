"""Talking to a loopback vLLM server: the ``openai`` client for requests, ``httpx2`` for the rest.

Requests go through ``openai.AsyncOpenAI`` (streaming chat completions, ``stream_options`` for
the usage chunk, ``extra_body`` for vLLM's ``cache_salt``; no retries, so every failure is
seen). Time to first token is measured on the client: from sending the request to the first
streamed chunk that carries generated text (or finishes the choice). vLLM's own endpoints that
are not part of the OpenAI API (``/health``, ``/metrics``, ``/tokenize``, ``/version``, the
``max_model_len`` of ``/v1/models``) are read with the ``httpx2`` client that ``openai`` brings.

Only servers on this machine are reached: every constructor checks the URL first.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvnotes.core.errors import ServingError

LOOPBACK_NAMES = ("localhost",)
# http_4xx/5xx: the server refused; timeout: no answer in time; connection: refused, dropped or
# cut short; stream: an error event or an unreadable chunk inside the stream
ERROR_KINDS = ("http_4xx", "http_5xx", "timeout", "connection", "stream")


def check_loopback_url(url: str) -> tuple[str, int, str]:
    """``(host, port, base_path)`` of an http URL on a loopback address; anything else raises.

    serve-bench only talks to servers on this machine (127.0.0.0/8, ::1, localhost).
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ServingError(f"server URL must look like http://127.0.0.1:PORT, got {url!r}")
    host = parts.hostname
    if host not in LOOPBACK_NAMES:
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ServingError(f"only loopback servers are allowed, got host {host!r}")
        except ValueError as err:
            raise ServingError(f"only loopback servers are allowed, got host {host!r}") from err
    try:
        port = parts.port or 80
    except ValueError as err:
        raise ServingError(f"bad port in server URL {url!r}") from err
    return host, port, parts.path.rstrip("/")


@dataclass
class StreamResult:
    """The outcome of one streamed chat request; ``error_kind`` is one of :data:`ERROR_KINDS`."""

    ok: bool
    ttft_s: float | None = None
    total_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_kind: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Client:
    """Blocking client for a loopback server's non-OpenAI endpoints (thread-safe)."""

    def __init__(self, url: str, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.host, self.port, self.base = check_loopback_url(self.url)  # before any client
        self.timeout = timeout
        self._http: Any = None  # one httpx2.Client, made on first use (it is thread-safe)

    def _session(self) -> Any:
        if self._http is None:
            import httpx2

            self._http = httpx2.Client(trust_env=False, timeout=self.timeout)
        return self._http

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def request(self, method: str, path: str, body: Any = None, *,
                timeout: float | None = None) -> tuple[int, bytes]:
        """``(status, body bytes)``; connection problems raise :class:`ServingError`."""
        import httpx2

        try:
            resp = self._session().request(method, self.url + path, json=body,
                                           timeout=timeout or self.timeout)
            return resp.status_code, resp.content
        except httpx2.HTTPError as err:
            raise ServingError(f"cannot reach the server at {self.url} ({method} {path}): "
                               f"{err!r}") from err

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        import json

        status, data = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ServingError(f"GET {self.url}{path} returned HTTP {status}: {data[:300]!r}")
        try:
            return json.loads(data)
        except ValueError as err:
            raise ServingError(f"GET {self.url}{path} did not return JSON: {data[:300]!r}") from err

    def healthy(self, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200."""
        try:
            return self.request("GET", "/health", timeout=timeout)[0] == 200
        except ServingError:
            return False

    def metrics_text(self) -> str:
        status, data = self.request("GET", "/metrics", timeout=30)
        if status != 200:
            raise ServingError(f"GET {self.url}/metrics returned HTTP {status}")
        return data.decode(errors="replace")

    def models(self) -> list[str]:
        """The model names the server serves (``/v1/models``)."""
        return [m["id"] for m in self.get_json("/v1/models", timeout=30).get("data", [])]

    def max_model_len(self, model: str) -> int | None:
        """The served model's context limit when the server reports it (vLLM does)."""
        for m in self.get_json("/v1/models", timeout=30).get("data", []):
            if m.get("id") == model and m.get("max_model_len"):
                return int(m["max_model_len"])
        return None

    def version(self) -> str | None:
        try:
            return self.get_json("/version", timeout=10).get("version")
        except ServingError:
            return None

    def count_tokens(self, model: str, text: str) -> int:
        """Tokens of ``text`` by the server's tokenizer (vLLM's ``POST /tokenize``)."""
        data = self.request("POST", "/tokenize",
                            {"model": model, "prompt": text, "add_special_tokens": False},
                            timeout=60)
        if data[0] != 200:
            raise ServingError(f"POST /tokenize returned HTTP {data[0]}: {data[1][:300]!r}")
        import json

        return int(json.loads(data[1])["count"])

    def async_openai(self, *, timeout: float | None = None) -> Any:
        """An ``openai.AsyncOpenAI`` for this server (no retries, no proxies from the
        environment); create it inside the event loop that uses it."""
        import openai

        t = timeout or self.timeout
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="kvnotes", timeout=t,
                                  max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(trust_env=False,
                                                                              timeout=t))


def _classify(err: BaseException) -> tuple[str, str]:
    """``(kind, message)`` of a failed request (kinds: :data:`ERROR_KINDS`)."""
    import httpx2
    import openai

    if isinstance(err, (openai.APITimeoutError, TimeoutError, httpx2.TimeoutException)):
        return "timeout", f"timed out ({type(err).__name__})"
    if isinstance(err, openai.APIStatusError):
        code = err.status_code
        kind = "http_5xx" if code >= 500 else "http_4xx"
        return kind, f"HTTP {code}: {str(err.message)[:300]}"
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        return "connection", f"connection failed: {type(cause).__name__}: {cause}"[:400]
    if isinstance(err, httpx2.TransportError):  # dropped while streaming
        return "connection", f"connection dropped: {type(err).__name__}: {err}"[:400]
    if isinstance(err, openai.APIError):  # an error event inside the stream
        return "stream", f"server error in stream: {str(err.message)[:300]}"
    return "stream", f"{type(err).__name__}: {err}"[:400]


async def stream_chat(client: Any, model: str, prompt: str, *, max_tokens: int = 8,
                      cache_salt: str | None = None, timeout: float | None = None
                      ) -> StreamResult:
    """Send one user message with greedy decoding through ``client`` (an ``AsyncOpenAI``) and
    stream the answer, timing it. Never raises for a server's failure: HTTP errors, refused or
    dropped connections, timeouts (``timeout`` bounds the whole request) and truncated streams
    come back as ``ok=False`` with ``error_kind`` and ``error``."""
    res = StreamResult(ok=False)
    pieces: list[str] = []
    finished = False
    t0 = time.perf_counter()

    async def consume() -> None:
        nonlocal finished
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": cache_salt} if cache_salt is not None else None)
        try:
            async for chunk in stream:
                for choice in chunk.choices or []:
                    content = choice.delta.content if choice.delta is not None else None
                    if res.ttft_s is None and (content or choice.finish_reason):
                        res.ttft_s = time.perf_counter() - t0
                    if content:
                        pieces.append(content)
                    if choice.finish_reason:
                        finished = True
                usage = chunk.usage
                if usage is not None:
                    res.prompt_tokens = usage.prompt_tokens
                    res.completion_tokens = usage.completion_tokens
                    details = getattr(usage, "prompt_tokens_details", None)
                    res.cached_tokens = getattr(details, "cached_tokens", None)
        finally:
            await stream.close()

    try:
        async with asyncio.timeout(timeout):
            await consume()
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 -- every server failure is reported, not raised
        res.error_kind, res.error = _classify(err)
        res.total_s = time.perf_counter() - t0
        res.text = "".join(pieces)
        return res
    res.total_s = time.perf_counter() - t0
    res.text = "".join(pieces)
    if not finished:
        res.error_kind, res.error = ("connection", "the server closed the stream before the "
                                     "answer finished")
    else:
        res.ok = True
    return res
