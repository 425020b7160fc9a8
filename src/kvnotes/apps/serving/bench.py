"""serve-bench: erratum vs in-place vs cold on an OpenAI-compatible vLLM server.

For every context length and concurrency level, fresh sessions are generated (their ids carry a
run tag, so no run finds another run's prompts in the prefix cache). Each cache-using policy
first sends every session's original prompt once (warm-up, not measured: the server has seen
the context before the edits arrive), then the measured stream of edits. The prefix-cache hit
rate of a phase is the ratio of the deltas of ``vllm:prefix_cache_hits_total`` and
``vllm:prefix_cache_queries_total`` around it; phases never overlap, so the deltas belong to
one policy.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.apps.serving.client import Client, StreamResult
from kvnotes.apps.serving.metrics import PrefixCacheCounters, agreement, percentile
from kvnotes.apps.serving.workload import ANSWERS, POLICIES, Session, make_sessions
from kvnotes.core.errors import ServingError, UnknownNameError
from kvnotes.eval.reports import write_bundle
from kvnotes.ops.decisions import parse_answer


@dataclass
class BenchConfig:
    """What one serve-bench run measures (all requests bounded in number and time)."""

    model: str = "smollm2-135m"
    context_tokens: tuple[int, ...] = (1000, 4000, 8000)
    field_depth: float = 0.1
    sessions: int = 4
    edits: int = 4
    concurrency: tuple[int, ...] = (1, 4, 16)
    policies: tuple[str, ...] = POLICIES
    max_tokens: int = 8
    request_timeout_s: float = 600.0
    time_budget_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise UnknownNameError("policy", bad[0], POLICIES)
        if not self.context_tokens or min(self.context_tokens) < 64:
            raise ValueError("context lengths must be at least 64 tokens")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be at least 1")
        if self.sessions < 1 or self.edits < 1:
            raise ValueError("need at least one session and one edit")

    def total_requests(self) -> int:
        """An upper bound on the requests a run sends (warm-ups included)."""
        n = 0
        for c in self.concurrency:
            s = max(self.sessions, c)
            for p in self.policies:
                n += s * self.edits + (0 if p == "cold" else s)
        return n * len(self.context_tokens)


@dataclass
class RequestRecord:
    """One measured request."""

    context_tokens: int
    concurrency: int
    policy: str
    session: str
    turn: int
    ok: bool
    ttft_s: float | None
    total_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str
    decision: str | None
    expected: str
    error: str | None = None
    skipped: bool = False


@dataclass
class PhaseSummary:
    """Per (context, concurrency, policy): latency, cache and decision figures."""

    context_tokens: int
    concurrency: int
    policy: str
    requests: int
    ok: int
    failed: int
    skipped: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    hit_rate: float | None  # from /metrics deltas
    hit_rate_usage: float | None  # sum(cached_tokens) / sum(prompt_tokens) from the responses
    queries_tokens: float | None
    hits_tokens: float | None
    requests_per_s: float | None
    wall_s: float
    mean_prompt_tokens: float | None
    decisions: dict[str, int] = field(default_factory=dict)
    accuracy: float | None = None  # decision == the refund policy's answer for the new value
    agreement_with_in_place: float | None = None
    agreement_n: int = 0


class _Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() > self.at


def _run_parallel(jobs: Sequence[Callable[[], None]], concurrency: int) -> None:
    """Run the jobs on ``concurrency`` threads; the first exception is re-raised at the end."""
    q: queue.Queue = queue.Queue()
    for j in jobs:
        q.put(j)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(err)
                return

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)  # short joins keep Ctrl-C responsive in the main thread
    if errors:
        raise errors[0]


def _counters(client: Client) -> PrefixCacheCounters | None:
    try:
        return PrefixCacheCounters.from_metrics(client.metrics_text())
    except (KeyError, ServingError):
        return None


def run_phase(client: Client, sessions: Sequence[Session], policy: str, *, config: BenchConfig,
              concurrency: int, context_tokens: int, deadline: _Deadline,
              log: Callable[[str], None] = lambda s: None) -> tuple[PhaseSummary,
                                                                   list[RequestRecord]]:
    """Warm-up (cache-using policies), then the measured edit streams of one policy."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    warm_failures: list[str] = []

    def send(prompt: str) -> StreamResult:
        salt = secrets.token_hex(16) if policy == "cold" else None
        return client.stream_chat(config.model, prompt, max_tokens=config.max_tokens,
                                  cache_salt=salt, timeout=config.request_timeout_s)

    def warm(s: Session) -> Callable[[], None]:
        def job() -> None:
            if deadline.passed():
                return
            r = send(s.warmup_prompt())
            if not r.ok:
                with lock:
                    warm_failures.append(f"{s.session_id}: {r.error}")
        return job

    def stream(s: Session) -> Callable[[], None]:
        def job() -> None:
            for turn in s.turns:
                base = dict(context_tokens=context_tokens, concurrency=concurrency,
                            policy=policy, session=s.session_id, turn=turn.index,
                            expected=turn.expected)
                if deadline.passed():
                    rec = RequestRecord(**base, ok=False, ttft_s=None, total_s=None,
                                        prompt_tokens=None, cached_tokens=None, text="",
                                        decision=None, error="time budget exhausted",
                                        skipped=True)
                else:
                    r = send(s.prompt(policy, turn.index))
                    rec = RequestRecord(**base, ok=r.ok, ttft_s=r.ttft_s, total_s=r.total_s,
                                        prompt_tokens=r.prompt_tokens,
                                        cached_tokens=r.cached_tokens, text=r.text,
                                        decision=parse_answer(r.text, ANSWERS) if r.ok else None,
                                        error=r.error)
                with lock:
                    records.append(rec)
        return job

    if policy != "cold":
        _run_parallel([warm(s) for s in sessions], concurrency)
    before = _counters(client)
    t0 = time.perf_counter()
    _run_parallel([stream(s) for s in sessions], concurrency)
    wall = time.perf_counter() - t0
    after = _counters(client)
    delta = after - before if before is not None and after is not None else None
    records.sort(key=lambda r: (r.session, r.turn))
    summary = summarize(records, policy=policy, concurrency=concurrency,
                        context_tokens=context_tokens, wall_s=wall, delta=delta)
    if warm_failures:
        summary.failed += len(warm_failures)
        for msg in warm_failures:
            log(f"warm-up failed: {msg}")
    return summary, records


def summarize(records: Sequence[RequestRecord], *, policy: str, concurrency: int,
              context_tokens: int, wall_s: float,
              delta: PrefixCacheCounters | None) -> PhaseSummary:
    """The figures of one phase from its request records and its /metrics delta."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    usage = [r for r in ok if r.prompt_tokens and r.cached_tokens is not None]
    decisions: dict[str, int] = {}
    for r in ok:
        key = r.decision or "unparsed"
        decisions[key] = decisions.get(key, 0) + 1
    return PhaseSummary(
        context_tokens=context_tokens, concurrency=concurrency, policy=policy,
        requests=len(records), ok=len(ok), failed=sum(1 for r in records
                                                      if not r.ok and not r.skipped),
        skipped=sum(1 for r in records if r.skipped),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        hit_rate=delta.hit_rate if delta else None,
        hit_rate_usage=(sum(r.cached_tokens for r in usage) / sum(r.prompt_tokens for r in usage)
                        if usage else None),
        queries_tokens=delta.queries if delta else None, hits_tokens=delta.hits if delta else None,
        requests_per_s=len(ok) / wall_s if wall_s > 0 and ok else None, wall_s=wall_s,
        mean_prompt_tokens=(sum(r.prompt_tokens for r in ok if r.prompt_tokens) / len(ok)
                            if ok and all(r.prompt_tokens for r in ok) else None),
        decisions=decisions,
        accuracy=sum(1 for r in ok if r.decision == r.expected) / len(ok) if ok else None)


def run_benchmark(client: Client, config: BenchConfig, *,
                  count_tokens: Callable[[str], int] | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every (context, concurrency, policy) phase; returns the JSON-ready result."""
    served = client.models()
    if config.model not in served:
        raise ServingError(f"the server at {client.url} does not serve {config.model!r}; it "
                           f"serves {served} (pass --model with one of these)")
    if count_tokens is None:
        memo: dict[str, int] = {}

        def count_tokens(text: str) -> int:
            if text not in memo:
                memo[text] = client.count_tokens(config.model, text)
            return memo[text]

    limit = client.max_model_len(config.model)
    if limit is not None:
        # chat template, errata and question come on top of the context, then the answer
        need = max(config.context_tokens) + 120 + 30 * config.edits + config.max_tokens
        if need > limit:
            raise ServingError(f"the server's max model length is {limit} tokens, too short for "
                               f"{max(config.context_tokens)}-token contexts with {config.edits}"
                               f" edits (about {need} tokens): lower --context-tokens or --edits,"
                               " or start the server with a larger --max-model-len")
    run_id = secrets.token_hex(3)
    deadline = _Deadline(config.time_budget_s)
    summaries: list[PhaseSummary] = []
    records: list[RequestRecord] = []
    sessions_meta: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for ctx in config.context_tokens:
        for conc in config.concurrency:
            sessions = make_sessions(max(config.sessions, conc), context_tokens=ctx,
                                     depth=config.field_depth, edits=config.edits,
                                     count_tokens=count_tokens, tag=f"{run_id}-c{ctx}-k{conc}",
                                     seed=config.seed)
            sessions_meta += [dict(session=s.session_id, context_tokens=s.context_tokens,
                                   field_token_depth=round(s.field_token_depth, 4),
                                   initial=s.initial, edits=[t.new for t in s.turns])
                              for s in sessions]
            by_policy: dict[str, list[RequestRecord]] = {}
            for policy in config.policies:
                log(f"context {ctx}, concurrency {conc}, {policy}: {len(sessions)} sessions x "
                    f"{config.edits} edits")
                summary, recs = run_phase(client, sessions, policy, config=config,
                                          concurrency=conc, context_tokens=ctx,
                                          deadline=deadline, log=log)
                summaries.append(summary)
                records += recs
                by_policy[policy] = recs
                log(f"  ok {summary.ok}/{summary.requests}  ttft p50 {_fmt(summary.ttft_p50_s)}"
                    f"  p90 {_fmt(summary.ttft_p90_s)}  hit rate {_pct(summary.hit_rate)}")
            ref = {(r.session, r.turn): r.decision for r in by_policy.get("in-place", []) if r.ok}
            for summary in summaries[-len(config.policies):]:
                if summary.policy == "in-place" or not ref:
                    continue
                mine = {(r.session, r.turn): r.decision for r in by_policy[summary.policy]
                        if r.ok}
                same, n = agreement(mine, ref)
                summary.agreement_with_in_place = same / n if n else None
                summary.agreement_n = n
    return {
        "config": asdict(config),
        "server": {"url": client.url, "version": client.version(), "models": served},
        "run_id": run_id,
        "wall_s": time.perf_counter() - t_start,
        "summaries": [asdict(s) for s in summaries],
        "ratios": ratios(summaries),
        "sessions": sessions_meta,
        "requests": [asdict(r) for r in records],
    }


def ratios(summaries: Sequence[PhaseSummary]) -> list[dict[str, Any]]:
    """p90 TTFT of in-place and cold over erratum, per (context, concurrency)."""
    table: dict[tuple[int, int], dict[str, PhaseSummary]] = {}
    for s in summaries:
        table.setdefault((s.context_tokens, s.concurrency), {})[s.policy] = s
    out = []
    for (ctx, conc), row in sorted(table.items()):
        e = row.get("erratum")
        entry: dict[str, Any] = {"context_tokens": ctx, "concurrency": conc}
        for other in ("in-place", "cold"):
            o = row.get(other)
            ok = e and o and e.ttft_p90_s and o.ttft_p90_s
            entry[f"{other}_over_erratum_p90"] = o.ttft_p90_s / e.ttft_p90_s if ok else None
        out.append(entry)
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_table(result: dict[str, Any]) -> str:
    """The per policy and concurrency table of a result, as Markdown."""
    lines = ["| context | conc | policy | ok/n | TTFT p50 | p90 | p99 | hit rate (metrics) | "
             "hit rate (usage) | req/s | agree w/ in-place | decisions | acc |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for s in result["summaries"]:
        agree = ("-" if s["agreement_with_in_place"] is None
                 else f"{s['agreement_with_in_place']:.2f} (n={s['agreement_n']})")
        dec = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items()))
        rps = "-" if s["requests_per_s"] is None else f"{s['requests_per_s']:.2f}"
        lines.append(
            f"| {s['context_tokens']} | {s['concurrency']} | {s['policy']} | "
            f"{s['ok']}/{s['requests']} | {_fmt(s['ttft_p50_s'])} | {_fmt(s['ttft_p90_s'])} | "
            f"{_fmt(s['ttft_p99_s'])} | {_pct(s['hit_rate'])} | {_pct(s['hit_rate_usage'])} | "
            f"{rps} | {agree} | {dec} | "
            f"{'-' if s['accuracy'] is None else format(s['accuracy'], '.2f')} |")
    lines += ["", "| context | conc | in-place / erratum p90 | cold / erratum p90 |",
              "|---:|---:|---:|---:|"]
    for r in result["ratios"]:
        a, b = r["in-place_over_erratum_p90"], r["cold_over_erratum_p90"]
        lines.append(f"| {r['context_tokens']} | {r['concurrency']} | "
                     f"{'-' if a is None else f'{a:.1f}x'} | {'-' if b is None else f'{b:.1f}x'} |")
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``result.json``, ``report.md`` and ``ttft_cdf.png`` in ``out``; returns their paths."""
    return write_bundle(out, result, report=report_markdown(result), json_name="result.json",
                        plot_name="ttft_cdf.png", plot=lambda path: plot_ttft_cdf(result, path))


def report_markdown(result: dict[str, Any]) -> str:
    """The markdown report of a serve-bench result."""
    cfg, server = result["config"], result["server"]
    failed = sum(s["failed"] for s in result["summaries"])
    skipped = sum(s["skipped"] for s in result["summaries"])
    launch = result.get("launch") or {}
    text = [
        "# serve-bench: erratum vs in-place vs cold on a vLLM prefix cache", "",
        f"- server: {server['url']} (vLLM {server.get('version') or '?'}), model "
        f"`{cfg['model']}`" + (f", launched by kvnotes (startup {launch['startup_s']:.0f} s)"
                               if launch.get("startup_s") else ""),
        f"- contexts {list(cfg['context_tokens'])} tokens, field at depth {cfg['field_depth']}, "
        f"{cfg['sessions']} sessions (at least one per concurrent stream) x {cfg['edits']} "
        f"edits, concurrency {list(cfg['concurrency'])}, greedy, max {cfg['max_tokens']} tokens",
        f"- requests measured: {sum(s['requests'] for s in result['summaries'])} "
        f"(failed {failed}, skipped by the time budget {skipped}); wall {result['wall_s']:.0f} s",
        "- TTFT: client-side, streaming, time to the first chunk carrying generated text. Hit "
        "rate: delta of vllm:prefix_cache_hits_total over delta of "
        "vllm:prefix_cache_queries_total (tokens) around each measured phase; the usage column "
        "is the same from each response's cached_tokens.",
        "- Each cache-using policy first sends every session's original prompt once (warm-up, "
        "not measured). Agreement: decisions equal to in-place's for the same session and edit; "
        "acc: the decision the refund policy implies for the new value.",
        "", markdown_table(result), "", "![TTFT CDF](ttft_cdf.png)", ""]
    return "\n".join(text)


def plot_ttft_cdf(result: dict[str, Any], path: str | Path) -> None:
    """One panel per context length; one TTFT CDF per policy and concurrency (log time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(result["config"]["context_tokens"])
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    colors = {"in-place": "tab:red", "erratum": "tab:green", "cold": "tab:gray"}
    styles = ["-", "--", ":", "-."]
    concs = list(result["config"]["concurrency"])
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for policy in result["config"]["policies"]:
            for k, conc in enumerate(concs):
                xs = sorted(r["ttft_s"] for r in result["requests"]
                            if r["ok"] and r["ttft_s"] is not None and r["policy"] == policy
                            and r["context_tokens"] == ctx and r["concurrency"] == conc)
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", color=colors.get(policy),
                        linestyle=styles[k % len(styles)], label=f"{policy}, conc {conc}")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_title(f"context {ctx} tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
