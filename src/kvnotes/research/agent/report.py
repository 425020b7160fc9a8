"""agent-bench's report: ``report.md`` and the latency chart, drawn from a
:class:`~kvnotes.research.agent.summary.BenchSummary`."""

from __future__ import annotations

from pathlib import Path

from kvnotes.core.machine import read_machine
from kvnotes.core.records import Json
from kvnotes.research.agent.summary import BenchSettings, BenchSummary


def _machine_line(machine: Json | None) -> str:
    """``machine``: ``{"before": ..., "after": ...}``, each a ``machine_info`` record."""
    if not machine:
        return ""
    b, a = (read_machine(machine[k]) for k in ("before", "after"))
    # "after" is busy when other work took CPU time during the run (cpu_use); the load average
    # after a run counts the run's own threads, so it is only reported
    busy = " (busy: latency ratios are contaminated)" if b["busy"] or a["busy"] else ""
    use = a.get("cpu_use")
    other = (f"; other work took {100 * use['other_share']:.1f}% of the CPUs during the run "
             f"(steal {100 * use['steal_share']:.1f}%)" if use else "")
    return (f" {b['torch_threads']} torch threads; load average {b['load_average'][0]} before, "
            f"{a['load_average'][0]} after{other}{busy}.")


def _settings_line(settings: BenchSettings | None) -> str:
    if settings is None:
        return ""
    eps = settings.episodes
    shown = f"{eps[0]}..{eps[-1]}" if len(eps) > 1 else (eps[0] if eps else "none")
    agent = ", ".join(f"{k} {getattr(settings, k)}" for k in ("order", "history", "variants",
                                                               "guard", "repair", "carry_record"))
    return f" Episodes {shown}; {agent}."


def plot_latency(result: BenchSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [p.turn + 1 for p in result.per_turn]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(turns, [p.recompute_latency_s for p in result.per_turn], "o-",
            label="recompute agent")
    ax.plot(turns, [p.kvnotes_latency_s for p in result.per_turn], "s-",
            label="kvnotes agent (splice + valid-prefix reuse)")
    ax.set_xlabel("turn")
    ax.set_ylabel("mean latency per turn (s)")
    ax.set_yscale("log")
    ax.set_xticks(turns)
    ax.set_title(f"{result.model}: {result.episodes} episodes, "
                 f"ratio {result.latency.ratio:.1f}x")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_markdown(result: BenchSummary) -> str:
    """The markdown of ``report.md``."""
    lines = [
        f"# agent-bench: {result.model}", "",
        f"{result.episodes} scripted episodes x {result.turns_per_episode} turns = "
        f"{result.decisions} decisions (tool calls: {'on' if result.tool_calls else 'off'})."
        + _machine_line(result.machine) + _settings_line(result.settings),
        "", "## Summary", "",
        "| figure | value |", "| --- | --- |",
        *_summary_rows(result), *_guard_rows(result), *_compute_rows(result),
        *_agreement_rows(result),
        *_per_turn_table(result), *_guard_sweep_table(result),
        "", "![latency per turn](latency.png)", "",
        *_flips_section(result),
        "", "Latency: time from a request (with its pending state changes) to the decision"
        " (and tool call when on), measured per turn with both agents interleaved. Skill "
        "compilation happens once per model, before the episodes, and is not in any turn; "
        "each agent takes one untimed warm-up turn before the first episode.",
        "",
    ]
    return "\n".join(lines)


def _summary_rows(result: BenchSummary) -> list[str]:
    """The summary table's rows every run has: identity, latency, tokens, margin, skills."""
    lat, tok = result.latency, result.tokens
    return [
        f"| decision identity with recompute | {result.identity:.1%} "
        f"({result.decisions - result.flip_count}/{result.decisions}) |",
        f"| flips | {result.flip_count} |",
        f"| total latency, recompute agent | {lat.recompute_total_s:.2f} s |",
        f"| total latency, kvnotes agent | {lat.kvnotes_total_s:.2f} s |",
        f"| latency ratio (recompute / kvnotes) | {lat.ratio:.2f}x |",
        f"| tokens computed, recompute agent | {tok.recompute_computed} |",
        f"| tokens computed, kvnotes agent | {tok.kvnotes_computed} "
        f"(reused {tok.kvnotes_reused}) |",
        f"| median decision margin, recompute (log-prob) | "
        f"{result.recompute_margin_median:.3f} |",
        f"| skills compiled this run / library hits | {result.skills.compiled_now} / "
        f"{result.skills.library_hits} ({result.skills.prepare_s:.1f} s, "
        "not in any turn) |",
    ]


def _guard_rows(result: BenchSummary) -> list[str]:
    """The decision guard's summary rows (none when the guard was off)."""
    g = result.guard
    if g is None:
        return []
    return [
        f"| decision guard (tau = {g.tau}) fired | {g.fired} of {g.decisions} "
        f"({g.fired_rate:.1%}); changed the decision {g.changed} times |",
        f"| guard cost (in the kvnotes latency) | {g.tokens} tokens recomputed, "
        f"{g.seconds:.2f} s |",
        f"| decisions the fast (unguarded) choice would have flipped | "
        f"{g.would_flip_without} |",
    ]


def _compute_rows(result: BenchSummary) -> list[str]:
    """The arithmetic summary rows (none without FLOP counts)."""
    comp = result.compute
    if comp is None or not comp.kvnotes_flops:
        return []
    fast = (f" (fast path, without the guard's recomputes: {comp.fast_flop_ratio:.1f}x "
            f"FLOPs, {comp.fast_latency_ratio:.1f}x latency)" if comp.guard_flops else "")
    return [
        f"| arithmetic, recompute / kvnotes (the latency ratio a compute-bound machine "
        f"allows) | {comp.recompute_flops / 1e12:.1f} / {comp.kvnotes_flops / 1e12:.1f}"
        f" TFLOP: {comp.flop_ratio:.1f}x{fast} |",
        f"| latency ratio / FLOP ratio (how much of the arithmetic saving the latency "
        f"keeps) | {comp.kept:.2f} |",
    ]


def _agreement_rows(result: BenchSummary) -> list[str]:
    """The summary rows measured only on some runs, of how close the kvnotes agent stays to
    recompute: the fast decision's margin error, identity after state changes (with the stale
    ablation) and tool-call validity."""
    lines: list[str] = []
    err = result.fast_margin_error
    if err is not None:
        lines.append(f"| fast decision's margin error vs recompute (log-prob): median / p90 / max"
                     f" | {err.median:.3f} / {err.p90:.3f} / {err.max:.3f} "
                     f"({err.under_0_001} decisions on exact notes) |")
    s = result.stale
    if s is not None:
        lines += [
            f"| identity after a state change: kvnotes (record rewritten) | "
            f"{s.kvnotes_identity_after_state_change:.1%} of "
            f"{s.decisions_after_state_change} |",
            f"| identity after a state change: stale record (changes ignored, ablation) | "
            f"{s.identity_after_state_change:.1%} |",
        ]
    t = result.tool_call_stats
    if t is not None:
        lines.append(f"| tool calls: valid kvnotes / recompute / identical raw, of "
                     f"{t.turns_with_a_call} | {t.kvnotes_valid} / {t.recompute_valid}"
                     f" / {t.identical_raw} |")
    return lines


def _per_turn_table(result: BenchSummary) -> list[str]:
    """The "Per turn" section: one row per turn index over every episode."""
    lines = ["", "## Per turn", "",
             "| turn | n | identity | recompute s | kvnotes s | ratio | FLOP ratio | "
             "recompute tokens | kvnotes tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result.per_turn:
        flop = p.flop_ratio
        lines.append(f"| {p.turn + 1} | {p.n} | {p.identity:.1%} | "
                     f"{p.recompute_latency_s:.3f} | {p.kvnotes_latency_s:.3f} | "
                     f"{p.ratio:.1f}x | {'-' if flop != flop else f'{flop:.1f}x'} | "
                     f"{p.recompute_tokens_computed:.0f} | "
                     f"{p.kvnotes_tokens_computed:.0f} |")
    return lines


def _guard_sweep_table(result: BenchSummary) -> list[str]:
    """The lower guard thresholds section (none without a sweep)."""
    if not result.guard_sweep:
        return []
    lines = ["", "## Lower guard thresholds, read off this run", "",
             "An estimate, not a run: a fire whose fast margin is at or above tau is dropped"
             " with its time and FLOPs; after it the notes would have stayed inexact, so "
             "later turns could differ.", "",
             "| tau | fired | flips it would miss | latency ratio | FLOP ratio |",
             "| --- | --- | --- | --- | --- |"]
    for row in result.guard_sweep:
        lines.append(f"| {row.tau} | {row.fired} | {row.missed_flips} | "
                     f"{row.latency_ratio:.1f}x | {row.flop_ratio:.1f}x |")
    return lines


def _flips_section(result: BenchSummary) -> list[str]:
    """The "Flips" section: every decision that differs from the recompute agent's."""
    lines = ["## Flips", ""]
    if not result.flips:
        lines.append("None: every decision matched the recompute agent.")
        return lines
    lines += ["| episode | turn | request | kvnotes | recompute | recompute margin | "
              "state changes so far |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in result.flips:
        events = ", ".join(f"{a}={b}" for a, b in f.events_so_far) or "none"
        lines.append(f"| {f.episode} | {f.turn + 1} | {f.kind} | {f.kvnotes} | "
                     f"{f.recompute} | {f.recompute_margin:.3f} | {events} |")
    return lines
