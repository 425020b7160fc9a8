"""The skills workload of serve-bench without a server: prompts, summaries, report."""

from __future__ import annotations

import pytest

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.bench.serving.skills import (
    PhaseSummary,
    SkillsBenchConfig,
    make_requests,
    markdown,
    ratios,
    skill_texts,
)
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.compose_client import ComposeResult, prompt_ids


def test_requests_pick_k_distinct_skills_in_random_order():
    reqs = make_requests(30, 4, seed=1)
    skills = set(skill_texts().values())
    assert len(skills) >= 8
    orders = set()
    for parts in reqs:
        assert parts[0] == HEADER and len(parts) == 6
        chosen = parts[1:5]
        assert len(set(chosen)) == 4 and set(chosen) <= skills
        assert "Customer" in parts[5]
        orders.add(tuple(chosen))
    assert len(orders) > 25  # orders rarely repeat: prefix caching gets little
    assert make_requests(30, 4, seed=1) == reqs  # deterministic per seed


def test_skills_are_realistic_lengths(tokenizer):
    for name, text in skill_texts().items():
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert 200 <= n <= 600, (name, n)


def test_prompt_ids_are_per_part_tokenization(tokenizer):
    parts = ["Header.\n", "Skill one.", " User asks?"]
    ids = prompt_ids(tokenizer, parts)
    expected = [t for p in parts for t in tokenizer(p, add_special_tokens=False)["input_ids"]]
    assert ids == expected  # SmolLM2 adds no BOS
    with pytest.raises(TypeError, match="list of strings"):
        prompt_ids(tokenizer, "one string")


def test_config_errors():
    with pytest.raises(UnknownNameError, match="valid policies: cold, prefix, compose"):
        SkillsBenchConfig(policies=("compose", "warm"))
    with pytest.raises(InvalidArgumentError, match="k must be between"):
        SkillsBenchConfig(k=0)


def _summary(policy: str, conc: int, p90: float) -> PhaseSummary:
    return PhaseSummary(policy, conc, 4, 4, 0, p90 / 2, p90, p90, 0.9 if policy == "compose"
                        else 0.0, 1600.0, 1.0)


def test_ratios_and_report():
    rows = [_summary("cold", 1, 6.0), _summary("prefix", 1, 5.0), _summary("compose", 1, 0.5)]
    assert ratios(rows) == [{"concurrency": 1, "prefix_over_compose_p90": 10.0,
                             "cold_over_compose_p90": 12.0}]
    result = {"config": vars(SkillsBenchConfig()) | {"concurrency": [1]},
              "machine": {"before": {"load_average": (0.1, 0.2, 0.3)},
                          "after": {"load_average": (0.4, 0.5, 0.6)}},
              "summaries": [vars(s) for s in rows], "ratios": ratios(rows),
              "fidelity": {"samples": 2, "first_token_agreement": 1.0,
                           "continuation_identity": 0.5, "continuation_tokens": 16,
                           "top20_overlap_mean": 0.9},
              "server": {"dtype": "float32", "block_size": 128}}
    md = markdown(result)
    assert "| compose | 1 | 4/4 |" in md and "prefix / compose = 10.0x" in md
    assert "first-token agreement: 100.0%" in md and "0.1/0.2/0.3" in md


def test_reused_fraction():
    assert ComposeResult(ok=True, prompt_tokens=200, cached_tokens=150).reused_fraction == 0.75
    assert ComposeResult(ok=False).reused_fraction is None
