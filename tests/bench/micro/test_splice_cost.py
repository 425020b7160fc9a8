"""The worker splice-cost microbenchmark: its config, a run on a tiny model, the stored result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.splice_cost import SpliceCostConfig, SpliceCostResult, plot, run

STORED = (Path(__file__).resolve().parents[3] / "docs" / "results" / "splice-cost"
          / "splice_cost.json")


def test_the_committed_result_reads_back():
    data = json.loads(STORED.read_text())
    result = SpliceCostResult.from_dict(data)
    assert result.to_dict() == data and result.rows[-1].tokens == 4096


def test_a_run_times_every_worker_state_against_a_copy(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = SpliceCostConfig(model="tiny", lengths=(8, 16), reps=1, block_size=4,
                              threads=torch.get_num_threads(), library=tmp_path / "library")
    said: list[str] = []
    result = run(config, engine, command="test", say=said.append)
    assert [r.tokens for r in result.rows] == [8, 16] and len(said) == 2
    assert result.rows[1].bytes_written == 2 * result.rows[0].bytes_written
    assert all(set(r.per_token_s) == {"copy", "warm", "turn", "cold"} for r in result.rows)
    assert all(len(r.raw_s["cold"]) == 1 for r in result.rows) and result.command == "test"
    assert (tmp_path / "library").is_dir()  # the long skill is kept for the next run
    data = json.loads(json.dumps(result.to_dict()))
    assert SpliceCostResult.from_dict(data) == result
    plot(result, tmp_path / "splice_cost.png")
    assert (tmp_path / "splice_cost.png").stat().st_size > 0


def test_the_config_refuses_what_it_cannot_run():
    with pytest.raises(InvalidArgumentError, match="lengths"):
        SpliceCostConfig(lengths=())
    with pytest.raises(InvalidArgumentError, match="dtype must be one of"):
        SpliceCostConfig(dtype="int8")
