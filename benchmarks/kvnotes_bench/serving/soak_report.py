"""The soak's report (markdown) and its plot (latency over time, skill events marked), both
rendered from a typed :class:`~kvnotes_bench.serving.soak_result.SoakResult` (a stored
``result.json`` is read back with ``SoakResult.from_dict``, so it can be reported again)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.formats import fmt_kinds, fmt_load, fmt_ms, fmt_s
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.serving.soak_check import SHARED_TENANTS
from kvnotes_bench.serving.soak_result import SoakResult

if TYPE_CHECKING:
    from kvnotes_bench.serving.corun import CorunResult

EVENT_COLOURS = {"publish": "tab:green", "corrupt": "tab:red", "delete": "tab:purple",
                 "retire": "tab:gray"}


def _loads(load: list[float] | None) -> str:
    return "-" if not load else "/".join(f"{x:.1f}" for x in load)


def _sharing(machine: MachineRecord) -> str:
    """What the load at the start says about the timings (the run's own server and clients
    load the machine too, so only the start tells other work apart)."""
    start = machine.load_average[0] if machine.load_average else None
    cpus = machine.cpus or 1
    if start is None:
        return "The load at the start is unknown: timings may be contended."
    if start > 0.75 * cpus:
        return ("The machine was shared with other work at the start: counts are valid, "
                "timings are contended.")
    return ("The machine was otherwise idle at the start (1-minute load under 0.75 per CPU); "
            "the load during the run is the server's and the benchmark's own.")


def markdown(result: Mapping[str, Any]) -> str:
    """The report of a result's JSON form (``SoakResult.to_dict()`` or a stored file)."""
    return report(SoakResult.from_dict(result))


def report(result: SoakResult) -> str:
    """The markdown report of one soak."""
    cfg, s, m = result.config, result.summary(), result.machine
    lines = [
        f"# serve-bench soak ({cfg.model})", "",
        f"Started {result.started or '?'} UTC; command: `{result.how or '?'}`.",
        f"Machine: {m.cpus} CPUs ({m.cpu_model or '?'}), {result.threads} "
        f"torch threads in the benchmark process; load average (1/5/15 min) at start "
        f"{_loads(m.load_average)}, at end {_loads(m.load_average_end)}. "
        + _sharing(m), "",
        f"Server: vLLM with kvnotes' connector, {result.launch.dtype if result.launch else '?'}, "
        f"{cfg.kv_blocks} KV blocks of {cfg.block_size} tokens "
        f"({cfg.kv_blocks * cfg.block_size} tokens), max model length "
        f"{cfg.max_model_len}. {cfg.clients} clients for {cfg.duration_s:.0f} s; each "
        f"request: header + {cfg.k_min}-{cfg.k_max} library skills (random subset and "
        f"order) + user text, {cfg.max_tokens} greedy tokens; {cfg.exact_fraction:.0%} "
        f"exact, {cfg.volatile_fraction:.0%} carrying the volatile skill of the moment (its "
        f"own tenant), the rest spliced in {len(SHARED_TENANTS)} shared tenants; "
        f"{cfg.disconnect_fraction:.0%} close their stream after 1-3 chunks.", "",
        "| figure | value |", "|---|---:|",
        f"| requests sent | {s.requests} (spliced {s.by_kind.get('spliced', 0)}, exact "
        f"{s.by_kind.get('exact', 0)}, volatile {s.by_kind.get('volatile', 0)}) |",
        f"| completed and checked | {s.checked} of {s.completed} |",
        f"| failed (errors by kind) | {s.failed} ({fmt_kinds(s.errors)}) |",
        f"| wrong answers | {s.wrong} |",
        f"| near ties (server top-2 within {cfg.tie_tau}) | {s.near_ties} |",
        f"| disconnects (closed early on purpose) | {s.disconnects} |",
        f"| preemptions (vLLM counter, delta) | {_num(s.preemptions)} |",
        f"| latency p50 / p99 (whole answer) | {fmt_s(s.latency_p50_s)} / "
        f"{fmt_s(s.latency_p99_s)} |",
        f"| TTFT p50 / p99 | {fmt_s(s.ttft_p50_s)} / {fmt_s(s.ttft_p99_s)} |",
        f"| completed requests per second | {_num(s.requests_per_s, 2)} |",
        f"| engine references computed | {result.references} |", "",
        "What each checked answer equalled (compose: `engine.compose(parts, repair=0)`; cut: "
        "the pieces before the volatile skill spliced, the rest computed; exact: a prefill of "
        "the same ids; partial: the composition's first blocks, the rest computed):", "",
        "| requests | " + " | ".join(_LABELS) + " |", "|---|" + "---:|" * len(_LABELS)]
    for key in sorted(s.matched):
        lines.append(f"| {key} | " + " | ".join(str(s.matched[key].get(lab, 0))
                                                  for lab in _LABELS) + " |")
    lines += ["", "Skill events (seconds into the run):", "",
              "| skill | event | planned | done |", "|---:|---|---:|---:|"]
    for e in result.events:
        lines.append(f"| {e.skill} | {e.kind} | {e.planned_s:.1f} | {e.done_s:.1f} |")
    lines += ["", "Server log: " + ", ".join(f"{k} {v}" for k, v in result.server_log.items())
              + "."]
    bad = [(r, r.verdict) for r in result.records
           if r.verdict is not None and r.verdict.status != "ok"]
    if bad:
        lines += ["", "Answers that matched no candidate:", ""]
        for r, v in bad[:20]:
            lines.append(f"- request {r.index} ({r.spec.kind}, skills {list(r.spec.prompt.skills)}"
                         f", tenant {r.spec.tenant}): {v.status} at step {v.diverged_at} (server "
                         f"margin {v.margin}); got {r.answer.token_ids}, expected "
                         f"{v.expected}")
    if result.corun is not None:
        lines += ["", corun_table(result.corun)]
    return "\n".join(lines) + "\n"


_LABELS = ("compose", "cut", "exact", "partial", "near_tie", "wrong")


def corun_table(corun: CorunResult) -> str:
    """The co-running measurement's table."""
    cfg = corun.config
    lines = [f"Co-running decode latency: one probe (short exact prompt, {cfg.probe_tokens} "
             f"tokens, ignore_eos) streamed again and again for {cfg.seconds:.0f} s per "
             f"mode beside {cfg.background} clients sending header + {cfg.k} skills + "
             f"user text ({cfg.max_tokens} tokens), spliced or the same prompts exactly:", "",
             "| background | probe ITL p50 | probe ITL p99 | mean | tokens | background "
             "requests (failed) | mean prompt | preemptions | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in corun.modes:
        lines.append(f"| {r.mode} | {fmt_ms(r.itl_p50_s)} | {fmt_ms(r.itl_p99_s)} | "
                     f"{fmt_ms(r.itl_mean_s)} | {r.tokens} | {r.background_requests} "
                     f"({r.background_failed}) | {_num(r.background_prompt_tokens_mean)} | "
                     f"{_num(r.preemptions)} | {fmt_load(r.load_before)} |")
    return "\n".join(lines)


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot_latency(result: SoakResult, path: Path) -> None:
    """Each completed request's latency against the time it was sent, by kind; skill events as
    vertical lines; failed and wrong answers marked."""
    with panels(path, 1, size=(10, 4)) as (ax,):
        for kind, marker in (("spliced", "o"), ("exact", "s"), ("volatile", "^")):
            pts = [(r.sent_s, r.answer.total_s) for r in result.records
                   if r.spec.kind == kind and r.answer.ok and r.answer.total_s is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=10, marker=marker, label=kind, alpha=0.7)
        bad = [(r.sent_s, r.answer.total_s or 0.0) for r in result.records
               if (not r.answer.ok and not r.answer.disconnected)
               or (r.verdict is not None and r.verdict.status == "wrong")]
        if bad:
            xs, ys = zip(*bad, strict=True)
            ax.scatter(xs, ys, s=40, marker="x", color="black", label="failed or wrong")
        seen: set[str] = set()
        for e in result.events:
            ax.axvline(e.done_s, color=EVENT_COLOURS.get(e.kind, "k"), lw=0.8, ls="--",
                       label=e.kind if e.kind not in seen else None)
            seen.add(e.kind)
        ax.set_xlabel("sent at (s into the run)")
        ax.set_ylabel("latency (s, whole answer)")
        ax.set_title(f"{result.config.model}: soak of kvnotes' connector")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=4)


def write_outputs(result: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """``result.json`` (the JSON form as given), ``report.md`` and ``latency.png`` in ``out``."""
    typed = SoakResult.from_dict(result)
    return write_bundle(out, dict(result), report=report(typed), json_name="result.json",
                        plot_name="latency.png", plot=lambda p: plot_latency(typed, p))
