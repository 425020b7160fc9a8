"""``--store`` and ``--store-password-file``: where a server's skill library lives.

The options and the one function a command needs to turn them into a store
(:func:`open_store`): ``kvnotes skills list/pin/forget`` take them as their parameters
(``store: str | None = store_option()``, ``store_password_file: Path | None =
store_password_file_option()``). ``kvnotes serve`` takes the same two options and opens a Redis
store with its host's mirror itself
(:meth:`~kvnotes.serving.front.store_link.StoreLink.open`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvnotes.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvnotes.serving.store import Store

STORE_HELP = ("Where the skill library lives: a folder (the default: --skills), or "
              "redis://HOST:PORT/DB (rediss:// for TLS), one library shared by every host "
              "given the same URL; the password in the URL (redis://:PASSWORD@HOST:PORT/DB) or "
              "in --store-password-file")
PASSWORD_FILE_HELP = "File whose first line is the store's password (kept out of the URL, argv)"


def store_option() -> Any:
    """A fresh ``--store`` option (typer reads one per command signature)."""
    return typer.Option(None, "--store", help=STORE_HELP)


def store_password_file_option() -> Any:
    return typer.Option(None, "--store-password-file", help=PASSWORD_FILE_HELP)


def open_store(store: str | None, password_file: Path | None = None, *,
               skills: Path | None = None) -> Store:
    """The store ``--store`` names; without it, the ``--skills`` folder as a store.

    Raises:
        InvalidArgumentError: neither given, a malformed URL, or a password file without a
            redis:// store (the message names the option).
    """
    from kvnotes.serving.store import FolderStore, store_from_url

    if store is None:
        if password_file is not None:
            raise InvalidArgumentError("--store-password-file is for a --store redis://... URL")
        if skills is None:
            raise InvalidArgumentError("give --skills DIR (this host's library folder) or "
                                       "--store URL (a shared one)")
        return FolderStore(skills)
    return store_from_url(store, password_file)
