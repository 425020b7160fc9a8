"""Slow and greedy clients (issue #46, item 4): heads sent byte by byte, many sockets from one
address, a head over the documented size, and a body over its limit announced up front."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from _front_fakes import MODEL
from _hostile import healthy, serve

from kvnotes.serving.front.app import Front, FrontConfig
from kvnotes.serving.planning.match import SkillCatalog

ATTACKER = "127.0.0.2"  # loopback too, another address: the legitimate client is 127.0.0.1
HEAD_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def front(upstream, published, tokenizer):
    config = FrontConfig(upstream=upstream.url, block_size=16, model=MODEL, api_key="sk-op",
                         max_connections=32, max_connections_per_ip=8,
                         head_timeout=HEAD_TIMEOUT, max_body_bytes=1 << 20, body_timeout=2.0)
    with serve(config, SkillCatalog(published.folder, tokenizer)) as f:
        yield f


AUTH = {"authorization": "Bearer sk-op"}


def connect(front: Front, source: str = ATTACKER) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", front.port))
    return s


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(65536) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_sockets_that_trickle_their_heads_hold_no_slot(front):
    stop = threading.Event()
    socks = [connect(front) for _ in range(40)]  # more than max_connections (32)

    def trickle() -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
        for i in range(len(head)):
            if stop.is_set():
                return
            for s in socks:
                try:
                    s.send(head[i:i + 1])
                except OSError:
                    pass
            time.sleep(0.1)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(0.3)
        assert front.connections.open[ATTACKER] <= 8  # the rest were closed at once
        healthy(front, headers=AUTH, during=True)  # from another address: served
        time.sleep(HEAD_TIMEOUT + 0.5)
        assert front.connections.open.get(ATTACKER, 0) == 0  # heads never whole: dropped
        assert front.connections.refused >= 32 and front.connections.dropped >= 8
        healthy(front, headers=AUTH, during=True)
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()


def test_a_head_over_the_limit_is_a_400_before_the_key_is_read(front):
    s = connect(front, "127.0.0.1")
    s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (20 << 10)
              + b"\r\n\r\n")  # whole, in one go: 20 KiB > 16 KiB, no key sent
    reply = b""
    while chunk := s.recv(65536):  # then closed
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:100]
    assert b"max_header_bytes" in reply
    healthy(front, headers=AUTH)


def test_a_body_over_the_limit_announced_up_front_is_answered_413(front):
    body = b"x" * (2 << 20)  # 2 MiB, the limit 1 MiB
    s = connect(front, "127.0.0.1")
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-op\r\n"
              b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode()
              + b"\r\n\r\n")
    s.sendall(body)
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = s.recv(65536)
        if not chunk:
            break
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    healthy(front, headers=AUTH)


def test_a_connection_that_sends_nothing_is_dropped(front):
    s = connect(front)
    assert closed_by_server(s, HEAD_TIMEOUT + 1.5)
    s.close()
