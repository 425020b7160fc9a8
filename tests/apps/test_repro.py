"""kvnotes repro: the claims file, the verdicts on synthetic numbers, resuming from checkpoints."""

from __future__ import annotations

import json
import re

import pytest

from kvnotes.apps import repro
from kvnotes.apps.claims import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    NOT_MEASURABLE,
    NOT_RUN,
    judge,
    load_claims,
)
from kvnotes.apps.repro import run_repro
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError


def claim(cid: str) -> dict:
    return next(c for c in load_claims()["claims"] if c["id"] == cid)


def est(mean: float, lo: float, hi: float, n: int = 4) -> dict:
    return {"mean": mean, "lo": lo, "hi": hi, "n": n}


def compose_result(cosines) -> dict:
    return {"cases": [{"case": f"c{i}", "logit_cosine": c, "kl": 0.01, "top1_agree": True,
                       "continuation_identical": True, "top2_margin": 1.0, "tokens_total": 10,
                       "tokens_reused": 8, "speedup": 3.0} for i, c in enumerate(cosines)]}


def trace_result(fields, insensitive: int = 2, retrieval: float = 0.9) -> dict:
    """Sensitive decision cases with these field effects, insensitive ones, one retrieval case."""
    case = {"status": "traced", "reason": "", "denominator": 2.0}
    cases = [{**case, "case_id": f"r{i}", "family": "refund", "sensitive": True, "field": f,
              "notes": 1 - f} for i, f in enumerate(fields)]
    cases += [{**case, "case_id": f"i{i}", "family": "access", "sensitive": False, "field": 0.3,
               "notes": 0.1, "denominator": 0.2} for i in range(insensitive)]
    cases += [{**case, "case_id": "l0", "family": "lookup", "sensitive": True,
               "field": retrieval, "notes": 0.1}]
    row = {"family": "all", "n_cases": len(cases), "n_sensitive": len(fields) + 1,
           "n_insensitive": insensitive, "n_skipped_length": 0, "n_skipped_other": 0,
           "median_abs_denominator": 2.0, "field": est(0.5, 0.1, 0.9), "notes": est(0.5, 0.1, 0.9)}
    return {"families": [row], "cases": cases}


def edit_result(recovery, n_sensitive: int) -> dict:
    """'overwrite' on a decision family (these figures) and on lookup (always recovered)."""
    def row(rec, sens):
        return {"n": 4, "n_sensitive": sens, "recovery": rec, "compute_fraction": 0.02,
                "identity": 1.0, "flips": 0, "cosine_mean": 1.0, "kl_mean": 0.0,
                "top1_agree": 1.0, "ttft_ratio_median": 0.1, "intended_new": None,
                "effect_median": None, "n_field_moved": 0, "cosine_median": 1.0,
                "kl_median": 0.0, "select_fraction": 0.0}
    return {"n_cases": 8, "n_sensitive": n_sensitive + 2,
            "per_strategy": {"overwrite": row(recovery, n_sensitive + 2)},
            "per_family": {"refund": {"overwrite": row(recovery, n_sensitive)},
                           "lookup": {"overwrite": row(1.0, 2)}}}


def agent_result(identity: float, ratio: float) -> dict:
    return {"decisions": 10, "flip_count": round(10 * (1 - identity)), "identity": identity,
            "recompute_margin_median": 1.5, "episodes": 2, "turns_per_episode": 5,
            "latency": {"ratio": ratio, "recompute_mean_turn_s": ratio * 0.01,
                        "kvnotes_mean_turn_s": 0.01},
            "tokens": {"kvnotes_computed": 10, "recompute_computed": 100}}


def test_claims_file_loads_and_every_claim_has_a_source():
    data = load_claims()
    assert "2606.17107" in data["source"]["arxiv"]
    ids = [c["id"] for c in data["claims"]]
    assert len(ids) == len(set(ids)) >= 6
    for c in data["claims"]:
        assert c["source"] and c["paper"] and c["figure"] and c["check"]
        judge(c, {})  # every claim has a verdict function


def test_a_claim_without_source_is_refused(tmp_path):
    path = tmp_path / "claims.json"
    path.write_text(json.dumps({"source": {}, "claims": [{"id": "x", "paper": "p",
                                                         "figure": {"value": 1}}]}))
    with pytest.raises(InvalidArgumentError, match="lacks \\['source'\\]"):
        load_claims(path)


def test_unknown_claim_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="composition_cosine"):
        judge({"id": "nope", "figure": {}}, {})


@pytest.mark.parametrize(("cosines", "verdict"), [([0.95, 0.999], HOLDS), ([0.95, 0.85], FAILS)])
def test_composition_verdict(cosines, verdict):
    r = judge(claim("composition_cosine"), {"compose": compose_result(cosines)})
    assert r["verdict"] == verdict
    assert f"min {min(cosines):.4f}" in r["ours"]


@pytest.mark.parametrize(("fields", "verdict"), [
    ([0.001, 0.002, 0.003, 0.004], HOLDS),
    ([0.8, 0.9, 0.85, 0.95], FAILS),
    ([-0.05, 0.08, 0.0, 0.02], INCONCLUSIVE),
])
def test_field_share_verdict(fields, verdict):
    r = judge(claim("field_kv_share"), {"trace": trace_result(fields)})
    assert r["verdict"] == verdict
    assert "decision families: 4 sensitive, 2 insensitive" in r["ours"]


def test_field_share_not_measurable_when_the_field_never_moves_the_decision():
    # only the retrieval case (the answer is the field's value) is sensitive: it is reported
    # beside the verdict, never counted as a decision
    r = judge(claim("field_kv_share"), {"trace": trace_result([], insensitive=6)})
    assert r["verdict"] == NOT_MEASURABLE
    assert "decision families: 0 sensitive, 6 insensitive" in r["ours"]
    assert "field KV 0.90 [0.90, 0.90], notes 0.10 [0.10, 0.10] over 1 sensitive of 1" in r["ours"]


@pytest.mark.parametrize(("recovery", "n", "verdict"), [
    (1.0, 4, HOLDS), (0.5, 4, FAILS), (None, 0, NOT_MEASURABLE)])
def test_cot_edit_verdict_counts_decision_families_only(recovery, n, verdict):
    stages = {"edit_cot": edit_result(recovery, n), "edit": edit_result(0.0, 3)}
    r = judge(claim("cot_field_edit"), stages)
    assert r["verdict"] == verdict
    assert f"decision families: recovered {round((recovery or 0) * n)}/{n} sensitive of 4" in r["ours"]
    assert "without CoT 0/3 sensitive of 4" in r["ours"]
    assert "retrieval families with CoT (the answer is the field's value) 2/2" in r["ours"]


def test_agent_verdicts_and_the_load_mark():
    stages = {"agent": agent_result(1.0, 3.2)}
    assert judge(claim("agent_identity"), stages)["verdict"] == HOLDS
    assert judge(claim("agent_identity"), {"agent": agent_result(0.9, 3.2)})["verdict"] == FAILS
    assert judge(claim("agent_speedup"), stages)["verdict"] == FAILS
    assert judge(claim("agent_speedup"), stages, busy=True)["verdict"] == (
        FAILS + " (measured under load)")
    assert judge(claim("agent_speedup"), {"agent": agent_result(1.0, 20.0)})["verdict"] == HOLDS
    # identity is not a timing: load does not mark it
    assert judge(claim("agent_identity"), stages, busy=True)["verdict"] == HOLDS


def test_missing_stages_are_not_run():
    for c in load_claims()["claims"]:
        assert judge(c, {})["verdict"] == NOT_RUN


SYNTHETIC = {"compose": compose_result([0.99, 0.98]), "edit": edit_result(0.0, 3),
             "edit_cot": edit_result(1.0, 2), "trace": trace_result([0.05, 0.1]),
             "agent": agent_result(1.0, 2.0)}


def test_resume_skips_finished_stages(monkeypatch, tmp_path):
    ran, loads = [], []
    monkeypatch.setattr(repro, "_run_stage",
                        lambda stage, *a: ran.append(stage) or SYNTHETIC[stage])

    def load(model, *, device, dtype):
        loads.append((model, device, dtype))
        return object()

    paths = run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == list(repro.STAGES) * 2 and len(loads) == 2
    assert (tmp_path / "a" / "trace.json").is_file() and (tmp_path / "c" / "agent.json").is_file()
    report = paths["report"].read_text()
    assert "| a | cosine min 0.9800" in report and paths["plot"].is_file()
    assert re.search(r"All stages together: \*\*\d+\.\d min\*\*", report)
    data = json.loads(paths["json"].read_text())
    assert {v["id"] for v in data["verdicts"]} >= {"composition_cosine", "vllm_prefix_cache"}

    # an interrupted run: one stage file gone, one damaged -> only those two run again
    (tmp_path / "a" / "edit.json").unlink()
    (tmp_path / "c" / "trace.json").write_text("{")
    ran.clear(), loads.clear()
    run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == ["edit", "trace"] and [m for m, *_ in loads] == ["a", "b/c"]

    # everything finished: no model is loaded at all
    ran.clear(), loads.clear()
    run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == [] and loads == []

    # other settings (full sizes, another dtype) do not reuse the quick checkpoints
    run_repro(["a"], tmp_path, load=load, quick=True, dtype="bfloat16", stages=["compose"])
    assert ran == ["compose"] and loads == [("a", "cpu", "bfloat16")]


def test_unknown_stage_and_no_models_are_refused(tmp_path):
    with pytest.raises(UnknownNameError, match="valid repro stages: compose"):
        run_repro(["a"], tmp_path, stages=["nope"])
    with pytest.raises(InvalidArgumentError, match="--models"):
        run_repro([], tmp_path)


def test_report_only_runs_nothing_and_marks_missing_stages(monkeypatch, tmp_path):
    monkeypatch.setattr(repro, "_run_stage", lambda stage, *a: SYNTHETIC[stage])
    load = lambda model, **k: object()  # noqa: E731
    run_repro(["a"], tmp_path, load=load, stages=["compose"])
    monkeypatch.setattr(repro, "_run_stage", lambda *a: pytest.fail("ran a stage"))
    paths = run_repro(["a"], tmp_path, load=lambda *a, **k: pytest.fail("loaded"),
                      report_only=True)
    data = json.loads(paths["json"].read_text())
    got = {v["id"]: v["models"]["a"]["verdict"] for v in data["verdicts"]}
    assert got["composition_cosine"] == HOLDS and got["field_kv_share"] == NOT_RUN
