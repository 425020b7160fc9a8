"""One streamed completion as the soak sends it: token ids in, token ids, top log-probabilities
and per-chunk arrival times out, failures classified, and an early close on demand.

The prompt goes as token ids (kvnotes' per-part layout, :func:`~kvnotes.serving.compose_client.
prompt_ids`); the answer comes back as token ids too (vLLM's ``return_tokens_as_token_ids``), so
it is compared with the engine's greedy ids without detokenizing. Sent through the workloads'
client (:mod:`kvnotes_bench.serving.client`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvnotes.core.errors import ServingError
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.protocol import SpliceRequest
from kvnotes_bench.kit.failures import Failure
from kvnotes_bench.serving.client import CUT_SHORT, stream
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
        ans.chunk_s.append(t)
        ans.chunk_tokens.append(n)
    return n


async def stream_completion(client: Any, model: str, ids: Sequence[int], *, max_tokens: int,
                            splice: SpliceRequest | None = None, close_after: int | None = None,
                            ignore_eos: bool = False, top: int = 2) -> Answer:
    """Greedy completion of ``ids`` on ``client`` (:func:`~kvnotes_bench.serving.client.
    open_client`), streamed.

    ``close_after``: close the stream after that many token-carrying chunks (a client that
    disconnects mid-answer; the answer is then ``disconnected``, not ``ok``). A stream that ends
    without a finish reason was cut short (a ``connection`` failure, as the erratum counts it);
    one that finishes with no tokens is a ``stream`` failure.
    """
    ans = Answer()
    extra: dict[str, Any] = {"return_tokens_as_token_ids": True}
    if splice is not None:  # the salt its tenant and tag give, and the message itself
        extra["cache_salt"] = splice_salt(splice.tenant, splice.tag)
        extra["kv_transfer_params"] = splice.to_params()
    if ignore_eos:
        extra["ignore_eos"] = True
    seen = await stream(
        lambda: client.completions.create(
            model=model, prompt=list(map(int, ids)), max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, logprobs=top,
            extra_body=extra),
        lambda chunk, t: _read_chunk(ans, chunk, t) > 0,
        close_when=lambda n: close_after is not None and n >= close_after
        and not ans.finish_reason)
    ans.ttft_s, ans.total_s, ans.disconnected = seen.ttft_s, seen.total_s, seen.closed_early
    failure = seen.failure
    if failure is None and not ans.disconnected:
        failure = (CUT_SHORT if ans.finish_reason is None else None if ans.token_ids
                   else Failure("stream", "the answer finished with no tokens"))
        ans.ok = failure is None
    if failure is not None:
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
