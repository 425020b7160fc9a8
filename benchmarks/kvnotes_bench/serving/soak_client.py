"""One streamed completion as the soak sends it: token ids in, token ids, top log-probabilities
and per-chunk arrival times out, failures classified, and an early close on demand.

The prompt goes as token ids (kvnotes' per-part layout, :func:`~kvnotes.serving.compose_client.
prompt_ids`); the answer comes back as token ids too (vLLM's ``return_tokens_as_token_ids``), so
it is compared with the engine's greedy ids without detokenizing. Talks to vLLM through
``openai.AsyncOpenAI``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvnotes.core.errors import ServingError
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.protocol import SpliceRequest
from kvnotes_bench.kit.failures import classify
from kvnotes_bench.serving.metrics import parse_prometheus

TOKEN_PREFIX = "token_id:"


@dataclass
class Answer:
    """What one streamed request got. ``chunk_s``: arrival of each chunk that carried tokens
    (seconds after the request was sent) with its token count in ``chunk_tokens``."""

    ok: bool = False
    error: str | None = None
    error_kind: str | None = None  # one of kvnotes_bench.kit.failures.ERROR_KINDS
    disconnected: bool = False  # the client closed the stream early (on purpose)
    token_ids: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None


def token_id(token: str) -> int:
    """``"token_id:123"`` -> 123 (vLLM's spelling with ``return_tokens_as_token_ids``)."""
    if not token.startswith(TOKEN_PREFIX):
        raise ValueError(f"expected a token spelled {TOKEN_PREFIX}N, got {token!r} (is "
                         "return_tokens_as_token_ids supported by this server?)")
    return int(token[len(TOKEN_PREFIX):])


def _read_chunk(ans: Answer, chunk: Any, t: float) -> int:
    """Fold one stream chunk into ``ans``; returns the tokens it carried."""
    n = 0
    for choice in chunk.choices or []:
        lp = getattr(choice, "logprobs", None)
        if lp is not None and lp.tokens:
            ids = [token_id(tok) for tok in lp.tokens]
            ans.token_ids += ids
            n += len(ids)
            for d in lp.top_logprobs or []:
                ans.top.append({token_id(k): float(v) for k, v in (d or {}).items()})
        if choice.finish_reason:
            ans.finish_reason = choice.finish_reason
    if chunk.usage is not None:
        ans.prompt_tokens = chunk.usage.prompt_tokens
        details = getattr(chunk.usage, "prompt_tokens_details", None)
        ans.cached_tokens = getattr(details, "cached_tokens", None) if details else None
    if n:
        if ans.ttft_s is None:
            ans.ttft_s = t
        ans.chunk_s.append(t)
        ans.chunk_tokens.append(n)
    return n


async def stream_completion(client: Any, model: str, ids: Sequence[int], *, max_tokens: int,
                            splice: SpliceRequest | None = None, close_after: int | None = None,
                            ignore_eos: bool = False, top: int = 2) -> Answer:
    """Greedy completion of ``ids`` on ``client`` (an ``openai.AsyncOpenAI``), streamed.

    ``close_after``: close the stream after that many token-carrying chunks (a client that
    disconnects mid-answer; the answer is then ``disconnected``, not ``ok``). A stream that ends
    without a finish reason is a ``stream`` error.
    """
    ans = Answer()
    extra: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if splice is not None:  # the salt its tenant and tag give, and the message itself
        extra["cache_salt"] = splice_salt(splice.tenant, splice.tag)
        extra["kv_transfer_params"] = splice.to_params()
    if ignore_eos:
        extra["ignore_eos"] = True
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=list(map(int, ids)), max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, logprobs=top,
            extra_body=extra)
        chunks = 0
        async for chunk in stream:
            chunks += _read_chunk(ans, chunk, time.perf_counter() - t0) > 0
            if close_after is not None and chunks >= close_after and not ans.finish_reason:
                await stream.close()
                ans.disconnected = True
                break
        ans.total_s = time.perf_counter() - t0
        if not ans.disconnected:
            ans.ok = ans.finish_reason is not None and bool(ans.token_ids)
            if not ans.ok:
                ans.error, ans.error_kind = "the stream ended without a finished answer", "stream"
    except Exception as err:  # noqa: BLE001 -- every failure is a counted outcome, not a crash
        ans.total_s = time.perf_counter() - t0
        failure = classify(err)
        ans.error, ans.error_kind = failure.message, failure.kind
    return ans


PREEMPTIONS = "vllm:num_preemptions_total"


def read_counter(text: str, name: str) -> float | None:
    """A counter summed over its label sets (None when the server does not export it)."""
    try:
        parsed = parse_prometheus(text)
    except ServingError:
        return None
    return parsed.get(name)
