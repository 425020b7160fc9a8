"""``kvnotes-bench serve agent`` and ``spliceable``: agent traffic through the learning front.

Its options' defaults are the benchmark's configs'
(:class:`~kvnotes_bench.serving.agent_traffic.AgentBenchConfig`,
:class:`~kvnotes_bench.serving.agent_traffic_protocol.ProtocolConfig`,
:class:`~kvnotes_bench.serving.agent_traffic_soak.AgentSoakConfig`), and the server's KV block is
a learning server's (:class:`~kvnotes.serving.front.config.LearnConfig`), for ``--learn`` and
``--no-learn`` alike, so the two runs compare on the same blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kvnotes.cli.app import emit_json
from kvnotes.cli.options import default_of
from kvnotes.core.sizes import format_size
from kvnotes.serving.front.config import LearnConfig
from kvnotes_bench.cli.app import invocation
from kvnotes_bench.cli.serve_bench import (
    Dtype,
    KvCacheGib,
    Model,
    Out,
    RequestTimeout,
    ServerOptions,
    StartupTimeout,
    VllmPython,
    bench_app,
    name_list,
    say,
    token_counts,
)
from kvnotes_bench.serving.agent_traffic import AgentBenchConfig
from kvnotes_bench.serving.agent_traffic_protocol import ProtocolConfig
from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig


def _bench(name: str) -> Any:
    return default_of(AgentBenchConfig, name)


def _protocol(name: str) -> Any:
    return default_of(ProtocolConfig, name)


def _soak(name: str) -> Any:
    return default_of(AgentSoakConfig, name)


Parts = Annotated[str | None, typer.Option(
    "--parts", help="Parts to run, comma-separated, of tools (BFCL live_multiple with "
    "tools=), documents (content parts), overhead (TTFT of a miss and beside a compile), "
    "soak (capped library, every answer checked); default all")]
Cases = Annotated[int, typer.Option("--cases", help="BFCL live_multiple development cases")]
Docs = Annotated[int, typer.Option("--docs", help="Document requests")]
DocsK = Annotated[int, typer.Option("--docs-k", help="Documents per request")]
Sightings = Annotated[int, typer.Option(
    "--learn-after", help="Sightings after which the server learns a chunk (its "
    "--learn-after)")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Greedy tokens per measured "
                                        "answer")]
LearnTimeout = Annotated[float, typer.Option(
    "--learn-timeout", help="Seconds to wait per case for its chunks to be learned")]
Repeats = Annotated[int, typer.Option("--repeats", help="Pairs per TTFT timing")]
Learn = Annotated[bool, typer.Option(
    "--learn/--no-learn", help="Serve with learning on (--no-learn: today's front, a "
    "baseline)")]
LibraryCap = Annotated[str, typer.Option(
    "--library-cap", help="The soak server's library cap (e.g. 64MiB; K/M/G: powers of 1000, "
    "KiB/MiB/GiB: of 1024): below the working set")]
Clients = Annotated[int, typer.Option("--clients", help="Soak clients")]
PoolTools = Annotated[int, typer.Option(
    "--pool-tools", help="Soak: the tools requests draw from (a seeded sample)")]
SoakRequests = Annotated[int, typer.Option("--soak-requests", help="Soak requests in all")]
ExactFraction = Annotated[float, typer.Option(
    "--exact-fraction", help="Soak requests sent with splice: false")]
DriftTau = Annotated[float | None, typer.Option(
    "--drift-tau", help="Soak check: compare greedy answers only up to the first step where "
    "the server's or the engine's top-2 log-prob margin is below this (a near tie; the "
    "answers cut short are counted); default: compared whole")]
BlockSize = Annotated[int, typer.Option(
    "--block-size", help="KV block size in tokens (CPU: a multiple of 32), for --learn and "
    "--no-learn alike (default: a learning server's, LearnConfig.block_size)")]
Seed = Annotated[int, typer.Option("--seed")]
Tenant = Annotated[str | None, typer.Option("--tenant", help="Sent as kvnotes.tenant")]
Repair = Annotated[str | None, typer.Option(
    "--repair", help="The launched front's repair, as `kvnotes serve --repair` spells it: "
    "K or K@F (default: the front's)")]
CompileNice = Annotated[int, typer.Option(
    "--learn-compile-nice", min=0, max=19, help="The server's compile thread nice value "
    "(its `kvnotes serve --learn-compile-nice`)")]
Guard = Annotated[str, typer.Option(
    "--guard", help="The launched front's guard, as `kvnotes serve --guard` spells it: auto "
    "(the model's calibrated default), 0 (off) or a margin; the soak runs without")]
RepairVariants = Annotated[str | None, typer.Option(
    "--repair-variants", help="Also measure each reordered request spliced with "
    "kvnotes.repair K for these K, comma-separated (e.g. 16,8; no share floor)")]


@bench_app.command("agent")
def agent(
    model: Model = _bench("model"), parts: Parts = None, cases: Cases = _bench("cases"),
    docs: Docs = _bench("docs"), docs_k: DocsK = _bench("docs_k"),
    sightings: Sightings = _protocol("sightings"), max_tokens: MaxTokens = _protocol("max_tokens"),
    learn_timeout: LearnTimeout = _protocol("learn_timeout_s"),
    repeats: Repeats = _bench("repeats"), learn: Learn = _bench("learn"),
    library_cap: LibraryCap = format_size(_bench("library_cap_bytes")),
    clients: Clients = _soak("clients"), pool_tools: PoolTools = _soak("pool"),
    soak_requests: SoakRequests = _soak("requests"),
    exact_fraction: ExactFraction = _soak("exact_fraction"),
    drift_tau: DriftTau = _soak("drift_tau"), seed: Seed = _protocol("seed"),
    tenant: Tenant = _bench("tenant"), repair: Repair = _bench("repair"),
    compile_nice: CompileNice = _bench("compile_nice"), guard: Guard = _bench("guard"),
    repair_variants: RepairVariants = None, dtype: Dtype = "float32",
    block_size: BlockSize = default_of(LearnConfig, "block_size"),
    kv_cache_gib: KvCacheGib = default_of(ServerOptions, "kv_cache_gib"),
    startup_timeout: StartupTimeout = default_of(ServerOptions, "startup_timeout"),
    vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = default_of(ServerOptions, "request_timeout"),
    out: Out = Path("out/serve-bench/agent"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """Agent traffic through the OpenAI front with learning on: BFCL tools= and documents as
    content parts, learned on sight and spliced in another order, against splice: false; the
    TTFT of a miss and beside a compile; a capped-library soak checked against the engine."""
    import kvnotes
    from kvnotes.core.errors import KvnotesError
    from kvnotes.core.sizes import parse_size
    from kvnotes_bench.serving.agent_traffic import run_agent
    from kvnotes_bench.serving.agent_traffic_report import markdown, write_outputs

    try:
        bench = AgentBenchConfig(
            model=model, parts=name_list(parts, _bench("parts")), cases=cases, docs=docs,
            docs_k=docs_k, repeats=repeats, learn=learn,
            library_cap_bytes=parse_size(library_cap, "--library-cap"), tenant=tenant,
            repair=repair, compile_nice=compile_nice, guard=guard,
            protocol=ProtocolConfig(sightings=sightings, max_tokens=max_tokens,
                                    learn_timeout_s=learn_timeout, seed=seed,
                                    repairs=token_counts(repair_variants)),
            soak=AgentSoakConfig(clients=clients, requests=soak_requests, pool=pool_tools,
                                 exact_fraction=exact_fraction, max_tokens=max_tokens,
                                 sightings=sightings, seed=seed, drift_tau=drift_tau))
    except KvnotesError as err:
        raise typer.BadParameter(str(err)) from err
    server = ServerOptions(launch=True, model=model, dtype=dtype, block_size=block_size,
                           kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout,
                           vllm_python=vllm_python, request_timeout=request_timeout, out=out)
    engine = kvnotes.load(model)
    out.mkdir(parents=True, exist_ok=True)
    target = server.target(max_model_len=4096)
    assert target.launch is not None  # ServerOptions(launch=True)
    result = run_agent(bench, target.launch, engine, out=out, request_timeout_s=request_timeout,
                       command=invocation(),
                       say=say)
    data = result.to_dict()
    paths = write_outputs(data, out)
    if as_json:
        emit_json({k: v for k, v in data.items() if k not in ("cases", "soak_requests")})
    else:
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


@bench_app.command("spliceable")
def spliceable(
    model: Model = "smollm2-135m",
    cases: Annotated[int, typer.Option("--cases", help="New tool lists per round")] = 8,
    tools: Annotated[int, typer.Option("--tools", help="Tools per list")] = 4,
    background: Annotated[str, typer.Option(
        "--background", help="Background clients per round, comma-separated (0: alone)")] = "0,4",
    sightings: Sightings = 2,
    answer_tokens: Annotated[int, typer.Option(
        "--answer-tokens", help="Greedy tokens of each sighting's answer")] = 16,
    learn_timeout: LearnTimeout = 120.0,
    engine_arm: Annotated[bool, typer.Option(
        "--engine/--no-engine", help="Also time the engine's compile of the same chunks")] = True,
    dtype: Dtype = "float32",
    kv_cache_gib: KvCacheGib = default_of(ServerOptions, "kv_cache_gib"),
    startup_timeout: StartupTimeout = default_of(ServerOptions, "startup_timeout"),
    vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = default_of(ServerOptions, "request_timeout"),
    out: Out = Path("out/serve-bench/spliceable"),
) -> None:
    """Time from a tool list's due sighting to its entries being spliceable (vLLM's prefill,
    and the engine's compile of the same chunks) against one exact request, and the share the
    third request splices."""
    import kvnotes
    from kvnotes.core.errors import KvnotesError
    from kvnotes_bench.serving.spliceable import (
        SpliceableConfig,
        report,
        run_spliceable,
        write_outputs,
    )

    if not all(x.strip().isdigit() for x in background.split(",")):
        raise typer.BadParameter(f"--background {background}: give client counts >= 0, "
                                 "comma-separated, e.g. 0,4")
    try:
        config = SpliceableConfig(model=model, cases=cases, tools=tools,
                                  background=tuple(int(x) for x in background.split(",")), after=sightings,
                                  answer_tokens=answer_tokens,
                                  learn_timeout_s=learn_timeout, engine=engine_arm)
    except (KvnotesError, ValueError) as err:
        raise typer.BadParameter(str(err)) from err
    server = ServerOptions(launch=True, model=model, dtype=dtype,
                           block_size=default_of(LearnConfig, "block_size"),
                           kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout,
                           vllm_python=vllm_python, request_timeout=request_timeout, out=out)
    engine = kvnotes.load(model)
    target = server.target(max_model_len=4096)
    assert target.launch is not None  # ServerOptions(launch=True)
    result = run_spliceable(config, target.launch, engine, out=out, command=invocation(),
                            request_timeout_s=request_timeout, say=say)
    paths = write_outputs(result, out)
    typer.echo(report(result))
    typer.echo(f"wrote {paths['json']}, {paths['report']}, {paths['plot']}")
