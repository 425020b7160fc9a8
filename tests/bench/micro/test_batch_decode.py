"""The batched-decoding microbenchmark: its config, a run on a tiny model, the stored result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.batch_decode import BatchDecodeConfig, BatchDecodeResult, plot, run

STORED = Path(__file__).resolve().parents[3] / "docs" / "results" / "bench" / "batch_decode.json"


def test_the_committed_result_reads_back():
    data = json.loads(STORED.read_text())
    assert BatchDecodeResult.from_dict(data).to_dict() == data


def test_a_run_decodes_every_row_alike_one_by_one_and_batched(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = BatchDecodeConfig(model="tiny", tokens=2, reps=1, threads=torch.get_num_threads())
    result = run(config, engine)
    assert result.rows == len(result.row_tokens) > 2 and result.new_tokens_per_row == 2
    assert result.texts_identical == result.rows  # batching changes no greedy token
    assert len(result.raw["batched_s"]) == 1 and result.speedup > 0
    assert BatchDecodeResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    plot(result, tmp_path / "batch_decode.png")
    assert (tmp_path / "batch_decode.png").stat().st_size > 0


def test_the_config_refuses_nothing_to_decode():
    with pytest.raises(InvalidArgumentError, match="tokens and reps must be at least 1"):
        BatchDecodeConfig(tokens=0)
