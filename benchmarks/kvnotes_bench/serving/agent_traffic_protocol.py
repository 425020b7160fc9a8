"""The fidelity protocol of ``serve-bench agent``: learn a case's chunks, then measure.

Per request (a BFCL case with its tools, or documents as content parts):

1. it is sent ``sightings`` times (the learning threshold: a chunk seen that many times is
   compiled in the background);
2. the benchmark waits until the front's learner has compiled the request's chunks: its
   ``compiles`` counter (``/kvnotes/stats``) has grown by the number of the request's
   learnable chunks not learned before (``learnable``: the chunks' token ids as the front lays
   them out, the ones of at least ``min_tokens``), or a compile failed, or ``learn_timeout_s``
   passed (the case is then measured anyway and recorded as not learned). Asking the front
   rather than probing the request: a request whose chunks all sit behind their exact prefix
   splices nothing, learned or not;
3. the same request with its chunks in another order (a fixed seeded permutation) is sent
   greedy, ``max_tokens`` tokens: as is (spliced where the front can, with its repair), once
   per ``repairs`` count (``kvnotes.repair: K``, the share floor off) and with ``splice:
   false`` (exact). The record compares them: the share of the prompt spliced, the tool choice
   (tools set), the first answer token and the whole answer.

:func:`summarize` gives the figures the issue's goals read (share of prompt tokens spliced >=
50%, tool choice identical >= 95%). Everything talks to a
:class:`~.agent_traffic_client.LearningSender`: tested with a fake one.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvnotes_bench.serving.agent_traffic_client import Answer, LearningSender
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest
from kvnotes_bench.serving.agent_traffic_share import (
    PooledBreakdown,
    ShareBreakdown,
    pool,
)

# the chunks of a request the front may learn: each one's token ids as the front lays it out
Learnable = Callable[[AgentRequest], Sequence[tuple[int, ...]]]

SHARE_GOAL = 0.5
CHOICE_GOAL = 0.95


@dataclass(frozen=True)
class ProtocolConfig:
    """How each case is run (see the module docstring)."""

    sightings: int = 2
    max_tokens: int = 16
    learn_timeout_s: float = 60.0
    poll_s: float = 0.5
    seed: int = 0  # of the measured request's chunk order
    repairs: tuple[int, ...] = ()  # kvnotes.repair counts measured besides the front's repair
    min_tokens: int = 32  # the front's LearnConfig.min_tokens: shorter chunks are not learned


@dataclass
class Variant:
    """The measured request spliced with ``kvnotes.repair: repair`` (the share floor off)."""

    repair: int
    answer: Answer
    breakdown: ShareBreakdown | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"repair": self.repair, "answer": self.answer.to_dict(),
                "breakdown": None if self.breakdown is None else self.breakdown.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Variant:
        b = d.get("breakdown")
        return cls(int(d["repair"]), Answer.from_dict(d["answer"]),
                   None if b is None else ShareBreakdown.from_dict(b))


@dataclass
class CaseRecord:
    """One case: what learning did, and the reordered request spliced against exact."""

    id: str
    kind: str
    chunks: int
    order: list[int]
    learned: bool  # the learner compiled the request's new chunks before the timeout
    learn_wait_s: float
    polls: int
    spliced: Answer
    exact: Answer
    answers: list[str]  # the ground truth's tool names (tools set)
    learn: dict[str, int] = field(default_factory=dict)  # expected, compiles, failures
    breakdown: ShareBreakdown | None = None  # of ``spliced``
    variants: list[Variant] = field(default_factory=list)

    def variant(self, repair: int) -> CaseRecord | None:
        """This record with the ``repair`` variant as its spliced answer (None: not run)."""
        for v in self.variants:
            if v.repair == repair:
                return replace(self, spliced=v.answer, breakdown=v.breakdown, variants=[])
        return None

    @property
    def measured(self) -> bool:
        return self.spliced.ok and self.exact.ok

    @property
    def share(self) -> float | None:
        """The measured request's spliced tokens over its prompt tokens."""
        p = self.spliced.prompt_tokens
        return self.spliced.spliced_tokens / p if self.spliced.ok and p else None

    @property
    def choice_identical(self) -> bool | None:
        if not self.measured or self.kind != "tools":
            return None
        return self.spliced.tool == self.exact.tool

    @property
    def first_token_identical(self) -> bool | None:
        if not self.measured:
            return None
        if self.spliced.tokens and self.exact.tokens:
            return self.spliced.tokens[0] == self.exact.tokens[0]
        return None

    @property
    def answer_identical(self) -> bool | None:
        """The whole greedy answer: its token strings when both carry log-probs, else its
        text (a tool call's name and arguments when the server parsed one)."""
        if not self.measured:
            return None
        if self.spliced.tokens and self.exact.tokens:
            return self.spliced.tokens == self.exact.tokens
        return self.spliced.text == self.exact.text

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(spliced=self.spliced.to_dict(), exact=self.exact.to_dict(),
                   learn=dict(self.learn),
                   breakdown=None if self.breakdown is None else self.breakdown.to_dict(),
                   variants=[v.to_dict() for v in self.variants])
        out.update(share=self.share, choice_identical=self.choice_identical,
                   first_token_identical=self.first_token_identical,
                   answer_identical=self.answer_identical)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaseRecord:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["spliced"] = Answer.from_dict(d["spliced"])
        kw["exact"] = Answer.from_dict(d["exact"])
        kw["learn"] = dict(d.get("learn") or {})
        b = d.get("breakdown")
        kw["breakdown"] = None if b is None else ShareBreakdown.from_dict(b)
        kw["variants"] = [Variant.from_dict(v) for v in d.get("variants") or []]
        return cls(**kw)


def _settled(counters: Mapping[str, int] | None) -> tuple[int, int]:
    c = counters or {}
    return int(c.get("compiles", 0)), int(c.get("failures", 0))


async def wait_learned(sender: LearningSender, before: Mapping[str, int] | None, expected: int,
                       config: ProtocolConfig) -> tuple[bool, float, int, dict[str, int]]:
    """``(learned, seconds waited, polls, counts)``: poll the front's learner until it has
    compiled ``expected`` chunks since ``before`` (its counters before the sightings), a
    compile failed, or the timeout passes. A front without a learner learns nothing."""
    t0 = time.monotonic()
    polls = 0
    c0, f0 = _settled(before)
    counts = {"expected": expected, "compiles": 0, "failures": 0}
    if before is None:
        return False, 0.0, polls, counts
    while True:
        now = await sender.learner()
        polls += 1
        c, f = _settled(now)
        counts.update(compiles=c - c0, failures=f - f0)
        if now is not None and (c - c0 >= expected or f > f0):
            return f == f0, time.monotonic() - t0, polls, counts
        if time.monotonic() - t0 >= config.learn_timeout_s:
            return False, time.monotonic() - t0, polls, counts
        await asyncio.sleep(config.poll_s)


async def run_case(sender: LearningSender, request: AgentRequest, config: ProtocolConfig,
                   learnable: Learnable | None = None,
                   known: set[tuple[int, ...]] | None = None) -> CaseRecord:
    """One case through the protocol (see the module docstring). ``known``: the chunks learned
    (or tried) by earlier cases on the same front, updated here; ``learnable`` None counts
    every chunk of the request (by its content) as learnable."""
    known = set() if known is None else known
    chunks: set[tuple[int, ...]]
    if learnable is None:  # every chunk counts, known by its content
        chunks = {(zlib.crc32(json.dumps(c, sort_keys=True).encode()),) for c in request.chunks}
    else:
        chunks = {c for c in learnable(request) if len(c) >= config.min_tokens}
    new = chunks - known
    before = await sender.learner()
    for _ in range(config.sightings):
        await sender.send(request, splice=True, max_tokens=1)
    learned, waited, polls, counts = await wait_learned(sender, before, len(new), config)
    known |= new
    measured = request.reordered(config.seed)
    spliced = await sender.send(measured, splice=True, max_tokens=config.max_tokens)
    variants = [Variant(k, await sender.send(measured, splice=True,
                                             max_tokens=config.max_tokens, repair=k))
                for k in config.repairs]
    exact = await sender.send(measured, splice=False, max_tokens=config.max_tokens)
    return CaseRecord(id=request.id, kind=request.kind, chunks=len(request.chunks),
                      order=list(measured.meta.get("order", [])), learned=learned,
                      learn_wait_s=round(waited, 3), polls=polls, spliced=spliced, exact=exact,
                      answers=list(request.answers), learn=counts, variants=variants)


async def run_cases(sender: LearningSender, requests: Sequence[AgentRequest],
                    config: ProtocolConfig, *, learnable: Learnable | None = None,
                    log: Callable[[str], None] = lambda s: None) -> list[CaseRecord]:
    """Every request through :func:`run_case`, one at a time (a case's learning is not
    disturbed by another's)."""
    out = []
    known: set[tuple[int, ...]] = set()
    for i, request in enumerate(requests):
        rec = await run_case(sender, request, config, learnable, known)
        out.append(rec)
        share = rec.share
        log(f"  {i + 1}/{len(requests)} {rec.id}: learned {rec.learned} "
            f"({rec.learn_wait_s:.1f} s), share {'-' if share is None else f'{share:.0%}'}, "
            f"choice {rec.spliced.tool} / {rec.exact.tool}, same answer {rec.answer_identical}"
            + "".join(f"; repair {v.repair}: share "
                      f"{v.answer.spliced_tokens / (v.answer.prompt_tokens or 1):.0%}"
                      for v in rec.variants)
            + ("" if rec.measured else f", failed: {rec.spliced.error or rec.exact.error}"))
    return out


@dataclass(frozen=True)
class FidelitySummary:
    """One set's figures over its cases (rates over the measured cases)."""

    kind: str
    cases: int
    measured: int
    learned: int
    share_mean: float | None  # mean over cases of spliced / prompt tokens
    share_pooled: float | None  # all spliced tokens over all prompt tokens
    share_at_goal: float | None  # cases with share >= SHARE_GOAL
    choice_identical: float | None  # tools set only
    first_token_identical: float | None
    answer_identical: float | None
    choice_correct_spliced: float | None  # the ground truth's tool (tools set)
    choice_correct_exact: float | None
    share_goal_met: bool | None
    choice_goal_met: bool | None
    repair: str = "front"  # "front": the front's own repair; else the kvnotes.repair count
    breakdown: PooledBreakdown | None = None  # where the prompt tokens went (pooled)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["breakdown"] = None if self.breakdown is None else self.breakdown.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FidelitySummary:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if isinstance(kw.get("breakdown"), dict):
            kw["breakdown"] = PooledBreakdown.from_dict(kw["breakdown"])
        return cls(**kw)


def _rate(values: Sequence[bool | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summarize(kind: str, records: Sequence[CaseRecord], repair: int | None = None
              ) -> FidelitySummary:
    """The figures of one set's records (see :class:`FidelitySummary`); with ``repair``, of
    their ``kvnotes.repair: repair`` variants (the records without one are left out)."""
    if repair is not None:
        records = [v for v in (r.variant(repair) for r in records) if v is not None]
    done = [r for r in records if r.measured]
    shares = [s for s in (r.share for r in done) if s is not None]
    prompt = sum(r.spliced.prompt_tokens or 0 for r in done if r.share is not None)
    spliced = sum(r.spliced.spliced_tokens for r in done if r.share is not None)
    tools = kind == "tools"
    choice = _rate([r.choice_identical for r in done]) if tools else None
    share_mean = sum(shares) / len(shares) if shares else None
    return FidelitySummary(
        kind=kind, cases=len(records), measured=len(done),
        learned=sum(r.learned for r in records), share_mean=share_mean,
        share_pooled=spliced / prompt if prompt else None,
        share_at_goal=_rate([s >= SHARE_GOAL for s in shares]),
        choice_identical=choice,
        first_token_identical=_rate([r.first_token_identical for r in done]),
        answer_identical=_rate([r.answer_identical for r in done]),
        choice_correct_spliced=(_rate([r.spliced.tool in r.answers for r in done if r.answers])
                                if tools else None),
        choice_correct_exact=(_rate([r.exact.tool in r.answers for r in done if r.answers])
                              if tools else None),
        share_goal_met=None if share_mean is None else share_mean >= SHARE_GOAL,
        choice_goal_met=None if choice is None else choice >= CHOICE_GOAL,
        repair="front" if repair is None else str(repair),
        breakdown=pool([r.breakdown for r in done if r.breakdown is not None]))
