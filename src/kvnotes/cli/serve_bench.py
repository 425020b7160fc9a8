"""``kvnotes serve-bench erratum|skills|soak|agent``: the serving benchmarks on a real vLLM server.

Both subcommands take the same server options (``--url`` of a running loopback server, or
``--launch`` to have kvnotes start one through :mod:`kvnotes.serving.launch.launcher`), gathered in
:class:`ServerOptions`; each workload's own options become its config dataclass
(:class:`~kvnotes.bench.serving.erratum.ErratumBenchConfig`,
:class:`~kvnotes.bench.serving.skills_config.SkillsBenchConfig`), which validates them.

Examples::

    kvnotes serve-bench erratum --launch --matrix --kv-cache-gib 12 --out out/serve-bench/matrix
    kvnotes serve-bench erratum --url http://127.0.0.1:8000 --context-tokens 8000 --concurrency 1
    kvnotes serve-bench skills --launch --model smollm2-135m --concurrency 1,4 --dtype float32
    kvnotes serve-bench soak --duration 180 --clients 8 --corun --out out/serve-bench/soak
    kvnotes serve-bench agent --model smollm2-135m --library-cap 8MiB --out out/serve-bench/agent
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvnotes.cli.app import app, emit_json, folder_option
from kvnotes.serving.front.config import DEFAULT_COMPILE_NICE

if TYPE_CHECKING:  # the CLI starts fast: the benchmarks are imported when a command runs
    from kvnotes.bench.serving.corun import CorunConfig
    from kvnotes.bench.serving.erratum import ErratumBenchConfig
    from kvnotes.bench.serving.runs import Target
    from kvnotes.bench.serving.skills_config import SkillsBenchConfig
    from kvnotes.bench.serving.soak_workload import SoakConfig

Written = tuple[dict[str, Any], dict[str, Path]]  # a result's JSON form and the files written

bench_app = typer.Typer(help="Serving benchmarks on a real vLLM server on this machine: "
                        "TTFT, hit rate, errors, fidelity.", no_args_is_help=True)
app.add_typer(bench_app, name="serve-bench")


# ---- options both workloads take --------------------------------------------------------------
Url = Annotated[str | None, typer.Option(
    "--url", help="A running OpenAI-compatible vLLM server on this machine, e.g. "
    "http://127.0.0.1:8000")]
Launch = Annotated[bool, typer.Option(
    "--launch", help="Start a vLLM server (from `make vllm`'s .venv-vllm) on 127.0.0.1, run, "
    "and stop it")]
Model = Annotated[str, typer.Option(
    "--model", help="Model alias/folder (--launch) or the served model name (--url)")]
Dtype = Annotated[str, typer.Option(
    "--dtype", help="--launch: server dtype (auto: bfloat16 where the CPU has native bf16, "
    "else float32)")]
BlockSize = Annotated[int | None, typer.Option(
    "--block-size", help="--launch: KV block size in tokens (CPU: a multiple of 32; vLLM's "
    "default 128)")]
KvCacheGib = Annotated[int, typer.Option("--kv-cache-gib", help="--launch: CPU KV cache, "
                                                                "whole GiB")]
StartupTimeout = Annotated[float, typer.Option("--startup-timeout")]
VllmPython = Annotated[str | None, typer.Option(
    "--vllm-python", help="Python of the vLLM environment (default .venv-vllm/bin/python)")]
RequestTimeout = Annotated[float, typer.Option("--request-timeout",
                                               help="Seconds one request may take")]
Out = Annotated[Path, typer.Option("--out", help="Folder of the result, report, plot and the "
                                                 "launched server's log")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON")]


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from err
    if not values:
        raise typer.BadParameter(f"{what} must list at least one integer")
    return values


def _names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return default if text is None else tuple(p.strip() for p in text.split(",") if p.strip())


def _counts(text: str | None) -> tuple[int, ...]:
    """``--repair-variants``' token counts (``"16,8"``); a bad one raises InvalidArgumentError."""
    from kvnotes.core.errors import InvalidArgumentError

    out = []
    for part in _names(text, ()):
        if not part.isdigit():
            raise InvalidArgumentError(f"--repair-variants {text}: give token counts >= 0, "
                                       "comma-separated, e.g. 16,8")
        out.append(int(part))
    return tuple(out)


@dataclass(frozen=True)
class ServerOptions:
    """The server options of both subcommands: where the requests go and how a launched server
    is started."""

    url: str | None = None
    launch: bool = False
    model: str = "smollm2-135m"
    dtype: str = "auto"
    block_size: int | None = None
    kv_cache_gib: int = 3
    startup_timeout: float = 900.0
    vllm_python: str | None = None
    request_timeout: float = 600.0
    out: Path = Path("out/serve-bench")

    def __post_init__(self) -> None:
        from kvnotes.bench.serving.erratum import validate_block_size

        if bool(self.url) == bool(self.launch):
            raise typer.BadParameter("pass exactly one of --url URL or --launch")
        if self.url and self.block_size is not None:
            raise typer.BadParameter("--block-size applies to a server kvnotes launches "
                                     "(--launch); a running server's block size is read from "
                                     "its /metrics")
        validate_block_size(self.block_size)
        folder_option(self.out, "--out")

    def target(self, *, max_model_len: int | None = None) -> Target:
        """The :class:`~kvnotes.bench.serving.runs.Target` of these options (``max_model_len``
        None: fitted to the workload by the runner)."""
        from kvnotes.bench.serving.runs import Target
        from kvnotes.serving.launch.launcher import LaunchConfig

        if self.url:
            return Target(url=self.url, request_timeout_s=self.request_timeout)
        launch = LaunchConfig(model=self.model, dtype=self.dtype, block_size=self.block_size,
                              kv_cache_gib=self.kv_cache_gib, max_model_len=max_model_len,
                              log_path=self.out / "server.log",
                              startup_timeout=self.startup_timeout, vllm_python=self.vllm_python)
        return Target(launch=launch, request_timeout_s=self.request_timeout)


def _log(line: str) -> None:
    typer.echo(line, err=True)


def _print(data: dict[str, Any], paths: dict[str, Path], table: str, as_json: bool) -> None:
    if as_json:
        emit_json({k: v for k, v in data.items() if k != "requests"})
    else:
        typer.echo(table)
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


# ---- the erratum ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErratumCommand:
    """What ``serve-bench erratum`` runs: the benchmark's config, the server, and the launched
    server's context length (None: fitted to the longest prompt)."""

    bench: ErratumBenchConfig
    server: ServerOptions
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and not self.server.launch:
            raise typer.BadParameter("--max-model-len applies to a server kvnotes launches "
                                     "(--launch); a running server's is read from /v1/models")

    def run(self) -> Written:
        """Run it and write the bundle in ``--out``."""
        from kvnotes.bench.serving.report import write_outputs
        from kvnotes.bench.serving.runs import run_erratum

        result = run_erratum(self.bench, self.server.target(max_model_len=self.max_model_len),
                             log=_log)
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("erratum")
def erratum(
    url: Url = None, launch: Launch = False, model: Model = "smollm2-135m",
    context_tokens: Annotated[str | None, typer.Option(
        "--context-tokens", help="Context lengths in tokens, comma-separated (default "
        "1000,4000,8000)")] = None,
    field_depth: Annotated[float, typer.Option("--field-depth",
                                               help="Where the field sits (0..1)")] = 0.1,
    sessions: Annotated[int, typer.Option("--sessions", help="Sessions per row (at least one "
                                          "per concurrent stream)")] = 4,
    edits: Annotated[int, typer.Option("--edits", help="Field edits per session")] = 4,
    concurrency: Annotated[str | None, typer.Option(
        "--concurrency", help="Concurrency levels, comma-separated (default 1,4,16)")] = None,
    policies: Annotated[str | None, typer.Option(
        "--policies", help="Policies, comma-separated (default in-place,erratum,cold)")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Tokens generated per answer (default 8; 24 with --question "
        "status, since small models restate the question before the status)")] = None,
    time_budget: Annotated[float | None, typer.Option(
        "--time-budget", help="Stop sending requests after this many seconds (the rest are "
        "reported as skipped)")] = None,
    requests_per_row: Annotated[int | None, typer.Option(
        "--requests-per-row", help="At least this many measured requests per (context, "
        "concurrency, policy) row (--matrix: 16)")] = None,
    matrix: Annotated[bool, typer.Option(
        "--matrix", help="The full matrix (contexts 1k/4k/8k and 16k where the model allows, "
        "concurrency 1/4/16, all policies, 16 requests per row); explicit options "
        "override")] = False,
    question: Annotated[str, typer.Option(
        "--question", help="What each request asks: decision (the refund the policy implies) "
        "or status (the field's current value, to see whether an edit is read)")] = "decision",
    errata: Annotated[str, typer.Option(
        "--errata", help="How edits are written: follow-up-latest (the default: the question "
        "first, as first asked, then one correction from the context's value to the current "
        "one and a re-ask), follow-up (each correction after the previous request), append "
        "(one correction per edit so far, then the question) or latest (one correction, then "
        "the question)")] = "follow-up-latest",
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", help="--launch: default fits the longest context")] = None,
    dtype: Dtype = "auto", block_size: BlockSize = None, kv_cache_gib: KvCacheGib = 3,
    startup_timeout: StartupTimeout = 900.0, vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = 600.0, out: Out = Path("out/serve-bench"),
    as_json: AsJson = False,
) -> None:
    """Erratum vs in-place vs cold on a vLLM prefix cache: TTFT, hit rate, answers.

    Long sessions whose one field is edited again and again; each edit sent as an erratum, in
    place, and cold (nothing reused)."""
    from kvnotes.bench.serving.erratum import (
        MATRIX_CONCURRENCY,
        MATRIX_CONTEXTS,
        MATRIX_OPTIONAL_CONTEXTS,
        MATRIX_REQUESTS_PER_ROW,
        ErratumBenchConfig,
    )
    from kvnotes.bench.serving.report import markdown_table
    from kvnotes.bench.serving.workload import POLICIES

    server = ServerOptions(
        url=url, launch=launch, model=model, dtype=dtype, block_size=block_size,
        kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout, vllm_python=vllm_python,
        request_timeout=request_timeout, out=out)
    per_row = requests_per_row if requests_per_row is not None else (
        MATRIX_REQUESTS_PER_ROW if matrix else 0)
    bench = ErratumBenchConfig(
        model=model,
        context_tokens=(_ints(context_tokens, "--context-tokens") if context_tokens
                        else MATRIX_CONTEXTS),
        optional_contexts=MATRIX_OPTIONAL_CONTEXTS if matrix and not context_tokens else (),
        field_depth=field_depth, sessions=sessions, edits=edits,
        concurrency=(_ints(concurrency, "--concurrency") if concurrency
                     else MATRIX_CONCURRENCY),
        policies=_names(policies, POLICIES),
        max_tokens=(max_tokens if max_tokens is not None
                    else 24 if question == "status" else 8),
        request_timeout_s=request_timeout, time_budget_s=time_budget, requests_per_row=per_row,
        block_size=block_size, question=question, errata=errata)
    data, paths = ErratumCommand(bench=bench, server=server, max_model_len=max_model_len).run()
    _print(data, paths, markdown_table(data), as_json)


# ---- the skills -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SkillsCommand:
    """What ``serve-bench skills`` runs: the benchmark's config, the server, the skill folder
    the library is published to, and whether skills are compiled behind the system header."""

    bench: SkillsBenchConfig
    server: ServerOptions
    skills_dir: Path | None = None
    anchor: bool = True

    def __post_init__(self) -> None:
        if self.server.url and self.skills_dir is None:
            raise typer.BadParameter("serve-bench skills --url needs --skills DIR: the folder "
                                     "the server was started with (the benchmark publishes its "
                                     "skills there)")
        if self.server.url and self.bench.via == "front":
            raise typer.BadParameter("--via front needs --launch: the benchmark starts the "
                                     "front and reaches the vLLM behind it for the exact answers")
        if self.skills_dir is not None:
            folder_option(self.skills_dir, "--skills")

    def run(self) -> Written:
        """Run it and write the bundle in ``--out``."""
        import kvnotes
        from kvnotes.bench.serving.runs import run_skills
        from kvnotes.bench.serving.skills_report import write_outputs

        engine = kvnotes.load(self.server.model)
        self.server.out.mkdir(parents=True, exist_ok=True)
        # the longest prompt a BFCL set keeps (multi_turn manuals run to ~6k tokens), within
        # what the model was trained on
        longest = max(4096, self.bench.max_context)
        limit = engine.adapter.max_positions
        target = self.server.target(max_model_len=min(longest, limit) if limit else longest)
        result = run_skills(self.bench, target, engine,
                            skills_dir=self.skills_dir or self.server.out / "skills",
                            anchor=self.anchor, log=_log)
        result = dataclasses.replace(result, command="kvnotes " + " ".join(
            shlex.quote(a) for a in sys.argv[1:]))
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("skills")
def skills(
    url: Url = None, launch: Launch = False, model: Model = "smollm2-135m",
    k: Annotated[int, typer.Option("--k", help="Skills per request")] = 4,
    requests: Annotated[int, typer.Option("--requests", help="Requests per row")] = 16,
    concurrency: Annotated[str | None, typer.Option(
        "--concurrency", help="Concurrency levels, comma-separated (default 1,4)")] = None,
    policies: Annotated[str | None, typer.Option(
        "--policies", help="Policies, comma-separated, of cold, prefix, compose (bare splice), "
        "repaired (each skill's first --repair tokens computed by vLLM in phases, aligned to the "
        "block size), guarded (repaired, answered exactly when the first token is a close "
        "call), variants (repaired, each skill also compiled behind the header and the skill "
        "that precedes it in the run's requests; needs --via front), variants-guarded "
        "(variants with the guard: the front's default when its library holds variants; "
        "needs --via front); default all but the variants ones")] = None,
    fidelity_samples: Annotated[int, typer.Option(
        "--fidelity-samples", help="Prompts each spliced policy (compose, repaired, guarded, "
        "variants, variants-guarded) answers, checked against the exact prompt")] = 20,
    guard_tau: Annotated[float | None, typer.Option(
        "--guard-tau", help="The guard's top-1 minus top-2 log-prob margin (default: chosen "
        "on --calibration-samples development prompts)")] = None,
    calibration_samples: Annotated[int, typer.Option(
        "--calibration-samples", help="Development prompts the guard's tau is chosen on")] = 6,
    skills_dir: Annotated[Path | None, typer.Option(
        "--skills", help="The server's skill folder (with --url: the one given to `kvnotes "
        "serve`; --launch default: OUT/skills)")] = None,
    no_anchor: Annotated[bool, typer.Option(
        "--no-anchor", help="Compile each policy alone instead of behind the system header "
        "(for comparison)")] = False,
    prompts: Annotated[str, typer.Option(
        "--prompts", help="What the requests are: airline (the agent's policies, --k per "
        "prompt, a customer's question), bfcl (BFCL live_multiple development cases: each "
        "function description a skill; the decision is the function name answered) or "
        "bfcl-multi_turn (BFCL multi_turn cases: each class's API manual a skill)")] = "airline",
    cases: Annotated[int, typer.Option(
        "--cases", help="--prompts bfcl*: cases spread over the set (as `kvnotes bench tools`)")
    ] = 40,
    max_context: Annotated[int, typer.Option(
        "--max-context", help="--prompts bfcl*: skip (and count) cases longer than this (the "
        "server's --max-model-len is at least this)")] = 2048,
    fidelity_concurrency: Annotated[str, typer.Option(
        "--fidelity-concurrency", help="Fidelity requests in flight at once, comma-separated "
        "levels (each a full fidelity pass)")] = "1",
    repair: Annotated[int, typer.Option(
        "--repair", help="The phased policies (repaired, guarded, variants*): tokens computed "
        "in context at the start of each "
        "spliced skill (rounded up to the block size)")] = 32,
    engine_check: Annotated[bool, typer.Option(
        "--engine-check", help="Also compose the fidelity prompts in kvnotes' engine from the "
        "notebooks the server splices, and count the server's answers equal to the engine's "
        "(after the server stops)")] = False,
    recheck_engine: Annotated[bool, typer.Option(
        "--recheck-engine", help="Start no server: run the engine check on the skills run "
        "stored in --out (its results.json and skills/), and rewrite its report")] = False,
    via: Annotated[str, typer.Option(
        "--via", help="Where the measured requests go: vllm (token ids planned by "
        "ComposeClient) or front (text prompts to kvnotes' OpenAI front, which plans them; "
        "needs --launch)")] = "vllm",
    dtype: Dtype = "auto", block_size: BlockSize = None, kv_cache_gib: KvCacheGib = 3,
    startup_timeout: StartupTimeout = 900.0, vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = 600.0, out: Out = Path("out/serve-bench"),
    as_json: AsJson = False,
) -> None:
    """Composed skills vs prefix caching vs cold inside vLLM: TTFT, hit rate, fidelity.

    Skills are spliced by kvnotes' connector, bare (compose) or with each skill's first tokens
    computed in context by phased requests (repaired, guarded); fidelity compares each
    spliced policy's answers with the same prompts sent exactly."""
    from kvnotes.bench.serving.skills_config import DEFAULT_POLICIES, SkillsBenchConfig
    from kvnotes.bench.serving.skills_report import markdown

    if recheck_engine:
        if url or launch:
            raise typer.BadParameter("--recheck-engine starts no server: drop --url and "
                                     "--launch (it reads the run stored in --out)")
        data, paths = _recheck_skills(model, out, skills_dir)
        _print(data, paths, markdown(data), as_json)
        return
    server = ServerOptions(
        url=url, launch=launch, model=model, dtype=dtype, block_size=block_size,
        kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout, vllm_python=vllm_python,
        request_timeout=request_timeout, out=out)
    bench = SkillsBenchConfig(
        model=model, k=k, requests=requests,
        concurrency=_ints(concurrency, "--concurrency") if concurrency else (1, 4),
        policies=_names(policies, DEFAULT_POLICIES), fidelity_samples=fidelity_samples,
        guard_tau=guard_tau, calibration_samples=calibration_samples, prompts=prompts,
        cases=cases, max_context=max_context, via=via, repair=repair, engine_check=engine_check,
        fidelity_concurrency=_ints(fidelity_concurrency, "--fidelity-concurrency"))
    data, paths = SkillsCommand(bench=bench, server=server, skills_dir=skills_dir,
                                anchor=not no_anchor).run()
    _print(data, paths, markdown(data), as_json)


def _recheck_skills(model: str, out: Path, skills_dir: Path | None) -> Written:
    """The engine check of the skills run stored in ``out``, its bundle rewritten."""
    import kvnotes
    from kvnotes.bench.serving.runs import recheck_engine
    from kvnotes.bench.serving.skills_report import write_outputs

    folder_option(out, "--out")
    data = recheck_engine(out, kvnotes.load(model), skills_dir=skills_dir, log=_log)
    return data, write_outputs(data, out)


# ---- the soak ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoakCommand:
    """What ``serve-bench soak`` runs: the soak's config, the launched server's options, and the
    co-running measurement after it (None: skipped)."""

    bench: SoakConfig
    server: ServerOptions
    corun: CorunConfig | None = None
    how: str = ""

    def __post_init__(self) -> None:
        if self.server.url:
            raise typer.BadParameter("serve-bench soak launches its own server (a small KV "
                                     "cache, a skill folder it damages on purpose): drop --url")

    def run(self) -> Written:
        """Run it and write the bundle in ``--out``."""
        import kvnotes
        from kvnotes.bench.serving.soak import run_soak
        from kvnotes.bench.serving.soak_report import write_outputs

        engine = kvnotes.load(self.server.model)
        self.server.out.mkdir(parents=True, exist_ok=True)
        target = self.server.target(max_model_len=self.bench.max_model_len)
        assert target.launch is not None  # __post_init__ refused --url
        result = run_soak(self.bench, target.launch, engine, out=self.server.out,
                          corun=self.corun, request_timeout_s=self.server.request_timeout,
                          how=self.how, say=_log)
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("soak")
def soak(
    model: Model = "smollm2-135m",
    duration: Annotated[float, typer.Option("--duration", help="Seconds the clients keep "
                                            "sending")] = 180.0,
    clients: Annotated[int, typer.Option("--clients", help="Concurrent clients")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Greedy tokens per answer, "
                                            "each checked against the engine")] = 16,
    exact_fraction: Annotated[float, typer.Option("--exact-fraction")] = 0.2,
    volatile_fraction: Annotated[float, typer.Option(
        "--volatile-fraction", help="Requests carrying the volatile skill of the moment")] = 0.3,
    disconnect_fraction: Annotated[float, typer.Option(
        "--disconnect-fraction", help="Requests whose stream is closed after 1-3 chunks")] = 0.1,
    event_interval: Annotated[float, typer.Option(
        "--event-interval", help="Seconds between volatile skills (each published, damaged, "
        "retired)")] = 20.0,
    block_size: Annotated[int, typer.Option("--block-size", help="KV block size (tokens, a "
                                            "multiple of 32)")] = 32,
    kv_blocks: Annotated[int, typer.Option(
        "--kv-blocks", help="KV cache size in blocks: small, so vLLM preempts")] = 96,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    corun: Annotated[bool, typer.Option(
        "--corun", help="Then measure a streamed request's inter-token latency beside spliced "
        "requests, beside the same prompts sent exactly, and alone")] = False,
    corun_seconds: Annotated[float, typer.Option("--corun-seconds",
                                                 help="Seconds per co-running mode")] = 40.0,
    recheck: Annotated[bool, typer.Option(
        "--recheck", help="Start no server: check the answers of the soak in --out again "
        "(its result.json, skills/ and volatile/)")] = False,
    dtype: Dtype = "float32", startup_timeout: StartupTimeout = 900.0,
    vllm_python: VllmPython = None, request_timeout: RequestTimeout = 300.0,
    out: Out = Path("out/serve-bench/soak"), as_json: AsJson = False,
) -> None:
    """The connector under load: concurrent clients, preemption, skills published, deleted and
    corrupted while requests use them, early disconnects; every answer checked against
    kvnotes' engine."""

    from kvnotes.bench.serving.corun import CorunConfig
    from kvnotes.bench.serving.soak_report import markdown
    from kvnotes.bench.serving.soak_workload import SoakConfig

    server = ServerOptions(launch=True, model=model, dtype=dtype, kv_cache_gib=1,
                           startup_timeout=startup_timeout, vllm_python=vllm_python,
                           request_timeout=request_timeout, out=out)
    interval = event_interval
    bench = SoakConfig(model=model, duration_s=duration, clients=clients, max_tokens=max_tokens,
                       exact_fraction=exact_fraction, volatile_fraction=volatile_fraction,
                       disconnect_fraction=disconnect_fraction, event_interval_s=interval,
                       damage_after_s=0.4 * interval, retire_after_s=0.8 * interval,
                       block_size=block_size, kv_blocks=kv_blocks, seed=seed)
    how = "kvnotes " + " ".join(sys.argv[1:])
    if recheck:
        import kvnotes
        from kvnotes.bench.serving.soak import recheck as check_again
        from kvnotes.bench.serving.soak_report import write_outputs

        data = check_again(out, kvnotes.load(model), say=_log)
        paths = write_outputs(data, out)
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")
        return
    data, paths = SoakCommand(bench=bench, server=server, how=how,
                              corun=CorunConfig(seconds=corun_seconds, background=max(
                                  1, clients - 1)) if corun else None).run()
    if as_json:
        emit_json({k: v for k, v in data.items() if k != "requests"})
    else:
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


# ---- agent traffic ----------------------------------------------------------------------------
@bench_app.command("agent")
def agent(
    model: Model = "smollm2-135m",
    parts: Annotated[str | None, typer.Option(
        "--parts", help="Parts to run, comma-separated, of tools (BFCL live_multiple with "
        "tools=), documents (content parts), overhead (TTFT of a miss and beside a compile), "
        "soak (capped library, every answer checked); default all")] = None,
    cases: Annotated[int, typer.Option("--cases", help="BFCL live_multiple development "
                                       "cases")] = 40,
    docs: Annotated[int, typer.Option("--docs", help="Document requests")] = 20,
    docs_k: Annotated[int, typer.Option("--docs-k", help="Documents per request")] = 3,
    sightings: Annotated[int, typer.Option(
        "--learn-after", help="Sightings after which the server learns a chunk (its "
        "--learn-after)")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Greedy tokens per measured "
                                            "answer")] = 16,
    learn_timeout: Annotated[float, typer.Option(
        "--learn-timeout", help="Seconds to wait per case for its chunks to be learned")] = 60.0,
    repeats: Annotated[int, typer.Option("--repeats", help="Pairs per TTFT timing")] = 10,
    learn: Annotated[bool, typer.Option(
        "--learn/--no-learn", help="Serve with learning on (--no-learn: today's front, a "
        "baseline)")] = True,
    library_cap: Annotated[str, typer.Option(
        "--library-cap", help="The soak server's library cap (e.g. 64MiB): below the working "
        "set")] = "64MiB",
    clients: Annotated[int, typer.Option("--clients", help="Soak clients")] = 4,
    pool_tools: Annotated[int, typer.Option(
        "--pool-tools", help="Soak: the tools requests draw from (a seeded sample)")] = 12,
    soak_requests: Annotated[int, typer.Option("--soak-requests",
                                               help="Soak requests in all")] = 200,
    exact_fraction: Annotated[float, typer.Option(
        "--exact-fraction", help="Soak requests sent with splice: false")] = 0.2,
    drift_tau: Annotated[float | None, typer.Option(
        "--drift-tau", help="Soak check: compare greedy answers only up to the first step where "
        "the server's or the engine's top-2 log-prob margin is below this (a near tie; the "
        "answers cut short are counted); default: compared whole")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Sent as kvnotes.tenant")] = None,
    repair: Annotated[str | None, typer.Option(
        "--repair", help="The launched front's repair, as `kvnotes serve --repair` spells it: "
        "K or K@F (default: the front's)")] = None,
    compile_nice: Annotated[int, typer.Option(
        "--learn-compile-nice", min=0, max=19, help="The server's compile thread nice value "
        "(its `kvnotes serve --learn-compile-nice`)")] = DEFAULT_COMPILE_NICE,
    guard: Annotated[str, typer.Option(
        "--guard", help="The launched front's guard, as `kvnotes serve --guard` spells it: auto "
        "(the model's calibrated default), 0 (off) or a margin; the soak runs without")] = "auto",
    repair_variants: Annotated[str | None, typer.Option(
        "--repair-variants", help="Also measure each reordered request spliced with "
        "kvnotes.repair K for these K, comma-separated (e.g. 16,8; no share floor)")] = None,
    dtype: Dtype = "float32", block_size: BlockSize = None, kv_cache_gib: KvCacheGib = 3,
    startup_timeout: StartupTimeout = 900.0, vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = 600.0, out: Out = Path("out/serve-bench/agent"),
    as_json: AsJson = False,
) -> None:
    """Agent traffic through the OpenAI front with learning on: BFCL tools= and documents as
    content parts, learned on sight and spliced in another order, against splice: false; the
    TTFT of a miss and beside a compile; a capped-library soak checked against the engine."""
    import kvnotes
    from kvnotes.bench.serving.agent_traffic import AgentBenchConfig, run_agent
    from kvnotes.bench.serving.agent_traffic_protocol import ProtocolConfig
    from kvnotes.bench.serving.agent_traffic_report import markdown, write_outputs
    from kvnotes.bench.serving.agent_traffic_soak import AgentSoakConfig
    from kvnotes.core.errors import KvnotesError
    from kvnotes.serving.front.config import parse_size

    try:
        bench = AgentBenchConfig(
            model=model, parts=_names(parts, ("tools", "documents", "overhead", "soak")),
            cases=cases, docs=docs, docs_k=docs_k, repeats=repeats, learn=learn,
            library_cap_bytes=parse_size(library_cap), tenant=tenant, repair=repair,
            compile_nice=compile_nice, guard=guard,
            protocol=ProtocolConfig(sightings=sightings, max_tokens=max_tokens,
                                    learn_timeout_s=learn_timeout, seed=seed,
                                    repairs=_counts(repair_variants)),
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
                       command="kvnotes " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                       say=_log)
    data = result.to_dict()
    paths = write_outputs(data, out)
    if as_json:
        emit_json({k: v for k, v in data.items() if k not in ("cases", "soak_requests")})
    else:
        typer.echo(markdown(data))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


@bench_app.command("agent-check")
def agent_check(
    folder: Annotated[Path, typer.Argument(help="A serve-bench agent output folder with a soak "
                                           "run (result.json, soak-requests.jsonl, "
                                           "soak-entries, soak-skills)")],
    drift_tau: Annotated[float | None, typer.Option(
        "--drift-tau", help="The drift rule's threshold (default: the run's own)")] = None,
) -> None:
    """Check a stored agent soak run's answers again against the engine (no server) and
    rewrite its bundle: records, result.json, report and plot."""
    from kvnotes.bench.serving.agent_traffic_recheck import recheck_bundle
    from kvnotes.bench.serving.agent_traffic_report import report
    from kvnotes.core.errors import KvnotesError

    try:
        result = recheck_bundle(folder, drift_tau=drift_tau, say=_log)
    except (KvnotesError, OSError) as err:
        raise typer.BadParameter(str(err)) from err
    typer.echo(report(result))
