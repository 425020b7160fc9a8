"""``kvnotes serve-bench``: the erratum on a real vLLM server (online prefix-cache benchmark)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvnotes.cli.app import app, emit_json, fail
from kvnotes.core.errors import KvnotesError


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
    context_tokens: str = typer.Option("1000,4000,8000", "--context-tokens",
                                       help="Context lengths in tokens, comma-separated"),
    field_depth: float = typer.Option(0.1, "--field-depth", help="Where the field sits (0..1)"),
    sessions: int = typer.Option(4, "--sessions", help="Sessions per run (at least one per "
                                 "concurrent stream)"),
    edits: int = typer.Option(4, "--edits", help="Field edits per session"),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="Concurrency levels"),
    policies: str = typer.Option("in-place,erratum,cold", "--policies"),
    max_tokens: int = typer.Option(8, "--max-tokens", help="Tokens generated per answer"),
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
) -> None:
    """Erratum vs in-place vs cold on a vLLM prefix cache: TTFT, hit rate, req/s, decisions."""
    from kvnotes.apps.serving import (
        BenchConfig,
        Client,
        VLLMServer,
        export_hf_dir,
        markdown_table,
        run_benchmark,
        write_outputs,
    )

    if bool(url) == bool(launch):
        raise typer.BadParameter("pass exactly one of --url URL or --launch")
    contexts = _ints(context_tokens, "--context-tokens")
    try:
        config = BenchConfig(model=model if url else Path(model).name if Path(model).exists()
                             else model,
                             context_tokens=contexts, field_depth=field_depth,
                             sessions=sessions, edits=edits,
                             concurrency=_ints(concurrency, "--concurrency"),
                             policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
                             max_tokens=max_tokens, request_timeout_s=request_timeout,
                             time_budget_s=time_budget)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err

    def log(line: str) -> None:
        typer.echo(line, err=True)

    try:
        if url:
            result = run_benchmark(Client(url, timeout=request_timeout), config, log=log)
        else:
            folder = export_hf_dir(model)
            # room for the longest prompt: context + errata + question + answer
            needed = max(contexts) + 120 + 30 * edits + max_tokens
            mml = max_model_len or min(max(4096, -(-needed // 1024) * 1024), _max_pos(folder))
            out.mkdir(parents=True, exist_ok=True)
            log(f"starting vLLM on {folder} (max-model-len {mml}); log: {out / 'server.log'}")
            t0 = time.monotonic()
            server = VLLMServer(folder, served_name=config.model, python=vllm_python,
                                log_path=out / "server.log", max_model_len=mml,
                                kv_cache_gib=kv_cache_gib, startup_timeout=startup_timeout)
            with server:
                log(f"server up at {server.url} (pid {server.pid}) after "
                    f"{time.monotonic() - t0:.0f} s")
                result = run_benchmark(Client(server.url, timeout=request_timeout), config,
                                       log=log)
            result["launch"] = {"startup_s": server.startup_s, "pid": server.pid,
                                "max_model_len": mml, "model_dir": str(folder),
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


def _max_pos(folder: Path) -> int:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 1 << 30)
