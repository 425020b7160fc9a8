"""The compose-TTFT microbenchmark: its config, a run on a tiny model, the stored result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.compose_ttft import ComposeTtftConfig, ComposeTtftResult, plot, run

STORED = Path(__file__).resolve().parents[3] / "docs" / "results" / "bench" / "compose_ttft.json"


def test_the_committed_result_reads_back(tmp_path):
    data = json.loads(STORED.read_text())
    result = ComposeTtftResult.from_dict(data)
    assert result.to_dict() == data
    assert result.speedup_at_4096 == result.rows[-1].speedup
    plot(result, tmp_path / "compose_ttft.png")


def test_a_run_times_every_length_against_its_shortest(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = ComposeTtftConfig(model="tiny", lengths=(8, 16), reps=1, decode_tokens=2,
                               threads=torch.get_num_threads())
    said: list[str] = []
    result = run(config, engine, say=said.append)
    assert [r.requested_tokens for r in result.rows] == [8, 16] and len(said) == 2
    first, last = result.rows
    assert first.decode_bytes_ratio == 1.0 and last.decode_bytes_ratio > 1.0  # more KV to read
    assert last.total_tokens > first.total_tokens and last.decode_tokens == 2
    assert result.speedup_at_2048 is None  # the run has no 2048-token row
    assert set(result.slopes) >= {"compose_s", "splice_s"}
    assert all(math.isfinite(v) for v in result.slopes.values())
    back = ComposeTtftResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back == result
    plot(result, tmp_path / "compose_ttft.png")
    assert (tmp_path / "compose_ttft.png").stat().st_size > 0


def test_the_config_refuses_an_empty_sweep():
    with pytest.raises(InvalidArgumentError, match="lengths"):
        ComposeTtftConfig(lengths=())
    with pytest.raises(InvalidArgumentError, match="decode_tokens"):
        ComposeTtftConfig(decode_tokens=0)
