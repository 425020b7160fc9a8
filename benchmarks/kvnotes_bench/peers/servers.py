"""``kvnotes-bench peers-servers``: the same agent prompts through three OpenAI-compatible servers.

kvboost 0.9.0's server, plain vLLM with prefix caching, and ``kvnotes serve --learn`` answer
the same ~2k-token BFCL ``live_multiple`` development prompts, streamed through the ``openai``
SDK at each concurrency, after a warm pass (each prompt sent ``sightings`` times) that lets
kvnotes learn the tools and kvboost cache its chunks; each concurrency then sends the same
prompts with their tools in a new order (:func:`reordered`), so no server answers from an exact
prefix hit on the whole prompt. Per server and concurrency: TTFT (to the
first delta that carries content or a tool call), whether the 16 greedy tokens equal the
server's own exact answer, and errors. Launching the servers is :mod:`.servers_launch`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvnotes_bench.kit.stats import percentile

SERVERS = ("kvboost", "vllm", "kvnotes")
# what each server's identity is measured against
REFERENCES = {"kvboost": "a kvboost server with --release-cache-after-request (every request "
                         "cold: one full prefill, no chunk reuse)",
              "vllm": "itself: prefix caching is exact, 100% by construction (not measured)",
              "kvnotes": "the same request with extra_body kvnotes.splice=false"}


def build_prompts(cases: Sequence[Any], count: Callable[[str], int], *, n: int, seed: int,
                  target: int = 2000) -> list[dict[str, Any]]:
    """``n`` chat bodies (``messages`` and ``tools``): a seeded development case's question and
    its own tools, then tools of the other cases (a seeded order) until the body's JSON counts
    about ``target`` tokens (``count``: the model's tokenizer). Same seed, same bodies."""
    from kvnotes_bench.serving.agent_traffic_requests import tool_pool, tool_requests

    requests = tool_requests(cases, min_tools=1)
    pool = tool_pool(requests)
    rng = random.Random(f"kvnotes-peers-servers:{seed}")
    bodies = []
    for r in rng.sample(requests, min(n, len(requests))):
        tools = list(r.chunks)
        names = {t["function"]["name"] for t in tools}
        for t in rng.sample(pool, len(pool)):
            if count(json.dumps({"messages": r.messages(), "tools": tools})) >= target:
                break
            if t["function"]["name"] not in names:
                tools.insert(rng.randint(0, len(tools)), t)
                names.add(t["function"]["name"])
        bodies.append({"id": r.id, "messages": r.messages(), "tools": tools})
    return bodies


def reordered(bodies: Sequence[dict[str, Any]], *, seed: int) -> list[dict[str, Any]]:
    """The same bodies, each with its tools in a new seeded order (the first tool moved, so a
    prefix cache holds at most the text before the tools): a known tool list in a new order,
    the case prompt-prefix reuse misses and chunk reuse is for."""
    rng = random.Random(f"kvnotes-peers-servers-order:{seed}")
    out = []
    for body in bodies:
        tools = list(body["tools"])
        if len(tools) > 1:
            first = tools[0]
            while tools[0] is first:
                rng.shuffle(tools)
        out.append({**body, "tools": tools})
    return out


@dataclass
class Reply:
    """One streamed answer: seconds to its first content or tool-call delta, its text."""

    ttft_s: float | None
    text: str
    error: str | None = None


async def stream_one(client: Any, model: str, body: Mapping[str, Any], *, max_tokens: int,
                     extra: Mapping[str, Any] | None = None) -> Reply:
    """``body`` sent greedy and streamed; the text joins content and tool-call pieces."""
    t0, first, parts = time.perf_counter(), None, []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=body["messages"], tools=body["tools"], max_tokens=max_tokens,
            temperature=0.0, stream=True, extra_body=dict(extra) if extra else None)
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is None:
                continue
            for call in delta.tool_calls or ():
                fn = call.function
                parts += [fn.name or "", fn.arguments or ""] if fn else []
            if delta.content:
                parts.append(delta.content)
            if first is None and (delta.content or delta.tool_calls):
                first = time.perf_counter() - t0
    except Exception as exc:  # a benchmark counts every failure, whatever the SDK raises
        return Reply(None, "".join(parts), f"{type(exc).__name__}: {exc}")
    return Reply(first, "".join(parts))


async def send_all(url: str, model: str, bodies: Sequence[Mapping[str, Any]], *,
                   concurrency: int, max_tokens: int,
                   extra: Mapping[str, Any] | None = None) -> list[Reply]:
    """Every body once, at most ``concurrency`` in flight; replies in the bodies' order."""
    from kvnotes_bench.serving.client import open_client

    client = open_client(url, timeout=1800.0)
    gate = asyncio.Semaphore(concurrency)

    async def one(body: Mapping[str, Any]) -> Reply:
        async with gate:
            return await stream_one(client, model, body, max_tokens=max_tokens, extra=extra)

    try:
        return list(await asyncio.gather(*(one(b) for b in bodies)))
    finally:
        await client.close()


@dataclass
class ServerRun:
    """One server at one concurrency: per prompt TTFT, identity with its exact answer, error."""

    server: str
    concurrency: int
    ttft_s: list[float | None]
    identical: list[bool | None]  # None: not compared (vLLM, or a failed request)
    errors: list[str | None]

    @classmethod
    def of(cls, server: str, concurrency: int, replies: Sequence[Reply],
           exact: Sequence[Reply] | None) -> ServerRun:
        same = [None if exact is None or r.error or e.error else r.text == e.text
                for r, e in zip(replies, exact or replies, strict=True)]
        return cls(server, concurrency, [r.ttft_s for r in replies], same,
                   [r.error for r in replies])

    def summary(self) -> dict[str, Any]:
        ttfts = [t for t in self.ttft_s if t is not None]
        compared = [x for x in self.identical if x is not None]
        return {"server": self.server, "concurrency": self.concurrency,
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
                "identical": sum(compared) / len(compared) if compared else None,
                "compared": len(compared), "errors": sum(e is not None for e in self.errors),
                "no_delta": sum(t is None and e is None  # answered, nothing streamed
                                for t, e in zip(self.ttft_s, self.errors, strict=True)),
                "reference": REFERENCES.get(self.server, "")}


@dataclass
class ServersResult:
    """The whole comparison: settings, where and when it ran, each server's runs."""

    config: dict[str, Any]
    date: str
    command: str
    machine: dict[str, Any]
    prompts: list[str]  # the cases' ids, in order
    prompt_tokens: list[int]
    runs: list[ServerRun] = field(default_factory=list)
    launches: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": [r.summary() for r in self.runs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServersResult:
        return cls(dict(d["config"]), d["date"], d["command"], dict(d["machine"]),
                   list(d["prompts"]), list(d["prompt_tokens"]),
                   [ServerRun(**r) for r in d["runs"]], dict(d.get("launches", {})))

    def table(self) -> str:
        rows = ["server   c  p50 TTFT  p90 TTFT  identical  errors"]
        for s in (r.summary() for r in self.runs):
            same = "itself" if s["identical"] is None else f"{s['identical']:.0%}"
            rows.append(f"{s['server']:<8} {s['concurrency']:>2} {_ms(s['ttft_p50_s'])} "
                        f"{_ms(s['ttft_p90_s'])}  {same:>9}  {s['errors']:>6}")
        return "\n".join(rows)


def _ms(s: float | None) -> str:
    return f"{'-':>9}" if s is None else f"{s * 1000:>7.0f}ms"


def plot(result: ServersResult, path: Path) -> None:
    """p90 TTFT per server, a bar per concurrency."""
    from kvnotes_bench.kit.plots import grouped_bars, panels

    conc = sorted({r.concurrency for r in result.runs})
    servers = [s for s in SERVERS if any(r.server == s for r in result.runs)]
    p90 = {(r.server, r.concurrency): r.summary()["ttft_p90_s"] or 0.0 for r in result.runs}
    with panels(path, size=(6.5, 4.0), title=f"{result.config.get('model')}: p90 TTFT, "
                f"{len(result.prompts)} prompts") as (ax,):
        grouped_bars(ax, servers, {f"c{c}": [p90.get((s, c), 0.0) for s in servers]
                                   for c in conc})
        ax.set_ylabel("p90 TTFT (s)")
        ax.legend()
