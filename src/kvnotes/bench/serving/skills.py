"""``kvnotes serve-bench skills``: composition inside vLLM against prefix caching and cold.

Each request is a header, registered skills and computed text (:mod:`.prompt_sets`: the airline
library, ``k`` skills in random order and a customer's question; or BFCL's ``live_multiple``
or ``multi_turn`` development cases, each function description or API manual a skill, the
decision the function name the answer writes). Policies:

- ``cold``: a fresh ``cache_salt`` per request, so nothing is reused (full prefill);
- ``prefix``: no salt, plain prefix caching: reuse only when an earlier request shared the
  exact same leading pieces in the same order;
- ``compose``: the splice salt, so the connector supplies the leading run of known pieces and
  prefix caching reuses repeats of the same spliced order (the bare splice);
- ``repaired``: a phased prefill (:mod:`kvnotes.serving.planning.phases`): the first ``repair`` tokens
  of every skill not exactly placed are computed in context by vLLM, each region ending on a
  block boundary, the rest spliced (``Repair(first=repair)`` aligned to the server's block
  size; 32, the default, is the rule ``Engine.compose`` follows by default);
- ``guarded``: ``repaired``, and when the first answer token's top-1 minus top-2 log-prob is
  below ``tau`` the answer comes from an exact request instead.

``via="vllm"`` sends each policy's requests to vLLM as token ids, planned by
:class:`~kvnotes.serving.compose_client.ComposeClient`; ``via="front"`` sends the prompt's text
to kvnotes' OpenAI front (:class:`FrontClients`), which finds the skills and plans the same
phases and guard itself: what an ordinary OpenAI client gets.

Phases run on the shared kit (:mod:`kvnotes.bench.serving.kit`). The reported hit rate counts
what the server did not compute: ``cached_tokens / prompt_tokens`` summed over a phase (vLLM's
``cached_tokens`` includes connector-supplied tokens; the kit's ``hit_rate`` from /metrics
counts only its own prefix cache); for the phased policies it is the real request's (its
phases' blocks are hits). TTFT of a phased request counts from its first phase. Fidelity: for a
sample of prompts, each spliced policy's answer against the same token ids sent to vLLM without
a salt (exact prefill or exact prefix hits): the first token, 16 greedy tokens, the top-20
logprob sets and, where the prompt set reads one, the decision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvnotes.bench.serving import kit
from kvnotes.bench.serving.kit import (
    MachineRecord,
    P90Ratio,
    PhaseSummary,
    ServerRecord,
    failure_lines,
    fmt_pct,
    fmt_s,
    load_now,
    p90_ratios,
    phase_line,
    summarize,
)
from kvnotes.bench.serving.prompt_sets import (
    PROMPT_SETS,
    AirlinePrompts,
    PromptSet,
    same_decision,
)
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.repair import Repair
from kvnotes.eval.reports import write_bundle
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, cold_salt
from kvnotes.serving.planning.phases import check_tau, margin
from kvnotes.serving.upstream import Client

if TYPE_CHECKING:
    from kvnotes.bench.serving.engine_check import EngineCheck
    from kvnotes.serving.launch.launcher import LaunchRecord

SKILL_POLICIES = ("cold", "prefix", "compose", "repaired", "guarded")
SPLICED_POLICIES = ("compose", "repaired", "guarded")  # the ones fidelity is measured for
PHASED_POLICIES = ("repaired", "guarded")
VIAS = ("vllm", "front")
# the phased policies' repair: each skill's first 32 tokens (the engine's default), aligned to
# the server's block size when planned
DEFAULT_REPAIR_TOKENS = 32
# the guard's tau when calibration finds no first token that differs from the exact prompt's
DEFAULT_TAU = 0.5


@dataclass(frozen=True)
class SkillsBenchConfig:
    """What one skills run measures: ``requests`` prompts per (concurrency, policy) row, then
    ``fidelity_samples`` prompts per spliced policy against exact ones. ``prompts`` names the
    prompt set (``k`` skills per airline prompt; ``cases`` BFCL cases within ``max_context``
    tokens), ``via`` where the requests go (vLLM itself, or kvnotes' OpenAI front), ``repair``
    the phased policies' tokens computed in context at the start of each spliced skill."""

    model: str = "smollm2-135m"
    k: int = 4
    requests: int = 16
    concurrency: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = SKILL_POLICIES
    max_tokens: int = 1  # TTFT phases: the first token is what is measured
    fidelity_samples: int = 20
    fidelity_tokens: int = 16
    seed: int = 0
    warmup: int = 2
    guard_tau: float | None = None  # None: calibrated on ``calibration_samples`` prompts
    calibration_samples: int = 6
    prompts: str = "airline"
    cases: int = 40
    max_context: int = 2048
    via: str = "vllm"
    fidelity_concurrency: tuple[int, ...] = (1,)
    repair: int = DEFAULT_REPAIR_TOKENS
    engine_check: bool = False  # compose the fidelity prompts in kvnotes' engine too

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in SKILL_POLICIES]
        if unknown:
            raise UnknownNameError("policy", unknown[0], SKILL_POLICIES)
        if self.prompts not in PROMPT_SETS:
            raise UnknownNameError("prompt set", self.prompts, PROMPT_SETS)
        if self.via not in VIAS:
            raise UnknownNameError("--via", self.via, VIAS)
        if self.prompts == "airline":
            AirlinePrompts(self.k)  # checks k against the library
        if self.requests < 1:
            raise InvalidArgumentError(f"--requests must be at least 1, got {self.requests}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidArgumentError("concurrency levels must be at least 1")
        if self.fidelity_samples < 0:
            raise InvalidArgumentError(f"--fidelity-samples must be 0 or more, got "
                                       f"{self.fidelity_samples}")
        if self.guard_tau is not None:
            check_tau(self.guard_tau)
        if self.calibration_samples < 1 and self.guard_tau is None and "guarded" in \
                self.policies:
            raise InvalidArgumentError("the guarded policy needs --guard-tau or at least one "
                                       "calibration sample")
        if not self.fidelity_concurrency or min(self.fidelity_concurrency) < 1:
            raise InvalidArgumentError("--fidelity-concurrency levels must be at least 1")
        if isinstance(self.repair, bool) or not isinstance(self.repair, int) or self.repair < 1:
            raise InvalidArgumentError(f"--repair must be a positive number of tokens, got "
                                       f"{self.repair!r}")
        if self.cases < 1 or self.max_context < 1:
            raise InvalidArgumentError("--cases and --max-context must be at least 1")


@dataclass
class Record:
    """One measured request."""

    policy: str
    concurrency: int
    ok: bool
    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None
    error_kind: str | None = None  # "request" for every failure (the client does not classify)
    skipped: bool = False
    phases: int = 0  # phased policies: phase requests sent before the real one
    guard_fired: bool | None = None  # guarded: the answer came from an exact request
    spliced_tokens: int | None = None  # phased policies: what the plan splices


class PolicyClients(Protocol):
    """What the benchmark sends through: ``send`` answers one prompt under a policy, ``plain``
    (vLLM itself) sends the exact references and the warm-up, ``tau`` is the guard's."""

    plain: ComposeClient
    tau: float | None

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult: ...


@dataclass(frozen=True)
class Clients:
    """The benchmark's clients straight to vLLM: ``plain`` for cold/prefix/compose and the exact
    references, ``repaired`` and ``guarded`` for the phased policies (each its own tenant, so
    one phased policy's blocks never serve the other), and the guard's ``tau``."""

    plain: ComposeClient
    repaired: ComposeClient | None = None
    guarded: ComposeClient | None = None
    tau: float | None = None
    repair: Repair = Repair(first=DEFAULT_REPAIR_TOKENS)

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult:
        if policy == "cold":
            return self.plain.complete(parts, max_tokens=max_tokens, salt=cold_salt(),
                                       logprobs=logprobs)
        if policy in ("prefix", "compose"):
            return self.plain.complete(parts, max_tokens=max_tokens, splice=policy == "compose",
                                       logprobs=logprobs)
        client = self.repaired if policy == "repaired" else self.guarded
        if client is None:
            raise InvalidArgumentError(f"policy {policy!r} needs a phased client")
        return client.complete(parts, max_tokens=max_tokens, logprobs=logprobs,
                               repair=self.repair, guard=self.tau if policy == "guarded" else None)


@dataclass(frozen=True)
class FrontClients:
    """The policies sent as text to kvnotes' OpenAI front (``front``: a client of its URL),
    each spliced policy in its own tenant; the front finds the skills, plans the phases and
    runs the guard. ``plain`` talks to vLLM itself (the exact references)."""

    plain: ComposeClient
    front: ComposeClient
    tau: float | None = None
    repair: Repair = Repair(first=DEFAULT_REPAIR_TOKENS)

    def options(self, policy: str) -> dict[str, Any]:
        """The request's ``kvnotes`` options under ``policy`` (cold also sends its own salt,
        which the front forwards as it came)."""
        if policy in ("cold", "prefix"):
            return {"splice": False}
        if policy == "compose":
            return {"tenant": "compose", "repair": 0, "guard": 0}
        return {"tenant": policy, "repair": self.repair.first,
                "guard": (self.tau or 0.0) if policy == "guarded" else 0}

    def send(self, policy: str, parts: list[str], max_tokens: int, *,
             logprobs: int | None = None) -> ComposeResult:
        if policy not in SKILL_POLICIES:
            raise UnknownNameError("policy", policy, SKILL_POLICIES)
        body: dict[str, Any] = {"model": self.front.model, "prompt": "".join(parts),
                                "max_tokens": int(max_tokens), "temperature": 0.0,
                                "kvnotes": self.options(policy)}
        if logprobs is not None:
            body["logprobs"] = int(logprobs)
        if policy == "cold":
            body["cache_salt"] = cold_salt()
        res = self.front.send(body)
        info = res.usage_kvnotes
        if info is not None:  # planned and spliced by the front (else forwarded exactly)
            res.phases = int(info.get("phases") or 0)
            res.spliced_tokens = info.get("spliced_tokens")
            res.guard_fired = bool(info.get("guard_fired")) if policy == "guarded" else None
            res.plan = info.get("plan")
        res.margin = margin(res.top_logprobs[0]) if res.top_logprobs else None
        return res


def run_phase(clients: PolicyClients, policy: str, concurrency: int, prompts: Sequence[list[str]],
              max_tokens: int, *, metrics: Client | None = None,
              log: Callable[[str], None] = lambda s: None) -> tuple[PhaseSummary, list[Record]]:
    """Every prompt once under ``policy``, ``concurrency`` in flight (the blocking client runs in
    a thread per worker)."""
    threads = ThreadPoolExecutor(max_workers=concurrency)

    async def send(parts: list[str]) -> list[Record]:
        r = await asyncio.get_running_loop().run_in_executor(
            threads, lambda: clients.send(policy, parts, max_tokens))
        return [Record(policy, concurrency, r.ok, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                       r.error, None if r.ok else "request", phases=r.phases,
                       guard_fired=r.guard_fired, spliced_tokens=r.spliced_tokens)]

    async def shutdown() -> None:
        threads.shutdown(wait=False)

    run = kit.run_phase(prompts, concurrency, send, cleanup=shutdown,
                        metrics_text=metrics.metrics_text if metrics is not None else None)
    for line in failure_lines(run):
        log(line)
    return (summarize(run.records, policy=policy, concurrency=concurrency, wall_s=run.wall_s,
                      run=run), run.records)


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
    guard_fires: int | None = None  # guarded: answers that came from the exact request
    decision_identity: float | None = None
    right_exact: int | None = None
    right_spliced: int | None = None
    forwarded: int = 0  # sent through the front, but forwarded exactly (nothing planned)
    halves: dict[str, dict[str, int]] = field(default_factory=dict)
    concurrency: int = 1  # the policy's requests in flight at once

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_fidelity(clients: PolicyClients | ComposeClient, prompts: Sequence[list[str]],
                     tokens: int, policies: Sequence[str] = ("compose",), *,
                     prompt_set: PromptSet | None = None,
                     concurrency: int | Sequence[int] = 1) -> list[Fidelity]:
    """Each prompt sent exactly, then under each of ``policies``: first token, ``tokens``
    greedy tokens and the first token's top-20 logprob set compared with the exact answer, and
    the decision ``prompt_set`` reads from each answer. ``concurrency`` requests of a policy are
    in flight at once (the server batches them), one pass per level given; the exact
    references are sent once, one by one."""
    if isinstance(clients, ComposeClient):
        clients = Clients(clients)
    plain = clients.plain
    exact = [plain.complete(parts, max_tokens=tokens, splice=False, logprobs=20)
             for parts in prompts]
    reads = prompt_set is not None and prompt_set.decides
    levels = [concurrency] if isinstance(concurrency, int) else list(concurrency)
    out = []
    for level in (max(1, c) for c in levels):
        with ThreadPoolExecutor(max_workers=level) as pool:
            for policy in policies:
                sent = list(pool.map(lambda parts, p=policy: clients.send(p, parts, tokens,
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
    case: dict[str, Any] = {
        **info,
        "first_token_agree": bool(got.tokens and ref.tokens and got.tokens[0] == ref.tokens[0]),
        "continuation_identical": got.text == ref.text, "spliced": got.text, "exact": ref.text,
        "spliced_cached": got.cached_tokens, "prompt_tokens": got.prompt_tokens,
        "exact_prompt_tokens": ref.prompt_tokens, "margin": got.margin,
        "guard_fired": got.guard_fired, "phases": got.phases,
        "spliced_tokens": got.spliced_tokens,
        "skills_found": (got.plan or {}).get("skills") if got.usage_kvnotes is not None
        else None,
        "forwarded": got.usage_kvnotes is None and got.plan is None}
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

    overlaps = [c["top20_overlap"] for c in ok if "top20_overlap" in c]
    halves: dict[str, dict[str, int]] = {}
    for c in ok:
        if "half" in c:
            h = halves.setdefault(c["half"], {"n": 0, "decision_identical": 0,
                                              "first_token_agree": 0,
                                              "continuation_identical": 0, "guard_fired": 0})
            h["n"] += 1
            for key in ("decision_identical", "first_token_agree", "continuation_identical",
                        "guard_fired"):
                h[key] += bool(c.get(key))
    answered = [c for c in ok if "right" in c]
    return Fidelity(
        samples=n, failed=len(cases) - n,
        first_token_agreement=share("first_token_agree"),
        continuation_identity=share("continuation_identical"), continuation_tokens=tokens,
        top20_overlap_mean=sum(overlaps) / len(overlaps) if overlaps else None,
        cases=cases, policy=policy,
        guard_fires=sum(bool(c.get("guard_fired")) for c in ok) if policy == "guarded" else None,
        decision_identity=share("decision_identical") if decisions else None,
        right_exact=sum(c["exact_right"] for c in answered) if answered else None,
        right_spliced=sum(c["right"] for c in answered) if answered else None,
        forwarded=sum(bool(c.get("forwarded")) for c in ok), halves=halves,
        concurrency=concurrency)


@dataclass
class Calibration:
    """How the guard's tau was chosen: the repaired first token's top-2 margin on development
    prompts (not measured ones) and whether that token equals the exact prompt's."""

    tau: float
    rule: str
    cases: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


@dataclass
class SkillsResult:
    """Everything one skills run measured; :meth:`to_dict` is the ``results.json`` schema."""

    config: SkillsBenchConfig
    machine: MachineRecord
    server: ServerRecord | None
    phases: list[PhaseSummary]
    fidelity: list[Fidelity]
    requests: list[Record]
    anchor: str = "header"  # what the skills were compiled behind: "header" or "none"
    launch: LaunchRecord | None = None
    calibration: Calibration | None = None
    guard_tau: float | None = None
    prompt_set: str = ""  # what a request is (the prompt set's description)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # cases over the context limit
    engine_check: list[EngineCheck] = field(default_factory=list)
    started: str = ""  # UTC, when the first request was sent ("%Y-%m-%d %H:%M")
    finished: str = ""
    command: str = ""  # the command line that ran it, when known

    def phased_rows(self) -> list[dict[str, Any]]:
        """Per phased (policy, concurrency) row: phases per request, guard fires, and the
        tokens the plan splices per request."""
        rows = []
        for s in self.phases:
            if s.policy not in PHASED_POLICIES:
                continue
            recs = [r for r in self.requests if r.policy == s.policy
                    and r.concurrency == s.concurrency and r.ok]
            rows.append({"policy": s.policy, "concurrency": s.concurrency,
                         "phases_per_request": (sum(r.phases for r in recs) / len(recs)
                                                if recs else None),
                         "guard_fires": (sum(bool(r.guard_fired) for r in recs)
                                         if s.policy == "guarded" else None),
                         "spliced_tokens_mean": (sum(r.spliced_tokens or 0 for r in recs)
                                                 / len(recs) if recs else None)})
        return rows

    def ratios(self) -> list[P90Ratio]:
        """p90 TTFT of prefix and cold over compose, per concurrency."""
        return p90_ratios(self.phases, reference="compose", others=("prefix", "cold"))

    def to_dict(self) -> dict[str, Any]:
        out = {"workload": "skills", "config": asdict(self.config),
               "started": self.started, "finished": self.finished, "command": self.command,
               "machine": self.machine.to_dict(),
               "server": None if self.server is None else self.server.to_dict(),
               "skills_anchor": self.anchor,
               "prompt_set": self.prompt_set, "skipped": self.skipped,
               "summaries": [s.to_dict() for s in self.phases],
               "ratios": [r.to_dict() for r in self.ratios()],
               "phased": self.phased_rows(),
               "guard_tau": self.guard_tau,
               "calibration": None if self.calibration is None else self.calibration.to_dict(),
               "fidelity": [f.to_dict() for f in self.fidelity],
               "engine_check": [c.to_dict() for c in self.engine_check],
               "requests": [asdict(r) for r in self.requests]}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        return out


def make_clients(client: ComposeClient, policies: Sequence[str], block_size: int | None, *,
                 anchor: bool = True, tau: float | None = None,
                 prompt_set: PromptSet | None = None,
                 repair_tokens: int = DEFAULT_REPAIR_TOKENS) -> Clients:
    """``client`` and, for the phased policies, clients that plan with the server's block size
    (the library's pieces from ``client``'s skills folder when it has one, else the prompt
    set's own index)."""
    if not set(policies) & set(PHASED_POLICIES):
        return Clients(client)
    if block_size is None:
        raise InvalidArgumentError("the repaired and guarded policies need the server's block "
                                   "size: it reports none in /metrics (vllm:cache_config_info)")
    skills = client.store.folder if client.store is not None else (
        prompt_set or AirlinePrompts()).index(client.tokenizer, anchor=anchor)

    def phased(tenant: str) -> ComposeClient:
        return ComposeClient(client.url, client.model, client.tokenizer, timeout=client.timeout,
                             tenant=tenant, skills=skills, block_size=block_size)

    return Clients(client, repaired=phased("repaired"), guarded=phased("guarded"), tau=tau,
                   repair=Repair(first=repair_tokens))


def run_skills_benchmark(client: ComposeClient, config: SkillsBenchConfig, *,
                         anchor: bool = True, prompt_set: PromptSet | None = None,
                         front: ComposeClient | None = None,
                         log: Callable[[str], None] = print) -> SkillsResult:
    """Every policy x concurrency phase, then fidelity, on the server ``client`` talks to
    (vLLM itself); with ``front`` (a client of kvnotes' OpenAI front before that server), the
    measured requests go through the front as text. ``prompt_set`` defaults to the airline
    library with ``config.k`` skills."""
    prompts_of = prompt_set or AirlinePrompts(config.k)
    metrics = Client(client.url)
    server = ServerRecord.read(metrics, client.model, log=log)
    machine = MachineRecord.now()
    started = utc_minute()
    phases: list[PhaseSummary] = []
    records: list[Record] = []
    clients: Clients | FrontClients
    if front is not None:
        clients = FrontClients(client, front, tau=config.guard_tau,
                               repair=Repair(first=config.repair))
    else:
        clients = make_clients(client, config.policies, server.block_size, anchor=anchor,
                               tau=config.guard_tau, prompt_set=prompts_of,
                               repair_tokens=config.repair)
    # warm-up: the first requests after start pay compilation; not measured
    for parts in prompts_of.requests(config.warmup, config.seed + 999, "warmup"):
        client.complete(parts, max_tokens=1, salt=cold_salt())
    calibration = None
    if "guarded" in config.policies and config.guard_tau is None:
        calibration = calibrate_tau(clients, prompts_of.requests(
            config.calibration_samples, config.seed + 5555, "calibration"))
        clients = dataclasses.replace(clients, tau=calibration.tau)
        log(f"guard tau {calibration.tau} ({calibration.rule}; margins "
            + ", ".join(f"{c['margin']:.3f}{'' if c['agree'] else '*'}"
                        for c in calibration.cases) + "; * differs from the exact prompt)")
    for i, conc in enumerate(config.concurrency):
        for j, policy in enumerate(config.policies):
            # each phase gets its own random prompts: prefix caching sees no planted repeats
            prompts = prompts_of.requests(config.requests, config.seed + 100 * i + j, "ttft")
            log(f"{policy}, concurrency {conc}: {len(prompts)} requests (load {load_now()})")
            summary, recs = run_phase(clients, policy, conc, prompts, config.max_tokens,
                                      metrics=metrics, log=log)
            phases.append(summary)
            records += recs
            log(phase_line(summary))
    fidelity: list[Fidelity] = []
    spliced = [p for p in SPLICED_POLICIES if p in config.policies]
    if spliced and config.fidelity_samples:
        prompts = fidelity_prompts(prompts_of, config)
        fidelity = measure_fidelity(clients, prompts, config.fidelity_tokens, spliced,
                                    prompt_set=prompts_of,
                                    concurrency=config.fidelity_concurrency)
        for f in fidelity:
            log(f"fidelity {f.policy} (concurrency {f.concurrency}): first token "
                f"{fmt_pct(f.first_token_agreement)}, "
                f"{config.fidelity_tokens}-token continuation "
                f"{fmt_pct(f.continuation_identity)}, top-20 overlap "
                f"{fmt_pct(f.top20_overlap_mean)} over {f.samples}"
                + (f", decision {fmt_pct(f.decision_identity)}"
                   if f.decision_identity is not None else "")
                + (f", guard fired {f.guard_fires}" if f.guard_fires is not None else ""))
    machine.finish()
    return SkillsResult(config=config, machine=machine, server=server, phases=phases,
                        fidelity=fidelity, requests=records, anchor="header" if anchor else "none",
                        calibration=calibration, guard_tau=clients.tau,
                        prompt_set=prompts_of.describe(),
                        skipped=list(getattr(prompts_of, "skipped", [])),
                        started=started, finished=utc_minute())


def config_prompt_set(config: SkillsBenchConfig, tokenizer: Any) -> PromptSet:
    """The prompt set a run of ``config`` sends (the same every time for one config)."""
    from kvnotes.bench.serving.prompt_sets import make_prompt_set

    return make_prompt_set(config.prompts, tokenizer, k=config.k, cases=config.cases,
                           max_context=config.max_context, answer_tokens=config.fidelity_tokens)


def fidelity_prompts(prompt_set: PromptSet, config: SkillsBenchConfig) -> list[list[str]]:
    """The prompts a run's fidelity pass sends (the same every time for one config)."""
    return prompt_set.requests(config.fidelity_samples, config.seed + 7777, "fidelity")


def utc_minute() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def markdown(result: dict[str, Any]) -> str:
    """The report of a result's JSON form (``SkillsResult.to_dict()`` or a stored file)."""
    cfg = result["config"]
    server = result.get("server") or {}
    launch = result.get("launch") or {}
    machine = result["machine"]
    anchored = result.get("skills_anchor") == "header"
    what = result.get("prompt_set") or (f"header + {cfg['k']} skills (random subset, random "
                                         "order) + ~100 tokens of user text")
    via = ("kvnotes' OpenAI front (text prompts; the front plans the splice, phases and guard)"
           if cfg.get("via") == "front" else "vLLM itself (token ids planned by ComposeClient)")
    lines = [f"# serve-bench skills ({cfg['model']})", ""]
    if result.get("started"):
        lines += [f"Run {result['started']} to {result.get('finished') or '?'} UTC"
                  + (f": `{result['command']}`" if result.get("command") else "") + ".", ""]
    lines += [
             f"{cfg['requests']} requests per row; each: {what}. Requests sent to {via}. TTFT "
             f"from the client (streaming, first token). Server: vLLM "
             f"{server.get('version') or '?'}, {launch.get('dtype', '?')}, block size "
             f"{server.get('block_size') or '?'}; skills compiled "
             f"{'behind the system header' if anchored else 'alone'}. Hit rate: the responses' "
             "cached_tokens over prompt_tokens (spliced tokens count as reused). Load average at "
             f"start / end: {_loads(machine.get('load_average'))} / "
             f"{_loads(machine.get('load_average_end'))}.", "",
             "| policy | concurrency | ok | p50 TTFT | p90 TTFT | p99 TTFT | hit rate | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["summaries"]:
        lines.append(f"| {s['policy']} | {s['concurrency']} | {s['ok']}/{s['requests']} | "
                     f"{fmt_s(s['ttft_p50_s'])} | {fmt_s(s['ttft_p90_s'])} | "
                     f"{fmt_s(s['ttft_p99_s'])} | {fmt_pct(s['hit_rate_usage'])} | "
                     f"{s['mean_prompt_tokens'] or 0:.0f} |")
    for r in result["ratios"]:
        parts = [f"{k.split('_')[0]} / compose = {v:.1f}x" for k, v in r.items()
                 if k != "concurrency" and v is not None]
        if parts:
            lines.append(f"\np90 TTFT at concurrency {r['concurrency']}: " + ", ".join(parts))
    phased = result.get("phased") or []
    if phased:
        tau = result.get("guard_tau")
        cal = result.get("calibration") or {}
        repair = (result.get("config") or {}).get("repair", DEFAULT_REPAIR_TOKENS)
        lines += ["", f"Phased policies: `Repair(first={repair})` aligned to the block "
                  f"size; guard tau {tau if tau is not None else '-'}"
                  + (f" (chosen on {len(cal.get('cases') or [])} development prompts: "
                     f"{cal.get('rule')})" if cal else "") + ".", "",
                  "| policy | concurrency | phases / request | guard fires | spliced tokens / request |",
                  "|---|---:|---:|---:|---:|"]
        for row in phased:
            fires = "-" if row["guard_fires"] is None else str(row["guard_fires"])
            lines.append(f"| {row['policy']} | {row['concurrency']} | "
                         f"{_num(row['phases_per_request'], 2)} | {fires} | "
                         f"{_num(row['spliced_tokens_mean'], 0)} |")
    fid = result.get("fidelity") or []
    if fid:
        lines += _fidelity_lines(fid)
    checks = result.get("engine_check") or []
    if checks:
        lines += _engine_lines(checks, fid[0]["continuation_tokens"] if fid else 0)
    return "\n".join(lines) + "\n"


def _engine_lines(checks: list[dict[str, Any]], tokens: int) -> list[str]:
    decisions = any(c.get("engine_decision") is not None for c in checks)
    several = len({c["concurrency"] for c in checks}) > 1
    lines = ["", "Against kvnotes' engine: the same prompts composed by `Engine.compose` from "
             "the notebooks the server splices, with the same repair and guard (counts of "
             f"{checks[0]['samples']}):", "",
             "| policy | server = engine (spliced) | server = engine (exact) | engine: first "
             f"token identical | engine: {tokens}-token identical |"
             + (" engine: decision identical | server: decision identical |" if decisions
                else "") + " engine guard fired |",
             "|---|---:|---:|---:|---:|" + ("---:|---:|" if decisions else "") + "---:|"]
    for c in checks:
        name = f"{c['policy']} @ {c['concurrency']}" if several else c["policy"]
        row = (f"| {name} | {c['server_equals_engine']} | {c['exact_equals_engine']} | "
               f"{c['engine_first_token']} | {c['engine_continuation']} |")
        if decisions:
            row += f" {c['engine_decision']} | {c['server_decision']} |"
        fires = "-" if c.get("guard_fires") is None else str(c["guard_fires"])
        lines.append(row + f" {fires} |")
    return lines


def _fidelity_lines(fid: list[dict[str, Any]]) -> list[str]:
    tokens = fid[0]["continuation_tokens"]
    decisions = any(f.get("decision_identity") is not None for f in fid)
    several = len({f.get("concurrency", 1) for f in fid}) > 1
    lines = ["", f"Fidelity over {fid[0]['samples']} prompts against the same token ids sent to "
             "vLLM without a salt (exact):", ""]
    head = ("| policy | first token identical | "
            f"{tokens}-token greedy continuation identical | top-20 overlap (first token) | "
            "guard fired |")
    rule = "|---|---:|---:|---:|---:|"
    if decisions:
        head = head.replace("| first token", "| decision identical | right tool: exact / this "
                            "| first token")
        rule += "---:|---:|"
    lines += [head, rule]
    for f in fid:
        fires = "-" if f.get("guard_fires") is None else str(f["guard_fires"])
        row = (f"| {_policy_at(f, several)} | {fmt_pct(f['first_token_agreement'])} | "
               f"{fmt_pct(f['continuation_identity'])} | {fmt_pct(f['top20_overlap_mean'])} | "
               f"{fires} |")
        if decisions:
            right = ("-" if f.get("right_exact") is None
                     else f"{f['right_exact']}/{f['samples']} / {f['right_spliced']}/{f['samples']}")
            row = row.replace(" | ", f" | {fmt_pct(f.get('decision_identity'))} | {right} | ", 1)
        lines.append(row)
    forwarded = {_policy_at(f, several): f.get("forwarded") for f in fid if f.get("forwarded")}
    if forwarded:
        lines += ["", "Forwarded exactly by the front (nothing planned): " + ", ".join(
            f"{p} {n}" for p, n in forwarded.items())]
    halves = [(_policy_at(f, several), f["halves"]) for f in fid if f.get("halves")]
    if halves:
        lines += ["", "By half (the guard's tau is chosen on the calibration half):", "",
                  "| policy | half | cases | decision identical | first token identical | "
                  f"{tokens}-token identical | guard fired |", "|---|---|---:|---:|---:|---:|---:|"]
        for policy, by_half in halves:
            for half, h in sorted(by_half.items()):
                lines.append(f"| {policy} | {half} | {h['n']} | {h['decision_identical']} | "
                             f"{h['first_token_agree']} | {h['continuation_identical']} | "
                             f"{h['guard_fired'] if policy.startswith('guarded') else '-'} |")
    return lines


def _policy_at(f: dict[str, Any], several: bool) -> str:
    policy = str(f.get("policy", "compose"))
    return f"{policy} @ {f.get('concurrency', 1)}" if several else policy


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _loads(load: Sequence[float] | None) -> str:
    return "-" if not load else "/".join(f"{x:.1f}" for x in load)


def plot_ttft(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    concs = sorted({r["concurrency"] for r in result["requests"]})
    fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 3.6), squeeze=False)
    for ax, conc in zip(axes[0], concs, strict=True):
        for policy in SKILL_POLICIES:
            xs = sorted(r["ttft_s"] for r in result["requests"] if r["policy"] == policy
                        and r["concurrency"] == conc and r["ok"] and r["ttft_s"] is not None)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=policy)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no crowded labels
        ax.set_xlabel("time to first token (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"concurrency {conc}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['config']['model']}: composed skills inside vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and ``ttft.png`` in ``out``; returns their paths."""
    return write_bundle(out, result, report=markdown(result), json_name="results.json",
                        plot_name="ttft.png", plot=lambda p: plot_ttft(result, p))
