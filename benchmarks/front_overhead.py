"""The OpenAI front's own time per request, over an upstream that answers at once.

An instant stand-in for vLLM (a raw ASGI app on uvicorn, its own process: ``/v1/completions``
answers a fixed body, or three events and ``[DONE]`` when streamed; ``/metrics`` gives the
block size) runs beside the front under test (its own process, imported from ``--src``: this
checkout's ``src``, or an older checkout's with ``--front old --old-src PATH``). The client sends
the same requests to the upstream directly and through the front, at concurrency 1 and 64,
non-streamed and streamed, for two prompts: ``forwarded`` (no registered skill: read, matched,
forwarded exactly) and ``spliced`` (the registered header at its origin, then text: planned and
sent as one spliced request, no phase). A request's latency runs from sending it to its last
byte; the front's overhead at a percentile is that percentile through the front less the same
percentile direct.

The skill library is SmolLM2-135M's (compiled once under a temporary folder). The JSON holds
every case's percentiles, the machine record before and after (load average) and the command;
the PNG plots p50 and p99 overhead per case.

    .venv/bin/python benchmarks/front_overhead.py --out docs/results/front-overhead
    .venv/bin/python benchmarks/front_overhead.py --front old --old-src ../oldfront/src \\
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
from pathlib import Path
from typing import Any

HEADER = ("You are the support agent of Fjord Air. Answer in one short sentence. Refunds: a "
          "ticket is refunded in full when it is cancelled within 24 hours of booking.\n")
USER = "\n\nCustomer: my bag arrived torn.\nAgent:"
PROMPTS = {"forwarded": "Customer: my bag arrived torn.\nAgent:", "spliced": HEADER + USER}
BLOCK = 16
SRC = Path(__file__).resolve().parents[1] / "src"


# ---- the instant upstream (its own process) ----------------------------------------------------
def upstream_app() -> Any:
    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1,
                       "model": "m", "choices": [{"index": 0, "text": " ok", "logprobs": None,
                                                  "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 8, "completion_tokens": 1,
                                 "total_tokens": 9}}).encode()
    event = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": None}]}
    stream = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for _ in range(3))
    stream += b"data: [DONE]\n\n"
    metrics = f'vllm:cache_config_info{{block_size="{BLOCK}"}} 1.0\n'.encode()
    models = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        ctype, data = b"application/json", body
        if path == "/metrics":
            ctype, data = b"text/plain", metrics
        elif path == "/v1/models":
            data = models
        elif path == "/health":
            data = b""
        elif b'"stream": true' in raw or b'"stream":true' in raw:
            ctype, data = b"text/event-stream", stream
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def run_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app(), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, backlog=2048)


# ---- the front under test (its own process, from --src) -----------------------------------------
def run_front(port: int, upstream: str, skills: str, model: str) -> None:
    import kvnotes
    from kvnotes.serving.front.app import Front, FrontConfig
    from kvnotes.serving.planning.match import SkillCatalog

    config = FrontConfig(upstream=upstream, port=port, block_size=BLOCK)
    front = Front(config, SkillCatalog(skills, kvnotes.load(model).tokenizer)).start()
    print(front.url, flush=True)
    while True:
        time.sleep(3600)


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
    raise RuntimeError(f"{url} did not come up")


def spawn(args: list[str], src: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.Popen([sys.executable, __file__, *args], env=env)


def publish(model: str, folder: Path) -> Path:
    """The skill library the front plans with (the header, compiled by kvnotes)."""
    import kvnotes
    from kvnotes.serving.skills import ServingSkills

    lib = ServingSkills(folder, kvnotes.load(model))
    lib.add(HEADER, name="header")
    return lib.folder


# ---- the client ----------------------------------------------------------------------------------
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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(direct: list[float], front: list[float]) -> dict[str, Any]:
    ms = 1e3
    if not direct or not front:
        return {"requests": len(front)}
    return {"direct_p50_ms": pct(direct, 0.5) * ms, "direct_p99_ms": pct(direct, 0.99) * ms,
            "front_p50_ms": pct(front, 0.5) * ms, "front_p99_ms": pct(front, 0.99) * ms,
            "overhead_p50_ms": (pct(front, 0.5) - pct(direct, 0.5)) * ms,
            "overhead_p99_ms": (pct(front, 0.99) - pct(direct, 0.99)) * ms,
            "front_mean_ms": statistics.fmean(front) * ms, "requests": len(front)}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "overhead_p50_ms" in r]
    labels = [f"{r['prompt']}\n{'stream' if r['stream'] else 'whole'} c={r['concurrency']}"
              for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
    ax.bar([i - 0.2 for i in x], [r["overhead_p50_ms"] for r in rows], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [r["overhead_p99_ms"] for r in rows], 0.4, label="p99")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("front overhead per request (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--front", choices=("new", "old"), default="new")
    parser.add_argument("--old-src", type=Path, help="an older checkout's src (--front old)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=640, help="per case (a multiple of 64)")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--out", type=Path, default=Path("docs/results/front-overhead"))
    parser.add_argument("--serve", nargs=4, metavar=("ROLE", "PORT", "UPSTREAM", "SKILLS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        role, port, upstream, skills = args.serve
        if role == "upstream":
            run_upstream(int(port))
        else:
            run_front(int(port), upstream, skills, args.model)
        return
    from kvnotes.core.machine import load_note, machine_info

    src = SRC
    if args.front == "old":
        if args.old_src is None:
            parser.error("--front old needs --old-src (e.g. a worktree of an older commit's src)")
        src = args.old_src.resolve()
    before = machine_info()
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="front-overhead-") as tmp:
        skills = publish(args.model, Path(tmp) / "skills")
        up_port, front_port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        front = f"http://127.0.0.1:{front_port}"
        try:
            procs.append(spawn(["--serve", "upstream", str(up_port), "-", "-"], SRC))
            wait_up(upstream)
            procs.append(spawn(["--model", args.model, "--serve", "front", str(front_port),
                                upstream, str(skills)], src))
            wait_up(front)
            for conc in [int(c) for c in args.concurrency.split(",")]:
                n = max(conc, args.requests // conc * conc)
                for name, prompt in PROMPTS.items():
                    for stream in (False, True):
                        direct, _ = asyncio.run(measure(upstream, prompt, stream, conc, n))
                        through, failed = asyncio.run(measure(front, prompt, stream, conc, n))
                        row = {"prompt": name, "stream": stream, "concurrency": conc,
                               "failed": failed, **summary(direct, through)}
                        rows.append(row)
                        print(f"{name:9s} stream={stream!s:5s} c={conc:<3d} overhead p50 "
                              f"{row.get('overhead_p50_ms', float('nan')):.2f} ms, p99 "
                              f"{row.get('overhead_p99_ms', float('nan')):.2f} ms (front p50 "
                              f"{row.get('front_p50_ms', float('nan')):.2f}, direct p50 "
                              f"{row.get('direct_p50_ms', float('nan')):.2f}); {failed} of "
                              f"{n} failed", flush=True)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
    after = machine_info(since=before)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"front-overhead-{args.front}"
    result = {"front": args.front, "src": str(src), "model": args.model, "rows": rows,
              "machine_before": before, "machine_after": after, "load": load_note(after),
              "command": shlex.join([sys.executable, *sys.argv]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out / f"{stem}.png", f"{args.front} front over an instant upstream\n"
         f"{load_note(after)}")
    print(f"wrote {args.out / stem}.json and .png; {load_note(after)}")


if __name__ == "__main__":
    main()
