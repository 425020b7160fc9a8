"""A TCP proxy on loopback between a client and a loopback Redis that can lose replies: the
command reaches the server and runs, its reply never reaches the client, and the connection is
closed (as a network that drops a reply and then the connection does). The store tests drop
the replies to chosen commands; ``serve-bench fleet``'s ``drop`` fault drops every reply for a
while (:meth:`DropProxy.drop_all_for`). Every loop is bounded by
a socket timeout and a stop flag; it stops, and closes every socket, on :meth:`DropProxy.stop`.
"""

from __future__ import annotations

import socket
import threading
import time

_POLL_S = 0.1
_MAX_CONNECTIONS = 64


class DropProxy:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port``.

    :meth:`drop_reply_to` arms it: the reply to the next ``times`` commands whose bytes hold
    ``marker`` are dropped; :meth:`drop_all_for`: every reply for some seconds; :attr:`dropped`
    counts them.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port = int(self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._marker = b""
        self._drops = 0
        self._all_until = 0.0  # time.monotonic() before which every reply is dropped
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_to(self, marker: bytes, times: int = 1) -> None:
        with self._lock:
            self._marker, self._drops = marker, times

    def drop_all_for(self, seconds: float) -> None:
        with self._lock:
            self._all_until = time.monotonic() + seconds

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            # the connections closed since are forgotten: a long run reconnects many times
            self._sockets = [s for s in self._sockets if s.fileno() != -1]
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._sockets) >= 2 * _MAX_CONNECTIONS:
                time.sleep(_POLL_S)
                continue
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:  # the server is down (killed): so is this connection
                _close(client)
                continue
            for s in (client, server):
                s.settimeout(_POLL_S)
            self._sockets += [client, server]
            drop = threading.Event()  # this connection's next reply is to be dropped
            self._spawn(self._up, client, server, drop)
            self._spawn(self._down, server, client, drop)

    def _up(self, client: socket.socket, server: socket.socket, drop: threading.Event) -> None:
        while not self._stop.is_set():
            data = self._recv(client)
            if data is None:
                continue
            if not data:
                break
            with self._lock:
                if self._drops and self._marker and self._marker in data:
                    self._drops -= 1
                    drop.set()
            try:
                server.sendall(data)
            except OSError:
                break
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, drop: threading.Event) -> None:
        while not self._stop.is_set():
            data = self._recv(server)
            if data is None:
                continue
            if not data:
                break
            with self._lock:
                if time.monotonic() < self._all_until:
                    drop.set()
            if drop.is_set():  # the command ran; its reply is lost with the connection
                with self._lock:
                    self.dropped += 1
                break
            try:
                client.sendall(data)
            except OSError:
                break
        _close(client, server)

    @staticmethod
    def _recv(s: socket.socket) -> bytes | None:
        """Bytes read, b"" when closed, None when nothing came within the poll."""
        try:
            return s.recv(1 << 16)
        except TimeoutError:
            return None
        except OSError:
            return b""

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._sockets:
            _close(s)
        for t in self._threads:
            t.join(5)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.close()
        except OSError:
            pass
