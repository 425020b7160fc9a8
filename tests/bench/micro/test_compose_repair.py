"""The compose-repair microbenchmark: its config and a run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro.compose_repair import (
    BUDGETS,
    FRESH,
    ComposeRepairConfig,
    ComposeRepairResult,
    plot,
    run,
    table,
)


def test_a_run_compares_every_condition_against_recompute(tokenizer, tmp_path):
    engine = make_tiny_engine("llama", tokenizer)
    config = ComposeRepairConfig(models=("tiny",), threads=torch.get_num_threads(), fresh=1)
    said: list[str] = []
    saved: list[ComposeRepairResult] = []
    result = run(config, engine, say=said.append, saved=saved.append)
    (m,) = result.models
    assert saved == [result] and len(said) == len(m.cases) and m.cases[-1] == FRESH[0].name
    assert [r.fresh for r in m.rows if r.case == FRESH[0].name][0]
    assert {s.budget for s in m.summary} == set(BUDGETS)
    bare = [r for r in m.rows if r.budget == 0]
    assert bare and all(r.repaired == 0 and r.select == "none" for r in bare)
    assert all(s.n == len(m.cases) for s in m.summary)
    back = ComposeRepairResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back.to_dict() == result.to_dict()
    assert table(result.models).count("| tiny |") == len(m.summary)
    plot(result.models, tmp_path / "compose-repair.png")
    assert (tmp_path / "compose-repair.png").stat().st_size > 0


def test_the_config_refuses_what_it_cannot_run(tokenizer):
    with pytest.raises(InvalidArgumentError, match="fresh must be between 0"):
        ComposeRepairConfig(fresh=len(FRESH) + 1)
    with pytest.raises(InvalidArgumentError, match="models is empty"):
        ComposeRepairConfig(models=())
    with pytest.raises(InvalidArgumentError, match="an engine stands for one model"):
        run(ComposeRepairConfig(models=("a", "b")), make_tiny_engine("llama", tokenizer))
