"""The tool benchmark's loop: every case, every strategy, against the exact prompt.

Cases alternate between two halves. The calibration half runs first; each guard without a
fixed threshold then gets the smallest ``tau`` that makes its base strategy's decisions match
the exact prompt's on that half (up to ``guard_target``), and runs, for real, on the
evaluation half only, where it is reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import machine_info
from kvnotes.core.metrics import compare_logits
from kvnotes.core.notebook import Notebook
from kvnotes.ops.decisions import Decision, guarded
from kvnotes.research.tool_runs import (
    BenchResult,
    CaseResult,
    GuardPoint,
    Outcome,
    Skipped,
    StrategySummary,
)
from kvnotes_bench.tools.bfcl_check import check_call
from kvnotes_bench.tools.choice import NameTrie, choose, name_trie
from kvnotes_bench.tools.data import ToolCase, load_cases, spread
from kvnotes_bench.tools.prompt import CasePrompt, case_prompt
from kvnotes_bench.tools.strategies import (
    DEFAULT_STRATEGIES,
    SkillCache,
    Strategy,
    build,
    exact_ids,
    parse_strategies,
    variants,
)

DECISION = ("constrained name decoding after '{\"name\": \"' over the candidates' full names "
            "(first-token scoring where their first tokens differ)")
Progress = Callable[[int, int, str], None]  # (done, total, case id)


@dataclass(frozen=True, slots=True)
class ToolsBenchConfig:
    """What ``kvnotes-bench tools`` runs."""

    set: str = "live_multiple"
    cases: int = 40  # spread over the set's file; 0: all
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    greedy_tokens: int = 0  # 16-token greedy identity when > 0 (costs a decode per strategy)
    # > 0: decode this many tokens (at least greedy_tokens) and run BFCL's AST checker on the
    # call each answer writes (live_multiple)
    call_tokens: int = 0
    max_context: int | None = None  # default: the model's maximum positions
    guard_target: float = 1.0  # calibrated guards match exact on this share of the half
    skill_opening: str = ""  # every skill's text starts with this after its newline ("": none)
    data_root: Path | None = None  # default: the installed bfcl-eval package
    settings: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # checked when the config is made, so a bad option fails before any model loads
        for name, value in (("cases", self.cases), ("greedy_tokens", self.greedy_tokens),
                            ("call_tokens", self.call_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be a whole number >= 0 (0: "
                                           f"{'all cases' if name == 'cases' else 'off'}), "
                                           f"got {value!r}")
        if self.max_context is not None and (isinstance(self.max_context, bool)
                                             or not isinstance(self.max_context, int)
                                             or self.max_context < 1):
            raise InvalidArgumentError(f"max_context must be a positive number of tokens, got "
                                       f"{self.max_context!r}")
        if not 0 < self.guard_target <= 1:
            raise InvalidArgumentError(f"guard_target must be in (0, 1], got {self.guard_target!r}")
        if not isinstance(self.skill_opening, str) or (self.skill_opening
                                                       and not self.skill_opening.strip()):
            raise InvalidArgumentError(f"skill_opening must be text with something visible in "
                                       f"it, e.g. 'Function:\\n' (empty: none), got "
                                       f"{self.skill_opening!r}")


@dataclass(slots=True)
class _Read:
    """A strategy's notes with the opening fed, the decision there and what it cost."""

    notes: Notebook
    step_notes: Notebook
    logits: torch.Tensor
    decision: Decision
    seconds: float


def _read(engine: Engine, nb: Notebook, q_ids: list[int], trie: NameTrie, built_s: float) -> _Read:
    t0 = time.perf_counter()
    step = engine.forward(nb, q_ids)
    fed = time.perf_counter() - t0
    return _Read(nb, step.notebook, step.logits, choose(engine, step.notebook, step.logits, trie),
                 built_s + fed)


def _outcome(strategy: str, read: _Read, exact: _Read, case: ToolCase, q: int, *,
             stats: dict[str, Any], guard: tuple[bool, int, float] | None = None,
             library: tuple[int, int] | None = None) -> Outcome:
    cmp = compare_logits(exact.logits, read.logits)
    total = len(read.notes) + q
    reused, repaired = int(stats.get("reused", 0)), int(stats.get("repaired", 0))
    computed = int(stats.get("computed", len(read.notes))) + q
    exact_parts = stats.get("exact")
    return Outcome(
        strategy=strategy, choice=str(read.decision.answer),
        exact_choice=str(exact.decision.answer), correct=read.decision.answer in case.answers,
        margin=read.decision.margin, first_token_agree=cmp.top1_agree, kl=cmp.kl,
        cosine=cmp.cosine, exact_top2_margin=cmp.top2_margin_reference, tokens_total=total,
        reused=reused, computed=computed, repaired=repaired,
        select_tokens=float(stats.get("select_tokens", 0.0)),
        guard_tokens=guard[1] if guard else 0, spliced=reused + repaired, ttft_s=read.seconds,
        guard_fired=guard[0] if guard else None, guard_tau=guard[2] if guard else None,
        exact_skills=len(exact_parts) if isinstance(exact_parts, list) else None,
        variants_new=library[0] if library else None,
        skills_new=library[1] if library else None)


def run_case(engine: Engine, case: ToolCase, prompt: CasePrompt, strategies: Sequence[Strategy],
             skills: SkillCache, *, half: str, taus: dict[str, float],
             greedy_tokens: int = 0, call_tokens: int = 0) -> CaseResult:
    """Every strategy on one case (guards only where ``taus`` or their own ``tau`` give one)."""
    q_ids = engine.encode(prompt.query)
    trie = name_trie(engine, case.candidates)
    ids, prefix = exact_ids(engine, prompt)
    reads: dict[str, _Read] = {}
    outcomes: list[Outcome] = []
    library: dict[str, tuple[int, int]] = {}
    for s in strategies:
        if s.kind == "guard":
            continue
        if s.kind == "compose":
            library[s.name] = skills.record(s.name, variants(prompt, s))
        compiling, t0 = skills.seconds, time.perf_counter()
        nb = build(engine, prompt, s, skills)
        # a skill is compiled once and reused: its first use's compile is not request time
        built = time.perf_counter() - t0 - (skills.seconds - compiling)
        reads[s.name] = _read(engine, nb, q_ids, trie, built)
    exact = reads["exact"]
    for s in strategies:
        if s.kind == "guard":
            continue
        stats = reads[s.name].notes.meta.get("compose", {}) if s.kind == "compose" else {}
        outcomes.append(_outcome(s.name, reads[s.name], exact, case, len(q_ids), stats=stats,
                                 library=library.get(s.name)))
    for s in strategies:
        tau = s.tau if s.tau is not None else taus.get(s.name)
        if s.kind != "guard" or tau is None:
            continue
        base = reads[s.base]

        def decide_on(nb: Notebook) -> Decision:
            step = engine.forward(nb, q_ids)
            return choose(engine, step.notebook, step.logits, trie)

        decision, notes = guarded(engine, base.notes, decide_on, tau=tau,
                                  extra_tokens=len(q_ids), exact_from=prefix)
        g = decision.guard
        assert g is not None
        read = base
        if g.fired:
            step = engine.forward(notes, q_ids)
            read = _Read(notes, step.notebook, step.logits, decision, base.seconds + g.seconds)
        reads[s.name] = read
        stats = base.notes.meta.get("compose", {})
        outcomes.append(_outcome(s.name, read, exact, case, len(q_ids), stats=stats,
                                 guard=(g.fired, g.tokens, tau)))
    if greedy_tokens > 0 or call_tokens > 0:
        outcomes = _with_greedy(engine, outcomes, reads, greedy_tokens, case=case,
                                call_tokens=call_tokens)
    return CaseResult(case.id, half, len(trie.names), len(case.skills), len(ids) + len(q_ids),
                      prefix, case.answers, tuple(outcomes))


def _with_greedy(engine: Engine, outcomes: list[Outcome], reads: dict[str, _Read],
                 n: int, *, case: ToolCase | None = None, call_tokens: int = 0
                 ) -> list[Outcome]:
    """Each strategy's greedy continuation after the opening, decoded as one batch (rows of
    equal length: no padding), its first ``n`` tokens compared with the exact prompt's; with
    ``call_tokens`` (and a ``case`` with BFCL's answers), decoded that far and the call it
    writes checked by BFCL's AST checker."""
    names = [o.strategy for o in outcomes]
    rows = engine.continue_greedy_batch([reads[s].step_notes for s in names],
                                        torch.stack([reads[s].logits for s in names]),
                                        max(n, call_tokens))
    ids = {s: r.token_ids[:n] for s, r in zip(names, rows, strict=True)} if n else {}
    texts = {s: engine.decode(t) for s, t in ids.items()}
    checks = {}
    if call_tokens and case is not None and "ground_truth" in case.meta:
        checks = {s: check_call(r.text, case.meta["functions"], case.meta["ground_truth"])
                  for s, r in zip(names, rows, strict=True)}
    out = []
    for o in outcomes:
        if n:
            o = replace(o, greedy_text=texts[o.strategy],
                        greedy_identical=texts[o.strategy] == texts["exact"])
        if o.strategy in checks:
            c = checks[o.strategy]
            o = replace(o, call_parsed=c.parsed, call_valid=bool(c.valid))
        out.append(o)
    return out


def calibrate_tau(cases: Sequence[CaseResult], base: str, target: float) -> float:
    """The smallest margin threshold under which re-deciding makes ``base``'s decisions equal
    the exact prompt's on at least ``target`` of ``cases`` (0: the guard never fires)."""
    outs = [o for c in cases if (o := c.outcome(base)) is not None]
    if not outs:
        return 0.0
    flips = sorted(o.margin for o in outs if not o.identical and not math.isnan(o.margin))
    for tau in [0.0, *(m + 1e-4 for m in flips)]:
        same = sum(o.identical or (not math.isnan(o.margin) and o.margin < tau) for o in outs)
        if same >= target * len(outs) - 1e-9:
            return tau
    return flips[-1] + 1e-4 if flips else 0.0


def guard_curve(cases: Sequence[CaseResult], base: str, taus: Sequence[float]
                ) -> list[GuardPoint]:
    """Identity and compute of ``guard:base`` at each ``tau``, read offline from the base's
    margins (a fired guard recomputes every token after the exact prefix)."""
    points = []
    rows = [(c, o) for c in cases if (o := c.outcome(base)) is not None]
    for tau in taus:
        same = fires = 0
        fractions, shares = [], []
        for c, o in rows:
            fired = not math.isnan(o.margin) and o.margin < tau
            fires += fired
            same += fired or o.identical
            extra = (c.tokens - c.exact_prefix) if fired else 0
            fractions.append((o.computed + o.repaired + o.select_tokens + extra) / c.tokens)
            shares.append((o.repaired + o.select_tokens + extra) / max(1, o.spliced))
        points.append(GuardPoint(base, tau, len(rows), same, fires,
                                 sum(fractions) / max(1, len(fractions)),
                                 sum(shares) / max(1, len(shares))))
    return points


def run_bench(engine: Engine, config: ToolsBenchConfig, *, model: str,
              progress: Progress | None = None,
              on_case: Callable[[CaseResult], None] | None = None) -> BenchResult:
    """The benchmark on ``config.cases`` cases of ``config.set`` (see the module doc)."""
    strategies = parse_strategies(list(config.strategies))
    all_cases = spread(load_cases(config.set, config.data_root), config.cases)
    limit = config.max_context or engine.adapter.max_positions or 1 << 30
    before = machine_info()
    skills = SkillCache(engine)
    fits: list[tuple[ToolCase, CasePrompt, str]] = []
    skipped: list[Skipped] = []
    for i, case in enumerate(all_cases):
        prompt = case_prompt(engine.tokenizer, case, config.skill_opening)
        n = len(exact_ids(engine, prompt)[0]) + len(engine.encode(prompt.query))
        if n + config.greedy_tokens > limit:
            skipped.append(Skipped(case.id, f"{n} tokens (+{config.greedy_tokens} generated) do "
                                            f"not fit the context limit of {limit}", n))
        else:
            fits.append((case, prompt, "calibrate" if i % 2 == 0 else "evaluate"))
    ordered = [f for f in fits if f[2] == "calibrate"] + [f for f in fits if f[2] == "evaluate"]
    results: list[CaseResult] = []
    taus: dict[str, float] = {}
    for done, (case, prompt, half) in enumerate(ordered):
        if half == "evaluate" and not taus:
            calibrated = [r for r in results if r.half == "calibrate"]
            taus = {s.name: calibrate_tau(calibrated, s.base, config.guard_target)
                    for s in strategies if s.kind == "guard" and s.tau is None}
        if progress:
            progress(done, len(ordered), case.id)
        result = run_case(engine, case, prompt, strategies, skills, half=half, taus=taus,
                          greedy_tokens=config.greedy_tokens, call_tokens=config.call_tokens)
        results.append(result)
        if on_case:
            on_case(result)
    if progress:
        progress(len(ordered), len(ordered), "")
    return assemble(results, strategies, model=model, set_name=config.set, taus=taus,
                    skipped=skipped, machine=dict(machine_info(since=before)),
                    settings={"cases_asked": config.cases, "greedy_tokens": config.greedy_tokens,
                              "call_tokens": config.call_tokens, "context_limit": limit,
                              "guard_target": config.guard_target,
                              "skill_opening": config.skill_opening,
                              "variants_compiled": skills.compiled,
                              "compile_seconds": round(skills.seconds, 3), **config.settings})


def assemble(results: Sequence[CaseResult], strategies: Sequence[Strategy], *, model: str,
             set_name: str, taus: dict[str, float], skipped: Sequence[Skipped] = (),
             machine: dict[str, object] | None = None,
             settings: dict[str, object] | None = None) -> BenchResult:
    """Summaries and the offline guard curve over measured cases: the end of a run, or the
    cases a stopped run left in its ``cases.jsonl``."""
    summaries = []
    for s in strategies:
        scope = [r for r in results if r.half == "evaluate"] if (
            s.kind == "guard" and s.tau is None) else list(results)
        summaries.append(StrategySummary.of(s.name, scope))
    curve: list[GuardPoint] = []
    for base in dict.fromkeys(s.base for s in strategies if s.kind == "guard"):
        margins = sorted({o.margin for r in results if (o := r.outcome(base)) is not None
                          and not math.isnan(o.margin)})
        grid = [0.0, *(m + 1e-4 for m in margins)]
        curve += guard_curve(results, base, grid)
    return BenchResult(
        model=model, set=set_name, strategies=tuple(s.name for s in strategies),
        decision=DECISION, cases=tuple(results), skipped=tuple(skipped),
        summaries=tuple(summaries), guard_curve=tuple(curve), taus=taus,
        machine=dict(machine or {}), settings=dict(settings or {}))
