"""Fixtures of the store's tests: real ``redis-server`` processes on loopback ports, and a
factory of library entries (real kvnotes notebook files, made without an engine).

The session's server is shared (each test gets it flushed); a test that kills, restarts or
fills its server takes its own (:func:`own_redis`). Each is started with no persistence on a
free loopback port and stopped by its process id. Tests that need one are skipped, saying
why, only where ``redis-server`` is not installed (``make redis`` installs it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _store_helpers import MODEL, REDIS_SERVER, RedisServer, entry_bytes

from kvnotes.serving.store.entry import EntryInfo, StoredEntry, describe


def _need_redis() -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (`make redis` installs Debian's package)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's server, emptied for this test."""
    client = redis_server.client()
    client.flushall()
    client.config_set("maxmemory", 0)
    client.close()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    """A server of this test's own: killed, restarted or filled without disturbing others."""
    _need_redis()
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def make_entry(tmp_path):
    """``make_entry(key, tenant=None, learned=True, **entry_bytes options) -> StoredEntry``."""
    staging = tmp_path / "staging"

    def make(key: str, tenant: str | None = None, *, learned: bool = True, model: str = MODEL,
             **options: object) -> StoredEntry:
        data = entry_bytes(staging, key, tenant=tenant, **options)  # type: ignore[arg-type]
        info = describe(data, key, model)
        if learned:
            info = EntryInfo(info.key, model, tenant, info.name, info.tokens, info.bytes,
                             info.sha256, kind="tool", learned=True, created=time.time())
        return StoredEntry(info, data)

    return make
