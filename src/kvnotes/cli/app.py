"""The typer application every command module registers on, and the one error printer.

Every command runs through :class:`_Commands.invoke`, so no mistake of the user's ends in a
Python traceback: the error is one line on stderr and the exit status says what kind it was.

- **2 (usage)**: a bad argument, option, file or name the user gave (``KvnotesError`` subclasses
  other than the runtime ones below, click's usage errors).
- **1 (runtime)**: the call was fine but something it relied on failed (a damaged notebook file,
  a notebook of another model, an unreachable server, an OS error, an unexpected bug; set
  ``KVNOTES_DEBUG=1`` to see the traceback of the latter).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import typer
from typer._click import exceptions as click  # typer vendors click: its own error classes
from typer._click.core import Context
from typer.core import TyperGroup

from kvnotes.core import errors
from kvnotes.core.errors import KvnotesError, UnsafePathError

USAGE, RUNTIME = 2, 1
# KvnotesErrors that say something failed, not that the call was wrong
_RUNTIME_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for cls in (errors.NotebookFileError, errors.NotebookMismatchError,
                    errors.UnsupportedModelError, getattr(errors, "ServingError", None))
    if cls is not None)


def exit_code(err: BaseException) -> int:
    """2 for a mistake in the call (usage), 1 for a failure at run time."""
    if isinstance(err, click.UsageError):
        return USAGE
    if isinstance(err, KvnotesError) and not isinstance(err, _RUNTIME_ERRORS):
        return USAGE
    return RUNTIME


def message(err: BaseException) -> str:
    """The one line printed for ``err``."""
    if isinstance(err, click.ClickException):
        text = err.format_message() + (" (see --help)" if isinstance(err, click.UsageError) else "")
    elif isinstance(err, KvnotesError):
        text = str(err)
    elif isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        where += f" -> {err.filename2}" if err.filename2 else ""
        text = f"{err.strerror}{where}"
    else:
        text = (f"internal error {type(err).__name__}: {err} (this is a kvnotes bug; set "
                "KVNOTES_DEBUG=1 for the traceback and please report it)")
    return " ".join(text.split())  # one line, whatever the message held


def _print_and_exit(err: BaseException) -> NoReturn:
    if os.environ.get("KVNOTES_DEBUG") and not isinstance(err, click.ClickException):
        traceback.print_exception(err, file=sys.stderr)
    typer.secho(f"error: {message(err)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(exit_code(err))


class _Commands(TyperGroup):
    """The root command group: runs every subcommand inside the one error wrapper."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # every other failure becomes one line (see the module doc)
            _print_and_exit(err)


def command_app(name: str, help: str) -> typer.Typer:
    """A root command group whose commands all print errors as :func:`fail` does (the
    ``kvnotes`` app, and the benchmark package's ``kvnotes-bench``)."""
    return typer.Typer(name=name, help=help, no_args_is_help=True, add_completion=False,
                       pretty_exceptions_enable=False, cls=_Commands)


app = command_app("kvnotes", "Editable, composable KV caches: the notes a language model "
                  "writes at prefill.")


def fail(err: KvnotesError) -> NoReturn:
    """Print a user-facing error in one line and exit (2 usage, 1 runtime; no traceback)."""
    _print_and_exit(err)


def read_text_file(path: Path, option: str) -> str:
    """The UTF-8 text of a file the user named with ``option``; a clear error otherwise."""
    if not path.exists():
        raise errors.InvalidArgumentError(f"{option}: no file at {path}")
    if path.is_dir():
        raise errors.InvalidArgumentError(f"{option}: {path} is a folder; give a text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise errors.InvalidArgumentError(
            f"{option}: {path} is not UTF-8 text (byte {err.start}); give a text file") from err
    except OSError as err:
        raise errors.InvalidArgumentError(f"{option}: cannot read {path}: {err.strerror}") from err


def folder_option(path: Path, option: str) -> Path:
    """A folder the command writes into: refused up front when it exists as a file."""
    if path.exists() and not path.is_dir():
        raise UnsafePathError(f"{option}: {path} is a file; give a folder path (it is created "
                              "when missing)")
    return path


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
