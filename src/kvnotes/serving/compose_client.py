"""A client for composed requests: parts in, answer plus how many prompt tokens were reused out.

The prompt is sent as token ids built part by part with kvnotes' own tokenization (BOS first
when the tokenizer adds one, then each part's tokens with no special tokens: exactly what
``engine.compose`` feeds), so registered skills in it match the server's pieces token for
token. Spliced requests carry the ``cache_salt`` ``kvnotes-splice`` (``kvnotes-splice:<tenant>``
for a client with a tenant); the same prompt without it is an exact request that never sees
spliced KV (docs/serving.md). Talks to the server through the ``openai`` client (streaming
completions, ``extra_body`` for the salt).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvnotes.core.document import added_bos, encode
from kvnotes.core.errors import ServingError
from kvnotes.serving.client import check_loopback_url
from kvnotes.serving.manifest import splice_salt


def prompt_ids(tokenizer: Any, parts: Sequence[str]) -> list[int]:
    """Token ids of ``parts`` as ``engine.compose`` lays them out."""
    if isinstance(parts, str):
        raise TypeError("parts is a list of strings (header, skills, user text), not one string")
    ids: list[int] = []
    bos = added_bos(tokenizer)  # the engine's BOS rule
    if bos is not None:
        ids.append(bos)
    for part in parts:
        ids += encode(tokenizer, part)
    return ids


@dataclass
class ComposeResult:
    """One completion: text, timing, and what the server reused."""

    ok: bool
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # local prefix hits plus spliced (external) tokens
    top_logprobs: list[dict[str, float]] = field(default_factory=list)  # per generated token
    error: str | None = None

    @property
    def reused_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


class ComposeClient:
    """Send composed prompts to a loopback vLLM server started by ``kvnotes serve``.

    ``tenant`` namespaces the client's spliced requests (salt ``kvnotes-splice:<tenant>``).

    Example:
        >>> client = ComposeClient("http://127.0.0.1:8000", "smollm2-135m", tokenizer)  # doctest: +SKIP
        >>> r = client.complete([HEADER, refunds, shipping, "Customer: ..."])          # doctest: +SKIP
        >>> r.text, r.cached_tokens, r.prompt_tokens                                    # doctest: +SKIP
    """

    def __init__(self, url: str, model: str, tokenizer: Any, *, timeout: float = 600.0,
                 tenant: str | None = None) -> None:
        check_loopback_url(url)  # before any client exists: loopback servers only
        self.salt = splice_salt(tenant)  # checks the tenant's spelling before any request
        from openai import OpenAI  # the client library is only needed by this class

        self.url, self.model, self.tokenizer = url.rstrip("/"), model, tokenizer
        self.tenant = tenant
        self._client = OpenAI(base_url=self.url + "/v1", api_key="kvnotes", timeout=timeout,
                              max_retries=0)

    def prompt_ids(self, parts: Sequence[str]) -> list[int]:
        return prompt_ids(self.tokenizer, parts)

    def complete(self, parts: Sequence[str] | None = None, *, ids: Sequence[int] | None = None,
                 max_tokens: int = 16, splice: bool = True, salt: str | None = None,
                 logprobs: int | None = None) -> ComposeResult:
        """Greedy completion of the composed prompt.

        ``splice=True`` sends the client's splice salt (skills at the front are supplied by
        the connector); ``splice=False`` sends no salt (an exact request: plain prefix caching).
        ``salt`` overrides both (e.g. a fresh salt per request for a cold prefill).
        """
        if ids is None:
            if parts is None:
                raise ServingError("complete() needs parts or ids")
            ids = self.prompt_ids(parts)
        extra: dict[str, Any] = {}
        if salt is not None or splice:
            extra["cache_salt"] = salt if salt is not None else self.salt
        res = ComposeResult(ok=False)
        t0 = time.perf_counter()
        try:
            stream = self._client.completions.create(
                model=self.model, prompt=list(map(int, ids)), max_tokens=max_tokens,
                temperature=0.0, stream=True, stream_options={"include_usage": True},
                logprobs=logprobs, extra_body=extra or None)
            for chunk in stream:
                for choice in chunk.choices or []:
                    if res.ttft_s is None and (choice.text or choice.finish_reason):
                        res.ttft_s = time.perf_counter() - t0
                    res.text += choice.text or ""
                    lp = getattr(choice, "logprobs", None)
                    if lp is not None:
                        res.tokens += list(lp.tokens or [])
                        res.top_logprobs += [dict(d) for d in (lp.top_logprobs or []) if d]
                if chunk.usage is not None:
                    res.prompt_tokens = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    res.cached_tokens = getattr(details, "cached_tokens", None) if details else None
            res.total_s = time.perf_counter() - t0
            res.ok = res.ttft_s is not None
            if not res.ok:
                res.error = "the stream carried no generated text"
        except Exception as err:  # noqa: BLE001 -- HTTP errors, disconnects, timeouts: reported
            res.error = f"{type(err).__name__}: {err}"
        return res


def cold_salt() -> str:
    """A salt no other request uses: the prompt is prefilled from scratch."""
    return f"cold-{uuid.uuid4().hex}"
