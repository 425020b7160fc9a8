"""What one request carries through the front: its record (:class:`Call`, what its log line
and metrics say) and the answer to send (:class:`Reply`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from kvnotes.serving.front.errors import ApiError, error_body
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.protocol import Outcome, WirePlan

JSON = "application/json"


@dataclass
class Reply:
    """An answer to send: a whole body, or a stream of byte chunks."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    stream: AsyncGenerator[bytes, None] | None = None
    # the upstream response a stream reads: closed when the answer ends, however it ends (a
    # generator closed before its first step never runs its own ``finally``)
    upstream: Any = None

    async def close(self) -> None:
        """Close the stream and the upstream response (both idempotent)."""
        try:
            if self.stream is not None:
                await self.stream.aclose()
        finally:
            if self.upstream is not None:
                await self.upstream.aclose()


def json_reply(status: int, obj: object, **headers: str) -> Reply:
    """A whole answer of ``obj`` as JSON (``obj``: anything ``json.dumps`` writes)."""
    return Reply(status, {"content-type": JSON, **headers}, json.dumps(obj).encode())


def error_reply(err: ApiError) -> Reply:
    headers = {"connection": "close"} if err.status in (408, 413) else {}
    return json_reply(err.status, error_body(err.status, str(err), err.param), **headers)


@dataclass
class Call:
    """One request's record: what its log line and metrics say."""

    route: str
    id: str
    t0: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    client: str = ""  # whose turn its planning takes (its key's digest, or its address)
    outcome: Outcome | None = None  # None: not decided yet (counted as internal_error)
    reason: str | None = None
    status: int = 0
    plan: WirePlan | None = None  # the plan it was spliced with (None: not spliced)
    first_upstream: float | None = None
    finished: bool = False
    leased: tuple[str, ...] = ()  # learned entries held against eviction while it runs

    def plan_summary(self) -> JsonObject:
        """What its log line says of its plan: the skills spliced, the phases, the spliced
        tokens (empty when it was not spliced)."""
        p = self.plan
        if p is None:
            return {}
        return {"skills": list(p.skills), "phases": len(p.phase_ends),
                "spliced_tokens": p.spliced_tokens}

    def upstream_started(self) -> None:
        if self.first_upstream is None:
            self.first_upstream = time.perf_counter()

