"""``serve-bench fleet``'s ``soak``: clients through every host while the store and a host fail.

The agent soak's clients (:func:`~kvnotes_bench.serving.agent_traffic_soak.soak_clients`:
random subsets of a pool of BFCL ``live_multiple`` development tools, a fraction sent with
``splice: false``) send through :class:`FleetSender`, which routes request ``i`` to host
``i % hosts`` (so a tool learned through one host is requested through the others). Meanwhile
:func:`run_faults` does each fault of the schedule when its fraction of the requests has been
sent (:data:`FAULTS`):

- ``kill``, ``restart``, ``flush``: the ``redis-server`` SIGKILLed by its pid, restarted (empty:
  no persistence), flushed;
- ``pause``: ``DEBUG SLEEP 3`` once some host holds a compile lease (its publish follows), or
  after :data:`WAIT_S` without one;
- ``drop``: the loopback proxy between host ``b`` and Redis drops every reply for 30 s (the
  commands run; their replies and connections are lost), then passes again;
- ``evict``: ``maxmemory`` a few MiB above what the server uses, ``volatile-lru`` (the store
  refuses ``allkeys-*`` policies at connect: they may evict its bookkeeping), lifted after
  :data:`EVICT_HOLD_S` so that the rest of the soak measures recovery, not a full server;
- ``sigkill``: the last host's process group (front, learner, vLLM) SIGKILLed while it holds a
  compile lease (or after :data:`WAIT_S`); its later requests go to the next live host, and a
  request it dropped is sent once more (a load balancer's retry, counted).

Every answer is checked against the engine afterwards, as the agent soak checks it; the figures
are cut at each fault (:func:`windows`): requests, failed and wrong answers, and the hit rate
(spliced requests over requests sent after one of their tools had been seen ``sightings``
times). :func:`published_lost` counts the entries published after the last destructive fault
that the store lost. The fronts' store counters (``/metrics`` series naming ``store``,
``fleet`` or ``mirror``) are read before and after the soak (:func:`store_series`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
    from kvnotes_bench.serving.redis_proxy import DropProxy

FAULTS = ("kill", "restart", "flush", "pause", "drop", "evict", "sigkill")
# the goal soak: every fault once, Redis killed and restarted twice; the last destructive fault
# (a restart, a flush or an eviction empties entries) leaves a third of the soak to check that
# nothing published after it is lost
DEFAULT_FAULTS: tuple[tuple[str, float], ...] = (
    ("pause", 0.1), ("drop", 0.17), ("kill", 0.25), ("restart", 0.3), ("evict", 0.4),
    ("flush", 0.5), ("sigkill", 0.58), ("kill", 0.62), ("restart", 0.66))
DESTRUCTIVE = ("restart", "flush", "evict")  # may lose published entries (expected losses)
PAUSE_S = 3  # DEBUG SLEEP: the server answers nothing meanwhile
DROP_S = 30.0  # the proxy drops every reply to its host this long
EVICT_HOLD_S = 20.0  # the small maxmemory is kept this long, then lifted
EVICT_ROOM = 8 << 20  # bytes of maxmemory above what the server used at the fault
WAIT_S = 30.0  # a pause or a SIGKILL waits this long for a compile to be under way


def check_faults(faults: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """``faults`` as a tuple, checked: known names, fractions rising within (0, 1), a kill
    followed by a restart before any other fault (the others need a running server), one
    ``sigkill`` at most (one host is killed for good).

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
    if sum(name == "sigkill" for name, _ in out) > 1:
        raise InvalidArgumentError("fault sigkill: once at most (the host stays down)")
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
    wall: float | None = None  # time.time() when it happened
    detail: str | None = None  # how it was timed and done


def host_of(index: int, hosts: Sequence[str]) -> str:
    """The host :class:`FleetSender` routes request ``index`` to."""
    return hosts[index % len(hosts)]


class FleetSender:
    """A :class:`~kvnotes_bench.serving.agent_traffic_client.Sender` over several hosts:
    request ``soak-<i>`` goes to host ``i % hosts`` (any other id to the first host), or to the
    next live host when that one was killed (:meth:`kill`); a request that fails because its
    host died under it is sent once more to a live host (a load balancer's retry), counted in
    :attr:`rerouted`."""

    def __init__(self, senders: Mapping[str, OpenAISender]) -> None:
        self.senders = dict(senders)
        self.names = list(self.senders)
        self.dead: set[str] = set()
        self.started = self.done = self.rerouted = 0

    def kill(self, name: str) -> None:
        self.dead.add(name)

    def _pick(self, request: AgentRequest) -> str:
        _, _, tail = request.id.rpartition("-")
        index = int(tail) if tail.isdigit() else 0
        live = [n for n in self.names if n not in self.dead] or self.names
        first = host_of(index, self.names)
        return first if first in live else host_of(index, live)

    async def _go(self, request: AgentRequest, call: Callable[[OpenAISender], Awaitable[Answer]]
                  ) -> Answer:
        self.started += 1
        try:
            name = self._pick(request)
            answer = await call(self.senders[name])
            if not answer.ok and name in self.dead:
                self.rerouted += 1
                answer = await call(self.senders[self._pick(request)])
            return answer
        finally:
            self.done += 1

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        return await self._go(request, lambda s: s.send(request, splice=splice,
                                                        max_tokens=max_tokens))

    async def stream(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        return await self._go(request, lambda s: s.stream(request, splice=splice,
                                                          max_tokens=max_tokens))


@dataclass
class FaultKit:
    """What the faults act on: the Redis server, the proxy between one host and it (``drop``),
    the host that may be killed (``sigkill``: its name, ``kill()`` SIGKILLs its process group,
    ``busy()`` whether it holds a compile lease: a job queued or compiling)."""

    redis: RedisProcess
    proxy: DropProxy | None = None
    victim: str | None = None
    kill: Callable[[], None] | None = None
    busy: Callable[[], bool] | None = None


def _compiling(kit: FaultKit) -> bool:
    """Whether some host holds a compile lease (a compile queued or under way)."""
    client = kit.redis.client()
    try:
        return next(iter(client.scan_iter(match="*:lease:compile:*", count=1000)), None) is not None
    finally:
        client.close()


def _wait(until: Callable[[], bool], stop: asyncio.Event) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not stop.is_set():
        if until():
            return True
        time.sleep(0.05)
    return False


def _do(kit: FaultKit, name: str, sender: FleetSender, stop: asyncio.Event) -> str | None:
    """Fault ``name`` (in a worker thread); how it was done, when worth saying."""
    redis = kit.redis
    if name in ("kill", "restart", "flush"):
        {"kill": redis.stop, "restart": redis.start, "flush": redis.flushall}[name]()
        return None
    client = redis.client()
    try:
        if name == "pause":
            timed = _wait(lambda: _compiling(kit), stop)
            client.execute_command("DEBUG", "SLEEP", PAUSE_S)
            return (f"DEBUG SLEEP {PAUSE_S} " + ("once a compile lease was taken" if timed
                                                  else f"(no compile seen in {WAIT_S:g} s)"))
        if name == "drop":
            if kit.proxy is None:
                raise InvalidArgumentError("no host talks to Redis through the proxy")
            kit.proxy.drop_all_for(DROP_S)
            return f"every reply to its host dropped for {DROP_S:g} s"
        if name == "evict":
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "volatile-lru")
            client.config_set("maxmemory", used + EVICT_ROOM)
            threading.Timer(EVICT_HOLD_S, _lift, (redis,)).start()
            return (f"maxmemory {used + EVICT_ROOM} bytes (used + {EVICT_ROOM >> 20} MiB) with "
                    f"volatile-lru for {EVICT_HOLD_S:g} s, then lifted (allkeys-lru is refused "
                    "by the store at connect)")
    finally:
        client.close()
    if kit.kill is None or kit.victim is None:
        raise InvalidArgumentError("no host runs in a process of its own to be killed")
    victim, busy = kit.victim, kit.busy
    timed = busy is not None and _wait(busy, stop)
    sender.kill(victim)
    kit.kill()
    return (f"host {victim} (front and vLLM) SIGKILLed "
            + ("holding a compile lease" if timed else f"(no compile seen in {WAIT_S:g} s)"))


def _lift(redis: RedisProcess) -> None:
    try:
        client = redis.client()
        client.config_set("maxmemory", 0)
        client.close()
    except Exception:  # noqa: BLE001 -- the server was killed or restarted meanwhile: no limit
        pass


async def run_faults(kit: FaultKit, faults: Sequence[tuple[str, float]],
                     sender: FleetSender, total: int, t0: float, stop: asyncio.Event,
                     say: Any = lambda s: None, poll_s: float = 0.05) -> list[FaultEvent]:
    """Each fault once ``sender`` has sent its fraction of ``total`` requests; a fault not
    reached when ``stop`` is set is recorded as not done. The server is left running."""
    events = [FaultEvent(name, at) for name, at in faults]
    for event in events:
        while sender.started < event.at * total and not stop.is_set():
            await asyncio.sleep(poll_s)
        if stop.is_set() and sender.started < event.at * total:
            event.error = "the soak ended before it"
            continue
        event.at_s = round(time.monotonic() - t0, 3)
        event.at_request = sender.started
        event.wall = time.time()
        event.load = load_now()
        try:
            event.detail = await asyncio.to_thread(_do, kit, event.name, sender, stop)
            event.ok = True
        except Exception as err:  # noqa: BLE001  # a failed fault is recorded, the soak goes on
            event.error = f"{type(err).__name__}: {str(err)[:300]}"
        say(f"  [{event.at_s:6.1f} s] {event.name} after {event.at_request} requests"
            + (f": {event.detail}" if event.ok and event.detail else "")
            + ("" if event.ok else f": {event.error}"))
    if not kit.redis.alive:
        await asyncio.to_thread(kit.redis.start)
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
    compiled: int = 0  # eligible once one of its tools' entries is known to exist (see windows)
    compiled_spliced: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.spliced / self.eligible if self.eligible else None

    @property
    def hit_rate_compiled(self) -> float | None:
        """The goal's hit rate: over requests sent after one of their tools was compiled."""
        return self.compiled_spliced / self.compiled if self.compiled else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate,
                "hit_rate_compiled": self.hit_rate_compiled}


def compiled_by(records: Sequence[SoakRecord]) -> dict[str, float]:
    """Each tool's earliest proof that its entry existed in the fleet: the send time of the
    first request whose answer spliced an entry for every one of its tools (a lower bound on
    when the first compile was done: the compile itself finished earlier)."""
    out: dict[str, float] = {}
    for rec in sorted(records, key=lambda r: r.sent_s):
        plan = (rec.answer.kvnotes or {}).get("plan") or {}
        if rec.splice and rec.answer.ok and len(plan.get("entries") or []) == len(rec.tools):
            for tool in rec.tools:
                out.setdefault(tool, rec.sent_s)
    return out


def windows(records: Sequence[SoakRecord], events: Sequence[FaultEvent]) -> list[Window]:
    """The records cut at each fault that happened (by the time each request was sent).

    Two hit rates per window: over requests sent once one of their tools had been seen
    ``sightings`` times (``eligible``: compiled or not, so a request sent while its chunk is
    still compiling counts as a miss), and over requests sent once one of their tools was known
    to be compiled (``compiled``, :func:`compiled_by`: the goal's "after the first compile")."""
    done = sorted((e for e in events if e.at_s is not None), key=lambda e: e.at_s or 0.0)
    cuts = [("before the faults", 0.0)] + [(f"after {e.name} @{e.at:g}", e.at_s or 0.0)
                                           for e in done]
    out = [Window(label, start, cuts[i + 1][1] if i + 1 < len(cuts) else None)
           for i, (label, start) in enumerate(cuts)]
    compiled_at = compiled_by(records)
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
        if rec.answer.ok and rec.splice and any(compiled_at.get(t, rec.sent_s) < rec.sent_s
                                                for t in rec.tools):
            w.compiled += 1
            w.compiled_spliced += rec.answer.spliced_tokens > 0
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


def published_lost(url: str, events: Sequence[FaultEvent]) -> dict[str, Any]:
    """Entries the hosts published (the store's change feed: every ``put`` it took) after the
    last destructive fault that was done (:data:`DESTRUCTIVE`: those may lose entries, and are
    expected to) and not forgotten since, that the store no longer returns whole: ``lost``
    (goal 0), with the ``published`` checked and the keys lost (an eviction counts from the
    end of its hold). Read from the server at ``url`` while it still runs."""
    from kvnotes.serving.store.redis_data import text
    from kvnotes.serving.store.redis_store import RedisStore

    done = [e for e in events if e.ok and e.name in DESTRUCTIVE and e.wall is not None]
    since = max((e.wall + (EVICT_HOLD_S if e.name == "evict" else 0.0) for e in done
                 if e.wall is not None), default=0.0)
    store = RedisStore.connect(url)
    try:
        client: Any = store.client  # redis-py's replies are untyped
        put: dict[tuple[str, str, str | None], int] = {}
        for feed in client.scan_iter(match=f"{store.settings.prefix}:feed:*"):
            model = text(feed).rpartition(":feed:")[2]
            for row_id, row in client.xrange(feed, min=f"{int(since * 1000)}-0", max="+"):
                f = {text(k): text(v) for k, v in row.items()}
                entry = (model, f["key"], None if f["tenant"] == "~" else f["tenant"])
                if f["op"] == "put":
                    put[entry] = int(text(row_id).partition("-")[0])
                else:  # forgotten (the fleet's bounds): not a loss
                    put.pop(entry, None)
        lost = [f"{m}/{t or '~'}/{k}" for (m, k, t) in put if store.get(m, k, t) is None]
    finally:
        store.close()
    return {"since": since if done else None, "after": [e.name for e in done][-1:],
            "published": len(put), "lost": len(lost), "lost_keys": lost[:50]}
