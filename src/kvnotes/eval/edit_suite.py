"""Edit evaluation: every strategy on the task suite, measured against recompute of the new value.

For each case the document is prefilled with the old value; each strategy then edits the field
and the question is asked on top. The reference is full recompute of the edited document.

Decisions without chain of thought compare the logits of the answers' first tokens at the
decision position (the position after the question); with ``cot=True`` the model reasons
greedily up to a budget and the answer is parsed from its text (cosine and KL are then read at
the first generated token). A case is *sensitive* when recompute gives different decisions for
the old and the new value; recovery rates count sensitive cases only.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.chat import chat_turn, has_template, turn_frame
from kvnotes.core.document import Document
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError, WorkerError
from kvnotes.core.machine import physical_cores
from kvnotes.core.metrics import compare_logits
from kvnotes.eval.reports import write_bundle
from kvnotes.ops.decisions import decide, decide_batch

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.eval.tasks.base import EditCase

DEFAULT_STRATEGIES: tuple[str, ...] = (
    "recompute", "prefix", "overwrite", "erratum",
    "repair:attention:8", "repair:attention:32", "repair:attention:96",
    "repair:kv_deviation:8", "repair:kv_deviation:32", "repair:kv_deviation:96",
)
ERRATUM_WORDINGS: tuple[str, ...] = ("erratum:update", "erratum:strong", "erratum:restate")
CHART = "edit.png"
COT_INSTRUCTION = "Think step by step, then finish with 'Final answer: <answer>'."


def parse_strategy(spec: str) -> tuple[str, dict[str, Any]]:
    """``"repair:kv_deviation:32"`` -> ``("repair", {"select": "kv_deviation", "k": 32})``;
    ``"erratum:strong"`` -> ``("erratum", {"template": "strong"})``."""
    from kvnotes.ops.edit import ERRATUM_TEMPLATES, SELECTORS, STRATEGIES

    name, *rest = spec.split(":")
    if name not in STRATEGIES:
        raise UnknownNameError("strategy", spec, STRATEGIES,
                               "with options: repair:<select>:<k>, erratum:<template>")
    if name == "repair":
        select = rest[0] if rest else "attention"
        if select not in SELECTORS:
            raise UnknownNameError("selector", select, SELECTORS, f"in {spec!r}")
        if len(rest) > 2 or (len(rest) == 2 and not rest[1].isdigit()):
            raise InvalidArgumentError(f"bad repair spec {spec!r}; write "
                                    f"repair:<{'|'.join(SELECTORS)}>:<k>")
        return name, {"select": select, "k": int(rest[1]) if len(rest) == 2 else 32}
    if name == "erratum" and rest:
        if rest[0] not in ERRATUM_TEMPLATES:
            raise UnknownNameError("erratum template", rest[0], sorted(ERRATUM_TEMPLATES))
        return name, {"template": rest[0]}
    if rest:
        raise InvalidArgumentError(f"strategy {name!r} takes no options, got {spec!r}")
    return name, {}


def case_prompt(engine: Engine, case: EditCase, *, cot: bool = False) -> tuple[Document, str]:
    """The document to prefill and the query to ask for one case.

    Chat models: the record is one user turn (part of the document, so edits see the same
    frame), the question a second user turn followed by the opened assistant turn. Base models:
    the record, then ``Question: ... Answer:``.
    """
    question = f"{case.question} {COT_INSTRUCTION}" if cot else case.question
    tok = engine.tokenizer
    if has_template(tok):
        head, tail = turn_frame(tok, "user")
        doc = Document([head, *case.document.parts, tail])
        return doc, chat_turn(tok, "user", question, generation_prompt=True)
    return case.document, f"\nQuestion: {question}\n" + ("Reasoning:" if cot else "Answer:")


def spread(cases: Sequence[EditCase], per_family: int) -> list[EditCase]:
    """``per_family`` cases of each family, evenly spaced through it (so they cover its value
    pairs rather than repeating the first one), taken round-robin across families (so a run
    stopped early still covers every family)."""
    by_family: dict[str, list[EditCase]] = {}
    for c in cases:
        by_family.setdefault(c.family, []).append(c)
    picked = [[g[i * len(g) // min(per_family, len(g))] for i in range(min(per_family, len(g)))]
              for g in by_family.values()]
    return [g[i] for i in range(per_family) for g in picked if i < len(g)]


def take_shard(cases: Sequence[EditCase], shard: str) -> list[EditCase]:
    """``"K/N"``: every N-th case starting at the K-th (1-based), so N processes together run
    each case once."""
    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise InvalidArgumentError(f"bad shard {shard!r}; write K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise InvalidArgumentError(f"bad shard {shard!r}: K must be between 1 and N")
    return list(cases[k - 1::n])


@dataclass(frozen=True, slots=True)
class StrategyRow:
    """One strategy on one case, measured against recompute of the new value."""

    strategy: str  # the spec, e.g. "repair:attention:32"
    family: str
    case_id: str
    decision: str | None
    identical: bool  # same decision as recompute(new)
    sensitive: bool  # recompute decides differently for the old and the new value
    recovered: bool  # sensitive and identical
    cosine: float
    kl: float
    top1_agree: bool
    margin: float  # first-token logit of recompute(new)'s answer minus the best other answer
    tokens_total: int
    tokens_recomputed: int
    tokens_appended: int
    compute_fraction: float
    select_tokens: float
    seconds: float
    ttft: float
    ttft_ratio: float  # (edit + question) / (recompute + question), wall clock
    text: str  # the CoT text ("" without CoT)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case: the reference decisions for the old and new value and one row per strategy."""

    case_id: str
    family: str
    field: str
    old_value: str
    new_value: str
    decision_old: str | None
    decision_new: str | None
    expected_old: str | None
    expected_new: str | None
    sensitive: bool
    tokens: int
    answer_logits_old: tuple[float, ...]  # first-token logit per answer, recompute(old)
    answer_logits_new: tuple[float, ...]
    answers: tuple[str, ...]
    text_old: str
    text_new: str
    rows: tuple[StrategyRow, ...]

    def row(self, strategy: str) -> StrategyRow | None:
        return next((r for r in self.rows if r.strategy == strategy), None)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(answer_logits_old=list(self.answer_logits_old),
                 answer_logits_new=list(self.answer_logits_new), answers=list(self.answers),
                 rows=[r.to_dict() for r in self.rows])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        """Read back :meth:`to_dict` (a ``results.json`` case; older files may lack answers)."""
        names = {f.name for f in fields(StrategyRow)}
        rows = tuple(StrategyRow(**{k: v for k, v in r.items() if k in names}) for r in d["rows"])
        answers = d.get("answers") or _suite_answers().get(d["case_id"], [])
        return cls(**{**{f.name: d.get(f.name) for f in fields(cls)},
                      "answer_logits_old": tuple(d["answer_logits_old"]),
                      "answer_logits_new": tuple(d["answer_logits_new"]),
                      "answers": tuple(answers), "rows": rows})


def evaluate_case(engine: Engine, case: EditCase, strategies: Sequence[str] = DEFAULT_STRATEGIES,
                  *, cot: bool = False, budget: int = 96, batch: bool = True) -> CaseResult:
    """One case: the reference decisions and one row per strategy (see module docstring).

    Every strategy's edit is made first; the question is then asked on each notebook. With
    ``cot`` and ``batch`` (the default) the chains of thought of all of them (old value,
    recompute and every strategy) are decoded as one batch (:func:`decide_batch`): one forward
    per reasoning token instead of one per strategy and token. Each edit and each first token
    is still timed alone, so the TTFT columns mean the same either way.
    """
    specs = [(s, *parse_strategy(s)) for s in strategies]
    doc, query = case_prompt(engine, case, cot=cot)
    nb_old = engine.prefill(doc)
    ref_nb, ref_report = engine.edit(nb_old, case.field, case.new_value, strategy="recompute")
    edits: list[tuple[str, Notebook, Any]] = []
    memo: dict[Any, Any] = {}  # repair selection scores, shared by the budgets k
    for label, name, options in specs:
        if name == "recompute":
            edits.append((label, ref_nb, ref_report))
            continue
        if name == "repair":
            options = {**options, "memo": memo}
        edits.append((label, *engine.edit(nb_old, case.field, case.new_value, strategy=name,
                                          **options)))
    asked = [nb_old, ref_nb, *(nb for _, nb, _ in edits if nb is not ref_nb)]
    decisions = iter(decide_batch(engine, asked, query, case.answers, cot=cot, budget=budget)
                     if batch else
                     [decide(engine, nb, query, case.answers, cot=cot, budget=budget)
                      for nb in asked])
    d_old, d_new = next(decisions), next(decisions)
    ttft_ref = ref_report.seconds + d_new.first_seconds
    sensitive = d_old.answer != d_new.answer
    rows = []
    for label, nb, report in edits:
        d = d_new if nb is ref_nb else next(decisions)
        cmp = compare_logits(d_new.logits, d.logits)
        ttft = report.seconds + d.first_seconds
        rows.append(StrategyRow(
            strategy=label, family=case.family, case_id=case.case_id, decision=d.answer,
            identical=d.answer == d_new.answer, sensitive=sensitive,
            recovered=sensitive and d.answer == d_new.answer,
            cosine=cmp.cosine, kl=cmp.kl, top1_agree=cmp.top1_agree,
            margin=_margin(list(d.scores.values()), case.answers, d_new.answer),
            tokens_total=report.tokens_total, tokens_recomputed=report.tokens_recomputed,
            tokens_appended=report.tokens_appended, compute_fraction=report.compute_fraction,
            select_tokens=report.select_tokens, seconds=report.seconds,
            ttft=ttft, ttft_ratio=ttft / ttft_ref if ttft_ref else float("nan"), text=d.text,
        ))
    return CaseResult(
        case_id=case.case_id, family=case.family, field=case.field,
        old_value=case.old_value, new_value=case.new_value,
        decision_old=d_old.answer, decision_new=d_new.answer,
        expected_old=case.expected_old, expected_new=case.expected_new,
        sensitive=sensitive, tokens=len(ref_nb),
        answer_logits_old=tuple(d_old.scores.values()),
        answer_logits_new=tuple(d_new.scores.values()),
        answers=tuple(case.answers), text_old=d_old.text, text_new=d_new.text, rows=tuple(rows),
    )


def _margin(scores: Sequence[float], answers: Sequence[str], target: str | None) -> float:
    """Logit of recompute(new)'s answer minus the best other answer (first tokens)."""
    if target is None or target not in answers:
        return float("nan")
    i = list(answers).index(target)
    others = [s for j, s in enumerate(scores) if j != i]
    return scores[i] - max(others) if others else float("nan")


def run_suite(engine: Engine, cases: Iterable[EditCase],
              strategies: Sequence[str] = DEFAULT_STRATEGIES, *, cot: bool = False,
              budget: int = 96, progress: Callable[[int, int], None] | None = None,
              checkpoint: Callable[[dict[str, Any]], None] | None = None,
              batch: bool = True, done: Iterable[CaseResult] = (), workers: int = 1,
              loader: Callable[[], Engine] | None = None,
              threads: int | None = None) -> dict[str, Any]:
    """Evaluate every case and aggregate per strategy and per family.

    ``batch``: decode each case's chains of thought as one batch (see :func:`evaluate_case`).

    ``checkpoint`` is called with the aggregate so far after every case (to write partial
    results during long runs). ``done``: results of an earlier run with the same settings
    (:func:`load_results`); cases found there are taken as they are instead of run again
    (``seconds`` is then this run's wall time only, and ``n_resumed`` counts the cases taken).

    ``workers=N`` (N > 1) evaluates the cases in N worker processes, each loading its own
    engine with ``loader`` (picklable: a module-level function or a ``functools.partial`` of
    one; it must load the model ``engine`` is) and running ``threads`` torch threads (default:
    the physical cores shared out). Each worker takes the next case as soon as it is free, so
    slow cases do not hold the others back; results come back in case order whatever order
    they finish in. The workers share the machine, so the timing columns are not quiet figures
    (``workers`` is recorded). A case that raises, or a worker that dies, stops the run with
    :class:`WorkerError`; the checkpoints written until then keep every finished case.
    """
    cases = list(cases)
    for s in strategies:
        parse_strategy(s)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers must be a number of processes >= 1, got {workers!r}")
    if workers > 1 and loader is None:
        raise InvalidArgumentError("workers > 1 needs a loader: each worker process loads its "
                                   "own engine")
    earlier = {r.case_id: r for r in done}
    todo = [c for c in cases if c.case_id not in earlier]
    finished = {c.case_id: earlier[c.case_id] for c in cases if c.case_id in earlier}
    resumed = len(finished)
    n_workers = min(workers, len(todo)) if workers > 1 else 1
    t0 = time.perf_counter()

    def summary() -> dict[str, Any]:
        results = [finished[c.case_id] for c in cases if c.case_id in finished]
        out = _summary(engine, results, strategies, cot, budget, t0, len(cases), batch, resumed)
        return {**out, "workers": n_workers} if n_workers > 1 else out

    if progress and resumed:
        progress(resumed, len(cases))
    if n_workers > 1:
        assert loader is not None
        evaluated = _in_workers(engine, loader, todo, strategies, cot=cot, budget=budget,
                                batch=batch, workers=n_workers,
                                threads=threads or max(1, physical_cores() // n_workers))
    else:
        evaluated = (evaluate_case(engine, case, strategies, cot=cot, budget=budget, batch=batch)
                     for case in todo)
    for result in evaluated:
        finished[result.case_id] = result
        if progress:
            progress(len(finished), len(cases))
        if checkpoint and len(finished) < len(cases):
            checkpoint(summary())
    return summary()


def _in_workers(engine: Engine, loader: Callable[[], Engine], cases: list[EditCase],
                strategies: Sequence[str], *, cot: bool, budget: int, batch: bool,
                workers: int, threads: int) -> Iterator[CaseResult]:
    """:func:`evaluate_case` of every case in ``workers`` spawned processes (a shared queue of
    cases, one engine per process), yielded as they finish."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
    jobs: Any = ctx.Queue()
    results: Any = ctx.Queue()
    for case in cases:
        jobs.put(case)
    for _ in range(workers):
        jobs.put(None)  # one stop sign per worker
    settings = (list(strategies), cot, budget, batch, threads, engine.name)
    procs = [ctx.Process(target=_worker, args=(loader, settings, jobs, results), daemon=True,
                         name=f"edit-eval-worker-{i + 1}") for i in range(workers)]
    for p in procs:
        p.start()
    try:
        left = len(cases)
        while left:
            try:
                kind, case_id, payload = results.get(timeout=2.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(
                        f"{dead[0].name} died (exit code {dead[0].exitcode}; out of memory?) "
                        f"with {left} cases unfinished; the cases done so far are in the "
                        "checkpoint: rerun with --resume") from None
                continue
            if kind == "error":
                where = f" on case {case_id}" if case_id else ""
                raise WorkerError(f"an edit-eval worker failed{where}: {payload}")
            left -= 1
            yield CaseResult.from_dict(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)


def _worker(loader: Callable[[], Engine], settings: tuple, jobs: Any, results: Any) -> None:
    """One worker process: load the engine, then evaluate cases from ``jobs`` until a stop
    sign; every outcome (a result or an error) goes to ``results``."""
    import torch

    strategies, cot, budget, batch, threads, name = settings
    torch.set_num_threads(threads)
    try:
        engine = loader()
        if engine.name != name:
            raise InvalidArgumentError(f"the worker loaded {engine.name!r}, not {name!r}")
    except Exception as err:  # reported to the parent, which stops the run
        results.put(("error", None, f"loading the model: {type(err).__name__}: {err}"))
        return
    while (case := jobs.get()) is not None:
        try:
            result = evaluate_case(engine, case, strategies, cot=cot, budget=budget,
                                   batch=batch)
        except Exception as err:
            results.put(("error", case.case_id, f"{type(err).__name__}: {err}"))
            return
        results.put(("done", case.case_id, result.to_dict()))


def load_results(path: str | Path, engine: Engine, strategies: Sequence[str], *, cot: bool,
                budget: int) -> list[CaseResult]:
    """The case results of an earlier ``results.json`` (a finished run or a
    checkpoint), for :func:`run_suite`'s ``done``. A missing file gives nothing to resume; a
    file that cannot be read or was written with other settings (model, CoT, budget,
    strategies) raises, so results measured differently are never mixed into one table."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        settings = {"model": data["model"], "cot": bool(data["cot"]),
                    "budget": data["budget"], "strategies": list(data["strategies"])}
        cases = [CaseResult.from_dict(c) for c in data["cases"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidArgumentError(
            f"cannot resume from {path}: not a readable edit-eval results.json ({err}); "
            "move it away or choose another --out") from None
    wanted = {"model": engine.name, "cot": cot, "budget": budget if cot else None,
              "strategies": list(strategies)}
    differ = [k for k in wanted if settings[k] != wanted[k]]
    if differ:
        raise InvalidArgumentError(
            f"cannot resume from {path}: it was run with other settings ("
            + ", ".join(f"{k}: {settings[k]!r} there, {wanted[k]!r} now" for k in differ)
            + "); choose another --out or the same settings")
    return cases


def _summary(engine: Engine, results: list[CaseResult], strategies: Sequence[str],
             cot: bool, budget: int, t0: float, planned: int,
             batch: bool = True, resumed: int = 0) -> dict[str, Any]:
    """The JSON-ready result: settings, aggregates and every case (as dicts)."""
    return {
        "model": engine.name, "cot": cot, "budget": budget if cot else None,
        "cot_batched": cot and batch,
        "strategies": list(strategies), "n_cases": len(results), "n_planned": planned,
        "n_resumed": resumed,
        "n_sensitive": sum(r.sensitive for r in results),
        "recompute_matches_expected": {
            "old": sum(r.decision_old == r.expected_old for r in results),
            "new": sum(r.decision_new == r.expected_new for r in results),
        },
        "seconds": time.perf_counter() - t0,
        **aggregates(results, strategies),
        "cases": [r.to_dict() for r in results],
    }


def aggregates(results: Sequence[CaseResult], strategies: Sequence[str]) -> dict[str, Any]:
    """``per_strategy`` over all cases and ``per_family``: the same within each family."""
    return {
        "per_strategy": aggregate(results, strategies),
        "per_family": {fam: aggregate([r for r in results if r.family == fam], strategies)
                       for fam in sorted({r.family for r in results})},
    }


def aggregate(results: Sequence[CaseResult], strategies: Sequence[str]) -> dict[str, Any]:
    """Per-strategy summary over case results."""
    out = {}
    for s in strategies:
        rows = [row for r in results for row in r.rows if row.strategy == s]
        if not rows:
            continue
        sens = [row for row in rows if row.sensitive]
        effects = [e for r in results if (e := _effect(r, s)) is not None]
        intended = [row.decision == r.expected_new for r in results for row in r.rows
                    if row.strategy == s and r.expected_new is not None]
        out[s] = {
            "n": len(rows),
            "n_field_moved": len(effects),
            "intended_new": _mean(intended) if intended else None,
            "effect_median": statistics.median(effects) if effects else None,
            "identity": _mean(row.identical for row in rows),
            "flips": sum(not row.identical for row in rows),
            "n_sensitive": len(sens),
            "recovery": _mean(row.identical for row in sens) if sens else None,
            "cosine_mean": _mean(row.cosine for row in rows),
            "cosine_median": statistics.median(row.cosine for row in rows),
            "kl_mean": _mean(row.kl for row in rows),
            "kl_median": statistics.median(row.kl for row in rows),
            "top1_agree": _mean(row.top1_agree for row in rows),
            "compute_fraction": _mean(row.compute_fraction for row in rows),
            "select_fraction": _mean(row.select_tokens / row.tokens_total for row in rows),
            "ttft_ratio_median": statistics.median(row.ttft_ratio for row in rows),
        }
    return out


MIN_FIELD_EFFECT = 1.0  # logits: below this the field barely moves the decision (DESIGN.md)


def _effect(case: CaseResult, strategy: str) -> float | None:
    """Normalized effect of one strategy on one case, or None when the field barely moves it.

    With m the first-token logit margin of recompute(new)'s answer over the best other answer:
    (m_strategy - m_old) / (m_new - m_old); 1 = moved as far as recompute, 0 = still the old
    value. Only cases where |m_new - m_old| >= MIN_FIELD_EFFECT count.
    """
    row = case.row(strategy)
    if not case.answers or row is None:
        return None
    m_old = _margin(case.answer_logits_old, case.answers, case.decision_new)
    m_new = _margin(case.answer_logits_new, case.answers, case.decision_new)
    if not abs(m_new - m_old) >= MIN_FIELD_EFFECT:
        return None
    return (row.margin - m_old) / (m_new - m_old)


def _suite_answers() -> dict[str, list[str]]:
    from kvnotes.eval.tasks import load_suite

    return {c.case_id: list(c.answers) for c in load_suite()}


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


# ---- writing ------------------------------------------------------------------------------------
def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def strategy_table(per_strategy: dict[str, Any]) -> list[str]:
    """Markdown table rows for a per-strategy aggregate."""
    lines = ["| strategy | identity | flips | recovery (sensitive) | logit cos (mean) "
             "| KL (median) | top-1 | normalized effect (median, n) | intended (new) "
             "| compute frac | selection frac | TTFT ratio (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, a in per_strategy.items():
        rec = (f"{a['recovery']:.3f} ({a['n_sensitive']})" if a["recovery"] is not None
               else "– (0)")
        eff = (f"{a['effect_median']:.2f} ({a['n_field_moved']})"
               if a.get("effect_median") is not None else "– (0)")
        lines.append(f"| {s} | {a['identity']:.3f} | {a['flips']}/{a['n']} | {rec} | "
                     f"{a['cosine_mean']:.4f} | {a['kl_median']:.4f} | {a['top1_agree']:.3f} | "
                     f"{eff} | {_fmt(a.get('intended_new'))} | {a['compute_fraction']:.3f} | "
                     f"{a['select_fraction']:.3f} | "
                     f"{a['ttft_ratio_median']:.3f} |")
    return lines


def family_table(result: dict[str, Any]) -> list[str]:
    """Markdown: recovery on sensitive cases (and sensitive count) per family and strategy."""
    strategies = result["strategies"]
    lines = ["| family | sensitive | " + " | ".join(strategies) + " |",
             "|---|---|" + "---|" * len(strategies)]
    for fam, agg in result["per_family"].items():
        first = next(iter(agg.values()))
        cells = []
        for s in strategies:
            a = agg.get(s)
            cells.append("–" if a is None or a["recovery"] is None
                         else f"{a['recovery']:.2f} / {a['identity']:.2f}")
        lines.append(f"| {fam} | {first['n_sensitive']}/{first['n']} | " + " | ".join(cells) + " |")
    return lines


def write_outputs(result: dict[str, Any], out: str | Path) -> dict[str, Path]:
    """``results.json``, ``report.md`` and ``edit.png`` in ``out`` (keys json, report, plot)."""
    return write_bundle(out, result, report=report_markdown(result), json_name="results.json",
                        plot_name=CHART, plot=lambda path: plot(result, path))


def report_markdown(result: dict[str, Any]) -> str:
    """The markdown report of a :func:`run_suite` result."""
    expected = result["recompute_matches_expected"]
    n = result["n_cases"]
    lines = [
        f"# Edit evaluation: {result['model']}",
        "",
        *([f"**Partial: {n} of {result['n_planned']} cases done.**", ""]
          if result.get("n_planned", n) != n else []),
        *([f"{result['n_resumed']} of the {n} cases were taken from an earlier run with the "
           "same settings (`--resume`, `--resume-from`); the wall time below is this run's "
           "alone.", ""]
          if result.get("n_resumed") else []),
        *([f"{result['workers']} worker processes ran the cases side by side (`--workers`), "
           "so the TTFT ratios and timings are not quiet-machine figures.", ""]
          if result.get("workers", 1) > 1 else []),
        f"{n} cases, {result['n_sensitive']} sensitive (recompute decides differently for the old "
        f"and the new value). Recompute(old) matches the task author's intended answer in "
        f"{expected['old']}/{n} cases, recompute(new) in {expected['new']}/{n}.",
        "",
        ("Decisions: chain of thought, greedy up to "
         f"{result['budget']} tokens, answer parsed from the text; cosine/KL at the first "
         "generated token." if result["cot"] else
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
        *strategy_table(result["per_strategy"]),
        "",
        "## Per family (recovery on sensitive / identity on all)",
        "",
        *family_table(result),
        "",
        f"![edit strategies]({CHART})",
        "",
        f"Wall time: {result['seconds']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Bar chart: recovery on sensitive cases and compute fraction per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = result["per_strategy"]
    names = list(agg)
    recovery = [agg[s]["recovery"] if agg[s]["recovery"] is not None else 0.0 for s in names]
    identity = [agg[s]["identity"] for s in names]
    compute = [agg[s]["compute_fraction"] for s in names]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.2))
    x = range(len(names))
    w = 0.28
    ax.bar([i - w for i in x], recovery, w,
           label=f"recovery (sensitive, n={result['n_sensitive']})")
    ax.bar(list(x), identity, w, label="identity (all cases)")
    ax.bar([i + w for i in x], compute, w, label="compute fraction")
    ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"edit strategies vs recompute: {result['model']}"
                 + (" (CoT)" if result["cot"] else ""))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rewrite_report(folder: str | Path) -> dict[str, Path]:
    """Re-aggregate ``folder/results.json`` and write the report and chart again (after the
    metrics or tables change, without re-running the models)."""
    folder = Path(folder)
    result = json.loads((folder / "results.json").read_text())
    cases = [CaseResult.from_dict(c) for c in result["cases"]]
    result.update(aggregates(cases, result["strategies"]))
    return write_outputs(result, folder)


def compare_strategies(engine: Engine, case: EditCase, strategies: Sequence[str] | None = None,
                       *, cot: bool = False) -> tuple[StrategyRow, ...]:
    """Every strategy on one :class:`~kvnotes.eval.tasks.EditCase`, side by side (for the demo):
    one :class:`StrategyRow` per strategy, compared with recompute of the new value."""
    return evaluate_case(engine, case, strategies or DEFAULT_STRATEGIES, cot=cot).rows
