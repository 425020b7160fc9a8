"""``kvnotes-bench serve erratum|skills|soak|agent``: the serving benchmarks on a real vLLM server.

The subcommands take the same server options (``--url`` of a running loopback server, or
``--launch`` to have kvnotes start one through :mod:`kvnotes.serving.launch.launcher`), gathered in
:class:`ServerOptions`; each workload's own options become its config dataclass
(:class:`~kvnotes_bench.serving.erratum.ErratumBenchConfig` here, the others in
:mod:`~kvnotes_bench.cli.serve_bench_skills`, :mod:`~kvnotes_bench.cli.serve_bench_soak` and
:mod:`~kvnotes_bench.cli.serve_bench_agent`), which validates them; an option's default is read from
that dataclass (:func:`~kvnotes.cli.options.default_of`), never written twice.

Examples::

    kvnotes-bench serve erratum --launch --matrix --kv-cache-gib 12 --out out/serve-bench/matrix
    kvnotes-bench serve erratum --url http://127.0.0.1:8000 --context-tokens 8000 --concurrency 1
    kvnotes-bench serve skills --launch --model smollm2-135m --concurrency 1,4 --dtype float32
    kvnotes-bench serve soak --duration 180 --clients 8 --corun --out out/serve-bench/soak
    kvnotes-bench serve agent --model smollm2-135m --library-cap 8MiB --out out/serve-bench/agent
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvnotes.cli.app import emit_json, folder_option
from kvnotes.cli.options import default_of
from kvnotes.serving.launch.launcher import LaunchConfig
from kvnotes_bench.cli.app import app
from kvnotes_bench.serving.erratum import ErratumBenchConfig

if TYPE_CHECKING:  # the runs are imported when a command runs; the configs hold the defaults
    from kvnotes_bench.serving.runs import Target

Written = tuple[dict[str, Any], dict[str, Path]]  # a result's JSON form and the files written

bench_app = typer.Typer(help="Serving benchmarks on a real vLLM server on this machine: "
                        "TTFT, hit rate, errors, fidelity.", no_args_is_help=True)
app.add_typer(bench_app, name="serve")


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


def int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from err
    if not values:
        raise typer.BadParameter(f"{what} must list at least one integer")
    return values


def name_list(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return default if text is None else tuple(p.strip() for p in text.split(",") if p.strip())


def token_counts(text: str | None) -> tuple[int, ...]:
    """``--repair-variants``' token counts (``"16,8"``); a bad one raises InvalidArgumentError."""
    from kvnotes.core.errors import InvalidArgumentError

    out = []
    for part in name_list(text, ()):
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
    model: str = default_of(LaunchConfig, "model")
    dtype: str = default_of(LaunchConfig, "dtype")
    block_size: int | None = None
    kv_cache_gib: int = 3  # a benchmark's server holds more than kvnotes serve's default
    startup_timeout: float = default_of(LaunchConfig, "startup_timeout")
    vllm_python: str | None = None
    request_timeout: float = 600.0
    out: Path = Path("out/serve-bench")

    def __post_init__(self) -> None:
        from kvnotes_bench.serving.erratum import validate_block_size

        if bool(self.url) == bool(self.launch):
            raise typer.BadParameter("pass exactly one of --url URL or --launch")
        if self.url and self.block_size is not None:
            raise typer.BadParameter("--block-size applies to a server kvnotes launches "
                                     "(--launch); a running server's block size is read from "
                                     "its /metrics")
        validate_block_size(self.block_size)
        folder_option(self.out, "--out")

    def target(self, *, max_model_len: int | None = None) -> Target:
        """The :class:`~kvnotes_bench.serving.runs.Target` of these options (``max_model_len``
        None: fitted to the workload by the runner)."""
        from kvnotes.serving.launch.launcher import LaunchConfig
        from kvnotes_bench.serving.runs import Target

        if self.url:
            return Target(url=self.url, request_timeout_s=self.request_timeout)
        launch = LaunchConfig(model=self.model, dtype=self.dtype, block_size=self.block_size,
                              kv_cache_gib=self.kv_cache_gib, max_model_len=max_model_len,
                              log_path=self.out / "server.log",
                              startup_timeout=self.startup_timeout, vllm_python=self.vllm_python)
        return Target(launch=launch, request_timeout_s=self.request_timeout)


def say(line: str) -> None:
    typer.echo(line, err=True)


def print_result(data: dict[str, Any], paths: dict[str, Path], table: str, as_json: bool) -> None:
    if as_json:
        emit_json({k: v for k, v in data.items() if k != "requests"})
    else:
        typer.echo(table)
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")


# ---- the erratum ------------------------------------------------------------------------------
def _erratum(name: str) -> Any:
    """A default of :class:`ErratumBenchConfig`: the option's."""
    return default_of(ErratumBenchConfig, name)


def _server(name: str) -> Any:
    """A default of :class:`ServerOptions`: the option's."""
    return default_of(ServerOptions, name)


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
        from kvnotes_bench.serving.report import write_outputs
        from kvnotes_bench.serving.runs import run_erratum

        result = run_erratum(self.bench, self.server.target(max_model_len=self.max_model_len),
                             log=say)
        data = result.to_dict()
        return data, write_outputs(data, self.server.out)


@bench_app.command("erratum")
def erratum(
    url: Url = None, launch: Launch = False, model: Model = _erratum("model"),
    context_tokens: Annotated[str | None, typer.Option(
        "--context-tokens", help="Context lengths in tokens, comma-separated (default "
        "1000,4000,8000)")] = None,
    field_depth: Annotated[float, typer.Option("--field-depth",
                                               help="Where the field sits (0..1)")] = (
        _erratum("field_depth")),
    sessions: Annotated[int, typer.Option("--sessions", help="Sessions per row (at least one "
                                          "per concurrent stream)")] = _erratum("sessions"),
    edits: Annotated[int, typer.Option("--edits", help="Field edits per session")] = _erratum("edits"),
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
        "or status (the field's current value, to see whether an edit is read)")] = (
        _erratum("question")),
    errata: Annotated[str, typer.Option(
        "--errata", help="How edits are written: follow-up-latest (the default: the question "
        "first, as first asked, then one correction from the context's value to the current "
        "one and a re-ask), follow-up (each correction after the previous request), append "
        "(one correction per edit so far, then the question) or latest (one correction, then "
        "the question)")] = _erratum("errata"),
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", help="--launch: default fits the longest context")] = None,
    dtype: Dtype = _server("dtype"), block_size: BlockSize = None,
    kv_cache_gib: KvCacheGib = _server("kv_cache_gib"),
    startup_timeout: StartupTimeout = _server("startup_timeout"), vllm_python: VllmPython = None,
    request_timeout: RequestTimeout = _server("request_timeout"), out: Out = _server("out"),
    as_json: AsJson = False,
) -> None:
    """Erratum vs in-place vs cold on a vLLM prefix cache: TTFT, hit rate, answers.

    Long sessions whose one field is edited again and again; each edit sent as an erratum, in
    place, and cold (nothing reused)."""
    from kvnotes_bench.serving.erratum import (
        MATRIX_CONCURRENCY,
        MATRIX_CONTEXTS,
        MATRIX_OPTIONAL_CONTEXTS,
        MATRIX_REQUESTS_PER_ROW,
    )
    from kvnotes_bench.serving.report import markdown_table
    from kvnotes_bench.serving.workload import POLICIES

    server = ServerOptions(
        url=url, launch=launch, model=model, dtype=dtype, block_size=block_size,
        kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout, vllm_python=vllm_python,
        request_timeout=request_timeout, out=out)
    per_row = requests_per_row if requests_per_row is not None else (
        MATRIX_REQUESTS_PER_ROW if matrix else 0)
    bench = ErratumBenchConfig(
        model=model,
        context_tokens=(int_list(context_tokens, "--context-tokens") if context_tokens
                        else MATRIX_CONTEXTS),
        optional_contexts=MATRIX_OPTIONAL_CONTEXTS if matrix and not context_tokens else (),
        field_depth=field_depth, sessions=sessions, edits=edits,
        concurrency=(int_list(concurrency, "--concurrency") if concurrency
                     else MATRIX_CONCURRENCY),
        policies=name_list(policies, POLICIES),
        max_tokens=(max_tokens if max_tokens is not None
                    else 24 if question == "status" else 8),
        request_timeout_s=request_timeout, time_budget_s=time_budget, requests_per_row=per_row,
        block_size=block_size, question=question, errata=errata)
    data, paths = ErratumCommand(bench=bench, server=server, max_model_len=max_model_len).run()
    print_result(data, paths, markdown_table(data), as_json)
