"""Helpers of the store's tests: real ``redis-server`` processes on loopback ports (started
without persistence on a free port, stopped by their process id), and library entries (real
kvnotes notebook files, made without an engine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from kvnotes.core import files
from kvnotes.serving.library.manifest import ENTRY_FORMAT, ENTRY_VERSION

REDIS_SERVER = shutil.which("redis-server")
MODEL = "m0del0000000000000000000"  # a fingerprint id's shape (24 characters)
FINGERPRINT = {"architecture": "LlamaForCausalLM", "model_type": "llama", "config_sha": "c",
               "tokenizer_sha": "t", "weights_sha": "w", "dtype": "float32", "num_layers": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` this test session started (and stops, by its pid)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), "--enable-debug-command", "local",
             "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ping()

    def _wait_ping(self, timeout_s: float = 10.0) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                assert self.proc is not None and self.proc.poll() is None, (
                    f"redis-server exited: {(self.folder / 'redis.log').read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"redis-server on port {self.port} did not answer PING")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill it (SIGKILL: as a crash would) and wait for it to go."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def client(self) -> Any:  # a redis.Redis (redis is imported on use)
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)


def entry_bytes(folder: Path, key: str, *, tenant: str | None = None, tokens: int = 8,
                width: int = 16, seed: int = 0, name: str = "chunk") -> bytes:
    """A kvnotes skill entry's file bytes: 2 layers of [1, 2 heads, tokens, width] float32."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.arange(tokens, dtype=torch.int64) + seed,
               "positions": torch.arange(tokens, dtype=torch.int64)}
    for layer in range(2):
        for kind in ("keys", "values"):
            tensors[f"layers.{layer}.{kind}"] = torch.randn(1, 2, tokens, width, generator=g)
    meta = {"tenant": tenant} if tenant is not None else {}
    header = {"format": ENTRY_FORMAT, "version": ENTRY_VERSION, "fingerprint": FINGERPRINT,
              "scheme": "rope", "length": tokens, "origin": 0, "num_layers": 2,
              "spans": [[name, "skill", 0, tokens]], "meta": meta}
    path = files.write(folder / f"{key}.safetensors", tensors, header)
    data = path.read_bytes()
    path.unlink()
    return data
