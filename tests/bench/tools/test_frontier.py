"""The guard swept over stored margins: counts, costs, the two thresholds, the bundle CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.research.tool_runs import CaseResult, Outcome
from kvnotes_bench.tools.frontier import frontier, main, point, sweep_taus


def _outcome(strategy: str, *, same: bool, margin: float, greedy: bool | None) -> Outcome:
    # 100 tokens, 20 exact prefix, 80 spliced of which 8 repaired
    return Outcome(strategy, "a" if same else "b", "a", same, margin, same, 0.1, 0.99, 1.0,
                   100, 72, 20, 8, 0.0, 0, 80, 0.01, greedy_identical=greedy)


def _case(i: int, half: str, *, same: bool, margin: float, greedy: bool | None = True
          ) -> CaseResult:
    return CaseResult(f"c{i}", half, 2, 2, 100, 20, ("a",),
                      (_outcome("exact", same=True, margin=2.0, greedy=None),
                       _outcome("v", same=same, margin=margin, greedy=greedy)))


CASES = [_case(0, "calibrate", same=True, margin=0.9),
         _case(1, "calibrate", same=True, margin=0.3, greedy=False),
         _case(2, "evaluate", same=False, margin=0.2, greedy=False),
         _case(3, "evaluate", same=True, margin=2.0)]


def test_a_fired_case_answers_exactly_and_costs_its_spliced_tokens() -> None:
    alone = point(CASES, "v", 0.0)
    assert (alone.choice_identical, alone.greedy_identical, alone.fires) == (3, 2, 0)
    assert alone.recompute_share == pytest.approx(8 / 80)
    fired = point(CASES, "v", 0.25)  # case 2 fires: its choice and continuation become exact
    assert (fired.choice_identical, fired.greedy_identical, fired.fires) == (4, 3, 1)
    assert fired.recompute_share == pytest.approx((3 * 8 / 80 + (8 + 80) / 80) / 4)
    both = point(CASES, "v", 0.5)
    assert (both.greedy_identical, both.fires) == (4, 2)


def test_sweep_steps_over_every_margin_and_thresholds_read_apart() -> None:
    assert sweep_taus(CASES, "v") == pytest.approx([0.0, 0.2001, 0.3001, 0.9001, 2.0001])
    f = frontier(CASES, "v", model="m", set_name="live_multiple", bundle="b")
    assert f.points[0].tau == 0.0 and len(f.points) == 5
    # 4/4 choices and >= 90% continuations: only once both flawed cases fire
    assert f.best is not None and f.best.tau == pytest.approx(0.3001)
    assert not f.best.within_budget  # 2 of 4 fired: half the spliced tokens recomputed
    # the calibration half is already identical: the calibrated guard never fires, and the
    # evaluation half keeps its flip
    assert f.calibrated_tau == 0.0
    assert (f.calibrated.cases, f.calibrated.choice_identical) == (2, 1)
    with pytest.raises(InvalidArgumentError, match="no case holds"):
        frontier(CASES, "w", model="m", set_name="s", bundle="b")


def test_no_greedy_run_leaves_the_continuation_unread() -> None:
    cases = [dataclasses.replace(c, outcomes=(c.outcomes[0], dataclasses.replace(
        c.outcomes[1], greedy_identical=None))) for c in CASES]
    p = point(cases, "v", 0.25)
    assert p.greedy_identical is None and p.greedy_rate is None
    assert p.identical_enough()  # the choice alone decides: 4/4


def test_cli_writes_json_report_and_plot(tmp_path: Path) -> None:
    bundle = tmp_path / "m-live_multiple"
    bundle.mkdir()
    (bundle / "results.json").write_text(json.dumps(
        {"model": "m", "set": "live_multiple", "cases": [c.to_dict() for c in CASES]}))
    out = tmp_path / "frontier"
    assert main([str(bundle), "--base", "v", "--out", str(out)]) == 0
    doc = json.loads((out / "frontier.json").read_text())
    (only,) = doc["frontiers"]
    assert only["model"] == "m" and only["best"]["choice_identical"] == 4
    assert "| m | v |" in (out / "report.md").read_text()
    assert (out / "frontier.png").stat().st_size > 1000
    with pytest.raises(InvalidArgumentError, match="no bundle holds"):
        main([str(bundle), "--base", "nope", "--out", str(out)])
    with pytest.raises(InvalidArgumentError, match="no results.json"):
        main([str(tmp_path), "--out", str(out)])
