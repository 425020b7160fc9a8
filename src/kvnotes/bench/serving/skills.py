"""``serve-bench --workload skills``: composition inside vLLM against prefix caching and cold.

Each request is ``[header][k skills, a random subset in random order][~100 tokens of user
text]``, sent as token ids (kvnotes' per-part tokenization). Policies:

- ``cold``: a fresh ``cache_salt`` per request, so nothing is reused (full prefill);
- ``prefix``: no salt, plain prefix caching: reuse only when an earlier request shared the
  exact same leading pieces in the same order;
- ``compose``: the splice salt, so the connector supplies the leading run of known pieces and
  prefix caching reuses repeats of the same spliced order.

Hit rate counts what the server did not compute: ``cached_tokens / prompt_tokens`` summed over a
phase (vLLM's ``cached_tokens`` includes connector-supplied tokens). Fidelity: for a sample of
compose requests, the same prompt sent without the splice salt (exact prefill or exact prefix
hits) is the reference for the first token, 16 greedy tokens and the top-20 logprob sets.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.agent.skills import skill_names, skill_text
from kvnotes.bench.serving.metrics import percentile
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.machine import machine_info
from kvnotes.eval.reports import write_bundle
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, cold_salt

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
            raise InvalidArgumentError(f"k must be between 1 and {len(skill_names())}")
        if self.requests < 1 or any(c < 1 for c in self.concurrency):
            raise InvalidArgumentError("requests and concurrency must be at least 1")


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
    policy: str
    concurrency: int
    ok: bool
    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None


@dataclass
class PhaseSummary:
    policy: str
    concurrency: int
    requests: int
    ok: int
    failed: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    hit_rate: float | None
    prompt_tokens_mean: float | None
    wall_s: float
    errors: list[str] = field(default_factory=list)


def _send(client: ComposeClient, policy: str, parts: list[str], max_tokens: int) -> ComposeResult:
    if policy == "cold":
        return client.complete(parts, max_tokens=max_tokens, salt=cold_salt())
    return client.complete(parts, max_tokens=max_tokens, splice=policy == "compose")


def run_phase(client: ComposeClient, policy: str, concurrency: int, prompts: Sequence[list[str]],
              max_tokens: int) -> tuple[PhaseSummary, list[Record]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: _send(client, policy, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    records = [Record(policy, concurrency, r.ok, r.ttft_s, r.prompt_tokens, r.cached_tokens,
                      r.error) for r in results]
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    prompt = sum(r.prompt_tokens or 0 for r in records if r.ok)
    cached = sum(r.cached_tokens or 0 for r in records if r.ok)
    ok = [r for r in records if r.ok]
    summary = PhaseSummary(
        policy, concurrency, len(records), len(ok), len(records) - len(ok),
        percentile(ttfts, 50), percentile(ttfts, 90), percentile(ttfts, 99),
        cached / prompt if prompt else None,
        prompt / len(ok) if ok else None, wall,
        sorted({r.error for r in records if r.error})[:5])
    return summary, records


def measure_fidelity(client: ComposeClient, prompts: Sequence[list[str]], tokens: int
                     ) -> dict[str, Any]:
    """Spliced answers against the same prompts sent exactly (no splice salt)."""
    first = same = 0
    overlaps: list[float] = []
    cases = []
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
    return {"samples": n, "failed": len(cases) - n,
            "first_token_agreement": first / n if n else None,
            "continuation_identity": same / n if n else None,
            "continuation_tokens": tokens,
            "top20_overlap_mean": sum(overlaps) / len(overlaps) if overlaps else None,
            "cases": cases}


def run_skills_benchmark(client: ComposeClient, config: SkillsBenchConfig, *,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every policy x concurrency phase, then fidelity; a JSON-able result."""
    machine_before = machine_info()  # threads, load average, CPU flags
    summaries: list[PhaseSummary] = []
    records: list[Record] = []
    # warm-up: the first requests after start pay compilation; not measured
    for parts in make_requests(config.warmup, config.k, config.seed + 999):
        client.complete(parts, max_tokens=1, salt=cold_salt())
    for i, conc in enumerate(config.concurrency):
        for j, policy in enumerate(config.policies):
            # each phase gets its own random prompts: prefix caching sees no planted repeats
            prompts = make_requests(config.requests, config.k, config.seed + 100 * i + j)
            summary, recs = run_phase(client, policy, conc, prompts, config.max_tokens)
            summaries.append(summary)
            records += recs
            log(f"{policy:8s} c={conc:<3d} p50 {_s(summary.ttft_p50_s)} p90 "
                f"{_s(summary.ttft_p90_s)} hit {_pct(summary.hit_rate)} "
                f"ok {summary.ok}/{summary.requests}")
    fidelity = None
    if "compose" in config.policies and config.fidelity_samples:
        prompts = make_requests(config.fidelity_samples, config.k, config.seed + 7777)
        fidelity = measure_fidelity(client, prompts, config.fidelity_tokens)
        log(f"fidelity: first token {_pct(fidelity['first_token_agreement'])}, "
            f"{config.fidelity_tokens}-token continuation "
            f"{_pct(fidelity['continuation_identity'])}, top-20 overlap "
            f"{_pct(fidelity['top20_overlap_mean'])} over {fidelity['samples']}")
    return {"workload": "skills", "config": asdict(config),
            "machine": {"before": machine_before, "after": machine_info()},
            "summaries": [asdict(s) for s in summaries], "ratios": ratios(summaries),
            "fidelity": fidelity, "requests": [asdict(r) for r in records]}


def ratios(summaries: Sequence[PhaseSummary]) -> list[dict[str, Any]]:
    """p90 TTFT of prefix and cold over compose, per concurrency."""
    out = []
    for conc in sorted({s.concurrency for s in summaries}):
        row = {s.policy: s for s in summaries if s.concurrency == conc}
        comp = row.get("compose")
        if comp is None or not comp.ttft_p90_s:
            continue
        entry: dict[str, Any] = {"concurrency": conc}
        for other in ("prefix", "cold"):
            if other in row and row[other].ttft_p90_s:
                entry[f"{other}_over_compose_p90"] = row[other].ttft_p90_s / comp.ttft_p90_s
        out.append(entry)
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"# serve-bench --workload skills ({cfg['model']})", "",
             f"{cfg['requests']} requests per row; each: header + {cfg['k']} of "
             f"{len(skill_names())} skills (random subset, random order) + ~100 tokens of user "
             f"text; TTFT from the client (streaming, first token). Server: "
             f"{result.get('server', {}).get('dtype', '?')}, block size "
             f"{result.get('server', {}).get('block_size', '?')}; skills compiled "
             f"{'behind the system header' if result.get('skills_anchor') == 'header' else 'alone'}"
             f". Load average before/after: "
             f"{_load(result['machine']['before'])} / {_load(result['machine']['after'])}.", "",
             "| policy | concurrency | ok | p50 TTFT | p90 TTFT | p99 TTFT | hit rate | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["summaries"]:
        lines.append(f"| {s['policy']} | {s['concurrency']} | {s['ok']}/{s['requests']} | "
                     f"{_s(s['ttft_p50_s'])} | {_s(s['ttft_p90_s'])} | {_s(s['ttft_p99_s'])} | "
                     f"{_pct(s['hit_rate'])} | {s['prompt_tokens_mean'] or 0:.0f} |")
    for r in result["ratios"]:
        parts = [f"{k.split('_')[0]} / compose = {v:.1f}x" for k, v in r.items()
                 if k != "concurrency"]
        lines.append(f"\np90 TTFT at concurrency {r['concurrency']}: " + ", ".join(parts))
    fid = result.get("fidelity")
    if fid:
        lines += ["", f"Fidelity over {fid['samples']} compose requests against the same prompt "
                  "sent without the splice salt (exact):", "",
                  f"- first-token agreement: {_pct(fid['first_token_agreement'])}",
                  f"- {fid['continuation_tokens']}-token greedy continuation identical: "
                  f"{_pct(fid['continuation_identity'])}",
                  f"- top-20 logprob set overlap at the first token: "
                  f"{_pct(fid['top20_overlap_mean'])}"]
    return "\n".join(lines) + "\n"


def _load(m: dict[str, Any]) -> str:
    return "/".join(f"{x:.1f}" for x in m["load_average"])


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
    return write_bundle(out, result, report=markdown(result), json_name="results.json",
                        plot_name="ttft.png", plot=lambda p: plot_ttft(result, p))
