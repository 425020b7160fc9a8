"""The splice-throughput microbenchmark: its config and a run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.splice_bandwidth import (
    SpliceBandwidthConfig,
    SpliceBandwidthResult,
    plot,
    run,
)


def test_a_run_times_the_splice_against_a_copy_of_the_same_bytes(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = SpliceBandwidthConfig(model="tiny", lengths=(8, 16), reps=1,
                                   threads=torch.get_num_threads())
    said: list[str] = []
    result = run(config, engine, say=said.append)
    assert [r.tokens for r in result.rows] == [8, 16] and len(said) == 2
    assert result.rows[1].bytes == 2 * result.rows[0].bytes  # KV bytes grow with the tokens
    assert all(r.splice_gb_s > 0 and len(r.raw["copy_s"]) == 1 for r in result.rows)
    assert SpliceBandwidthResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    plot(result, tmp_path / "splice_bandwidth.png")


def test_the_config_refuses_an_empty_sweep():
    with pytest.raises(InvalidArgumentError, match="lengths"):
        SpliceBandwidthConfig(lengths=())
