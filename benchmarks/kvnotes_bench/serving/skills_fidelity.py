"""The skills workload's fidelity: each spliced policy's answers against the same prompts sent
exactly (first token, greedy continuation, top-20 log-prob sets, the decision where the prompt
set reads one), and the guard's tau calibrated on development prompts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from kvnotes.serving.compose_client import ComposeClient, ComposeResult
from kvnotes_bench.serving.prompt_sets import PromptSet, same_decision
from kvnotes_bench.serving.skills_clients import Clients, PolicyClients
from kvnotes_bench.serving.skills_config import DEFAULT_TAU, GUARDED_POLICIES, SkillsBenchConfig


@dataclass
class HalfCounts:
    """One half's counts of a fidelity pass (cases, and how many agreed by each measure)."""

    n: int = 0
    decision_identical: int = 0
    first_token_agree: int = 0
    continuation_identical: int = 0
    guard_fired: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> HalfCounts:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass
class Fidelity:
    """One spliced policy's answers against the same prompts sent exactly (no splice salt).

    Where the prompt set reads a decision (BFCL: the function name written): how often it is
    the exact prompt's (``decision_identity``), and how often each picks a tool BFCL's ground
    truth accepts (``right_exact`` / ``right_spliced``, counts); ``halves`` splits the counts by
    the case's half (the guard's tau is chosen on the calibration half)."""

    samples: int
    failed: int
    first_token_agreement: float | None
    continuation_identity: float | None
    continuation_tokens: int
    top20_overlap_mean: float | None
    cases: list[dict[str, Any]]
    policy: str = "compose"
    guard_fires: int | None = None  # guarded policies: answers that came from the exact request
    decision_identity: float | None = None
    right_exact: int | None = None
    right_spliced: int | None = None
    forwarded: int = 0  # sent through the front, but forwarded exactly (nothing planned)
    halves: dict[str, HalfCounts] = field(default_factory=dict)
    concurrency: int = 1  # the policy's requests in flight at once
    # the plans' skill tokens recomputed in context, over all prompt tokens and over the
    # tokens of the pieces they placed (spliced + recomputed); None: no plan reported them
    repaired_share: float | None = None
    repaired_of_pieces: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fidelity:
        """Read back :meth:`to_dict` (a field an older run lacks takes its default)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"halves", "cases"}
        return cls(**{k: v for k, v in d.items() if k in known},
                   cases=[dict(c) for c in d.get("cases", [])],
                   halves={h: HalfCounts.from_dict(c) for h, c in (d.get("halves") or {}).items()})


def measure_fidelity(clients: PolicyClients | ComposeClient, prompts: Sequence[list[str]],
                     tokens: int, policies: Sequence[str] = ("compose",), *,
                     prompt_set: PromptSet | None = None,
                     concurrency: int | Sequence[int] = 1) -> list[Fidelity]:
    """Each prompt sent exactly, then under each of ``policies``: first token, ``tokens``
    greedy tokens and the first token's top-20 logprob set compared with the exact answer, and
    the decision ``prompt_set`` reads from each answer. ``concurrency`` requests of a policy are
    in flight at once (the server batches them), one pass per level given; the exact
    references are sent once, one by one."""
    senders: PolicyClients = Clients(clients) if isinstance(clients, ComposeClient) else clients
    plain = senders.plain
    exact = [plain.complete(parts, max_tokens=tokens, splice=False, logprobs=20)
             for parts in prompts]
    reads = prompt_set is not None and prompt_set.decides
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    out = []
    for level in (max(1, c) for c in levels):
        with ThreadPoolExecutor(max_workers=level) as pool:
            for policy in policies:
                sent = list(pool.map(lambda parts, p=policy: senders.send(p, parts, tokens,
                                                                          logprobs=20), prompts))
                cases = [_fidelity_case(got, ref, prompt_set.info(parts) if prompt_set else {},
                                        prompt_set if reads else None)
                         for parts, got, ref in zip(prompts, sent, exact, strict=True)]
                out.append(_fidelity(policy, cases, tokens, decisions=reads, concurrency=level))
    return out


def _fidelity_case(got: ComposeResult, ref: ComposeResult, info: dict[str, Any],
                   prompt_set: PromptSet | None) -> dict[str, Any]:
    if not (got.ok and ref.ok):
        return {**info, "error": got.error or ref.error}
    plan = got.plan.to_dict() if got.plan is not None else {}
    case: dict[str, Any] = {
        **info,
        "first_token_agree": bool(got.tokens and ref.tokens and got.tokens[0] == ref.tokens[0]),
        "continuation_identical": got.text == ref.text, "spliced": got.text, "exact": ref.text,
        "spliced_cached": got.cached_tokens, "prompt_tokens": got.prompt_tokens,
        "exact_prompt_tokens": ref.prompt_tokens, "margin": got.margin,
        "guard_fired": got.guard_fired, "phases": got.phases,
        "spliced_tokens": got.spliced_tokens,
        "skills_found": plan.get("skills") if got.usage_kvnotes is not None else None,
        # not spliced: forwarded, or sent exactly as its part-wise ids
        "forwarded": got.plan is None,
        # what the plan recomputed, and which entry each piece was spliced from
        "repaired_tokens": plan.get("repaired_tokens"),
        "entries": plan.get("entries")}
    if got.top_logprobs and ref.top_logprobs:
        a, b = set(got.top_logprobs[0]), set(ref.top_logprobs[0])
        case["top20_overlap"] = len(a & b) / max(1, len(b))
    if prompt_set is not None:
        mine, theirs = prompt_set.decision(got.text), prompt_set.decision(ref.text)
        case["decision"], case["exact_decision"] = mine, theirs
        case["decision_identical"] = same_decision(prompt_set, got.text, ref.text)
        if "answers" in info:
            case["right"], case["exact_right"] = mine in info["answers"], theirs in info["answers"]
    return case


def _fidelity(policy: str, cases: list[dict[str, Any]], tokens: int, *, decisions: bool,
              concurrency: int = 1) -> Fidelity:
    ok = [c for c in cases if "error" not in c]
    n = len(ok)

    def share(key: str) -> float | None:
        return sum(bool(c.get(key)) for c in ok) / n if n else None

    planned = [c for c in ok if c.get("repaired_tokens") is not None]
    repaired = sum(int(c["repaired_tokens"]) for c in planned)
    prompt = sum(int(c.get("prompt_tokens") or 0) for c in planned)
    pieces = repaired + sum(int(c.get("spliced_tokens") or 0) for c in planned)

    overlaps = [c["top20_overlap"] for c in ok if "top20_overlap" in c]
    halves: dict[str, HalfCounts] = {}
    for c in ok:
        if "half" in c:
            h = halves.setdefault(c["half"], HalfCounts())
            h.n += 1
            h.decision_identical += bool(c.get("decision_identical"))
            h.first_token_agree += bool(c.get("first_token_agree"))
            h.continuation_identical += bool(c.get("continuation_identical"))
            h.guard_fired += bool(c.get("guard_fired"))
    answered = [c for c in ok if "right" in c]
    return Fidelity(
        samples=n, failed=len(cases) - n,
        first_token_agreement=share("first_token_agree"),
        continuation_identity=share("continuation_identical"), continuation_tokens=tokens,
        top20_overlap_mean=sum(overlaps) / len(overlaps) if overlaps else None,
        cases=cases, policy=policy,
        guard_fires=(sum(bool(c.get("guard_fired")) for c in ok) if policy in GUARDED_POLICIES
                     else None),
        decision_identity=share("decision_identical") if decisions else None,
        right_exact=sum(c["exact_right"] for c in answered) if answered else None,
        right_spliced=sum(c["right"] for c in answered) if answered else None,
        forwarded=sum(bool(c.get("forwarded")) for c in ok), halves=halves,
        concurrency=concurrency,
        repaired_share=repaired / prompt if planned and prompt else None,
        repaired_of_pieces=repaired / pieces if planned and pieces else None)


@dataclass
class Calibration:
    """How the guard's tau was chosen: the repaired first token's top-2 margin on development
    prompts (not measured ones) and whether that token equals the exact prompt's."""

    tau: float
    rule: str
    cases: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        return cls(tau=d["tau"], rule=d["rule"], cases=[dict(c) for c in d.get("cases", [])])


def calibrate_tau(clients: PolicyClients, prompts: Sequence[list[str]]) -> Calibration:
    """tau just above the largest margin at which a repaired first token still differed from the
    exact prompt's (every such development prompt would have been answered exactly); with no
    such prompt, :data:`DEFAULT_TAU`."""
    cases: list[dict[str, Any]] = []
    for parts in prompts:
        got = clients.send("repaired", parts, 1, logprobs=2)
        ref = clients.plain.complete(parts, max_tokens=1, splice=False)
        if got.ok and ref.ok and got.margin is not None:
            cases.append({"margin": got.margin, "agree": got.text == ref.text})
    wrong = [c["margin"] for c in cases if not c["agree"]]
    if wrong:
        return Calibration(tau=round(max(wrong) * 1.05 + 1e-3, 4),
                           rule="largest margin of a differing first token, +5%", cases=cases)
    return Calibration(tau=DEFAULT_TAU, rule="no differing first token: the default",
                       cases=cases)


def fidelity_prompts(prompt_set: PromptSet, config: SkillsBenchConfig) -> list[list[str]]:
    """The prompts a run's fidelity pass sends (the same every time for one config)."""
    return prompt_set.requests(config.fidelity_samples, config.seed + 7777, "fidelity")
