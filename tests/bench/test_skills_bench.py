"""The skills workload of serve-bench without vLLM: prompts, summaries, report, and a whole run
against the fake OpenAI-compatible server."""

from __future__ import annotations

import pytest

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.bench.serving.kit import MachineRecord, PhaseSummary
from kvnotes.bench.serving.skills import (
    Fidelity,
    SkillsBenchConfig,
    SkillsResult,
    library_index,
    make_requests,
    markdown,
    run_skills_benchmark,
    skill_texts,
    write_outputs,
)
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.compose_client import ComposeClient, ComposeResult, prompt_ids


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
    with pytest.raises(UnknownNameError, match="valid policies: cold, prefix, compose, "
                                               "repaired, guarded"):
        SkillsBenchConfig(policies=("compose", "warm"))
    with pytest.raises(InvalidArgumentError, match="k must be between"):
        SkillsBenchConfig(k=0)
    with pytest.raises(InvalidArgumentError, match="margin >= 0"):
        SkillsBenchConfig(guard_tau=-1.0)
    with pytest.raises(InvalidArgumentError, match="calibration sample"):
        SkillsBenchConfig(calibration_samples=0)


def _summary(policy: str, conc: int, p90: float) -> PhaseSummary:
    return PhaseSummary(policy=policy, concurrency=conc, requests=4, ok=4, failed=0, skipped=0,
                        ttft_p50_s=p90 / 2, ttft_p90_s=p90, ttft_p99_s=p90, ttft_mean_s=p90 / 2,
                        hit_rate=None, hit_rate_usage=0.9 if policy == "compose" else 0.0,
                        queries_tokens=None, hits_tokens=None, requests_per_s=None, wall_s=1.0,
                        mean_prompt_tokens=1600.0)


def test_ratios_and_report():
    rows = [_summary("cold", 1, 6.0), _summary("prefix", 1, 5.0), _summary("compose", 1, 0.5)]
    result = SkillsResult(config=SkillsBenchConfig(concurrency=(1,)),
                          machine=MachineRecord(2, "cpu", [], [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]),
                          server=None, phases=rows, requests=[],
                          fidelity=[Fidelity(samples=2, failed=0, first_token_agreement=1.0,
                                             continuation_identity=0.5, continuation_tokens=16,
                                             top20_overlap_mean=0.9, cases=[]),
                                    Fidelity(samples=2, failed=0, first_token_agreement=1.0,
                                             continuation_identity=1.0, continuation_tokens=16,
                                             top20_overlap_mean=1.0, cases=[],
                                             policy="guarded", guard_fires=1)])
    data = result.to_dict()
    assert data["ratios"] == [{"concurrency": 1, "prefix_over_compose_p90": 10.0,
                               "cold_over_compose_p90": 12.0}]
    assert "context_tokens" not in data["summaries"][0]  # the skills rows do not vary it
    md = markdown(data)
    assert "| compose | 1 | 4/4 |" in md and "prefix / compose = 10.0x" in md
    assert "| compose | 100.0% | 50.0% | 90.0% | - |" in md
    assert "| guarded | 100.0% | 100.0% | 100.0% | 1 |" in md
    assert "0.1/0.2/0.3 / 0.4/0.5/0.6" in md


def test_skills_benchmark_on_fake_server(fake_server, tokenizer, tmp_path):
    """The whole workload on the shared kit: every phase measured, its /metrics read, the
    concurrency honoured; the fake reuses only exact prefixes within one salt."""
    url, state = fake_server
    state.min_delay = 0.02
    config = SkillsBenchConfig(requests=4, concurrency=(1, 2), fidelity_samples=2, warmup=1,
                               calibration_samples=2)
    client = ComposeClient(url, "smollm2-135m", tokenizer)
    data = run_skills_benchmark(client, config, log=lambda s: None).to_dict()
    rows = {(s["policy"], s["concurrency"]): s for s in data["summaries"]}
    assert set(rows) == {(p, c) for p in ("cold", "prefix", "compose", "repaired", "guarded")
                         for c in (1, 2)}
    # three skills after the first are repaired (a phase each, 128-token blocks); the fake
    # sends no logprobs, so the guard cannot see a margin and always answers exactly
    phased = {(r["policy"], r["concurrency"]): r for r in data["phased"]}
    assert phased[("repaired", 1)]["phases_per_request"] == 3.0
    assert phased[("guarded", 2)]["guard_fires"] == 4
    assert phased[("repaired", 2)]["guard_fires"] is None
    assert data["guard_tau"] == 0.5 and data["calibration"]["cases"] == []
    assert [f["policy"] for f in data["fidelity"]] == ["compose", "repaired", "guarded"]
    # server-side requests per measured one: 3 phases + the real one (+ the exact answer)
    per_request = {"repaired": 4, "guarded": 5}
    for (policy, _), s in rows.items():
        assert s["ok"] == s["requests"] == 4 and s["failed"] == 0 and s["errors"] == {}
        assert s["breakdown"]["n"] == 4 * per_request.get(policy, 1)
        assert s["metrics_error"] is None
        assert s["mean_prompt_tokens"] > 1000
    assert rows[("cold", 1)]["hit_rate_usage"] == 0.0
    assert state.max_inflight == 2
    assert [r["concurrency"] for r in data["ratios"]] == [1, 2]
    assert data["fidelity"][0]["samples"] == 2 and data["server"]["block_size"] == 128
    assert data["machine"]["load_average_end"] is not None
    paths = write_outputs(data, tmp_path)
    assert "| compose | 2 | 4/4 |" in paths["report"].read_text()


def test_cli_skills_options_checked_before_any_server():
    from typer.testing import CliRunner

    from kvnotes.cli import app

    res = CliRunner().invoke(app, ["serve-bench", "skills", "--url", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "--url needs --skills DIR" in res.output
    res = CliRunner().invoke(app, ["serve-bench", "skills", "--launch", "--k", "0"])
    assert res.exit_code == 2 and "--k must be between 1 and" in res.output
    res = CliRunner().invoke(app, ["serve-bench", "skills", "--launch", "--policies", "warm"])
    assert res.exit_code == 2 and "unknown policy 'warm'" in res.output
    res = CliRunner().invoke(app, ["serve-bench", "skills", "--launch", "--guard-tau", "-1"])
    assert res.exit_code == 2 and "margin >= 0" in res.output
    res = CliRunner().invoke(app, ["serve-bench", "--workload", "skills"])
    assert res.exit_code == 2  # one subcommand per workload


def test_reused_fraction():
    assert ComposeResult(ok=True, prompt_tokens=200, cached_tokens=150).reused_fraction == 0.75
    assert ComposeResult(ok=False).reused_fraction is None


def test_library_index_places_pieces_where_register_skills_compiles_them(tokenizer):
    idx = library_index(tokenizer)
    header = idx.get("header")
    assert header is not None and header.origin == 0  # SmolLM2 adds no BOS
    for name in skill_texts():
        piece = idx.get(name)
        assert piece is not None and piece.origin == len(header)  # compiled behind the header
    alone = library_index(tokenizer, anchor=False)
    assert {alone.get(n).origin for n in skill_texts()} == {0}  # type: ignore[union-attr]
