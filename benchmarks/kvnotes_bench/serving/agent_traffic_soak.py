"""``serve-bench agent``'s capped-library soak: random tool subsets, every answer checked.

``clients`` concurrent clients send ``requests`` chat requests in all, each with a random
subset (``tools`` = lo..hi) of a pool of ``pool`` BFCL ``live_multiple`` development tools (a
seeded sample: an entry is ~30-50 KB per token in float32, so a dozen tools compiled behind a
few prefixes each are already hundreds of MB) in random order and one of the cases' questions,
greedy, ``max_tokens`` tokens; a fraction is sent with ``splice: false``. The server learns
with a library cap smaller than the working set, so entries are evicted while requests use
them. While the clients run, every entry the library publishes is kept (a hard link in
``out/soak-entries``: an evicted entry stays readable for the check). After the run (the server
stopped) every answer is checked against the one engine reference its report describes
(:mod:`~kvnotes_bench.serving.agent_traffic_check`; the references computed are counted).

Reported: requests served and failed, answers wrong / near tie / unchecked, the hit rate
(spliced requests over requests sent after one of their tools had been seen ``sightings``
times), the share of prompt tokens spliced, the evictions the server's ``/metrics`` count
(every counter whose name says ``evict``; None when it exports none), the bytes the library
published against its cap.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.kit.machine import load_now
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_client import Answer, Sender
from kvnotes_bench.serving.agent_traffic_records import SoakRequestRecord
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest, subset_request

if TYPE_CHECKING:
    from kvnotes_bench.serving.agent_traffic_check import AgentOracle, CheckConfig
    from kvnotes_bench.serving.agent_traffic_render import Rendered


# vLLM's float32 CPU kernels and the engine give the same computation's top-2 log-prob margins
# within ~3e-5 (measured on the soak's splice: false answers); a larger gap on an answer whose
# tokens equal a reference says the reference is not the server's very computation
GAP_TAU = 1e-3


@dataclass(frozen=True)
class AgentSoakConfig:
    """The soak's traffic (see the module docstring)."""

    clients: int = 4
    requests: int = 200
    pool: int = 12  # tools drawn from (a seeded sample of the cases' tools)
    tools_min: int = 2
    tools_max: int = 4
    exact_fraction: float = 0.2
    max_tokens: int = 16
    sightings: int = 2
    seed: int = 0
    tie_tau: float = 0.05
    drift_tau: float | None = None  # compare greedy paths up to a near tie (None: whole)

    def __post_init__(self) -> None:
        if self.pool < self.tools_max:
            raise InvalidArgumentError(f"--pool-tools {self.pool}: at least the tools per "
                                       f"request ({self.tools_max})")
        if self.clients < 1 or self.requests < 1:
            raise InvalidArgumentError("the soak needs at least one client and one request")
        if not 1 <= self.tools_min <= self.tools_max:
            raise InvalidArgumentError(f"tools per request {self.tools_min}..{self.tools_max}: "
                                       "give 1 <= min <= max")
        if not 0.0 <= self.exact_fraction <= 1.0:
            raise InvalidArgumentError("--exact-fraction must lie in [0, 1]")
        if self.drift_tau is not None and not self.drift_tau >= 0.0:
            raise InvalidArgumentError("--drift-tau must be >= 0")


@dataclass
class SoakRecord:
    """One soak request and its answer (``verdict`` after the check)."""

    index: int
    client: int
    sent_s: float
    tools: list[str]
    question: int
    splice: bool
    eligible: bool  # one of its tools had been seen `sightings` times before it was sent
    answer: Answer
    verdict: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["answer"] = self.answer.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SoakRecord:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["answer"] = Answer.from_dict(d["answer"])
        return cls(**kw)


class EntryKeeper:
    """Keeps every entry file published under ``library`` (recursively) as a hard link in
    ``keep`` (a copy where links are refused), polling every ``interval_s``."""

    def __init__(self, library: Path, keep: Path, interval_s: float = 0.2) -> None:
        self.library, self.keep, self.interval_s = library, keep, interval_s
        self.kept: set[str] = set()
        keep.mkdir(parents=True, exist_ok=True)

    def sweep(self) -> int:
        """Keep what is new; returns how many files were kept."""
        n = 0
        for path in self.library.rglob("*.safetensors") if self.library.is_dir() else []:
            if path.name.startswith(".") or path.name in self.kept:
                continue
            target = self.keep / path.name
            try:
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)
            except FileNotFoundError:
                continue  # evicted since the listing
            self.kept.add(path.name)
            n += 1
        return n

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sweep)
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass
        await asyncio.to_thread(self.sweep)

    def bytes_kept(self) -> int:
        return sum(p.stat().st_size for p in self.keep.glob("*.safetensors"))


def evictions(metrics_texts: Sequence[str]) -> float | None:
    """The sum of every ``/metrics`` counter whose name says ``evict`` (None: none exported)."""
    from kvnotes_bench.serving.metrics import parse_prometheus

    total, found = 0.0, False
    for text in metrics_texts:
        for name, value in parse_prometheus(text).items():
            if "evict" in name and not name.endswith("_created"):
                total += value
                found = True
    return total if found else None


async def soak_clients(sender: Sender, pool: Sequence[dict[str, Any]], questions: Sequence[str],
                       config: AgentSoakConfig, *, say: Callable[[str], None] = lambda s: None
                       ) -> tuple[list[tuple[SoakRecord, AgentRequest]], float]:
    """The clients until ``config.requests`` are answered; records with their requests."""
    records: list[tuple[SoakRecord, AgentRequest]] = []
    seen: Counter[str] = Counter()
    counter = iter(range(config.requests))
    t0 = time.monotonic()

    async def one_client(cid: int) -> None:
        rng = random.Random(f"kvnotes-agent-soak:{config.seed}:{cid}")
        for index in counter:  # one iterator shared by the clients (one thread: no lock)
            req = subset_request(pool, questions, rng,
                                 k=(config.tools_min, config.tools_max), index=index)
            splice = rng.random() >= config.exact_fraction
            names = list(req.candidates)
            eligible = splice and any(seen[n] >= config.sightings for n in names)
            seen.update(names)
            sent = time.monotonic() - t0
            answer = await sender.send(req, splice=splice, max_tokens=config.max_tokens)
            records.append((SoakRecord(index, cid, round(sent, 3), names,
                                       list(questions).index(req.question), splice, eligible,
                                       answer), req))
            if len(records) % 50 == 0:
                say(f"  [{time.monotonic() - t0:6.1f} s] {len(records)} requests, "
                    f"{sum(not r.answer.ok for r, _ in records)} failed, load {load_now()}")

    await asyncio.gather(*(one_client(c) for c in range(config.clients)))
    return records, time.monotonic() - t0


def request_record(rec: SoakRecord, rendered: Rendered | None, tenant: str | None,
                   why: str | None = None) -> SoakRequestRecord:
    """The per-request record of ``rec`` (its prompt as rebuilt: ``rendered``)."""
    a = rec.answer
    row = SoakRequestRecord(
        index=rec.index, client=rec.client, sent_s=rec.sent_s, tenant=tenant, splice=rec.splice,
        eligible=rec.eligible, tools=list(rec.tools), question=rec.question, ok=a.ok,
        error=a.error, prompt_tokens=a.prompt_tokens, spliced_tokens=a.spliced_tokens,
        usage=a.kvnotes,
        tokens=list(a.tokens), margins=list(a.margins), text=a.text,
        finish_reason=a.finish_reason)
    if rendered is not None:
        row.prompt_ids, row.prompt_source = list(rendered.ids), rendered.source
        row.stop = list(rendered.stop)
    elif a.ok:
        row.verdict = {"status": "unchecked", "why": why or "the prompt could not be rendered"}
    return row


def check_records(records: Sequence[tuple[SoakRecord, AgentRequest]], oracle: AgentOracle,
                  tokenizer: Any, config: CheckConfig, *, tenant: str | None = None,
                  render: Callable[[Any, AgentRequest, Sequence[str]], Rendered] | None = None,
                  say: Callable[[str], None] = lambda s: None) -> list[SoakRequestRecord]:
    """A verdict for every answered request (:func:`~kvnotes_bench.serving.
    agent_traffic_check.check_request`), set on its :class:`SoakRecord`; returns the
    per-request records, failed requests included. ``render``: the prompt of a request, cut
    at the texts of the entries its answer's report names
    (:func:`~kvnotes_bench.serving.agent_traffic_render.rendered_prompt`)."""
    from kvnotes.serving.protocol import ProtocolError
    from kvnotes_bench.serving.agent_traffic_check import check_request, read_usage
    from kvnotes_bench.serving.agent_traffic_render import rendered_prompt

    render = render or rendered_prompt
    rows: list[SoakRequestRecord] = []
    for rec, req in records:
        try:
            usage = read_usage(rec.answer.kvnotes)
        except ProtocolError:
            usage = None  # the check says why
        cuts = oracle.entries.texts(usage, tokenizer) if usage is not None else []
        try:
            rendered, why = render(tokenizer, req, cuts), None
        except Exception as err:  # noqa: BLE001  # e.g. no chat template: the answer is unchecked
            rendered, why = None, (f"the prompt could not be rendered: {type(err).__name__}: "
                                   f"{str(err)[:200]}")
        rows.append(request_record(rec, rendered, tenant, why))
    # in the order sent: a request's prefix-cache hit is taken from an earlier one's layout
    done = sorted(((rec, row) for (rec, _), row in zip(records, rows, strict=True)
                   if rec.answer.ok), key=lambda pair: (pair[0].sent_s, pair[0].index))
    for n, (rec, row) in enumerate(done):
        if row.verdict is None:
            row.verdict = check_request(row, oracle, tokenizer, config).to_dict()
        rec.verdict = row.verdict
        status = row.verdict.get("status")
        if status != "ok":
            say(f"  request {rec.index} (tools {rec.tools}, splice {rec.splice}): {status}"
                + (f" at step {row.verdict.get('diverged_at')}" if status != "unchecked"
                   else f" ({row.verdict.get('why')})"))
        if (n + 1) % 50 == 0:
            say(f"  checked {n + 1}/{len(done)} ({oracle.computed} references)")
    return rows


@dataclass(frozen=True)
class SoakSummary(Record):
    """The soak's figures."""

    requests: int
    served: int
    failed: int
    checked: int
    wrong: int
    near_tie: int
    unchecked: int
    matched: dict[str, int]  # which reference the ok answers equal (reported, exact)
    eligible: int
    spliced: int  # eligible requests the front spliced
    hit_rate: float | None  # spliced / eligible
    share_pooled: float | None  # spliced tokens over prompt tokens, spliced-mode requests
    errors: dict[str, int] = field(default_factory=dict)
    cut: int = 0  # ok answers compared only up to a near tie (the drift rule)
    cut_at: dict[str, int] = field(default_factory=dict)  # the step compared up to: count
    # ok answers whose top-2 margins differ from the matched reference's by more than
    # GAP_TAU somewhere: equal tokens, but not the reference's very computation
    gapped: int = 0
    gap_max: float | None = None


def summarize(records: Sequence[SoakRecord]) -> SoakSummary:
    """The figures of checked (or unchecked) records."""
    ok = [r for r in records if r.answer.ok]
    status = Counter((r.verdict or {}).get("status", "unchecked") for r in ok)
    matched = Counter(str((r.verdict or {}).get("matched", "")).split("@")[0] for r in ok
                      if (r.verdict or {}).get("status") == "ok")
    eligible = [r for r in ok if r.eligible]
    hits = sum(r.answer.spliced_tokens > 0 for r in eligible)
    cut = Counter(str((r.verdict or {}).get("compared")) for r in ok
                  if (r.verdict or {}).get("status") == "ok" and (r.verdict or {}).get("cut"))
    gaps = [float(g) for r in ok if (g := (r.verdict or {}).get("margin_gap")) is not None]
    spliced_mode = [r for r in ok if r.splice and r.answer.prompt_tokens]
    prompt = sum(r.answer.prompt_tokens or 0 for r in spliced_mode)
    return SoakSummary(
        requests=len(records), served=len(ok), failed=len(records) - len(ok),
        checked=status["ok"] + status["wrong"] + status["near_tie"], wrong=status["wrong"],
        near_tie=status["near_tie"], unchecked=status["unchecked"], matched=dict(matched),
        eligible=len(eligible), spliced=hits,
        hit_rate=hits / len(eligible) if eligible else None,
        share_pooled=(sum(r.answer.spliced_tokens for r in spliced_mode) / prompt
                      if prompt else None),
        errors=dict(Counter((r.answer.error or "?").split(":")[0] for r in records
                            if not r.answer.ok)),
        cut=sum(cut.values()), cut_at=dict(sorted(cut.items(), key=lambda kv: int(kv[0]))),
        gapped=sum(g > GAP_TAU for g in gaps), gap_max=max(gaps) if gaps else None)
