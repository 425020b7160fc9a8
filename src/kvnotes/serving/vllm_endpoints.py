"""Talking to the vLLM server behind kvnotes: its non-OpenAI endpoints, over loopback only.

vLLM's own endpoints that are not part of the OpenAI API (``/health``, ``/metrics``,
``/tokenize``, ``/version``, the ``max_model_len`` of ``/v1/models``) are read with the
``httpx2`` client that ``openai`` brings. Only servers on this machine are reached: every
constructor checks the URL first.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from kvnotes.core.errors import ServingError
from kvnotes.serving.json_types import JsonObject, JsonValue

LOOPBACK_NAMES = ("localhost",)
CACHE_CONFIG = "vllm:cache_config_info"


def info_labels(text: str, name: str = CACHE_CONFIG) -> dict[str, str]:
    """The labels of an info-style gauge in a ``/metrics`` text, read with ``prometheus_client``'s
    parser (vLLM's ``vllm:cache_config_info`` carries the cache configuration, ``block_size``
    among it); {} when absent or unparsable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name:
                    return dict(s.labels)
    except ValueError:
        return {}
    return {}


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

    def request(self, method: str, path: str, body: JsonValue = None, *,
                timeout: float | None = None) -> tuple[int, bytes]:
        """``(status, body bytes)`` (``body``: sent as JSON); connection problems raise
        :class:`ServingError`."""
        import httpx2

        try:
            resp = self._session().request(method, self.url + path, json=body,
                                           timeout=timeout or self.timeout)
            return resp.status_code, resp.content
        except httpx2.HTTPError as err:
            raise ServingError(f"cannot reach the server at {self.url} ({method} {path}): "
                               f"{err!r}") from err

    def get_json(self, path: str, *, timeout: float | None = None) -> JsonValue:
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

    def get_object(self, path: str, *, timeout: float | None = None) -> JsonObject:
        """:meth:`get_json` of an endpoint that answers a JSON object."""
        data = self.get_json(path, timeout=timeout)
        if not isinstance(data, dict):
            raise ServingError(f"GET {self.url}{path} did not return a JSON object: "
                               f"{type(data).__name__}")
        return data

    def _models(self) -> list[JsonObject]:
        listed = self.get_object("/v1/models", timeout=30).get("data", [])
        if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
            raise ServingError(f"GET {self.url}/v1/models did not list models")
        return [m for m in listed if isinstance(m, dict)]

    def models(self) -> list[str]:
        """The model names the server serves (``/v1/models``)."""
        return [str(m["id"]) for m in self._models()]

    def max_model_len(self, model: str) -> int | None:
        """The served model's context limit when the server reports it (vLLM does)."""
        for m in self._models():
            limit = m.get("max_model_len")
            if m.get("id") == model and limit and isinstance(limit, (int, float, str)):
                return int(limit)
        return None

    def version(self) -> str | None:
        try:
            version = self.get_object("/version", timeout=10).get("version")
        except ServingError:
            return None
        return None if version is None else str(version)

    def count_tokens(self, model: str, text: str) -> int:
        """Tokens of ``text`` by the server's tokenizer (vLLM's ``POST /tokenize``)."""
        data = self.request("POST", "/tokenize",
                            {"model": model, "prompt": text, "add_special_tokens": False},
                            timeout=60)
        if data[0] != 200:
            raise ServingError(f"POST /tokenize returned HTTP {data[0]}: {data[1][:300]!r}")
        import json

        return int(json.loads(data[1])["count"])
