"""Edit evaluation (bench/edit): strategy specs, typed results, the pool, resuming, reports."""

from __future__ import annotations

import json
import os
from functools import partial

import pytest

from kvnotes.core.errors import InvalidArgumentError, KvnotesError, UnknownNameError, WorkerError
from kvnotes.core.models import load
from kvnotes.eval.tasks import load_suite
from kvnotes.research.edit.cases import spread, take_shard
from kvnotes.research.edit.checkpoint import load_results
from kvnotes.research.edit.evaluate import compare_strategies, evaluate_case
from kvnotes.research.edit.report import report_markdown, write_outputs
from kvnotes.research.edit.results import CaseResult, SuiteResult, SuiteSettings
from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES, parse_strategy
from kvnotes.research.edit.suite import run_suite


def test_parse_strategy_specs():
    assert parse_strategy("repair:kv_deviation:8") == ("repair", {"select": "kv_deviation",
                                                                  "k": 8})
    assert parse_strategy("erratum:strong") == ("erratum", {"template": "strong"})
    assert parse_strategy("prefix") == ("prefix", {})
    for spec in DEFAULT_STRATEGIES:
        parse_strategy(spec)
    with pytest.raises(UnknownNameError, match=r"^unknown strategy 'magic'; valid strategies: "
                                               r"recompute, prefix, overwrite, erratum, repair "
                                               r"\(with options: "):
        parse_strategy("magic")
    with pytest.raises(UnknownNameError, match=r"unknown repair selector 'random'; valid repair "
                                               r"selectors: attention, kv_deviation \(.*in "
                                               r"'repair:random:3'"):
        parse_strategy("repair:random:3")
    with pytest.raises(UnknownNameError, match="first applies to compose only"):
        parse_strategy("repair:first:8")
    with pytest.raises(InvalidArgumentError, match=r"bad repair spec 'repair:attention:x'; "
                                                   r"write repair:<attention\|kv_deviation>:<k>"):
        parse_strategy("repair:attention:x")
    with pytest.raises(KvnotesError, match="unknown erratum template 'loud'; valid erratum "
                                           "templates: correction, restate, strong, update"):
        parse_strategy("erratum:loud")


def test_run_suite_writes_json_report_and_chart(tiny_llama, tmp_path):
    assert [c.family for c in spread(load_suite(["refund", "lookup"]), 2)] == [
        "refund", "lookup", "refund", "lookup"]
    both = load_suite(["refund", "lookup"])
    everything = spread(both, len(both))  # what edit-eval runs without --per-family
    assert sorted(c.case_id for c in everything) == sorted(c.case_id for c in both)
    assert [c.family for c in everything[:4]] == ["refund", "lookup", "refund", "lookup"]
    cases = spread(load_suite(["refund", "lookup"]), 1)
    assert [c.family for c in cases] == ["refund", "lookup"]
    strategies = ["recompute", "prefix", "overwrite", "erratum", "repair:kv_deviation:4"]
    result = run_suite(tiny_llama, cases, SuiteSettings(strategies))
    agg = result.per_strategy
    assert agg["recompute"].identity == 1.0 and agg["prefix"].identity == 1.0
    assert agg["prefix"].cosine_mean > 0.9999
    assert agg["overwrite"].compute_fraction < 0.1
    assert set(result.per_family) == {"refund", "lookup"}
    paths = write_outputs(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["n_cases"] == 2 and len(data["cases"][0]["rows"]) == len(strategies)
    assert data["per_strategy"]["prefix"]["identity"] == 1.0  # the keys results.json keeps
    assert SuiteResult.from_dict(data).to_dict() == data
    report = paths["report"].read_text()
    assert "| prefix |" in report and "sensitive" in report
    assert paths["plot"].stat().st_size > 1000
    # typed results round-trip through results.json, and the report is rebuilt from it
    case = CaseResult.from_dict(data["cases"][0])
    assert case.to_dict() == data["cases"][0]
    assert case.row("prefix").strategy == "prefix" and len(case.rows) == len(strategies)


def test_compare_strategies_rows(tiny_llama):
    case = load_suite(["access"])[0]
    rows = compare_strategies(tiny_llama, case, ["recompute", "overwrite", "erratum"])
    assert [r.strategy for r in rows] == ["recompute", "overwrite", "erratum"]
    assert rows[0].identical and rows[0].cosine == pytest.approx(1.0)
    assert rows[1].to_dict()["strategy"] == "overwrite" and rows[1].case_id == case.case_id


def test_batched_cot_equals_one_by_one(tiny_llama):
    """With CoT, every strategy's reasoning is decoded as one batch by default; the rows are
    those of decoding each alone (texts, decisions, first-token logits), and the result says
    it was batched."""
    case = load_suite(["refund"])[0]
    strategies = ["recompute", "overwrite", "erratum", "repair:kv_deviation:4"]
    batched = evaluate_case(tiny_llama, case, SuiteSettings(strategies, cot=True, budget=6))
    alone = evaluate_case(tiny_llama, case,
                          SuiteSettings(strategies, cot=True, budget=6, batch=False))
    assert (batched.text_old, batched.text_new) == (alone.text_old, alone.text_new)
    for b, a in zip(batched.rows, alone.rows, strict=True):
        assert (b.strategy, b.text, b.decision) == (a.strategy, a.text, a.decision)
        assert b.kl == pytest.approx(a.kl, abs=1e-6)
    assert any(r.text for r in batched.rows)
    result = run_suite(tiny_llama, [case], SuiteSettings(("recompute", "erratum"), cot=True, budget=4))
    assert result.cot_batched is True
    assert run_suite(tiny_llama, [case], SuiteSettings(("recompute",))).cot_batched is False


def test_shards_and_resume_merge_into_the_whole_run(tiny_llama, tmp_path):
    """Shards split a run without overlap; a run given earlier results takes those cases as
    they are (their timings too, so they were not run again) and runs only the rest."""
    cases = spread(load_suite(["refund", "lookup", "access"]), 1)
    strategies = ["recompute", "overwrite", "erratum"]
    one, two = take_shard(cases, "1/2"), take_shard(cases, "2/2")
    assert [c.case_id for c in one + two] == [cases[0].case_id, cases[2].case_id,
                                              cases[1].case_id]
    for bad in ("0/2", "3/2", "x", "1/2/3"):
        with pytest.raises(InvalidArgumentError, match="bad shard"):
            take_shard(cases, bad)
    write_outputs(run_suite(tiny_llama, one, SuiteSettings(strategies)), tmp_path / "a")
    done = load_results(tmp_path / "a" / "results.json", tiny_llama,
                        SuiteSettings(tuple(strategies)))
    assert [r.case_id for r in done] == [c.case_id for c in one]
    merged = run_suite(tiny_llama, cases, SuiteSettings(strategies), done=done)
    assert merged.n_cases == 3 and merged.n_resumed == 2
    first = json.loads((tmp_path / "a" / "results.json").read_text())["cases"]
    assert merged.cases[0].to_dict() == first[0] and merged.cases[2].to_dict() == first[1]
    fresh = run_suite(tiny_llama, cases, SuiteSettings(strategies))
    for got, want in zip(merged.cases, fresh.cases, strict=True):
        assert [r.decision for r in got.rows] == [r.decision for r in want.rows]
    write_outputs(merged, tmp_path / "m")
    assert "2 of the 3 cases were taken from an earlier run" in (
        tmp_path / "m" / "report.md").read_text()


def test_resume_refuses_other_settings_and_damaged_files(tiny_llama, tmp_path):
    cases = spread(load_suite(["refund"]), 1)
    write_outputs(run_suite(tiny_llama, cases, SuiteSettings(("recompute", "erratum"))), tmp_path)
    path = tmp_path / "results.json"
    both = ("recompute", "erratum")
    assert load_results(tmp_path / "none.json", tiny_llama, SuiteSettings(("recompute",))) == []
    with pytest.raises(InvalidArgumentError, match=r"other settings \(strategies: "):
        load_results(path, tiny_llama, SuiteSettings(("recompute",)))
    with pytest.raises(InvalidArgumentError, match=r"other settings \(cot: False there, "
                                                   r"True now, budget: None there, 96 now"):
        load_results(path, tiny_llama, SuiteSettings(both, cot=True, budget=96))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(InvalidArgumentError, match="not a readable edit-eval results.json"):
        load_results(path, tiny_llama, SuiteSettings(both))
    path.write_text(json.dumps({"model": tiny_llama.name}))  # not a results file
    with pytest.raises(InvalidArgumentError, match="not a readable edit-eval results.json"):
        load_results(path, tiny_llama, SuiteSettings(both))


def test_workers_give_the_serial_results_in_case_order(tiny_folder):
    """Two worker processes (one engine each, one queue of cases) give the serial run's
    decisions, in case order, with checkpoints and progress as they finish; resumed cases are
    not sent to the workers."""
    engine = load(str(tiny_folder))
    cases = spread(load_suite(["refund", "lookup", "access"]), 1)
    strategies = ["recompute", "overwrite", "erratum"]
    serial = run_suite(engine, cases, SuiteSettings(strategies))
    ticks, saved = [], []
    parallel = run_suite(engine, cases, SuiteSettings(strategies), workers=2, threads=1,
                         loader=partial(load, str(tiny_folder)),
                         progress=lambda i, n: ticks.append((i, n)), checkpoint=saved.append)
    assert parallel.workers == 2 and "workers" not in serial.to_dict()
    assert parallel.to_dict()["workers"] == 2
    assert [c.case_id for c in parallel.cases] == [c.case_id for c in cases]
    for got, want in zip(parallel.cases, serial.cases, strict=True):
        assert [r.decision for r in got.rows] == [r.decision for r in want.rows]
        assert [r.kl for r in got.rows] == pytest.approx([r.kl for r in want.rows], abs=1e-5)
    assert ticks == [(1, 3), (2, 3), (3, 3)] and [s.n_cases for s in saved] == [1, 2]
    assert "2 worker processes ran the cases side by side" in report_markdown(parallel)
    first = CaseResult.from_dict(serial.cases[0].to_dict())
    assert first == serial.cases[0]
    resumed = run_suite(engine, cases, SuiteSettings(strategies), workers=4, threads=1, done=[first],
                        loader=partial(load, str(tiny_folder)))
    assert resumed.n_resumed == 1 and resumed.workers == 2  # no more workers than cases
    assert resumed.cases[0] == serial.cases[0]


def test_worker_failures_stop_the_run_with_a_clear_error(tiny_folder, tmp_path):
    engine = load(str(tiny_folder))
    cases = spread(load_suite(["refund", "lookup"]), 1)
    with pytest.raises(WorkerError, match="an edit-eval worker failed: loading the model: "):
        run_suite(engine, cases, SuiteSettings(("recompute",)), workers=2, threads=1,
                  loader=partial(load, str(tmp_path / "no-such-model")))
    with pytest.raises(WorkerError, match=r"edit-eval-worker-\d died \(exit code 3; out of "
                                          r"memory\?\) with 2 cases unfinished"):
        run_suite(engine, cases, SuiteSettings(("recompute",)), workers=2, threads=1,
                  loader=partial(os._exit, 3))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="workers must be a number of processes"):
            run_suite(engine, cases, SuiteSettings(("recompute",)), workers=bad)
    with pytest.raises(InvalidArgumentError, match="workers > 1 needs a loader"):
        run_suite(engine, cases, SuiteSettings(("recompute",)), workers=2)
