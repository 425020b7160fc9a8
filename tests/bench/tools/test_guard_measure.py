"""The guard's and the divergence's measurements on a tiny random model (exactness only)."""

from __future__ import annotations

import math

import pytest

from kvnotes_bench.tools.divergence import (
    DivergenceCase,
    SkillOracle,
    StrategyRead,
    deviation,
    oracle,
    summarize,
    summarize_oracle,
    where_of,
)
from kvnotes_bench.tools.guard_measure import (
    Request,
    decode,
    first_divergence,
    guard_case,
    notes_of,
    read,
    skill_ids,
)
from kvnotes_bench.tools.prompt import CasePrompt
from kvnotes_bench.tools.strategies import SkillCache, parse_strategy

PROMPT = CasePrompt("You pick a tool.", ("\nweather: the forecast of a city for a day",
                                         "\nflights: search flights between two airports"),
                    "\nUser: fly me to Rome", ' {"name": "')


def test_exact_and_composed_records_count_the_same_tokens(tiny_llama):
    req = Request("r", "live_multiple", PROMPT, True)
    skills = SkillCache(tiny_llama)
    exact = read(tiny_llama, req, notes_of(tiny_llama, req, parse_strategy("exact"), skills))
    composed = read(tiny_llama, req, notes_of(tiny_llama, req, parse_strategy("epic:4"),
                                              skills))
    decode(tiny_llama, [composed, exact], 4)
    ids, spans = skill_ids(tiny_llama, PROMPT)
    assert len(composed.notes) == len(exact.notes) == len(ids)
    assert [int(t) for t in exact.notes.token_ids] == ids
    rec = guard_case(tiny_llama, req, composed, exact)
    assert rec.tokens == len(ids) + len(req.tail(tiny_llama))
    assert rec.spliced == sum(b - a for a, b in spans) and rec.prefix == spans[0][0]
    assert 0 < rec.repaired <= 4  # the second skill's first 4 (the first is exactly placed)
    assert rec.margin >= 0 and math.isfinite(rec.exact_margin)
    assert len(exact.greedy) == 4 and rec.choice_same is not None
    # the exact reading against itself: identical, the same margin
    same = guard_case(tiny_llama, req, exact, exact)
    assert same.first_same and same.greedy_same and same.margin == same.exact_margin


def test_recomputing_the_only_spliced_skill_restores_the_exact_notes(tiny_llama):
    req = Request("r", "live_multiple", PROMPT, True)
    skills = SkillCache(tiny_llama)
    exact = read(tiny_llama, req, notes_of(tiny_llama, req, parse_strategy("exact"), skills))
    bare = read(tiny_llama, req, notes_of(tiny_llama, req, parse_strategy("splice"), skills))
    decode(tiny_llama, [bare, exact], 6)
    checks = oracle(tiny_llama, req, bare, exact, n=6)
    assert [c.index for c in checks] == [1]  # the first skill sits where it was compiled
    (only,) = checks
    assert only.restores and only.restores_first and only.deviation > 0
    _, spans = skill_ids(tiny_llama, PROMPT)
    assert deviation(exact.notes, exact.notes, *spans[1]) == 0


def test_where_a_divergence_sits():
    assert first_divergence([5, 6, 7], [5, 6, 8]) == 2
    assert first_divergence([5, 6], [5, 6, 7]) == 2  # one row stopped early
    assert first_divergence([1], [1]) is None
    assert [where_of(p, 3) for p in (0, 1, 2, 3, 9)] == [
        "first token", "rest of the name", "rest of the name", "arguments", "arguments"]


def _case(first: bool, same: bool, at: int | None, oracle_rows=()) -> DivergenceCase:
    where = None if at is None else where_of(at, 3)
    return DivergenceCase("c", 3, "x", 3, (StrategyRead("epic:32", first, same, at, where, ""),),
                          tuple(oracle_rows))


def test_summaries_count_identity_given_the_first_token_and_restoring_places():
    cases = [_case(True, True, None), _case(True, False, 5, [
        SkillOracle(1, 10, 0.5, False, True), SkillOracle(2, 10, 0.1, True, True)]),
        _case(False, False, 0, [SkillOracle(1, 10, 0.2, True, True),
                                SkillOracle(2, 10, 0.3, False, False)])]
    s = summarize(cases, "epic:32")
    assert (s.cases, s.first_same, s.greedy_same, s.greedy_given_first) == (3, 2, 1, 1)
    assert s.where == {"first token": 1, "rest of the name": 0, "arguments": 1}
    assert s.positions == [0, 5]
    o = summarize_oracle(cases)
    assert (o.divergent, o.restored, o.restored_by_last) == (2, 2, 1)
    assert o.restored_by_most_deviating == 0 and o.last_is_most_deviating == 1
    assert o.by_place_from_end == {"1": 1, "2": 1}
    assert DivergenceCase.from_dict(cases[1].to_dict()) == cases[1]


@pytest.mark.parametrize("bad", ["exact", "guard:epic:32"])
def test_divergence_takes_composed_strategies(bad):
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes_bench.tools.divergence import DivergenceConfig

    with pytest.raises(InvalidArgumentError):
        DivergenceConfig(strategies=(bad,))


def test_a_guard_run_with_divergence_pools_from_its_json(tiny_llama, monkeypatch):
    import json

    from kvnotes_bench.tools import guard_run
    from kvnotes_bench.tools.guard_run import GuardBenchConfig, GuardBenchResult

    reqs = [Request(f"r{i}", "live_multiple", PROMPT, True) for i in range(3)]
    monkeypatch.setattr(guard_run, "requests", lambda engine, s, n, **kw: reqs)
    config = GuardBenchConfig(sets=("live_multiple",), cases=3, strategy="epic:4",
                              divergence=("pred+epic:4",), part=(1, 2), taus=(0.0, 0.5))
    result = guard_run.run_guard_bench(tiny_llama, config, model="tiny")
    assert [c.id for c in result.cases["live_multiple"]] == ["r1"]  # every 2nd from the 2nd
    (div,) = result.divergence["live_multiple"]
    assert [r.strategy for r in div.reads] == ["epic:4", "pred+epic:4"]
    data = json.loads(json.dumps(result.to_dict(), default=str))
    pooled = GuardBenchResult.from_dicts([data, data])
    assert len(pooled.cases["live_multiple"]) == 2 and pooled.curves["live_multiple"][0].cases == 2
    assert "16 greedy tokens on live_multiple" in guard_run.markdown(pooled)


def test_airline_requests_come_from_the_prompt_maker_given(tiny_llama):
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes_bench.serving.prompt_sets import make_requests
    from kvnotes_bench.tools.guard_measure import requests

    found = requests(tiny_llama, "airline", 3, k=2, airline=make_requests)
    assert [r.id for r in found] == ["airline-0", "airline-1", "airline-2"]
    assert all(len(r.prompt.skills) == 2 and not r.decides and not r.prompt.query
               for r in found)
    assert found[0].prompt == requests(tiny_llama, "airline", 3, k=2,
                                       airline=make_requests)[0].prompt  # seeded
    with pytest.raises(InvalidArgumentError, match="make_requests"):
        requests(tiny_llama, "airline", 3)
    with pytest.raises(InvalidArgumentError, match="unknown development set"):
        requests(tiny_llama, "simple", 3)


def test_bench_guard_refuses_a_held_out_set_and_a_bad_part_before_loading(monkeypatch):
    from typer.testing import CliRunner

    from kvnotes.cli import options
    from kvnotes_bench.cli import app

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(options, "load_engine", no_load)
    held = CliRunner().invoke(app, ["guard", "--model", "m", "--set",
                                    "live_multiple,simple"])
    assert held.exit_code == 2 and "held out" in held.output
    part = CliRunner().invoke(app, ["guard", "--model", "m", "--part", "2/2"])
    assert part.exit_code == 2 and "--part 2/2" in part.output
