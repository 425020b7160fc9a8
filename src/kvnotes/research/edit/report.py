"""Writing a run: the markdown tables, ``report.md``, the chart, and the bundle on disk."""

from __future__ import annotations

from pathlib import Path

from kvnotes.eval.reports import write_bundle
from kvnotes.research.edit.results import MIN_FIELD_EFFECT, PerStrategy, SuiteResult

CHART = "edit.png"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def strategy_table(per_strategy: PerStrategy) -> list[str]:
    """Markdown table rows for a per-strategy aggregate."""
    lines = ["| strategy | identity | flips | recovery (sensitive) | logit cos (mean) "
             "| KL (median) | top-1 | normalized effect (median, n) | intended (new) "
             "| compute frac | selection frac | TTFT ratio (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, a in per_strategy.items():
        rec = f"{a.recovery:.3f} ({a.n_sensitive})" if a.recovery is not None else "– (0)"
        eff = (f"{a.effect_median:.2f} ({a.n_field_moved})" if a.effect_median is not None
               else "– (0)")
        lines.append(f"| {s} | {a.identity:.3f} | {a.flips}/{a.n} | {rec} | "
                     f"{a.cosine_mean:.4f} | {a.kl_median:.4f} | {a.top1_agree:.3f} | "
                     f"{eff} | {_fmt(a.intended_new)} | {a.compute_fraction:.3f} | "
                     f"{a.select_fraction:.3f} | {a.ttft_ratio_median:.3f} |")
    return lines


def family_table(result: SuiteResult) -> list[str]:
    """Markdown: recovery on sensitive cases (and sensitive count) per family and strategy."""
    strategies = result.strategies
    lines = ["| family | sensitive | " + " | ".join(strategies) + " |",
             "|---|---|" + "---|" * len(strategies)]
    for fam, agg in result.per_family.items():
        first = next(iter(agg.values()))
        cells = []
        for s in strategies:
            a = agg.get(s)
            cells.append("–" if a is None or a.recovery is None
                         else f"{a.recovery:.2f} / {a.identity:.2f}")
        lines.append(f"| {fam} | {first.n_sensitive}/{first.n} | " + " | ".join(cells) + " |")
    return lines


def write_outputs(result: SuiteResult, out: str | Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and ``edit.png`` in ``out`` (keys json, report, plot)."""
    return write_bundle(out, result.to_dict(), report=report_markdown(result),
                        json_name="results.json", plot_name=CHART,
                        plot=lambda path: plot(result, path))


def report_markdown(result: SuiteResult) -> str:
    """The markdown report of a :func:`~kvnotes.research.edit.suite.run_suite` result."""
    expected = result.recompute_matches_expected
    n = result.n_cases
    lines = [
        f"# Edit evaluation: {result.model}",
        "",
        *([f"**Partial: {n} of {result.n_planned} cases done.**", ""]
          if result.n_planned != n else []),
        *([f"{result.n_resumed} of the {n} cases were taken from an earlier run with the "
           "same settings (`--resume`, `--resume-from`); the wall time below is this run's "
           "alone.", ""]
          if result.n_resumed else []),
        *([f"{result.workers} worker processes ran the cases side by side (`--workers`), "
           "so the TTFT ratios and timings are not quiet-machine figures.", ""]
          if result.workers > 1 else []),
        f"{n} cases, {result.n_sensitive} sensitive (recompute decides differently for the old "
        f"and the new value). Recompute(old) matches the task author's intended answer in "
        f"{expected.old}/{n} cases, recompute(new) in {expected.new}/{n}.",
        "",
        ("Decisions: chain of thought, greedy up to "
         f"{result.budget} tokens, answer parsed from the text; cosine/KL at the first "
         "generated token." if result.cot else
         "Decisions: no chain of thought; the answer whose first token has the highest logit at "
         "the decision position (after the question). Cosine and KL compare the full next-token "
         "logits there with recompute of the new value."),
        "",
        "Identity: decision equal to recompute(new), over all cases. Recovery: the same over "
        "sensitive cases only (count in brackets). Compute fraction: tokens computed (recomputed "
        "+ appended) / tokens a full recompute computes. Selection fraction: token-equivalent "
        "work to choose repair tokens (kv_deviation: an early-layer pass; attention: an "
        "instrumented pass standing in for statistics recorded at prefill). TTFT ratio: (edit + "
        "question forward) / (recompute + question forward), wall clock on this machine. "
        "Normalized effect: with m the first-token logit margin of recompute(new)'s answer over "
        "the best other answer, (m_strategy - m_old) / (m_new - m_old), median over the cases "
        f"where the field moves m by at least {MIN_FIELD_EFFECT:g} logit (count in brackets); "
        "1 = as far as recompute, 0 = still the old value. Intended (new): decision equal to "
        "the answer the task author intends for the new value (the model's competence, not "
        "fidelity to recompute).",
        "",
        "## Per strategy",
        "",
        *strategy_table(result.per_strategy),
        "",
        "## Per family (recovery on sensitive / identity on all)",
        "",
        *family_table(result),
        "",
        f"![edit strategies]({CHART})",
        "",
        f"Wall time: {result.seconds:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def plot(result: SuiteResult, path: Path) -> None:
    """Bar chart: recovery on sensitive cases and compute fraction per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result.per_strategy
    names = list(agg)
    recovery = [0.0 if (r := agg[s].recovery) is None else r for s in names]
    identity = [agg[s].identity for s in names]
    compute = [agg[s].compute_fraction for s in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2))
    x = range(len(names))
    w = 0.28
    ax.bar([i - w for i in x], recovery, w,
           label=f"recovery (sensitive, n={result.n_sensitive})")
    ax.bar(list(x), identity, w, label="identity (all cases)")
    ax.bar([i + w for i in x], compute, w, label="compute fraction")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"edit strategies vs recompute: {result.model}"
                 + (" (CoT)" if result.cot else ""))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

