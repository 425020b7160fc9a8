"""``kvnotes-bench shape``: the product's shape against the lean-product goals."""

from __future__ import annotations

import typer

from kvnotes_bench.cli.app import app


@app.command("shape")
def shape(untyped: bool = typer.Option(False, "--untyped", help="also list each function "
                                       "whose signature carries dict[str, Any]")) -> None:
    """Lines, commands, serve's options, validators and untyped JSON against their goals."""
    from kvnotes_bench.shape import measure

    measured = measure()
    typer.echo(measured.table())
    if untyped:
        typer.echo("\n".join(measured.untyped_signatures))
