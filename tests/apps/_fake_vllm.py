"""A stand-in for a vLLM OpenAI-compatible server, for the serving unit tests.

It serves /health, /v1/models, /version, /tokenize (one token per word or punctuation mark),
/metrics (the two prefix-cache counters) and streamed /v1/chat/completions. Its "prefix cache"
counts, per request, the longest prefix (in tokens) shared with an earlier prompt of the same
cache salt; prefill time is proportional to the uncached tokens. Run as a module
(``python -m _fake_vllm --port P --served-model-name M``) it behaves like a launched server.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


class FakeState:
    def __init__(self, model: str, seconds_per_token: float = 2e-5) -> None:
        self.model = model
        self.spt = seconds_per_token
        self.lock = threading.Lock()
        self.prompts: dict[str | None, list[list[str]]] = {}
        self.queries = 0
        self.hits = 0
        self.max_model_len: int | None = None

    def prefill(self, prompt: str, salt: str | None) -> tuple[int, int]:
        toks = tokens(prompt)
        with self.lock:
            best = 0
            for old in self.prompts.get(salt, []):
                n = 0
                for a, b in zip(old, toks, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self.prompts.setdefault(salt, []).append(toks)
            self.queries += len(toks)
            self.hits += best
        return len(toks), best


def _status(prompt: str) -> str:
    """The asked-about order's status, as a perfect reader of the prompt sees it."""
    m = re.search(r"refund of order #(\d+)", prompt)
    if not m:
        return ""
    oid = m.group(1)
    fixes = re.findall(rf"order #{oid} is ([a-z ]+?), not", prompt)
    if fixes:
        return fixes[-1]
    rec = re.search(rf"Order #{oid}:[^\n]*?status: ([a-z ]+?);", prompt)
    return rec.group(1) if rec else ""


def make_handler(state: FakeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                entry = {"id": state.model, "max_model_len": state.max_model_len}
                self._send(200, json.dumps({"data": [entry]}).encode())
            elif self.path == "/version":
                self._send(200, b'{"version": "fake"}')
            elif self.path == "/metrics":
                text = ("# HELP vllm:prefix_cache_queries_total q\n"
                        "# TYPE vllm:prefix_cache_queries_total counter\n"
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="{state.model}"}}'
                        f" {float(state.queries)}\n"
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="{state.model}"}}'
                        f" {float(state.hits)}\n")
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/tokenize":
                self._send(200, json.dumps({"count": len(tokens(body["prompt"])) or 0}).encode())
                return
            if self.path != "/v1/chat/completions":
                self._send(404, b'{"error": "not found"}')
                return
            if body.get("model") != state.model:
                self._send(404, json.dumps({"error": f"model {body.get('model')} not found"})
                           .encode())
                return
            prompt = body["messages"][-1]["content"]
            n, hit = state.prefill(prompt, body.get("cache_salt"))
            time.sleep(state.spt * (n - hit))
            answer = "Yes." if _status(prompt).startswith(("delivered", "returned")) else "No."
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                      {"choices": [{"delta": {"content": answer}}]},
                      {"choices": [{"delta": {}, "finish_reason": "stop"}]},
                      {"choices": [], "usage": {"prompt_tokens": n, "completion_tokens": 1,
                                                "prompt_tokens_details": {"cached_tokens": hit}}}]
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def serve(port: int, model: str) -> tuple[ThreadingHTTPServer, FakeState]:
    """Start the fake server on 127.0.0.1:``port`` in a daemon thread (port 0: any free)."""
    state = FakeState(model)
    httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, state


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="fake")
    p.add_argument("--startup-delay", type=float, default=0.5)
    args, _ = p.parse_known_args()
    print("fake vLLM starting", flush=True)
    time.sleep(args.startup_delay)
    httpd, _ = serve(args.port, args.served_model_name)
    print(f"fake vLLM listening on {args.port}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        sys.exit(0)
