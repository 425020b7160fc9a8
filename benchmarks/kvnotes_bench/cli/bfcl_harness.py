"""``kvnotes-bench bfcl-harness``: BFCL's own harness against plain vLLM and ``kvnotes serve``
(:mod:`kvnotes_bench.harness_bfcl`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvnotes_bench.cli.app import app, invocation
from kvnotes_bench.harness_bfcl import HarnessConfig, run_harness, summary_lines

_DEFAULT = HarnessConfig()


@app.command("bfcl-harness")
def bfcl_harness(
    model: str = typer.Option(_DEFAULT.model, help="bundled model alias or HF folder"),
    categories: str = typer.Option(",".join(_DEFAULT.categories),
                                   help="BFCL categories, comma-separated (never `multiple`)"),
    per_category: int = typer.Option(_DEFAULT.per_category, help="first N cases of each"),
    passes: int = typer.Option(_DEFAULT.passes, help="passes through kvnotes (last scored)"),
    handler: str = typer.Option(_DEFAULT.handler, help="BFCL's model entry (prompt format)"),
    out: Path = typer.Option(Path("docs/results/bfcl-harness"), help="result folder"),
) -> None:
    """Score the same BFCL cases through plain vLLM and through `kvnotes serve --learn`."""
    config = HarnessConfig(model=model, categories=tuple(c for c in categories.split(",") if c),
                           per_category=per_category, passes=passes, handler=handler)
    command = invocation()
    result = run_harness(config, out, command)
    (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n", "utf-8")
    typer.echo("\n".join(summary_lines(result)))
