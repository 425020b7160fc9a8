"""A client for composed requests: parts in, answer plus how many prompt tokens were reused out.

The prompt is sent as token ids built part by part with kvnotes' own tokenization (BOS first
when the tokenizer adds one, then each part's tokens with no special tokens: exactly what
``engine.compose`` feeds), so registered skills in it match the server's pieces token for
token. Spliced requests carry the ``cache_salt`` ``kvnotes-splice`` (``kvnotes-splice:<tenant>``
for a client with a tenant); the same prompt without it is an exact request that never sees
spliced KV (docs/guide/serving.md). Talks to the server through the ``openai`` client (streaming
completions, ``extra_body`` for the salt and the splice ranges).

With a :class:`~kvnotes.core.repair.Repair`, a request is sent as a phased prefill
(:mod:`kvnotes.serving.planning.phases`): the client reads which parts are registered skills, and where
each was compiled, from the server's skills folder (the one ``kvnotes serve --skills`` and
``ServingSkills`` publish to), plans the phases, sends them one after the other, then the real
request; with a guard, a first token whose top-2 margin is below it is answered by an exact
request instead.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvnotes.core.errors import InvalidArgumentError, ServingError
from kvnotes.core.repair import Repair
from kvnotes.serving.json_types import CompletionBody, UpstreamBody
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.splice import PieceIndex
from kvnotes.serving.planning.layout import part_ids, prompt_ids
from kvnotes.serving.planning.phases import (
    PhasePlan,
    check_tau,
    completion_body,
    guard_fires,
    margin,
    part_spans,
    plan_phases,
)
from kvnotes.serving.protocol import SpliceRequest, UsageKvnotes, WirePlan
from kvnotes.serving.vllm_endpoints import check_loopback_url

# body keys the openai client does not know: sent through extra_body
_EXTRA_KEYS = ("cache_salt", "kv_transfer_params", "kvnotes")  # not the SDK's own fields


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
    # a phased request (repair=...): the phases sent (and how many failed: the real request
    # is then partly computed, still correct), the tokens the plan splices, the first spliced
    # token's top-2 margin, whether the guard fired (None: no guard) and the plan itself
    phases: int = 0
    phase_errors: int = 0
    phase_cached_tokens: list[int | None] = field(default_factory=list)
    spliced_tokens: int | None = None
    margin: float | None = None
    guard_fired: bool | None = None
    plan: WirePlan | None = None
    # the answer of kvnotes' OpenAI front: its ``usage.kvnotes`` (None: not sent by a front,
    # or forwarded there exactly)
    usage_kvnotes: UsageKvnotes | None = None

    @property
    def reused_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


class ComposeClient:
    """Send composed prompts to a loopback vLLM server started by ``kvnotes serve``.

    ``tenant`` namespaces the client's spliced requests (salt ``kvnotes-splice:<tenant>``;
    each spliced request also carries a :class:`~kvnotes.serving.protocol.SpliceRequest`, the
    only thing the connector splices by).
    ``skills`` is the server's skills folder (``ROOT/<model fingerprint id>``, e.g.
    ``ServingSkills.folder``; rescanned as it changes) or an index of its pieces, and
    ``block_size`` the server's block size: both are needed for repaired (phased) requests,
    which must know which parts are registered skills, where each was compiled, and where a
    block ends.

    Example:
        >>> client = ComposeClient("http://127.0.0.1:8000", "smollm2-135m", tokenizer)  # doctest: +SKIP
        >>> r = client.complete([HEADER, refunds, shipping, "Customer: ..."])          # doctest: +SKIP
        >>> r.text, r.cached_tokens, r.prompt_tokens                                    # doctest: +SKIP
    """

    def __init__(self, url: str, model: str, tokenizer: Any, *, timeout: float = 600.0,
                 tenant: str | None = None,
                 skills: str | os.PathLike[str] | PieceIndex | None = None,
                 block_size: int | None = None) -> None:
        check_loopback_url(url)  # before any client exists: loopback servers only
        self.salt = splice_salt(tenant)  # checks the tenant's spelling before any request
        from openai import OpenAI  # the client library is only needed by this class

        self.url, self.model, self.tokenizer = url.rstrip("/"), model, tokenizer
        self.tenant = tenant
        self.block_size = block_size
        self.timeout = timeout
        self.store = PieceStore(skills) if isinstance(skills, (str, os.PathLike)) else None
        self._index = skills if isinstance(skills, PieceIndex) else None
        self._client = OpenAI(base_url=self.url + "/v1", api_key="kvnotes", timeout=timeout,
                              max_retries=0)

    def prompt_ids(self, parts: Sequence[str]) -> list[int]:
        return prompt_ids(self.tokenizer, parts)

    def plan(self, parts: Sequence[str], repair: Repair) -> tuple[list[int], PhasePlan]:
        """The prompt ids of ``parts`` and their phased plan under ``repair``."""
        if self.store is not None:
            self.store.refresh()
            index = self.store.index
        elif self._index is not None:
            index = self._index
        else:
            index = None
        if index is None or self.block_size is None:
            raise InvalidArgumentError(
                "a repaired request needs the server's skills folder and block size: "
                "ComposeClient(..., skills=ServingSkills.folder, block_size=N)")
        ids_per_part = part_ids(self.tokenizer, parts)
        spans = part_spans(ids_per_part, index)
        ids = [t for p in ids_per_part for t in p]
        return ids, plan_phases(spans, repair, self.block_size, tenant=self.tenant)

    def complete(self, parts: Sequence[str] | None = None, *, ids: Sequence[int] | None = None,
                 max_tokens: int = 16, splice: bool = True, salt: str | None = None,
                 logprobs: int | None = None, repair: Repair | None = None,
                 guard: float | None = None) -> ComposeResult:
        """Greedy completion of the composed prompt.

        ``splice=True`` sends the client's splice salt and a splice request for the prompt's
        leading run of skills (:meth:`SpliceRequest.leading
        <kvnotes.serving.protocol.SpliceRequest.leading>`: the connector supplies the registered
        skills at the front); ``splice=False`` sends neither (an exact request: plain prefix
        caching). ``salt`` overrides both: an exact request under that salt (e.g. a fresh salt
        per request for a cold prefill).

        ``repair`` (with ``parts``): a phased prefill, each skill's first tokens computed in
        context by vLLM (:mod:`kvnotes.serving.planning.phases`); ``guard`` (a log-prob margin, with a
        repair): when the first answer token's top-1 minus top-2 is below it, the answer comes
        from an exact request. TTFT then counts from the first phase to the first token of the
        answer returned.
        """
        if repair is not None or guard is not None:
            if repair is None or parts is None or ids is not None or salt is not None \
                    or not splice:
                raise InvalidArgumentError("repair= and guard= plan a spliced request from its "
                                           "parts: give parts and repair, not ids, salt or "
                                           "splice=False")
            return self._phased(parts, repair, guard, max_tokens=max_tokens, logprobs=logprobs)
        if ids is None:
            if parts is None:
                raise ServingError("complete() needs parts or ids")
            ids = self.prompt_ids(parts)
        body = completion_body(ids, self.model, max_tokens=max_tokens, logprobs=logprobs)
        if salt is not None:
            body["cache_salt"] = salt
        elif splice:
            body["cache_salt"] = self.salt
            body["kv_transfer_params"] = SpliceRequest.leading(self.tenant).to_params()
        return self.send(body)

    def _phased(self, parts: Sequence[str], repair: Repair, guard: float | None, *,
                max_tokens: int, logprobs: int | None) -> ComposeResult:
        if guard is not None:
            check_tau(guard)
        t0 = time.perf_counter()
        ids, plan = self.plan(parts, repair)
        errors = 0
        cached: list[int | None] = []
        for body in plan.phase_bodies(ids, self.model):
            phase = self.send(body)  # a lost phase costs time, never correctness
            errors += not phase.ok
            cached.append(phase.cached_tokens)

        def fires(res: ComposeResult) -> bool:
            return guard is not None and guard_fires(
                res.top_logprobs[0] if res.top_logprobs else None, guard)

        res = self.send(plan.real_body(ids, self.model, max_tokens=max_tokens, guard=guard,
                                       logprobs=logprobs), t0=t0, stop=fires)
        spliced_margin = margin(res.top_logprobs[0]) if res.top_logprobs else None
        fired = res.ok and fires(res)
        if fired:  # the same ids, no salt: the exact answer, timed from the first phase
            res = self.send(completion_body(ids, self.model, max_tokens=max_tokens,
                                            logprobs=logprobs), t0=t0)
        res.margin = spliced_margin
        res.phases, res.phase_errors, res.phase_cached_tokens = len(cached), errors, cached
        res.spliced_tokens = 0 if fired else plan.spliced_tokens
        res.guard_fired = None if guard is None else fired
        res.plan = plan.wire()
        return res

    def send(self, body: CompletionBody | UpstreamBody, *, t0: float | None = None,
             stop: Callable[[ComposeResult], bool] | None = None) -> ComposeResult:
        """Stream one prepared ``/v1/completions`` body (e.g. a :class:`PhasePlan`'s, or a
        client's for kvnotes' front, whose ``usage.kvnotes`` is read); ``stop``
        is asked once the first token is in and ends the stream early when it says so (the
        answer then comes from elsewhere). TTFT counts from ``t0`` (default: now)."""
        res = ComposeResult(ok=False)
        t0 = time.perf_counter() if t0 is None else t0
        std, extra = _split(body)
        std = {**std, "stream": True, "stream_options": {"include_usage": True}}
        try:
            # the SDK checks its own fields' values
            stream = self._client.completions.create(**cast(Any, std), extra_body=extra or None)
            for chunk in stream:
                first = res.ttft_s is None
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
                    extra = getattr(chunk.usage, "model_extra", None) or {}
                    if isinstance(extra.get("kvnotes"), dict):
                        res.usage_kvnotes = UsageKvnotes.from_dict(extra["kvnotes"])
                if first and res.ttft_s is not None and stop is not None and stop(res):
                    stream.close()
                    break
            res.total_s = time.perf_counter() - t0
            res.ok = res.ttft_s is not None
            if not res.ok:
                res.error = "the stream carried no generated text"
        except Exception as err:  # noqa: BLE001 -- HTTP errors, disconnects, timeouts: reported
            res.error = f"{type(err).__name__}: {err}"
        return res


def _split(body: CompletionBody | UpstreamBody) -> tuple[dict[str, object], dict[str, object]]:
    """A completions body as the openai client takes it: the keyword arguments of its own
    fields, and ``extra_body``."""
    fields: dict[str, object] = dict(body)
    std = {k: v for k, v in fields.items() if k not in _EXTRA_KEYS}
    return std, {k: fields[k] for k in _EXTRA_KEYS if k in fields}


def cold_salt() -> str:
    """A salt no other request uses: the prompt is prefilled from scratch."""
    return f"cold-{uuid.uuid4().hex}"
