"""The connector's scheduler side without vLLM: a load is recorded when vLLM allocates the
request's blocks and emitted in the step that schedules it, new or resumed after preemption."""

from __future__ import annotations

import logging

from kvnotes.serving.plans import SplicePlanner
from kvnotes.serving.splice import PieceIndex, PieceInfo

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
