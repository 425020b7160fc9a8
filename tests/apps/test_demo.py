"""The demo end to end on the bundled SmolLM2: every case composes, report and plot are written."""

from __future__ import annotations

import json

import pytest

from kvnotes.apps.demo import ComposeDemoResult, demo_data, run_compose_demo, write_report

pytestmark = pytest.mark.real


def test_demo_data_is_bundled():
    skills, cases = demo_data()
    assert {"refund_policy", "order_tools", "shipping_policy"} <= set(skills)
    assert all(set(c.skills) <= set(skills) for c in cases) and len(cases) >= 3


def test_compose_demo_end_to_end(smollm2, tmp_path):
    result = run_compose_demo(smollm2, max_new_tokens=4)
    assert len(result.cases) == len(demo_data()[1])
    for case in result.cases:
        row = case.fidelity
        assert row.tokens_reused + row.tokens_computed == row.tokens_total
        assert row.tokens_reused > row.tokens_computed  # the skills dominate each context
        assert row.logit_cosine > 0.95, case
    path = write_report(result, tmp_path)
    assert "| late-return |" in path.read_text()
    assert (tmp_path / "compose.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["model"] == "smollm2-135m" and data["cases"][0]["logit_cosine"] > 0.95
    assert ComposeDemoResult.from_dict(data).to_dict() == data
