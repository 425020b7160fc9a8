"""Field sensitivity: per-case decisions for old and new value, per-family counts, the table."""

from __future__ import annotations

import json

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.eval.tasks import load_suite
from kvnotes.research.trace.sensitivity import (
    CaseSensitivity,
    SensitivityResult,
    measure_sensitivity,
    sensitivity_table,
    summarize,
)


def case(cid: str, family: str, old: str, new: str, delta: float,
         trace: float | None) -> CaseSensitivity:
    return CaseSensitivity(cid, family, old, new, old != new, delta, trace, False)


def test_summarize_counts_changes_and_denominators_per_family():
    cases = [case("a0", "a", "x", "y", 3.0, 2.5), case("a1", "a", "x", "x", 0.2, 0.5),
             case("b0", "b", "x", "x", -0.1, None)]
    rows = {r.family: r for r in summarize(cases, min_denominator=1.0)}
    assert (rows["a"].n, rows["a"].n_changed, rows["a"].n_trace_sensitive) == (2, 1, 1)
    assert rows["a"].median_abs_delta == pytest.approx(1.6)
    assert rows["b"].median_abs_trace_delta is None and rows["b"].n_trace_sensitive == 0
    assert (rows["all"].n, rows["all"].n_changed) == (3, 1)
    # a higher threshold makes the same case insensitive
    assert summarize(cases, min_denominator=3.0)[0].n_trace_sensitive == 0


def test_measure_on_a_tiny_model_agrees_with_its_own_counts_and_round_trips(tiny_llama):
    cases = load_suite(["routing"], "dev")[:2] + load_suite(["refund"])[:1]
    result = measure_sensitivity(tiny_llama, cases, split="dev")
    assert [c.case_id for c in result.cases] == [c.case_id for c in cases]
    for c in result.cases:
        assert c.changed == (c.decision_old != c.decision_new)
        assert c.trace_delta is not None
    rows = {r.family: r for r in result.families}
    assert rows["routing"].n == 2 and rows["refund"].n == 1 and rows["all"].n == 3
    assert rows["all"].n_changed == sum(c.changed for c in result.cases)
    back = SensitivityResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back == result
    table = sensitivity_table(result)
    assert "| routing | 2 |" in table and table.splitlines()[0].startswith("| family | cases |")


def test_a_case_without_intended_answers_is_refused(tiny_llama):
    from dataclasses import replace

    bare = replace(load_suite(["refund"])[0], expected_old=None)
    with pytest.raises(InvalidArgumentError, match="needs expected_old and expected_new"):
        measure_sensitivity(tiny_llama, [bare])
