"""The edit task suite: size, shape and parse rules (no model needed beyond a tokenizer)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.eval.tasks import FAMILIES, EditCase, load_suite
from kvnotes.eval.tasks.families import EDIT_FAMILIES
from kvnotes.ops.decisions import parse_answer


@pytest.fixture(scope="module")
def suite() -> list[EditCase]:
    return load_suite(EDIT_FAMILIES)  # other modules may register more families


def test_suite_size_and_families(suite):
    counts = Counter(c.family for c in suite)
    assert len(counts) >= 6
    assert len(suite) >= 150
    assert min(counts.values()) >= 20
    assert len({c.case_id for c in suite}) == len(suite)


def test_suite_is_deterministic(suite):
    again = load_suite(EDIT_FAMILIES)
    assert [c.document for c in again] == [c.document for c in suite]


def test_cases_are_well_formed(suite):
    for c in suite:
        assert c.old_value != c.new_value
        assert c.document.value(c.field) == c.old_value
        assert c.new_document.value(c.field) == c.new_value
        assert c.expected_old in c.answers and c.expected_new in c.answers
        assert c.expected_old != c.expected_new, c.case_id  # every case is meant to flip


def test_contexts_are_realistic_and_field_early(suite, tokenizer):
    for c in suite:
        ids, spans = c.document.tokenize(tokenizer)
        field = next(s for s in spans if s[1] == "field")
        assert 150 <= len(ids) <= 400, (c.case_id, len(ids))
        assert field[2] < len(ids) // 4, c.case_id


def test_answer_first_tokens_are_distinct(suite, tokenizer):
    for c in suite:
        for space in ("", " "):
            firsts = [tokenizer(space + a, add_special_tokens=False)["input_ids"][0]
                      for a in c.answers]
            assert len(set(firsts)) == len(firsts), (c.case_id, c.answers)


def test_parse_takes_the_first_answer_as_a_word(suite):
    case = next(c for c in suite if c.family == "access")
    assert parse_answer("Deny. I would not allow it.", case.answers) == "deny"
    assert parse_answer("allowance", case.answers) is None
    assert parse_answer("", case.answers) is None


def test_load_suite_by_family_and_unknown_family():
    assert {c.family for c in load_suite(["refund", "lookup"])} == {"refund", "lookup"}
    with pytest.raises(UnknownNameError, match="^unknown family 'nope'; valid families: "):
        load_suite(["nope"])
    assert set(FAMILIES) >= {"refund", "eligibility", "membership", "scheduling", "threshold",
                             "access", "lookup"}


def test_routing_keeps_development_and_held_out_seeds_apart():
    from kvnotes.eval.tasks import SEEDED_FAMILIES
    from kvnotes.eval.tasks.routing import DEV_SEEDS, HELDOUT_SEEDS

    family = SEEDED_FAMILIES["routing"]
    assert family.dev_seeds == DEV_SEEDS and family.heldout_seeds == HELDOUT_SEEDS
    assert not set(DEV_SEEDS) & set(HELDOUT_SEEDS)
    dev, held = load_suite(["routing"], "dev"), load_suite(["routing"])
    assert [c.case_id for c in dev] == [f"routing-s{s}" for s in DEV_SEEDS]
    assert [c.case_id for c in held] == [f"routing-s{s}" for s in HELDOUT_SEEDS]
    # the default suite holds the held-out cases, and generating them twice gives the same text
    assert [c.document.text for c in load_suite(["routing"], "heldout")] == \
        [c.document.text for c in held]


def test_routing_cases_decide_differently_for_old_and_new_value():
    for c in load_suite(["routing"]) + load_suite(["routing"], "dev"):
        assert c.old_value != c.new_value and c.expected_old != c.expected_new
        assert {c.expected_old, c.expected_new} <= set(c.answers) and len(c.answers) == 3
        rule = c.document.text.split("\n\n")[0]
        assert f"category is {c.old_value} goes to the {c.expected_old} team" in rule
        assert f"category is {c.new_value} goes to the {c.expected_new} team" in rule


def test_unknown_split_and_overlapping_seeds_are_refused():
    from kvnotes.eval.tasks.base import register_seeded_family

    with pytest.raises(UnknownNameError, match="valid seed splits: heldout, dev"):
        load_suite(["routing"], "test")
    with pytest.raises(InvalidArgumentError, match="development and held-out seeds overlap"):
        register_seeded_family("x", dev_seeds=[1, 2], heldout_seeds=[2, 3])
