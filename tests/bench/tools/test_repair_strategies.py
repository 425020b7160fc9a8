"""The tool bench's spellings of the share floor (epic:K@F) and the adaptive rule (epic:K~T)."""

from __future__ import annotations

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes_bench.tools.strategies import parse_strategies, parse_strategy, repair_of


@pytest.mark.parametrize("spec,repair", [
    ("epic:32", Repair(first=32)),
    ("epic:32@0.1", Repair(first=32, share=0.1)),
    ("epic:32~0.2", Repair(first=32, adapt=0.2)),
    ("epic:16@0.05~0.3", Repair(first=16, share=0.05, adapt=0.3)),
    ("pred+epic:32@0.1", Repair(first=32, share=0.1)),
])
def test_epic_spellings_make_the_repair(spec, repair):
    strategy = parse_strategy(spec)
    assert strategy.kind == "compose" and strategy.name == spec
    assert repair_of(strategy) == repair
    assert strategy.predecessor == spec.startswith("pred+")


@pytest.mark.parametrize("spec,match", [
    ("epic:32@1.5", "not a fraction"), ("epic:0~0.2", "first > 0 or share > 0"),
    ("epic:32@", "unknown strategy"), ("epic:32~", "unknown strategy"),
])
def test_bad_epic_spellings_are_refused(spec, match):
    with pytest.raises(InvalidArgumentError, match=match):
        parse_strategy(spec)


def test_floors_and_thresholds_are_distinct_strategies():
    names = [s.name for s in parse_strategies(["epic:32", "epic:32@0.1", "epic:32~0.2"])]
    assert names == ["exact", "epic:32", "epic:32@0.1", "epic:32~0.2"]


def test_a_guard_on_a_share_floor_takes_the_last_at_as_its_threshold():
    guard = parse_strategy("guard:epic:32@0.1@0.5")
    assert (guard.base, guard.tau) == ("epic:32@0.1", 0.5)
    plain = parse_strategy("guard:epic:32@0.5")  # one @: the threshold, as before
    assert (plain.base, plain.tau) == ("epic:32", 0.5)
