"""Repair that sizes itself: the share floor and the adaptive rule (tiny models)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_engine, make_tiny_model

import kvnotes
from kvnotes.core.errors import ArgumentTypeError, InvalidArgumentError
from kvnotes.core.repair import (
    DEFAULT_FIRST,
    DEFAULT_REPAIR,
    DEFAULT_SHARE,
    SERVER_REPAIR,
    Repair,
    adapt_end,
    as_repair,
    first_tokens,
    parse_repair,
    relative_change,
    repair_spelling,
    repaired_end,
)
from kvnotes.core.repair_plan import Piece, Text, plan_repair

REFUNDS = ("Refunds are issued within five days of the return reaching the warehouse. "
           "Final-sale items cannot be returned. Gift cards are never refunded in cash, and "
           "opened hygiene products stay with the customer.")
SHIPPING = ("Shipping takes three days inside the country and ten days abroad. Express "
            "shipping costs extra and is not refunded when the parcel is late by one day only. "
            "Parcels lost in transit are replaced once, free of charge, after a carrier claim.")


def _close(a, b, atol=1e-5):
    assert torch.equal(a.token_ids, b.token_ids)
    for l in range(a.num_layers):
        assert torch.allclose(a.keys(l), b.keys(l), atol=atol), l
        assert torch.allclose(a.values(l), b.values(l), atol=atol), l


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer)


# ---- the share floor ----------------------------------------------------------------------------
@pytest.mark.parametrize("length,first,share,expected", [
    (200, 32, 0.1, 32),      # a short skill keeps the fixed count
    (320, 32, 0.1, 32),      # exactly at the crossover
    (321, 32, 0.1, 33),      # just past it: ceil(32.1)
    (5800, 32, 0.1, 580),    # a long manual gets its share
    (5800, 32, 0.0, 32),     # no share: the fixed count
    (100, 0, 0.05, 5),       # a share alone
    (7, 0, 0.01, 1),         # any positive share repairs at least one token
    (0, 32, 0.5, 32),        # before capping at the (empty) skill
])
def test_first_tokens_is_the_larger_of_the_count_and_the_share(length, first, share, expected):
    assert first_tokens(length, first, share) == expected
    assert first_tokens(length, first, share) == max(first, math.ceil(share * length - 1e-9))


def test_repaired_end_with_a_share_rounds_up_to_align_and_caps_at_the_skill():
    assert repaired_end(40, 1040, 32, share=0.1) == 140
    assert repaired_end(40, 1040, 32, align=16, share=0.1) == 144  # 140 -> the next block end
    assert repaired_end(40, 240, 32, align=16, share=0.1) == 80  # the count wins, then aligned
    assert repaired_end(40, 60, 32, share=0.9) == 60  # capped at the skill
    assert repaired_end(40, 40, 32, share=0.5) == 40


def test_plan_repair_sizes_each_piece_by_its_own_length():
    short = Piece(100, origin=1, prefix_digest="elsewhere")
    long = Piece(2000, origin=1, prefix_digest="elsewhere")
    plan = plan_repair([Text(1), short, Text(3), long], Repair(first=32, share=0.1))
    assert plan.regions == [(1, 33), (104, 304)]
    assert plan.repaired == 32 + 200
    # aligned as a server plans it, from absolute positions
    aligned = plan_repair([Text(1), short, Text(3), long], Repair(first=32, share=0.1, align=16))
    assert aligned.regions == [(1, 48), (104, 304)]  # 33 -> 48; 304 is already a multiple


@pytest.mark.parametrize("kwargs,error,message", [
    ({"share": 1.5}, InvalidArgumentError, r"Repair\(share=1\.5\) is not a fraction in \[0, 1\]"),
    ({"share": -0.1}, InvalidArgumentError, r"Repair\(share=-0\.1\)"),
    ({"share": float("nan")}, InvalidArgumentError, r"Repair\(share=nan\)"),
    ({"share": "0.1"}, ArgumentTypeError, r"Repair\(share='0\.1'\): give a fraction"),
    ({"share": True}, ArgumentTypeError, r"Repair\(share=True\)"),
    ({"adapt": -1.0}, InvalidArgumentError, r"Repair\(adapt=-1\.0\): give a threshold >= 0"),
    ({"adapt": float("nan")}, InvalidArgumentError, r"Repair\(adapt=nan\)"),
    ({"adapt": float("inf")}, InvalidArgumentError, r"Repair\(adapt=inf\)"),
    ({"adapt": "0.2"}, InvalidArgumentError, r"Repair\(adapt='0\.2'\)"),
    ({"adapt": 0.2, "adapt_step": 0}, InvalidArgumentError, r"adapt_step=0"),
    ({"adapt": 0.2, "adapt_cap": 2.0}, InvalidArgumentError, r"adapt_cap=2\.0"),
    ({"first": 0, "adapt": 0.2}, InvalidArgumentError, r"give first > 0 or share > 0"),
    ({"budget": 0.1, "adapt": 0.2}, InvalidArgumentError, r"give one of adapt or budget"),
])
def test_repair_refuses_bad_share_and_adapt_fields(kwargs, error, message):
    with pytest.raises(error, match=message):
        Repair(**kwargs)


def test_the_tag_names_the_share_and_the_adaptive_rule():
    assert Repair(first=32).tag() == "f32a1"
    assert Repair(first=32, share=0.1).tag() == "f32a1s0.1"
    assert Repair(first=32, share=0.1, align=16).tag() == "f32a16s0.1"
    assert Repair(first=32, adapt=0.2).tag() == "f32a1t0.2k32c0.25"
    assert Repair(first=32, adapt=0.2, adapt_step=16, adapt_cap=0.5).tag() == "f32a1t0.2k16c0.5"
    tags = {Repair(first=32, share=s).tag() for s in (0.0, 0.05, 0.1, 0.2)}
    assert len(tags) == 4  # a server's salts differ between floors


def test_int_repair_keeps_meaning_the_first_tokens_and_the_default_is_named():
    assert as_repair(16) == Repair(first=16) and as_repair(16).share == 0
    assert as_repair(DEFAULT_REPAIR) is DEFAULT_REPAIR
    assert DEFAULT_REPAIR.first == DEFAULT_FIRST and DEFAULT_REPAIR.share == DEFAULT_SHARE
    assert SERVER_REPAIR.adapt is None  # a server plans its phases before the request runs
    assert not DEFAULT_REPAIR.is_noop and Repair(first=0, share=0.1).is_noop is False


@pytest.mark.parametrize("spec,repair", [
    ("32", Repair(first=32)), ("0", Repair(first=0)), ("32@0.1", Repair(first=32, share=0.1)),
    ("16@.2", Repair(first=16, share=0.2)), ("32~0.2", Repair(first=32, adapt=0.2)),
    ("32@0.05~0.3", Repair(first=32, share=0.05, adapt=0.3)),
])
def test_parse_repair_reads_the_spelling_and_spells_it_back(spec, repair):
    assert parse_repair(spec) == repair
    assert parse_repair(repair_spelling(repair)) == repair


@pytest.mark.parametrize("spec", ["", "x", "32@", "@0.1", "32@0.1@0.2", "-1", "32~"])
def test_parse_repair_refuses_other_spellings(spec):
    with pytest.raises(InvalidArgumentError, match="spell it K"):
        parse_repair(spec)


def test_parse_repair_checks_the_values_as_a_repair_does():
    with pytest.raises(InvalidArgumentError, match="not a fraction"):
        parse_repair("32@1.5")
    with pytest.raises(ArgumentTypeError, match="a repair spelling is text"):
        parse_repair(None)  # type: ignore[arg-type]


# ---- the adaptive rule --------------------------------------------------------------------------
def test_adapt_end_is_the_cap_share_never_below_the_first_region():
    assert adapt_end(0, 1000, Repair(first=32, adapt=0.1)) == 250
    assert adapt_end(0, 100, Repair(first=32, adapt=0.1)) == 32  # the cap is below the first
    assert adapt_end(10, 1010, Repair(first=32, adapt=0.1, adapt_cap=0.1, align=16)) == 112
    assert relative_change([]) == 0.0 and relative_change([(4.0, 16.0)]) == 0.5


def test_adaptive_repair_at_threshold_zero_recomputes_up_to_the_cap(tokenizer):
    engine = kvnotes.Engine.from_model(make_tiny_model("llama", tokenizer).double(), tokenizer)
    refunds, shipping = engine.compile(REFUNDS), engine.compile(SHIPPING)
    parts = ["Customer asks. ", refunds, " Then: ", shipping, " Answer:"]
    whole = engine.compose(parts, repair=Repair(first=4, adapt=0.0, adapt_step=4,
                                                adapt_cap=1.0))
    stats = whole.meta["compose"]
    assert stats["reused"] == 0 and stats["repaired"] == len(refunds) + len(shipping)
    adapt = stats["adapt"]
    assert adapt["planned"] == 8 and adapt["extra_tokens"] == stats["repaired"] - 8
    # one forward per 4 tokens after the first 4, per skill
    assert adapt["extra_forwards"] == sum(math.ceil((len(s) - 4) / 4) for s in (refunds, shipping))
    assert all(c > 0 for changes in adapt["changes"] for c in changes)
    _close(whole, engine.prefill(whole.token_ids), atol=1e-10)  # every token: a prefill
    # a cap below the skill stops there, even at threshold 0
    capped = engine.compose(parts, repair=Repair(first=4, adapt=0.0, adapt_step=4,
                                                 adapt_cap=0.5)).meta["compose"]
    caps = [max(4, math.ceil(0.5 * len(s))) for s in (refunds, shipping)]
    assert [b - a for a, b in capped["regions"]] == caps and capped["repaired"] == sum(caps)


def test_adaptive_repair_with_a_huge_threshold_stays_at_the_first_tokens(tiny):
    parts = ["Q. ", tiny.compile(REFUNDS), " and ", tiny.compile(SHIPPING), " A:"]
    fixed = tiny.compose(parts, repair=Repair(first=5))
    stay = tiny.compose(parts, repair=Repair(first=5, adapt=1e9))
    stats = stay.meta["compose"]
    assert stats["regions"] == fixed.meta["compose"]["regions"] and stats["repaired"] == 10
    assert stats["adapt"]["extra_tokens"] == 0 and stats["adapt"]["extra_forwards"] == 0
    assert [len(c) for c in stats["adapt"]["changes"]] == [1, 1]  # one measurement per skill
    _close(stay, fixed, atol=0)


def test_adaptive_repair_grows_only_the_skills_whose_notes_moved(tiny):
    parts = ["Q. ", tiny.compile(REFUNDS), " and ", tiny.compile(SHIPPING), " A:"]
    probe = tiny.compose(parts, repair=Repair(first=4, adapt=1e9, adapt_step=4, adapt_cap=1.0))
    first_changes = [c[0] for c in probe.meta["compose"]["adapt"]["changes"]]
    # a threshold between the two skills' first measurements grows only the one above it
    lo, hi = sorted(first_changes)
    assert lo < hi
    nb = tiny.compose(parts, repair=Repair(first=4, adapt=(lo + hi) / 2, adapt_step=4,
                                           adapt_cap=1.0))
    lengths = [b - a for a, b in nb.meta["compose"]["regions"]]
    assert [n > 4 for n in lengths] == [c > (lo + hi) / 2 for c in first_changes]


def test_the_share_floor_in_compose_recomputes_a_share_of_each_skill(tiny):
    refunds, shipping = tiny.compile(REFUNDS), tiny.compile(SHIPPING)
    parts = ["Q. ", refunds, " and ", shipping, " A:"]
    nb = tiny.compose(parts, repair=Repair(first=2, share=0.5))
    want = [max(2, math.ceil(0.5 * len(s))) for s in (refunds, shipping)]
    stats = nb.meta["compose"]
    assert [b - a for a, b in stats["regions"]] == want and stats["repair"] == "f2a1s0.5"
    at = [r[0] for r in stats["regions"]]
    by_hand = tiny.compose(parts[:2], repair=0)
    by_hand = tiny.recompute(by_hand, range(at[0], at[0] + want[0]))
    by_hand = tiny.extend(by_hand, " and ").splice(shipping)
    by_hand = tiny.extend(tiny.recompute(by_hand, range(at[1], at[1] + want[1])), " A:")
    _close(nb, by_hand)
