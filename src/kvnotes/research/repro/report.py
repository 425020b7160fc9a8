"""The ``kvnotes repro`` report: a table per claim (the paper's figure, ours per model, the
verdict), the load each stage ran under, details per model and one chart."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.records import Json, adapter
from kvnotes.eval.reports import write_bundle
from kvnotes.research.edit.report import strategy_table
from kvnotes.research.repro.claims import (
    TOOLS_CLAIM,
    Claim,
    Claims,
    StageResults,
    Verdict,
    judge,
    load_claims,
)
from kvnotes.research.repro.run import ReproRun, Sizes, StageRecord
from kvnotes.research.tool_runs import stored_runs

PerModel = dict[str, dict[str, StageRecord]]

# where a source checkout keeps the `kvnotes-bench tools` results the tool claim reads
TOOLS_RESULTS = Path(__file__).resolve().parents[4] / "docs" / "results" / "tools"


@dataclass(frozen=True, slots=True)
class ClaimVerdicts:
    """One claim and, per model, our figure and the verdict."""

    claim: Claim
    models: dict[str, Verdict]

    def to_dict(self) -> Json:
        return {**self.claim.to_dict(), "models": {m: v.to_dict() for m, v in self.models.items()}}


def _json(sizes: Sizes) -> Json:
    """The sizes as a stage file records them (lists, not tuples)."""
    out: Json = adapter(Sizes).dump_python(sizes, mode="json")
    return out


def stage_results(stages: dict[str, StageRecord], model: str | None = None,
                  tools_results: Path | None = None) -> StageResults:
    """One model's records as the typed results the verdicts read, with ``model``'s stored
    `kvnotes-bench tools` runs under ``tools_results`` when both are given."""
    tools = tuple(stored_runs(tools_results, model)) if model and tools_results else ()
    results: dict[str, Any] = {stage: record.result for stage, record in stages.items()}
    return StageResults(**results, tools=tools)


def verdicts(per_model: PerModel, claims: Claims | None = None,
             tools_results: Path | None = TOOLS_RESULTS) -> list[ClaimVerdicts]:
    """One entry per claim: the paper's figure (then kvnotes' tool claim, read from the stored
    results under ``tools_results``) and, per model, ours and the verdict."""
    claims = claims or load_claims()
    results = {model: stage_results(stages, model, tools_results)
               for model, stages in per_model.items()}
    return [ClaimVerdicts(claim, {
        model: judge(claim, results[model], busy=any(r.busy for r in stages.values()))
        for model, stages in per_model.items()}) for claim in (*claims.claims, TOOLS_CLAIM)]


def report_markdown(run: ReproRun, table: list[ClaimVerdicts], claims: Claims,
                    command: str = "") -> str:
    src, settings, per_model = claims.source, run.settings, run.models
    md = ["# kvnotes repro: the paper's claims beside our measurements", "",
          f"Paper: *{src.title}* ({src.url}); figures from its {src.where}, kept in "
          "`src/kvnotes/apps/data/paper_claims.json`. Ours are measured by this run.", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"Device `{settings.device}`, dtype `{settings.dtype}`, {settings.size_label} "
           "sizes: " + ", ".join(f"{k}={v}" for k, v in _json(settings.sizes).items()), ""]
    choice = settings.choice
    md += [f"Task families of the edit, CoT and trace stages: "
           f"{', '.join(choice.families) if choice.families else 'every family'}; seeded "
           f"families on their **{choice.split}** seeds.", ""]
    md += ["| model | stage | finished | seconds | load average (1 min) before/after | "
           "CPUs (SIMD) | torch threads |", "|---|---|---|---|---|---|---|"]
    for model, stages in per_model.items():
        for stage, r in stages.items():
            b, a = r.load_before, r.load_after
            threads = "-" if b.torch_threads is None else b.torch_threads
            md.append(f"| {model} | {stage} | {r.finished or '-'} | {r.seconds:.0f} | "
                      f"{b.load_1min:.2f} / {a.load_1min:.2f}{' (busy)' if r.busy else ''} | "
                      f"{b.cpus} ({b.cpu_flags or '-'}) | {threads} |")
    total = sum(r.seconds for stages in per_model.values() for r in stages.values())
    busy = any(r.busy for stages in per_model.values() for r in stages.values())
    md += ["", f"All stages together: **{total / 60:.1f} min**"
           + (" (some stages ran while the machine was busy: an upper bound on a quiet run)"
              if busy else "") + "."]
    md += ["", "Verdicts: **holds**, **does not hold**, **inconclusive** (the CI spans the "
           "paper's figure), **not measurable** (the field does not move the decision on this "
           "model, so a normalized effect or a recovery rate has no denominator), **not run**. "
           "Timing verdicts measured while the machine was busy say so.", ""]
    md += verdict_matrix(table, list(per_model))
    for row in table:
        claim = row.claim
        md += [f"## {claim.title}", "",
               f"{'Claim' if claim.project else 'Paper'} ({claim.source}; {claim.scale}): "
               f"{claim.paper}.", "",
               f"Check: {claim.check}.", "",
               "| model | ours | verdict | why |", "|---|---|---|---|"]
        for model, v in row.models.items():
            md.append(f"| {model} | {v.ours} | **{v.verdict}** | {v.why} |")
        md.append("")
    md += _details(per_model)
    md += ["![repro](repro.png)", "", "Share of the decision carried by the field's own KV and "
           "by the notes, per family (denoising effects over the sensitive cases, 95% bootstrap "
           "CIs):", "", "![trace shares](trace-shares.png)", ""]
    return "\n".join(md)


def verdict_matrix(table: list[ClaimVerdicts], models: list[str]) -> list[str]:
    """One row per claim, one column per model: the verdict and the number behind it."""
    md = ["## Verdicts at a glance", "", "| claim | " + " | ".join(models) + " |",
          "|---|" + "---|" * len(models)]
    for row in table:
        cells = []
        for m in models:
            v = row.models[m]
            cells.append(f"**{v.verdict}**" + (f": {v.why}" if v.why else ""))
        md.append(f"| {row.claim.title} | " + " | ".join(cells) + " |")
    return md + [""]


def _details(per_model: PerModel) -> list[str]:
    md = ["## Details per model", ""]
    for model, stages in per_model.items():
        md += [f"### {model}", ""]
        results = stage_results(stages)
        if results.compose is not None:
            md += ["Composition (demo skills and contexts):", "",
                   "| case | tokens | reused | cosine | KL | top-1 | margin | speedup |",
                   "|---|---|---|---|---|---|---|---|"]
            for c in results.compose.cases:
                f = c.fidelity
                md.append(f"| {c.case} | {f.tokens_total} | {f.tokens_reused} | "
                          f"{f.logit_cosine:.4f} | {f.kl:.4f} | "
                          f"{'same' if f.top1_agree else 'DIFF'} | {f.top2_margin:.2f} | "
                          f"{f.speedup:.1f}x |")
            md.append("")
        for edit, label in ((results.edit, "without CoT"), (results.edit_cot, "with CoT")):
            if edit is not None:
                md += [f"Edit suite {label}: {edit.n_cases} cases, {edit.n_sensitive} sensitive.",
                       "", *strategy_table(edit.per_strategy), ""]
        if results.trace is not None:
            md += ["Causal trace (denoising effects, mean [95% CI] over sensitive cases):", "",
                   "| family | cases | sensitive | insensitive | skipped | median abs(d) | "
                   "field KV | notes |", "|---|---|---|---|---|---|---|---|"]
            for row in results.trace.families:
                md.append(f"| {row.family} | {row.n_cases} | {row.n_sensitive} | "
                          f"{row.n_insensitive} | "
                          f"{row.n_skipped_length + row.n_skipped_other} | "
                          f"{_num(row.median_abs_denominator)} | {row.field} | {row.notes} |")
            md.append("")
        if results.agent is not None:
            a = results.agent
            md += [f"Agent: {a.episodes} episodes x {a.turns_per_episode} turns, identity "
                   f"{a.identity:.1%}, latency ratio {a.latency.ratio:.2f}x, tokens "
                   f"computed {a.tokens.kvnotes_computed} vs {a.tokens.recompute_computed}.", ""]
    return md


def _num(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.2f}"


def plot(per_model: PerModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    models = list(per_model)
    for i, model in enumerate(models):
        st = stage_results(per_model[model])
        if st.compose is not None:
            cos = [c.fidelity.logit_cosine for c in st.compose.cases]
            axes[0].scatter([i] * len(cos), cos, label=model)
        row = st.trace.overall() if st.trace is not None else None
        if row:
            for j, (name, e) in enumerate((("field", row.field), ("notes", row.notes))):
                if e.n:
                    axes[1].errorbar(i + 0.2 * j, e.mean, yerr=[[e.mean - e.lo], [e.hi - e.mean]],
                                     fmt="o", color=f"C{j}", label=name if i == 0 else None)
        for j, edit in enumerate((st.edit, st.edit_cot)):
            per = edit.per_strategy if edit is not None else {}
            names = [s for s in ("overwrite", "erratum", "prefix") if s in per]
            vals = [per[s].recovery if per[s].recovery is not None else 0 for s in names]
            xs = [i + 0.12 * k + 0.4 * j for k in range(len(names))]
            axes[2].bar(xs, vals, width=0.1, color=[f"C{k}" for k in range(len(names))],
                        hatch="//" if j else None)
    axes[0].axhline(0.90, color="gray", ls="--", lw=0.8)
    axes[0].set_title("composition: logit cosine per case (paper >= 0.90)", fontsize=9)
    axes[1].axhline(0.01, color="gray", ls="--", lw=0.8)
    axes[1].set_title("trace, sensitive cases of every family: field KV vs notes\n"
                      "(paper, decisions: field < 0.01; decision families: see report)",
                      fontsize=9)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=7)
    axes[2].set_title("edit recovery, sensitive cases of every family:\n"
                      "overwrite / erratum / prefix, plain | CoT (hatched)", fontsize=9)
    for ax in axes:
        ax.set_xticks(range(len(models)), models, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_trace_shares(per_model: PerModel, path: Path) -> None:
    """Per family and model, the field KV's and the notes' denoising effect with 95% CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(per_model)
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.5 * max(1, len(models)), 3.8),
                             squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        trace = stage_results(per_model[model]).trace
        rows = [r for r in (trace.families if trace else ()) if r.family != "all"]
        for i, row in enumerate(rows):
            for j, (name, e) in enumerate((("field KV", row.field), ("notes", row.notes))):
                if e.n:
                    ax.errorbar(i + 0.2 * j - 0.1, e.mean,
                                yerr=[[e.mean - e.lo], [e.hi - e.mean]], fmt="o", color=f"C{j}",
                                capsize=3, label=name if i == 0 else None)
        ax.axhline(0.01, color="gray", ls="--", lw=0.8)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlim(-0.6, max(1, len(rows)) - 0.4)
        ax.set_xticks(range(len(rows)), [f"{r.family}\n({r.n_sensitive}/{r.n_cases} sens.)"
                                         for r in rows], fontsize=7)
        ax.set_ylabel("share of the decision (denoising)")
        ax.set_title(f"{model}: field KV vs notes (paper: field < 0.01, dashed)", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: str | Path, run: ReproRun, *, command: str = "",
                 tools_results: Path | None = TOOLS_RESULTS) -> dict[str, Path]:
    """Judge every claim on every model and write report.md, repro.json and repro.png (the
    tool claim from the stored results under ``tools_results``)."""
    claims = load_claims()
    table = verdicts(run.models, claims, tools_results)
    md = report_markdown(run, table, claims, command)
    result = {"settings": run.settings.to_dict(), "claims_source": claims.source.to_dict(),
              "verdicts": [row.to_dict() for row in table],
              "models": {m: {s: r.to_dict() for s, r in stages.items()}
                         for m, stages in run.models.items()}}
    paths = write_bundle(out, result, report=md, json_name="repro.json", plot_name="repro.png",
                         plot=lambda p: plot(run.models, p))
    paths["trace_plot"] = Path(out) / "trace-shares.png"
    staged = paths["trace_plot"].with_name(".trace-shares.tmp.png")
    plot_trace_shares(run.models, staged)
    os.replace(staged, paths["trace_plot"])
    return paths
