"""A request's admission: its in-flight slot, its counting and its outcome, as one context.

``async with Admission(slots, call):`` takes one of ``slots``' places (429 when none is free,
counted as ``rejected``) and, however the block ends (an answer, an error the front answers,
an exception anywhere, the client leaving, a stream cancelled), gives the place back and
finishes the call once: its leases released, its outcome counted, its log line written. The
slot is given back before anything else of the ending can fail, so no path leaks one.

Example:
    >>> import asyncio
    >>> from kvnotes.serving.front.call import Call
    >>> slots = Slots(1)
    >>> async def one() -> int:
    ...     async with Admission(slots, Call("chat", "r1")):
    ...         return slots.in_flight
    >>> asyncio.run(one()), slots.in_flight
    (1, 0)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType

from kvnotes.serving.front.call import Call
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.protocol import Outcome

log = logging.getLogger("kvnotes.serving.front")


class Slots:
    """The places for requests in flight (``FrontConfig.max_concurrent`` of them);
    ``on_change(+1 | -1)`` follows each change (the in-flight gauge)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        self.limit, self.in_flight = limit, 0
        self._on_change = on_change

    def take(self) -> bool:
        if self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        self._changed(1)
        return True

    def give_back(self) -> None:
        self.in_flight -= 1
        self._changed(-1)

    def _changed(self, delta: int) -> None:
        if self._on_change is not None:
            try:
                self._on_change(delta)
            except Exception:  # noqa: BLE001 -- a gauge that fails never holds a slot
                log.exception("the in-flight gauge failed")


class Admission:
    """One request's slot and ending (see the module docstring).

    Args:
        slots: where its place is taken from.
        call: its record; ``finish(call)`` is called once at the end (counting, log line,
            leases), after the slot is back.
        finish: the call's ending (default: nothing beyond the slot).
        rejected: called instead when no place is free (before the 429 is raised).
    """

    def __init__(self, slots: Slots, call: Call, finish: Callable[[Call], None] | None = None,
                 rejected: Callable[[Call], None] | None = None) -> None:
        self.slots, self.call = slots, call
        self._finish, self._rejected = finish, rejected
        self._held = False

    async def __aenter__(self) -> Admission:
        if not self.slots.take():
            if self._rejected is not None:
                self._rejected(self.call)
            raise ApiError(429, f"the front is serving {self.slots.limit} requests "
                           "(FrontConfig.max_concurrent): retry later")
        self._held = True
        return self

    def release(self) -> None:
        """Give the slot back and finish the call (once; idempotent)."""
        if self._held:
            self._held = False
            self.slots.give_back()
        if not self.call.finished and self._finish is not None:
            try:
                self._finish(self.call)
            except Exception:  # noqa: BLE001 -- counting never turns an answer into a failure
                log.exception("request %s: its ending was not counted", self.call.id)

    async def __aexit__(self, kind: type[BaseException] | None, err: BaseException | None,
                        tb: TracebackType | None) -> None:
        if isinstance(err, asyncio.CancelledError) and not self.call.finished:
            self.call.outcome = Outcome.DISCONNECTED
        elif err is not None and not self.call.finished:
            if not isinstance(err, ApiError):
                self.call.outcome = Outcome.INTERNAL_ERROR
            elif not self.call.outcome:
                self.call.outcome = (Outcome.BAD_REQUEST if err.status < 500
                                     else Outcome.UPSTREAM_ERROR)
        self.release()
