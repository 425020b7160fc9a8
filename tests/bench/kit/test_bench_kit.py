"""The kit every workload shares: failure kinds, number formats, the machine record."""

from __future__ import annotations

from kvnotes_bench.kit.failures import Failure, classify, count_kinds
from kvnotes_bench.kit.formats import fmt_kinds, fmt_load, fmt_ms, fmt_pct, fmt_s
from kvnotes_bench.kit.machine import MachineRecord


def test_failures_are_classified_by_their_classes_names():
    class Status(Exception):
        status_code = 503
        message = "overloaded"

    class APITimeoutError(Exception):
        pass

    class TransportError(Exception):
        pass

    class APIError(Exception):
        message = "bad chunk"

    assert classify(Status()) == Failure("http_5xx", "HTTP 503: overloaded")
    assert classify(APITimeoutError()) == Failure("timeout", "timed out (APITimeoutError)")
    assert classify(ConnectionResetError("peer")).kind == "connection"
    assert classify(TransportError("cut")) == Failure(
        "connection", "connection dropped: TransportError: cut")
    assert classify(APIError()) == Failure("stream", "server error in stream: bad chunk")
    assert classify(ValueError("x")) == Failure("stream", "ValueError: x")


def test_failures_are_counted_by_kind():
    class Rec:
        def __init__(self, kind: str | None) -> None:
            self.error_kind = kind

    assert count_kinds([Rec("timeout"), Rec(None), Rec("timeout")]) == {"other": 1, "timeout": 2}


def test_formats():
    assert (fmt_s(0.12345), fmt_ms(0.0126), fmt_pct(0.987), fmt_load([1.26, 2.0, 3.0])) == (
        "0.123s", "13 ms", "98.7%", "1.3")
    assert fmt_s(None) == fmt_ms(None) == fmt_pct(None) == fmt_load(None) == fmt_kinds({}) == "-"
    assert fmt_kinds({"timeout": 2, "http_5xx": 1}) == "http_5xx 1, timeout 2"


def test_the_machine_record_reads_back():
    record = MachineRecord(2, "cpu", ["avx2"], [0.5, 0.4, 0.3], [1.0, 0.9, 0.8])
    assert MachineRecord.from_dict(record.to_dict()) == record
    assert MachineRecord.from_dict({}) == MachineRecord(None, "", [], [])
