"""``kvnotes-bench peers``: kvnotes against kvboost on the same weights and prompts."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvnotes_bench.cli.app import app


@app.command("peers")
def peers(
    model: str = typer.Option("smollm2-135m", help="a bundled model (both sides load its HF folder)"),
    split: str = typer.Option("report", help="dev: choose policies on it; report: publish it"),
    cases: int = typer.Option(20, help="cases per workload"),
    reps: int = typer.Option(5, help="timed rounds per case (after one greedy warm-up round)"),
    greedy_tokens: int = typer.Option(16, help="greedy tokens compared with recompute"),
    methods: str | None = typer.Option(None, help="comma-separated: recompute, kvnotes, "
                                       "kvnotes-best, kvnotes:<policy>, kvboost-selective, "
                                       "kvboost-cacheblend, kvboost-selective-rec, "
                                       "kvboost-cacheblend-rec (default: all but kvnotes:*)"),
    best: str = typer.Option("anchor", help="the kvnotes policy of kvnotes-best (chosen on dev)"),
    workloads: str = typer.Option("tools,tools-shuffled,docs,chat", help="comma-separated"),
    threads: int | None = typer.Option(None, help="torch threads (default: physical cores)"),
    peers_python: str = typer.Option(".venv-peers/bin/python", help="kvboost's Python "
                                     "(make peers)"),
    max_prompt_tokens: int | None = typer.Option(None, help="leave out longer cases (default: "
                                                 "the model's maximum positions)"),
    out: Path = typer.Option(Path("out/peers"), help="folder for peers.json and peers.png"),
) -> None:
    """kvnotes' compose against kvboost 0.9.0's chunk reuse: identity, accuracy, TTFT."""
    from kvnotes_bench.peers.bench import run_peers
    from kvnotes_bench.peers.results import plot
    from kvnotes_bench.peers.runner import DEFAULT_METHODS, PeersConfig

    def listed(s: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in s.split(",") if x.strip())

    config = PeersConfig(model=model, split=split, cases=cases, reps=reps,
                         greedy_tokens=greedy_tokens,
                         methods=listed(methods) if methods else DEFAULT_METHODS, best=best,
                         workloads=listed(workloads), threads=threads, peers_python=peers_python,
                         max_prompt_tokens=max_prompt_tokens)
    result = run_peers(config, out, say=typer.echo)
    name = f"peers-{model}-{split}"
    (out / f"{name}.json").write_text(json.dumps(result.to_dict(), indent=1))
    plot(result, out / f"{name}.png")
    typer.echo(result.table())
    typer.echo(f"wrote {out / name}.json and .png")
