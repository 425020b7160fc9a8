"""A ``redis-server`` process of our own: started on a free loopback port, stopped by its pid.

The store's tests and ``kvnotes-bench serve fleet`` need a real Redis they can kill, restart
and flush. :class:`RedisProcess` starts one with no persistence (``--save ""``, no append-only
file: a restart comes back empty, as a crashed cache does), bound to 127.0.0.1, its log in its
folder, and waits until it answers ``PING``; :meth:`RedisProcess.stop` kills it with SIGKILL
(as a crash would) by the pid it started, never by name. A restart reuses the port, so clients
holding its URL reconnect to the new process.

Example:
    >>> from kvnotes.serving.store.redis_process import RedisProcess   # doctest: +SKIP
    >>> with RedisProcess(Path("/tmp/r")) as redis_server:              # doctest: +SKIP
    ...     print(redis_server.url)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from kvnotes.core.errors import ServingError

REDIS_SERVER = shutil.which("redis-server")
INSTALL_HINT = "`make redis` installs Debian's redis-server package"


class RedisProcessError(ServingError):
    """A ``redis-server`` could not be found, started or reached."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` of 127.0.0.1."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisProcess:
    """One ``redis-server`` this process started (see the module docstring).

    Args:
        folder: its working folder (created): ``redis.log`` is written there.
        port: the loopback port (None: a free one).
        binary: the ``redis-server`` executable (None: the one on ``PATH``).
        start_timeout_s: how long :meth:`start` waits for ``PING``.
    """

    def __init__(self, folder: Path, *, port: int | None = None, binary: str | None = None,
                 start_timeout_s: float = 10.0) -> None:
        # absolute: redis-server changes into --dir before it opens --logfile, so a relative
        # log path would be looked up inside the folder and the server would exit silently
        self.folder = Path(folder).resolve()
        self.port = free_port() if port is None else port
        self.binary = binary or REDIS_SERVER
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.folder / "redis.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        if self.binary is None:
            raise RedisProcessError(f"redis-server is not installed ({INSTALL_HINT})")
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder),
                "--enable-debug-command", "local", "--logfile", str(self.log_path)]

    def start(self) -> RedisProcess:
        """Start it (a no-op while it runs) and wait until it answers ``PING``."""
        if self.alive:
            return self
        cmd = self.command()
        if not port_free(self.port):  # PING would reach whoever holds it, not our server
            raise RedisProcessError(f"port {self.port} on 127.0.0.1 is in use")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ping()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ping(self) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if not self.alive:
                    raise RedisProcessError(f"redis-server exited: {self._log_tail()}")
                if time.monotonic() > deadline:
                    raise RedisProcessError(f"redis-server on port {self.port} did not answer "
                                            f"PING within {self.start_timeout_s} s")
                time.sleep(0.05)
        finally:
            client.close()

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text("utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Kill it (SIGKILL, by its pid: as a crash would) and wait for it to go."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> RedisProcess:
        """Kill it and start a new, empty one on the same port."""
        self.stop()
        return self.start()

    def flushall(self) -> None:
        """Empty it (``FLUSHALL``)."""
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def client(self, timeout_s: float = 5.0) -> Any:  # a redis.Redis (imported on use)
        import redis

        return redis.Redis(port=self.port, socket_timeout=timeout_s)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
