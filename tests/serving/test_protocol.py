"""The wire contract: each message round-trips through its JSON form, and a reader refuses
another version, an unknown field or a malformed value with a message naming it."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvnotes.core.errors import KvnotesError
from kvnotes.core.repair import Repair
from kvnotes.serving.front.prometheus import OUTCOMES
from kvnotes.serving.library.splice import SpliceRange
from kvnotes.serving.protocol import (
    PARAMS_KEY,
    LoadedRange,
    Outcome,
    PlanEntry,
    ProtocolError,
    SpliceReport,
    SpliceRequest,
    UsageBuilder,
    UsageKvnotes,
    WirePlan,
    repair_from_dict,
    repair_to_dict,
)

REQUEST = SpliceRequest((SpliceRange(0, 0, 16), SpliceRange(16, 48, 90)), ("h", "k"))
REPORT = SpliceReport(100, 48, (LoadedRange(16, 48, 90, "k"),), ((64, 90),))
PLAN = WirePlan(100, 16, Repair(first=32, align=16, share=0.1), "kvnotes-splice+f32a16s0.1",
                REQUEST.ranges, ((16, 48),), (48,), ("header", "refunds"),
                (PlanEntry("header", "h", 0, 16, 0), PlanEntry("refunds", "k", 16, 90, 32)),
                ("header",))
USAGE = UsageKvnotes(58, 1, False, PLAN, None, (None,), REPORT)


def wire(obj: object) -> object:
    """Through JSON text and back, as it travels."""
    return json.loads(json.dumps(obj))


def test_every_message_round_trips_through_json():
    assert SpliceRequest.from_params(wire(REQUEST.to_params())) == REQUEST
    tenanted = SpliceRequest(REQUEST.ranges, tenant="acme", tag="f32a16s0.1")
    assert SpliceRequest.from_params(wire(tenanted.to_params())) == tenanted
    assert SpliceReport.from_params(wire(REPORT.to_params())) == REPORT
    assert WirePlan.from_dict(wire(PLAN.to_dict())) == PLAN
    assert UsageKvnotes.from_dict(wire(USAGE.to_dict())) == USAGE
    assert UsageKvnotes.from_dict(wire(UsageKvnotes(exact="no_skill").to_dict())).exact == \
        "no_skill"


def test_a_leading_request_names_no_ranges():
    """``ComposeClient``'s: the connector supplies the prompt's leading run of its entries."""
    asked = SpliceRequest.leading("acme")
    assert asked.to_params() == {"kvnotes": {"v": 1, "tenant": "acme"}}
    assert SpliceRequest.from_params(wire(asked.to_params())) == asked
    assert asked.ranges is None and asked.tag is None
    # an empty list is not the same: no range at all, so nothing is supplied
    assert SpliceRequest.from_params({"kvnotes": {"v": 1, "ranges": []}}).ranges == ()
    with pytest.raises(ProtocolError, match="keys without ranges"):
        SpliceRequest.from_params({"kvnotes": {"v": 1, "keys": ["k"]}})
    with pytest.raises(ProtocolError, match="missing field 'v'"):
        SpliceRequest.from_params({"kvnotes": {"tenant": "acme"}})


def test_the_report_derives_supplied_and_computed_from_its_ranges():
    # [48, 90) loaded, a failed load from 64: vLLM recomputed from there
    assert REPORT.entries == ("k",) and REPORT.recompute_from == 64
    assert REPORT.supplied == 16 and REPORT.computed == 100 - 48 - 16
    d = REPORT.to_dict()
    assert (d["supplied"], d["computed"], d["entries"]) == (16, 36, ["k"])


def test_no_message_means_none():
    assert SpliceRequest.from_params(None) is None
    assert SpliceRequest.from_params({"do_remote_prefill": True}) is None
    assert SpliceReport.from_params(None) is None and SpliceReport.from_params({}) is None


def test_the_usage_reports_are_whole_or_none():
    assert USAGE.reports == ()  # a phase without a report: the picture is incomplete
    whole = UsageKvnotes(58, 1, False, PLAN, None, (REPORT,), REPORT)
    assert whole.reports == (REPORT, REPORT)


def test_the_plan_carries_the_repair_itself_as_fields_not_a_tag():
    repair = Repair(first=32, align=16, share=0.1)
    assert PLAN.repair == repair
    assert PLAN.to_dict()["repair"] == repair_to_dict(repair) == {
        "first": 32, "align": 16, "share": 0.1, "skip_exact": True}
    assert repair_from_dict(wire(repair_to_dict(repair))) == repair
    assert repair_to_dict(Repair(first=0, align=16, share=0))["share"] == 0.0  # a number
    with pytest.raises(ProtocolError, match=r"repair f8a1b4first: a budget or the adaptive"):
        repair_to_dict(Repair(first=8, budget=4))
    with pytest.raises(ValidationError, match=r"a budget or the adaptive rule"):
        WirePlan(10, 16, Repair(first=8, adapt=0.2), "s", ())


@pytest.mark.parametrize("params, message", [
    ({PARAMS_KEY: {"v": 2, "ranges": []}},
     "kvnotes splice request: version 2; this kvnotes reads version 1"),
    ({PARAMS_KEY: {"ranges": []}}, "kvnotes splice request: missing field 'v'"),
    ({PARAMS_KEY: {"v": 1, "ranges": [], "all": True}},
     "kvnotes splice request: unknown field 'all' (fields: v, ranges, keys, tenant, tag)"),
    ({PARAMS_KEY: [[0, 0, 16]]}, "kvnotes splice request: expected a JSON object, got list"),
    ({PARAMS_KEY: {"v": 1, "ranges": [[0, 0, 16]], "keys": ["a", "b"]}},
     "kvnotes splice request: 2 keys for 1 ranges (give one entry key per range, or none)"),
    ({PARAMS_KEY: {"v": 1, "ranges": [[0, 0, 16]], "keys": [7]}},
     "kvnotes splice request: keys[0]: input should be a valid string, got 7"),
    ({PARAMS_KEY: {"v": 1, "ranges": [[0, 0, 16], [8, 8, 20]]}},
     "kvnotes splice request: range [8, 8, 20] overlaps the one before it ([0, 0, 16])"),
    ({PARAMS_KEY: {"v": 1, "ranges": [[0, 5, 3]]}},
     "kvnotes splice request: ranges[0]: splice range [0, 5, 3]: need 0 <= piece_start <= "
     "start < end"),
    ("ranges", "kv_transfer_params: expected a JSON object, got str"),
])
def test_a_splice_request_this_version_cannot_read_is_refused(params, message):
    with pytest.raises(ProtocolError) as err:
        SpliceRequest.from_params(params)
    assert str(err.value) == message
    assert isinstance(err.value, KvnotesError)


@pytest.mark.parametrize("change, message", [
    ({"v": 0}, "kvnotes splice report: version 0; this kvnotes reads version 1"),
    ({"blocks": [1]}, "kvnotes splice report: unknown field 'blocks' (fields: v, "
                      "prompt_tokens, local_hit, loaded, failed, refused, entries, supplied, "
                      "computed)"),
    ({"loaded": [[16, 48, 90]]}, "kvnotes splice report: loaded[0]: expected [piece_start, "
                                 "start, end, key], got [16, 48, 90]"),
    ({"failed": [[90, 64]]}, "kvnotes splice report: failed[0]: [start, end] with start <= "
                             "end, got [90, 64]"),
    ({"local_hit": -1}, "kvnotes splice report: local_hit: input should be greater than or equal to 0, "
                        "got -1"),
    ({"supplied": 42}, "kvnotes splice report: supplied is 42, its other fields give 16"),
])
def test_a_report_this_version_cannot_read_is_refused(change, message):
    with pytest.raises(ProtocolError) as err:
        SpliceReport.from_dict({**REPORT.to_dict(), **change})
    assert str(err.value) == message


@pytest.mark.parametrize("change, message", [
    ({"v": 2}, "usage.kvnotes: version 2; this kvnotes reads version 1"),
    ({"tag": "f32a16"}, "usage.kvnotes: unknown field 'tag' (fields: v, spliced_tokens, "
                        "phases, guard_fired, plan, exact, phase_reports, report, "
                        "no_report)"),
    ({"guard_fired": 1}, "usage.kvnotes: guard_fired: input should be a valid boolean, got 1"),
    ({"plan": {**PLAN.to_dict(), "repair": "f32a16"}},
     "usage.kvnotes: plan.repair: expected a JSON object, got str"),
    ({"plan": {**PLAN.to_dict(), "repair": {"first": 32, "align": 16, "share": 2}}},
     "usage.kvnotes: plan.repair.share: input should be less than or equal to 1, got 2"),
    ({"plan": {**PLAN.to_dict(), "spliced_tokens": 1}},
     "usage.kvnotes: plan: spliced_tokens is 1, its other fields give 58"),
])
def test_a_usage_this_version_cannot_read_is_refused(change, message):
    with pytest.raises(ProtocolError) as err:
        UsageKvnotes.from_dict({**USAGE.to_dict(), **change})
    assert str(err.value) == message


@pytest.mark.parametrize("read, value, message", [
    # a boolean is not an integer, nor a number
    (SpliceReport.from_dict, {"v": 1, "prompt_tokens": True},
     "kvnotes splice report: prompt_tokens: input should be a valid integer, got True"),
    (PlanEntry.from_dict, {"name": "h", "key": "h", "start": 0, "end": False, "repaired": 0},
     "kvnotes plan entry: end: input should be a valid integer, got False"),
    (repair_from_dict, {"first": 0, "align": 16, "share": True},
     "kvnotes repair: share: input should be a valid number, got True"),
    # nor is a float or a numeric string
    (repair_from_dict, {"first": 8.0, "align": 16},
     "kvnotes repair: first: input should be a valid integer, got 8.0"),
    (UsageKvnotes.from_dict, {"v": 1, "phases": "2"},
     "usage.kvnotes: phases: input should be a valid integer, got '2'"),
    # counts are not negative, a block size and an alignment are at least 1
    (PlanEntry.from_dict, {"name": "h", "key": "h", "start": -1, "end": 4, "repaired": 0},
     "kvnotes plan entry: start: input should be greater than or equal to 0, got -1"),
    (repair_from_dict, {"first": 0, "align": 0},
     "kvnotes repair: align: input should be greater than or equal to 1, got 0"),
    (repair_from_dict, {"first": 0, "align": 1, "share": -0.5},
     "kvnotes repair: share: input should be greater than or equal to 0, got -0.5"),
    # unknown and missing fields, nested ones named by their path
    (repair_from_dict, {"first": 0, "align": 1, "budget": 4},
     "kvnotes repair: unknown field 'budget' (fields: first, align, share, skip_exact)"),
    (UsageKvnotes.from_dict, {"v": 1, "phase_reports": [None, {"v": 1, "prompt_tokens": 3,
                                                              "hit": 0}]},
     "usage.kvnotes: phase_reports[1]: unknown field 'hit' (fields: v, prompt_tokens, "
     "local_hit, loaded, failed, refused, entries, supplied, computed)"),
    (UsageKvnotes.from_dict, {"v": 1, "report": {"v": 1}},
     "usage.kvnotes: report: missing field 'prompt_tokens'"),
    (UsageKvnotes.from_dict, {"v": 1, "report": {"v": 2, "prompt_tokens": 3}},
     "usage.kvnotes: report: version 2; this kvnotes reads version 1"),
    (SpliceReport.from_dict, {"v": 1, "prompt_tokens": 3, "loaded": [[0, 0, 2, 7]]},
     "kvnotes splice report: loaded[0]: expected [piece_start, start, end, key], got "
     "[0, 0, 2, 7]"),
    (SpliceReport.from_dict, "report", "kvnotes splice report: expected a JSON object, got str"),
])
def test_values_are_read_strictly(read, value, message):
    with pytest.raises(ProtocolError) as err:
        read(value)
    assert str(err.value) == message


def test_a_message_is_checked_when_built():
    with pytest.raises(ValidationError, match="keys without ranges"):
        SpliceRequest(None, ("k",))
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        SpliceReport(10, -1)
    with pytest.raises(ValidationError, match="valid boolean"):
        UsageKvnotes(guard_fired=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="start <= end"):
        WirePlan(10, 16, Repair(first=0, align=16), "s", (), ((8, 4),))
    assert repair_from_dict({"first": 0, "align": 16, "share": 1}).share == 1.0  # a number


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        REPORT.local_hit = 0  # type: ignore[misc]


def test_outcomes_keep_their_label_strings():
    assert OUTCOMES == ("spliced", "forwarded", "exact", "guard_fired", "phase_failed",
                        "upstream_error", "bad_request", "unauthorized", "rejected",
                        "disconnected", "internal_error")
    assert Outcome.SPLICED == "spliced" and json.dumps(Outcome.GUARD_FIRED) == '"guard_fired"'


def test_no_report_is_on_the_wire_only_when_it_says_something():
    assert "no_report" not in USAGE.to_dict()
    streamed = UsageKvnotes(58, 1, False, PLAN, None, (REPORT,), None, "stream")
    assert streamed.to_dict()["no_report"] == "stream"
    assert UsageKvnotes.from_dict(streamed.to_dict()) == streamed
    built = UsageBuilder(58, PLAN, guard_fired=True, report=None).done()
    assert built.no_report == "guard_fired"
    assert UsageBuilder(exact="no_skill").done().no_report is None
