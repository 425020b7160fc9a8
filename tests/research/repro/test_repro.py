"""kvnotes repro: the claims file, the verdicts on synthetic numbers, resuming from checkpoints."""

from __future__ import annotations

import json
import re

import pytest

from kvnotes.apps.demo import CompiledSkill, ComposeCase, ComposeDemoResult
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.eval.fidelity import FidelityReport
from kvnotes.research.agent.summary import (
    BenchSettings,
    BenchSummary,
    ComputeStats,
    Flip,
    LatencyStats,
    MarginErrorStats,
    SkillStats,
    TokenStats,
)
from kvnotes.research.edit.results import ExpectedMatches, StrategySummary, SuiteResult
from kvnotes.research.repro import run as repro
from kvnotes.research.repro.claims import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    NOT_MEASURABLE,
    NOT_RUN,
    TOOLS_CLAIM,
    Claim,
    StageResults,
    judge,
    load_claims,
)
from kvnotes.research.repro.report import write_report
from kvnotes.research.repro.run import run_repro
from kvnotes.research.tool_runs import StrategySummary as ToolsSummary
from kvnotes.research.tool_runs import stored_runs
from kvnotes.research.trace.suite import CaseOutcome, Estimate, FamilySummary, TraceSuiteResult


def claim(cid: str) -> Claim:
    return load_claims().get(cid)


def est(mean: float, lo: float, hi: float, n: int = 4) -> Estimate:
    return Estimate(mean, lo, hi, n)


def compose_result(cosines) -> ComposeDemoResult:
    def report(cos: float) -> FidelityReport:
        return FidelityReport(logit_cosine=cos, kl=0.01, top1_agree=True, top2_margin=1.0,
                              composed_margin=1.0, continuation_identical=True,
                              recompute_text="a", composed_text="a", tokens_total=10,
                              tokens_reused=8, tokens_computed=2, tokens_repaired=0,
                              compute_fraction=0.2, ttft_recompute_s=0.3, ttft_compose_s=0.1)

    return ComposeDemoResult(
        model="m", skills={"s": CompiledSkill(8, 0.01, "bos", 0)}, repair="f0a1",
        cases=tuple(ComposeCase(f"c{i}", ("s",), report(c)) for i, c in enumerate(cosines)),
        max_new_tokens=4, timing=None)


def trace_result(fields, insensitive: int = 2, retrieval: float = 0.9) -> TraceSuiteResult:
    """Sensitive decision cases with these field effects, insensitive ones, one retrieval case."""
    cases = [CaseOutcome(f"r{i}", "refund", "traced", "", denominator=2.0, sensitive=True,
                         field=f, notes=1 - f) for i, f in enumerate(fields)]
    cases += [CaseOutcome(f"i{i}", "access", "traced", "", denominator=0.2, sensitive=False,
                          field=0.3, notes=0.1) for i in range(insensitive)]
    cases += [CaseOutcome("l0", "lookup", "traced", "", denominator=2.0, sensitive=True,
                          field=retrieval, notes=0.1)]
    row = FamilySummary(family="all", n_cases=len(cases), n_skipped_length=0,
                        n_skipped_other=0, n_insensitive=insensitive,
                        n_sensitive=len(fields) + 1, n_flips=0, median_abs_denominator=2.0,
                        field=est(0.5, 0.1, 0.9), notes=est(0.5, 0.1, 0.9),
                        noising_field=est(0.5, 0.1, 0.9), noising_notes=est(0.5, 0.1, 0.9))
    return TraceSuiteResult("m", (row,), tuple(cases))


def edit_result(recovery, n_sensitive: int) -> SuiteResult:
    """'overwrite' on a decision family (these figures) and on lookup (always recovered)."""
    def row(rec, sens):
        return StrategySummary(n=4, n_field_moved=0, intended_new=None, effect_median=None,
                               identity=1.0, flips=0, n_sensitive=sens, recovery=rec,
                               cosine_mean=1.0, cosine_median=1.0, kl_mean=0.0, kl_median=0.0,
                               top1_agree=1.0, compute_fraction=0.02, select_fraction=0.0,
                               ttft_ratio_median=0.1)
    return SuiteResult(model="m", cot=False, budget=None, cot_batched=False,
                       strategies=("overwrite",), n_cases=8, n_planned=8, n_resumed=0,
                       n_sensitive=n_sensitive + 2,
                       recompute_matches_expected=ExpectedMatches(8, 8), seconds=1.0,
                       per_strategy={"overwrite": row(recovery, n_sensitive + 2)},
                       per_family={"refund": {"overwrite": row(recovery, n_sensitive)},
                                   "lookup": {"overwrite": row(1.0, 2)}},
                       cases=())


def agent_result(identity: float, ratio: float) -> BenchSummary:
    flips = round(10 * (1 - identity))
    flip = Flip(episode="e0", turn=1, kind="refund", kvnotes="yes", recompute="no",
                kvnotes_margin=0.5, recompute_margin=0.7, recompute_scores={"no": 1.0},
                kvnotes_scores={"yes": 1.0}, events_so_far=())
    return BenchSummary(
        settings=BenchSettings("request", 0, True, False, None, 0, True, ("e0", "e1")),
        model="m", episodes=2, turns_per_episode=5, decisions=10, identity=identity,
        flips=(flip,) * flips, per_turn=(),
        latency=LatencyStats(kvnotes_total_s=0.1, recompute_total_s=ratio * 0.1, ratio=ratio,
                             kvnotes_mean_turn_s=0.01, recompute_mean_turn_s=ratio * 0.01),
        tokens=TokenStats(kvnotes_computed=10, kvnotes_reused=90, recompute_computed=100),
        compute=ComputeStats(1.0, ratio, 0.0, ratio, ratio, ratio, 1.0),
        recompute_margin_median=1.5, guard=None,
        fast_margin_error=MarginErrorStats(0.0, 0.0, 0.0, 10), guard_sweep=None,
        skills=SkillStats(("s",), {"s": 8}, 0, 1, 0.1), tool_calls=False)


def test_claims_file_loads_and_every_claim_has_a_source():
    data = load_claims()
    assert "2606.17107" in data.source.arxiv
    ids = [c.id for c in data.claims]
    assert len(ids) == len(set(ids)) >= 6
    for c in data.claims:
        assert c.source and c.paper and c.figure and c.check
        assert judge(c, StageResults()).verdict  # every claim has a verdict function


def test_a_claim_without_source_is_refused(tmp_path):
    path = tmp_path / "claims.json"
    path.write_text(json.dumps({"source": {}, "claims": [{"id": "x", "paper": "p",
                                                         "figure": {"value": 1}}]}))
    with pytest.raises(InvalidArgumentError, match="lacks \\['source'\\]"):
        load_claims(path)


def test_unknown_claim_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="composition_cosine"):
        judge(Claim("nope", "", "", {}, "", "", ""), StageResults())
    with pytest.raises(UnknownNameError, match="valid paper claims: .*agent_identity"):
        load_claims().get("nope")


@pytest.mark.parametrize(("cosines", "verdict"), [([0.95, 0.999], HOLDS), ([0.95, 0.85], FAILS)])
def test_composition_verdict(cosines, verdict):
    r = judge(claim("composition_cosine"), StageResults(compose=compose_result(cosines)))
    assert r.verdict == verdict
    assert f"min {min(cosines):.4f}" in r.ours


@pytest.mark.parametrize(("fields", "verdict"), [
    ([0.001, 0.002, 0.003, 0.004], HOLDS),
    ([0.8, 0.9, 0.85, 0.95], FAILS),
    ([-0.05, 0.08, 0.0, 0.02], INCONCLUSIVE),
])
def test_field_share_verdict(fields, verdict):
    r = judge(claim("field_kv_share"), StageResults(trace=trace_result(fields)))
    assert r.verdict == verdict
    assert "decision families: 4 sensitive, 2 insensitive" in r.ours


def test_field_share_not_measurable_when_the_field_never_moves_the_decision():
    # only the retrieval case (the answer is the field's value) is sensitive: it is reported
    # beside the verdict, never counted as a decision
    r = judge(claim("field_kv_share"), StageResults(trace=trace_result([], insensitive=6)))
    assert r.verdict == NOT_MEASURABLE
    assert "decision families: 0 sensitive, 6 insensitive" in r.ours
    assert "field KV 0.90 [0.90, 0.90], notes 0.10 [0.10, 0.10] over 1 sensitive of 1" in r.ours


@pytest.mark.parametrize(("recovery", "n", "verdict"), [
    (1.0, 4, HOLDS), (0.5, 4, FAILS), (None, 0, NOT_MEASURABLE)])
def test_cot_edit_verdict_counts_decision_families_only(recovery, n, verdict):
    stages = StageResults(edit_cot=edit_result(recovery, n), edit=edit_result(0.0, 3))
    r = judge(claim("cot_field_edit"), stages)
    assert r.verdict == verdict
    assert f"decision families: recovered {round((recovery or 0) * n)}/{n} sensitive of 4" in r.ours
    assert "without CoT 0/3 sensitive of 4" in r.ours
    assert "retrieval families with CoT (the answer is the field's value) 2/2" in r.ours


def test_agent_verdicts_and_the_load_mark():
    stages = StageResults(agent=agent_result(1.0, 3.2))
    assert judge(claim("agent_identity"), stages).verdict == HOLDS
    slower = StageResults(agent=agent_result(0.9, 3.2))
    assert judge(claim("agent_identity"), slower).verdict == FAILS
    assert judge(claim("agent_speedup"), stages).verdict == FAILS
    assert judge(claim("agent_speedup"), stages, busy=True).verdict == (
        FAILS + " (measured under load)")
    faster = StageResults(agent=agent_result(1.0, 20.0))
    assert judge(claim("agent_speedup"), faster).verdict == HOLDS
    # identity is not a timing: load does not mark it
    assert judge(claim("agent_identity"), stages, busy=True).verdict == HOLDS


def test_missing_stages_are_not_run():
    for c in load_claims().claims:
        assert judge(c, StageResults()).verdict == NOT_RUN


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

    run = run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == list(repro.STAGES) * 2 and len(loads) == 2
    paths = write_report(tmp_path, run)
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
    rerun = run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == ["edit", "trace"] and [m for m, *_ in loads] == ["a", "b/c"]
    report = write_report(tmp_path, rerun)["report"].read_text()

    # everything finished: no model is loaded at all, and the typed results read back are
    # the ones measured
    ran.clear(), loads.clear()
    again = run_repro(["a", "b/c"], tmp_path, load=load, quick=True)
    assert ran == [] and loads == []
    for stage, result in SYNTHETIC.items():
        assert again.models["a"][stage].result == result, stage
    assert write_report(tmp_path, again)["report"].read_text() == report

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
    run = run_repro(["a"], tmp_path, load=lambda *a, **k: pytest.fail("loaded"),
                    report_only=True)
    assert list(run.models["a"]) == ["compose"]
    paths = write_report(tmp_path, run)
    data = json.loads(paths["json"].read_text())
    got = {v["id"]: v["models"]["a"]["verdict"] for v in data["verdicts"]}
    assert got["composition_cosine"] == HOLDS and got["field_kv_share"] == NOT_RUN


def tools_summary(strategy: str, identical: int, share: float, *, cases: int = 38,
                  correct: int = 18, exact_correct: int = 18) -> dict:
    return ToolsSummary(strategy=strategy, cases=cases, identical=identical, correct=correct,
                        exact_correct=exact_correct, first_token_agree=identical,
                        kl_median=0.01, kl_mean=0.02, flip_margin_max=0.5, greedy_cases=0,
                        greedy_identical=0, compute_fraction=0.2, recompute_share=share,
                        ttft_ratio_median=2.0, guard_fires=0, guard_tau=None).to_dict()


def write_tools_run(root, folder: str, rows: list[dict], *, model: str = "a",
                    set_name: str = "live_multiple") -> None:
    path = root / folder / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "set": set_name,
                                "settings": {"date": "2026-12-02 00:00 UTC", "command": "c"},
                                "machine": {"load_average": [3.0, 2.0, 1.0]},
                                "summaries": [tools_summary("exact", 38, 0.0), *rows]}))


def test_tool_claim_is_read_from_stored_results_and_follows_the_numbers(tmp_path):
    def verdict(rows, **kw):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        write_tools_run(root, "run", rows, **kw)
        return judge(TOOLS_CLAIM, StageResults(tools=tuple(stored_runs(root, "a"))))

    assert judge(TOOLS_CLAIM, StageResults()).verdict == NOT_RUN
    short = verdict([tools_summary("splice", 26, 0.0), tools_summary("epic:32", 36, 0.12)])
    assert short.verdict == FAILS
    assert short.why == "not reproduced: live_multiple: 95% identical at <= 15% recompute"
    assert "epic:32 36/38 (95%) identical at 12.0% recompute" in short.ours
    held = verdict([tools_summary("epic:32", 38, 0.12)])
    assert held.verdict == HOLDS
    # identical enough only above the budget: the row within it is judged (the splice here)
    costly = verdict([tools_summary("splice", 26, 0.0), tools_summary("epic:64", 38, 0.3)])
    assert costly.verdict == FAILS and "68% identical" in costly.why
    assert "best at any cost epic:64 38/38" in costly.ours
    # accuracy against the ground truth must stay within a point of the exact prompt's
    off = verdict([tools_summary("epic:32", 38, 0.12, correct=17)])
    assert off.verdict == FAILS and "accuracy off by 1/38" in off.why
    # another model's runs are not read
    assert verdict([tools_summary("epic:32", 38, 0.12)], model="b").verdict == NOT_RUN


def test_tool_claim_row_in_the_report_uses_the_largest_run_per_set(tmp_path):
    root = tmp_path / "tools"
    write_tools_run(root, "small", [tools_summary("epic:32", 5, 0.1, cases=5)])
    rows = [tools_summary("epic:32", 35, 0.14)]
    write_tools_run(root, "big", rows)
    run = repro.ReproRun(repro.RunSettings("cpu", "float32", True, repro.QUICK), {"a": {}})
    paths = write_report(tmp_path / "out", run, tools_results=root)
    data = json.loads(paths["json"].read_text())
    row = next(v for v in data["verdicts"] if v["id"] == TOOLS_CLAIM.id)
    assert row["project"] and row["models"]["a"]["verdict"] == FAILS
    assert "`big`" in row["models"]["a"]["ours"] and "`small`" not in row["models"]["a"]["ours"]
    report = paths["report"].read_text()
    assert "## Composition on public tool documentation" in report
    assert "Claim (kvnotes (docs/bench/tools.md)" in report and "92% identical" in report


def two_strategy_edit(over: float | None, err: float | None, n: int) -> SuiteResult:
    base = edit_result(over, n)
    fam = base.per_family["refund"]["overwrite"]
    from dataclasses import replace
    per_family = {"refund": {"overwrite": fam, "erratum": replace(fam, recovery=err)},
                  "lookup": base.per_family["lookup"]}
    return replace(base, strategies=("overwrite", "erratum"), per_family=per_family)


@pytest.mark.parametrize(("over", "err", "verdict", "why"), [
    (0.0, 1.0, HOLDS, "overwrite recovery 0/4 = 0.00 <= 0.5, erratum 4/4 = 1.00 >= 0.95"),
    (1.0, 1.0, FAILS, "overwrite recovery 4/4 = 1.00 > 0.5: the field-only edit does not fail"),
    (0.25, 0.5, FAILS, "erratum recovery 2/4 = 0.50 < 0.95"),
    (None, None, NOT_MEASURABLE, "the field moves recompute's decision in 0 of 4 decision cases"),
])
def test_erratum_vs_overwrite_verdict(over, err, verdict, why):
    n = 0 if over is None else 4
    r = judge(claim("erratum_vs_overwrite"), StageResults(edit=two_strategy_edit(over, err, n)))
    assert (r.verdict, r.why) == (verdict, why)
    assert r.ours.startswith("decision families without CoT: overwrite recovered ")
    assert judge(claim("erratum_vs_overwrite"), StageResults()).verdict == NOT_RUN


def test_case_choice_and_cases_per_family_reach_the_stages(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(repro, "_run_stage",
                        lambda stage, engine, settings, *a: seen.append(settings)
                        or SYNTHETIC[stage])
    choice = repro.CaseChoice(("routing",), "heldout")
    sizes = repro.with_cases(repro.CLAIMS, 30)
    run = run_repro(["a"], tmp_path, load=lambda *a, **k: object(), stages=["trace"],
                    sizes=sizes, choice=choice)
    assert seen[0].choice == choice and seen[0].sizes.trace_cases == 30
    assert seen[0].size_label == "custom" and repro.RunSettings(
        "cpu", "float32", False, repro.CLAIMS).size_label == "claims"
    stored = json.loads((tmp_path / "a" / "trace.json").read_text())
    assert stored["settings"]["cases"] == {"families": ["routing"], "split": "heldout"}
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", stored["finished"])
    # another split does not reuse the stage
    seen.clear()
    run_repro(["a"], tmp_path, load=lambda *a, **k: object(), stages=["trace"], sizes=sizes,
              choice=repro.CaseChoice(("routing",), "dev"))
    assert len(seen) == 1
    paths = write_report(tmp_path, run)
    report = paths["report"].read_text()
    assert "## Verdicts at a glance" in report and "| claim | a |" in report
    assert "seeded families on their **heldout** seeds" in report
    assert paths["trace_plot"].is_file() and "![trace shares](trace-shares.png)" in report


def test_bad_case_choice_is_refused():
    with pytest.raises(UnknownNameError, match="valid families: "):
        repro.CaseChoice(("nope",))
    with pytest.raises(UnknownNameError, match="valid seed splits: heldout, dev"):
        repro.CaseChoice(None, "test")
    with pytest.raises(InvalidArgumentError, match="at least 1, got 0"):
        repro.with_cases(repro.CLAIMS, 0)
