"""Fake kvnotes hosts for ``serve-bench fleet``'s plumbing test: each an OpenAI-like front in a
thread of this process (no vLLM, no engine), sharing one "fleet" state.

A tool list seen ``after`` times through any host is "compiled" by that host (one entry file
per tool, named by the tool, in its skills folder, one compile each); a host's stats read
"mirrors" every other host's entry files into its own folder; a spliced request whose tools are
all in the host's folder reports ``spliced_tokens`` 60 of 100 prompt tokens. Answers are two
tokens with log-probs, whole or streamed (SSE with usage).
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any


@dataclass
class Fleet:
    after: int = 2
    sightings: dict[tuple[str, ...], int] = field(default_factory=dict)
    hosts: list[FakeHost] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _names(body: dict[str, Any]) -> tuple[str, ...]:
    return tuple(sorted(t["function"]["name"] for t in body.get("tools") or []))


class FakeHost:
    """A launched host's stand-in (what :func:`launcher.prepare` returns): ``with`` serves."""

    def __init__(self, config: Any, fleet: Fleet, skills: Any) -> None:
        self.config, self.fleet, self.skills = config, fleet, skills
        self.compiles = 0
        self.server = SimpleNamespace(served_name="fake", log_path=config.log_path,
                                      startup_s=0.0)
        self.httpd: http.server.ThreadingHTTPServer | None = None
        fleet.hosts.append(self)

    @property
    def folder(self) -> Path:
        return Path(self.config.skills)

    @property
    def url(self) -> str:
        assert self.httpd is not None
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def record(self) -> Any:
        return SimpleNamespace(to_dict=lambda: {"fake": True, "skills": str(self.folder)})

    def has(self, name: str) -> bool:
        return any(self.folder.rglob(f"{name}.safetensors"))

    def mirror(self) -> None:
        for other in self.fleet.hosts:
            if other is not self and other.config.front.store is not None:
                for path in other.folder.rglob("*.safetensors"):
                    if not self.has(path.stem) and self.config.front.store is not None:
                        shutil.copy(path, self.folder / path.name)

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        names = _names(body)
        splice = ((body.get("kvnotes") or {}).get("splice", True))
        hit = splice and bool(names) and all(self.has(n) for n in names)
        if splice:
            with self.fleet.lock:
                seen = self.fleet.sightings[names] = self.fleet.sightings.get(names, 0) + 1
                if seen == self.fleet.after:
                    for n in names:
                        if not self.has(n):
                            (self.folder / f"{n}.safetensors").write_bytes(b"entry")
                            self.compiles += 1
        return {"prompt_tokens": 100, "kvnotes": {"spliced_tokens": 60 if hit else 0}}

    def __enter__(self) -> FakeHost:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.httpd is not None
        self.httpd.shutdown()
        self.httpd.server_close()


_LOGPROBS = {"content": [{"token": t, "logprob": -0.1, "top_logprobs": [
    {"token": t, "logprob": -0.1}, {"token": "z", "logprob": -2.0}]} for t in ("a", "b")]}


def _handler(host: FakeHost) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
            if self.path == "/kvnotes/stats":
                host.mirror()
                self._send(json.dumps({"learner": {"compiles": host.compiles,
                                                   "failures": 0}}).encode())
            elif self.path == "/metrics":
                text = (f"# TYPE kvnotes_front_fleet_published counter\n"
                        f"kvnotes_front_fleet_published_total {host.compiles}\n")
                self._send(text.encode(), "text/plain; version=0.0.4")
            else:
                self.send_error(404)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            usage = host.chat(body)
            message = {"role": "assistant", "content": "ab"}
            if not body.get("stream"):
                self._send(json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "message": message, "finish_reason": "length",
                                 "logprobs": _LOGPROBS}],
                    "usage": {**usage, "completion_tokens": 2, "total_tokens": 102}}).encode())
                return
            chunks = [{"choices": [{"index": 0, "delta": {"content": "ab"},
                                    "logprobs": _LOGPROBS, "finish_reason": None}]},
                      {"choices": [], "usage": {**usage, "completion_tokens": 2,
                                                "total_tokens": 102}}]
            head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}
            text = "".join("data: " + json.dumps({**head, **c}) + "\n\n"
                           for c in chunks) + "data: [DONE]\n\n"
            self._send(text.encode(), "text/event-stream")

    return Handler
