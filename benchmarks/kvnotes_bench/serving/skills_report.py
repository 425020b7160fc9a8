"""The skills run's report: markdown tables and the TTFT plot, rendered from a typed
:class:`~kvnotes_bench.serving.skills.SkillsResult` (a stored ``results.json`` is read back
with :meth:`~kvnotes_bench.serving.skills.SkillsResult.from_dict` first)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.formats import fmt_pct, fmt_s
from kvnotes_bench.kit.plots import cdf, log_x, panels
from kvnotes_bench.serving.skills import SkillsResult
from kvnotes_bench.serving.skills_config import GUARDED_POLICIES, SKILL_POLICIES
from kvnotes_bench.serving.skills_fidelity import Fidelity
from kvnotes_bench.serving.skills_variants import DeclaredVariants, variant_use

if TYPE_CHECKING:
    from kvnotes_bench.serving.engine_check import EngineCheck


def markdown(result: Mapping[str, Any]) -> str:
    """The report of a result's JSON form (``SkillsResult.to_dict()`` or a stored file)."""
    return report(SkillsResult.from_dict(result))


def report(result: SkillsResult) -> str:
    """The markdown report of one skills run."""
    cfg = result.config
    server = result.server
    anchored = result.anchor == "header"
    what = result.prompt_set or (f"header + {cfg.k} skills (random subset, random "
                                 "order) + ~100 tokens of user text")
    via = ("kvnotes' OpenAI front (text prompts; the front plans the splice, phases and guard)"
           if cfg.via == "front" else "vLLM itself (token ids planned by ComposeClient)")
    lines = [f"# serve-bench skills ({cfg.model})", ""]
    if result.started:
        lines += [f"Run {result.started} to {result.finished or '?'} UTC"
                  + (f": `{result.command}`" if result.command else "") + ".", ""]
    version = server.version if server is not None else None
    block = server.block_size if server is not None else None
    lines += [
             f"{cfg.requests} requests per row; each: {what}. Requests sent to {via}. TTFT "
             f"from the client (streaming, first token). Server: vLLM "
             f"{version or '?'}, {result.launch.dtype if result.launch else '?'}, block size "
             f"{block or '?'}; skills compiled "
             f"{'behind the system header' if anchored else 'alone'}. Hit rate: the responses' "
             "cached_tokens over prompt_tokens (spliced tokens count as reused). Load average at "
             f"start / end: {_loads(result.machine.load_average)} / "
             f"{_loads(result.machine.load_average_end)}.", "",
             "| policy | concurrency | ok | p50 TTFT | p90 TTFT | p99 TTFT | hit rate | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result.phases:
        lines.append(f"| {s.policy} | {s.concurrency} | {s.ok}/{s.requests} | "
                     f"{fmt_s(s.ttft_p50_s)} | {fmt_s(s.ttft_p90_s)} | "
                     f"{fmt_s(s.ttft_p99_s)} | {fmt_pct(s.hit_rate_usage)} | "
                     f"{s.mean_prompt_tokens or 0:.0f} |")
    for r in result.ratios():
        parts = [f"{other} / {r.reference} = {v:.1f}x" for other, v in r.over.items()
                 if v is not None]
        if parts:
            lines.append(f"\np90 TTFT at concurrency {r.concurrency}: " + ", ".join(parts))
    phased = result.phased_rows()
    if phased:
        tau = result.guard_tau
        cal = result.calibration
        lines += ["", f"Phased policies: `Repair(first={cfg.repair})` aligned to the block "
                  f"size; guard tau {tau if tau is not None else '-'}"
                  + (f" (chosen on {len(cal.cases)} development prompts: "
                     f"{cal.rule})" if cal is not None else "") + ".", "",
                  "| policy | concurrency | phases / request | guard fires | spliced tokens / request |",
                  "|---|---:|---:|---:|---:|"]
        for row in phased:
            fires = "-" if row.guard_fires is None else str(row.guard_fires)
            lines.append(f"| {row.policy} | {row.concurrency} | "
                         f"{_num(row.phases_per_request, 2)} | {fires} | "
                         f"{_num(row.spliced_tokens_mean, 0)} |")
    fid = result.fidelity
    if fid:
        lines += fidelity_lines(fid)
        lines += recompute_lines(fid, result.variants, len(result.requests))
    if result.engine_check:
        lines += engine_lines(result.engine_check, fid[0].continuation_tokens if fid else 0)
    return "\n".join(lines) + "\n"


def engine_lines(checks: Sequence[EngineCheck], tokens: int) -> list[str]:
    """The table of the server's answers against kvnotes' engine."""
    decisions = any(c.engine_decision is not None for c in checks)
    several = len({c.concurrency for c in checks}) > 1
    lines = ["", "Against kvnotes' engine: the same prompts composed by `Engine.compose` from "
             "the notebooks the server splices, with the same repair and guard (counts of "
             f"{checks[0].samples}):", "",
             "| policy | server = engine (spliced) | server = engine (exact) | engine: first "
             f"token identical | engine: {tokens}-token identical |"
             + (" engine: decision identical | server: decision identical |" if decisions
                else "") + " engine guard fired |",
             "|---|---:|---:|---:|---:|" + ("---:|---:|" if decisions else "") + "---:|"]
    for c in checks:
        name = f"{c.policy} @ {c.concurrency}" if several else c.policy
        row = (f"| {name} | {c.server_equals_engine} | {c.exact_equals_engine} | "
               f"{c.engine_first_token} | {c.engine_continuation} |")
        if decisions:
            row += f" {c.engine_decision} | {c.server_decision} |"
        fires = "-" if c.guard_fires is None else str(c.guard_fires)
        lines.append(row + f" {fires} |")
    return lines


def fidelity_lines(fid: Sequence[Fidelity]) -> list[str]:
    """The fidelity table (and the forwarded counts and the by-half table where there are)."""
    tokens = fid[0].continuation_tokens
    decisions = any(f.decision_identity is not None for f in fid)
    several = len({f.concurrency for f in fid}) > 1
    lines = ["", f"Fidelity over {fid[0].samples} prompts against the same token ids sent to "
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
        fires = "-" if f.guard_fires is None else str(f.guard_fires)
        row = (f"| {_policy_at(f, several)} | {fmt_pct(f.first_token_agreement)} | "
               f"{fmt_pct(f.continuation_identity)} | {fmt_pct(f.top20_overlap_mean)} | "
               f"{fires} |")
        if decisions:
            right = ("-" if f.right_exact is None
                     else f"{f.right_exact}/{f.samples} / {f.right_spliced}/{f.samples}")
            row = row.replace(" | ", f" | {fmt_pct(f.decision_identity)} | {right} | ", 1)
        lines.append(row)
    forwarded = {_policy_at(f, several): f.forwarded for f in fid if f.forwarded}
    if forwarded:
        lines += ["", "Forwarded exactly by the front (nothing planned): " + ", ".join(
            f"{p} {n}" for p, n in forwarded.items())]
    halves = [(_policy_at(f, several), f.policy in GUARDED_POLICIES, f.halves)
              for f in fid if f.halves]
    if halves:
        lines += ["", "By half (the guard's tau is chosen on the calibration half):", "",
                  "| policy | half | cases | decision identical | first token identical | "
                  f"{tokens}-token identical | guard fired |", "|---|---|---:|---:|---:|---:|---:|"]
        for policy, guarded, by_half in halves:
            for half, h in sorted(by_half.items()):
                lines.append(f"| {policy} | {half} | {h.n} | {h.decision_identical} | "
                             f"{h.first_token_agree} | {h.continuation_identical} | "
                             f"{h.guard_fired if guarded else '-'} |")
    return lines


def recompute_lines(fid: Sequence[Fidelity], variants: DeclaredVariants | None,
                    requests: int) -> list[str]:
    """What each policy's fidelity plans recomputed and, with declared variants, how often a
    plan spliced one (and spliced it as it is: exactly placed) and what they cost."""
    rows = [f for f in fid if f.repaired_share is not None]
    if not rows:
        return []
    several = len({f.concurrency for f in fid}) > 1
    lines = ["", "Recomputed in context by the fidelity prompts' plans (skill tokens computed by "
             "vLLM instead of spliced), over all prompt tokens and over the placed pieces' "
             "tokens" + ("; variant hits: pieces spliced from a declared variant (of all pieces "
                         "placed, BOS and header included), exact: of those, spliced with "
                         "nothing recomputed" if variants is not None else "") + ":", "",
             "| policy | recomputed / prompt tokens | recomputed / piece tokens |"
             + (" variant hits / pieces | exact hits |" if variants is not None else ""),
             "|---|---:|---:|" + ("---:|---:|" if variants is not None else "")]
    for f in rows:
        row = (f"| {_policy_at(f, several)} | {fmt_pct(f.repaired_share)} | "
               f"{fmt_pct(f.repaired_of_pieces)} |")
        if variants is not None:
            use = variant_use(f.cases, variants.keys)
            row += f" {use['hits']}/{use['spliced']} | {use['exact']} |"
        lines.append(row)
    if variants is not None:
        lines += ["", f"Declared variants (the variants policy's tenant `{variants.tenant}`): "
                  f"{variants.pairs} (predecessor, skill) pairs of {variants.skills} skills, "
                  f"each compiled behind the header and its predecessor ({variants.compiled} "
                  f"compiled by this run), {variants.bytes / 2**20:.1f} MiB on disk; compiled "
                  f"in {variants.compile_s:.1f} s before the server started, once: the "
                  f"compiles amortized over the run ({requests} measured requests and the "
                  "fidelity prompts)."]
    return lines


def _policy_at(f: Fidelity, several: bool) -> str:
    return f"{f.policy} @ {f.concurrency}" if several else f.policy


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _loads(load: Sequence[float] | None) -> str:
    return "-" if not load else "/".join(f"{x:.1f}" for x in load)


def plot_ttft(result: SkillsResult, path: Path) -> None:
    """Per concurrency level, the CDF of each policy's TTFT."""
    concs = sorted({r.concurrency for r in result.requests})
    title = f"{result.config.model}: composed skills inside vLLM"
    with panels(path, len(concs), size=(5 * len(concs), 3.6), title=title) as axes:
        for ax, conc in zip(axes, concs, strict=True):
            for policy in SKILL_POLICIES:
                cdf(ax, (r.ttft_s for r in result.requests if r.policy == policy
                         and r.concurrency == conc and r.ok and r.ttft_s is not None),
                    label=policy)
            log_x(ax)
            ax.set_xlabel("time to first token (s, log)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"concurrency {conc}")
            ax.grid(alpha=0.3)
            ax.legend()


def write_outputs(result: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """``results.json`` (the JSON form as given), ``report.md`` and ``ttft.png`` in ``out``;
    returns their paths."""
    typed = SkillsResult.from_dict(result)
    return write_bundle(out, dict(result), report=report(typed), json_name="results.json",
                        plot_name="ttft.png", plot=lambda p: plot_ttft(typed, p))
