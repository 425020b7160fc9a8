"""Streaming requests to a loopback server, timed on the client: what serve-bench measures.

Requests go through ``openai.AsyncOpenAI`` (streaming chat completions, ``stream_options`` for
the usage chunk, ``extra_body`` for vLLM's ``cache_salt``; no retries, so every failure is
seen). Time to first token is measured on the client: from sending the request to the first
streamed chunk that carries generated text (or finishes the choice).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvnotes.serving.vllm_endpoints import Client, check_loopback_url
from kvnotes_bench.kit.failures import classify

__all__ = ["Client", "StreamResult", "check_loopback_url", "stream_chat"]

@dataclass
class StreamResult:
    """The outcome of one streamed chat request; ``error_kind`` is one of
    :data:`~kvnotes_bench.kit.failures.ERROR_KINDS`."""

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
        failure = classify(err)
        res.error_kind, res.error = failure.kind, failure.message
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
