"""The entry planned for each splice range travels with it (``SpliceRequest.keys``): the
connector supplies a range from that very entry, whichever variant its own rule would prefer,
and computes the range when the entry is not in its view of the library."""

from __future__ import annotations

from kvnotes.core.repair import Repair
from kvnotes.serving.library.splice import (
    PieceIndex,
    PieceInfo,
    check_ranges,
)
from kvnotes.serving.planning.layout import SentPart
from kvnotes.serving.planning.phases import plan_phases, sent_spans

HEADER = PieceInfo("h", "header", (1, 2, 3, 4), 0)
SKILL = tuple(range(100, 140))
ANCHORED = PieceInfo("anchored", "s", SKILL, 4, behind=(1, 2, 3, 4))
LATE = PieceInfo("late", "s", SKILL, 60, behind=tuple(range(60)))  # compiled elsewhere


def index(*pieces: PieceInfo) -> PieceIndex:
    ix = PieceIndex()
    for p in pieces:
        ix.add(p)
    return ix


def prompt() -> list[int]:
    return [*HEADER.token_ids, *SKILL, 7, 8]


def test_a_planned_key_is_the_entry_supplied_even_when_another_variant_ranks_first() -> None:
    ix, ids = index(HEADER, ANCHORED, LATE), prompt()
    ranges = [[0, 0, 4], [4, 4, 44]]
    assert check_ranges(ids, ix, ranges).pieces == (HEADER, ANCHORED)  # the server's own rule
    checked = check_ranges(ids, ix, ranges, ["h", "late"])
    assert checked.pieces == (HEADER, LATE) and checked.reason is None


def test_a_planned_key_the_server_does_not_hold_is_computed() -> None:
    ix, ids = index(HEADER, ANCHORED), prompt()
    checked = check_ranges(ids, ix, [[0, 0, 4], [4, 4, 44]], ["h", "late"])
    assert checked.pieces == (HEADER,) and checked.dropped == 1
    assert checked.reason is not None and "late" in checked.reason
    # a key of an entry with other tokens is refused the same way
    checked = check_ranges(ids, ix, [[0, 0, 4], [4, 4, 44]], ["h", "h"])
    assert checked.pieces == (HEADER,) and checked.dropped == 1


def test_malformed_keys_drop_every_range() -> None:
    ix, ids = index(HEADER, ANCHORED), prompt()
    for keys in ("h", ["h"], ["h", 3], {"a": 1}):
        checked = check_ranges(ids, ix, [[0, 0, 4], [4, 4, 44]], keys)
        assert checked.pieces == () and checked.dropped == 2 and checked.reason is not None


def test_the_plan_sends_each_ranges_entry_key() -> None:
    spans = sent_spans([SentPart(HEADER.token_ids, HEADER), SentPart(SKILL, LATE),
                        SentPart((7, 8))])
    plan = plan_phases(spans, Repair(first=8), 4)
    assert [s.key for s in spans] == ["h", "late", ""]
    assert len(plan.keys) == len(plan.ranges) == 2 and plan.keys == ("h", "late")
    params = plan.splice_request().to_params()["kvnotes"]
    assert params["keys"] == ["h", "late"]
    assert len(params["ranges"]) == 2
    # a phase's request carries the keys of its own ranges only
    end = plan.ranges[1].start
    assert plan.splice_request(end).keys == ("h",)


def test_spans_without_keys_send_none() -> None:
    spans = sent_spans([SentPart(HEADER.token_ids, PieceInfo("", "header", (1, 2, 3, 4), 0)),
                        SentPart((7, 8))])
    plan = plan_phases(spans, Repair(first=8), 4)
    assert plan.keys == () and "keys" not in plan.splice_request().to_params()["kvnotes"]
