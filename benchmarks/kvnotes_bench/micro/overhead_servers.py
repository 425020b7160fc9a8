"""The two servers the front-overhead benchmark (``front_overhead``) times, each in its own
process: an instant stand-in for vLLM, and the front under test.

This file is run by path (``python overhead_servers.py ROLE PORT UPSTREAM SKILLS MODEL``) with
``PYTHONPATH`` set to the ``src`` the front is imported from: this checkout's, or an older
checkout's that may lack this file. So it imports nothing of kvnotes at module level, and
the front role uses only entry points every checkout with ``serving/front/`` has.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

BLOCK = 16  # the block size the stand-in reports and the front plans with


def upstream_app() -> Any:
    """A raw ASGI app: ``/v1/completions`` answers a fixed body, or three events and ``[DONE]``
    when streamed; ``/metrics`` gives the block size."""
    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                       "model": "m", "choices": [{"index": 0, "text": " ok", "logprobs": None,
                                                  "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 8, "completion_tokens": 1,
                                 "total_tokens": 9}}).encode()
    event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": None}]}
    stream = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for _ in range(3))
    stream += b"data: [DONE]\n\n"
    metrics = f'vllm:cache_config_info{{block_size="{BLOCK}"}} 1.0\n'.encode()
    models = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        ctype, data = b"application/json", body
        if path == "/metrics":
            ctype, data = b"text/plain", metrics
        elif path == "/v1/models":
            data = models
        elif path == "/health":
            data = b""
        elif b'"stream": true' in raw or b'"stream":true' in raw:
            ctype, data = b"text/event-stream", stream
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def run_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app(), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, backlog=2048)


def run_front(port: int, upstream: str, skills: str, model: str) -> None:
    """The front of whichever kvnotes ``PYTHONPATH`` gives, until the process is ended."""
    from kvnotes.core.models import load
    from kvnotes.serving.front.app import Front, FrontConfig
    from kvnotes.serving.planning.match import SkillCatalog

    config = FrontConfig(upstream=upstream, port=port, block_size=BLOCK)
    front = Front(config, SkillCatalog(skills, load(model).tokenizer)).start()
    print(front.url, flush=True)
    while True:
        time.sleep(3600)


def main(argv: list[str]) -> None:
    role, port, upstream, skills, model = argv
    if role == "upstream":
        run_upstream(int(port))
    else:
        run_front(int(port), upstream, skills, model)


if __name__ == "__main__":
    main(sys.argv[1:])
