"""The compile-share microbenchmark: its config, a run on a tiny model, the stored result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.compile_share import (
    CompileShareConfig,
    CompileShareResult,
    markdown,
    plot,
    run,
    tool_list,
)

STORED = Path(__file__).resolve().parents[3] / "docs" / "results" / "bench" / "compile_share.json"


def test_the_committed_result_reads_back():
    data = json.loads(STORED.read_text())
    result = CompileShareResult.from_dict(data)
    assert result.to_dict() == data
    # the measured ordering the default rests on: a higher nice value, a slower busy compile
    busy = [r.busy_s for r in sorted(result.rows, key=lambda r: r.nice)]
    assert busy == sorted(busy)


def test_a_run_times_each_nice_value_idle_and_busy(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = CompileShareConfig(model="tiny", nice=(0, 5), tokens=24, reps=1, busy=1,
                                threads=torch.get_num_threads())
    result = run(config, engine)
    assert [r.nice for r in result.rows] == [0, 5] and result.busy_processes == 1
    assert result.chunk_tokens >= 24
    for row in result.rows:
        assert len(row.idle_raw) == len(row.busy_raw) == 1 and row.idle_s > 0
        assert row.slowdown == pytest.approx(row.busy_s / row.idle_s)
    assert result.rows[0].predicted_share == 0.5 > result.rows[1].predicted_share
    assert CompileShareResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert "| 5 |" in markdown(result)
    plot(result, tmp_path / "compile_share.png")
    assert (tmp_path / "compile_share.png").stat().st_size > 0


def test_the_chunk_holds_the_asked_tokens(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    assert len(engine.tokenizer.encode(tool_list(100, engine))) >= 100


def test_the_config_refuses_bad_values():
    with pytest.raises(InvalidArgumentError, match="nice values"):
        CompileShareConfig(nice=(20,))
    with pytest.raises(InvalidArgumentError, match="at least 1"):
        CompileShareConfig(reps=0)
