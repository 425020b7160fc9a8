"""The connector's scheduler side without vLLM: a load is recorded when vLLM allocates the
request's blocks and emitted in the step that schedules it, new or resumed after preemption."""

from __future__ import annotations

import logging

import pytest

from kvnotes.serving.library.splice import PieceIndex, PieceInfo
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


# ---- splice ranges (kv_transfer_params["kvnotes_splice"]) ---------------------------------------
def ranged(planner: SplicePlanner, req: str, prompt: list[int], hit: int, idx: PieceIndex,
           ranges: object, blocks: int = 8) -> tuple[int, list]:
    """The external tokens offered at ``hit`` and the load when vLLM takes them all."""
    ext = planner.match(req, None, prompt, hit, idx, ranges)
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
    assert planner.match("r", None, prompt, 16, idx, [[0, 32, 40], [40, 48, 120]]) == 0
    assert planner.match("r", None, prompt, 40, idx, [[0, 0, 40], [40, 48, 120]]) == 0
    assert planner.match("r", None, prompt, 0, idx, []) == 0  # no range at all: nothing
    planner.allocated("r", [1], 0)
    assert planner.take({"r": 1}) == []


def test_the_last_prompt_token_is_left_to_compute():
    idx, prompt = index(40, 40)
    prompt = prompt[:80]  # the prompt ends with the last piece
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 48, idx, [[0, 0, 40], [40, 48, 80]]) == 31


@pytest.mark.parametrize("bad, kept", [
    ([[0, 0, 40], [40, 48, 79]], 1),        # the piece ends at 80, not 79
    ([[0, 0, 40], [41, 48, 80]], 1),        # no piece starts at 41
    ([[0, 0, 40], [40, 48, 300]], 1),       # past the prompt
    ([[0, 0, 40], [40, 30, 80]], 1),        # start before piece_start
    ([[0, 0, 40], [0, 0, 40], [40, 40, 80]], 1),  # overlaps the range before it
    ([[0, 0, 40], "x", [40, 40, 80]], 1),   # not three integers
    ([[0, 0, 40], [40, True, 80]], 1),
    ([[0, 0, 41]], 0),
    ("0,0,40", 0),                          # not a list
])
def test_an_invalid_range_and_every_range_after_it_are_dropped_and_logged(caplog, bad, kept):
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        got = planner.match("r", None, prompt, 0, idx, bad)
        planner.match("r", None, prompt, 0, idx, bad)  # admitted again: logged once
    assert got == (40 if kept else 0)
    assert caplog.text.count("splice ranges dropped") == 1 and "request r" in caplog.text
    # the later, valid-looking range is never used: a hit there supplies nothing
    assert planner.match("q", None, prompt, 40, idx, bad) == 0


def test_without_ranges_the_leading_run_is_supplied():
    idx, prompt = index(40, 40)
    planner = SplicePlanner(block_size=BLOCK)
    assert planner.match("r", None, prompt, 0, idx) == 80
    assert planner.match("r", None, prompt, 0, idx, None) == 80
    # a range list that names only the first piece limits the splice to it
    assert planner.match("r", None, prompt, 0, idx, [[0, 0, 40]]) == 40


def test_a_piece_compiled_behind_a_prefix_is_chosen_by_its_placement():
    """Two pieces with the same tokens: the range takes the one compiled where it is placed."""
    idx, prompt = index(40, 40)
    idx.add(PieceInfo("moved", "s1040-alone", tuple(prompt[40:80]), 0))
    idx.add(PieceInfo("here", "s1040-here", tuple(prompt[40:80]), 40))
    planner = SplicePlanner(block_size=BLOCK)
    ext, (load,) = ranged(planner, "r", prompt, 48, idx, [[0, 0, 40], [40, 48, 80]])
    assert ext == 32 and [p.piece.key for p in load.pieces()] == ["here"]
