"""The OpenAI front's own time per request, over an upstream that answers at once.

An instant stand-in for vLLM (a raw ASGI app on uvicorn, its own process: ``/v1/completions``
answers a fixed body, or three events and ``[DONE]`` when streamed; ``/metrics`` gives the
block size) runs beside the front under test (its own process, imported from this checkout's
``src``, or an older checkout's with ``--front old --old-src PATH``; both servers live in
``overhead_servers.py``). The client sends the same requests to the upstream directly and
through the front, at concurrency 1 and 64, non-streamed and streamed, for two prompts:
``forwarded`` (no registered skill: read, matched, forwarded exactly) and ``spliced`` (the
registered header at its origin, then text: planned and sent as one spliced request, no phase).
A request's latency runs from sending it to its last byte; the front's overhead at a percentile
is that percentile through the front less the same percentile direct.

The skill library is SmolLM2-135M's (compiled once under a temporary folder). The JSON holds
every case's percentiles, the machine record before and after (load average) and the command;
the PNG plots p50 and p99 overhead per case.

    .venv/bin/python -m kvnotes_bench.micro.front_overhead --out docs/results/front-overhead
    .venv/bin/python -m kvnotes_bench.micro.front_overhead --front old --old-src ../oldfront/src \\
        --out docs/results/front-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError, KvnotesError
from kvnotes.core.machine import load_note, machine_info
from kvnotes.core.models import load
from kvnotes_bench.micro import overhead_servers

HEADER = ("You are the support agent of Fjord Air. Answer in one short sentence. Refunds: a "
          "ticket is refunded in full when it is cancelled within 24 hours of booking.\n")
USER = "\n\nCustomer: my bag arrived torn.\nAgent:"
PROMPTS = {"forwarded": "Customer: my bag arrived torn.\nAgent:", "spliced": HEADER + USER}
SERVERS = Path(overhead_servers.__file__).resolve()
SRC = SERVERS.parents[3]  # the folder holding this kvnotes: its front is the "new" one


@dataclass(frozen=True)
class FrontOverheadConfig:
    """One run: the ``front`` under test (``"new"``: this checkout's; ``"old"``: the one under
    ``old_src``), ``requests`` per case at each of ``concurrency``, with ``model``'s skills."""

    front: str = "new"
    old_src: Path | None = None
    model: str = "smollm2-135m"
    requests: int = 640
    concurrency: tuple[int, ...] = (1, 64)

    def __post_init__(self) -> None:
        if self.front not in ("new", "old"):
            raise InvalidArgumentError(f"front must be 'new' or 'old', got {self.front!r}")
        if self.front == "old" and self.old_src is None:
            raise InvalidArgumentError("the old front needs old_src (--old-src): an older "
                                       "checkout's src, e.g. a worktree of an older commit's")
        if self.requests < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError("requests and every concurrency must be at least 1, got "
                                       f"{self.requests} and {self.concurrency}")

    @property
    def src(self) -> Path:
        """The ``src`` the front under test is imported from."""
        return SRC if self.old_src is None or self.front == "new" else self.old_src.resolve()


# the percentiles a row holds when both sides answered; a row whose side all failed has none
STATS = ("direct_p50_ms", "direct_p99_ms", "front_p50_ms", "front_p99_ms", "overhead_p50_ms",
         "overhead_p99_ms", "front_mean_ms")


@dataclass(frozen=True)
class OverheadRow:
    """One case: a prompt, streamed or not, at one concurrency; milliseconds per request."""

    prompt: str
    stream: bool
    concurrency: int
    failed: int  # requests through the front that failed (reset, refused, an error status)
    requests: int  # requests through the front that were answered
    direct_p50_ms: float | None = None
    direct_p99_ms: float | None = None
    front_p50_ms: float | None = None
    front_p99_ms: float | None = None
    overhead_p50_ms: float | None = None
    overhead_p99_ms: float | None = None
    front_mean_ms: float | None = None

    @property
    def measured(self) -> bool:
        return self.overhead_p50_ms is not None

    def to_dict(self) -> dict[str, Any]:
        head = {"prompt": self.prompt, "stream": self.stream, "concurrency": self.concurrency,
                "failed": self.failed}
        stats = {k: getattr(self, k) for k in STATS if getattr(self, k) is not None}
        return {**head, **stats, "requests": self.requests}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OverheadRow:
        return cls(prompt=d["prompt"], stream=d["stream"], concurrency=d["concurrency"],
                   failed=d["failed"], requests=d["requests"], **{k: d.get(k) for k in STATS})


def summary(prompt: str, stream: bool, concurrency: int, failed: int, direct: list[float],
            front: list[float]) -> OverheadRow:
    """A case's row from the seconds per request direct and through the front."""
    row = OverheadRow(prompt, stream, concurrency, failed, len(front))
    if not direct or not front:
        return row
    ms = 1e3
    return OverheadRow(
        prompt, stream, concurrency, failed, len(front),
        direct_p50_ms=pct(direct, 0.5) * ms, direct_p99_ms=pct(direct, 0.99) * ms,
        front_p50_ms=pct(front, 0.5) * ms, front_p99_ms=pct(front, 0.99) * ms,
        overhead_p50_ms=(pct(front, 0.5) - pct(direct, 0.5)) * ms,
        overhead_p99_ms=(pct(front, 0.99) - pct(direct, 0.99)) * ms,
        front_mean_ms=statistics.fmean(front) * ms)


@dataclass(frozen=True)
class FrontOverheadResult:
    """What one run measured; :meth:`to_dict` is ``front-overhead-{front}.json``'s schema."""

    front: str
    src: str
    model: str
    rows: tuple[OverheadRow, ...]
    machine_before: dict[str, Any]  # kvnotes.core.machine.machine_info records
    machine_after: dict[str, Any]
    load: str
    command: str
    date: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrontOverheadResult:
        return cls(**{**{f.name: d[f.name] for f in fields(cls)},
                      "rows": tuple(OverheadRow.from_dict(r) for r in d["rows"])})


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, timeout: float = 120.0) -> None:
    import httpx2

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx2.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    raise KvnotesError(f"{url} did not come up within {timeout:.0f} s: see the server's output "
                       "above (with --front old, check that --old-src is a kvnotes src)")


def spawn(args: list[str], src: Path) -> subprocess.Popen[bytes]:
    """One of ``overhead_servers``' roles in its own process, importing kvnotes from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.Popen([sys.executable, str(SERVERS), *args], env=env)


def publish(engine: Engine, folder: Path) -> Path:
    """The skill library the front plans with (the header, compiled by kvnotes)."""
    from kvnotes.serving.skills import ServingSkills

    lib = ServingSkills(folder, engine)
    lib.add(HEADER, name="header")
    return lib.folder


async def measure(url: str, prompt: str, stream: bool, concurrency: int, requests: int
                  ) -> tuple[list[float], int]:
    """Seconds per answered request (send to last byte), ``concurrency`` in flight, and the
    count of requests that failed (reset, refused, an error status)."""
    import httpx2

    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0.0,
            "stream": stream}
    out: list[float] = []
    failed = [0]
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(timeout=60, limits=limits, trust_env=False) as client:
        async def one() -> None:
            t0 = time.perf_counter()
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_raw():
                        pass
                    ok = resp.status_code == 200
            except httpx2.HTTPError:
                ok = False
            if ok:
                out.append(time.perf_counter() - t0)
            else:
                failed[0] += 1

        async def worker(n: int) -> None:
            for _ in range(n):
                await one()

        await asyncio.gather(*[worker(requests // concurrency) for _ in range(concurrency)])
        out.clear()  # the first round warmed the connections
        failed[0] = 0
        await asyncio.gather(*[worker(requests // concurrency) for _ in range(concurrency)])
    return out, failed[0]


def run(config: FrontOverheadConfig, engine: Engine | None = None, command: str = "",
        say: Callable[[str], None] = print) -> FrontOverheadResult:
    """Every case of ``config`` against the two servers (``engine`` compiles the skills:
    default ``config.model`` loaded; the front loads ``config.model``'s tokenizer itself);
    ``command`` is recorded as the run's command line."""
    src = config.src
    before = machine_info()
    engine = load(config.model) if engine is None else engine
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[OverheadRow] = []
    with tempfile.TemporaryDirectory(prefix="front-overhead-") as tmp:
        skills = publish(engine, Path(tmp) / "skills")
        up_port, front_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        front = f"http://127.0.0.1:{front_port}"
        try:
            procs.append(spawn(["upstream", str(up_port), "-", "-", "-"], SRC))
            wait_up(upstream)
            procs.append(spawn(["front", str(front_port), upstream, str(skills), config.model],
                               src))
            wait_up(front)
            for conc in config.concurrency:
                n = max(conc, config.requests // conc * conc)
                for name, prompt in PROMPTS.items():
                    for stream in (False, True):
                        direct, _ = asyncio.run(measure(upstream, prompt, stream, conc, n))
                        through, failed = asyncio.run(measure(front, prompt, stream, conc, n))
                        row = summary(name, stream, conc, failed, direct, through)
                        rows.append(row)
                        say(describe(row, n))
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
    after = machine_info(since=before)
    return FrontOverheadResult(
        front=config.front, src=str(src), model=config.model, rows=tuple(rows),
        machine_before=before, machine_after=after, load=load_note(after), command=command,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))


def describe(row: OverheadRow, sent: int) -> str:
    nan = float("nan")

    def ms(v: float | None) -> float:
        return nan if v is None else v

    return (f"{row.prompt:9s} stream={row.stream!s:5s} c={row.concurrency:<3d} overhead p50 "
            f"{ms(row.overhead_p50_ms):.2f} ms, p99 {ms(row.overhead_p99_ms):.2f} ms (front p50 "
            f"{ms(row.front_p50_ms):.2f}, direct p50 {ms(row.direct_p50_ms):.2f}); "
            f"{row.failed} of {sent} failed")


def plot(result: FrontOverheadResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r.measured]
    labels = [f"{r.prompt}\n{'stream' if r.stream else 'whole'} c={r.concurrency}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
    ax.bar([i - 0.2 for i in x], [r.overhead_p50_ms or 0.0 for r in rows], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r.overhead_p99_ms or 0.0 for r in rows], 0.4, label="p99")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("front overhead per request (ms)")
    ax.set_title(f"{result.front} front over an instant upstream\n{result.load}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--front", choices=("new", "old"), default="new")
    parser.add_argument("--old-src", type=Path, help="an older checkout's src (--front old)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=640, help="per case (a multiple of 64)")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--out", type=Path, default=Path("docs/results/front-overhead"))
    args = parser.parse_args()
    if args.front == "old" and args.old_src is None:
        parser.error("--front old needs --old-src (e.g. a worktree of an older commit's src)")
    config = FrontOverheadConfig(front=args.front, old_src=args.old_src, model=args.model,
                                 requests=args.requests,
                                 concurrency=tuple(int(c) for c in args.concurrency.split(",")))
    command = shlex.join([sys.executable, "-m", __spec__.name if __spec__ else __name__,
                          *sys.argv[1:]])
    result = run(config, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"front-overhead-{args.front}"
    stem.with_suffix(".json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png; {result.load}")


if __name__ == "__main__":
    main()
