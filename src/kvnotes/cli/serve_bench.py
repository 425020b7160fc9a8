"""``kvnotes serve-bench``: the serving benchmarks on a real vLLM server."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvnotes.cli.app import app, emit_json, fail, folder_option
from kvnotes.cli.serve import _max_pos
from kvnotes.core.errors import KvnotesError, UnknownNameError


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from err
    if not values:
        raise typer.BadParameter(f"{what} must list at least one integer")
    return values


@app.command("serve-bench")
def serve_bench(
    url: str = typer.Option(None, "--url", help="A running OpenAI-compatible vLLM server on "
                            "this machine, e.g. http://127.0.0.1:8000"),
    launch: bool = typer.Option(False, "--launch", help="Start a vLLM server (from `make vllm`'s "
                                ".venv-vllm) on 127.0.0.1, run, and stop it"),
    model: str = typer.Option("smollm2-135m", "--model", help="Model alias/folder (--launch) "
                              "or the served model name (--url)"),
    context_tokens: str = typer.Option(None, "--context-tokens",
                                       help="Context lengths in tokens, comma-separated "
                                       "(default 1000,4000,8000)"),
    field_depth: float = typer.Option(0.1, "--field-depth", help="Where the field sits (0..1)"),
    sessions: int = typer.Option(4, "--sessions", help="Sessions per run (at least one per "
                                 "concurrent stream)"),
    edits: int = typer.Option(4, "--edits", help="Field edits per session"),
    concurrency: str = typer.Option(None, "--concurrency", help="Concurrency levels (default "
                                    "1,4,16 for erratum, 1,4 for skills)"),
    policies: str = typer.Option(None, "--policies", help="default: in-place,erratum,cold "
                                 "(erratum) or cold,prefix,compose (skills)"),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Tokens generated per answer "
                                   "(default 8; 24 with --question status, since small models "
                                   "restate the question before the status)"),
    time_budget: float = typer.Option(None, "--time-budget", help="Stop sending requests after "
                                      "this many seconds (the rest are reported as skipped)"),
    request_timeout: float = typer.Option(600.0, "--request-timeout"),
    out: Path = typer.Option(Path("out/serve-bench"), "--out"),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON"),
    vllm_python: str = typer.Option(None, "--vllm-python", help="Python of the vLLM environment "
                                    "(default .venv-vllm/bin/python)"),
    kv_cache_gib: float = typer.Option(3.0, "--kv-cache-gib", help="--launch: CPU KV cache size"),
    max_model_len: int = typer.Option(None, "--max-model-len", help="--launch: default fits "
                                      "the longest context"),
    startup_timeout: float = typer.Option(900.0, "--startup-timeout"),
    workload: str = typer.Option("erratum", "--workload", help="erratum: field edits on long "
                                 "contexts; skills: composed skills (cold / prefix / compose)"),
    k: int = typer.Option(4, "--k", help="skills: skills per request"),
    requests: int = typer.Option(16, "--requests", help="skills: requests per row"),
    fidelity_samples: int = typer.Option(20, "--fidelity-samples", help="skills: compose "
                                         "requests checked against the exact prompt"),
    skills_dir: Path = typer.Option(None, "--skills", help="skills: the server's skill folder "
                                    "(with --url: the one given to `kvnotes serve`)"),
    dtype: str = typer.Option("auto", "--dtype", help="--launch: server dtype (auto: bfloat16 "
                              "where the CPU has native bf16, else float32)"),
    block_size: int = typer.Option(None, "--block-size", help="--launch: KV block size in "
                                   "tokens (CPU: a multiple of 32; vLLM's default 128)"),
    requests_per_row: int = typer.Option(None, "--requests-per-row", help="erratum: at least "
                                         "this many measured requests per (context, "
                                         "concurrency, policy) row (--matrix: 16)"),
    matrix: bool = typer.Option(False, "--matrix", help="erratum: the full matrix (contexts "
                                "1k/4k/8k and 16k where the model allows, concurrency 1/4/16, "
                                "all policies, 16 requests per row); explicit options override"),
    question: str = typer.Option("decision", "--question", help="erratum: what each request "
                                 "asks: decision (the refund the policy implies) or status "
                                 "(the field's current value, to see whether an edit is read)"),
    errata: str = typer.Option(
        "follow-up-latest", "--errata",
        help="erratum: how edits are written: follow-up-latest (the default: the question "
             "first, as first asked, then one correction from the context's value to the current "
             "one and a re-ask), follow-up (each correction after the previous request), append "
             "(one correction per edit so far, then the question) or latest (one correction, "
             "then the question)"),
    no_anchor: bool = typer.Option(False, "--no-anchor", help="skills: compile each policy alone "
                                   "instead of behind the system header (for comparison)"),
) -> None:
    """Erratum vs in-place vs cold (--workload erratum) or composed skills vs prefix caching vs
    cold (--workload skills) on a real vLLM server: TTFT, hit rate, fidelity."""
    if workload == "skills":
        return _skills_bench(url=url, launch=launch, model=model, k=k, requests=requests,
                             concurrency=concurrency or "1,4", policies=policies,
                             fidelity_samples=fidelity_samples, skills_dir=skills_dir,
                             dtype=dtype, block_size=block_size, out=out, as_json=as_json,
                             vllm_python=vllm_python, kv_cache_gib=kv_cache_gib,
                             startup_timeout=startup_timeout,
                             request_timeout=request_timeout, no_anchor=no_anchor)
    if workload != "erratum":
        raise UnknownNameError("workload", workload, ("erratum", "skills"))
    from kvnotes.bench.serving.erratum import (
        MATRIX_CONCURRENCY,
        MATRIX_CONTEXTS,
        MATRIX_OPTIONAL_CONTEXTS,
        MATRIX_REQUESTS_PER_ROW,
        BenchConfig,
        run_benchmark,
    )
    from kvnotes.bench.serving.report import markdown_table, write_outputs
    from kvnotes.serving.client import Client
    from kvnotes.serving.export import export_hf_dir
    from kvnotes.serving.server import VLLMServer

    if bool(url) == bool(launch):
        raise typer.BadParameter("pass exactly one of --url URL or --launch")
    if url and block_size is not None:
        raise typer.BadParameter("--block-size applies to a server kvnotes launches (--launch); "
                                 "a running server's block size is read from its /metrics")
    contexts = (_ints(context_tokens, "--context-tokens") if context_tokens
                else MATRIX_CONTEXTS)
    concurrency = concurrency or ",".join(map(str, MATRIX_CONCURRENCY))
    optional = MATRIX_OPTIONAL_CONTEXTS if matrix and not context_tokens else ()
    per_row = requests_per_row if requests_per_row is not None else (
        MATRIX_REQUESTS_PER_ROW if matrix else 0)
    try:
        config = BenchConfig(model=model if url else Path(model).name if Path(model).exists()
                             else model,
                             context_tokens=contexts, field_depth=field_depth,
                             sessions=sessions, edits=edits,
                             concurrency=_ints(concurrency, "--concurrency"),
                             policies=tuple(p.strip() for p in (policies or "in-place,erratum,cold"
                                                                 ).split(",") if p.strip()),
                             max_tokens=(max_tokens if max_tokens is not None
                                         else 24 if question == "status" else 8),
                             request_timeout_s=request_timeout,
                             time_budget_s=time_budget, requests_per_row=per_row,
                             optional_contexts=optional, block_size=block_size,
                             question=question, errata=errata)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err

    def log(line: str) -> None:
        typer.echo(line, err=True)

    try:
        if url:
            result = run_benchmark(Client(url, timeout=request_timeout), config, log=log)
        else:
            from kvnotes.serving.launch import cpu_dtype

            served_dtype = cpu_dtype() if dtype == "auto" else dtype
            folder = export_hf_dir(model, dtype=served_dtype)
            # room for the longest prompt: context + errata + question + answer
            needed = max(contexts + optional) + 120 + 30 * edits + config.max_tokens
            mml = max_model_len or min(max(4096, -(-needed // 1024) * 1024), _max_pos(folder))
            out.mkdir(parents=True, exist_ok=True)
            log(f"starting vLLM on {folder} ({served_dtype}, max-model-len {mml}, block size "
                f"{block_size or 'default'}); log: {out / 'server.log'}")
            t0 = time.monotonic()
            server = VLLMServer(folder, served_name=config.model, python=vllm_python,
                                log_path=out / "server.log", max_model_len=mml,
                                dtype=served_dtype, kv_cache_gib=kv_cache_gib,
                                startup_timeout=startup_timeout,
                                extra_args=["--block-size", str(block_size)] if block_size
                                else ())
            with server:
                log(f"server up at {server.url} (pid {server.pid}) after "
                    f"{time.monotonic() - t0:.0f} s")
                result = run_benchmark(Client(server.url, timeout=request_timeout), config,
                                       log=log)
            result["launch"] = {"startup_s": server.startup_s, "pid": server.pid,
                                "max_model_len": mml, "model_dir": str(folder),
                                "dtype": served_dtype, "block_size": block_size,
                                "stopped": not server.alive_pids(), "command": server.cmd}
            log(f"server stopped (pid {server.pid})")
    except KvnotesError as err:
        fail(err)
        return
    paths = write_outputs(result, out)
    if as_json:
        emit_json({k: v for k, v in result.items() if k != "requests"})
    else:
        typer.echo(markdown_table(result))
        typer.echo(f"\nwrote {paths['json']}, {paths['report']}, {paths['plot']}")




def _skills_bench(*, url: str | None, launch: bool, model: str, k: int, requests: int,
                  concurrency: str, policies: str | None, fidelity_samples: int,
                  skills_dir: Path | None, dtype: str, block_size: int | None, out: Path,
                  as_json: bool, vllm_python: str | None, kv_cache_gib: float,
                  startup_timeout: float, request_timeout: float, no_anchor: bool) -> None:
    import kvnotes
    from kvnotes.bench.serving.skills import (
        SKILL_POLICIES,
        SkillsBenchConfig,
        markdown,
        run_skills_benchmark,
        skill_texts,
        write_outputs,
    )
    from kvnotes.serving.compose_client import ComposeClient
    from kvnotes.serving.launch import compose_server, cpu_dtype
    from kvnotes.serving.skills import ServingSkills

    if bool(url) == bool(launch):
        raise typer.BadParameter("pass exactly one of --url URL or --launch")
    if url and skills_dir is None:
        raise typer.BadParameter("--workload skills --url needs --skills DIR: the folder the "
                                 "server was started with (the benchmark registers its skills)")
    out = folder_option(out, "--out")
    config = SkillsBenchConfig(
        model=model, k=k, requests=requests, concurrency=_ints(concurrency, "--concurrency"),
        policies=tuple(p.strip() for p in (policies or ",".join(SKILL_POLICIES)).split(",")
                       if p.strip()), fidelity_samples=fidelity_samples)
    engine = kvnotes.load(model)

    def log(line: str) -> None:
        typer.echo(line, err=True)

    def register(skills: ServingSkills) -> None:
        from kvnotes.apps.agent.prompt import HEADER

        skills.add(HEADER, name="header")
        for name, text in skill_texts().items():
            # anchored: each policy compiled behind the header every request starts with
            info = skills.add(text, name=name, after=None if no_anchor else HEADER)
            log(f"skill {name}: {len(info)} tokens (first position {info.origin})")

    server_info: dict[str, object] = {}
    if url:
        register(ServingSkills(skills_dir, engine))
        time.sleep(1.0)  # the connector rescans its folder at most every 0.25 s
        client = ComposeClient(url, model, engine.tokenizer, timeout=request_timeout)
        result = run_skills_benchmark(client, config, log=log)
    else:
        out.mkdir(parents=True, exist_ok=True)
        lib_dir = skills_dir or out / "skills"
        served = cpu_dtype() if dtype == "auto" else dtype
        server, skills = compose_server(engine, model, lib_dir, dtype=served,
                                        block_size=block_size, kv_cache_gib=kv_cache_gib,
                                        python=vllm_python, log_path=out / "server.log",
                                        startup_timeout=startup_timeout)
        register(skills)
        log(f"starting vLLM ({served}) with the kvnotes connector; log: {out / 'server.log'}")
        with server:
            log(f"server up at {server.url} after {server.startup_s:.0f} s")
            client = ComposeClient(server.url, server.served_name, engine.tokenizer,
                                   timeout=request_timeout)
            result = run_skills_benchmark(client, config, log=log)
        server_info = {"dtype": served, "block_size": block_size or 128,
                       "startup_s": server.startup_s, "command": server.cmd,
                       "stopped": not server.alive_pids()}
    result["server"] = server_info
    result["skills_anchor"] = "none" if no_anchor else "header"
    paths = write_outputs(result, out)
    if as_json:
        emit_json({k_: v for k_, v in result.items() if k_ != "requests"})
    else:
        typer.echo(markdown(result))
        typer.echo(f"wrote {paths['json']}, {paths['report']}, {paths['plot']}")
