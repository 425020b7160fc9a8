"""``serve-bench fleet``'s report (markdown) and plot, rendered from a typed
:class:`~kvnotes_bench.serving.fleet.FleetResult` (a stored ``result.json`` is read back with
``FleetResult.from_dict``, so it can be reported again)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.formats import fmt_ms, fmt_pct
from kvnotes_bench.kit.plots import grouped_bars, panels
from kvnotes_bench.serving.fleet import FleetResult
from kvnotes_bench.serving.fleet_parts import ttft_overhead
from kvnotes_bench.serving.fleet_summary import goals, share_summary, soak_windows


def _met(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "NOT met")


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def _header(result: FleetResult) -> list[str]:
    m = result.machine
    load = "/".join(f"{x:.1f}" for x in m.load_average) or "-"
    end = "/".join(f"{x:.1f}" for x in m.load_average_end or []) or "-"
    redis = result.redis
    return [f"# serve-bench fleet ({result.config.model})", "",
            f"- run: {result.started} to {result.finished} UTC", f"- command: `{result.command}`",
            f"- machine: {m.cpus} CPUs, {m.cpu_model}; load {load} at start, {end} at end",
            f"- torch threads: {result.threads.get('torch', '-')}",
            f"- Redis: redis-server {redis.get('version', '-')} on port {redis.get('port', '-')}"
            f" (no persistence); hosts: {', '.join(sorted(result.launches)) or '-'}", ""]


def _goals(result: FleetResult) -> list[str]:
    lines = ["## Goals (a shared store)", "", "| goal | value | target | |", "|---|---|---|---|"]
    for name, g in goals(result).items():
        lines.append(f"| {name} | {_value(g['value'])} | {g['goal']} | {_met(g['met'])} |")
    return lines + [""]


def _share(result: FleetResult) -> list[str]:
    if not result.share:
        return []
    s = share_summary(result)
    lines = ["## share: learned through host a, first request on host b", "",
             f"{s['cases']} tool lists; learned {s['learned']}, on b before its request "
             f"{s['mirrored']}; share spliced on b mean {fmt_pct(s['share_mean'])}, min "
             f"{fmt_pct(s['share_min'])}; identical to splice: false {fmt_pct(s['identical'])}; "
             f"compiles {s['compiles']} (by host {s['compiles_by_host']}) for "
             f"{s['expected_compiles']} new chunks", "",
             "| case | tools | new chunks | compiles | on b after | share on b | identical |",
             "|---|---|---|---|---|---|---|"]
    for c in result.share:
        lines.append(f"| {c.id} | {c.tools} | {c.expected} | {c.compiles} | "
                     f"{c.mirror_wait_s:.1f} s{'' if c.mirrored else ' (not yet)'} | "
                     f"{fmt_pct(c.share)} | {c.identical} |")
    after = result.series.get("after_share") or {}
    if any(after.values()):
        lines += ["", "The fronts' store, fleet and mirror series after the part:", ""]
        lines += [f"- {host}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(values.items())
                                            if v) for host, values in after.items()
                  if any(values.values())]
    return lines + [""]


def _cost(result: FleetResult) -> list[str]:
    if not (result.ttft or result.fetch or result.miss):
        return []
    lines = ["## cost", ""]
    if result.ttft:
        lines += ["| concurrency | store | median p90 TTFT | 95% CI | rounds | failed | "
                  "share spliced |", "|---|---|---|---|---|---|---|"]
        for r in result.ttft:
            ci = r.median_p90_ci_s
            span = "-" if ci is None else f"{fmt_ms(ci[0])} - {fmt_ms(ci[1])}"
            lines.append(f"| {r.concurrency} | {r.store} | {fmt_ms(r.median_p90_s)} | {span} | "
                         f"{len(r.p90s)} | {r.failed} | {fmt_pct(r.share)} |")
        lines += [""] + [f"- c{c}: Redis over folder {fmt_pct(ttft_overhead(result.ttft, c))}"
                         for c in sorted({r.concurrency for r in result.ttft})] + [""]
    if result.fetch is not None:
        f = result.fetch
        lines.append(f"- fetch: {f.entries} entries, {f.bytes / 1e6:.1f} MB in {f.seconds:.3f} s"
                     f" from this process: {_value(f.s_per_mb)} s/MB; host b's mirror: "
                     f"{_value(f.mirror_s_per_mb)} s/MB"
                     + ("" if f.mirror else " (its front reports no mirror counters)"))
    if result.miss is not None:
        m = result.miss
        lines.append(f"- miss on host b: median TTFT {fmt_ms(m.median_measured_s)} against "
                     f"{fmt_ms(m.median_reference_s)} with splice: false "
                     f"({fmt_pct(m.overhead)} over, {m.failed} failed)")
    return lines + [""]


def _soak(result: FleetResult) -> list[str]:
    summary = result.soak_summary()
    if summary is None:
        return []
    lost = result.soak.get("published_lost") or {}
    lines = ["## soak: every host while Redis (and one host) fail", "",
             f"{summary.requests} requests in {result.soak.get('wall_s', '-')} s: "
             f"{summary.failed} failed, {summary.wrong} wrong, {summary.near_tie} near tie, "
             f"{summary.unchecked} unchecked; hit rate {fmt_pct(summary.hit_rate)}; "
             f"{result.soak.get('rerouted', 0)} sent again after their host was killed; "
             f"{lost.get('lost', '-')} of {lost.get('published', '-')} entries published after "
             f"the last destructive fault ({', '.join(lost.get('after') or []) or 'none'}) "
             "lost", "", "| fault | at | after requests | done |", "|---|---|---|---|"]
    for e in result.faults:
        done = f"yes{f': {e.detail}' if e.detail else ''}" if e.ok else f"no: {e.error}"
        lines.append(f"| {e.name} | {e.at:g} | {_value(e.at_request)} | {done} |")
    lines += ["", "Hit rate per window: over requests sent once one of their tools was seen twice "
              "(eligible), and over those sent once one of their tools was known compiled (an "
              "earlier answer spliced all of its request's tools: the goal's).", "",
              "| window | requests | failed | wrong | unchecked | eligible | hit rate | "
              "after a compile | hit rate after a compile |", "|---|---|---|---|---|---|---|---|---|"]
    for w in soak_windows(result):
        lines.append(f"| {w.label} | {w.requests} | {w.failed} | {w.wrong} | {w.unchecked} | "
                     f"{w.eligible} | {fmt_pct(w.hit_rate)} | {w.compiled} | "
                     f"{fmt_pct(w.hit_rate_compiled)} |")
    series = result.soak.get("store_series") or {}
    if any(series.values()):
        lines += ["", "Store counters over the soak (per host, what grew):", ""]
        lines += [f"- {host}: " + ", ".join(f"{k} +{v:g}" for k, v in grown.items())
                  for host, grown in series.items() if grown]
    return lines + [""]


def report(result: FleetResult) -> str:
    notes = [f"- {n}" for n in result.notes]
    skipped = [f"- left out: {s.get('id')} ({s.get('why')})" for s in result.skipped]
    tail = (["## Notes", "", *notes, *skipped, ""] if notes or skipped else [])
    return "\n".join(_header(result) + _goals(result) + _share(result) + _cost(result)
                     + _soak(result) + tail)


def markdown(data: Mapping[str, Any]) -> str:
    return report(FleetResult.from_dict(data))


def plot(result: FleetResult, path: Path) -> None:
    """Left: host b's share spliced per tool list; middle: median p90 TTFT by store and
    concurrency; right: the soak's hit rate per window between faults."""
    title = f"serve-bench fleet ({result.config.model})"
    with panels(path, 3, size=(14, 4), title=title) as (ax, bx, cx):
        shares = [c.share or 0.0 for c in result.share]
        ax.bar(range(len(shares)), shares, color=["C0" if c.identical else "C3"
                                                  for c in result.share])
        ax.axhline(0.5, color="gray", ls=":", lw=1)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("tool list")
        ax.set_title("share spliced on b's first request\n(red: answer differs)", fontsize=9)
        levels = sorted({r.concurrency for r in result.ttft})
        grouped_bars(bx, [f"c{c}" for c in levels], {
            store: [next((1000 * (r.median_p90_s or 0.0) for r in result.ttft
                          if r.store == store and r.concurrency == c), 0.0) for c in levels]
            for store in ("redis", "folder")})
        bx.set_ylabel("median p90 TTFT (ms)")
        bx.set_title("entries local: Redis store vs folder store", fontsize=9)
        if levels:
            bx.legend(fontsize=8)
        spans = soak_windows(result)
        grouped_bars(cx, [w.label.replace(" @", "\n@") for w in spans], {
            "seen twice": [w.hit_rate or 0.0 for w in spans],
            "after a compile (goal)": [w.hit_rate_compiled or 0.0 for w in spans]})
        cx.tick_params(axis="x", labelsize=7, labelrotation=40)
        cx.set_ylim(0, 1.05)
        cx.legend(fontsize=7)
        cx.set_title("soak hit rate between faults", fontsize=9)


def write_outputs(data: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """``result.json``, ``report.md`` and ``fleet.png`` in ``out``."""
    result = FleetResult.from_dict(data)
    return write_bundle(out, dict(data), report=report(result), json_name="result.json",
                        plot_name="fleet.png", plot=lambda path: plot(result, path))
