"""A small OpenAI-compatible HTTP client (standard library only) for loopback vLLM servers.

Time to first token is measured on the client: the request is sent with ``stream: true`` and
TTFT is the time from sending it to the first streamed chunk that carries generated text (or
finishes the choice).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvnotes.core.errors import ServingError

LOOPBACK_NAMES = ("localhost",)


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
    """The outcome of one streamed chat request."""

    ok: bool
    ttft_s: float | None = None
    total_s: float | None = None
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Client:
    """Blocking client for one OpenAI-compatible server (one connection per request: thread-safe).
    """

    def __init__(self, url: str, *, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.host, self.port, self.base = check_loopback_url(self.url)
        self.timeout = timeout

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port,
                                          timeout=self.timeout if timeout is None else timeout)

    def request(self, method: str, path: str, body: Any = None, *,
                timeout: float | None = None) -> tuple[int, bytes]:
        """``(status, body bytes)``; connection problems raise :class:`ServingError`."""
        conn = self._conn(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, self.base + path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as err:
            raise ServingError(f"cannot reach the server at {self.url} ({method} {path}): "
                               f"{err!r}") from err
        finally:
            conn.close()

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        status, data = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ServingError(f"GET {self.url}{path} returned HTTP {status}: {data[:300]!r}")
        return json.loads(data)

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
        return data.decode()

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
        except (ServingError, ValueError):
            return None

    def count_tokens(self, model: str, text: str) -> int:
        """Tokens of ``text`` by the server's tokenizer (vLLM's ``POST /tokenize``)."""
        status, data = self.request("POST", "/tokenize",
                                    {"model": model, "prompt": text, "add_special_tokens": False},
                                    timeout=60)
        if status != 200:
            raise ServingError(f"POST /tokenize returned HTTP {status}: {data[:300]!r}")
        return int(json.loads(data)["count"])

    def stream_chat(self, model: str, prompt: str, *, max_tokens: int = 8,
                    cache_salt: str | None = None, timeout: float | None = None) -> StreamResult:
        """Send one user message with greedy decoding and stream the answer, timing it."""
        body: dict[str, Any] = {
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        conn = self._conn(timeout)
        t0 = time.perf_counter()
        res = StreamResult(ok=False)
        try:
            conn.request("POST", self.base + "/v1/chat/completions", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json",
                                  "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}"
                return res
            pieces: list[str] = []
            done = False
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = f"server error in stream: {chunk['error']}"
                    return res
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if res.ttft_s is None and (content or choice.get("finish_reason")):
                        res.ttft_s = time.perf_counter() - t0
                    if content:
                        pieces.append(content)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
            res.total_s = time.perf_counter() - t0
            res.text = "".join(pieces)
            if not done:
                res.error = "stream ended without [DONE]"
            elif res.ttft_s is None:
                res.error = "stream carried no generated chunk"
            else:
                res.ok = True
            return res
        except (OSError, http.client.HTTPException, ValueError) as err:  # incl. timeouts
            res.error = f"{type(err).__name__}: {err}"
            return res
        finally:
            conn.close()
