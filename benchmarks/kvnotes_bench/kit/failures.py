"""How a failed request is classified, and failures counted by kind.

Kinds (:data:`ERROR_KINDS`): ``http_4xx``/``http_5xx``, the server refused; ``timeout``, no
answer in time; ``connection``, refused, dropped or cut short; ``stream``, an error event or an
unreadable chunk inside the stream. Exceptions are told apart by their classes' names, so
classifying needs neither openai nor httpx imported.

    >>> class APITimeoutError(Exception): ...
    >>> classify(APITimeoutError()).kind
    'timeout'
    >>> classify(ConnectionResetError("peer")).message
    'connection failed: ConnectionResetError: peer'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

ERROR_KINDS = ("http_4xx", "http_5xx", "timeout", "connection", "stream")
_TIMEOUTS = {"APITimeoutError", "TimeoutError", "TimeoutException"}
_CONNECTIONS = {"APIConnectionError", "ConnectionError"}


@dataclass(frozen=True)
class Failure:
    """A failed request: its kind (one of :data:`ERROR_KINDS`) and a one-line message."""

    kind: str
    message: str


def classify(err: BaseException) -> Failure:
    """The kind of a failed request and a message naming its cause."""
    names = {c.__name__ for c in type(err).__mro__}
    if names & _TIMEOUTS:
        return Failure("timeout", f"timed out ({type(err).__name__})")
    status = getattr(err, "status_code", None)
    if isinstance(status, int):
        message = str(getattr(err, "message", err))[:300]
        return Failure("http_5xx" if status >= 500 else "http_4xx", f"HTTP {status}: {message}")
    if names & _CONNECTIONS:
        cause = err.__cause__ or err
        return Failure("connection",
                       f"connection failed: {type(cause).__name__}: {cause}"[:400])
    if "TransportError" in names:  # httpx: dropped while streaming
        return Failure("connection", f"connection dropped: {type(err).__name__}: {err}"[:400])
    if "APIError" in names:  # openai: an error event inside the stream
        message = str(getattr(err, "message", err))[:300]
        return Failure("stream", f"server error in stream: {message}")
    return Failure("stream", f"{type(err).__name__}: {err}"[:400])


class Failed(Protocol):
    """What :func:`count_kinds` reads from a failed outcome."""

    @property
    def error_kind(self) -> str | None: ...


def count_kinds(failed: Iterable[Failed]) -> dict[str, int]:
    """Failed outcomes counted by ``error_kind`` ("other" when a record has none)."""
    out: dict[str, int] = {}
    for o in failed:
        key = o.error_kind or "other"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
