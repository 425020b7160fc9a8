"""``--store``'s spelling: a folder, ``redis://HOST:PORT/DB`` or ``rediss://`` (TLS).

Example:
    >>> parse_store_url("redis://:s3cret@cache.internal:6380/2").display
    'redis://:***@cache.internal:6380/2'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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


def mask(url: str) -> str:
    """``url`` with everything between its scheme and its last ``@`` masked: a password is
    never shown, even one whose unescaped ``#``, ``/`` or ``?`` hides it from a URL parser.

    Example:
        >>> mask("redis://:p#ss/w?rd@cache:6379/0")
        'redis://***@cache:6379/0'
    """
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def _fail(url: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"--store {mask(url)}: {why}; give a folder, "
                                "redis://HOST:PORT/DB or rediss://HOST:PORT/DB (TLS), the "
                                "password in the URL (redis://:PASSWORD@HOST:PORT/DB) or in "
                                "--store-password-file")


def _port(url: str, port: int | None) -> int:
    if port is None:
        return 6379
    if port == 0:
        raise _fail(url, "port 0 is no server's port (give 1 to 65535, or none for 6379)")
    return port


def parse_store_url(url: str) -> StoreUrl:
    """Parse a ``--store`` value; :class:`InvalidArgumentError` naming what is wrong (with the
    URL's password masked: :func:`mask`)."""
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
    if "@" in parts.path + parts.query + parts.fragment:
        raise _fail(url, "the password or user holds a '/', '?' or '#': percent-encode it "
                    "(%2F, %3F, %23) or put the password in --store-password-file")
    if parts.query:
        raise _fail(url, f"URL options ('?{parts.query}') are not read: the database is the "
                    "path (/DB) and the timeouts are kvnotes' own")
    if parts.fragment:
        raise _fail(url, "a URL fragment ('#...') means nothing here")
    try:
        port = _port(url, parts.port)
    except ValueError as err:
        raise _fail(url, f"the port is not a number from 1 to 65535 ({err})") from err
    if not parts.hostname:
        raise _fail(url, "no host")
    db_text = parts.path.lstrip("/")
    if not (db_text == "" or (db_text.isdigit() and int(db_text) < 1 << 16)):
        raise _fail(url, f"the database {db_text!r} is not a number (redis://HOST:PORT/0)")
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


def check_store(url: str, password_file: str | os.PathLike[str] | None = None) -> StoreUrl:
    """Everything about ``--store`` and ``--store-password-file`` that can be checked without
    reaching the server (call it before loading a model): the URL, a password file only for a
    Redis store, not a password both in the URL and in a file, the file readable. Returns the
    URL with the password in effect.

    Raises:
        InvalidArgumentError: any of those (the URL's password masked).
        UnknownNameError: another scheme.
    """
    parsed = parse_store_url(url)
    if password_file is None:
        return parsed
    if not parsed.is_redis:
        raise InvalidArgumentError("--store-password-file is for a redis:// store, not a "
                                   f"folder ({parsed.path})")
    if parsed.password is not None:
        raise _fail(url, "a password both in the URL and in --store-password-file")
    return replace(parsed, password=read_password_file(password_file))


def store_from_url(url: str, password_file: str | os.PathLike[str] | None = None, *,
                   settings: RedisSettings | None = None) -> Store:
    """The store a ``--store`` value names: a :class:`FolderStore` for a folder (or
    ``file://``), a :class:`RedisStore` for ``redis://`` / ``rediss://``. Nothing is sent to a
    server yet: a store that is down is found out (and counted) at its first use.

    Raises:
        InvalidArgumentError: what :func:`check_store` refuses.
        UnknownNameError: another scheme.

    ``settings``: a Redis store's timeouts and retries (default :class:`RedisSettings`'s).
    """
    parsed = check_store(url, password_file)
    if not parsed.is_redis:
        from kvnotes.serving.store.folder import FolderStore

        return FolderStore(parsed.path)
    try:
        from kvnotes.serving.store.redis_store import RedisStore
    except ImportError as err:  # redis-py is in the `serving` extra
        raise InvalidArgumentError("--store redis://...: the redis package is not installed "
                                   "(pip install 'kvnotes[serving]')") from err
    return RedisStore.connect(parsed.url, password=parsed.password, display=parsed.display,
                              settings=settings)
