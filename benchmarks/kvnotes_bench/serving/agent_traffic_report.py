"""``serve-bench agent``'s report (markdown) and plot, rendered from a typed
:class:`~kvnotes_bench.serving.agent_traffic.AgentResult` (a stored ``result.json`` is read back
with ``AgentResult.from_dict``, so it can be reported again)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.formats import fmt_ms, fmt_pct
from kvnotes_bench.kit.plots import grouped_bars, panels
from kvnotes_bench.serving.agent_traffic import AgentResult
from kvnotes_bench.serving.agent_traffic_overhead import OVERHEAD_GOAL
from kvnotes_bench.serving.agent_traffic_protocol import CHOICE_GOAL, SHARE_GOAL
from kvnotes_bench.serving.agent_traffic_soak import GAP_TAU

SET_NAMES = {"tools": "BFCL live_multiple (tools=)", "documents": "airline documents (content "
             "parts)"}


def _loads(load: list[float] | None) -> str:
    return "-" if not load else "/".join(f"{x:.1f}" for x in load)


def _goal(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "NOT met")


def _counted(result: AgentResult) -> bool:
    """Whether learning was read from the front's learner counters (runs before that waited
    for a probe to splice, and recorded no counts)."""
    return any(r.learn for records in result.cases.values() for r in records)


def _settings(result: AgentResult) -> str:
    """The learning wait, the front's repair and guard, the block size and the repair
    variants."""
    p = result.config.protocol
    block = (result.launches.get("main") or {}).get("block_size") or "vLLM's default"
    tau = result.guard_tau
    guard = ("" if tau is None else f"; its guard: tau {tau:g} (--guard {result.config.guard})"
             if tau else f"; its guard: off (--guard {result.config.guard})")
    return (" (until the front's learner compiled the case's new chunks). The front's repair: "
            f"{result.config.repair or 'its default'}{guard}; KV block size {block}"
            + (f"; also measured with `kvnotes.repair` K = {', '.join(str(k) for k in p.repairs)}"
               " (no share floor)" if p.repairs else "") + ".")


def markdown(result: Mapping[str, Any]) -> str:
    """The report of a result's JSON form (``AgentResult.to_dict()`` or a stored file)."""
    return report(AgentResult.from_dict(result))


def report(result: AgentResult) -> str:
    """The markdown report of one run."""
    cfg, m = result.config, result.machine
    p = cfg.protocol
    lines = [f"# serve-bench agent ({cfg.model})", "",
             f"Run {result.started or '?'} to {result.finished or '?'} UTC"
             + (f": `{result.command}`" if result.command else "") + ".",
             f"Machine: {m.cpus} CPUs ({m.cpu_model or '?'}); threads {result.threads or '?'}; "
             f"load average (1/5/15 min) at start {_loads(m.load_average)}, at end "
             f"{_loads(m.load_average_end)}.",
             f"Learning {'on' if cfg.learn else 'OFF'}; a chunk learned once seen {p.sightings} "
             f"times; measured answers greedy, {p.max_tokens} tokens; learning waited for at "
             f"most {p.learn_timeout_s:.0f} s per case"
             + (_settings(result) if _counted(result) else "."), ""]
    summaries = result.summaries()
    if summaries:
        lines += [f"Goals: share of prompt tokens spliced >= {SHARE_GOAL:.0%}, tool choice "
                  f"identical to `splice: false` >= {CHOICE_GOAL:.0%}.", "",
                  "| set |" + (" repair |" if p.repairs else "") + " cases | measured | "
                  "learned | share spliced (mean / pooled / cases >= goal) | tool choice "
                  f"identical | first token identical | {p.max_tokens} tokens identical | "
                  "choice correct spliced / exact | goals |",
                  "|---|" + ("---|" if p.repairs else "") + "---:|---:|---:|---|---:|---:|---:|"
                  "---|---|"]
        for s in summaries:
            lines.append(
                f"| {SET_NAMES.get(s.kind, s.kind)} |" + (f" {s.repair} |" if p.repairs else "")
                + f" {s.cases} | {s.measured} | {s.learned} | "
                f"{fmt_pct(s.share_mean)} / {fmt_pct(s.share_pooled)} / "
                f"{fmt_pct(s.share_at_goal)} | {fmt_pct(s.choice_identical)} | "
                f"{fmt_pct(s.first_token_identical)} | {fmt_pct(s.answer_identical)} | "
                f"{fmt_pct(s.choice_correct_spliced)} / {fmt_pct(s.choice_correct_exact)} | "
                f"share {_goal(s.share_goal_met)}"
                + (f", choice {_goal(s.choice_goal_met)}" if s.kind == "tools" else "") + " |")
    pooled = [s for s in summaries if s.breakdown is not None]
    if pooled:
        lines += ["", "Where the measured requests' prompt tokens went (pooled over the set): "
                  "spliced; recomputed by the repair rule (each matched chunk's first max(K, "
                  "share x len)); recomputed to reach a KV block boundary; in chunks no learned "
                  "entry matched; text that is never a chunk (template, system turn, question; "
                  "the header before the first chunk in brackets).", "",
                  "| set | repair | spliced | repaired | block alignment | chunks unmatched | "
                  "text (header) | chunks / matched / spliced per request |",
                  "|---|---|---:|---:|---:|---:|---|---|"]
        for s in pooled:
            b = s.breakdown
            assert b is not None
            sh = b.shares
            lines.append(
                f"| {SET_NAMES.get(s.kind, s.kind)} | {s.repair} | {fmt_pct(sh['spliced'])} | "
                f"{fmt_pct(sh['repaired'])} | {fmt_pct(sh['aligned'])} | "
                f"{fmt_pct(sh['unmatched'])} | {fmt_pct(sh['text'])} "
                f"({fmt_pct(sh['text_head'])}) | {b.chunks_mean:.1f} / {b.matched_mean:.1f} / "
                f"{b.spliced_chunks_mean:.1f} |")
    if result.timings:
        lines += ["", f"TTFT (streamed, medians; goal: at most {OVERHEAD_GOAL:.0%} over the "
                  "reference). Timings are valid only on an otherwise idle machine.", "",
                  "| timing | measured | reference | overhead | pairs | failed | load before / "
                  "after | goal |", "|---|---:|---:|---:|---:|---:|---|---|"]
        what = {"miss": "first sight vs splice:false",
                "compile": "beside a background compile vs without"}
        for t in result.timings:
            ov = t.overhead
            lines.append(f"| {what.get(t.name, t.name)} | {fmt_ms(t.median_measured_s)} | "
                         f"{fmt_ms(t.median_reference_s)} | {fmt_pct(ov)} | "
                         f"{len(t.measured)} | {t.failed} | {_loads(t.load_before)} / "
                         f"{_loads(t.load_after)} | "
                         f"{_goal(None if ov is None else ov <= OVERHEAD_GOAL)} |")
    soak = result.soak_summary()
    if soak is not None:
        info = result.soak
        ev = info.get("evictions")
        lines += ["", f"Soak: {cfg.soak.clients} clients, {soak.requests} requests of "
                  f"{cfg.soak.tools_min}-{cfg.soak.tools_max} tools from a pool of "
                  f"{info.get('pool_tools', '?')}, {cfg.soak.exact_fraction:.0%} with `splice: "
                  f"false`; library cap {info.get('library_cap_bytes', '?')} bytes, "
                  f"{info.get('library_bytes_published', '?')} bytes published in "
                  f"{info.get('entries_published', '?')} entries; {info.get('wall_s', '?')} s.", "",
                  "| served | failed | checked | wrong | near tie | unchecked | hit rate | "
                  "share spliced | evictions | matched |", "|---:|---:|---:|---:|---:|---:|---:|"
                  "---:|---:|---|",
                  f"| {soak.served} | {soak.failed} | {soak.checked} | {soak.wrong} | "
                  f"{soak.near_tie} | {soak.unchecked} | {fmt_pct(soak.hit_rate)} "
                  f"({soak.spliced}/{soak.eligible}) | {fmt_pct(soak.share_pooled)} | "
                  f"{'-' if ev is None else f'{ev:.0f}'} | "
                  + ", ".join(f"{k} {v}" for k, v in sorted(soak.matched.items())) + " |"]
        tau = cfg.soak.drift_tau
        if tau is not None:
            lines.append(
                f"\nDrift rule: answers compared up to the first step where the server's or the "
                f"engine's top-2 margin is below {tau:g}; {soak.cut} ok answers were cut short"
                + (" (compared steps: " + ", ".join(f"{k}: {v}" for k, v in soak.cut_at.items())
                   + ")" if soak.cut_at else "") + ".")
        if soak.gap_max is not None:
            lines.append(f"\nServer and engine top-2 margins over the matched steps: largest gap "
                         f"{soak.gap_max:.2g}; {soak.gapped} ok answers with a gap over "
                         f"{GAP_TAU:g} (equal tokens, not the reference's very computation).")
        if info.get("references") is not None:
            lines.append(f"\nEngine references computed: {info['references']} (one per checked "
                         "answer: the computation its connector reports describe).")
        if info.get("records"):
            # a run before the wire contract (no reference count) recorded the plan alone
            recorded = "usage.kvnotes" if info.get("references") is not None else "plan"
            lines.append(f"Every request, its prompt ids, {recorded}, answer and verdict: "
                         f"`{info['records']}`.")
        if soak.errors:
            lines.append("\nFailures: " + ", ".join(f"{k} {v}" for k, v in soak.errors.items()))
    if result.skipped:
        lines += ["", f"Left out: {len(result.skipped)} cases ("
                  + ", ".join(f"{x['id']}: {x['why']}" for x in result.skipped[:5])
                  + (", ..." if len(result.skipped) > 5 else "") + ")."]
    if result.notes:
        lines += ["", "Notes:", *(f"- {n}" for n in result.notes)]
    return "\n".join(lines) + "\n"


def plot(result: AgentResult, path: Path) -> None:
    """Left: per set, the share spliced and the identity rates; right: the TTFT medians of each
    timing's arms."""
    title = f"serve-bench agent ({result.config.model})"
    with panels(path, 2, size=(11, 4), title=title) as (ax, bx):
        metrics = ("share_mean", "choice_identical", "first_token_identical", "answer_identical")
        labels = ("share spliced", "tool choice =", "first token =", "16 tokens =")
        summaries = result.summaries()
        grouped_bars(ax, labels, {
            SET_NAMES.get(s.kind, s.kind) + ("" if s.repair == "front" else f", repair {s.repair}"):
            [getattr(s, k) or 0.0 for k in metrics] for s in summaries})
        ax.axhline(SHARE_GOAL, color="gray", ls=":", lw=1)
        ax.axhline(CHOICE_GOAL, color="gray", ls="--", lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_title("spliced vs splice:false (reordered chunks)")
        if summaries:
            ax.legend(fontsize=8)
        names = [t.name for t in result.timings]
        ms = [1000 * (t.median_measured_s or 0.0) for t in result.timings]
        ref = [1000 * (t.median_reference_s or 0.0) for t in result.timings]
        grouped_bars(bx, names, {"measured": ms, "reference": ref})
        bx.set_ylabel("median TTFT (ms)")
        bx.set_title("miss: first sight / splice:false; compile: beside / without")
        if names:
            bx.legend(fontsize=8)


def write_outputs(data: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """``result.json``, ``report.md`` and ``agent.png`` in ``out``."""
    result = AgentResult.from_dict(data)
    return write_bundle(out, dict(data), report=report(result), json_name="result.json",
                        plot_name="agent.png", plot=lambda path: plot(result, path))
