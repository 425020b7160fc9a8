"""``kvnotes-bench peers-servers``: kvboost's, vLLM's and kvnotes' servers on the same prompts."""

from __future__ import annotations

import json
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import typer

from kvnotes_bench.cli.app import app


@app.command("peers-servers")
def peers_servers(
    model: str = typer.Option("qwen2.5-coder-0.5b", help="a bundled model, served in float32"),
    prompts: int = typer.Option(24, help="agent prompts (BFCL live_multiple development cases)"),
    seed: int = typer.Option(0, help="of the cases and the tools added to them"),
    target_tokens: int = typer.Option(2000, help="about this many tokens per prompt"),
    concurrency: str = typer.Option("1,4", help="comma-separated concurrencies"),
    servers: str = typer.Option("kvboost,vllm,kvnotes", help="comma-separated, run in turn"),
    peers_python: str = typer.Option(".venv-peers/bin/python", help="kvboost's Python "
                                     "(make peers)"),
    out: Path = typer.Option(Path("out/peers-servers"), help="folder for the JSON, PNG, logs"),
) -> None:
    """TTFT p50/p90, identity with each server's exact answer and errors, per concurrency."""
    from transformers import AutoTokenizer

    from kvnotes.serving.launch.launcher import export_model
    from kvnotes_bench.kit.machine import MachineRecord
    from kvnotes_bench.peers.servers import ServersResult, build_prompts, plot
    from kvnotes_bench.peers.servers_launch import ServersConfig, measure
    from kvnotes_bench.tools.data import load_cases

    config = ServersConfig(model=model, prompts=prompts, seed=seed, target_tokens=target_tokens,
                           concurrency=tuple(int(c) for c in concurrency.split(",")),
                           servers=tuple(s.strip() for s in servers.split(",") if s.strip()),
                           peers_python=peers_python)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(export_model(model, "float32").folder)
    bodies = build_prompts(load_cases("live_multiple"),
                           lambda s: len(tok.encode(s, add_special_tokens=False)),
                           n=prompts, seed=seed, target=target_tokens)
    sizes = [len(tok.encode(tok.apply_chat_template(
        b["messages"], tools=b["tools"], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)) for b in bodies]
    machine = MachineRecord.now()
    result = ServersResult(config.__dict__ | {"concurrency": list(config.concurrency),
                                              "servers": list(config.servers)},
                           datetime.now(UTC).isoformat(timespec="seconds"),
                           shlex.join(["kvnotes-bench", *sys.argv[1:]]), {},
                           [b["id"] for b in bodies], sizes)
    typer.echo(f"{len(bodies)} prompts, {min(sizes)}..{max(sizes)} tokens")
    for name in config.servers:
        typer.echo(f"{name} ...")
        runs, cmd = measure(name, config, bodies, out, typer.echo)
        result.runs += runs
        result.launches[name] = shlex.join(str(c) for c in cmd)
    machine.finish()
    result.machine = machine.to_dict()
    name = f"peers-servers-{model}"
    (out / f"{name}.json").write_text(json.dumps(result.to_dict(), indent=1))
    plot(result, out / f"{name}.png")
    typer.echo(result.table())
    typer.echo(f"wrote {out / name}.json and .png")
