"""``serve-bench fleet``'s ``soak``: clients through both hosts while the store fails.

The agent soak's clients (:func:`~kvnotes_bench.serving.agent_traffic_soak.soak_clients`:
random subsets of a pool of BFCL ``live_multiple`` development tools, a fraction sent with
``splice: false``) send through :class:`FleetSender`, which routes request ``i`` to host
``i % hosts`` (so a tool learned through one host is requested through the other). Meanwhile
:func:`run_faults` kills the ``redis-server`` (SIGKILL, by its pid), restarts it (empty: no
persistence) and flushes it, each when the given fraction of the requests has been sent. Every
answer is checked against the engine afterwards, as the agent soak checks it; the figures are
cut at each fault (:func:`windows`): requests, failed and wrong answers, and the hit rate
(spliced requests over requests sent after one of their tools had been seen ``sightings``
times) before and after it. The fronts' store counters (``/metrics`` series naming ``store``,
``fleet`` or ``mirror``) are read before and after the soak (:func:`store_series`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.kit.machine import load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_client import Answer

if TYPE_CHECKING:
    from kvnotes.serving.store.redis_process import RedisProcess
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender
    from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
    from kvnotes_bench.serving.agent_traffic_soak import SoakRecord

FAULTS = ("kill", "restart", "flush")
# killed and restarted twice, flushed once, at these fractions of the requests sent
DEFAULT_FAULTS: tuple[tuple[str, float], ...] = (
    ("kill", 0.15), ("restart", 0.25), ("flush", 0.45), ("kill", 0.65), ("restart", 0.75))


def check_faults(faults: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """``faults`` as a tuple, checked: known names, fractions rising within (0, 1), a kill
    followed by a restart before the next kill or flush (a flush needs a running server).

    Example:
        >>> check_faults([("kill", 0.2), ("restart", 0.4)])
        (('kill', 0.2), ('restart', 0.4))
    """
    out = tuple((str(name), float(at)) for name, at in faults)
    down, last = False, 0.0
    for name, at in out:
        if name not in FAULTS:
            raise InvalidArgumentError(f"fault {name!r}: use one of {', '.join(FAULTS)}")
        if not last < at < 1.0:
            raise InvalidArgumentError(f"fault {name}@{at}: give rising fractions of the "
                                       "requests within (0, 1)")
        if name == "restart" and not down:
            raise InvalidArgumentError(f"fault restart@{at}: restart follows a kill")
        if name != "restart" and down:
            raise InvalidArgumentError(f"fault {name}@{at}: the server is down (killed); "
                                       "restart it first")
        down = name == "kill"
        last = at
    return out


def parse_faults(text: str) -> tuple[tuple[str, float], ...]:
    """``kill@0.15,restart@0.25,...`` as fault steps (:func:`check_faults`).

    Example:
        >>> parse_faults("kill@0.2,restart@0.3,flush@0.5")
        (('kill', 0.2), ('restart', 0.3), ('flush', 0.5))
    """
    steps = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, at = part.partition("@")
        try:
            steps.append((name, float(at)))
        except ValueError as err:
            raise InvalidArgumentError(f"fault {part!r}: spell it NAME@FRACTION, e.g. "
                                       "kill@0.2") from err
    return check_faults(steps)


@dataclass
class FaultEvent(Record):
    """One fault as it happened (``ok`` False: it failed, or the soak ended first)."""

    name: str
    at: float  # the planned fraction of the requests sent
    at_s: float | None = None  # seconds into the soak
    at_request: int | None = None  # requests sent when it happened
    ok: bool = False
    error: str | None = None
    load: list[float] = field(default_factory=list)


def host_of(index: int, hosts: Sequence[str]) -> str:
    """The host :class:`FleetSender` routes request ``index`` to."""
    return hosts[index % len(hosts)]


class FleetSender:
    """A :class:`~kvnotes_bench.serving.agent_traffic_client.Sender` over several hosts:
    request ``soak-<i>`` goes to host ``i % hosts`` (any other id to the first host)."""

    def __init__(self, senders: Mapping[str, OpenAISender]) -> None:
        self.senders = dict(senders)
        self.names = list(self.senders)
        self.started = 0
        self.done = 0

    def _pick(self, request: AgentRequest) -> OpenAISender:
        _, _, tail = request.id.rpartition("-")
        index = int(tail) if tail.isdigit() else 0
        return self.senders[host_of(index, self.names)]

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        self.started += 1
        try:
            return await self._pick(request).send(request, splice=splice, max_tokens=max_tokens)
        finally:
            self.done += 1

    async def stream(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        self.started += 1
        try:
            return await self._pick(request).stream(request, splice=splice,
                                                    max_tokens=max_tokens)
        finally:
            self.done += 1


async def run_faults(redis_server: RedisProcess, faults: Sequence[tuple[str, float]],
                     sender: FleetSender, total: int, t0: float, stop: asyncio.Event,
                     say: Any = lambda s: None, poll_s: float = 0.05) -> list[FaultEvent]:
    """Each fault once ``sender`` has sent its fraction of ``total`` requests; a fault not
    reached when ``stop`` is set is recorded as not done. The server is left running."""
    events = [FaultEvent(name, at) for name, at in faults]
    actions = {"kill": redis_server.stop, "restart": redis_server.start,
               "flush": redis_server.flushall}
    for event in events:
        while sender.started < event.at * total and not stop.is_set():
            await asyncio.sleep(poll_s)
        if stop.is_set() and sender.started < event.at * total:
            event.error = "the soak ended before it"
            continue
        event.at_s = round(time.monotonic() - t0, 3)
        event.at_request = sender.started
        event.load = load_now()
        try:
            await asyncio.to_thread(actions[event.name])
            event.ok = True
        except Exception as err:  # noqa: BLE001  # a failed fault is recorded, the soak goes on
            event.error = f"{type(err).__name__}: {str(err)[:300]}"
        say(f"  [{event.at_s:6.1f} s] redis {event.name} after {event.at_request} requests"
            + ("" if event.ok else f": {event.error}"))
    if not redis_server.alive:
        await asyncio.to_thread(redis_server.start)
    return events


# ---- the figures per window ---------------------------------------------------------------------
@dataclass
class Window:
    """The soak's requests sent between two faults."""

    label: str
    start_s: float
    end_s: float | None
    requests: int = 0
    failed: int = 0
    wrong: int = 0
    unchecked: int = 0
    eligible: int = 0
    spliced: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.spliced / self.eligible if self.eligible else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


def windows(records: Sequence[SoakRecord], events: Sequence[FaultEvent]) -> list[Window]:
    """The records cut at each fault that happened (by the time each request was sent)."""
    done = sorted((e for e in events if e.at_s is not None), key=lambda e: e.at_s or 0.0)
    cuts = [("before the faults", 0.0)] + [(f"after {e.name} @{e.at:g}", e.at_s or 0.0)
                                           for e in done]
    out = [Window(label, start, cuts[i + 1][1] if i + 1 < len(cuts) else None)
           for i, (label, start) in enumerate(cuts)]
    for rec in records:
        w = next(w for w in reversed(out) if rec.sent_s >= w.start_s)
        w.requests += 1
        status = (rec.verdict or {}).get("status")
        if not rec.answer.ok:
            w.failed += 1
        elif status == "wrong":
            w.wrong += 1
        elif status in (None, "unchecked"):
            w.unchecked += 1
        if rec.answer.ok and rec.eligible:
            w.eligible += 1
            w.spliced += rec.answer.spliced_tokens > 0
    return out


def store_series(metrics_text: str) -> dict[str, float]:
    """A front's ``/metrics`` series that name the store, the fleet or the mirror (faults,
    publishes and adoptions, fetches), summed over labels."""
    from kvnotes_bench.serving.metrics import parse_prometheus

    return {name: value for name, value in parse_prometheus(metrics_text).items()
            if any(w in name for w in ("store", "fleet", "mirror"))
            and not name.endswith("_created")}


def series_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each series grew by (counters); series that did not change are left out."""
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)
            if after[k] != before.get(k, 0.0)}
