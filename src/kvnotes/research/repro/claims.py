"""The paper's claims (``apps/data/paper_claims.json``, each with its source) and the verdicts.

:func:`judge` is a pure function of a claim's figure and our typed stage results
(:class:`StageResults`, as :mod:`kvnotes.research.repro.run` measures them): ``holds``, ``does not
hold``, ``inconclusive`` (a CI that spans the paper's figure), ``not measurable`` (the field does
not move the decision on this model, so there is no denominator) or ``not run``. Timing claims
measured on a busy machine say so.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvnotes.apps.demo import ComposeDemoResult
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.records import Json
from kvnotes.research.agent.summary import BenchSummary
from kvnotes.research.edit.results import SuiteResult
from kvnotes.research.tool_runs import StoredRun, StrategySummary
from kvnotes.research.trace.suite import CaseOutcome, TraceSuiteResult, bootstrap_mean

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
NOT_MEASURABLE, NOT_RUN = "not measurable", "not run"
COT_RECOVERY_OK = 0.95  # "1.00 at 8B": recovery at or above this counts as holding

# families whose answer is the field's own value (docs/design.md: there the field KV carries
# it); the paper's claim is about decisions a policy derives from the field, so they are
# reported apart
RETRIEVAL_FAMILIES = ("lookup", "capital_recall")

# ---------------------------------------------------------------------------------------------
# the paper's claims


@dataclass(frozen=True, slots=True)
class PaperSource:
    title: str
    arxiv: str
    url: str
    where: str  # where in the paper the figures are stated

    def to_dict(self) -> dict[str, str]:
        return {"title": self.title, "arxiv": self.arxiv, "url": self.url, "where": self.where}


# a claim's numbers by name (its unit is kept beside them)
Figure = dict[str, float]


@dataclass(frozen=True, slots=True)
class Claim:
    """One figure of the paper, where it is stated, and how kvnotes checks it."""

    id: str
    title: str
    paper: str  # the paper's words
    figure: Figure  # the figure's numbers; the keys depend on the claim
    scale: str
    source: str
    check: str
    timing: bool = False  # a timing: marked when measured on a busy machine
    project: bool = False  # kvnotes' own claim (``paper`` holds its words), not the paper's
    unit: str = ""  # what the figure's numbers measure (kept in the figure in the JSON)

    def to_dict(self) -> Json:
        figure: Json = {**self.figure, **({"unit": self.unit} if self.unit else {})}
        d: Json = {"id": self.id, "title": self.title, "paper": self.paper, "figure": figure,
                   "scale": self.scale, "source": self.source, "check": self.check}
        d = {**d, "timing": True} if self.timing else d
        return {**d, "project": True} if self.project else d


@dataclass(frozen=True, slots=True)
class Claims:
    source: PaperSource
    claims: tuple[Claim, ...]

    def get(self, claim_id: str) -> Claim:
        found = next((c for c in self.claims if c.id == claim_id), None)
        if found is None:
            raise UnknownNameError("paper claim", claim_id, [c.id for c in self.claims])
        return found


def load_claims(path: str | Path | None = None) -> Claims:
    """The paper's figures: the bundled ``paper_claims.json`` or the file at ``path``."""
    if path is None:
        text = (resources.files("kvnotes.apps") / "data" / "paper_claims.json").read_text()
    else:
        text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    for claim in data["claims"]:
        missing = [k for k in ("id", "paper", "figure", "source") if not claim.get(k)]
        if missing:
            raise InvalidArgumentError(f"paper claim {claim.get('id')!r} lacks {missing}; every "
                                       "claim needs its figure and its source")
    src = data["source"]
    return Claims(
        source=PaperSource(*(str(src.get(k, "")) for k in ("title", "arxiv", "url", "where"))),
        claims=tuple(Claim(c["id"], c.get("title", c["id"]), c["paper"],
                           {k: v for k, v in c["figure"].items() if k != "unit"},
                           c.get("scale", ""), c["source"], c.get("check", ""),
                           bool(c.get("timing", False)), unit=c["figure"].get("unit", ""))
                     for c in data["claims"]))


# ---------------------------------------------------------------------------------------------
# verdicts: pure functions of a claim's figure and our stage results


@dataclass(frozen=True, slots=True)
class StageResults:
    """One model's finished stages (None: not run)."""

    compose: ComposeDemoResult | None = None
    edit: SuiteResult | None = None
    edit_cot: SuiteResult | None = None
    trace: TraceSuiteResult | None = None
    agent: BenchSummary | None = None
    tools: tuple[StoredRun, ...] = ()  # stored `kvnotes-bench tools` runs of this model


@dataclass(frozen=True, slots=True)
class Verdict:
    """Our figure for one claim on one model, the verdict, and why."""

    ours: str
    verdict: str
    why: str = ""

    def to_dict(self) -> Json:
        return {"ours": self.ours, "verdict": self.verdict, "why": self.why}


def judge(claim: Claim, stages: StageResults, *, busy: bool = False) -> Verdict:
    """Our figure for one claim on one model and the verdict (``not run`` when the stage it
    needs is missing); ``busy`` marks timing claims as measured under load."""
    if claim.id not in JUDGES:
        raise UnknownNameError("paper claim", claim.id, sorted(JUDGES))
    out = JUDGES[claim.id](claim.figure, stages)
    if claim.timing and busy and out.verdict in (HOLDS, FAILS):
        return Verdict(out.ours, out.verdict + " (measured under load)", out.why)
    return out


def _judge_compose(fig: Figure, stages: StageResults) -> Verdict:
    data = stages.compose
    if data is None or not data.cases:
        return Verdict("-", NOT_RUN)
    cases = [c.fidelity for c in data.cases]
    cos = [c.logit_cosine for c in cases]
    n = len(cases)
    ours = (f"cosine min {min(cos):.4f}, median {statistics.median(cos):.4f} (n={n}); KL median "
            f"{statistics.median(c.kl for c in cases):.3f}; top-1 same "
            f"{sum(bool(c.top1_agree) for c in cases)}/{n}; continuation identical "
            f"{sum(bool(c.continuation_identical) for c in cases)}/{n}; recompute top-2 "
            f"margin median {statistics.median(c.top2_margin for c in cases):.2f}")
    if min(cos) >= fig["low"]:
        return Verdict(ours, HOLDS, f"every case at or above {fig['low']} (min {min(cos):.4f}, "
                                    f"n={n})")
    return Verdict(ours, FAILS, f"{sum(c < fig['low'] for c in cos)}/{n} cases below "
                                f"{fig['low']}")


def _judge_field(fig: Figure, stages: StageResults) -> Verdict:
    data = stages.trace
    if data is None:
        return Verdict("-", NOT_RUN)
    traced = [c for c in data.cases if c.status == "traced"]
    decision = [c for c in traced if c.family not in RETRIEVAL_FAMILIES]
    retrieval = [c for c in traced if c.family in RETRIEVAL_FAMILIES]
    sens = [c for c in decision if c.sensitive]
    rsens = [c for c in retrieval if c.sensitive]

    def ci(cases: Sequence[CaseOutcome], effect: Callable[[CaseOutcome], float | None]) -> str:
        return str(bootstrap_mean([_num(effect(c)) for c in cases]))

    def field(c: CaseOutcome) -> float | None:
        return c.field

    def notes(c: CaseOutcome) -> float | None:
        return c.notes

    skipped = len(data.cases) - len(traced)
    aside = (f"; retrieval families ({', '.join(RETRIEVAL_FAMILIES)}; the answer is the field's "
             f"value): field KV {ci(rsens, field)}, notes {ci(rsens, notes)} over "
             f"{len(rsens)} sensitive of {len(retrieval)}" if retrieval else "")
    counts = (f"decision families: {len(sens)} sensitive, {len(decision) - len(sens)} "
              f"insensitive{f', {skipped} skipped' if skipped else ''}")
    if not sens:
        return Verdict(counts + aside, NOT_MEASURABLE,
                       "the field does not move the decision (abs(m_new - m_old) < 1 logit) in "
                       f"any of the {len(decision)} traced decision cases")
    est = bootstrap_mean([_num(c.field) for c in sens])
    ours = f"field KV {ci(sens, field)}, notes {ci(sens, notes)}; {counts}{aside}"
    below, n = fig["below"], f"field KV {est} over {len(sens)} sensitive cases"
    if est.hi < below:
        return Verdict(ours, HOLDS, f"{n}: the CI lies below {below}")
    if est.lo > below:
        return Verdict(ours, FAILS, f"{n}: the CI lies above {below}")
    return Verdict(ours, INCONCLUSIVE, f"{n}: the CI spans {below}")


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


@dataclass(frozen=True, slots=True)
class Pool:
    """One strategy pooled over a group of families."""

    n: int
    n_sensitive: int
    recovered: int
    compute_fraction: float  # mean over the cases

    def __str__(self) -> str:
        return f"{self.recovered}/{self.n_sensitive} sensitive of {self.n}"


def overwrite_pool(result: SuiteResult | None, retrieval: bool = False,
                   strategy: str = "overwrite") -> Pool | None:
    """The 'overwrite' strategy (or ``strategy``) pooled over the decision families (or the
    retrieval ones)."""
    if result is None or not result.per_family:
        return None
    rows = [fam[strategy] for name, fam in result.per_family.items()
            if strategy in fam and (name in RETRIEVAL_FAMILIES) == retrieval]
    if not rows:
        return None
    n = sum(r.n for r in rows)
    return Pool(n=n, n_sensitive=sum(r.n_sensitive for r in rows),
                recovered=round(sum((r.recovery or 0) * r.n_sensitive for r in rows)),
                compute_fraction=sum(r.compute_fraction * r.n for r in rows) / n)


def _judge_cot(fig: Figure, stages: StageResults) -> Verdict:
    cot = overwrite_pool(stages.edit_cot)
    if cot is None:
        return Verdict("-", NOT_RUN)
    plain = overwrite_pool(stages.edit)
    aside = f"; without CoT {plain}" if plain else ""
    rcot = overwrite_pool(stages.edit_cot, retrieval=True)
    aside += (f"; retrieval families with CoT (the answer is the field's value) {rcot}"
              if rcot else "")
    ours = (f"decision families: recovered {cot}, compute {cot.compute_fraction:.1%}{aside}")
    if not cot.n_sensitive:
        return Verdict(ours, NOT_MEASURABLE,
                       f"the field moves recompute's CoT decision in 0 of {cot.n} decision cases")
    recovery = cot.recovered / cot.n_sensitive
    got = f"recovery {cot.recovered}/{cot.n_sensitive} = {recovery:.2f}"
    if recovery >= COT_RECOVERY_OK:
        return Verdict(ours, HOLDS, f"{got} >= {COT_RECOVERY_OK}")
    return Verdict(ours, FAILS, f"{got} < {COT_RECOVERY_OK}")


def _judge_erratum(fig: Figure, stages: StageResults) -> Verdict:
    over = overwrite_pool(stages.edit)
    err = overwrite_pool(stages.edit, strategy="erratum")
    if over is None or err is None:
        return Verdict("-", NOT_RUN, "needs the edit stage with the overwrite and erratum "
                                     "strategies")
    ours = f"decision families without CoT: overwrite recovered {over}; erratum recovered {err}"
    if not over.n_sensitive:
        return Verdict(ours, NOT_MEASURABLE,
                       f"the field moves recompute's decision in 0 of {over.n} decision cases")
    r_over, r_err = over.recovered / over.n_sensitive, err.recovered / err.n_sensitive
    lo, hi = fig["overwrite_recovers_at_most"], fig["erratum_recovers_at_least"]
    misses = ([f"overwrite recovery {over.recovered}/{over.n_sensitive} = {r_over:.2f} > {lo}: "
               "the field-only edit does not fail"] if r_over > lo else [])
    misses += ([f"erratum recovery {err.recovered}/{err.n_sensitive} = {r_err:.2f} < {hi}"]
               if r_err < hi else [])
    if misses:
        return Verdict(ours, FAILS, "; ".join(misses))
    return Verdict(ours, HOLDS, f"overwrite recovery {over.recovered}/{over.n_sensitive} = "
                                f"{r_over:.2f} <= {lo}, erratum {err.recovered}/"
                                f"{err.n_sensitive} = {r_err:.2f} >= {hi}")


def _judge_agent_identity(fig: Figure, stages: StageResults) -> Verdict:
    data = stages.agent
    if data is None or not data.decisions:
        return Verdict("-", NOT_RUN)
    ours = (f"identity {data.identity:.1%} ({data.decisions - data.flip_count}/"
            f"{data.decisions}); recompute margin median {data.recompute_margin_median:.2f}")
    if data.identity >= fig["value"]:
        return Verdict(ours, HOLDS)
    return Verdict(ours, FAILS, f"{data.flip_count} flips")


def _judge_agent_speedup(fig: Figure, stages: StageResults) -> Verdict:
    data = stages.agent
    if data is None or not data.decisions:
        return Verdict("-", NOT_RUN)
    lat = data.latency
    ours = (f"{lat.ratio:.1f}x (recompute {lat.recompute_mean_turn_s * 1e3:.0f} ms, kvnotes "
            f"{lat.kvnotes_mean_turn_s * 1e3:.0f} ms per turn)")
    if lat.ratio >= fig["value"]:
        return Verdict(ours, HOLDS)
    return Verdict(ours, FAILS, f"below {fig['value']}x")


# kvnotes' own claim, checked on public data by `kvnotes-bench tools` (its runs take hours on
# a CPU, so the verdict reads their stored results instead of running them)
TOOLS_CLAIM = Claim(
    id="tools_indistinguishable",
    title="Composition on public tool documentation: indistinguishable from recompute",
    paper="composed notes decide like recompute: the tool choice identical to the exact "
          "prompt in >= 99% of cases at <= 15% of the spliced tokens recomputed, accuracy "
          "against the ground truth within 1 point of the exact prompt's",
    figure={"identity": 0.99, "recompute_share": 0.15, "accuracy_points": 1.0},
    unit="share of cases whose tool choice equals the exact prompt's",
    scale="SmolLM2-135M and Gemma-3-270M on BFCL v4 live_multiple and multi_turn",
    source="kvnotes (docs/bench/tools.md)",
    check="read from the stored `kvnotes-bench tools` results (docs/results/tools/*/"
          "results.json), per development set the run with the most cases: holds when some "
          "composed strategy (guard fires counted as full recomputes) is identical to the exact "
          "prompt in >= 99% of cases at <= 15% of the spliced tokens recomputed with accuracy "
          "within 1 point of the exact prompt's, on every set measured; does not hold otherwise",
    project=True)


def _rate(s: StrategySummary) -> float:
    return s.identical / s.cases if s.cases else 0.0


def _row(s: StrategySummary) -> str:
    return (f"{s.strategy} {s.identical}/{s.cases} ({_rate(s):.0%}) identical at "
            f"{s.recompute_share:.1%} recompute, right tool {s.correct}/{s.cases} vs exact "
            f"{s.exact_correct}/{s.cases}")


def _judge_tools(fig: Figure, stages: StageResults) -> Verdict:
    by_set: dict[str, StoredRun] = {}
    for run in stages.tools:  # per set the run with the most cases, then the latest
        best = by_set.get(run.set)
        if best is None or (run.cases, run.date) > (best.cases, best.date):
            by_set[run.set] = run
    if not by_set:
        return Verdict("-", NOT_RUN, "no stored `kvnotes-bench tools` results for this model "
                                     "under docs/results/tools (docs/bench/tools.md)")
    parts, misses = [], []
    for name, run in sorted(by_set.items()):
        rows = [s for s in run.summaries if s.strategy != "exact" and s.cases]
        within = [s for s in rows if s.recompute_share <= fig["recompute_share"]]
        pick = max(within, key=lambda s: (_rate(s), -s.recompute_share), default=None)
        top = max(rows, key=lambda s: (_rate(s), -s.recompute_share), default=None)
        text = (f"{name} (`{run.folder}`, {run.date}, load {run.load_1min:.1f}): within "
                f"{fig['recompute_share']:.0%} recompute, " + (_row(pick) if pick else "none"))
        if top is not None and top is not pick:
            text += f"; best at any cost {_row(top)}"
        parts.append(text)
        accurate = pick is not None and 100 * abs(pick.correct - pick.exact_correct) \
            <= fig["accuracy_points"] * pick.cases
        if pick is None or _rate(pick) < fig["identity"] or not accurate:
            misses.append(f"{name}: {_rate(pick) if pick else 0:.0%} identical"
                          + ("" if accurate or pick is None else ", accuracy off by "
                             f"{abs(pick.correct - pick.exact_correct)}/{pick.cases}")
                          + f" at <= {fig['recompute_share']:.0%} recompute")
    ours = "; ".join(parts)
    if misses:
        return Verdict(ours, FAILS, "not reproduced: " + "; ".join(misses))
    return Verdict(ours, HOLDS, f">= {fig['identity']:.0%} identical within "
                                f"{fig['recompute_share']:.0%} recompute on every set")


def _judge_vllm(fig: Figure, stages: StageResults) -> Verdict:
    return Verdict("-", NOT_RUN, "needs a vLLM server: run `kvnotes-bench serve` (see "
                                 "docs/bench/skills.md)")


JUDGES: dict[str, Callable[[Figure, StageResults], Verdict]] = {
    "composition_cosine": _judge_compose, "field_kv_share": _judge_field,
    "cot_field_edit": _judge_cot, "erratum_vs_overwrite": _judge_erratum,
    "agent_identity": _judge_agent_identity,
    "agent_speedup": _judge_agent_speedup, "vllm_prefix_cache": _judge_vllm,
    TOOLS_CLAIM.id: _judge_tools,
}
