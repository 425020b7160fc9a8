"""The typer application every command module registers on."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from kvnotes.core.errors import KvnotesError

app = typer.Typer(
    name="kvnotes",
    help="Editable, composable KV caches: the notes a language model writes at prefill.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(err: KvnotesError) -> None:
    """Print a user-facing error and exit 2 (no traceback: the message says how to fix it)."""
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
