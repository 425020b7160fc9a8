"""``kvnotes serve-bench skills``: composition inside vLLM against prefix caching and cold.

Each request is ``[header][k skills, a random subset in random order][~100 tokens of user
text]``, sent as token ids (kvnotes' per-part tokenization). Policies:

- ``cold``: a fresh ``cache_salt`` per request, so nothing is reused (full prefill);
- ``prefix``: no salt, plain prefix caching: reuse only when an earlier request shared the
  exact same leading pieces in the same order;
- ``compose``: the splice salt, so the connector supplies the leading run of known pieces and
  prefix caching reuses repeats of the same spliced order.

Phases run on the shared kit (:mod:`kvnotes.bench.serving.kit`). The reported hit rate counts
what the server did not compute: ``cached_tokens / prompt_tokens`` summed over a phase (vLLM's
``cached_tokens`` includes connector-supplied tokens; the kit's ``hit_rate`` from /metrics
counts only its own prefix cache). Fidelity: for a sample of
compose requests, the same prompt sent without the splice salt (exact prefill or exact prefix
hits) is the reference for the first token, 16 greedy tokens and the top-20 logprob sets.
"""

from __future__ import annotations

import asyncio
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
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.eval.reports import write_bundle
from kvnotes.serving.client import Client
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, cold_salt

if TYPE_CHECKING:
    from kvnotes.serving.launch import LaunchRecord
    from kvnotes.serving.skills import ServingSkills

SKILL_POLICIES = ("cold", "prefix", "compose")

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


def _send(client: ComposeClient, policy: str, parts: list[str], max_tokens: int) -> ComposeResult:
    if policy == "cold":
        return client.complete(parts, max_tokens=max_tokens, salt=cold_salt())
    return client.complete(parts, max_tokens=max_tokens, splice=policy == "compose")


def run_phase(client: ComposeClient, policy: str, concurrency: int, prompts: Sequence[list[str]],
              max_tokens: int, *, metrics: Client | None = None,
              log: Callable[[str], None] = lambda s: None) -> tuple[PhaseSummary, list[Record]]:
    """Every prompt once under ``policy``, ``concurrency`` in flight (the blocking client runs in
    a thread per worker)."""
    threads = ThreadPoolExecutor(max_workers=concurrency)

    async def send(parts: list[str]) -> list[Record]:
        r = await asyncio.get_running_loop().run_in_executor(
            threads, _send, client, policy, parts, max_tokens)
        return [Record(policy, concurrency, r.ok, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                       r.error, None if r.ok else "request")]

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
    """Spliced answers against the same prompts sent exactly (no splice salt)."""

    samples: int
    failed: int
    first_token_agreement: float | None
    continuation_identity: float | None
    continuation_tokens: int
    top20_overlap_mean: float | None
    cases: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_fidelity(client: ComposeClient, prompts: Sequence[list[str]], tokens: int
                     ) -> Fidelity:
    """Each prompt sent spliced and exactly: first token, ``tokens`` greedy tokens and the first
    token's top-20 logprob set compared."""
    first = same = 0
    overlaps: list[float] = []
    cases: list[dict[str, Any]] = []
    for parts in prompts:
        spliced = client.complete(parts, max_tokens=tokens, splice=True, logprobs=20)
        exact = client.complete(parts, max_tokens=tokens, splice=False, logprobs=20)
        if not (spliced.ok and exact.ok):
            cases.append({"error": spliced.error or exact.error})
            continue
        agree = bool(spliced.tokens and exact.tokens and spliced.tokens[0] == exact.tokens[0])
        first += agree
        same += spliced.text == exact.text
        if spliced.top_logprobs and exact.top_logprobs:
            a, b = set(spliced.top_logprobs[0]), set(exact.top_logprobs[0])
            overlaps.append(len(a & b) / max(1, len(b)))
        cases.append({"first_token_agree": agree, "continuation_identical":
                      spliced.text == exact.text, "spliced": spliced.text, "exact": exact.text,
                      "spliced_cached": spliced.cached_tokens, "prompt_tokens":
                      spliced.prompt_tokens})
    n = sum(1 for c in cases if "error" not in c)
    return Fidelity(samples=n, failed=len(cases) - n,
                    first_token_agreement=first / n if n else None,
                    continuation_identity=same / n if n else None, continuation_tokens=tokens,
                    top20_overlap_mean=sum(overlaps) / len(overlaps) if overlaps else None,
                    cases=cases)


@dataclass
class SkillsResult:
    """Everything one skills run measured; :meth:`to_dict` is the ``results.json`` schema."""

    config: SkillsBenchConfig
    machine: MachineRecord
    server: ServerRecord | None
    phases: list[PhaseSummary]
    fidelity: Fidelity | None
    requests: list[Record]
    anchor: str = "header"  # what the skills were compiled behind: "header" or "none"
    launch: LaunchRecord | None = None

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
               "fidelity": None if self.fidelity is None else self.fidelity.to_dict(),
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


def run_skills_benchmark(client: ComposeClient, config: SkillsBenchConfig, *,
                         anchor: bool = True,
                         log: Callable[[str], None] = print) -> SkillsResult:
    """Every policy x concurrency phase, then fidelity, on the server ``client`` talks to."""
    metrics = Client(client.url)
    server = ServerRecord.read(metrics, client.model, log=log)
    machine = MachineRecord.now()
    phases: list[PhaseSummary] = []
    records: list[Record] = []
    # warm-up: the first requests after start pay compilation; not measured
    for parts in make_requests(config.warmup, config.k, config.seed + 999):
        client.complete(parts, max_tokens=1, salt=cold_salt())
    for i, conc in enumerate(config.concurrency):
        for j, policy in enumerate(config.policies):
            # each phase gets its own random prompts: prefix caching sees no planted repeats
            prompts = make_requests(config.requests, config.k, config.seed + 100 * i + j)
            log(f"{policy}, concurrency {conc}: {len(prompts)} requests (load {load_now()})")
            summary, recs = run_phase(client, policy, conc, prompts, config.max_tokens,
                                      metrics=metrics, log=log)
            phases.append(summary)
            records += recs
            log(phase_line(summary))
    fidelity = None
    if "compose" in config.policies and config.fidelity_samples:
        prompts = make_requests(config.fidelity_samples, config.k, config.seed + 7777)
        fidelity = measure_fidelity(client, prompts, config.fidelity_tokens)
        log(f"fidelity: first token {fmt_pct(fidelity.first_token_agreement)}, "
            f"{config.fidelity_tokens}-token continuation "
            f"{fmt_pct(fidelity.continuation_identity)}, top-20 overlap "
            f"{fmt_pct(fidelity.top20_overlap_mean)} over {fidelity.samples}")
    machine.finish()
    return SkillsResult(config=config, machine=machine, server=server, phases=phases,
                        fidelity=fidelity, requests=records, anchor="header" if anchor else "none")


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
    fid = result.get("fidelity")
    if fid:
        lines += ["", f"Fidelity over {fid['samples']} compose requests against the same prompt "
                  "sent without the splice salt (exact):", "",
                  f"- first-token agreement: {fmt_pct(fid['first_token_agreement'])}",
                  f"- {fid['continuation_tokens']}-token greedy continuation identical: "
                  f"{fmt_pct(fid['continuation_identity'])}",
                  f"- top-20 logprob set overlap at the first token: "
                  f"{fmt_pct(fid['top20_overlap_mean'])}"]
    return "\n".join(lines) + "\n"


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
