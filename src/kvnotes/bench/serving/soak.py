"""``kvnotes serve-bench soak``: the connector under a bounded, adversarial load, every answer
checked.

One vLLM server with kvnotes' connector and a KV cache small enough that vLLM preempts
requests; ``clients`` concurrent clients send requests for ``duration_s`` seconds, each one
``[header][k skills of the skills workload's library, random subset and order][user text]``:

- ``spliced``: the splice salt of one of a few shared tenants (the prefix cache is shared);
- ``exact``: no salt (vLLM's own prefix caching, never spliced KV);
- ``volatile``: spliced, with the volatile skill of the moment among the skills, in a tenant of
  its own. A background task publishes a new volatile skill every ``event_interval_s``, damages
  it ``damage_after_s`` later (in turn: one byte of its tensors flipped in place, or its file
  deleted) and stops using it ``retire_after_s`` after its publication.

A fraction of requests closes its stream after the first chunks (a client disconnecting). After
the run (the server stopped) every completed answer is checked against kvnotes' engine in this
process (:mod:`kvnotes.bench.serving.soak_check` says what each answer may equal). The result:
requests, errors by kind, wrong answers, disconnects, vLLM's preemption counter before and
after, latency percentiles, the skill events with their times, the machine and its load.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.bench.serving.kit import MachineRecord, load_now
from kvnotes.bench.serving.metrics import percentile
from kvnotes.bench.serving.soak_check import (
    DAMAGES,
    KINDS,
    SHARED_TENANTS,
    EngineOracle,
    Prompt,
    SkillEvent,
    Verdict,
    allowed,
    check,
    event_schedule,
)
from kvnotes.bench.serving.soak_client import PREEMPTIONS, Answer, read_counter, stream_completion
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError

if TYPE_CHECKING:
    from kvnotes.bench.serving.corun import CorunConfig, CorunResult
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.launch.launcher import LaunchConfig, LaunchRecord
    from kvnotes.serving.skills import ServingSkills

# short user turns: every reference is computed by the engine, and a distinct prompt costs its
# user text and the answer's steps (the skills before it are spliced or shared prefixes)
USERS = ("\n\nCustomer: my bag arrived torn. What do I get?\nAgent:",
         "\n\nCustomer: can I cancel my flight tomorrow and get my money back?\nAgent:",
         "\n\nCustomer: my flight was six hours late. What am I owed?\nAgent:",
         "\n\nCustomer: I am a gold member; can I change my booking for free?\nAgent:",
         "\n\nCustomer: I missed my connection. What happens now?\nAgent:",
         "\n\nCustomer: can I add a second bag after check-in?\nAgent:")
SOAK_SKILLS = ("baggage", "cancellation", "compensation", "refunds")
_NOTICES = ("a strike at the destination airport", "a runway closure", "a storm warning",
            "a check-in system outage", "a fuel shortage", "an air-traffic control strike")


def volatile_text(i: int) -> str:
    """The ``i``-th volatile skill: a short notice no other skill shares a token run with."""
    notice = _NOTICES[i % len(_NOTICES)]
    return (f"## Temporary notice {i}\n\nBecause of {notice} (notice {i}), passengers booked "
            f"on affected flights may rebook once without a change fee within {24 + i} hours; "
            "refunds follow the refund policy.\n\n")


@dataclass(frozen=True)
class SoakConfig:
    """What one soak runs.

    Args:
        duration_s: seconds clients keep sending (a request in flight at the end finishes).
        clients: concurrent clients (each sends its next request when its last one ends).
        max_tokens: greedy tokens per answer (every one is checked).
        skills: the library skills requests draw from (a few: each distinct prompt costs a
            reference computed by the engine).
        k_min, k_max: skills per request, drawn uniformly.
        users: how many of the short user turns (:data:`USERS`) requests draw from.
        exact_fraction: requests sent exactly (no salt).
        volatile_fraction: requests that carry the volatile skill of the moment (when one is
            live; spliced otherwise).
        disconnect_fraction: requests whose stream the client closes after 1-3 chunks.
        event_interval_s, damage_after_s, retire_after_s, first_event_s: the skill events
            (:func:`~kvnotes.bench.serving.soak_check.event_schedule`).
        block_size: the server's KV block size (tokens; CPU: a multiple of 32).
        kv_blocks: the server's KV cache in blocks (``--num-gpu-blocks-override``): small, so
            vLLM preempts.
        max_model_len: the server's longest prompt plus answer.
        tie_tau: server log-probability gap under which a divergence is a near tie.
        seed: the workload's random seed.
    """

    model: str = "smollm2-135m"
    duration_s: float = 180.0
    clients: int = 8
    max_tokens: int = 16
    skills: tuple[str, ...] = SOAK_SKILLS
    k_min: int = 1
    k_max: int = 2
    users: int = 4
    exact_fraction: float = 0.2
    volatile_fraction: float = 0.3
    disconnect_fraction: float = 0.1
    event_interval_s: float = 20.0
    damage_after_s: float = 8.0
    retire_after_s: float = 16.0
    first_event_s: float = 5.0
    block_size: int = 32
    kv_blocks: int = 96
    max_model_len: int = 2048
    tie_tau: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        from kvnotes.bench.serving.prompt_sets import skill_texts

        library = skill_texts()
        unknown = [name for name in self.skills if name not in library]
        if unknown:
            raise UnknownNameError("skill", unknown[0], sorted(library))
        if self.duration_s <= 0:
            raise InvalidArgumentError(f"--duration must be positive, got {self.duration_s}")
        if self.clients < 1:
            raise InvalidArgumentError(f"--clients must be at least 1, got {self.clients}")
        if not 1 <= self.max_tokens <= 256:
            raise InvalidArgumentError(f"--max-tokens must be 1-256 (every answer is checked "
                                       f"against the engine), got {self.max_tokens}")
        if not 1 <= self.k_min <= self.k_max <= len(self.skills):
            raise InvalidArgumentError(f"skills per request: need 1 <= k_min ({self.k_min}) <= "
                                       f"k_max ({self.k_max}) <= {len(self.skills)} (the skills "
                                       "drawn from)")
        if not 1 <= self.users <= len(USERS):
            raise InvalidArgumentError(f"users must be 1-{len(USERS)}, got {self.users}")
        for name in ("exact_fraction", "volatile_fraction", "disconnect_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidArgumentError(f"{name} must lie in [0, 1], got {value}")
        if self.exact_fraction + self.volatile_fraction > 1.0:
            raise InvalidArgumentError("exact_fraction + volatile_fraction must be at most 1")
        if self.block_size <= 0 or self.block_size % 32:
            raise InvalidArgumentError(f"--block-size {self.block_size}: vLLM's CPU build "
                                       "takes a positive multiple of 32")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise InvalidArgumentError(
                f"--kv-blocks {self.kv_blocks} x block size {self.block_size} holds fewer "
                f"tokens than max_model_len {self.max_model_len}: vLLM refuses to start")
        if self.tie_tau < 0:
            raise InvalidArgumentError(f"tie_tau must be 0 or more, got {self.tie_tau}")
        self.events()  # refuses an event timing that does not fit

    def events(self) -> list[SkillEvent]:
        return event_schedule(self.duration_s, interval_s=self.event_interval_s,
                              damage_after_s=self.damage_after_s,
                              retire_after_s=self.retire_after_s, first_s=self.first_event_s)

    def launch(self, base: LaunchConfig, skills: Path) -> LaunchConfig:
        """``base`` with this soak's cache, block size, length and skill folder."""
        import dataclasses

        return dataclasses.replace(
            base, skills=skills, block_size=self.block_size, max_model_len=self.max_model_len,
            kv_cache_gib=1, extra_args=(*base.extra_args, "--num-gpu-blocks-override",
                                        str(self.kv_blocks)))


# ---- requests --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    """One request a client sends: its kind, prompt, tenant and whether it disconnects."""

    kind: str
    prompt: Prompt
    tenant: str | None
    close_after: int | None = None
    volatile: int | None = None  # the volatile skill's index

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"request kind {self.kind!r}: use one of "
                                       f"{', '.join(KINDS)}")


def next_spec(rng: random.Random, config: SoakConfig, live: int | None) -> RequestSpec:
    """The next request of a client; ``live`` is the volatile skill of the moment (None: none).

    A spliced request carries ``k_min``-``k_max`` library skills, an exact one a single skill.
    A volatile request is ``[header][one library skill][the volatile skill][user]``: the
    volatile skill is moved (it was compiled right behind the header), so its splice differs
    from an exact prefill, and it is last, so the run cut at it leaves little to compute.
    """
    r = rng.random()
    kind = ("exact" if r < config.exact_fraction else
            "volatile" if live is not None and r < config.exact_fraction + config.volatile_fraction
            else "spliced")
    # exact and volatile requests carry one library skill: their exact references share the
    # prefill of header + skill (the engine computes each once)
    n = rng.randint(config.k_min, config.k_max) if kind == "spliced" else 1
    names = rng.sample(list(config.skills), n)
    at = None
    if kind == "volatile":
        at = len(names)
        names.append(volatile_name(live))  # type: ignore[arg-type]
    close = rng.randint(1, 3) if rng.random() < config.disconnect_fraction else None
    tenant = (f"soak-v{live}-{uuid.uuid4().hex[:12]}" if kind == "volatile"
              else rng.choice(SHARED_TENANTS) if kind == "spliced" else None)
    user = USERS[rng.randrange(min(config.users, len(USERS)))]
    return RequestSpec(kind, Prompt(tuple(names), user, config.max_tokens, at), tenant, close,
                       live if kind == "volatile" else None)


def volatile_name(i: int) -> str:
    return f"volatile-{i}"


def salt_of(spec: RequestSpec) -> str | None:
    from kvnotes.serving.library.manifest import splice_salt

    return None if spec.kind == "exact" else splice_salt(spec.tenant)


@dataclass
class SoakRecord:
    """One request of the soak, with its answer and, once checked, its verdict."""

    index: int
    client: int
    spec: RequestSpec
    sent_s: float  # seconds after the run started
    answer: Answer
    verdict: Verdict | None = None
    after_damage: bool = False

    def to_dict(self) -> dict[str, Any]:
        a = self.answer
        p = self.spec.prompt
        return {"index": self.index, "client": self.client, "kind": self.spec.kind,
                "skills": list(p.skills), "user": p.user, "max_tokens": p.max_tokens,
                "volatile_at": p.volatile_at, "tenant": self.spec.tenant,
                "close_after": self.spec.close_after,
                "volatile": self.spec.volatile, "after_damage": self.after_damage,
                "sent_s": round(self.sent_s, 3), "ok": a.ok, "disconnected": a.disconnected,
                "error": a.error, "error_kind": a.error_kind, "ttft_s": a.ttft_s,
                "total_s": a.total_s, "prompt_tokens": a.prompt_tokens,
                "cached_tokens": a.cached_tokens, "finish_reason": a.finish_reason,
                "token_ids": a.token_ids,
                "top": [{str(k): v for k, v in d.items()} for d in a.top],
                "verdict": None if self.verdict is None else self.verdict.to_dict()}


def record_from_dict(d: dict[str, Any]) -> SoakRecord:
    """A record back from its JSON form (without its verdict: checks are made again)."""
    prompt = Prompt(tuple(d["skills"]), d["user"], d["max_tokens"], d["volatile_at"])
    spec = RequestSpec(d["kind"], prompt, d["tenant"], d["close_after"], d["volatile"])
    answer = Answer(ok=d["ok"], error=d["error"], error_kind=d["error_kind"],
                    disconnected=d["disconnected"], token_ids=list(d["token_ids"]),
                    top=[{int(k): v for k, v in t.items()} for t in d["top"]],
                    finish_reason=d["finish_reason"], prompt_tokens=d["prompt_tokens"],
                    cached_tokens=d["cached_tokens"], ttft_s=d["ttft_s"], total_s=d["total_s"])
    return SoakRecord(d["index"], d["client"], spec, d["sent_s"], answer)


# ---- the volatile skills ---------------------------------------------------------------------
@dataclass
class EventLog:
    """The skill events as they happened: planned and actual times, the skill's file."""

    events: list[dict[str, Any]] = field(default_factory=list)
    live: int | None = None
    notebooks: dict[str, Notebook] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def damage_file(path: Path, kind: str) -> None:
    """``corrupt``: one byte of the file's tensor data flipped, in place (the index keeps the
    entry; its checksum fails when read); ``delete``: the file removed."""
    if kind == "delete":
        path.unlink()
        return
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)  # inside the last tensor's bytes
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


async def run_events(schedule: Sequence[SkillEvent], skills: ServingSkills, header: str,
                     log: EventLog, t0: float, say: Callable[[str], None],
                     keep: Path | None = None) -> None:
    """Publish, damage and retire the volatile skills at their times (compiling in a thread);
    each published file is copied to ``keep`` first (the references need it after its
    damage)."""
    import shutil

    paths: dict[int, Path] = {}
    for ev in schedule:
        await asyncio.sleep(max(0.0, t0 + ev.t_s - time.monotonic()))
        name = volatile_name(ev.skill)
        started = time.monotonic() - t0
        if ev.kind == "publish":
            text = volatile_text(ev.skill)
            await asyncio.to_thread(skills.add, text, name=name, after=header)
            log.notebooks[name] = skills.library.get(text, name=name, after=header)
            log.texts[name] = text
            paths[ev.skill] = skills.library.path_for(text, after=header)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(paths[ev.skill], keep / f"{name}.safetensors")
            log.live = ev.skill
        elif ev.kind == "retire":
            log.live = None
        else:
            await asyncio.to_thread(damage_file, paths[ev.skill], ev.kind)
        done = time.monotonic() - t0
        log.events.append({"kind": ev.kind, "skill": ev.skill, "planned_s": ev.t_s,
                           "started_s": round(started, 3), "done_s": round(done, 3)})
        say(f"[{done:6.1f} s] {ev.kind} {name}")


# ---- the run ---------------------------------------------------------------------------------
async def soak_clients(url: str, model: str, tokenizer: Any, config: SoakConfig,
                       skills: ServingSkills, header: str, texts: dict[str, str],
                       events: EventLog, *,
                       request_timeout_s: float, say: Callable[[str], None],
                       keep: Path | None = None
                       ) -> tuple[list[tuple[SoakRecord, list[int]]], float]:
    """The clients and the event task for ``config.duration_s``; the records with their ids."""
    import copy

    from openai import AsyncOpenAI

    from kvnotes.serving.planning.layout import prompt_ids

    # the event task compiles skills in a thread with the engine's tokenizer; a fast
    # tokenizer refuses two threads at once, so the clients tokenize with their own copy
    tokenizer = copy.deepcopy(tokenizer)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="kvnotes", timeout=request_timeout_s,
                         max_retries=0)
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
                                             salt=salt_of(spec), close_after=spec.close_after)
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


def damage_times(events: Sequence[dict[str, Any]]) -> dict[int, tuple[str, float]]:
    """Each damaged volatile skill's damage kind and the time it was done."""
    return {e["skill"]: (e["kind"], e["done_s"]) for e in events if e["kind"] in DAMAGES}


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


@dataclass
class SoakResult:
    """Everything one soak measured; :meth:`to_dict` is the ``result.json`` schema."""

    config: SoakConfig
    machine: MachineRecord
    records: list[SoakRecord]
    events: list[dict[str, Any]]
    wall_s: float
    preemptions_before: float | None
    preemptions_after: float | None
    server_log: dict[str, int]
    references: int
    how: str = ""
    threads: int | None = None
    launch: LaunchRecord | None = None
    corun: CorunResult | None = None
    started: str = ""

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.wall_s, self.preemptions_before,
                         self.preemptions_after)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workload": "soak", "started": self.started, "how": self.how,
            "config": asdict(self.config), "machine": self.machine.to_dict(),
            "threads": self.threads, "summary": self.summary(), "events": self.events,
            "wall_s": self.wall_s, "preemptions_before": self.preemptions_before,
            "preemptions_after": self.preemptions_after, "server_log": self.server_log,
            "references_computed": self.references,
            "corun": None if self.corun is None else self.corun.to_dict(),
            "requests": [r.to_dict() for r in self.records]}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        return out


def summarize(recs: Sequence[SoakRecord], wall_s: float, preemptions_before: float | None,
              preemptions_after: float | None) -> dict[str, Any]:
    """The soak's figures from its records."""
    ok = [r for r in recs if r.answer.ok]
    failed = [r for r in recs if not r.answer.ok and not r.answer.disconnected]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.answer.error_kind or "other"] = errors.get(r.answer.error_kind or "other",
                                                            0) + 1
    verdicts: dict[str, int] = {}
    matched: dict[str, dict[str, int]] = {}
    for r in ok:
        if r.verdict is None:
            continue
        verdicts[r.verdict.status] = verdicts.get(r.verdict.status, 0) + 1
        key = r.spec.kind + (" after damage" if r.after_damage else "")
        row = matched.setdefault(key, {})
        label = (r.verdict.matched or r.verdict.status).split("@")[0]
        row[label] = row.get(label, 0) + 1
    lat = [r.answer.total_s for r in ok if r.answer.total_s is not None]
    ttft = [r.answer.ttft_s for r in ok if r.answer.ttft_s is not None]
    pre = (None if preemptions_before is None or preemptions_after is None
           else preemptions_after - preemptions_before)
    return {"requests": len(recs), "completed": len(ok), "failed": len(failed),
            "errors": dict(sorted(errors.items())), "disconnects": sum(
                r.answer.disconnected for r in recs),
            "by_kind": {k: sum(r.spec.kind == k for r in recs) for k in KINDS},
            "checked": sum(r.verdict is not None for r in ok),
            "wrong": verdicts.get("wrong", 0), "near_ties": verdicts.get("near_tie", 0),
            "matched": matched, "preemptions": pre,
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None}


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
    from kvnotes.bench.serving.prompt_sets import register_skills, skill_texts
    from kvnotes.serving.launch import launcher as launcher
    from kvnotes.serving.upstream import Client

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
            from kvnotes.bench.serving.corun import run_corun

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
    from kvnotes.bench.serving.soak_report import write_outputs

    write_outputs(result.to_dict(), out)  # the answers, unchecked: `--recheck` can resume here
    check_records(records, oracle, damage_times(events.events), eos=sorted(engine.eos_ids),
                  tie_tau=config.tie_tau, say=say)
    result.references = oracle.computed
    return result


def recheck(out: Path, engine: Engine, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Check the answers of a finished soak again from its ``out`` folder (``result.json``, the
    library in ``skills/``, the volatile skills' copies in ``volatile/``); returns the result's
    JSON form with the new verdicts."""
    import json

    from kvnotes.apps.agent.prompt import HEADER
    from kvnotes.bench.serving.prompt_sets import skill_texts
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.skills import ServingSkills

    data: dict[str, Any] = json.loads((out / "result.json").read_text("utf-8"))
    cfg = data["config"]
    skills = ServingSkills(out / "skills", engine)
    texts = skill_texts()
    notebooks = {name: skills.library.get(text, name=name, after=HEADER)
                 for name, text in texts.items()}
    for e in data["events"]:
        if e["kind"] == "publish":
            name = volatile_name(e["skill"])
            texts[name] = volatile_text(e["skill"])
            notebooks[name] = Notebook.load(out / "volatile" / f"{name}.safetensors", engine)
    oracle = EngineOracle(engine, (HEADER, skills.library.get(HEADER, name="header")),
                          notebooks, texts, block_size=cfg["block_size"])
    records = [record_from_dict(d) for d in data["requests"]]
    check_records([(r, None) for r in records], oracle, damage_times(data["events"]),
                  eos=sorted(engine.eos_ids), tie_tau=cfg["tie_tau"], say=say)
    data["requests"] = [r.to_dict() for r in records]
    data["references_computed"] = oracle.computed
    data["summary"] = summarize(records, data["wall_s"], data["preemptions_before"],
                                data["preemptions_after"])
    return data
