"""A loopback stand-in for vLLM's OpenAI server, for the front's tests.

:class:`FakeVLLM` records every request (method, path, body, headers) and answers like vLLM's
completions endpoint (streamed too): "spliced answer" for a request carrying a splice salt,
"exact answer" for one without; the first token's top-2 log-prob margin is set per kind, so the
guard can be made to fire. ``fault`` makes the completions endpoint fail on demand: ``hang``
(no answer), ``cut`` (a stream closed after its first event), ``bad_json`` (an event that is not
JSON), ``slow`` (events 0.2 s apart), ``wrong_shape`` (an answer, or a streamed event, that is
JSON but not what vLLM sends), ``trickle`` (one byte every 0.2 s, never ending);
``hang_metrics`` makes ``/metrics`` hang; ``words`` sets the answer's streamed pieces.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BLOCK = 16
MODEL = "tiny"
HEADER = "You are the support agent of Fjord Air. Answer in one short sentence.\n"
REFUNDS = ("\nREFUNDS: a ticket is refunded in full when it is cancelled within 24 hours of "
           "booking; after that, only taxes are refunded, and a voucher covers the fare. Ask "
           "for the booking code first, and never promise a refund the policy does not give.")
BAGGAGE = ("\nBAGGAGE: one cabin bag of 8 kg is free; a checked bag costs 30 euros, and a "
           "torn bag is repaired or paid for when it is reported within 7 days of the flight, "
           "with the tag number and a photo of the damage.")
USER = "\n\nCustomer: my bag arrived torn.\nAgent:"



class FakeVLLM:
    """A loopback stand-in for vLLM's OpenAI server (records bodies; answers completions)."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, body)
        self.headers: list[dict[str, str]] = []  # each request's headers, in order
        self.margin = {"spliced": 3.0, "exact": 3.0}
        self.words: list[str] | None = None  # the answer's pieces (None: "<kind> answer")
        self.fail: tuple[int, dict[str, Any]] | None = None
        self.fault: str | None = None
        self.hang_metrics = False
        # the connector's report a spliced completion returns in its kv_transfer_params (a
        # function of the request body; None: vLLM returns none, as without a report)
        self.report: Any = None
        self.closed_streams = 0  # streams whose client went away before their end
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def do_GET(self) -> None:  # noqa: N802
                fake.requests.append(("GET", self.path, None))
                fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path == "/metrics" and fake.hang_metrics:
                    time.sleep(30)
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL}]})
                elif self.path == "/metrics":
                    self._send(200, f'vllm:cache_config_info{{block_size="{BLOCK}"}} 1.0\n'
                               .encode(), "text/plain")
                elif self.path == "/health":
                    self._send(200, b"", "text/plain")
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers["content-length"]))
                body = json.loads(raw)
                fake.requests.append(("POST", self.path, body))
                fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                if fake.fault == "hang":
                    time.sleep(30)
                    return
                if fake.fail is not None:
                    self._json(*fake.fail)
                elif self.path == "/v1/chat/completions":
                    self._json(200, {"object": "chat.completion", "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "vllm chat"},
                         "finish_reason": "stop"}]})
                else:
                    fake.complete(self, body)

            def _json(self, status: int, obj: Any) -> None:
                self._send(status, json.dumps(obj).encode(), "application/json")

            def _send(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # a burst of streams is queued, not reset

        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def complete(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        kind = "spliced" if body.get("cache_salt") else "exact"
        words = ["one"] if body.get("max_tokens") == 1 else (self.words or [kind, " answer"])
        k = body.get("logprobs")
        choices = []
        for i, w in enumerate(words):
            lp = None
            if k is not None:
                top = {w: -0.1, "other": -0.1 - self.margin[kind], "third": -9.0}
                lp = {"tokens": [w], "token_logprobs": [-0.1], "text_offset": [0],
                      "top_logprobs": [dict(list(top.items())[:max(k, 1)])]}
            choices.append({"index": 0, "text": w, "logprobs": lp, "stop_reason": None,
                            "finish_reason": "length" if i == len(words) - 1 else None})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(words),
                 "total_tokens": len(body["prompt"]) + len(words),
                 "prompt_tokens_details": {"cached_tokens": 7}}
        head = {"id": "cmpl-abc", "created": 1, "model": body["model"]}
        if self.fault == "trickle":
            self._trickle(handler, bool(body.get("stream")))
            return
        if self.fault == "wrong_shape" and not body.get("stream"):
            handler._json(200, {**head, "choices": [{"index": 0, "text": 5}]})  # type: ignore[attr-defined]
            return
        if not body.get("stream"):
            text = "".join(c["text"] for c in choices)
            lp = None
            if k is not None:
                lp = {key: [v for c in choices for v in c["logprobs"][key]]
                      for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
            finish, stop = "length", _stop_at(text, body.get("stop"))
            if stop is not None:  # as vLLM: cut before it, and its frontend drops the report
                text, finish = text[:text.index(stop)], "stop"
            data = {**head, "object": "text_completion", "usage": usage, "choices": [
                {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
                 "stop_reason": stop}]}
            if self.report is not None and body.get("kv_transfer_params") and stop is None:
                data["kv_transfer_params"] = self.report(body)
            handler._json(200, data)  # type: ignore[attr-defined]
            return
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.end_headers()
        if self.fault == "bad_json":
            handler.wfile.write(b"data: {\"choices\": [\n\n")
            return
        if self.fault == "wrong_shape":
            handler.wfile.write(b'data: {"choices": [{"index": 0, "text": null}]}\n\n'
                                b"data: [DONE]\n\n")
            return
        if self.fault == "slow":
            choices = choices * 10
        try:
            for c in choices:
                chunk = {**head, "object": "text_completion", "choices": [c], "usage": None}
                handler.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                handler.wfile.flush()
                if self.fault == "cut":
                    handler.close_connection = True
                    return
                if self.fault == "slow":
                    time.sleep(0.2)
        except OSError:
            self.closed_streams += 1
            return
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {**head, "object": "text_completion", "choices": [], "usage": usage}
            handler.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        handler.wfile.write(b"data: [DONE]\n\n")

    def _trickle(self, handler: BaseHTTPRequestHandler, stream: bool) -> None:
        """One byte every 0.2 s of an answer that never ends (until the client leaves)."""
        if not stream:
            handler.send_response(200)
            handler.send_header("content-type", "application/json")
            handler.send_header("content-length", "100000")
            handler.end_headers()
        else:
            handler.send_response(200)
            handler.send_header("content-type", "text/event-stream")
            handler.end_headers()
        try:
            for _ in range(600):
                handler.wfile.write(b" " if not stream else b":")
                handler.wfile.flush()
                time.sleep(0.2)
        except OSError:
            self.closed_streams += 1

    def posted(self, path: str = "/v1/completions") -> list[dict[str, Any]]:
        return [b for m, p, b in self.requests if m == "POST" and p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stop_at(text: str, stops: Any) -> str | None:
    """The stop string (of ``stops``, a string or a list) that vLLM would end ``text`` on."""
    found = [s for s in ([stops] if isinstance(stops, str) else stops or []) if s in text]
    return min(found, key=text.index) if found else None
