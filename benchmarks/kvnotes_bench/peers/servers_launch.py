"""The three servers of ``peers-servers``, one at a time, and the run that measures each.

Plain vLLM comes from :func:`kvnotes.serving.launch.launcher.prepare` (no skills, no front:
prefix caching on, as vLLM's default); ``kvnotes serve MODEL --learn`` runs as a user starts
it; kvboost's server (``python -m kvboost.server``, its own ``.venv-peers``) loads the same
exported HF folder on the CPU in float32, its tool parser off: that parser holds a whole
``<tool_call>`` block back until it closes (after 16 tokens, at the request's end), so its
first delta would time the parser, not the prefill.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.errors import ServingError
from kvnotes_bench.peers.servers import Reply, ServerRun, reordered, send_all


@dataclass(frozen=True)
class ServersConfig:
    model: str = "qwen2.5-coder-0.5b"
    prompts: int = 24
    seed: int = 0
    target_tokens: int = 2000
    concurrency: tuple[int, ...] = (1, 4)
    max_tokens: int = 16
    sightings: int = 2  # warm sends per prompt: the front's learning.after
    servers: tuple[str, ...] = ("kvboost", "vllm", "kvnotes")
    peers_python: str = ".venv-peers/bin/python"
    kvboost_recompute: str = "cacheblend"  # its server's default
    learn_timeout_s: float = 600.0


def _wait_health(url: str, proc: subprocess.Popen[bytes] | None, name: str,
                 timeout_s: float = 1200.0) -> None:
    from kvnotes.serving.vllm_endpoints import Client

    client, deadline = Client(url, timeout=10.0), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServingError(f"{name} exited {proc.returncode} before it was healthy")
        if client.healthy():
            return
        time.sleep(2.0)
    raise ServingError(f"{name} at {url} was not healthy within {timeout_s:.0f} s")


@contextmanager
def _process(cmd: list[str], log: Path, name: str) -> Iterator[str]:
    from kvnotes.serving.launch.process import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_health(url, proc, name)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=120)


def kvboost_cmd(config: ServersConfig, folder: Path, *, cold: bool) -> list[str]:
    """kvboost's server on ``folder``; ``cold``: its cache reset after every request."""
    return [config.peers_python, "-m", "kvboost.server", "--model", str(folder),
            "--model-name", config.model, "--device", "cpu", "--dtype", "float32",
            "--recompute-strategy", config.kvboost_recompute, "--host", "127.0.0.1",
            "--log-level", "warning", *(["--release-cache-after-request"] if cold else [])]


@contextmanager
def server(name: str, config: ServersConfig, out: Path, *, cold: bool = False
           ) -> Iterator[tuple[str, list[str]]]:
    """``(url, command)`` of one server, up and healthy, stopped when the block ends."""
    from kvnotes.serving.launch.launcher import LaunchConfig, export_model, prepare

    if name == "vllm":
        launch = prepare(LaunchConfig(model=config.model, dtype="float32",
                                      log_path=out / "vllm.log"))
        with launch:
            yield launch.url, launch.record().command
    elif name == "kvnotes":
        settings = out / "serve.toml"
        settings.write_text(f'log = "{out / "kvnotes-vllm.log"}"\n', "utf-8")
        cmd = [str(Path(sys.executable).parent / "kvnotes"), "serve", config.model, "--learn",
               "--dtype", "float32", "--skills", str(out / "skills"), "--config", str(settings)]
        with _process(cmd, out / "kvnotes.log", name) as url:
            yield url, cmd
    elif name == "kvboost":
        cmd = kvboost_cmd(config, export_model(config.model, "float32").folder, cold=cold)
        with _process(cmd, out / f"kvboost{'-cold' if cold else ''}.log", name) as url:
            yield url, cmd
    else:
        raise ServingError(f"unknown server {name!r}")


def _learner(url: str) -> int | None:
    from kvnotes.serving.vllm_endpoints import Client

    try:
        learner = Client(url, timeout=10.0).get_object("/kvnotes/stats").get("learner")
    except (ServingError, OSError, ValueError):
        return None
    compiles = learner.get("compiles") if isinstance(learner, dict) else None
    return compiles if isinstance(compiles, int) else None


def wait_learned(url: str, timeout_s: float, say: Callable[[str], None]) -> None:
    """Until the learner's compile count has not moved for 10 s (or ``timeout_s``)."""
    last, still, t0 = _learner(url), time.monotonic(), time.monotonic()
    while time.monotonic() - still < 10.0 and time.monotonic() - t0 < timeout_s:
        time.sleep(2.0)
        now = _learner(url)
        if now != last:
            last, still = now, time.monotonic()
    say(f"  kvnotes learned {last} chunks in {time.monotonic() - t0:.0f} s")


def measure(name: str, config: ServersConfig, bodies: Sequence[dict[str, Any]], out: Path,
            say: Callable[[str], None]) -> tuple[list[ServerRun], list[str]]:
    """One server's runs (warm pass on ``bodies``, then each concurrency on the same prompts
    with their tools in a new order, :func:`reordered`) and the command that started it."""
    sets = {c: reordered(bodies, seed=c) for c in config.concurrency}

    def send(url: str, c: int, batch: Sequence[dict[str, Any]],
             extra: dict[str, Any] | None = None) -> list[Reply]:
        return asyncio.run(send_all(url, config.model, batch, concurrency=c,
                                    max_tokens=config.max_tokens, extra=extra))

    exact: dict[int, list[Reply]] = {}
    if name == "kvboost":
        with server(name, config, out, cold=True) as (url, _):
            exact = {c: send(url, 1, sets[c]) for c in config.concurrency}
    with server(name, config, out) as (url, cmd):
        for _ in range(config.sightings):
            send(url, 1, bodies)
        if name == "kvnotes":
            wait_learned(url, config.learn_timeout_s, say)
        timed = {c: send(url, c, sets[c]) for c in config.concurrency}
        if name == "kvnotes":
            exact = {c: send(url, 1, sets[c], {"kvnotes": {"splice": False}})
                     for c in config.concurrency}
    runs = [ServerRun.of(name, c, replies, exact.get(c)) for c, replies in timed.items()]
    for r in runs:
        say(f"  {name} c{r.concurrency}: {r.summary()}")
    return runs, cmd
