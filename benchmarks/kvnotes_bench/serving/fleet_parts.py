"""``serve-bench fleet``'s ``share`` and ``cost`` parts: one library across two hosts, and what
the shared store costs a request.

``share`` (:func:`share_case`): a BFCL ``live_multiple`` development tool list is sent twice
through host A (its chunks are counted in the shared store and compiled once, by A); once the
compiled entries are in host B's folder (its mirror fetched them), B's first request with the
same tools is measured against the same request with ``splice: false`` on B: the share of prompt
tokens spliced, whether the greedy answers are identical, and the compiles of both fronts.

``cost``: streamed TTFT of those requests (their entries local on every host) at each
concurrency, p90 per round, through a host on the Redis store and through a host on its own
folder (:func:`ttft_round`); the fetch cost per MB of the store's entries (:func:`fetch_cost`, a
``get`` of each, timed here, beside the mirror's own :class:`~kvnotes.serving.store.MirrorStats`
as the front reports them, :func:`mirror_counts`); a miss's TTFT against ``splice: false`` is
:func:`~kvnotes_bench.serving.agent_traffic_overhead.miss_overhead`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvnotes_bench.kit.records import Record
from kvnotes_bench.kit.stats import bootstrap_ci, median, percentile
from kvnotes_bench.serving.agent_traffic_client import Answer

if TYPE_CHECKING:
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender
    from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

SHARE_GOAL = 0.5  # of prompt tokens spliced on host B's first request
TTFT_GOAL = 0.10  # p90 TTFT through Redis over the folder store's, minus one
MISS_GOAL = 0.05  # a miss's TTFT over splice: false, minus one
MIRROR_KEYS = ("fetched", "fetched_bytes", "fetch_s")  # MirrorStats, as a front reports it


# ---- what a front says ------------------------------------------------------------------------
def front_stats(url: str) -> dict[str, Any] | None:
    """A front's ``/kvnotes/stats`` (None: it did not answer)."""
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.vllm_endpoints import Client

    try:
        data = Client(url, timeout=10.0).get_json("/kvnotes/stats")
    except (KvnotesError, OSError):
        return None
    return data if isinstance(data, dict) else None


def find_mirror(stats: Any) -> dict[str, Any] | None:
    """The mirror's counters (a mapping holding every one of :data:`MIRROR_KEYS`) anywhere in a
    front's stats, or None when it reports none."""
    if isinstance(stats, Mapping):
        if all(k in stats for k in MIRROR_KEYS):
            return dict(stats)
        for value in stats.values():
            found = find_mirror(value)
            if found is not None:
                return found
    return None


def mirror_counts(url: str) -> dict[str, Any]:
    """A host's mirror counters: from ``/kvnotes/stats`` when it reports them (with the fetch
    time), else ``fetched`` and ``fetched_bytes`` from its ``/metrics``
    (``kvnotes_front_mirror_*_total``); empty when neither says."""
    found = find_mirror(front_stats(url))
    if found is not None:
        return found
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.vllm_endpoints import Client
    from kvnotes_bench.serving.metrics import parse_prometheus

    try:
        series = parse_prometheus(Client(url, timeout=10.0).metrics_text())
    except (KvnotesError, OSError):
        return {}
    return {k: series[f"kvnotes_front_mirror_{k}_total"] for k in MIRROR_KEYS[:2]
            if f"kvnotes_front_mirror_{k}_total" in series}


def learner_counts(stats: Mapping[str, Any] | None) -> dict[str, int]:
    learner = (stats or {}).get("learner")
    return {str(k): int(v) for k, v in (learner or {}).items() if isinstance(v, int)}


def entry_names(folder: Path) -> set[str]:
    """The entries under a serving root (any depth), by file stem (their key)."""
    if not folder.is_dir():
        return set()
    return {p.stem for p in folder.rglob("*.safetensors") if not p.name.startswith(".")}


def same_answer(a: Answer, b: Answer) -> bool | None:
    """Whether two greedy answers are identical: their token strings when both carry log-probs,
    else their text (None: one failed)."""
    if not (a.ok and b.ok):
        return None
    if a.tokens and b.tokens:
        return a.tokens == b.tokens
    return a.text == b.text


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float,
                   poll_s: float = 0.5) -> tuple[bool, float]:
    """``(met, seconds waited)``: poll ``check`` until it holds or ``timeout_s`` passes."""
    t0 = time.monotonic()
    while True:
        if await check():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout_s:
            return False, time.monotonic() - t0
        await asyncio.sleep(poll_s)


# ---- share --------------------------------------------------------------------------------------
@dataclass
class HostView:
    """What a part needs of one launched host: its name, front URL, serving root and client."""

    name: str
    url: str
    skills: Path
    sender: OpenAISender


@dataclass
class ShareCase:
    """One tool list: learned through host A, then host B's first request with it."""

    id: str
    tools: int
    expected: int  # new learnable chunks of the list (one compile each, fleet-wide)
    learned: bool
    learn_wait_s: float
    mirrored: bool  # every new entry was in B's folder before B's request
    mirror_wait_s: float
    compiles: dict[str, int]  # per host: entries compiled during the case
    first: Answer  # host B's first request with the tools
    exact: Answer  # the same on host B with splice: false

    @property
    def share(self) -> float | None:
        a = self.first
        return a.spliced_tokens / a.prompt_tokens if a.ok and a.prompt_tokens else None

    @property
    def identical(self) -> bool | None:
        return same_answer(self.first, self.exact)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(first=self.first.to_dict(), exact=self.exact.to_dict(), share=self.share,
                   identical=self.identical)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShareCase:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["first"], kw["exact"] = Answer.from_dict(d["first"]), Answer.from_dict(d["exact"])
        return cls(**kw)


@dataclass(frozen=True)
class ShareSettings:
    sightings: int = 2
    max_tokens: int = 16
    min_tokens: int = 32  # the front's LearnConfig.min_tokens
    learn_timeout_s: float = 120.0
    mirror_timeout_s: float = 60.0
    poll_s: float = 0.5
    settle_s: float = 1.0  # after the entries reached b's folder, for its catalog's rescan


async def _compiles(hosts: Sequence[HostView]) -> dict[str, dict[str, int]]:
    return {h.name: learner_counts(await asyncio.to_thread(front_stats, h.url)) for h in hosts}


def _delta(after: Mapping[str, Mapping[str, int]], before: Mapping[str, Mapping[str, int]],
           name: str = "compiles") -> dict[str, int]:
    return {h: after[h].get(name, 0) - before.get(h, {}).get(name, 0) for h in after}


async def share_case(a: HostView, b: HostView, request: AgentRequest, settings: ShareSettings,
                     learnable: Callable[[AgentRequest], Sequence[tuple[int, ...]]],
                     known: set[tuple[int, ...]]) -> ShareCase:
    """One tool list through the protocol of the module docstring; ``known``: chunks earlier
    cases learned (updated here)."""
    chunks = {c for c in learnable(request) if len(c) >= settings.min_tokens}
    new = chunks - known
    hosts = (a, b)
    before = await _compiles(hosts)
    names_a = entry_names(a.skills)
    fetched_b = await asyncio.to_thread(mirror_counts, b.url)
    for _ in range(settings.sightings):
        await a.sender.send(request, splice=True, max_tokens=1)

    async def compiled() -> bool:
        now = await _compiles(hosts)
        done = sum(_delta(now, before).values()) >= len(new)
        return done or sum(_delta(now, before, "failures").values()) > 0

    met, waited = await wait_for(compiled, settings.learn_timeout_s, settings.poll_s)
    learned = met and sum(_delta(await _compiles(hosts), before, "failures").values()) == 0
    fresh = entry_names(a.skills) - names_a

    async def local_on_b() -> bool:
        if fresh <= entry_names(b.skills):
            return True
        stats = await asyncio.to_thread(mirror_counts, b.url)
        return int(stats.get("fetched", 0)) - int(fetched_b.get("fetched", 0)) >= len(fresh)

    mirrored, mirror_wait = await wait_for(local_on_b, settings.mirror_timeout_s,
                                           settings.poll_s)
    if fresh:  # the mirror's write is seen here before b's catalog has rescanned
        await asyncio.sleep(settings.settle_s)
    known |= new
    first = await b.sender.send(request, splice=True, max_tokens=settings.max_tokens)
    exact = await b.sender.send(request, splice=False, max_tokens=settings.max_tokens)
    return ShareCase(id=request.id, tools=len(request.chunks), expected=len(new),
                     learned=learned, learn_wait_s=round(waited, 3), mirrored=mirrored,
                     mirror_wait_s=round(mirror_wait, 3),
                     compiles=_delta(await _compiles(hosts), before), first=first, exact=exact)


async def fleet_compiles(hosts: Sequence[HostView], settle_s: float = 3.0
                         ) -> dict[str, dict[str, int]]:
    """Every front's learner counters, read after ``settle_s`` (a late compile is counted)."""
    await asyncio.sleep(settle_s)
    return await _compiles(hosts)


# ---- cost ---------------------------------------------------------------------------------------
@dataclass
class TtftRun(Record):
    """One store at one concurrency: per round, the p90 TTFT of its requests."""

    store: str  # "redis" or "folder"
    concurrency: int
    p90s: list[float] = field(default_factory=list)
    failed: int = 0
    spliced_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def median_p90_s(self) -> float | None:
        return median(self.p90s)

    @property
    def median_p90_ci_s(self) -> tuple[float, float] | None:
        """The 95% bootstrap interval of :attr:`median_p90_s` over rounds: two servers on a
        shared CPU make one round's p90 noisy, and the goal is judged on the median."""
        return bootstrap_ci(self.p90s, np.median)

    @property
    def share(self) -> float | None:
        return self.spliced_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median_p90_s": self.median_p90_s,
                "median_p90_ci_s": self.median_p90_ci_s, "share": self.share}


async def ttft_round(sender: OpenAISender, requests: Sequence[AgentRequest], concurrency: int,
                     run: TtftRun, *, max_tokens: int = 4) -> None:
    """Every request once, streamed and spliced, ``concurrency`` at a time; the round's p90
    TTFT is appended to ``run``."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(request: AgentRequest) -> None:
        async with gate:
            answer = await sender.stream(request, splice=True, max_tokens=max_tokens)
        if not answer.ok or answer.ttft_s is None:
            run.failed += 1
            return
        ttfts.append(answer.ttft_s)
        run.spliced_tokens += answer.spliced_tokens
        run.prompt_tokens += answer.prompt_tokens or 0

    await asyncio.gather(*(one(r) for r in requests))
    value = percentile(ttfts, 90)
    if value is not None:
        run.p90s.append(value)


def ttft_overhead(runs: Sequence[TtftRun], concurrency: int) -> float | None:
    """The Redis store's median p90 over the folder store's at ``concurrency``, minus one."""
    by = {r.store: r.median_p90_s for r in runs if r.concurrency == concurrency}
    redis, folder = by.get("redis"), by.get("folder")
    return redis / folder - 1 if redis is not None and folder else None


@dataclass
class FetchCost(Record):
    """What fetching entries from the store costs: a timed ``get`` of each from here, and the
    host's mirror counters (None: its front reports none)."""

    entries: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: int = 0
    mirror: dict[str, Any] | None = None

    @property
    def s_per_mb(self) -> float | None:
        return self.seconds / (self.bytes / 1e6) if self.bytes else None

    @property
    def mirror_s_per_mb(self) -> float | None:
        """The mirror's own seconds per MB fetched (None: it reports no fetch time)."""
        m = self.mirror or {}
        size = float(m.get("fetched_bytes") or 0)
        seconds = m.get("fetch_s")
        return float(seconds) / (size / 1e6) if size and seconds is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "s_per_mb": self.s_per_mb,
                "mirror_s_per_mb": self.mirror_s_per_mb}


def fetch_cost(url: str, mirror: dict[str, Any] | None = None) -> FetchCost:
    """A timed ``get`` of every entry the store at ``url`` holds (of every model and tenant)."""
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.store import store_from_url

    cost = FetchCost(mirror=mirror)
    store = store_from_url(url)
    try:
        for model in store.models():
            for info in store.list(model, every=True):
                t0 = time.perf_counter()
                try:
                    entry = store.get(model, info.key, info.tenant)
                except KvnotesError:
                    entry = None
                if entry is None:
                    cost.failed += 1
                    continue
                cost.seconds += time.perf_counter() - t0
                cost.entries += 1
                cost.bytes += len(entry.data)
    finally:
        store.close()
    return cost
