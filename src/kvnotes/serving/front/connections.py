"""Slow and greedy clients, below the app: uvicorn's h11 protocol with a head deadline and a
per-address cap on open connections, and an ASGI guard on the head's size.

uvicorn bounds a connection's idle time between requests (``timeout_keep_alive``) and the part
of a head it buffers (``h11_max_incomplete_event_size``), but not how long a client may take to
send a head, nor how many connections one address holds: a few dozen sockets that trickle
their heads would hold every connection (``limit_concurrency``) for good.
:func:`guarded_protocol` gives uvicorn a protocol class that closes a connection whose head is
not complete ``head_timeout`` seconds after it began, and refuses (closes at once) a
connection beyond ``max_connections_per_ip`` from one address. :class:`HeadLimit` answers a
head larger than ``max_header_bytes`` that arrived whole (h11's bound only sees incomplete
ones) with a 400 before any route, authentication included, reads it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvnotes.serving.front.errors import error_body


class ConnectionGuard:
    """The open connections by address, and the two bounds (shared by one server's
    connections; the event loop's thread only)."""

    def __init__(self, head_timeout: float, max_per_ip: int | None) -> None:
        self.head_timeout, self.max_per_ip = head_timeout, max_per_ip
        self.open: Counter[str] = Counter()
        self.refused = 0  # connections closed at once: over the per-address cap
        self.dropped = 0  # connections closed: their head never came whole in time

    def admit(self, address: str) -> bool:
        if self.max_per_ip is not None and self.open[address] >= self.max_per_ip:
            self.refused += 1
            return False
        self.open[address] += 1
        return True

    def leave(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol bounded by ``guard`` (pass it as ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _address = ""
        _admitted = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else ""
            self._admitted = guard.admit(self._address)
            if not self._admitted:
                self.transport.close()
                return
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._waiting_for_head():
                if self._head_timer is None:  # the next head on a kept-alive connection
                    self._await_head()
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self._admitted:
                self._admitted = False
                guard.leave(self._address)
            super().connection_lost(exc)

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _await_head(self) -> None:
            self._head_timer = self.loop.call_later(guard.head_timeout, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing() \
                    and self.timeout_keep_alive_task is None:
                guard.dropped += 1
                self.transport.close()

    return GuardedH11Protocol


class HeadLimit:
    """ASGI middleware: a request whose head (line and headers) is larger than ``limit``
    bytes is answered 400, before the app sees it."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ())
            if size > self.limit:
                body = json.dumps(error_body(400, f"the request's head is larger than "
                                             f"{self.limit} bytes (FrontConfig."
                                             "max_header_bytes)")).encode()
                await send({"type": "http.response.start", "status": 400, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
