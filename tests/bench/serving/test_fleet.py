"""``serve-bench fleet`` without vLLM: its config, the share protocol over fake hosts, the
timing rounds, the soak's routing and windows, the faults against a real ``redis-server``, and
the report and plot of a synthetic result."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.store.redis_process import REDIS_SERVER, RedisProcess
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.serving import fleet_parts
from kvnotes_bench.serving.agent_traffic_client import Answer
from kvnotes_bench.serving.agent_traffic_overhead import Timing
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
from kvnotes_bench.serving.agent_traffic_soak import SoakRecord
from kvnotes_bench.serving.fleet import FleetBenchConfig, FleetResult, with_store
from kvnotes_bench.serving.fleet_parts import (
    FetchCost,
    HostView,
    ShareCase,
    ShareSettings,
    TtftRun,
    find_mirror,
    same_answer,
    share_case,
    ttft_overhead,
    ttft_round,
)
from kvnotes_bench.serving.fleet_report import markdown, write_outputs
from kvnotes_bench.serving.fleet_soak import (
    DEFAULT_FAULTS,
    FAULTS,
    FaultEvent,
    FaultKit,
    FleetSender,
    compiled_by,
    parse_faults,
    run_faults,
    series_delta,
    store_series,
    windows,
)
from kvnotes_bench.serving.fleet_summary import goals


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"does {name}",
                                             "parameters": {"type": "object"}}}


def _request(i: int, names=("a", "b")) -> AgentRequest:
    return AgentRequest(id=f"soak-{i}", kind="tools", system="s", question="q",
                        chunks=tuple(_tool(n) for n in names))


def _answer(spliced: int = 0, prompt: int = 100, tokens=("x", "y"), ok: bool = True,
            ttft: float | None = 0.1) -> Answer:
    return Answer(ok=ok, error=None if ok else "APIError: down", text="".join(tokens),
                  tokens=list(tokens), prompt_tokens=prompt, spliced_tokens=spliced,
                  ttft_s=ttft)


# ---- config -------------------------------------------------------------------------------------
def test_config_checks_parts_and_faults() -> None:
    assert FleetBenchConfig(parts=("cost",)).parts == ("share", "cost")  # cost times share's
    with pytest.raises(InvalidArgumentError, match="--parts"):
        FleetBenchConfig(parts=("nope",))
    with pytest.raises(InvalidArgumentError, match="--concurrency"):
        FleetBenchConfig(concurrency=(0,))
    with pytest.raises(InvalidArgumentError, match="restart follows a kill"):
        FleetBenchConfig(faults=(("restart", 0.2),))
    with pytest.raises(InvalidArgumentError, match="down"):
        parse_faults("kill@0.2,flush@0.3")
    with pytest.raises(InvalidArgumentError, match="rising"):
        parse_faults("flush@0.5,flush@0.4")
    with pytest.raises(InvalidArgumentError, match="NAME@FRACTION"):
        parse_faults("kill")
    with pytest.raises(InvalidArgumentError, match="once at most"):
        parse_faults("sigkill@0.2,sigkill@0.3")
    with pytest.raises(InvalidArgumentError, match="--hosts"):
        FleetBenchConfig(hosts=2)  # the default schedule kills a host: two must go on
    assert {name for name, _ in DEFAULT_FAULTS} == set(FAULTS)  # the goal soak: every fault
    assert FleetBenchConfig().hosts == 3 and FleetBenchConfig(hosts=2, faults=()).hosts == 2
    config = FleetBenchConfig(cases=3, concurrency=(1, 2), faults=parse_faults("flush@0.5"))
    assert FleetBenchConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_with_store_sets_the_front_or_learning_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class Learn:
        after: int = 2
        store: str | None = None

    @dataclasses.dataclass(frozen=True)
    class Front:
        learn: Learn | None = None
        store: str | None = None

    @dataclasses.dataclass(frozen=True)
    class Bare:
        learn: Learn | None = None

    @dataclasses.dataclass(frozen=True)
    class Nothing:
        learn: object = None

    url = "redis://127.0.0.1:1/0"
    assert with_store(Front(Learn()), url).store == url  # type: ignore[arg-type,attr-defined]
    assert with_store(Bare(Learn()), url).learn.store == url  # type: ignore[arg-type,attr-defined]
    with pytest.raises(InvalidArgumentError, match="shared-store setting"):
        with_store(Nothing(), url)  # type: ignore[arg-type]


# ---- share and cost -----------------------------------------------------------------------------
class _FakeSender:
    """A host's client: each spliced request is a hit with ``spliced`` tokens once
    ``hit`` says so."""

    def __init__(self, hit=lambda: True, spliced: int = 60, ttft: float = 0.1) -> None:
        self.sent: list[tuple[str, bool]] = []
        self.hit, self.spliced, self.ttft = hit, spliced, ttft

    async def send(self, request, *, splice, max_tokens, repair=None) -> Answer:
        self.sent.append((request.id, splice))
        return _answer(self.spliced if splice and self.hit() else 0)

    async def stream(self, request, *, splice, max_tokens) -> Answer:
        self.sent.append((request.id, splice))
        return _answer(self.spliced if splice else 0, ttft=self.ttft)

    async def close(self) -> None:
        pass


def test_share_case_learns_on_a_and_splices_on_b(tmp_path, monkeypatch) -> None:
    """Host a compiles a chunk (one file, one compile) after two sightings; host b's mirror
    copies it; b's first request is then measured against splice: false."""
    folder_a, folder_b = tmp_path / "a", tmp_path / "b"
    folder_a.mkdir()
    folder_b.mkdir()
    counters = {"a": 0, "b": 0}
    a_sender = _FakeSender()

    def stats(url: str) -> dict:
        host = url[-1]
        if host == "a" and len(a_sender.sent) >= 2 and counters["a"] == 0:
            counters["a"] = 1  # the compile, and its entry file
            (folder_a / "k1.safetensors").write_bytes(b"x")
        if host == "b" and (folder_a / "k1.safetensors").exists():
            (folder_b / "k1.safetensors").write_bytes(b"x")  # the mirror's fetch
        return {"learner": {"compiles": counters[host], "failures": 0}}

    monkeypatch.setattr(fleet_parts, "front_stats", stats)
    b_sender = _FakeSender(hit=lambda: (folder_b / "k1.safetensors").exists())
    a = HostView("a", "http://h/a", folder_a, a_sender)  # type: ignore[arg-type]
    b = HostView("b", "http://h/b", folder_b, b_sender)  # type: ignore[arg-type]
    settings = ShareSettings(min_tokens=1, learn_timeout_s=5, mirror_timeout_s=5, poll_s=0.01,
                             settle_s=0.0)
    known: set = set()
    case = asyncio.run(share_case(a, b, _request(0), settings, lambda r: [(1, 2, 3)], known))
    assert [s for _, s in a_sender.sent] == [True, True]
    assert b_sender.sent == [("soak-0", True), ("soak-0", False)]
    assert case.learned and case.mirrored and case.expected == 1
    assert case.compiles == {"a": 1, "b": 0}
    assert case.share == pytest.approx(0.6) and case.identical
    assert known == {(1, 2, 3)}
    assert ShareCase.from_dict(json.loads(json.dumps(case.to_dict()))).share == case.share


def test_ttft_round_and_overhead() -> None:
    run = TtftRun("redis", 2)
    asyncio.run(ttft_round(_FakeSender(ttft=0.2), [_request(i) for i in range(4)], 2, run))
    assert run.p90s == [0.2] and run.failed == 0 and run.share == pytest.approx(0.6)
    folder = TtftRun("folder", 2, p90s=[0.1, 0.1, 0.3])
    assert ttft_overhead([run, folder], 2) == pytest.approx(1.0)
    assert ttft_overhead([run], 2) is None
    # a round's p90 is kit.stats' linear percentile: the nearest rank the fleet used before
    # (the published cost-0.9.0 run) gave 9.0 for these ten values
    assert percentile([5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == pytest.approx(9.1)
    lo, hi = folder.median_p90_ci_s or (0.0, 0.0)
    assert 0.1 <= lo <= folder.median_p90_s <= hi <= 0.3 and run.median_p90_ci_s is None


def test_answers_and_mirror_counters() -> None:
    assert same_answer(_answer(), _answer(spliced=50)) is True
    assert same_answer(_answer(), _answer(tokens=("x", "z"))) is False
    assert same_answer(_answer(), _answer(ok=False)) is None
    stats = {"learner": {"compiles": 1}, "store": {"mirror": {"fetched": 2, "fetched_bytes":
                                                              4_000_000, "fetch_s": 0.5}}}
    mirror = find_mirror(stats)
    assert mirror is not None and find_mirror({"learner": {}}) is None
    cost = FetchCost(entries=2, bytes=2_000_000, seconds=0.1, mirror=mirror)
    assert cost.s_per_mb == pytest.approx(0.05) and cost.mirror_s_per_mb == pytest.approx(0.125)
    # a mirror read from /metrics has no fetch time: no cost per MB is made up
    assert FetchCost(mirror={"fetched": 2, "fetched_bytes": 10}).mirror_s_per_mb is None


def test_store_series_keeps_store_fleet_and_mirror_counters() -> None:
    text = ("# TYPE kvnotes_front_store_faults counter\n"
            'kvnotes_front_store_faults_total{reason="down"} 2\n'
            'kvnotes_front_store_faults_total{reason="slow"} 1\n'
            "# TYPE kvnotes_front_fleet_adopted counter\nkvnotes_front_fleet_adopted_total 4\n"
            "# TYPE kvnotes_front_mirror_fetched counter\nkvnotes_front_mirror_fetched_total 5\n"
            "# TYPE kvnotes_front_requests counter\nkvnotes_front_requests_total 9\n")
    series = store_series(text)
    assert series == {"kvnotes_front_store_faults_total": 3.0,
                      "kvnotes_front_fleet_adopted_total": 4.0,
                      "kvnotes_front_mirror_fetched_total": 5.0}
    assert series_delta({"kvnotes_front_store_faults_total": 1.0}, series) == {
        "kvnotes_front_store_faults_total": 2.0, "kvnotes_front_fleet_adopted_total": 4.0,
        "kvnotes_front_mirror_fetched_total": 5.0}


# ---- soak ---------------------------------------------------------------------------------------
def test_fleet_sender_routes_by_request_index() -> None:
    senders = {"a": _FakeSender(), "b": _FakeSender()}
    fleet = FleetSender(senders)  # type: ignore[arg-type]

    async def go() -> None:
        for i in range(5):
            await fleet.send(_request(i), splice=True, max_tokens=1)

    asyncio.run(go())
    assert [i for i, _ in senders["a"].sent] == ["soak-0", "soak-2", "soak-4"]
    assert [i for i, _ in senders["b"].sent] == ["soak-1", "soak-3"]
    assert fleet.started == fleet.done == 5


def _record(i: int, sent_s: float, *, ok=True, eligible=True, spliced=10, status="ok"):
    return SoakRecord(i, 0, sent_s, ["a"], 0, True, eligible,
                      _answer(spliced, ok=ok), verdict={"status": status} if ok else None)


def test_windows_cut_at_each_fault() -> None:
    records = [_record(0, 0.5), _record(1, 1.5, spliced=0), _record(2, 2.5, ok=False),
               _record(3, 3.5, status="wrong"), _record(4, 3.6, eligible=False)]
    events = [FaultEvent("kill", 0.2, at_s=1.0, ok=True), FaultEvent("restart", 0.4, at_s=2.0,
                                                                      ok=True),
              FaultEvent("flush", 0.9, error="the soak ended before it")]
    ws = windows(records, events)
    assert [w.label for w in ws] == ["before the faults", "after kill @0.2",
                                     "after restart @0.4"]
    assert [w.requests for w in ws] == [1, 1, 3]
    assert ws[0].hit_rate == 1.0 and ws[1].hit_rate == 0.0
    assert ws[2].failed == 1 and ws[2].wrong == 1 and ws[2].eligible == 1


def _spliced_all(i: int, sent_s: float, tools: list[str], entries: int) -> SoakRecord:
    answer = _answer(10 if entries else 0)
    answer.kvnotes = {"plan": {"entries": [{"name": f"e{k}"} for k in range(entries)]}}
    return SoakRecord(i, 0, sent_s, tools, 0, True, True, answer, verdict={"status": "ok"})


def test_the_goals_hit_rate_counts_requests_after_one_of_their_tools_was_compiled() -> None:
    records = [_spliced_all(0, 1.0, ["a", "b"], 0),  # a miss while both still compile
               _spliced_all(1, 2.0, ["a", "b"], 1),  # one of two spliced: proves neither
               _spliced_all(2, 3.0, ["a"], 1),  # a proven at 3.0
               _spliced_all(3, 4.0, ["a", "c"], 0),  # after a's compile, not spliced: a miss
               _spliced_all(4, 5.0, ["c"], 0)]  # c never proven: not counted
    assert compiled_by(records) == {"a": 3.0}
    (w,) = windows(records, [])
    assert (w.eligible, w.spliced) == (5, 2)  # seen twice: every request counts
    assert (w.compiled, w.compiled_spliced, w.hit_rate_compiled) == (1, 0, 0.0)


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_run_faults_kills_restarts_and_flushes_a_real_server(tmp_path) -> None:
    class Counting:
        started = 0

    sender = Counting()
    with RedisProcess(tmp_path / "redis") as server:
        first_pid = server.pid

        async def go() -> list[FaultEvent]:
            stop = asyncio.Event()
            task = asyncio.create_task(run_faults(
                FaultKit(server), parse_faults("kill@0.2,restart@0.4,flush@0.6,kill@0.8"),
                sender, 10, 0.0, stop, poll_s=0.01))  # type: ignore[arg-type]
            for _ in range(10):
                sender.started += 1
                if sender.started == 5:  # after the restart: data the flush must remove
                    await asyncio.sleep(0.5)
                    server.client().set("k", b"v")
                await asyncio.sleep(0.2)
            stop.set()
            return await task

        events = asyncio.run(go())
        assert [e.name for e in events] == ["kill", "restart", "flush", "kill"]
        assert all(e.ok for e in events), [e.error for e in events]
        assert [e.at_request for e in events] == [2, 4, 6, 8]
        # the last kill is undone: the server is left running, empty after the flush
        assert server.alive and server.pid != first_pid
        assert server.client().get("k") is None


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_run_faults_pauses_drops_evicts_and_kills_a_host(tmp_path, monkeypatch) -> None:
    import redis

    from kvnotes_bench.serving import fleet_soak
    from kvnotes_bench.serving.redis_proxy import DropProxy

    monkeypatch.setattr(fleet_soak, "DROP_S", 1.0)
    monkeypatch.setattr(fleet_soak, "EVICT_HOLD_S", 0.5)
    fleet = FleetSender({"a": _FakeSender(), "c": _FakeSender()})  # type: ignore[dict-item]
    killed: list[str] = []
    with RedisProcess(tmp_path / "redis") as server:
        server.client().set("kvn:lease:compile:m:ab", "token:nonce", px=60_000)  # a compile
        proxy = DropProxy(server.port)
        kit = FaultKit(server, proxy, "c", lambda: killed.append("c"), lambda: True)
        through = redis.Redis(port=proxy.port, socket_timeout=0.3)

        async def go() -> list[FaultEvent]:
            stop = asyncio.Event()
            task = asyncio.create_task(run_faults(
                kit, parse_faults("pause@0.2,drop@0.4,evict@0.6,sigkill@0.8"), fleet, 5, 0.0,
                stop, poll_s=0.01))
            for _ in range(5):
                fleet.started += 1
                await asyncio.sleep(0.05)
            while not task.done():
                await asyncio.sleep(0.05)
            return await task

        t0 = time.monotonic()
        events = asyncio.run(go())
        assert [e.name for e in events] == ["pause", "drop", "evict", "sigkill"]
        assert all(e.ok for e in events), [e.error for e in events]
        assert time.monotonic() - t0 >= fleet_soak.PAUSE_S  # the server slept
        assert "once a compile lease was taken" in (events[0].detail or "")
        # answered only once the drop is over: redis-py retries after each dropped reply
        assert through.ping() is True and proxy.dropped > 0
        assert "volatile-lru" in (events[2].detail or "")
        assert server.client().config_get("maxmemory-policy")["maxmemory-policy"] == \
            "volatile-lru"
        assert killed == ["c"] and fleet.dead == {"c"}
        assert "holding a compile lease" in (events[3].detail or "")
        time.sleep(0.6)  # the eviction's hold is over
        assert server.client().config_get("maxmemory")["maxmemory"] == "0"
        proxy.stop()


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_the_proxy_passes_again_once_a_killed_server_is_restarted(tmp_path) -> None:
    import redis

    from kvnotes_bench.serving.redis_proxy import DropProxy

    with RedisProcess(tmp_path / "redis") as server:
        proxy = DropProxy(server.port)
        through = redis.Redis(port=proxy.port, socket_timeout=0.5, retry_on_error=[],
                              retry=None)
        assert through.ping() is True
        server.stop()
        with pytest.raises(redis.ConnectionError):
            through.ping()
        server.start()  # the same port
        assert through.ping() is True
        proxy.stop()


def test_fleet_sender_sends_a_killed_hosts_requests_to_a_live_one() -> None:
    class Dying(_FakeSender):
        async def send(self, request, *, splice, max_tokens, repair=None) -> Answer:
            self.sent.append((request.id, splice))
            return _answer(ok=False)

    senders = {"a": _FakeSender(), "b": Dying()}
    fleet = FleetSender(senders)  # type: ignore[arg-type]
    fleet.kill("b")  # b died while soak-1 was on its way to it

    async def go() -> list[Answer]:
        return [await fleet.send(_request(i), splice=True, max_tokens=1) for i in range(4)]

    assert all(a.ok for a in asyncio.run(go()))
    assert [i for i, _ in senders["a"].sent] == ["soak-0", "soak-1", "soak-2", "soak-3"]
    assert senders["b"].sent == [] and fleet.rerouted == 0
    fleet.dead.clear()
    asyncio.run(fleet.send(_request(1), splice=True, max_tokens=1))  # fails on b: b lives
    fleet.kill("b")
    answer = asyncio.run(fleet.send(_request(3), splice=True, max_tokens=1))
    assert answer.ok and fleet.rerouted == 0  # routed to a from the start


# ---- report -------------------------------------------------------------------------------------
def _result() -> FleetResult:
    result = FleetResult(config=FleetBenchConfig(cases=2), machine=MachineRecord.now(),
                         started="2026-12-06 23:00", finished="2026-12-06 23:30",
                         command="kvnotes-bench serve fleet", threads={"torch": 2},
                         redis={"version": "7.0.15", "port": 6390})
    for i in range(2):
        result.share.append(ShareCase(f"case-{i}", 3, 3, True, 1.0, True, 2.0,
                                      {"a": 3, "b": 0}, _answer(70), _answer(0)))
    result.compiles = {"a": {"compiles": 6}, "b": {"compiles": 0}}
    for c in (1, 4):
        result.ttft += [TtftRun("redis", c, [0.105, 0.11], 0, 70, 100),
                        TtftRun("folder", c, [0.1, 0.1], 0, 70, 100)]
    result.fetch = FetchCost(entries=6, bytes=6_000_000, seconds=0.06)
    result.miss = Timing("miss", measured=[0.1, 0.1], reference=[0.1, 0.1])
    result.soak_records = [_record(i, float(i)) for i in range(6)]
    result.faults = [FaultEvent("kill", 0.3, at_s=2.0, at_request=2, ok=True),
                     FaultEvent("restart", 0.6, at_s=4.0, at_request=4, ok=True)]
    result.series = {"after_share": {"a": {"kvnotes_front_fleet_published_total": 6.0},
                                       "b": {"kvnotes_front_fleet_adopted_total": 0.0}}}
    result.soak = {"wall_s": 6.0, "store_series": {"a": {"kvnotes_front_store_faults_total":
                                                         3.0}, "b": {}}}
    return result


def test_goals_of_a_synthetic_result() -> None:
    g = goals(_result())
    assert g["share_spliced"]["met"] and g["share_identical"]["met"]
    assert g["share_compiles"]["met"] and g["share_compiles"]["value"] == 6
    assert g["ttft_c1"]["value"] == pytest.approx(0.075) and g["ttft_c1"]["met"]
    assert g["miss"]["met"] and g["soak_failed"]["met"] and g["soak_wrong"]["met"]
    assert g["fetch_s_per_mb"]["value"] == pytest.approx(0.01)


def test_report_and_plot_from_a_synthetic_result(tmp_path: Path) -> None:
    data = json.loads(json.dumps(_result().to_dict()))
    assert json.loads(json.dumps(FleetResult.from_dict(data).to_dict())) == data
    paths = write_outputs(data, tmp_path)
    assert paths["plot"].stat().st_size > 1000
    text = markdown(data)
    assert paths["report"].read_text() == text
    assert "| share_spliced | 0.700 |" in text and "after restart @0.6" in text
    assert "kvnotes_front_store_faults_total +3" in text
    assert "- a: kvnotes_front_fleet_published_total 6" in text
    windows_ = data["soak"]["windows"]
    assert [w["requests"] for w in windows_] == [2, 2, 2]


# ---- the hosts and the command ------------------------------------------------------------------
def test_host_config_puts_each_host_on_its_folder_and_the_store(tmp_path) -> None:
    from kvnotes.serving.front.config import FrontConfig, LearnConfig
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes_bench.serving.fleet import STORE_FIELDS, host_config

    base = LaunchConfig(model="smollm2-135m", block_size=32)
    folder = host_config(base, tmp_path / "c", 3, 30.0, None)
    assert folder.skills == tmp_path / "c" / "skills"
    assert folder.log_path == tmp_path / "c" / "server.log" and folder.block_size == 32
    assert folder.front is not None and folder.front.learn is not None
    assert folder.front.learn.after == 3 and folder.front.guard == 0.0
    url = "redis://127.0.0.1:6399/0"
    wired = [n for n in STORE_FIELDS if n in {f.name for f in dataclasses.fields(FrontConfig)}
             | {f.name for f in dataclasses.fields(LearnConfig)}]
    if not wired:  # a kvnotes without the fleet wiring is refused before anything starts
        with pytest.raises(InvalidArgumentError, match="shared-store setting"):
            host_config(base, tmp_path / "a", 2, 30.0, url)
        return
    host = host_config(base, tmp_path / "a", 2, 30.0, url)
    assert host.front is not None
    assert url in (getattr(host.front, wired[0], None), getattr(host.front.learn, wired[0], None))


def test_the_command_refuses_bad_options_before_loading_a_model() -> None:
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    runner = CliRunner()
    for args, said in ((["--parts", "share,bogus"], "bogus"),
                       (["--faults", "kill@0.2,flush@0.3"], "restart it first"),
                       (["--faults", "explode@0.5"], "explode"),
                       (["--concurrency", "1,x"], "1,x")):
        result = runner.invoke(app, ["serve", "fleet", "--model", "no-such-model", *args])
        assert result.exit_code == 2 and said in result.output, result.output
