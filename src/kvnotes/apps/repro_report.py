"""The ``kvnotes repro`` report: a table per claim (the paper's figure, ours per model, the
verdict), the load each stage ran under, details per model and one chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvnotes.apps.claims import ci_text, judge, load_claims, trace_overall
from kvnotes.eval.reports import write_bundle

# ---------------------------------------------------------------------------------------------
# the report


def verdicts(per_model: dict[str, dict[str, Any]],
             claims: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One entry per claim: the paper's figure and, per model, ours and the verdict."""
    claims = claims or load_claims()
    table = []
    for claim in claims["claims"]:
        rows = {}
        for model, stages in per_model.items():
            results = {s: r["result"] for s, r in stages.items()}
            busy = any(r["load_before"]["busy"] or r["load_after"]["busy"]
                       for r in stages.values())
            rows[model] = judge(claim, results, busy=busy)
        table.append({**claim, "models": rows})
    return table


def report_markdown(per_model: dict[str, dict[str, Any]], table: list[dict[str, Any]],
                    settings: dict[str, Any], claims: dict[str, Any], command: str = "") -> str:
    src = claims["source"]
    md = ["# kvnotes repro: the paper's claims beside our measurements", "",
          f"Paper: *{src['title']}* ({src['url']}); figures from its {src['where']}, kept in "
          "`src/kvnotes/apps/data/paper_claims.json`. Ours are measured by this run.", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"Device `{settings['device']}`, dtype `{settings['dtype']}`, "
           f"{'--quick sizes' if settings['quick'] else 'full sizes'}: "
           + ", ".join(f"{k}={v}" for k, v in settings["sizes"].items()), ""]
    md += ["| model | stage | seconds | load average (1 min) before/after | CPUs (SIMD) | "
           "torch threads |", "|---|---|---|---|---|---|"]
    for model, stages in per_model.items():
        for stage, r in stages.items():
            b, a = r["load_before"], r["load_after"]
            md.append(f"| {model} | {stage} | {r['seconds']:.0f} | {b['load_1min']:.2f} / "
                      f"{a['load_1min']:.2f}{' (busy)' if b['busy'] or a['busy'] else ''} | "
                      f"{b['cpus']} ({b.get('cpu_flags') or '-'}) | "
                      f"{b.get('torch_threads', '-')} |")
    total = sum(r["seconds"] for stages in per_model.values() for r in stages.values())
    busy = any(r["load_before"]["busy"] or r["load_after"]["busy"]
               for stages in per_model.values() for r in stages.values())
    md += ["", f"All stages together: **{total / 60:.1f} min**"
           + (" (some stages ran while the machine was busy: an upper bound on a quiet run)"
              if busy else "") + "."]
    md += ["", "Verdicts: **holds**, **does not hold**, **inconclusive** (the CI spans the "
           "paper's figure), **not measurable** (the field does not move the decision on this "
           "model, so a normalized effect or a recovery rate has no denominator), **not run**. "
           "Timing verdicts measured while the machine was busy say so.", ""]
    for claim in table:
        md += [f"## {claim['title']}", "",
               f"Paper ({claim['source']}; {claim['scale']}): {claim['paper']}.", "",
               f"Check: {claim['check']}.", "",
               "| model | ours | verdict | why |", "|---|---|---|---|"]
        for model, r in claim["models"].items():
            md.append(f"| {model} | {r['ours']} | **{r['verdict']}** | {r['why']} |")
        md.append("")
    md += _details(per_model)
    md += ["![repro](repro.png)", ""]
    return "\n".join(md)


def _details(per_model: dict[str, dict[str, Any]]) -> list[str]:
    from kvnotes.eval.edit_suite import strategy_table

    md = ["## Details per model", ""]
    for model, stages in per_model.items():
        md += [f"### {model}", ""]
        if "compose" in stages:
            md += ["Composition (demo skills and contexts):", "",
                   "| case | tokens | reused | cosine | KL | top-1 | margin | speedup |",
                   "|---|---|---|---|---|---|---|---|"]
            for c in stages["compose"]["result"]["cases"]:
                md.append(f"| {c['case']} | {c['tokens_total']} | {c['tokens_reused']} | "
                          f"{c['logit_cosine']:.4f} | {c['kl']:.4f} | "
                          f"{'same' if c['top1_agree'] else 'DIFF'} | {c['top2_margin']:.2f} | "
                          f"{c['speedup']:.1f}x |")
            md.append("")
        for stage, label in (("edit", "without CoT"), ("edit_cot", "with CoT")):
            if stage in stages:
                r = stages[stage]["result"]
                md += [f"Edit suite {label}: {r['n_cases']} cases, {r['n_sensitive']} sensitive.",
                       "", *strategy_table(r["per_strategy"]), ""]
        if "trace" in stages:
            md += ["Causal trace (denoising effects, mean [95% CI] over sensitive cases):", "",
                   "| family | cases | sensitive | insensitive | skipped | median abs(d) | "
                   "field KV | notes |", "|---|---|---|---|---|---|---|---|"]
            for row in stages["trace"]["result"]["families"]:
                md.append(f"| {row['family']} | {row['n_cases']} | {row['n_sensitive']} | "
                          f"{row['n_insensitive']} | "
                          f"{row['n_skipped_length'] + row['n_skipped_other']} | "
                          f"{_num(row['median_abs_denominator'])} | {ci_text(row['field'])} | "
                          f"{ci_text(row['notes'])} |")
            md.append("")
        if "agent" in stages:
            a = stages["agent"]["result"]
            md += [f"Agent: {a['episodes']} episodes x {a['turns_per_episode']} turns, identity "
                   f"{a['identity']:.1%}, latency ratio {a['latency']['ratio']:.2f}x, tokens "
                   f"computed {a['tokens']['kvnotes_computed']} vs "
                   f"{a['tokens']['recompute_computed']}.", ""]
    return md


def _num(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.2f}"


def plot(per_model: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    models = list(per_model)
    for i, model in enumerate(models):
        st = per_model[model]
        if "compose" in st:
            cos = [c["logit_cosine"] for c in st["compose"]["result"]["cases"]]
            axes[0].scatter([i] * len(cos), cos, label=model)
        row = trace_overall(st["trace"]["result"]) if "trace" in st else None
        if row:
            for j, key in enumerate(("field", "notes")):
                e = row[key]
                if e.get("n"):
                    axes[1].errorbar(i + 0.2 * j, e["mean"], yerr=[[e["mean"] - e["lo"]],
                                     [e["hi"] - e["mean"]]], fmt="o", color=f"C{j}",
                                     label=key if i == 0 else None)
        for j, stage in enumerate(("edit", "edit_cot")):
            per = st.get(stage, {}).get("result", {}).get("per_strategy", {})
            names = [s for s in ("overwrite", "erratum", "prefix") if s in per]
            vals = [per[s]["recovery"] if per[s]["recovery"] is not None else 0 for s in names]
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


def write_report(out: str | Path, per_model: dict[str, dict[str, Any]],
                 settings: dict[str, Any], *, command: str = "") -> dict[str, Path]:
    """Judge every claim on every model and write report.md, repro.json and repro.png."""
    claims = load_claims()
    table = verdicts(per_model, claims)
    md = report_markdown(per_model, table, settings, claims, command)
    result = {"settings": settings, "claims_source": claims["source"], "verdicts": table,
              "models": per_model}
    return write_bundle(out, result, report=md, json_name="repro.json", plot_name="repro.png",
                        plot=lambda p: plot(per_model, p))
