"""The connector's scheduler side without vLLM: a load is recorded when vLLM allocates the
request's blocks and emitted in the step that schedules it, new or resumed after preemption."""

from __future__ import annotations

import logging

import pytest

from kvnotes.serving.library.splice import PieceIndex, PieceInfo
from kvnotes.serving.protocol import LoadedRange, ProtocolError, SpliceReport, SpliceRequest
from kvnotes.serving.vllm.plans import SplicePlanner

BLOCK = 16


def index(*lengths: int) -> tuple[PieceIndex, list[int]]:
    """Pieces of the given lengths with distinct tokens, and a prompt of all of them + 3."""
    idx, prompt, nxt = PieceIndex(), [], 1000
    for n in lengths:
        ids = tuple(range(nxt, nxt + n))
        idx.add(PieceInfo(f"k{nxt}", f"s{nxt}", ids, 0))
        prompt += ids
        nxt += n
    return idx, prompt + [1, 2, 3]


def test_a_new_request_is_loaded_into_the_blocks_it_was_given():
    idx, prompt = index(20, 30)
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 0, idx) == 50
    planner.allocated("r", [4, 9, 2, 8], 50)
    (load,) = planner.take({"r": 53})
    assert (load.start, load.end, load.block_ids) == (0, 50, (4, 9, 2, 8))
    assert load.written_blocks == (4, 9, 2, 8)
    assert planner.take({"r": 1}) == []  # emitted once


def test_a_request_resumed_after_preemption_is_loaded_again():
    """Preempted, the request is admitted again from zero computed tokens with fresh blocks;
    the V1 runner lists it among the cached requests, so only its id says it is scheduled."""
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    planner.match("r", "acme", prompt, 0, idx)
    planner.allocated("r", [1, 2, 3, 4, 5, 6], 80)
    assert len(planner.take({"r": 83})) == 1
    # ... decoding, then preempted: its blocks are freed and it waits again
    assert planner.match("r", "acme", prompt, 0, idx) == 80
    planner.allocated("r", [11, 12, 13, 14, 15, 16], 80)
    (load,) = planner.take({"other": 1, "r": 83})
    assert (load.req_id, load.tenant, load.block_ids[:5]) == ("r", "acme", (11, 12, 13, 14, 15))
    assert (load.start, load.end) == (0, 80)


def test_the_load_starts_at_the_local_hit_and_takes_what_vllm_took():
    """vLLM asks with its block-aligned local hit; it may take fewer tokens than offered."""
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 32, idx) == 48
    planner.allocated("r", list(range(6)), 8)  # trimmed by the scheduler
    (load,) = planner.take({"r": 51})
    assert (load.start, load.end) == (32, 40)
    assert [p.piece.name for p in load.pieces()] == ["s1000"]  # the second piece is not needed
    assert load.written_blocks == (2,)


def test_nothing_is_loaded_when_vllm_takes_nothing_or_the_request_ends():
    idx, prompt = index(40)
    planner = SplicePlanner(block_size=BLOCK)
    planner.match("a", None, prompt, 0, idx)
    planner.allocated("a", [1, 2, 3], 0)  # a longer local hit won
    planner.match("b", None, prompt, 0, idx)
    planner.allocated("b", [4, 5, 6], 40)
    planner.finished("b")  # aborted before its step
    assert planner.take({"a": 3, "b": 3}) == [] and planner.pending == 0


def test_a_load_for_a_request_not_scheduled_is_dropped_with_a_warning(caplog):
    idx, prompt = index(40)
    planner = SplicePlanner(block_size=BLOCK)
    planner.match("r", None, prompt, 0, idx)
    planner.allocated("r", [1, 2, 3], 40)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        assert planner.take({"x": 1}) == []
    assert "['r']" in caplog.text and planner.pending == 0


def test_unmatched_prompts_plan_nothing():
    idx, prompt = index(40)
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, [7, *prompt], 0, idx) == 0
    assert planner.match("s", None, prompt, 48, idx) == 0  # the local hit covers the run
    planner.allocated("r", [1], 0)
    assert planner.take({"r": 1, "s": 1}) == []


# ---- splice ranges (a SpliceRequest in kv_transfer_params) -------------------------------------
def asked(ranges: object, keys: object = None) -> SpliceRequest | None:
    """A splice request as the connector reads it from ``kv_transfer_params``."""
    body: dict = {"v": 1, "ranges": ranges}
    if keys is not None:
        body["keys"] = keys
    return SpliceRequest.from_params({"kvnotes": body})


def ranged(planner: SplicePlanner, req: str, prompt: list[int], hit: int, idx: PieceIndex,
           ranges: object, blocks: int = 8) -> tuple[int, list]:
    """The external tokens offered at ``hit`` and the load when vLLM takes them all."""
    ext = planner.match(req, None, prompt, hit, idx, asked(ranges))
    planner.allocated(req, list(range(blocks)), ext)
    return ext, planner.take({req: len(prompt)})


def test_a_hit_at_a_range_start_supplies_that_range_and_the_ranges_contiguous_after_it():
    idx, prompt = index(40, 40, 40)  # pieces at 0, 40, 80; the second repaired to 48
    ranges = [[0, 0, 40], [40, 48, 80], [80, 80, 120]]
    planner = SplicePlanner(block_size=BLOCK)
    ext, (load,) = ranged(planner, "r", prompt, 48, idx, ranges)
    assert ext == 72 and (load.start, load.end) == (48, 120)
    # the repaired piece is placed at its own start: its tokens from the offset on are written
    assert [(p.piece.name, p.start) for p in load.pieces()] == [("s1040", 40), ("s1080", 80)]
    # at token 0 only the first range: the next one leaves out its piece's first tokens
    ext, (load,) = ranged(planner, "s", prompt, 0, idx, ranges)
    assert ext == 40 and [p.piece.name for p in load.pieces()] == ["s1000"]


def test_a_hit_inside_a_range_supplies_from_the_hit_on():
    idx, prompt = index(40, 80)
    planner = SplicePlanner(block_size=BLOCK)
    ext, (load,) = ranged(planner, "r", prompt, 64, idx, [[0, 0, 40], [40, 48, 120]])
    assert ext == 56 and (load.start, load.end) == (64, 120)
    assert load.written_blocks == (4, 5, 6, 7)


def test_a_hit_in_no_range_supplies_nothing():
    idx, prompt = index(40, 80)
    planner = SplicePlanner(block_size=BLOCK)
    # 16: inside the first piece's recomputed tokens [0, 32); 40: the second's [40, 48)
    assert planner.match("r", None, prompt, 16, idx, asked([[0, 32, 40], [40, 48, 120]])) == 0
    assert planner.match("r", None, prompt, 40, idx, asked([[0, 0, 40], [40, 48, 120]])) == 0
    assert planner.match("r", None, prompt, 0, idx, asked([])) == 0  # no range at all: nothing
    planner.allocated("r", [1], 0)
    assert planner.take({"r": 1}) == []


def test_the_last_prompt_token_is_left_to_compute():
    idx, prompt = index(40, 40)
    prompt = prompt[:80]  # the prompt ends with the last piece
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 48, idx, asked([[0, 0, 40], [40, 48, 80]])) == 31


@pytest.mark.parametrize("bad, kept", [
    ([[0, 0, 40], [40, 48, 79]], 1),        # the piece ends at 80, not 79
    ([[0, 0, 40], [41, 48, 80]], 1),        # no piece starts at 41
    ([[0, 0, 40], [40, 48, 300]], 1),       # past the prompt
    ([[0, 0, 41]], 0),
])
def test_a_range_the_prompt_does_not_hold_is_dropped_with_every_range_after_it(caplog, bad,
                                                                               kept):
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        got = planner.match("r", None, prompt, 0, idx, asked(bad))
        planner.match("r", None, prompt, 0, idx, asked(bad))  # admitted again: logged once
    assert got == (40 if kept else 0)
    assert caplog.text.count("splice ranges dropped") == 1 and "request r" in caplog.text
    # the later, valid-looking range is never used: a hit there supplies nothing
    assert planner.match("q", None, prompt, 40, idx, asked(bad)) == 0


@pytest.mark.parametrize("bad, message", [
    ([[0, 0, 40], [40, 30, 80]], "ranges[1]: splice range [40, 30, 80]: need 0 <= piece_start "
                                 "<= start < end"),
    ([[0, 0, 40], [0, 0, 40], [40, 40, 80]], "range [0, 0, 40] overlaps the one before it "
                                             "([0, 0, 40])"),
    ([[0, 0, 40], "x", [40, 40, 80]], "ranges[1]: a splice range is [piece_start, start, end] "
                                      "(three integers), got 'x'"),
    ([[0, 0, 40], [40, True, 80]], "ranges[1]: a splice range is [piece_start, start, end] "
                                   "(three integers), got [40, True, 80]"),
    ("0,0,40", "ranges: expected a list, got str"),
])
def test_a_malformed_splice_request_is_refused_whole_and_the_request_computed(caplog, bad,
                                                                               message):
    """Never splice what cannot be vouched for: the connector reads the message, and a
    request whose message it refuses gets nothing supplied, with the reason logged and
    reported."""
    with pytest.raises(ProtocolError) as err:
        asked(bad)
    assert str(err.value) == f"kvnotes splice request: {message}"
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        assert planner.match("r", None, prompt, 0, idx, None, str(err.value)) == 0
        assert planner.match("r", None, prompt, 0, idx, None, str(err.value)) == 0
    assert caplog.text.count("its splice request was refused") == 1
    report = planner.finished("r")
    assert report is not None and report.refused == str(err.value) and report.loaded == ()
    assert report.computed == len(prompt)


def test_without_ranges_the_leading_run_is_supplied():
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 0, idx) == 80
    assert planner.match("r", None, prompt, 0, idx, None) == 80
    # a range list that names only the first piece limits the splice to it
    assert planner.match("r", None, prompt, 0, idx, asked([[0, 0, 40]])) == 40


def test_a_piece_compiled_behind_a_prefix_is_chosen_by_its_placement():
    """Two pieces with the same tokens: the range takes the one compiled where it is placed."""
    idx, prompt = index(40, 40)
    idx.add(PieceInfo("moved", "s1040-alone", tuple(prompt[40:80]), 0))
    idx.add(PieceInfo("here", "s1040-here", tuple(prompt[40:80]), 40))
    planner = SplicePlanner(block_size=BLOCK)
    ext, (load,) = ranged(planner, "r", prompt, 48, idx, [[0, 0, 40], [40, 48, 80]])
    assert ext == 32 and [p.piece.key for p in load.pieces()] == ["here"]


# ---- the report (request_finished) ----------------------------------------------------------
def test_the_report_says_what_was_loaded_from_which_entry_and_what_was_computed():
    idx, prompt = index(40, 80)  # 123 tokens: pieces [0, 40) and [40, 120), then 3 of text
    planner = SplicePlanner(block_size=BLOCK)
    ext, (load,) = ranged(planner, "r", prompt, 48, idx, [[0, 0, 40], [40, 48, 120]])
    report = planner.finished("r")
    assert report == SpliceReport(123, 48, (LoadedRange(40, 48, 120, "k1040"),))
    assert report.entries == ("k1040",) and report.supplied == ext == 72
    assert report.computed == 123 - 48 - 72 and report.failed == ()
    assert planner.finished("r") is None  # forgotten once reported


def test_a_failed_load_is_reported_from_its_first_failed_block():
    """vLLM recomputes from the first failed block on: the report's supplied tokens stop
    there; a block of another request's load is not this one's failure."""
    idx, prompt = index(40, 80)
    planner = SplicePlanner(block_size=BLOCK)
    planner.match("r", None, prompt, 0, idx)
    planner.allocated("r", [10, 11, 12, 13, 14, 15, 16, 17], 120)
    planner.take({"r": 123})
    planner.failed({12, 99})  # block 2 holds tokens [32, 48)
    report = planner.finished("r")
    assert report is not None and report.failed == ((32, 120),)
    assert report.recompute_from == 32 and report.supplied == 32
    assert [(r.start, r.end, r.key) for r in report.loaded] == [(0, 40, "k1000"),
                                                                 (40, 120, "k1040")]


def test_a_request_never_matched_has_no_report():
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.finished("unknown") is None
