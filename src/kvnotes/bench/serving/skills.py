"""``kvnotes serve-bench skills``: composition inside vLLM against prefix caching and cold.

Each request is ``[header][k skills, a random subset in random order][~100 tokens of user
text]``, sent as token ids (kvnotes' per-part tokenization). Policies:

- ``cold``: a fresh ``cache_salt`` per request, so nothing is reused (full prefill);
- ``prefix``: no salt, plain prefix caching: reuse only when an earlier request shared the
  exact same leading pieces in the same order;
- ``compose``: the splice salt, so the connector supplies the leading run of known pieces and
  prefix caching reuses repeats of the same spliced order (the bare splice);
- ``repaired``: a phased prefill (:mod:`kvnotes.serving.phases`): the first 32 tokens of every
  skill not exactly placed are computed in context by vLLM, each region ending on a block
  boundary, the rest spliced (``Repair(first=32)`` aligned to the server's block size, the
  rule ``Engine.compose`` follows by default);
- ``guarded``: ``repaired``, and when the first answer token's top-1 minus top-2 log-prob is
  below ``tau`` the answer comes from an exact request instead.

Phases run on the shared kit (:mod:`kvnotes.bench.serving.kit`). The reported hit rate counts
what the server did not compute: ``cached_tokens / prompt_tokens`` summed over a phase (vLLM's
``cached_tokens`` includes connector-supplied tokens; the kit's ``hit_rate`` from /metrics
counts only its own prefix cache); for the phased policies it is the real request's (its
phases' blocks are hits). TTFT of a phased request counts from its first phase. Fidelity: for a
sample of prompts, each spliced policy's answer against the same prompt sent without the splice
salt (exact prefill or exact prefix hits): the first token, 16 greedy tokens and the top-20
logprob sets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.agent.skills import skill_names, skill_text
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
from kvnotes.core.document import added_bos, encode
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.repair import Repair
from kvnotes.eval.reports import write_bundle
from kvnotes.serving.client import Client
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, cold_salt
from kvnotes.serving.phases import check_tau
from kvnotes.serving.splice import PieceIndex, PieceInfo

if TYPE_CHECKING:
    from kvnotes.serving.launch import LaunchRecord
    from kvnotes.serving.skills import ServingSkills

SKILL_POLICIES = ("cold", "prefix", "compose", "repaired", "guarded")
SPLICED_POLICIES = ("compose", "repaired", "guarded")  # the ones fidelity is measured for
PHASED_POLICIES = ("repaired", "guarded")
# the phased policies' repair: each skill's first 32 tokens (the engine's default), aligned to
# the server's block size when planned
REPAIR = Repair(first=32)
# the guard's tau when calibration finds no first token that differs from the exact prompt's
DEFAULT_TAU = 0.5

_NAMES = ("Ana Ruiz", "Tom Becker", "Mei Lin", "Omar Haddad", "Sofia Rossi", "Jonas Berg",
          "Priya Nair", "Lukas Novak", "Grace Okafor", "Hiro Tanaka")
_ISSUES = (
    "I booked a flight {when} and I need to cancel it because of a family emergency. I paid "
    "with a {pay}. Can I get my money back, and how long will it take?",
    "My checked bag arrived {when} with a broken handle and a torn side pocket. The flight "
    "was operated by you and I am a {tier} member. What compensation can I get?",
    "I want to change the name on my booking made {when}; my passport shows my married name. "
    "I also want to add extra legroom. What does that cost for a {tier} member?",
    "My flight was delayed by six hours {when} and I missed a connection. I was travelling "
    "with a {pay} booking. What are you obliged to give me under your policy?",
)
_WHEN = ("2 hours ago", "yesterday", "5 days ago", "3 weeks ago", "last month")
_PAY = ("credit card", "gift card", "travel certificate", "corporate account")
_TIER = ("regular", "silver", "gold")


def skill_texts() -> dict[str, str]:
    """The benchmark's skill library: the agent's airline policies and tool manual."""
    return {name: skill_text(name) for name in skill_names()}


def user_text(rng: random.Random) -> str:
    issue = rng.choice(_ISSUES).format(when=rng.choice(_WHEN), pay=rng.choice(_PAY),
                                       tier=rng.choice(_TIER))
    ref = f"{rng.choice('ABCDEFGH')}{rng.randint(10000, 99999)}"
    return (f"\n\nCustomer {rng.choice(_NAMES)} (booking {ref}, account {rng.randint(1000, 9999)})"
            f" writes: {issue} Please answer with the exact policy that applies and the next "
            "step you will take.\nAgent:")


@dataclass(frozen=True)
class SkillsBenchConfig:
    """What one skills run measures: ``requests`` prompts per (concurrency, policy) row, each
    with ``k`` skills, then ``fidelity_samples`` compose requests against exact ones."""

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

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in SKILL_POLICIES]
        if unknown:
            raise UnknownNameError("policy", unknown[0], SKILL_POLICIES)
        if not 1 <= self.k <= len(skill_names()):
            raise InvalidArgumentError(f"--k must be between 1 and {len(skill_names())} (the "
                                       f"library's skills), got {self.k}")
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


def make_requests(n: int, k: int, seed: int) -> list[list[str]]:
    """``n`` prompts as parts: header, ``k`` skills (random subset and order), user text."""
    rng = random.Random(seed)
    skills = skill_texts()
    names = sorted(skills)
    out = []
    for _ in range(n):
        chosen = rng.sample(names, k)
        out.append([HEADER, *(skills[s] for s in chosen), user_text(rng)])
    return out


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


@dataclass(frozen=True)
class Clients:
    """The benchmark's clients: ``plain`` for cold/prefix/compose and the exact references,
    ``repaired`` and ``guarded`` for the phased policies (each its own tenant, so one phased
    policy's blocks never serve the other), and the guard's ``tau``."""

    plain: ComposeClient
    repaired: ComposeClient | None = None
    guarded: ComposeClient | None = None
    tau: float | None = None

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
        return client.complete(parts, max_tokens=max_tokens, logprobs=logprobs, repair=REPAIR,
                               guard=self.tau if policy == "guarded" else None)


def run_phase(clients: Clients, policy: str, concurrency: int, prompts: Sequence[list[str]],
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
    """One spliced policy's answers against the same prompts sent exactly (no splice salt)."""

    samples: int
    failed: int
    first_token_agreement: float | None
    continuation_identity: float | None
    continuation_tokens: int
    top20_overlap_mean: float | None
    cases: list[dict[str, Any]]
    policy: str = "compose"
    guard_fires: int | None = None  # guarded: answers that came from the exact request

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_fidelity(clients: Clients | ComposeClient, prompts: Sequence[list[str]],
                     tokens: int, policies: Sequence[str] = ("compose",)) -> list[Fidelity]:
    """Each prompt sent exactly, then under each of ``policies``: first token, ``tokens``
    greedy tokens and the first token's top-20 logprob set compared with the exact answer."""
    if isinstance(clients, ComposeClient):
        clients = Clients(clients)
    exact = [clients.plain.complete(parts, max_tokens=tokens, splice=False, logprobs=20)
             for parts in prompts]
    out = []
    for policy in policies:
        first = same = fires = 0
        overlaps: list[float] = []
        cases: list[dict[str, Any]] = []
        for parts, ref in zip(prompts, exact, strict=True):
            got = clients.send(policy, parts, tokens, logprobs=20)
            if not (got.ok and ref.ok):
                cases.append({"error": got.error or ref.error})
                continue
            agree = bool(got.tokens and ref.tokens and got.tokens[0] == ref.tokens[0])
            first += agree
            same += got.text == ref.text
            fires += bool(got.guard_fired)
            if got.top_logprobs and ref.top_logprobs:
                a, b = set(got.top_logprobs[0]), set(ref.top_logprobs[0])
                overlaps.append(len(a & b) / max(1, len(b)))
            cases.append({"first_token_agree": agree, "continuation_identical":
                          got.text == ref.text, "spliced": got.text, "exact": ref.text,
                          "spliced_cached": got.cached_tokens, "prompt_tokens":
                          got.prompt_tokens, "margin": got.margin, "guard_fired":
                          got.guard_fired, "phases": got.phases})
        n = sum(1 for c in cases if "error" not in c)
        out.append(Fidelity(samples=n, failed=len(cases) - n,
                            first_token_agreement=first / n if n else None,
                            continuation_identity=same / n if n else None,
                            continuation_tokens=tokens,
                            top20_overlap_mean=sum(overlaps) / len(overlaps) if overlaps else None,
                            cases=cases, policy=policy,
                            guard_fires=fires if policy == "guarded" else None))
    return out


@dataclass
class Calibration:
    """How the guard's tau was chosen: the repaired first token's top-2 margin on development
    prompts (not measured ones) and whether that token equals the exact prompt's."""

    tau: float
    rule: str
    cases: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate_tau(clients: Clients, prompts: Sequence[list[str]]) -> Calibration:
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
               "machine": self.machine.to_dict(),
               "server": None if self.server is None else self.server.to_dict(),
               "skills_anchor": self.anchor,
               "summaries": [s.to_dict() for s in self.phases],
               "ratios": [r.to_dict() for r in self.ratios()],
               "phased": self.phased_rows(),
               "guard_tau": self.guard_tau,
               "calibration": None if self.calibration is None else self.calibration.to_dict(),
               "fidelity": [f.to_dict() for f in self.fidelity],
               "requests": [asdict(r) for r in self.requests]}
        if self.launch is not None:
            out["launch"] = self.launch.to_dict()
        return out


def register_skills(skills: ServingSkills, *, anchor: bool = True,
                    log: Callable[[str], None] = lambda s: None) -> None:
    """Publish the benchmark's library: the system header as a piece, then every policy,
    compiled behind the header every request starts with (``anchor``) or alone."""
    skills.add(HEADER, name="header")
    for name, text in skill_texts().items():
        info = skills.add(text, name=name, after=HEADER if anchor else None)
        log(f"skill {name}: {len(info)} tokens (first position {info.origin})")


def library_index(tokenizer: Any, *, anchor: bool = True) -> PieceIndex:
    """The pieces :func:`register_skills` publishes, as the server indexes them (token ids and
    the position each was compiled at: behind BOS when the tokenizer adds one, skills behind
    the header when ``anchor``), for planning phased requests without reading the folder."""
    bos = added_bos(tokenizer)
    index = PieceIndex()
    at = 0
    if bos is not None:
        index.add(PieceInfo("bos", "bos", (bos,), 0))
        at = 1
    header = tuple(encode(tokenizer, HEADER))
    index.add(PieceInfo("header", "header", header, at))
    origin = at + len(header) if anchor else at
    for name, text in skill_texts().items():
        index.add(PieceInfo(name, name, tuple(encode(tokenizer, text)), origin))
    return index


def make_clients(client: ComposeClient, policies: Sequence[str], block_size: int | None, *,
                 anchor: bool = True, tau: float | None = None) -> Clients:
    """``client`` and, for the phased policies, clients that plan with the server's block size
    (the library's pieces from ``client``'s skills folder when it has one)."""
    if not set(policies) & set(PHASED_POLICIES):
        return Clients(client)
    if block_size is None:
        raise InvalidArgumentError("the repaired and guarded policies need the server's block "
                                   "size: it reports none in /metrics (vllm:cache_config_info)")
    skills = client.store.folder if client.store is not None else library_index(
        client.tokenizer, anchor=anchor)

    def phased(tenant: str) -> ComposeClient:
        return ComposeClient(client.url, client.model, client.tokenizer, timeout=client.timeout,
                             tenant=tenant, skills=skills, block_size=block_size)

    return Clients(client, repaired=phased("repaired"), guarded=phased("guarded"), tau=tau)


def run_skills_benchmark(client: ComposeClient, config: SkillsBenchConfig, *,
                         anchor: bool = True,
                         log: Callable[[str], None] = print) -> SkillsResult:
    """Every policy x concurrency phase, then fidelity, on the server ``client`` talks to."""
    metrics = Client(client.url)
    server = ServerRecord.read(metrics, client.model, log=log)
    machine = MachineRecord.now()
    phases: list[PhaseSummary] = []
    records: list[Record] = []
    clients = make_clients(client, config.policies, server.block_size, anchor=anchor,
                           tau=config.guard_tau)
    # warm-up: the first requests after start pay compilation; not measured
    for parts in make_requests(config.warmup, config.k, config.seed + 999):
        client.complete(parts, max_tokens=1, salt=cold_salt())
    calibration = None
    if "guarded" in config.policies and config.guard_tau is None:
        calibration = calibrate_tau(clients, make_requests(config.calibration_samples,
                                                           config.k, config.seed + 5555))
        clients = dataclasses.replace(clients, tau=calibration.tau)
        log(f"guard tau {calibration.tau} ({calibration.rule}; margins "
            + ", ".join(f"{c['margin']:.3f}{'' if c['agree'] else '*'}"
                        for c in calibration.cases) + "; * differs from the exact prompt)")
    for i, conc in enumerate(config.concurrency):
        for j, policy in enumerate(config.policies):
            # each phase gets its own random prompts: prefix caching sees no planted repeats
            prompts = make_requests(config.requests, config.k, config.seed + 100 * i + j)
            log(f"{policy}, concurrency {conc}: {len(prompts)} requests (load {load_now()})")
            summary, recs = run_phase(clients, policy, conc, prompts, config.max_tokens,
                                      metrics=metrics, log=log)
            phases.append(summary)
            records += recs
            log(phase_line(summary))
    fidelity: list[Fidelity] = []
    spliced = [p for p in SPLICED_POLICIES if p in config.policies]
    if spliced and config.fidelity_samples:
        prompts = make_requests(config.fidelity_samples, config.k, config.seed + 7777)
        fidelity = measure_fidelity(clients, prompts, config.fidelity_tokens, spliced)
        for f in fidelity:
            log(f"fidelity {f.policy}: first token {fmt_pct(f.first_token_agreement)}, "
                f"{config.fidelity_tokens}-token continuation "
                f"{fmt_pct(f.continuation_identity)}, top-20 overlap "
                f"{fmt_pct(f.top20_overlap_mean)} over {f.samples}"
                + (f", guard fired {f.guard_fires}" if f.guard_fires is not None else ""))
    machine.finish()
    return SkillsResult(config=config, machine=machine, server=server, phases=phases,
                        fidelity=fidelity, requests=records, anchor="header" if anchor else "none",
                        calibration=calibration, guard_tau=clients.tau)


def markdown(result: dict[str, Any]) -> str:
    """The report of a result's JSON form (``SkillsResult.to_dict()`` or a stored file)."""
    cfg = result["config"]
    server = result.get("server") or {}
    launch = result.get("launch") or {}
    machine = result["machine"]
    anchored = result.get("skills_anchor") == "header"
    lines = [f"# serve-bench skills ({cfg['model']})", "",
             f"{cfg['requests']} requests per row; each: header + {cfg['k']} of "
             f"{len(skill_names())} skills (random subset, random order) + ~100 tokens of user "
             f"text; TTFT from the client (streaming, first token). Server: vLLM "
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
        lines += ["", f"Phased policies: `Repair(first={REPAIR.first})` aligned to the block "
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
        tokens = fid[0]["continuation_tokens"]
        lines += ["", f"Fidelity over {fid[0]['samples']} prompts against the same prompt sent "
                  "without the splice salt (exact):", "",
                  f"| policy | first token identical | {tokens}-token greedy continuation "
                  "identical | top-20 overlap (first token) | guard fired |",
                  "|---|---:|---:|---:|---:|"]
        for f in fid:
            fires = "-" if f.get("guard_fires") is None else str(f["guard_fires"])
            lines.append(f"| {f.get('policy', 'compose')} | "
                         f"{fmt_pct(f['first_token_agreement'])} | "
                         f"{fmt_pct(f['continuation_identity'])} | "
                         f"{fmt_pct(f['top20_overlap_mean'])} | {fires} |")
    return "\n".join(lines) + "\n"


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
