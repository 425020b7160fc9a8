"""The trace suite's typed summary (what ``kvnotes repro`` stores) and its case picking."""

from __future__ import annotations

import json
import math

from kvnotes.eval.tasks import load_suite
from kvnotes.research.trace.suite import (
    CaseOutcome,
    Estimate,
    FamilySummary,
    TraceSuiteResult,
    pick_cases,
)


def summary(family: str, field: Estimate) -> FamilySummary:
    return FamilySummary(family=family, n_cases=3, n_skipped_length=1, n_skipped_other=0,
                         n_insensitive=1, n_sensitive=1, n_flips=0,
                         median_abs_denominator=float("nan"), field=field,
                         notes=Estimate(0.9, 0.8, 1.0, 1), noising_field=field,
                         noising_notes=field, field_by_layer=[0.1, 0.2])


def test_summary_round_trips_through_json_with_nan_as_null():
    empty = Estimate(float("nan"), float("nan"), float("nan"), 0)
    result = TraceSuiteResult("m", (summary("refund", Estimate(0.1, 0.0, 0.2, 1)),
                                    summary("all", empty)),
                              (CaseOutcome("r0", "refund", "traced", "", denominator=2.0,
                                           sensitive=True, field=0.1, notes=0.9),
                               CaseOutcome("r1", "refund", "skipped", "unequal length: x")))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["families"][1]["field"]["mean"] is None  # JSON has no NaN
    assert "sensitive" not in data["cases"][1]  # a skipped case carries no effects
    back = TraceSuiteResult.from_dict(data)
    assert back.cases == result.cases
    assert back.overall().family == "all" and str(back.overall().field) == "n/a"
    assert math.isnan(back.families[0].median_abs_denominator)
    assert back.families[0].field == Estimate(0.1, 0.0, 0.2, 1)
    assert back.families[0].field_by_layer == [0.1, 0.2]


def test_pick_cases_takes_equal_length_values_and_counts_the_pool(tiny_llama):
    suite = load_suite(["refund", "capital_recall"])
    picks = pick_cases(tiny_llama, suite, 2)
    encode = tiny_llama.encode
    assert picks.cases and all(len(encode(c.old_value)) == len(encode(c.new_value))
                               for c in picks.cases)
    for fam in ("refund", "capital_recall"):
        equal, total = picks.pool[fam]
        assert total == sum(c.family == fam for c in suite) and equal <= total
        assert sum(c.family == fam for c in picks.cases) == min(2, equal)
    assert picks.pool["all"] == (sum(picks.pool[f][0] for f in ("refund", "capital_recall")),
                                 len(suite))
