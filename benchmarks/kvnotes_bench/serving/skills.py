"""``kvnotes-bench serve skills``: composition inside vLLM against prefix caching and cold.

Each request is a header, registered skills and computed text (:mod:`.prompt_sets`: the airline
library, ``k`` skills in random order and a customer's question; or BFCL's ``live_multiple``
or ``multi_turn`` development cases, each function description or API manual a skill, the
decision the function name the answer writes). Policies:

- ``cold``: a fresh ``cache_salt`` per request, so nothing is reused (full prefill);
- ``prefix``: no salt, plain prefix caching: reuse only when an earlier request shared the
  exact same leading pieces in the same order;
- ``compose``: a splice request for the leading run and its salt, so the connector supplies the
  leading run of known pieces and prefix caching reuses repeats of the same spliced order (the
  bare splice);
- ``repaired``: a phased prefill (:mod:`kvnotes.serving.planning.phases`): the first ``repair`` tokens
  of every skill not exactly placed are computed in context by vLLM, each region ending on a
  block boundary, the rest spliced (``Repair(first=repair)`` aligned to the server's block
  size; 32, the default, is the rule ``Engine.compose`` follows by default);
- ``guarded``: ``repaired``, and when the first answer token's top-1 minus top-2 log-prob is
  below ``tau`` the answer comes from an exact request instead;
- ``variants`` (``via="front"`` only): ``repaired``, with each skill also compiled behind the
  header and the skill that precedes it, for the (predecessor, skill) pairs the policy's
  requests contain (declared before the run, :mod:`~kvnotes_bench.serving.skills_variants`);
  the front splices the variant that ranks first, and an exactly placed one is not repaired;
- ``variants-guarded`` (``via="front"`` only): ``variants`` with the guard, in the same tenant
  (so it sees the same declared variants): what the front does by default when its library
  holds variants.

``via="vllm"`` sends each policy's requests to vLLM as token ids, planned by
:class:`~kvnotes.serving.compose_client.ComposeClient`; ``via="front"`` sends the prompt's text
to kvnotes' OpenAI front (:class:`~kvnotes_bench.serving.skills_clients.FrontClients`), which
finds the skills and plans the same phases and guard itself: what an ordinary OpenAI client
gets.

Phases run on the shared kit (:mod:`kvnotes_bench.serving.kit`). The reported hit rate counts
what the server did not compute: ``cached_tokens / prompt_tokens`` summed over a phase (vLLM's
``cached_tokens`` includes connector-supplied tokens; the kit's ``hit_rate`` from /metrics
counts only its own prefix cache); for the phased policies it is the real request's (its
phases' blocks are hits). TTFT of a phased request counts from its first phase. Fidelity: for a
sample of prompts, each spliced policy's answer against the same token ids sent to vLLM without
a salt (exact prefill or exact prefix hits): the first token, 16 greedy tokens, the top-20
logprob sets and, where the prompt set reads one, the decision.

This module runs the workload and holds its result; the configuration is
:mod:`~kvnotes_bench.serving.skills_config`'s, the policies' clients
:mod:`~kvnotes_bench.serving.skills_clients`', the fidelity pass and the guard's calibration
:mod:`~kvnotes_bench.serving.skills_fidelity`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeClient, cold_salt
from kvnotes.serving.vllm_endpoints import Client
from kvnotes_bench.kit.formats import fmt_pct
from kvnotes_bench.kit.machine import MachineRecord, load_now
from kvnotes_bench.serving import kit
from kvnotes_bench.serving.kit import (
    P90Ratio,
    PhaseSummary,
    ServerRecord,
    failure_lines,
    p90_ratios,
    phase_line,
    summarize,
)
from kvnotes_bench.serving.prompt_sets import AirlinePrompts, PromptSet
from kvnotes_bench.serving.skills_clients import Clients, FrontClients, PolicyClients, make_clients
from kvnotes_bench.serving.skills_config import (
    GUARDED_POLICIES,
    PHASED_POLICIES,
    SPLICED_POLICIES,
    VARIANTS_POLICIES,
    SkillsBenchConfig,
    config_from_dict,
)
from kvnotes_bench.serving.skills_fidelity import (
    Calibration,
    Fidelity,
    calibrate_tau,
    fidelity_prompts,
    measure_fidelity,
)
from kvnotes_bench.serving.skills_variants import DeclaredVariants, VariantPair, variant_pairs

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import LaunchRecord
    from kvnotes_bench.serving.engine_check import EngineCheck


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
    guard_fired: bool | None = None  # guarded policies: the answer came from an exact request
    spliced_tokens: int | None = None  # phased policies: what the plan splices

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Record:
        """Read back ``asdict(record)``."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


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


@dataclass(frozen=True)
class PhasedRow:
    """One phased (policy, concurrency) row: what the phased requests cost beside the TTFT."""

    policy: str
    concurrency: int
    phases_per_request: float | None
    guard_fires: int | None  # guarded policies only
    spliced_tokens_mean: float | None


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
    variants: DeclaredVariants | None = None  # what the variants policies declared beforehand

    def phased_rows(self) -> list[PhasedRow]:
        """Per phased (policy, concurrency) row: phases per request, guard fires, and the
        tokens the plan splices per request."""
        rows = []
        for s in self.phases:
            if s.policy not in PHASED_POLICIES:
                continue
            recs = [r for r in self.requests if r.policy == s.policy
                    and r.concurrency == s.concurrency and r.ok]
            rows.append(PhasedRow(
                policy=s.policy, concurrency=s.concurrency,
                phases_per_request=sum(r.phases for r in recs) / len(recs) if recs else None,
                guard_fires=(sum(bool(r.guard_fired) for r in recs)
                             if s.policy in GUARDED_POLICIES else None),
                spliced_tokens_mean=(sum(r.spliced_tokens or 0 for r in recs) / len(recs)
                                     if recs else None)))
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
               "phased": [asdict(r) for r in self.phased_rows()],
               "guard_tau": self.guard_tau,
               "calibration": None if self.calibration is None else self.calibration.to_dict(),
               "fidelity": [f.to_dict() for f in self.fidelity],
               "engine_check": [c.to_dict() for c in self.engine_check],
               "requests": [asdict(r) for r in self.requests],
               "variants": None if self.variants is None else self.variants.to_dict()}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SkillsResult:
        """Read back :meth:`to_dict` (a stored ``results.json``; fields an older run lacks take
        their defaults)."""
        from kvnotes.serving.launch.launcher import LaunchRecord

        checks: list[EngineCheck] = []
        if d.get("engine_check"):
            from kvnotes_bench.serving.engine_check import EngineCheck  # needs torch: only then

            checks = [EngineCheck.from_dict(c) for c in d["engine_check"]]
        launch = d.get("launch")
        calibration = d.get("calibration")
        variants = d.get("variants")
        return cls(config=config_from_dict(d["config"]),
                   machine=MachineRecord.from_dict(d.get("machine") or {}),
                   server=ServerRecord.from_dict(d["server"]) if d.get("server") else None,
                   phases=[PhaseSummary.from_dict(s) for s in d.get("summaries", [])],
                   fidelity=[Fidelity.from_dict(f) for f in d.get("fidelity") or []],
                   requests=[Record.from_dict(r) for r in d.get("requests", [])],
                   anchor=d.get("skills_anchor", "none"),
                   launch=LaunchRecord(**{f.name: launch[f.name]
                                          for f in dataclasses.fields(LaunchRecord)})
                   if launch else None,
                   calibration=Calibration.from_dict(calibration) if calibration else None,
                   guard_tau=d.get("guard_tau"), prompt_set=d.get("prompt_set", ""),
                   skipped=[dict(x) for x in d.get("skipped") or []], engine_check=checks,
                   started=d.get("started", ""), finished=d.get("finished", ""),
                   command=d.get("command", ""),
                   variants=DeclaredVariants.from_dict(variants) if variants else None)


def phase_prompts(config: SkillsBenchConfig, prompt_set: PromptSet
                  ) -> list[tuple[int, str, list[list[str]]]]:
    """``(concurrency, policy, prompts)`` of each TTFT row, in the order they run (each row
    its own random prompts: prefix caching sees no planted repeats)."""
    return [(conc, policy, prompt_set.requests(config.requests, config.seed + 100 * i + j,
                                               "ttft"))
            for i, conc in enumerate(config.concurrency)
            for j, policy in enumerate(config.policies)]


def policy_prompts(config: SkillsBenchConfig, prompt_set: PromptSet, policy: str
                   ) -> list[list[str]]:
    """Every prompt a run of ``config`` sends under ``policy``: its TTFT rows', then the
    fidelity pass's."""
    out = [p for _, name, prompts in phase_prompts(config, prompt_set) if name == policy
           for p in prompts]
    if config.fidelity_samples:
        out += fidelity_prompts(prompt_set, config)
    return out


def declared_pairs(config: SkillsBenchConfig, prompt_set: PromptSet) -> list[VariantPair]:
    """The variants a run of ``config`` declares: the distinct (predecessor, skill) pairs of
    every prompt the variants policies it asks for send (both share the declared entries)."""
    return variant_pairs([p for policy in VARIANTS_POLICIES if policy in config.policies
                          for p in policy_prompts(config, prompt_set, policy)])


def run_skills_benchmark(client: ComposeClient, config: SkillsBenchConfig, *,
                         anchor: bool = True, prompt_set: PromptSet | None = None,
                         front: ComposeClient | None = None,
                         variants: DeclaredVariants | None = None,
                         log: Callable[[str], None] = print) -> SkillsResult:
    """Every policy x concurrency phase, then fidelity, on the server ``client`` talks to
    (vLLM itself); with ``front`` (a client of kvnotes' OpenAI front before that server), the
    measured requests go through the front as text. ``prompt_set`` defaults to the airline
    library with ``config.k`` skills; ``variants``: what was declared for the variants
    policies (published before the server was asked anything)."""
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
    if config.calibrates:
        calibration = calibrate_tau(clients, prompts_of.requests(
            config.calibration_samples, config.seed + 5555, "calibration"))
        clients = dataclasses.replace(clients, tau=calibration.tau)
        log(f"guard tau {calibration.tau} ({calibration.rule}; margins "
            + ", ".join(f"{c['margin']:.3f}{'' if c['agree'] else '*'}"
                        for c in calibration.cases) + "; * differs from the exact prompt)")
    for conc, policy, prompts in phase_prompts(config, prompts_of):
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
                + (f", guard fired {f.guard_fires}" if f.guard_fires is not None else "")
                + (f", recomputed {fmt_pct(f.repaired_share)} of prompt tokens"
                   if f.repaired_share is not None else ""))
    machine.finish()
    return SkillsResult(config=config, machine=machine, server=server, phases=phases,
                        fidelity=fidelity, requests=records, anchor="header" if anchor else "none",
                        calibration=calibration, guard_tau=clients.tau,
                        prompt_set=prompts_of.describe(),
                        skipped=list(getattr(prompts_of, "skipped", [])),
                        started=started, finished=utc_minute(), variants=variants)


def utc_minute() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())
