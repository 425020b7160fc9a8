"""The serving workloads' one HTTP client: ``openai.AsyncOpenAI``, timed on the client.

:func:`open_client` makes the client every workload sends through (no retries, so every failure
is seen). :func:`stream` drives one streamed request: it times it, takes the time to the first
token from the first chunk that carried generated output (each workload's reader says which do),
closes early on demand and turns any failure into a classified
:class:`~kvnotes_bench.kit.failures.Failure`. vLLM's and kvnotes' own fields
(``cache_salt``, ``kv_transfer_params``, ``return_tokens_as_token_ids``, ``kvnotes``) go in
``extra_body``; the front's ``/kvnotes/stats`` is read with the same client
(:func:`get_json`). The readers of each workload's chunks stay in the workload:
:func:`stream_chat` (the erratum's), :func:`kvnotes_bench.serving.soak_client.stream_completion`
(token ids in and out), :meth:`kvnotes_bench.serving.agent_traffic_client.OpenAISender.stream`
(tools and log-probs). ``/metrics`` and ``/health`` go through the wheel's blocking
:class:`~kvnotes.serving.vllm_endpoints.Client`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvnotes.serving.vllm_endpoints import Client, check_loopback_url
from kvnotes_bench.kit.failures import Failure, classify

__all__ = ["Client", "StreamResult", "Streamed", "check_loopback_url", "get_json",
           "open_client", "stream", "stream_chat"]

API_KEY = "kvnotes"  # what a server that checks no key is sent
CUT_SHORT = Failure("connection", "the server closed the stream before the answer finished")


def open_client(url: str, *, timeout: float, api_key: str = API_KEY) -> Any:
    """An ``AsyncOpenAI`` for the server at ``url`` (``http://127.0.0.1:PORT``), without
    retries (a workload counts each failure instead of hiding it) and without the
    environment's proxies (the servers are loopback ones); create it inside the event loop
    that uses it."""
    import openai

    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key,
                              timeout=timeout, max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(trust_env=False,
                                                                          timeout=timeout))


@dataclass
class Streamed:
    """What the transport saw of one streamed request: seconds to the first chunk that carried
    output and to the end (both from sending), the failure if any, and whether the client
    closed the stream early on purpose."""

    ttft_s: float | None = None
    total_s: float | None = None
    failure: Failure | None = None
    closed_early: bool = False


async def stream(open_stream: Callable[[], Awaitable[Any]], read: Callable[[Any, float], bool],
                 *, timeout: float | None = None,
                 close_when: Callable[[int], bool] | None = None) -> Streamed:
    """Open a stream (``open_stream``: the SDK's ``create(..., stream=True)``) and feed each
    chunk to ``read(chunk, seconds since sent)``, which says whether it carried output.

    ``timeout`` bounds the whole request; ``close_when(n)``, asked after the n-th chunk that
    carried output, closes the stream there (a client that leaves mid-answer). Never raises for
    a server's failure: it comes back as :attr:`Streamed.failure`.
    """
    out = Streamed()
    t0 = time.perf_counter()

    async def consume() -> None:
        carried = 0
        chunks = await open_stream()
        try:
            async for chunk in chunks:
                t = time.perf_counter() - t0
                if not read(chunk, t):
                    continue
                carried += 1
                if out.ttft_s is None:
                    out.ttft_s = t
                if close_when is not None and close_when(carried):
                    out.closed_early = True
                    break
        finally:
            await chunks.close()

    try:
        async with asyncio.timeout(timeout):
            await consume()
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 -- every server failure is reported, not raised
        out.failure = classify(err)
    out.total_s = time.perf_counter() - t0
    return out


async def get_json(client: Any, url: str) -> Any | None:
    """``GET url`` (an endpoint beside ``/v1``, e.g. the front's ``/kvnotes/stats``) through
    ``client``, with its key; None when the server refuses or does not answer JSON."""
    import openai

    try:
        return await client.get(url, cast_to=object)
    except (openai.OpenAIError, ValueError):
        return None


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


@dataclass
class _ChatReader:
    """Folds chat chunks into a :class:`StreamResult`: text, usage, whether it finished."""

    res: StreamResult
    pieces: list[str] = field(default_factory=list)
    finished: bool = False

    def __call__(self, chunk: Any, _t: float) -> bool:
        """True when ``chunk`` carried text or finished the choice."""
        carried = False
        for choice in chunk.choices or []:
            content = choice.delta.content if choice.delta is not None else None
            carried = carried or bool(content or choice.finish_reason)
            if content:
                self.pieces.append(content)
            self.finished = self.finished or bool(choice.finish_reason)
        usage = chunk.usage
        if usage is not None:
            self.res.prompt_tokens = usage.prompt_tokens
            self.res.completion_tokens = usage.completion_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            self.res.cached_tokens = getattr(details, "cached_tokens", None)
        return carried


async def stream_chat(client: Any, model: str, prompt: str, *, max_tokens: int = 8,
                      cache_salt: str | None = None, timeout: float | None = None
                      ) -> StreamResult:
    """One user message, greedy, streamed through ``client`` (:func:`open_client`) and timed.
    Never raises for a server's failure: HTTP errors, refused or dropped connections, timeouts
    (``timeout`` bounds the whole request) and cut streams come back as ``ok=False`` with
    ``error_kind`` and ``error``."""
    reader = _ChatReader(StreamResult(ok=False))
    seen = await stream(
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": cache_salt} if cache_salt is not None else None),
        reader, timeout=timeout)
    res = reader.res
    res.ttft_s, res.total_s, res.text = seen.ttft_s, seen.total_s, "".join(reader.pieces)
    failure = seen.failure or (None if reader.finished else CUT_SHORT)
    if failure is None:
        res.ok = True
    else:
        res.error_kind, res.error = failure.kind, failure.message
    return res
