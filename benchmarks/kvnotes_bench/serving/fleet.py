"""``kvnotes-bench serve fleet``: kvnotes hosts (three by default) over one Redis store, what
the shared store gives a fleet and what it costs.

One ``redis-server`` is started here on a free loopback port
(:class:`~kvnotes.serving.store.redis_process.RedisProcess`, stopped by its pid at the end) and
``hosts`` hosts ``a``, ``b``, ... are launched (:mod:`kvnotes.serving.launch.launcher`), each
a vLLM server with kvnotes' connector over its own local folder and the OpenAI front learning
on sight (``kvnotes serve --learn --store redis://...``) with the same store. Three parts, each optional:

- ``share`` (:mod:`~kvnotes_bench.serving.fleet_parts`): BFCL ``live_multiple`` development tool
  lists seen twice through host A, then host B's first request with the same tools: the share of
  prompt tokens spliced on B, whether its answer is identical to ``splice: false`` on B, the
  compiles of both fronts (goal: >= 50% spliced, identical, one compile per new chunk for the
  fleet);
- ``cost``: p90 TTFT (median over rounds) through host B on the Redis store against a third
  host on a copy of B's folder as a plain folder store (``kvnotes serve --learn`` without
  ``--store``), rounds alternating, at each concurrency, once the entries are local (goal:
  within 10%); the fetch cost per MB of the store's entries; a miss's TTFT on host B against
  ``splice: false`` (goal: <= 5% over);
- ``soak`` (:mod:`~kvnotes_bench.serving.fleet_soak`): clients through every host while Redis
  fails: killed and restarted, flushed, paused 3 s as a compile starts, its replies to host
  ``b`` dropped for 30 s (``b`` talks to it through a loopback proxy), a small ``maxmemory``
  (``volatile-lru``: the store refuses ``allkeys-*`` at connect), and the last host SIGKILLed
  with a compile under way (it runs in a process group of its own,
  :mod:`~kvnotes_bench.serving.fleet_host`); every answer checked against the engine as the
  agent soak checks it; failed and wrong answers, the hit rate per window between faults, and
  the entries published after the last destructive fault that the store lost (goal: 0 failed,
  0 wrong, 0 lost, hit rate >= 90% in every window).

The fronts run without a guard (the soak's answers are checked against the engine's splice).
The result (:class:`FleetResult`) records the date, the command, the machine and its load, the
torch threads, the Redis server and the launched servers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving.agent_traffic_overhead import Timing
from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig, SoakRecord, SoakSummary
from kvnotes_bench.serving.fleet_parts import FetchCost, ShareCase, TtftRun
from kvnotes_bench.serving.fleet_soak import DEFAULT_FAULTS, FaultEvent, check_faults

if TYPE_CHECKING:
    from kvnotes.serving.front.config import FrontConfig
    from kvnotes.serving.launch.launcher import LaunchConfig

PARTS = ("share", "cost", "soak")
HOSTS = ("a", "b")  # the share and cost parts' hosts (the first two of the fleet)
# FrontConfig's (or LearnConfig's) shared-store URL, as the fleet wiring may name it
STORE_FIELDS = ("store", "store_url")


@dataclass(frozen=True)
class FleetBenchConfig:
    """What ``serve-bench fleet`` runs.

    Args:
        model: the model alias (its served name once launched).
        parts: which of :data:`PARTS` run (``cost`` times the ``share`` part's requests, so it
            runs ``share`` too).
        cases: BFCL ``live_multiple`` development tool lists of the ``share`` part.
        max_context: tool lists longer than this (tokens of the request's text) are left out.
        sightings: the fronts' ``--learn-after``.
        max_tokens: greedy tokens of each measured answer.
        learn_timeout_s: how long a case waits for its chunks to be compiled.
        mirror_timeout_s: how long it then waits for them to reach host B's folder.
        concurrency: the ``cost`` part's concurrency levels.
        rounds: timing rounds per store and concurrency (each sends every request
            ``per_round`` times).
        per_round: how many times a round sends each request.
        miss_repeats: pairs of the miss timing.
        hosts: hosts of the fleet (>= 2; request ``i`` of the soak goes to host ``i % hosts``).
        soak: the soak's traffic (its ``requests`` in all, through every host).
        soak_cases: the development cases whose tools make the soak's pool.
        faults: ``(name, fraction of the soak's requests sent)`` in order, a name of
            :data:`~kvnotes_bench.serving.fleet_soak.FAULTS`.
    """

    model: str = "smollm2-135m"
    parts: tuple[str, ...] = PARTS
    cases: int = 8
    max_context: int = 3500
    sightings: int = 2
    max_tokens: int = 16
    learn_timeout_s: float = 120.0
    mirror_timeout_s: float = 60.0
    concurrency: tuple[int, ...] = (1, 4)
    rounds: int = 5
    per_round: int = 2
    miss_repeats: int = 10
    hosts: int = 3
    soak: AgentSoakConfig = field(default_factory=lambda: AgentSoakConfig(requests=120))
    soak_cases: int = 40
    faults: tuple[tuple[str, float], ...] = DEFAULT_FAULTS

    def __post_init__(self) -> None:
        unknown = set(self.parts) - set(PARTS)
        if unknown or not self.parts:
            raise InvalidArgumentError(f"--parts {','.join(self.parts)}: use some of "
                                       f"{', '.join(PARTS)}")
        if "cost" in self.parts and "share" not in self.parts:  # cost times share's requests
            object.__setattr__(self, "parts", tuple(p for p in PARTS
                                                    if p in (*self.parts, "share")))
        if self.cases < 1 or self.soak_cases < 1:
            raise InvalidArgumentError("--cases and --soak-cases must be >= 1")
        if self.sightings < 1 or self.max_tokens < 1:
            raise InvalidArgumentError("--learn-after and --max-tokens must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError("--concurrency: positive integers, e.g. 1,4")
        if self.rounds < 1 or self.per_round < 1 or self.miss_repeats < 1:
            raise InvalidArgumentError("--rounds, --per-round and --miss-repeats must be >= 1")
        if self.learn_timeout_s <= 0 or self.mirror_timeout_s <= 0:
            raise InvalidArgumentError("the learning and mirror timeouts must be positive")
        object.__setattr__(self, "faults", check_faults(self.faults))
        if self.hosts < 2 + ("sigkill" in dict(self.faults)):
            raise InvalidArgumentError("--hosts: at least 2 (3 with a sigkill fault: one host "
                                       "is killed, two go on)")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["faults"] = [list(f) for f in self.faults]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FleetBenchConfig:
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        for name in ("parts", "concurrency"):
            if name in kw:
                kw[name] = tuple(kw[name])
        if "faults" in kw:
            kw["faults"] = tuple((str(n), float(a)) for n, a in kw["faults"])
        if isinstance(kw.get("soak"), dict):
            kw["soak"] = AgentSoakConfig(**kw["soak"])
        return cls(**kw)


# ---- the hosts ----------------------------------------------------------------------------------
def with_store(front: FrontConfig, url: str) -> FrontConfig:
    """``front`` serving its library from the shared store at ``url`` (``kvnotes serve
    --store URL``): the store field of the front's settings, or of its learning settings.

    Raises:
        InvalidArgumentError: this kvnotes' front has no store setting.
    """
    def store_field(settings: Any) -> str | None:
        names = {f.name for f in dataclasses.fields(settings)} if settings is not None else ()
        return next((n for n in STORE_FIELDS if n in names), None)

    change: dict[str, Any]  # a field the fleet wiring adds
    if (name := store_field(front)) is not None:
        change = {name: url}
        return dataclasses.replace(front, **change)
    if front.learn is not None and (name := store_field(front.learn)) is not None:
        change = {name: url}
        return dataclasses.replace(front, learn=dataclasses.replace(front.learn, **change))
    raise InvalidArgumentError("this kvnotes' front has no shared-store setting "
                               f"(FrontConfig.{STORE_FIELDS[0]}): serve-bench fleet needs the "
                               "fleet wiring of `kvnotes serve --store`")


def check_fleet_wiring() -> None:
    """Fail before anything starts when this kvnotes' front cannot take a shared store."""
    from kvnotes.serving.front.config import FrontConfig, LearnConfig

    with_store(FrontConfig(learn=LearnConfig()), "redis://127.0.0.1:6379/0")


def host_config(base: LaunchConfig, folder: Path, sightings: int, timeout: float,
                store_url: str | None) -> LaunchConfig:
    """One host: ``base`` with the connector over ``folder/skills``, the front learning on
    sight with no guard, on the store at ``store_url`` (None: its folder), its log in
    ``folder``."""
    from kvnotes_bench.serving.agent_traffic import learning_launch

    config = learning_launch(dataclasses.replace(base, log_path=folder / "server.log"),
                             folder / "skills", after=sightings, timeout=timeout, guard=0.0)
    if store_url is None:
        return config
    assert config.front is not None  # learning_launch sets the front
    return dataclasses.replace(config, front=with_store(config.front, store_url))


# ---- the result ---------------------------------------------------------------------------------
@dataclass
class FleetResult:
    """Everything one ``serve-bench fleet`` run measured; :meth:`to_dict` is its JSON."""

    config: FleetBenchConfig
    machine: MachineRecord
    started: str = ""
    finished: str = ""
    command: str = ""
    threads: dict[str, int] = field(default_factory=dict)
    redis: dict[str, Any] = field(default_factory=dict)  # version, port, pids
    launches: dict[str, Any] = field(default_factory=dict)  # "a", "b", "folder": LaunchRecord
    skipped: list[dict[str, Any]] = field(default_factory=list)
    share: list[ShareCase] = field(default_factory=list)
    compiles: dict[str, dict[str, int]] = field(default_factory=dict)  # learner counters, end
    ttft: list[TtftRun] = field(default_factory=list)
    fetch: FetchCost | None = None
    miss: Timing | None = None
    soak_records: list[SoakRecord] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    soak: dict[str, Any] = field(default_factory=dict)  # wall, pool, store series deltas
    # the fronts' store, fleet and mirror series (/metrics) at a moment ("after_share"), by host
    series: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def soak_summary(self) -> SoakSummary | None:
        from kvnotes_bench.serving.agent_traffic_soak import summarize

        return summarize(self.soak_records) if self.soak_records else None

    def to_dict(self) -> dict[str, Any]:
        from kvnotes_bench.serving.fleet_summary import goals, share_summary, soak_windows

        summary = self.soak_summary()
        return {"workload": "fleet", "config": self.config.to_dict(), "started": self.started,
                "finished": self.finished, "command": self.command,
                "machine": self.machine.to_dict(), "threads": self.threads,
                "redis": self.redis, "launches": self.launches, "skipped": self.skipped,
                "goals": goals(self), "share_summary": share_summary(self),
                "share": [c.to_dict() for c in self.share], "compiles": self.compiles,
                "ttft": [r.to_dict() for r in self.ttft],
                "fetch": None if self.fetch is None else self.fetch.to_dict(),
                "miss": None if self.miss is None else self.miss.to_dict(),
                "faults": [e.to_dict() for e in self.faults], "series": self.series,
                "soak": {**self.soak, "summary": None if summary is None else summary.to_dict(),
                         "windows": [w.to_dict() for w in soak_windows(self)]},
                "notes": self.notes,
                "soak_requests": [r.to_dict() for r in self.soak_records]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FleetResult:
        """Read back :meth:`to_dict`."""
        fetch, miss = d.get("fetch"), d.get("miss")
        return cls(config=FleetBenchConfig.from_dict(d.get("config") or {}),
                   machine=MachineRecord.from_dict(d.get("machine") or {}),
                   started=d.get("started", ""), finished=d.get("finished", ""),
                   command=d.get("command", ""), threads=dict(d.get("threads") or {}),
                   redis=dict(d.get("redis") or {}), launches=dict(d.get("launches") or {}),
                   skipped=list(d.get("skipped") or []),
                   share=[ShareCase.from_dict(c) for c in d.get("share") or []],
                   compiles=dict(d.get("compiles") or {}),
                   ttft=[TtftRun.from_dict(r) for r in d.get("ttft") or []],
                   fetch=None if fetch is None else FetchCost.from_dict(fetch),
                   miss=None if miss is None else Timing.from_dict(miss),
                   soak_records=[SoakRecord.from_dict(r) for r in d.get("soak_requests") or []],
                   faults=[FaultEvent.from_dict(e) for e in d.get("faults") or []],
                   series=dict(d.get("series") or {}),
                   soak={k: v for k, v in (d.get("soak") or {}).items()
                         if k not in ("summary", "windows")},
                   notes=list(d.get("notes") or []))
