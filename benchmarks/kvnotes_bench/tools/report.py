"""The tool benchmark's report: a markdown table per run and the identity-vs-compute chart."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvnotes.core.machine import load_note
from kvnotes.eval.reports import write_bundle
from kvnotes.research.tool_runs import BenchResult, StrategySummary
from kvnotes_bench.kit.plots import panels


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.0f}%)" if d else "-"


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_table(summaries: tuple[StrategySummary, ...]) -> list[str]:
    lines = ["| strategy | cases | choice identical to exact | right tool: exact / this | "
             "first token agrees | KL median | largest exact margin flipped | greedy identical | "
             "compute fraction | recompute of spliced | variants compiled / distinct skills | "
             "TTFT ratio (median) | guard fires (tau) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    calls = any(s.calls_checked for s in summaries)
    if calls:
        lines[0] += " BFCL AST valid: exact / this (parsed) |"
        lines[1] += "---:|"
    for s in summaries:
        guard = f"{s.guard_fires} ({_num(s.guard_tau, 2)})" if s.strategy.startswith("guard") \
            else "-"
        greedy = _pct(s.greedy_identical, s.greedy_cases) if s.greedy_cases else "-"
        library = f"{s.variants} / {s.distinct_skills}" if s.variants is not None else "-"
        lines.append(
            f"| {s.strategy} | {s.cases} | {_pct(s.identical, s.cases)} | "
            f"{s.exact_correct}/{s.cases} / {s.correct}/{s.cases} | "
            f"{_pct(s.first_token_agree, s.cases)} | {_num(s.kl_median, 4)} | "
            f"{_num(s.flip_margin_max, 2)} | {greedy} | {_num(s.compute_fraction)} | "
            f"{_num(s.recompute_share)} | {library} | {_num(s.ttft_ratio_median, 2)}x | "
            f"{guard} |" + (f" {_call_cell(s)} |" if calls else ""))
    return lines


def _call_cell(s: StrategySummary) -> str:
    if not s.calls_checked:
        return "-"
    return (f"{s.exact_calls_valid}/{s.calls_checked} / {s.calls_valid}/{s.calls_checked} "
            f"({s.calls_parsed})")


def _load_samples(machine: dict[str, object]) -> list[str]:
    samples = machine.get("load_samples")
    if not isinstance(samples, list) or not samples:
        return []
    ones = sorted(float(x["load_average"][0]) for x in samples)
    return [f"Load average (1 min) sampled {len(ones)} times during the run: "
            f"{ones[0]:.1f}-{ones[-1]:.1f}, median {ones[len(ones) // 2]:.1f}.", ""]


def _opening(settings: dict[str, object]) -> list[str]:
    opening = settings.get("skill_opening")
    if not isinstance(opening, str) or not opening:
        return []
    return [f"Skill opening: every skill's text starts with {json.dumps(opening)} after its "
            "newline, in the exact prompt and the composed one alike (the same token ids).", ""]


def render(result: BenchResult, command: str = "") -> str:
    settings = result.settings
    tokens = [c.tokens for c in result.cases]
    lines = [f"# Tool-choice fidelity: {result.model} on BFCL v4 `{result.set}`", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Date: {settings.get('date', '-')}. {load_note(result.machine)}. The machine was "
        "shared with other jobs: accuracy and identity are exact figures, timings are not.",
        "",
        *_load_samples(result.machine),
        *_opening(settings),
        f"Decision: {result.decision}. Cases: {len(result.cases)} run"
        + (f" ({min(tokens)}-{max(tokens)} tokens each)" if tokens else "")
        + f", {len(result.skipped)} skipped (do not fit the context limit of "
        f"{settings.get('context_limit')}).",
        "",
        "Guards without a fixed threshold are calibrated on the calibration half of the cases "
        "and reported on the evaluation half only (their row's case count); every other row "
        "covers all cases. Compute fraction: tokens run through the model (text parts, the "
        "call opening, repaired tokens, the KV-deviation pass, a fired guard's recompute) over "
        "all tokens of the prompt; recompute of spliced: the work on spliced tokens as a share "
        "of them. Variants compiled / distinct skills: the compiled skill variants the strategy "
        "spliced over these cases (its library: one per skill behind the header, one per "
        "(predecessor, skill) pair with `pred`) and the distinct skills among them. TTFT "
        "ratio: the exact prompt's time to the decision's logits over this strategy's "
        "(compiled skills are ready; compiling is not counted).",
        "",
        *summary_table(result.summaries),
        "",
    ]
    if result.taus:
        lines += ["Calibrated thresholds: " + ", ".join(f"`{k}` tau={v:.3f}"
                                                      for k, v in result.taus.items()), ""]
    flips = [(c.id, o) for c in result.cases for o in c.outcomes if not o.identical]
    if flips:
        lines += ["## Flipped decisions", "",
                  "| case | strategy | exact chose | this chose | this margin | right |",
                  "|---|---|---|---|---:|---|"]
        lines += [f"| {cid} | {o.strategy} | `{o.exact_choice}` | `{o.choice}` | "
                  f"{_num(o.margin, 2)} | {'yes' if o.correct else 'no'} |"
                  for cid, o in flips[:60]]
        lines.append("")
    if result.skipped:
        lines += ["## Skipped", ""] + [f"- {s.id}: {s.reason}" for s in result.skipped[:20]]
        lines.append("")
    return "\n".join(lines)


# the goal the chart marks: identity with the exact prompt at a recompute budget
GOAL_IDENTITY, GOAL_RECOMPUTE = 99.0, 0.15


def plot(result: BenchResult, path: Path) -> None:
    """Decision identity with the exact prompt against compute, one point per strategy and each
    guard's curve over its threshold: against the compute fraction of the whole prompt (left)
    and against the share of the spliced tokens recomputed, guard fires included (right, with
    the goal's corner)."""
    title = (f"{result.model}, BFCL v4 {result.set}: identity vs compute "
             f"(goal: >= {GOAL_IDENTITY:g}% at <= {GOAL_RECOMPUTE:.0%} recompute)")
    with panels(path, 2, size=(12, 4.5), title=title, title_size=9) as axes:
        for ax, x_of, label in (
                (axes[0], lambda s: s.compute_fraction,
                 "compute fraction (tokens run through the model / prompt tokens)"),
                (axes[1], lambda s: s.recompute_share,
                 "recompute of spliced tokens (repair + selection + guard fires)")):
            for i, s in enumerate(result.summaries):
                if not s.cases or (ax is axes[1] and s.strategy == "exact"):
                    continue
                y = 100 * s.identical / s.cases
                ax.scatter(x_of(s), y, zorder=3, color=f"C{i % 10}")  # one colour per strategy
                # staggered labels: strategies often share an identity level
                ax.annotate(f"{s.strategy} (n={s.cases})", (x_of(s), y), fontsize=7,
                            xytext=(4, 3 + 9 * (i % 3)), textcoords="offset points")
            for base in dict.fromkeys(p.base for p in result.guard_curve):
                pts = [p for p in result.guard_curve if p.base == base and p.cases]
                xs = [p.compute_fraction if ax is axes[0] else p.recompute_share for p in pts]
                ax.plot(xs, [100 * p.identical / p.cases for p in pts], lw=1, alpha=0.6,
                        label=f"guard on {base} (tau swept, all cases)")
            ax.set_xlabel(label, fontsize=8)
            ax.set_ylabel("tool choice identical to exact (%)")
            ax.grid(alpha=0.3)
            if result.guard_curve:
                ax.legend(fontsize=7, loc="lower right")
        axes[1].axhline(GOAL_IDENTITY, color="gray", ls="--", lw=0.8)
        axes[1].axvline(GOAL_RECOMPUTE, color="gray", ls="--", lw=0.8)
        axes[1].set_xlim(left=0, right=max(0.5, min(1.2, axes[1].get_xlim()[1])))


def write_outputs(result: BenchResult, out: str | Path, command: str = "") -> dict[str, Path]:
    return write_bundle(out, result.to_dict(), report=render(result, command),
                        json_name="results.json", plot_name="identity.png",
                        plot=lambda p: plot(result, p))
