"""The library's ``redis-server`` helper against a real server: start, flush, kill by pid,
restart empty on the same port."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnotes.serving.store.redis_process import (
    REDIS_SERVER,
    RedisProcess,
    RedisProcessError,
    free_port,
)

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed "
                                 "(`make redis` installs Debian's package)")


@needs_redis
def test_start_flush_kill_restart(tmp_path) -> None:
    with RedisProcess(tmp_path / "r") as server:
        pid, port = server.pid, server.port
        assert server.alive and server.url == f"redis://127.0.0.1:{port}/0"
        client = server.client()
        client.set("k", b"v")
        assert client.get("k") == b"v"
        server.flushall()
        assert client.get("k") is None
        client.set("k", b"v")
        server.stop()
        assert not server.alive and server.pid is None
        server.restart()
        assert server.alive and server.pid != pid and server.port == port
        # no persistence: a restarted server is empty, as a crashed cache is
        assert server.client().get("k") is None
    assert not server.alive
    assert (tmp_path / "r" / "redis.log").is_file()


@needs_redis
def test_a_server_that_cannot_start_says_why(tmp_path) -> None:
    with RedisProcess(tmp_path / "a") as first:
        clash = RedisProcess(tmp_path / "b", port=first.port, start_timeout_s=5.0)
        with pytest.raises(RedisProcessError):
            clash.start()
        assert not clash.alive


def test_missing_binary_is_named(tmp_path, monkeypatch) -> None:
    server = RedisProcess(tmp_path, port=free_port())
    monkeypatch.setattr(server, "binary", None)
    with pytest.raises(RedisProcessError, match="redis-server is not installed"):
        server.start()


@needs_redis
def test_a_relative_folder_starts(tmp_path, monkeypatch) -> None:
    """``--out out/run`` gives a relative folder: redis-server changes into ``--dir`` before it
    opens ``--logfile``, so both must be absolute."""
    monkeypatch.chdir(tmp_path)
    with RedisProcess(Path("out") / "run" / "redis") as server:
        assert server.alive and server.log_path.is_absolute()
        assert server.log_path.is_file()
