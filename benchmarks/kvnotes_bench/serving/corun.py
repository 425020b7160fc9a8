"""The decode latency of a request that runs beside spliced requests, against beside exact ones.

A *probe* (a short exact prompt, ``probe_tokens`` greedy tokens with ``ignore_eos``) is streamed
again and again for ``seconds`` while ``background`` clients send requests of the soak's shape
(header, ``k`` skills in random order, user text) in a loop. Modes:

- ``idle``: no background (the floor);
- ``spliced``: the background requests carry a splice request and salt (tenant ``corun``): the
  connector writes their skills' KV before the step's forward, vLLM computes the user text;
- ``exact``: the same background prompts, in the same order, without a salt: vLLM computes
  them (its prefix cache reuses what earlier exact prompts share, typically the header and a
  first skill).

The probe's inter-token latency (gap between successive streamed tokens) is what a decoding
user feels of the others' prefills and splices; p50/p99 per mode, with vLLM's preemption
counter read around each mode.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes_bench.kit.machine import load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.kit.stats import percentile
from kvnotes_bench.serving.client import open_client
from kvnotes_bench.serving.soak_client import PREEMPTIONS, Answer, read_counter, stream_completion

CORUN_MODES = ("idle", "spliced", "exact")
CORUN_TENANT = "corun"


@dataclass(frozen=True)
class CorunConfig:
    """What the co-running measurement runs (``seconds`` per mode, after ``warmup_s`` of
    background alone)."""

    seconds: float = 40.0
    background: int = 7
    probe_tokens: int = 64
    modes: tuple[str, ...] = CORUN_MODES
    k: int = 3
    max_tokens: int = 16
    warmup_s: float = 3.0
    seed: int = 1

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in CORUN_MODES]
        if unknown:
            raise UnknownNameError("co-running mode", unknown[0], CORUN_MODES)
        if not self.modes:
            raise InvalidArgumentError("co-running: name at least one mode")
        if self.seconds <= 0 or self.warmup_s < 0:
            raise InvalidArgumentError(f"co-running: seconds ({self.seconds}) must be positive "
                                       f"and warm-up ({self.warmup_s}) not negative")
        if self.background < 1 or self.probe_tokens < 2 or self.k < 1 or self.max_tokens < 1:
            raise InvalidArgumentError("co-running: background clients, skills per request and "
                                       "background tokens must be at least 1, probe tokens at "
                                       "least 2")


def inter_token_gaps(answer: Answer) -> list[float]:
    """Seconds between successive streamed tokens (a chunk carrying n tokens counts its gap n
    times, divided by n); the first token's wait (TTFT) is not a gap."""
    gaps: list[float] = []
    for prev, t, n in zip(answer.chunk_s, answer.chunk_s[1:], answer.chunk_tokens[1:],
                          strict=False):
        gaps += [(t - prev) / n] * n
    return gaps


@dataclass
class ModeResult(Record):
    """One mode: the probe's inter-token latency and what the background sent."""

    mode: str
    probes: int
    probes_failed: int
    tokens: int
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_mean_s: float | None
    background_requests: int
    background_failed: int
    background_prompt_tokens_mean: float | None
    preemptions: float | None
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)


@dataclass
class CorunResult:
    config: CorunConfig
    modes: list[ModeResult]

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "modes": [m.to_dict() for m in self.modes]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CorunResult:
        config: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in d["config"].items()}
        return cls(config=CorunConfig(**config),
                   modes=[ModeResult.from_dict(m) for m in d["modes"]])


def mode_result(mode: str, probes: list[Answer], background: list[Answer],
                preemptions: float | None, loads: tuple[list[float], list[float]]
                ) -> ModeResult:
    gaps = [g for a in probes if a.ok for g in inter_token_gaps(a)]
    prompt = [a.prompt_tokens for a in background if a.ok and a.prompt_tokens]
    return ModeResult(
        mode=mode, probes=sum(a.ok for a in probes), probes_failed=sum(not a.ok for a in probes),
        tokens=len(gaps), itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
        itl_mean_s=sum(gaps) / len(gaps) if gaps else None,
        background_requests=len(background),
        background_failed=sum(not a.ok for a in background),
        background_prompt_tokens_mean=sum(prompt) / len(prompt) if prompt else None,
        preemptions=preemptions, load_before=loads[0], load_after=loads[1])


async def run_corun(url: str, model: str, tokenizer: Any, config: CorunConfig, header: str,
                    texts: Mapping[str, str], *, request_timeout_s: float,
                    say: Callable[[str], None] = print) -> CorunResult:
    """Every mode of ``config`` on the server at ``url``, one after the other."""
    from kvnotes.serving.planning.layout import prompt_ids
    from kvnotes.serving.protocol import SpliceRequest
    from kvnotes.serving.vllm_endpoints import Client
    from kvnotes_bench.serving.prompt_sets import user_text

    client = open_client(url, timeout=request_timeout_s)
    metrics = Client(url)
    names = sorted(texts)
    results: list[ModeResult] = []

    def background_ids(cid: int, i: int) -> list[int]:
        # the same prompt sequence in every mode: request i of client cid
        rng = random.Random(f"{config.seed}:{cid}:{i}")
        chosen = rng.sample(names, min(config.k, len(names)))
        return prompt_ids(tokenizer, [header, *(texts[s] for s in chosen), user_text(rng)])

    async def background(mode: str, cid: int, end: float, out: list[Answer]) -> None:
        splice = SpliceRequest.leading(CORUN_TENANT) if mode == "spliced" else None
        i = 0
        while time.monotonic() < end:
            out.append(await stream_completion(client, model, background_ids(cid, i),
                                               max_tokens=config.max_tokens, splice=splice))
            i += 1

    async def probes(start: float, end: float, out: list[Answer]) -> None:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        rng = random.Random(f"{config.seed}:probe")
        while time.monotonic() < end:
            ids = prompt_ids(tokenizer, [header, user_text(rng)])
            out.append(await stream_completion(client, model, ids, max_tokens=config.probe_tokens,
                                               ignore_eos=True))

    try:
        for mode in config.modes:
            load0 = load_now()
            pre0 = read_counter(await asyncio.to_thread(metrics.metrics_text), PREEMPTIONS)
            t0 = time.monotonic()
            start, end = t0 + config.warmup_s, t0 + config.warmup_s + config.seconds
            probe: list[Answer] = []
            bg: list[Answer] = []
            jobs = [probes(start, end, probe)]
            if mode != "idle":
                jobs += [background(mode, c, end, bg) for c in range(config.background)]
            await asyncio.gather(*jobs)
            pre1 = read_counter(await asyncio.to_thread(metrics.metrics_text), PREEMPTIONS)
            r = mode_result(mode, probe, bg, None if pre0 is None or pre1 is None
                            else pre1 - pre0, (load0, load_now()))
            results.append(r)
            say(f"co-running {mode}: probe ITL p50 {_ms(r.itl_p50_s)} p99 {_ms(r.itl_p99_s)} "
                f"over {r.tokens} tokens; background {r.background_requests} requests "
                f"({r.background_failed} failed)")
    finally:
        await client.close()
    return CorunResult(config, results)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f} ms"
