"""The guard's calibration arithmetic and the default it picks (no model)."""

from __future__ import annotations

import math

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.tools.guard_calib import GuardCase, choose_default, curve, row


def case(margin: float, *, same: bool = True, first: bool = True, choice: bool | None = None,
         tokens: int = 100, spliced: int = 80, repaired: int = 8, prefix: int = 10
         ) -> GuardCase:
    return GuardCase("c", "s", margin, 2.0, first, same, choice, tokens, spliced, repaired,
                     prefix)


def test_a_fired_request_is_identical_and_pays_for_an_exact_prefill():
    cases = [case(0.1, same=False, first=False, choice=False), case(2.0, choice=True)]
    off, on = row(cases, 0.0), row(cases, 0.5)
    assert (off.fires, off.greedy_same, off.first_same, off.choice_same) == (0, 1, 1, 1)
    assert (on.fires, on.greedy_same, on.first_same, on.choice_same) == (1, 2, 2, 2)
    # off: 8 + 8 of 160 spliced recomputed; on: the fired one's 80 spliced on top
    assert off.spliced_share == pytest.approx(16 / 160)
    assert on.spliced_share == pytest.approx((16 + 80) / 160)
    # computed: (100 - 80 + 8) each; the fired one adds its 100 - 10 unprefixed tokens
    assert off.computed_share == pytest.approx(56 / 200)
    assert on.computed_share == pytest.approx((56 + 90) / 200)
    assert on.fire_rate == 0.5 and on.greedy_identity == 1.0


def test_tau_zero_never_fires_and_an_unknown_margin_fires_otherwise():
    cases = [case(math.nan, same=False), case(0.0, same=False)]
    assert row(cases, 0.0).fires == 0
    assert row(cases, 0.01).fires == 2
    assert row(cases, 0.01).choice_same is None  # no decision read in this set


def test_curve_is_one_row_per_tau_and_fires_grow_with_tau():
    cases = [case(m) for m in (0.05, 0.3, 0.8, 1.6)]
    rows = curve(cases, (0.0, 0.1, 0.5, 1.0, 2.0))
    assert [r.tau for r in rows] == [0.0, 0.1, 0.5, 1.0, 2.0]
    assert [r.fires for r in rows] == [0, 1, 2, 3, 4]
    with pytest.raises(InvalidArgumentError):
        row(cases, -0.1)


def test_default_is_the_smallest_tau_with_the_most_gain_within_the_budget():
    # 10 requests: the two that differ have small margins; one near-tie that agrees
    cases = [case(0.05, same=False, first=False), case(0.15, same=False, first=False)] \
        + [case(3.0)] * 8
    taus = (0.0, 0.1, 0.2, 0.3, 5.0)
    choice = choose_default({"a": curve(cases, taus)}, budget=0.2)
    assert choice.tau == 0.2  # catches both at 20% fired; 0.3 gains no more; 5.0 is over
    assert choice.rows["a"].greedy_same == 10 and "first tokens +2" in choice.reason


def test_a_continuation_fixed_by_chance_does_not_turn_the_guard_on():
    # the only small margin belongs to a request whose first token already agrees
    cases = [case(0.05, same=False)] + [case(3.0, same=False, first=False)] + [case(3.0)] * 8
    choice = choose_default({"a": curve(cases, (0.0, 0.1, 5.0))}, budget=0.2)
    assert choice.tau == 0.0 and "fixes a first token" in choice.reason


def test_default_is_off_when_gains_need_more_than_the_budget_on_any_set():
    near_ties = [case(0.05 * (i + 1), same=i != 5, first=i != 5)  # every margin small
                 for i in range(10)]
    clear = [case(0.05, same=False, first=False)] + [case(3.0)] * 9
    taus = (0.0, 0.1, 0.2, 0.5)
    choice = choose_default({"clear": curve(clear, taus), "ties": curve(near_ties, taus)},
                            budget=0.2)
    assert choice.tau == 0.1  # gains on "clear" within 20% fired on both sets
    only_ties = choose_default({"ties": curve(near_ties, taus)}, budget=0.2)
    assert only_ties.tau == 0.0 and "off" in only_ties.reason and "ties 90%" in only_ties.reason


def test_default_needs_matching_curves_with_tau_zero():
    cases = [case(1.0)]
    with pytest.raises(InvalidArgumentError, match="same thresholds"):
        choose_default({"a": curve(cases, (0.0, 0.5)), "b": curve(cases, (0.0, 1.0))})
    with pytest.raises(InvalidArgumentError, match="tau 0"):
        choose_default({"a": curve(cases, (0.5, 1.0))})


def test_a_case_round_trips_through_json():
    c = case(0.3, choice=True)
    assert GuardCase.from_dict(c.to_dict()) == c
