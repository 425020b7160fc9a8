"""The quantized-KV microbenchmark: its config and a run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.metrics import LogitComparison
from kvnotes_bench.micro.quant_fidelity import (
    CONTEXTS,
    QUERY,
    SKILLS,
    QuantFidelityConfig,
    QuantRun,
    run,
)


def test_a_run_compares_every_variant_in_every_context(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    said: list[str] = []
    result = run(QuantFidelityConfig(model="tiny", max_new_tokens=2,
                                      threads=torch.get_num_threads()), engine, say=said.append)
    assert len(result.cases) == len(said) == len(SKILLS) * len(CONTEXTS)
    assert result.query == QUERY and set(result.sizes_bytes) == set(SKILLS)
    assert all(s["int8-token"] < s["fp32"] for s in result.sizes_bytes.values())
    fp32 = [c.variants["fp32"].vs_fp32_compose for c in result.cases]
    assert all(v.kl == pytest.approx(0, abs=1e-6) and v.top1_agree for v in fp32)
    assert result.summary["fp32"].top1_vs_fp32_compose == 1.0
    data = json.loads(json.dumps(result.to_dict()))
    assert QuantRun.from_dict(data).to_dict() == data


def test_a_logit_comparison_reads_back_its_dict():
    c = LogitComparison(cosine=0.9, kl=0.1, top1_reference=3, top1_method=4,
                        top2_margin_reference=0.5, top2_margin_method=0.2)
    assert c.to_dict()["top1_agree"] is False and LogitComparison.from_dict(c.to_dict()) == c


def test_the_config_refuses_no_continuation():
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be at least 1"):
        QuantFidelityConfig(max_new_tokens=0)
