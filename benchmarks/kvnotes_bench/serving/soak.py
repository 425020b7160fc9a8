"""``kvnotes-bench serve soak``: the connector under a bounded, adversarial load, every answer
checked.

One vLLM server with kvnotes' connector and a KV cache small enough that vLLM preempts
requests; ``clients`` concurrent clients send requests for ``duration_s`` seconds, each one
``[header][k skills of the skills workload's library, random subset and order][user text]``:

- ``spliced``: the splice request and salt of one of a few shared tenants (the prefix cache is
  shared);
- ``exact``: no salt (vLLM's own prefix caching, never spliced KV);
- ``volatile``: spliced, with the volatile skill of the moment among the skills, in a tenant of
  its own. A background task publishes a new volatile skill every ``event_interval_s``, damages
  it ``damage_after_s`` later (in turn: one byte of its tensors flipped in place, or its file
  deleted) and stops using it ``retire_after_s`` after its publication.

A fraction of requests closes its stream after the first chunks (a client disconnecting). After
the run (the server stopped) every completed answer is checked against kvnotes' engine in this
process (:mod:`kvnotes_bench.serving.soak_check` says what each answer may equal). The result:
requests, errors by kind, wrong answers, disconnects, vLLM's preemption counter before and
after, latency percentiles, the skill events with their times, the machine and its load.

This module runs the soak and checks it; what it sends is
:mod:`~kvnotes_bench.serving.soak_workload`'s, the volatile skills' events
:mod:`~kvnotes_bench.serving.soak_events`', the records and the result
:mod:`~kvnotes_bench.serving.soak_result`'s.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.serving.client import open_client
from kvnotes_bench.serving.soak_check import EngineOracle, allowed, check
from kvnotes_bench.serving.soak_client import PREEMPTIONS, read_counter, stream_completion
from kvnotes_bench.serving.soak_events import EventLog, damage_times, run_events
from kvnotes_bench.serving.soak_result import SoakRecord, SoakResult
from kvnotes_bench.serving.soak_workload import SoakConfig, next_spec, splice_of

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes.serving.skills import ServingSkills
    from kvnotes_bench.serving.corun import CorunConfig


async def soak_clients(url: str, model: str, tokenizer: Any, config: SoakConfig,
                       skills: ServingSkills, header: str, texts: dict[str, str],
                       events: EventLog, *,
                       request_timeout_s: float, say: Callable[[str], None],
                       keep: Path | None = None
                       ) -> tuple[list[tuple[SoakRecord, list[int]]], float]:
    """The clients and the event task for ``config.duration_s``; the records with their ids."""
    import copy

    from kvnotes.serving.planning.layout import prompt_ids

    # the event task compiles skills in a thread with the engine's tokenizer; a fast
    # tokenizer refuses two threads at once, so the clients tokenize with their own copy
    tokenizer = copy.deepcopy(tokenizer)
    client = open_client(url, timeout=request_timeout_s)
    records: list[tuple[SoakRecord, list[int]]] = []
    t0 = time.monotonic()
    end = t0 + config.duration_s

    async def one_client(cid: int) -> None:
        rng = random.Random(f"{config.seed}:{cid}")
        while time.monotonic() < end:
            spec = next_spec(rng, config, events.live)
            parts = [header, *((texts | events.texts)[s] for s in spec.prompt.skills),
                     spec.prompt.user]
            ids = prompt_ids(tokenizer, parts)
            sent = time.monotonic() - t0
            answer = await stream_completion(client, model, ids, max_tokens=config.max_tokens,
                                             splice=splice_of(spec), close_after=spec.close_after)
            records.append((SoakRecord(len(records), cid, spec, sent, answer), ids))

    async def progress() -> None:
        while time.monotonic() < end:
            await asyncio.sleep(30)
            done = [r for r, _ in records]
            say(f"[{time.monotonic() - t0:6.1f} s] {len(done)} requests, "
                f"{sum(not r.answer.ok and not r.answer.disconnected for r in done)} failed, "
                f"load {load_now()}")

    try:
        await asyncio.gather(run_events(config.events(), skills, header, events, t0, say, keep),
                             progress(), *(one_client(c) for c in range(config.clients)))
    finally:
        await client.close()
    return records, time.monotonic() - t0


def check_records(records: Sequence[tuple[SoakRecord, list[int] | None]],
                  oracle: EngineOracle, damage: dict[int, tuple[str, float]], *,
                  eos: Sequence[int], tie_tau: float, say: Callable[[str], None]) -> None:
    """A verdict for every completed answer (references computed once per prompt)."""
    t0 = time.monotonic()
    done = [(r, ids) for r, ids in records if r.answer.ok]
    kinds_of: dict[int, tuple[str, ...]] = {}
    for rec, _ in done:
        spec = rec.spec
        hit = damage.get(spec.volatile) if spec.volatile is not None else None
        rec.after_damage = hit is not None and rec.sent_s >= hit[1]
        kinds_of[rec.index] = allowed(spec.kind, damage=hit[0] if hit else None,
                                      after_damage=rec.after_damage)
    oracle.warm([(rec.spec.prompt, k) for rec, _ in done for k in kinds_of[rec.index]], say=say)
    for n, (rec, ids) in enumerate(done):
        spec, kinds = rec.spec, kinds_of[rec.index]
        if ids is not None and ids != oracle.ids(spec.prompt):
            raise AssertionError(f"request {rec.index}: the engine rebuilds other ids than "
                                 "were sent")
        rec.verdict = check(rec.answer.token_ids, rec.answer.top, spec.prompt, kinds, oracle,
                            eos=eos, tie_tau=tie_tau)
        if rec.verdict.status != "ok":
            say(f"  request {rec.index} ({spec.kind}, skills {list(spec.prompt.skills)}): "
                f"{rec.verdict.status} at step {rec.verdict.diverged_at}")
        if (n + 1) % 50 == 0:
            say(f"  checked {n + 1}/{len(done)} ({time.monotonic() - t0:.0f} s, "
                f"{oracle.computed} references)")


SERVER_LOG_MARKS = {"spliced": "spliced tokens", "recomputed": "are recomputed",
                    "recovered": "Recovered from KV load failure", "skipped": "skipping skill file",
                    "removed": "no longer spliced", "errors": " ERROR ", "tracebacks": "Traceback"}


def scan_log(path: Path | None) -> dict[str, int]:
    """How often the server's log says each of :data:`SERVER_LOG_MARKS`."""
    if path is None or not path.is_file():
        return {}
    text = path.read_text("utf-8", errors="replace")
    return {k: text.count(mark) for k, mark in SERVER_LOG_MARKS.items()}


def run_soak(config: SoakConfig, base: LaunchConfig, engine: Engine, *, out: Path,
             corun: CorunConfig | None = None, request_timeout_s: float = 300.0, how: str = "",
             say: Callable[[str], None] = print) -> SoakResult:
    """Launch the server, publish the library, run the soak (and the co-running measurement),
    stop the server, check every answer."""
    import torch

    from kvnotes.apps.agent.prompt import HEADER
    from kvnotes.serving.launch import launcher as launcher
    from kvnotes.serving.vllm_endpoints import Client
    from kvnotes_bench.serving.prompt_sets import register_skills, skill_texts

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    launch = launcher.prepare(config.launch(base, out / "skills"), engine)
    assert launch.skills is not None  # the connector is on
    register_skills(launch.skills, anchor=True, log=say)
    texts = skill_texts()
    notebooks: dict[str, Notebook] = {
        name: launch.skills.library.get(text, name=name, after=HEADER)
        for name, text in texts.items()}
    header_nb = launch.skills.library.get(HEADER, name="header")
    events = EventLog()
    machine = MachineRecord.now()
    say(f"starting vLLM ({launch.model.dtype}, {config.kv_blocks} blocks of "
        f"{config.block_size}); log: {launch.server.log_path}")
    corun_result = None
    with launch:
        say(f"server up at {launch.url} after {launch.server.startup_s:.0f} s")
        metrics = Client(launch.url)
        model = launch.server.served_name
        before = read_counter(metrics.metrics_text(), PREEMPTIONS)
        records, wall = asyncio.run(soak_clients(
            launch.url, model, engine.tokenizer, config, launch.skills, HEADER, texts, events,
            request_timeout_s=request_timeout_s, say=say, keep=out / "volatile"))
        after = read_counter(metrics.metrics_text(), PREEMPTIONS)
        say(f"soak: {len(records)} requests in {wall:.0f} s; preemptions {before} -> {after}")
        if corun is not None:
            from kvnotes_bench.serving.corun import run_corun

            corun_result = asyncio.run(run_corun(launch.url, model, engine.tokenizer, corun,
                                                 HEADER, texts, request_timeout_s=request_timeout_s,
                                                 say=say))
    machine.finish()
    say("checking every completed answer against the engine")
    oracle = EngineOracle(engine, (HEADER, header_nb), notebooks | events.notebooks,
                          texts | events.texts, block_size=config.block_size)
    result = SoakResult(config=config, machine=machine, records=[r for r, _ in records],
                        events=events.events, wall_s=wall, preemptions_before=before,
                        preemptions_after=after, server_log=scan_log(launch.server.log_path),
                        references=0, how=how, threads=torch.get_num_threads(),
                        launch=launch.record(), corun=corun_result, started=started)
    # the answers, unchecked, kept should the check fail (the report comes with the verdicts)
    write_bundle(out, result.to_dict(), report="The answers are not checked yet.\n",
                 json_name="result.json", plot_name="latency.png")
    check_records(records, oracle, damage_times(events.events), eos=sorted(engine.eos_ids),
                  tie_tau=config.tie_tau, say=say)
    result.references = oracle.computed
    return result
