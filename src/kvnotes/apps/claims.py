"""The paper's claims (``apps/data/paper_claims.json``, each with its source) and the verdicts.

:func:`judge` is a pure function of a claim's figure and our stage results (as
:mod:`kvnotes.apps.repro` writes them): ``holds``, ``does not hold``, ``inconclusive`` (a CI that
spans the paper's figure), ``not measurable`` (the field does not move the decision on this
model, so there is no denominator) or ``not run``. Timing claims measured on a busy machine say so.
"""

from __future__ import annotations

import json
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
NOT_MEASURABLE, NOT_RUN = "not measurable", "not run"
COT_RECOVERY_OK = 0.95  # "1.00 at 8B": recovery at or above this counts as holding

# ---------------------------------------------------------------------------------------------
# the paper's claims


def load_claims(path: str | Path | None = None) -> dict[str, Any]:
    """The paper's figures: ``{"source": {...}, "claims": [{id, paper, figure, source}, ...]}``."""
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
    return data


# ---------------------------------------------------------------------------------------------
# verdicts: pure functions of a claim's figure and our stage results


def judge(claim: dict[str, Any], stages: dict[str, Any], *, busy: bool = False) -> dict[str, Any]:
    """Our figure for one claim on one model and the verdict.

    ``stages`` maps stage name to its result (a missing stage gives ``not run``); ``busy``
    marks timing claims as measured under load. Returns ``{"ours", "verdict", "why"}``.
    """
    judges = {"composition_cosine": _judge_compose, "field_kv_share": _judge_field,
              "cot_field_edit": _judge_cot, "agent_identity": _judge_agent_identity,
              "agent_speedup": _judge_agent_speedup, "vllm_prefix_cache": _judge_vllm}
    if claim["id"] not in judges:
        raise UnknownNameError("paper claim", claim["id"], sorted(judges))
    out = judges[claim["id"]](claim["figure"], stages)
    if claim.get("timing") and busy and out["verdict"] in (HOLDS, FAILS):
        out["verdict"] += " (measured under load)"
    return out


def _result(ours: str, verdict: str, why: str = "") -> dict[str, Any]:
    return {"ours": ours, "verdict": verdict, "why": why}


def _judge_compose(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    data = stages.get("compose")
    if not data or not data.get("cases"):
        return _result("-", NOT_RUN)
    cases = data["cases"]
    cos = [c["logit_cosine"] for c in cases]
    n = len(cases)
    ours = (f"cosine min {min(cos):.4f}, median {statistics.median(cos):.4f} (n={n}); KL median "
            f"{statistics.median(c['kl'] for c in cases):.3f}; top-1 same "
            f"{sum(bool(c['top1_agree']) for c in cases)}/{n}; continuation identical "
            f"{sum(bool(c['continuation_identical']) for c in cases)}/{n}; recompute top-2 "
            f"margin median {statistics.median(c['top2_margin'] for c in cases):.2f}")
    if min(cos) >= fig["low"]:
        return _result(ours, HOLDS, f"every case at or above {fig['low']}")
    return _result(ours, FAILS, f"{sum(c < fig['low'] for c in cos)}/{n} cases below "
                                f"{fig['low']}")


def trace_overall(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The summary row over every traced family (``all``, or the only family)."""
    rows = trace.get("families") or []
    return next((r for r in rows if r["family"] == "all"), rows[-1] if rows else None)


# families whose answer is the field's own value (DESIGN.md: there the field KV carries it); the
# paper's claim is about decisions a policy derives from the field, so they are reported apart
RETRIEVAL_FAMILIES = ("lookup", "capital_recall")


def _judge_field(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    from kvnotes.eval.trace_suite import bootstrap_mean

    data = stages.get("trace")
    if not data or "cases" not in data:
        return _result("-", NOT_RUN)
    traced = [c for c in data["cases"] if c["status"] == "traced"]
    decision = [c for c in traced if c["family"] not in RETRIEVAL_FAMILIES]
    retrieval = [c for c in traced if c["family"] in RETRIEVAL_FAMILIES]
    sens = [c for c in decision if c["sensitive"]]
    rsens = [c for c in retrieval if c["sensitive"]]

    def ci(cases: list[dict[str, Any]], key: str) -> str:
        e = bootstrap_mean([c[key] for c in cases])
        return ci_text({"mean": e.mean, "lo": e.lo, "hi": e.hi, "n": e.n})

    skipped = len(data["cases"]) - len(traced)
    aside = (f"; retrieval families ({', '.join(RETRIEVAL_FAMILIES)}; the answer is the field's "
             f"value): field KV {ci(rsens, 'field')}, notes {ci(rsens, 'notes')} over "
             f"{len(rsens)} sensitive of {len(retrieval)}" if retrieval else "")
    counts = (f"decision families: {len(sens)} sensitive, {len(decision) - len(sens)} "
              f"insensitive{f', {skipped} skipped' if skipped else ''}")
    if not sens:
        return _result(counts + aside, NOT_MEASURABLE,
                       "the field does not move the decision (abs(m_new - m_old) < 1 logit) in "
                       "any traced decision case")
    est = bootstrap_mean([c["field"] for c in sens])
    ours = f"field KV {ci(sens, 'field')}, notes {ci(sens, 'notes')}; {counts}{aside}"
    below = fig["below"]
    if est.hi < below:
        return _result(ours, HOLDS, f"the CI lies below {below}")
    if est.lo > below:
        return _result(ours, FAILS, f"the CI lies above {below}")
    return _result(ours, INCONCLUSIVE, f"the CI spans {below}")


def ci_text(e: dict[str, Any]) -> str:
    if not e or not e.get("n"):
        return "n/a"
    return f"{e['mean']:.2f} [{e['lo']:.2f}, {e['hi']:.2f}]"


def overwrite_pool(result: dict[str, Any] | None, retrieval: bool = False) -> dict[str, Any] | None:
    """The 'overwrite' strategy pooled over the decision families (or the retrieval ones):
    ``n``, ``n_sensitive``, ``recovered`` and the mean ``compute_fraction``."""
    per_family = (result or {}).get("per_family")
    if not per_family:
        return None
    rows = [fam["overwrite"] for name, fam in per_family.items()
            if "overwrite" in fam and (name in RETRIEVAL_FAMILIES) == retrieval]
    if not rows:
        return None
    n = sum(r["n"] for r in rows)
    return {"n": n, "n_sensitive": sum(r["n_sensitive"] for r in rows),
            "recovered": round(sum((r["recovery"] or 0) * r["n_sensitive"] for r in rows)),
            "compute_fraction": sum(r["compute_fraction"] * r["n"] for r in rows) / n}


def _pool_text(p: dict[str, Any] | None) -> str:
    return "n/a" if p is None else f"{p['recovered']}/{p['n_sensitive']} sensitive of {p['n']}"


def _judge_cot(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    cot = overwrite_pool(stages.get("edit_cot"))
    if cot is None:
        return _result("-", NOT_RUN)
    plain = overwrite_pool(stages.get("edit"))
    aside = (f"; without CoT {_pool_text(plain)}" if plain else "")
    rcot = overwrite_pool(stages.get("edit_cot"), retrieval=True)
    aside += (f"; retrieval families with CoT (the answer is the field's value) "
              f"{_pool_text(rcot)}" if rcot else "")
    ours = (f"decision families: recovered {_pool_text(cot)}, compute "
            f"{cot['compute_fraction']:.1%}{aside}")
    if not cot["n_sensitive"]:
        return _result(ours, NOT_MEASURABLE,
                       "the field does not move recompute's CoT decision in any decision case")
    recovery = cot["recovered"] / cot["n_sensitive"]
    if recovery >= COT_RECOVERY_OK:
        return _result(ours, HOLDS, f"recovery {recovery:.2f} >= {COT_RECOVERY_OK}")
    return _result(ours, FAILS, f"recovery {recovery:.2f} < {COT_RECOVERY_OK}")


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _judge_agent_identity(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    data = stages.get("agent")
    if not data or not data.get("decisions"):
        return _result("-", NOT_RUN)
    ours = (f"identity {data['identity']:.1%} ({data['decisions'] - data['flip_count']}/"
            f"{data['decisions']}); recompute margin median {data['recompute_margin_median']:.2f}")
    if data["identity"] >= fig["value"]:
        return _result(ours, HOLDS)
    return _result(ours, FAILS, f"{data['flip_count']} flips")


def _judge_agent_speedup(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    data = stages.get("agent")
    if not data or not data.get("decisions"):
        return _result("-", NOT_RUN)
    lat = data["latency"]
    ours = (f"{lat['ratio']:.1f}x (recompute {lat['recompute_mean_turn_s'] * 1e3:.0f} ms, kvnotes "
            f"{lat['kvnotes_mean_turn_s'] * 1e3:.0f} ms per turn)")
    if lat["ratio"] >= fig["value"]:
        return _result(ours, HOLDS)
    return _result(ours, FAILS, f"below {fig['value']}x")


def _judge_vllm(fig: dict[str, Any], stages: dict[str, Any]) -> dict[str, Any]:
    return _result("-", NOT_RUN, "needs a vLLM server: run `kvnotes serve-bench` (see "
                                 "docs/serving.md)")
