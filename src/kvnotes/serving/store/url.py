"""``--store``'s spelling: a folder, ``redis://HOST:PORT/DB`` or ``rediss://`` (TLS).

Example:
    >>> parse_store_url("redis://:s3cret@cache.internal:6380/2").display
    'redis://:***@cache.internal:6380/2'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.store.base import Store

if TYPE_CHECKING:
    from kvnotes.serving.store.redis_store import RedisSettings

SCHEMES = ("redis", "rediss", "file")


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A parsed ``--store`` value. ``display`` is the URL with its password masked."""

    scheme: str  # "redis", "rediss" or "file"
    url: str  # as given (it may hold a password: never logged)
    display: str
    host: str = ""
    port: int = 0
    db: int = 0
    password: str | None = None
    path: str = ""  # a folder store's root

    @property
    def is_redis(self) -> bool:
        return self.scheme in ("redis", "rediss")


def _fail(url: str, why: str) -> InvalidArgumentError:
    shown = urlsplit(url)._replace(netloc="...").geturl() if "@" in url else url
    return InvalidArgumentError(f"--store {shown}: {why}; give a folder, "
                                "redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS), the "
                                "password in the URL (redis://:PASSWORD@HOST:PORT/DB) or in "
                                "--store-password-file")


def parse_store_url(url: str) -> StoreUrl:
    """Parse a ``--store`` value; :class:`InvalidArgumentError` naming what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgumentError("--store: give a folder or a redis:// URL")
    if "://" not in url:
        return StoreUrl("file", url, url, path=url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise UnknownNameError("store scheme", scheme, SCHEMES,
                               "a folder path, redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise _fail(url, "a file:// URL names a local folder (file:///path/to/skills)")
        return StoreUrl("file", url, url, path=unquote(parts.path))
    try:
        port = parts.port or 6379
    except ValueError as err:
        raise _fail(url, f"the port is not a number from 1 to 65535 ({err})") from err
    if not parts.hostname:
        raise _fail(url, "no host")
    db_text = parts.path.lstrip("/")
    if not (db_text == "" or (db_text.isdigit() and int(db_text) < 1 << 16)):
        raise _fail(url, f"the database {db_text!r} is not a number (redis://HOST:PORT/0)")
    if parts.fragment:
        raise _fail(url, "a URL fragment ('#...') means nothing here")
    password = unquote(parts.password) if parts.password is not None else None
    user = f"{parts.username}:" if parts.username else ":"
    auth = f"{user}***@" if password is not None else ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    display = f"{scheme}://{auth}{host}:{port}/{int(db_text or 0)}"
    return StoreUrl(scheme, url, display, parts.hostname, port, int(db_text or 0), password)


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password in a file (its first line, without the line break)."""
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"--store-password-file {p}: cannot read it ({err})") from err
    password = text.splitlines()[0] if text.splitlines() else ""
    if not password:
        raise InvalidArgumentError(f"--store-password-file {p} is empty: write the password on "
                                   "its first line")
    return password


def store_from_url(url: str, password_file: str | os.PathLike[str] | None = None, *,
                   settings: RedisSettings | None = None) -> Store:
    """The store a ``--store`` value names: a :class:`FolderStore` for a folder (or
    ``file://``), a :class:`RedisStore` for ``redis://`` / ``rediss://``. Nothing is sent to a
    server yet: a store that is down is found out (and counted) at its first use.

    Raises:
        InvalidArgumentError: a malformed URL, a password both in the URL and in a file, or a
            password file for a folder.
        UnknownNameError: another scheme.

    ``settings``: a Redis store's timeouts and retries (default :class:`RedisSettings`'s).
    """
    parsed = parse_store_url(url)
    if not parsed.is_redis:
        if password_file is not None:
            raise InvalidArgumentError("--store-password-file is for a redis:// store, not a "
                                       f"folder ({parsed.path})")
        from kvnotes.serving.store.folder import FolderStore

        return FolderStore(parsed.path)
    password = parsed.password
    if password_file is not None:
        if password is not None:
            raise _fail(url, "a password both in the URL and in --store-password-file")
        password = read_password_file(password_file)
    try:
        from kvnotes.serving.store.redis_store import RedisStore
    except ImportError as err:  # redis-py is in the `serving` extra
        raise InvalidArgumentError("--store redis://...: the redis package is not installed "
                                   "(pip install 'kvnotes[serving]')") from err
    return RedisStore.connect(parsed.url, password=password, display=parsed.display,
                              settings=settings)
