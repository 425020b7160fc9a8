"""A stand-in for a vLLM OpenAI-compatible server, for the serving unit tests.

It serves what the ``openai`` client and serve-bench send: /health, /v1/models, /version,
/tokenize (one token per word or punctuation mark), /metrics (prefix-cache counters, vLLM's
per-request histograms, ``vllm:cache_config_info`` with the block size) and streamed
/v1/chat/completions and /v1/completions (``stream_options.include_usage``, ``cache_salt``).
Its "prefix cache" counts, per request, the longest prefix (in tokens) shared with an earlier
prompt of the same cache salt; one "engine" computes one request at a time, for a time
proportional to the uncached tokens (the wait for it is the queue time). ``FakeState.fail``
makes coming requests fail on demand (HTTP 500/400, dropped connection, cut stream, hang, error
event). Run as a module (``python -m _fake_vllm --port P --served-model-name M``) it behaves
like a launched server.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


FAULTS = ("http_500", "http_400", "drop", "cut", "hang", "stream_error")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_prefill_kv_computed_tokens", "vllm:request_prompt_tokens")


class FakeState:
    def __init__(self, model: str, seconds_per_token: float = 2e-5) -> None:
        self.model = model
        self.spt = seconds_per_token
        self.min_delay = 0.0  # seconds every request computes at least
        self.step_s = 0.001  # one decode step
        self.lock = threading.Lock()
        self.engine = threading.Lock()  # one request computed at a time
        self.prompts: dict[str | None, list[list[str]]] = {}
        self.queries = 0
        self.hits = 0
        self.max_model_len: int | None = None
        self.block_size = 128
        self.inflight = 0
        self.max_inflight = 0
        self.requests = 0
        self.hist = {name: [0.0, 0] for name in HISTOGRAMS}  # name -> [sum, count]
        self.faults: list[tuple[str, object]] = []  # (kind, predicate on the prompt text)
        self.hang_s = 5.0
        # which correction of the asked-about order the fake model reads: "last" (a perfect
        # reader), "first" (repeats the first one, as SmolLM2 was seen to) or "none" (misses them)
        self.errata_reader = "last"

    def fail(self, kind: str, n: int = 1, when: object = None) -> None:
        """The next ``n`` generation requests (whose prompt text satisfies ``when``, if given)
        fail with ``kind``: http_500, http_400, drop (connection closed, no answer), cut (the
        stream stops before the answer), hang (no answer for ``hang_s``), stream_error."""
        assert kind in FAULTS, kind
        with self.lock:
            self.faults += [(kind, when)] * n

    def take_fault(self, prompt: str) -> str | None:
        with self.lock:
            for i, (kind, when) in enumerate(self.faults):
                if when is None or when(prompt):  # type: ignore[operator]
                    del self.faults[i]
                    return kind
        return None

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            self.hist[name][0] += value
            self.hist[name][1] += 1

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


def _status(prompt: str, errata_reader: str = "last") -> str:
    """The asked-about order's status, as a reader of the prompt sees it: the last correction
    (a perfect reader), the first one, or none (the record as first written)."""
    m = re.search(r"(?:refund of|current status of) order #(\d+)", prompt)
    if not m:
        return ""
    oid = m.group(1)
    fixes = re.findall(rf"order #{oid} is ([a-z ]+?), not", prompt)
    if fixes and errata_reader != "none":
        return fixes[-1] if errata_reader == "last" else fixes[0]
    rec = re.search(rf"Order #{oid}:[^\n]*?status: ([a-z ]+?);", prompt)
    return rec.group(1) if rec else ""


def make_handler(state: FakeState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes (keep-alive)

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
                self._send(200, metrics_text(state).encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/tokenize":
                self._send(200, json.dumps({"count": len(tokens(body["prompt"])) or 0}).encode())
                return
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._send(404, b'{"error": "not found"}')
                return
            if body.get("model") != state.model:
                self._error(404, f"The model `{body.get('model')}` does not exist.")
                return
            with state.lock:
                state.inflight += 1
                state.requests += 1
                state.max_inflight = max(state.max_inflight, state.inflight)
            try:
                self._generate(body, chat)
            finally:
                with state.lock:
                    state.inflight -= 1

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"object": "error", "message": message,
                                         "type": "BadRequestError" if code < 500 else
                                         "InternalServerError", "code": code}).encode())

        def _generate(self, body: dict, chat: bool) -> None:
            if chat:
                prompt = body["messages"][-1]["content"]
            else:
                p = body["prompt"]
                prompt = " ".join(map(str, p)) if isinstance(p, list) else p
            fault = state.take_fault(prompt)
            if fault == "http_500":
                self._error(500, "fake engine failure")
                return
            if fault == "http_400":
                self._error(400, "fake bad request")
                return
            if fault == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault == "hang":
                time.sleep(state.hang_s)
            t_arrival = time.perf_counter()
            with state.engine:
                t_sched = time.perf_counter()
                n, hit = state.prefill(prompt, body.get("cache_salt"))
                time.sleep(max(state.min_delay, state.spt * (n - hit)) + state.step_s)
            t_first = time.perf_counter()
            state.observe("vllm:request_queue_time_seconds", t_sched - t_arrival)
            state.observe("vllm:request_prefill_time_seconds", t_first - t_sched)
            state.observe("vllm:time_to_first_token_seconds", t_first - t_arrival)
            state.observe("vllm:inter_token_latency_seconds", state.step_s)
            state.observe("vllm:request_prefill_kv_computed_tokens", n - hit)
            state.observe("vllm:request_prompt_tokens", n)
            status = _status(prompt, state.errata_reader)
            if "current status of order #" in prompt:
                answer = f"The status is {status}."
            else:
                answer = "Yes." if status.startswith(("delivered", "returned")) else "No."
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            obj = "chat.completion.chunk" if chat else "text_completion"
            head = {"id": "cmpl-fake", "object": obj, "created": 0, "model": state.model}

            def choice(text: str | None, finish: str | None = None) -> dict:
                if chat:
                    delta = {} if text is None else {"content": text}
                    return {"index": 0, "delta": delta, "finish_reason": finish}
                return {"index": 0, "text": text or "", "finish_reason": finish}

            chunks = [{**head, "choices": [choice("")]}]
            if chat:
                chunks[0]["choices"][0]["delta"]["role"] = "assistant"
            if fault == "stream_error":
                chunks.append({"error": {"message": "fake error inside the stream",
                                         "type": "InternalServerError", "code": 500}})
            chunks.append({**head, "choices": [choice(answer)]})
            if fault != "cut":
                chunks += [{**head, "choices": [choice(None, "stop")]},
                           {**head, "choices": [], "usage": {
                               "prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                               "prompt_tokens_details": {"cached_tokens": hit}}}]
            self.close_connection = True
            try:
                for c in chunks:
                    self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                if fault != "cut":
                    self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout): nothing left to send

    return Handler


def metrics_text(state: FakeState) -> str:
    """/metrics as vLLM writes it: counters, histograms (sum, count, +Inf bucket), cache info."""
    labels = f'engine="0",model_name="{state.model}"'
    lines = ["# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.",
             "# TYPE vllm:prefix_cache_queries_total counter",
             f"vllm:prefix_cache_queries_total{{{labels}}} {float(state.queries)}",
             "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.",
             "# TYPE vllm:prefix_cache_hits_total counter",
             f"vllm:prefix_cache_hits_total{{{labels}}} {float(state.hits)}",
             "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
             "# TYPE vllm:cache_config_info gauge",
             f'vllm:cache_config_info{{block_size="{state.block_size}",cache_dtype="auto",'
             'enable_prefix_caching="True",engine="0"} 1.0']
    with state.lock:
        for name, (total, count) in state.hist.items():
            lines += [f"# HELP {name} fake", f"# TYPE {name} histogram",
                      f'{name}_bucket{{{labels},le="+Inf"}} {float(count)}',
                      f"{name}_count{{{labels}}} {float(count)}",
                      f"{name}_sum{{{labels}}} {float(total)}"]
    return "\n".join(lines) + "\n"


def serve(port: int, model: str, *, block_size: int = 128) -> tuple[ThreadingHTTPServer,
                                                                       FakeState]:
    """Start the fake server on 127.0.0.1:``port`` in a daemon thread (port 0: any free)."""
    state = FakeState(model)
    state.block_size = block_size
    httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, state


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="fake")
    p.add_argument("--startup-delay", type=float, default=0.5)
    p.add_argument("--block-size", type=int, default=128)
    args, _ = p.parse_known_args()
    print(f"fake vLLM starting: {' '.join(sys.argv[1:])}", flush=True)
    time.sleep(args.startup_delay)
    httpd, _ = serve(args.port, args.served_model_name, block_size=args.block_size)
    print(f"fake vLLM listening on {args.port}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        sys.exit(0)
