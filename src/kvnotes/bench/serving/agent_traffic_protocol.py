"""The fidelity protocol of ``serve-bench agent``: learn a case's chunks, then measure.

Per request (a BFCL case with its tools, or documents as content parts):

1. it is sent ``sightings`` times (the learning threshold: a chunk seen that many times is
   compiled in the background);
2. the benchmark waits until the learned chunks are published: the same request (one token)
   is sent again until its ``usage.kvnotes.spliced_tokens`` is positive and the same on two
   polls in a row, or ``learn_timeout_s`` passes (the case is then measured anyway and
   recorded as not learned);
3. the same request with its chunks in another order (a fixed seeded permutation) is sent
   twice, greedy, ``max_tokens`` tokens: as is (spliced where the front can) and with
   ``splice: false`` (exact). The record compares them: the share of the prompt spliced, the
   tool choice (tools set), the first answer token and the whole answer.

:func:`summarize` gives the figures the issue's goals read (share of prompt tokens spliced >=
50%, tool choice identical >= 95%). Everything talks to a :class:`~.agent_traffic_client.Sender`:
tested with a fake one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvnotes.bench.serving.agent_traffic_client import Answer, Sender
from kvnotes.bench.serving.agent_traffic_requests import AgentRequest

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


@dataclass
class CaseRecord:
    """One case: what learning did, and the reordered request spliced against exact."""

    id: str
    kind: str
    chunks: int
    order: list[int]
    learned: bool  # spliced tokens seen (and stable) before the timeout
    learn_wait_s: float
    polls: int
    spliced: Answer
    exact: Answer
    answers: list[str]  # the ground truth's tool names (tools set)

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
        out = asdict(self)
        out.update(share=self.share, choice_identical=self.choice_identical,
                   first_token_identical=self.first_token_identical,
                   answer_identical=self.answer_identical)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaseRecord:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["spliced"] = Answer.from_dict(d["spliced"])
        kw["exact"] = Answer.from_dict(d["exact"])
        return cls(**kw)


async def wait_learned(sender: Sender, request: AgentRequest, config: ProtocolConfig
                       ) -> tuple[bool, float, int]:
    """``(learned, seconds waited, polls)``: poll ``request`` (one token) until its spliced
    tokens are positive and unchanged over two polls, or the timeout."""
    t0 = time.monotonic()
    last = -1
    polls = 0
    while True:
        answer = await sender.send(request, splice=True, max_tokens=1)
        polls += 1
        now = answer.spliced_tokens if answer.ok else 0
        if now > 0 and now == last:
            return True, time.monotonic() - t0, polls
        last = now
        if time.monotonic() - t0 >= config.learn_timeout_s:
            return False, time.monotonic() - t0, polls
        await asyncio.sleep(config.poll_s)


async def run_case(sender: Sender, request: AgentRequest, config: ProtocolConfig) -> CaseRecord:
    """One case through the protocol (see the module docstring)."""
    for _ in range(config.sightings):
        await sender.send(request, splice=True, max_tokens=1)
    learned, waited, polls = await wait_learned(sender, request, config)
    measured = request.reordered(config.seed)
    spliced = await sender.send(measured, splice=True, max_tokens=config.max_tokens)
    exact = await sender.send(measured, splice=False, max_tokens=config.max_tokens)
    return CaseRecord(id=request.id, kind=request.kind, chunks=len(request.chunks),
                      order=list(measured.meta.get("order", [])), learned=learned,
                      learn_wait_s=round(waited, 3), polls=polls, spliced=spliced, exact=exact,
                      answers=list(request.answers))


async def run_cases(sender: Sender, requests: Sequence[AgentRequest], config: ProtocolConfig,
                    *, log: Callable[[str], None] = lambda s: None) -> list[CaseRecord]:
    """Every request through :func:`run_case`, one at a time (a case's learning is not
    disturbed by another's)."""
    out = []
    for i, request in enumerate(requests):
        rec = await run_case(sender, request, config)
        out.append(rec)
        share = rec.share
        log(f"  {i + 1}/{len(requests)} {rec.id}: learned {rec.learned} "
            f"({rec.learn_wait_s:.1f} s), share {'-' if share is None else f'{share:.0%}'}, "
            f"choice {rec.spliced.tool} / {rec.exact.tool}, same answer {rec.answer_identical}"
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FidelitySummary:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def _rate(values: Sequence[bool | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summarize(kind: str, records: Sequence[CaseRecord]) -> FidelitySummary:
    """The figures of one set's records (see :class:`FidelitySummary`)."""
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
        choice_goal_met=None if choice is None else choice >= CHOICE_GOAL)
