"""``kvnotes-bench serve fleet``: kvnotes hosts over one Redis store, what the shared store
gives a fleet and what it costs.

Starts a ``redis-server`` on a free loopback port and ``--hosts`` hosts (vLLM with kvnotes'
connector,
the learning OpenAI front on ``--store redis://...``), runs the ``share``, ``cost`` and ``soak``
parts (:mod:`kvnotes_bench.serving.fleet`) and writes ``result.json``, ``report.md`` and
``fleet.png`` in ``--out``.

Example::

    kvnotes-bench serve fleet --model smollm2-135m --out out/serve-bench/fleet
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvnotes.cli.app import emit_json, folder_option
from kvnotes_bench.cli.app import invocation
from kvnotes_bench.cli.serve_bench import bench_app

if TYPE_CHECKING:  # the CLI starts fast: the benchmark is imported when the command runs
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes_bench.serving.fleet import FleetBenchConfig


def _log(line: str) -> None:
    typer.echo(line, err=True)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise typer.BadParameter(f"{what}: comma-separated integers, got {text!r}") from err
    if not values:
        raise typer.BadParameter(f"{what}: at least one integer")
    return values


@bench_app.command("fleet")
def fleet(
    model: Annotated[str, typer.Option("--model", help="Model alias (every host)")] =
    "smollm2-135m",
    hosts: Annotated[int, typer.Option("--hosts", help="Hosts over the one Redis (soak "
                                       "requests round-robin)")] = 3,
    parts: Annotated[str, typer.Option(
        "--parts", help="Parts to run, comma-separated, of share (learned on host a, spliced "
        "on host b), cost (TTFT through Redis vs a folder store; a miss vs splice: false; "
        "fetch cost; runs share too), soak (every host while Redis and a host fail; every "
        "answer checked)")] = "share,cost,soak",
    cases: Annotated[int, typer.Option("--cases", help="BFCL live_multiple development tool "
                                       "lists of the share part")] = 8,
    sightings: Annotated[int, typer.Option("--learn-after", help="The fronts' "
                                           "--learn-after")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Greedy tokens per measured "
                                            "answer")] = 16,
    learn_timeout: Annotated[float, typer.Option("--learn-timeout", help="Seconds a tool list "
                                                 "waits to be compiled")] = 120.0,
    mirror_timeout: Annotated[float, typer.Option(
        "--mirror-timeout", help="Seconds it then waits to reach host b's folder")] = 60.0,
    concurrency: Annotated[str, typer.Option("--concurrency", help="cost: concurrency "
                                             "levels")] = "1,4",
    rounds: Annotated[int, typer.Option("--rounds", help="cost: rounds per store and "
                                        "level")] = 5,
    per_round: Annotated[int, typer.Option("--per-round", help="cost: sends of each request "
                                           "per round")] = 2,
    miss_repeats: Annotated[int, typer.Option("--miss-repeats", help="cost: pairs of the miss "
                                              "timing")] = 10,
    clients: Annotated[int, typer.Option("--clients", help="Soak clients")] = 4,
    soak_requests: Annotated[int, typer.Option("--soak-requests", help="Soak requests in "
                                               "all")] = 120,
    pool_tools: Annotated[int, typer.Option("--pool-tools", help="Soak: tools drawn "
                                            "from")] = 12,
    faults: Annotated[str, typer.Option(
        "--faults", help="Soak: NAME@FRACTION of the requests sent, in order, NAME one of "
        "kill, restart, flush, pause, drop, evict, sigkill (default: every one)")] = "",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="The servers' dtype")] = "float32",
    block_size: Annotated[int, typer.Option("--block-size", help="vLLM's KV block size "
                                            "(tokens)")] = 32,
    kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", help="Each server's CPU KV "
                                              "cache, whole GiB")] = 1,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout")] = 900.0,
    vllm_python: Annotated[str | None, typer.Option(
        "--vllm-python", help="Python of the vLLM environment (default .venv-vllm/bin/python)")
    ] = None,
    request_timeout: Annotated[float, typer.Option("--request-timeout")] = 600.0,
    out: Annotated[Path, typer.Option("--out", help="Folder of the result, report, plot, "
                                      "logs and libraries")] = Path("out/serve-bench/fleet"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """Hosts over one Redis store: a tool list learned on one host spliced on another, what
    the store costs a request, and a soak through all of them while Redis and a host fail."""
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig
    from kvnotes_bench.serving.fleet import FleetBenchConfig, check_fleet_wiring
    from kvnotes_bench.serving.fleet_soak import DEFAULT_FAULTS, parse_faults

    folder_option(out, "--out")
    try:
        bench = FleetBenchConfig(
            model=model, parts=tuple(p.strip() for p in parts.split(",") if p.strip()),
            cases=cases, sightings=sightings, max_tokens=max_tokens,
            learn_timeout_s=learn_timeout, mirror_timeout_s=mirror_timeout,
            concurrency=_ints(concurrency, "--concurrency"), rounds=rounds,
            per_round=per_round, miss_repeats=miss_repeats, hosts=hosts,
            faults=parse_faults(faults) if faults else DEFAULT_FAULTS,
            soak=AgentSoakConfig(clients=clients, requests=soak_requests, pool=pool_tools,
                                 max_tokens=max_tokens, sightings=sightings, seed=seed))
        base = LaunchConfig(model=model, dtype=dtype, block_size=block_size,
                            kv_cache_gib=kv_cache_gib, max_model_len=4096,
                            startup_timeout=startup_timeout, vllm_python=vllm_python)
        check_fleet_wiring()
    except KvnotesError as err:
        raise typer.BadParameter(str(err)) from err
    _run(bench, base, out=out, request_timeout=request_timeout, as_json=as_json)


def _run(bench: FleetBenchConfig, base: LaunchConfig, *, out: Path, request_timeout: float,
         as_json: bool) -> None:
    """Load the model, run the benchmark and write its bundle in ``out``."""
    import kvnotes
    from kvnotes_bench.serving.fleet_report import markdown, write_outputs
    from kvnotes_bench.serving.fleet_run import run_fleet

    engine = kvnotes.load(bench.model)
    out.mkdir(parents=True, exist_ok=True)
    result = run_fleet(bench, base, engine, out=out, request_timeout_s=request_timeout,
                       command=invocation(),
                       say=_log)
    data = result.to_dict()
    paths = write_outputs(data, out)
    if as_json:
        emit_json({k: v for k, v in data.items() if k not in ("share", "soak_requests")})
    else:
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")
