"""The plan-time benchmark, run tiny: its JSON's shape and its plot (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from kvnotes.bench.micro import plan_time
from kvnotes.core.errors import InvalidArgumentError


def test_a_tiny_run_writes_its_json_and_plot(tmp_path):
    plan_time.main(["--sizes", "4,8", "--in-prompt", "2", "--prompt-tokens", "160",
                    "--repeats", "3", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "plan-time.json").read_text())
    assert (tmp_path / "plan-time.png").stat().st_size > 0
    assert {"config", "prompt_tokens", "rows", "machine_before", "machine_after", "load",
            "command", "date"} <= set(data)
    assert data["config"]["sizes"] == [4, 8] and "plan_time" in data["command"]
    assert 100 < data["prompt_tokens"] < 220
    assert [(r["path"], r["catalog_size"]) for r in data["rows"]] == [
        ("text", 4), ("ids", 4), ("text", 8), ("ids", 8)]
    for row in data["rows"]:
        assert row["repeats"] == 3 and row["skills_found"] == 2  # the prompt's entries
        assert 0 < row["p50_ms"] <= row["p90_ms"]
    assert "torch_threads" in data["machine_after"]
    assert 0 < data["tokenize_p50_ms"]
    result = plan_time.read_result(data)
    assert result.to_dict() == data


def test_a_catalog_smaller_than_the_prompts_entries_is_refused():
    with pytest.raises(InvalidArgumentError, match="every catalog size"):
        plan_time.PlanTimeConfig(sizes=(2, 10), in_prompt=4)
