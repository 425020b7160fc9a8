"""``serve-bench fleet``'s run: the Redis server, the hosts, and each part in turn (see
:mod:`kvnotes_bench.serving.fleet`).

Layout of ``out``: ``redis/`` (the server's log), ``hosts/a``, ``hosts/b``, ... (each host's
``server.log`` and ``skills`` folder; a host in its own process also its ``host.log``),
``folder-store/`` (the ``cost`` part's folder-store host, on a copy of host B's folder),
``soak-entries/`` (every entry a host held during the soak, kept for the check) and
``soak-requests.jsonl`` (the soak's per-request records).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import string
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.serving.agent_traffic import (
    AgentBenchConfig,
    learnable_chunks,
    thread_counts,
    tool_set,
    utc_minute,
)
from kvnotes_bench.serving.fleet import HOSTS, FleetBenchConfig, FleetResult, host_config
from kvnotes_bench.serving.fleet_host import HostProcess
from kvnotes_bench.serving.fleet_parts import (
    HostView,
    ShareSettings,
    TtftRun,
    fetch_cost,
    fleet_compiles,
    mirror_counts,
    share_case,
    ttft_round,
)
from kvnotes_bench.serving.fleet_soak import FaultKit

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.serving.launch.launcher import Launch, LaunchConfig
    from kvnotes.serving.store.redis_process import RedisProcess
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender
    from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
    from kvnotes_bench.serving.agent_traffic_soak import EntryKeeper, SoakRecord

Say = Callable[[str], None]
SoakTraffic = tuple[list[tuple["SoakRecord", "AgentRequest"]], "EntryKeeper", Any]


def request_sets(config: FleetBenchConfig, tokenizer: Any
                 ) -> tuple[list[AgentRequest], list[AgentRequest], list[dict[str, Any]]]:
    """The ``share`` part's tool lists, the soak's cases (its tool pool and questions) and the
    cases left out for length (BFCL ``live_multiple`` development cases only)."""
    n = max(config.cases, config.soak_cases if "soak" in config.parts else 0)
    agent = AgentBenchConfig(model=config.model, parts=("tools",), cases=n,
                             max_context=config.max_context)
    requests, skipped = tool_set(agent, tokenizer)
    return requests[:config.cases], requests[:config.soak_cases], skipped


def _sender(launch: Launch | HostProcess, timeout: float) -> OpenAISender:
    from kvnotes_bench.serving.agent_traffic_client import OpenAISender

    name = launch.served_name if isinstance(launch, HostProcess) else launch.server.served_name
    return OpenAISender(launch.url, name, timeout=timeout)


def _view(name: str, launch: Launch, timeout: float) -> HostView:
    assert launch.config.skills is not None  # host_config sets the folder
    return HostView(name, launch.url, launch.config.skills, _sender(launch, timeout))


def _redis_info(server: RedisProcess) -> dict[str, Any]:
    client = server.client()
    try:
        version = client.info("server").get("redis_version")
    finally:
        client.close()
    return {"version": version, "port": server.port, "pid": server.pid, "url": server.url,
            "binary": server.binary, "persistence": "none"}


def run_fleet(config: FleetBenchConfig, base: LaunchConfig, engine: Engine, *, out: Path,
              request_timeout_s: float = 600.0, command: str = "", say: Say = print
              ) -> FleetResult:
    """Every part of ``config`` on ``config.hosts`` hosts launched from ``base`` over one Redis
    server: with a ``drop`` fault host ``b`` talks to it through a :class:`DropProxy`, with a
    ``sigkill`` fault the last host runs in a process group of its own (:class:`HostProcess`)."""
    from kvnotes.serving.launch import launcher
    from kvnotes.serving.store.redis_process import RedisProcess
    from kvnotes_bench.serving.redis_proxy import DropProxy

    result = FleetResult(config=config, machine=MachineRecord.now(), started=utc_minute(),
                         command=command, threads=thread_counts())
    share_set, soak_set, result.skipped = request_sets(config, engine.tokenizer)
    redis_server = RedisProcess(out / "redis")
    launches: dict[str, Launch | HostProcess] = {}
    traffic: SoakTraffic | None = None
    faults = dict(config.faults) if "soak" in config.parts else {}
    names = list(string.ascii_lowercase[:config.hosts])
    try:
        redis_server.start()
        result.redis = _redis_info(redis_server)
        say(f"redis-server {result.redis['version']} at {redis_server.url} "
            f"(pid {redis_server.pid})")
        with ExitStack() as stack:
            kit = FaultKit(redis_server)
            if "drop" in faults:
                kit.proxy = DropProxy(redis_server.port)
                stack.callback(kit.proxy.stop)
                result.redis["proxy"] = {"host": names[1], "url": kit.proxy.url}
            for name in names:  # one at a time: each picks its free ports as it starts
                folder, url = out / "hosts" / name, redis_server.url
                if kit.proxy is not None and name == names[1]:
                    url = kit.proxy.url
                if "sigkill" in faults and name == names[-1]:
                    host = HostProcess(name, base, folder, config.sightings, request_timeout_s,
                                       url)
                    kit.victim, kit.kill, kit.busy = name, host.kill, host.busy
                    say(f"host {name}: starting in a process group of its own; log: "
                        f"{folder / 'host.log'}")
                    launches[name] = stack.enter_context(host)
                    say(f"host {name}: up at {host.url} after {host.ready['startup_s']} s")
                    continue
                launch = launcher.prepare(host_config(
                    base, folder, config.sightings, request_timeout_s, url), engine)
                launches[name] = launch
                say(f"host {name}: starting vLLM with the connector and the learning front; "
                    f"log: {launch.server.log_path}")
                stack.enter_context(launch)
                say(f"host {name}: up at {launch.url} after {launch.server.startup_s:.0f} s")
            launched = {n: h for n, h in launches.items() if not isinstance(h, HostProcess)}
            if "share" in config.parts:
                asyncio.run(_share(config, launched, share_set, result, request_timeout_s,
                                   engine.tokenizer, say))
            if "cost" in config.parts:
                _cost(config, launched, base, engine, share_set, result, out=out,
                      timeout=request_timeout_s, redis_url=redis_server.url, say=say)
            if "soak" in config.parts:
                traffic = _soak_traffic(config, launches, kit, soak_set, result,
                                        out=out, timeout=request_timeout_s, say=say)
    finally:
        for name, running in launches.items():
            result.launches[name] = (running.record() if isinstance(running, HostProcess)
                                     else running.record().to_dict())
        redis_server.stop()
    if traffic is not None:  # checked with the servers stopped: the engine has the CPU
        _soak_check(config, traffic, engine, result, out=out, say=say)
    result.machine.finish()
    result.finished = utc_minute()
    return result


async def _share(config: FleetBenchConfig, launches: Mapping[str, Launch],
                 requests: Sequence[AgentRequest], result: FleetResult, timeout: float,
                 tokenizer: Any, say: Say) -> None:
    a, b = (_view(name, launches[name], timeout) for name in HOSTS)
    settings = ShareSettings(sightings=config.sightings, max_tokens=config.max_tokens,
                             learn_timeout_s=config.learn_timeout_s,
                             mirror_timeout_s=config.mirror_timeout_s)
    learnable = learnable_chunks(tokenizer)
    known: set[tuple[int, ...]] = set()
    say(f"share: {len(requests)} BFCL live_multiple tool lists, twice through host a, then "
        f"host b (load {load_now()})")
    try:
        for i, request in enumerate(requests):
            case = await share_case(a, b, request, settings, learnable, known)
            result.share.append(case)
            share = case.share
            say(f"  {i + 1}/{len(requests)} {case.id}: compiled {case.compiles} of "
                f"{case.expected} new ({case.learn_wait_s:.1f} s), on b after "
                f"{case.mirror_wait_s:.1f} s ({case.mirrored}), share on b "
                f"{'-' if share is None else f'{share:.0%}'}, identical {case.identical}")
        result.compiles = await fleet_compiles((a, b))
        result.series["after_share"] = await asyncio.to_thread(_metrics, launches)
    finally:
        await a.sender.close()
        await b.sender.close()


def _cost(config: FleetBenchConfig, launches: Mapping[str, Launch], base: LaunchConfig,
          engine: Engine, requests: Sequence[AgentRequest], result: FleetResult, *, out: Path,
          timeout: float, redis_url: str, say: Say) -> None:
    from kvnotes.serving.launch import launcher
    from kvnotes.serving.library.registry import REGISTRY_DIR

    b = launches[HOSTS[1]]
    assert b.config.skills is not None  # host_config sets the folder
    result.fetch = fetch_cost(redis_url, mirror_counts(b.url) or None)
    say(f"cost: fetched {result.fetch.entries} entries ({result.fetch.bytes} bytes) from the "
        f"store in {result.fetch.seconds:.3f} s")
    folder = out / "folder-store"
    # the folder-store host serves a copy of host b's entries (files, as b's mirror copies are:
    # not b's learned registry, a database b holds open)
    shutil.copytree(b.config.skills, folder / "skills", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".*", REGISTRY_DIR))
    launch = launcher.prepare(host_config(base, folder, config.sightings, timeout, None), engine)
    say(f"cost: starting the folder-store host; log: {launch.server.log_path}")
    with launch:
        say(f"cost: folder-store host up at {launch.url} after "
            f"{launch.server.startup_s:.0f} s")
        asyncio.run(_timings(config, b, launch, requests, result, timeout, say))
    result.launches["folder"] = launch.record().to_dict()


async def _timings(config: FleetBenchConfig, redis_host: Launch, folder_host: Launch,
                   requests: Sequence[AgentRequest], result: FleetResult, timeout: float,
                   say: Say) -> None:
    from kvnotes_bench.serving.agent_traffic_overhead import miss_overhead

    senders = {"redis": _sender(redis_host, timeout), "folder": _sender(folder_host, timeout)}
    try:
        for sender in senders.values():  # every entry loaded once on each host
            for request in requests:
                await sender.send(request, splice=True, max_tokens=1)
        batch = [r for r in requests for _ in range(config.per_round)]
        for c in config.concurrency:
            runs = {name: TtftRun(name, c) for name in senders}
            for i in range(config.rounds):  # alternating: neither store always first
                for name in (("redis", "folder") if i % 2 == 0 else ("folder", "redis")):
                    await ttft_round(senders[name], batch, c, runs[name])
            result.ttft += runs.values()
            say(f"  c{c}: median p90 TTFT redis {runs['redis'].median_p90_s}, folder "
                f"{runs['folder'].median_p90_s} (load {load_now()})")
        result.miss = await miss_overhead(senders["redis"], list(requests), config.miss_repeats,
                                          tag="fleet-miss", log=say)
    finally:
        for sender in senders.values():
            await sender.close()


def _metrics(launches: Mapping[str, Launch | HostProcess]) -> dict[str, dict[str, float]]:
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.vllm_endpoints import Client
    from kvnotes_bench.serving.fleet_soak import store_series

    out = {}
    for name, launch in launches.items():
        try:
            out[name] = store_series(Client(launch.url, timeout=10.0).metrics_text())
        except (KvnotesError, OSError):
            out[name] = {}
    return out


def _soak_traffic(config: FleetBenchConfig, launches: Mapping[str, Launch | HostProcess],
                  kit: FaultKit, cases: Sequence[AgentRequest],
                  result: FleetResult, *, out: Path, timeout: float, say: Say
                  ) -> SoakTraffic | None:
    from kvnotes.serving.library.manifest import ServingManifest
    from kvnotes_bench.serving.agent_traffic_requests import tool_pool
    from kvnotes_bench.serving.agent_traffic_soak import EntryKeeper
    from kvnotes_bench.serving.fleet_soak import published_lost, series_delta

    everything = tool_pool(cases)
    pool = random.Random(f"kvnotes-agent-pool:{config.soak.seed}").sample(
        everything, min(config.soak.pool, len(everything)))
    questions = sorted({r.question for r in cases})
    if len(pool) < config.soak.tools_max or not questions:
        result.notes.append(f"soak: a pool of {len(pool)} tools is too small")
        return None
    keeper = EntryKeeper(out / "hosts", out / "soak-entries")
    say(f"soak: {config.soak.requests} requests from {config.soak.clients} clients through "
        f"{len(launches)} hosts over {len(pool)} tools; faults "
        + ", ".join(f"{n}@{a:g}" for n, a in config.faults))
    before = _metrics(launches)
    records, wall = asyncio.run(_soak_clients(config, launches, kit, pool, questions,
                                              keeper, result, timeout, say))
    after = _metrics(launches)
    result.soak.update({
        "wall_s": round(wall, 2), "pool_tools": len(pool), "entries_kept": len(keeper.kept),
        "routing": f"request i -> host i % {len(launches)}, a killed host's to the next live one",
        "store_series": {h: series_delta(before.get(h, {}), after[h]) for h in after},
        "published_lost": published_lost(kit.redis.url, result.faults)})
    lost = result.soak["published_lost"]
    say(f"soak: {lost['published']} entries published after the last destructive fault, "
        f"{lost['lost']} of them lost")
    first = launches[HOSTS[0]]
    assert not isinstance(first, HostProcess)  # host a runs here
    skills = first.skills
    assert skills is not None  # the connector is on
    return records, keeper, ServingManifest.read(skills.folder).fingerprint_obj


async def _soak_clients(config: FleetBenchConfig, launches: Mapping[str, Launch | HostProcess],
                        kit: FaultKit, pool: Sequence[dict[str, Any]],
                        questions: Sequence[str], keeper: EntryKeeper, result: FleetResult,
                        timeout: float, say: Say
                        ) -> tuple[list[tuple[SoakRecord, AgentRequest]], float]:
    from kvnotes_bench.serving.agent_traffic_soak import soak_clients
    from kvnotes_bench.serving.fleet_soak import FleetSender, run_faults

    fleet = FleetSender({name: _sender(launch, timeout) for name, launch in launches.items()})
    done, kept = asyncio.Event(), asyncio.Event()
    keeping = asyncio.create_task(keeper.run(kept))
    t0 = time.monotonic()
    faults = asyncio.create_task(run_faults(kit, config.faults, fleet,
                                            config.soak.requests, t0, done, say))
    try:
        return await soak_clients(fleet, pool, questions, config.soak, say=say)
    finally:
        done.set()
        result.faults = await faults
        result.soak["rerouted"] = fleet.rerouted
        kept.set()
        await keeping
        for sender in fleet.senders.values():
            await sender.close()


def _soak_check(config: FleetBenchConfig, traffic: SoakTraffic, engine: Engine,
                result: FleetResult, *, out: Path, say: Say) -> None:
    from kvnotes_bench.serving.agent_traffic_check import AgentOracle, CheckConfig, KeptEntries
    from kvnotes_bench.serving.agent_traffic_records import RECORDS_NAME, write_records
    from kvnotes_bench.serving.agent_traffic_soak import check_records

    records, keeper, fingerprint = traffic
    say(f"soak: {len(records)} requests; checking every answer against the engine")
    check = CheckConfig(max_tokens=config.soak.max_tokens, eos=tuple(sorted(engine.eos_ids)),
                        tie_tau=config.soak.tie_tau, drift_tau=config.soak.drift_tau)
    oracle = AgentOracle(engine, KeptEntries(keeper.keep, fingerprint))
    rows = check_records(records, oracle, engine.tokenizer, check, say=say)
    result.soak["records"] = write_records(rows, out / RECORDS_NAME).name
    result.soak_records = [r for r, _ in records]
