"""The erratum benchmark's report: the Markdown tables, the TTFT CDF, and the bundle on disk.

The report renders a typed :class:`~kvnotes_bench.serving.erratum.ErratumResult`; a stored
``result.json`` is read back with ``ErratumResult.from_dict``, so a saved run can be rendered
again without rerunning it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvnotes.eval.reports import write_bundle
from kvnotes_bench.kit.formats import fmt_kinds, fmt_load, fmt_ms, fmt_pct, fmt_s
from kvnotes_bench.kit.plots import cdf, panels
from kvnotes_bench.serving.erratum import ErratumResult
from kvnotes_bench.serving.workload import ERRATA_FORMS


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x"


def markdown_table(data: Mapping[str, Any]) -> str:
    """The per policy and concurrency tables of a result's JSON form, as Markdown."""
    return tables(ErratumResult.from_dict(data))


def tables(result: ErratumResult) -> str:
    """The per policy and concurrency tables of a result, as Markdown."""
    lines = ["| context | conc | policy | ok/n | TTFT p50 | p90 | p99 | hit rate (metrics) | "
             "hit rate (usage) | req/s | errors | warm-up errors | load 1m before/after | "
             "agree w/ in-place | answers | acc | old answer |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---:|---:|"]
    for row in result.phases:
        s, a = row.phase, row.answers
        agree = ("-" if a.agreement_with_in_place is None
                 else f"{a.agreement_with_in_place:.2f} (n={a.agreement_n})")
        dec = ", ".join(f"{k} {v}" for k, v in sorted(a.decisions.items()))
        rps = "-" if s.requests_per_s is None else f"{s.requests_per_s:.2f}"
        lines.append(
            f"| {s.context_tokens} | {s.concurrency} | {s.policy} | "
            f"{s.ok}/{s.requests} | {fmt_s(s.ttft_p50_s)} | {fmt_s(s.ttft_p90_s)} | "
            f"{fmt_s(s.ttft_p99_s)} | {fmt_pct(s.hit_rate)} | {fmt_pct(s.hit_rate_usage)} | "
            f"{rps} | {fmt_kinds(s.errors)} | {fmt_kinds(s.warmup_errors)} "
            f"| {fmt_load(s.load_before)} / {fmt_load(s.load_after)} | {agree} | {dec} | "
            f"{'-' if a.accuracy is None else format(a.accuracy, '.2f')} | "
            f"{'-' if a.stale_rate is None else format(a.stale_rate, '.2f')} |")
    lines += ["", "| context | conc | in-place / erratum p90 | cold / erratum p90 |",
              "|---:|---:|---:|---:|"]
    for r in result.ratios():
        lines.append(f"| {r.context_tokens} | {r.concurrency} | "
                     f"{_x(r.over.get('in-place'))} | {_x(r.over.get('cold'))} |")
    return "\n".join(lines)


def breakdown_table(result: ErratumResult) -> str:
    """Where the mean TTFT of each phase went, from vLLM's per-request histograms."""
    lines = ["| context | conc | policy | client TTFT | server TTFT | queue | compute | "
             "first step | frontend | computed tokens | prompt tokens | n |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result.phases:
        s = row.phase
        b = s.breakdown
        if not b:
            continue
        tok = "-" if b["computed_tokens"] is None else f"{b['computed_tokens']:.0f}"
        prompt = "-" if b["prompt_tokens"] is None else f"{b['prompt_tokens']:.0f}"
        n = "-" if b["n"] is None else f"{b['n']:.0f}"
        lines.append(f"| {s.context_tokens} | {s.concurrency} | {s.policy} | "
                     f"{fmt_ms(b['client_ttft_s'])} | {fmt_ms(b['server_ttft_s'])} | "
                     f"{fmt_ms(b['queue_s'])} | {fmt_ms(b['compute_s'])} | {fmt_ms(b['first_step_s'])} "
                     f"| {fmt_ms(b['frontend_s'])} | {tok} | {prompt} | {n} |")
    return "\n".join(lines)


def write_outputs(result: Mapping[str, Any], out: str | Path) -> dict[str, Path]:
    """``result.json`` (the JSON form as given), ``report.md`` and ``ttft_cdf.png`` in
    ``out``; returns their paths."""
    return write_bundle(out, dict(result), report=report_markdown(result),
                        json_name="result.json", plot_name="ttft_cdf.png",
                        plot=lambda path: plot_ttft_cdf(result, path))


def report_markdown(data: Mapping[str, Any]) -> str:
    """The markdown report of a result's JSON form (``ErratumResult.to_dict()`` or a stored
    ``result.json``)."""
    return report(ErratumResult.from_dict(data))


def report(result: ErratumResult) -> str:
    """The markdown report of one erratum run."""
    cfg, server, machine = result.config, result.server, result.machine
    failed = sum(p.phase.failed for p in result.phases)
    warm_failed = sum(p.phase.warmup_failed for p in result.phases)
    skipped = sum(p.phase.skipped for p in result.phases)
    startup = result.launch.startup_s if result.launch is not None else None
    text = [
        "# serve-bench: erratum vs in-place vs cold on a vLLM prefix cache", "",
        f"- server: {server.url} (vLLM {server.version or '?'}), model "
        f"`{cfg.model}`, KV block size {server.block_size or '? (not reported)'} tokens"
        + (f", launched by kvnotes (startup {startup:.0f} s)" if startup else ""),
        f"- machine: {'?' if machine.cpus is None else machine.cpus} CPUs, "
        f"{machine.cpu_model or '?'}, flags "
        f"{', '.join(machine.cpu_flags) or '-'}; load average at start "
        f"{machine.load_average}, at end {machine.load_average_end}",
        f"- contexts {result.contexts} tokens"
        + "".join(f" ({s.context_tokens} skipped: {s.reason})" for s in result.contexts_skipped)
        + f", field at depth {cfg.field_depth}, at least {cfg.sessions} sessions (one per "
        f"concurrent stream, {cfg.requests_per_row} measured requests per row at "
        f"least) x {cfg.edits} edits, concurrency {list(cfg.concurrency)}, greedy, max "
        f"{cfg.max_tokens} tokens",
        f"- requests measured: {sum(p.phase.requests for p in result.phases)} "
        f"(failed {failed}, skipped by the time budget {skipped}; warm-ups failed "
        f"{warm_failed}; errors by kind: {fmt_kinds(result.errors())}); wall "
        f"{result.wall_s:.0f} s",
        "- TTFT: client-side (openai AsyncOpenAI, streaming), time to the first chunk carrying "
        "generated text. Hit rate: delta of vllm:prefix_cache_hits_total over delta of "
        "vllm:prefix_cache_queries_total (tokens) around each measured phase; the usage column "
        "is the same from each response's cached_tokens.",
        "- Each cache-using policy first sends every session's original prompt once (warm-up, "
        "not measured). Question: " + (
            "the order's current status (the field's value itself)"
            if cfg.question == "status" else
            "the refund decision the policy implies for the order's status")
        + ". Errata: " + ERRATA_FORMS[cfg.errata]
        + ". Agreement: answers equal to in-place's for the same session and edit; acc: the "
        "right answer for the new value; old answer: the answer the session's original value "
        "gives (what the cached context still says), over the edits whose right answer differs "
        "from it (the edits were missed). Errors: http_4xx/5xx, "
        "timeout, connection (refused, dropped, cut short), stream (error inside the stream).",
        "", tables(result), "", "![TTFT CDF](ttft_cdf.png)", "",
        "## Where the time to first token goes", "",
        "Means per request over each measured phase, from deltas of vLLM's histograms: queue "
        "(vllm:request_queue_time_seconds), compute = prefill time "
        "(vllm:request_prefill_time_seconds, scheduled to first token) less one engine step, "
        "first step = the mean decode step (vllm:inter_token_latency_seconds), frontend = "
        "client TTFT less the server's (vllm:time_to_first_token_seconds): HTTP, chat template, "
        "tokenization, streaming. Computed tokens: vllm:request_prefill_kv_computed_tokens "
        "(for the erratum: the partly filled last block and the text after it that the previous "
        "request did not have: the corrections and the question, or with --errata follow-up the "
        "new correction and the re-ask).", "",
        breakdown_table(result), ""]
    return "\n".join(text)


def plot_ttft_cdf(result: Mapping[str, Any], path: str | Path) -> None:
    """One panel per context length; one TTFT CDF per policy and concurrency (log time axis).
    Reads the JSON form (``requests``, ``config``, ``contexts``), so the requests of several
    runs merged into one can be drawn together."""
    contexts = list(result.get("contexts") or result["config"]["context_tokens"])
    with panels(path, len(contexts), size=(5 * len(contexts), 4)) as axes:
        colors = {"in-place": "tab:red", "erratum": "tab:green", "cold": "tab:gray"}
        styles = ["-", "--", ":", "-."]
        concs = list(result["config"]["concurrency"])
        for ax, ctx in zip(axes, contexts, strict=True):
            for policy in result["config"]["policies"]:
                for k, conc in enumerate(concs):
                    cdf(ax, (r["ttft_s"] for r in result["requests"]
                             if r["ok"] and r["ttft_s"] is not None and r["policy"] == policy
                             and r["context_tokens"] == ctx and r["concurrency"] == conc),
                        color=colors.get(policy), linestyle=styles[k % len(styles)],
                        label=f"{policy}, conc {conc}")
            ax.set_xscale("log")
            ax.set_xlabel("time to first token (s)")
            ax.set_title(f"context {ctx} tokens")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[-1].legend(fontsize=8, loc="lower right")
