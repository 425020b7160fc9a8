"""BFCL's own AST checker on calls read after the opening (the installed bfcl-eval package)."""

from __future__ import annotations

import json

import pytest

from kvnotes_bench.tools.bfcl_check import CallCheck, check_call, parse_call
from kvnotes_bench.tools.data import load_cases, spread
from kvnotes_bench.tools.prompt import CALL_OPENING

WEATHER = [{"name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "dict", "properties": {
                "city": {"type": "string", "description": "The city."},
                "unit": {"type": "string", "description": "c or f."}},
                "required": ["city"]}}]
TRUTH = [{"get_weather": {"city": ["Paris"], "unit": ["", "c"]}}]


def _after_opening(call: dict) -> str:
    text = json.dumps(call)
    assert text.startswith(CALL_OPENING)
    return text[len(CALL_OPENING):]


def test_parse_call_reads_the_first_complete_object():
    assert parse_call('get_weather", "arguments": {"city": "Pa}ris"}} and more {') == {
        "get_weather": {"city": "Pa}ris"}}  # a brace inside a string does not close it
    assert parse_call('get_weather", "arguments": {"city": ') is None  # cut off
    assert parse_call('get_weather", "arguments": 3}') is None  # not a call's shape
    assert parse_call('get_weather" "arguments": {}}') is None  # not JSON
    assert parse_call('f", "parameters": {"x": 1}}') == {"f": {"x": 1}}


def test_checker_accepts_the_right_call_and_says_why_not_otherwise():
    ok = check_call(_after_opening({"name": "get_weather", "arguments": {"city": "Paris"}}),
                    WEATHER, TRUTH)
    assert ok == CallCheck(parsed=True, valid=True, name="get_weather", error=None)
    wrong = check_call(_after_opening({"name": "get_weather", "arguments": {"city": "Rome"}}),
                       WEATHER, TRUTH)
    assert wrong.parsed and wrong.valid is False and "Rome" in (wrong.error or "")
    missing = check_call(_after_opening({"name": "get_weather", "arguments": {}}), WEATHER, TRUTH)
    assert missing.valid is False and missing.error
    assert check_call('get_wea', WEATHER, TRUTH) == CallCheck(parsed=False, valid=None)


def _first_accepted(values):
    if isinstance(values, list):
        return next((_first_accepted(v) for v in values if v != ""), None)
    if isinstance(values, dict):
        return {k: _first_accepted(v) for k, v in values.items()
                if _first_accepted(v) is not None}
    return values


def test_ground_truth_calls_of_development_cases_pass_bfcl_checker():
    """Each case's own first accepted answer, written as the prompt asks, is valid: the case's
    raw descriptions and possible answers reach the checker as BFCL's evaluation passes them."""
    checked = 0
    for case in spread(load_cases("live_multiple"), 30):
        truth = case.meta["ground_truth"]
        (name, accepted), = truth[0].items()
        args = {k: _first_accepted(v) for k, v in accepted.items()
                if _first_accepted(v) is not None}
        got = check_call(_after_opening({"name": name, "arguments": args}),
                         case.meta["functions"], truth)
        if got.valid:
            checked += 1
        else:  # BFCL's checker is strict about some nested forms: say which
            assert got.parsed and got.error, case.id
    assert checked >= 20


@pytest.mark.parametrize("junk", ["", "}", '"}', "\\"])
def test_odd_texts_are_unparsable_not_errors(junk):
    assert check_call(junk, WEATHER, TRUTH).parsed is False


def test_the_bench_checks_each_strategys_call_where_asked(tiny_llama):
    """``call_tokens`` decodes the longer answer for the checker and keeps the greedy identity
    over the first ``greedy_tokens``; the summary counts checked, parsed and valid calls."""
    from kvnotes.research.tool_runs import StrategySummary
    from kvnotes_bench.tools.data import SkillDoc, ToolCase
    from kvnotes_bench.tools.prompt import case_prompt
    from kvnotes_bench.tools.runner import run_case
    from kvnotes_bench.tools.strategies import SkillCache, parse_strategies

    docs = [dict(WEATHER[0]), {**WEATHER[0], "name": "get_time"}]
    case = ToolCase("live_multiple_x", "live_multiple",
                    tuple(SkillDoc(d["name"], json.dumps(d), (d["name"],)) for d in docs),
                    "Weather in Paris?", ("get_weather",),
                    meta={"functions": docs, "ground_truth": TRUTH})
    prompt = case_prompt(tiny_llama.tokenizer, case)
    strategies = parse_strategies(["exact", "splice"])
    short = run_case(tiny_llama, case, prompt, strategies, SkillCache(tiny_llama),
                     half="evaluate", taus={}, greedy_tokens=3)
    long = run_case(tiny_llama, case, prompt, strategies, SkillCache(tiny_llama),
                    half="evaluate", taus={}, greedy_tokens=3, call_tokens=12)
    for a, b in zip(short.outcomes, long.outcomes, strict=True):
        assert a.greedy_text == b.greedy_text and a.greedy_identical == b.greedy_identical
        assert a.call_parsed is None and b.call_parsed is not None
        assert b.call_valid is False or b.call_parsed  # valid only where it parsed
    s = StrategySummary.of("splice", [long])
    assert s.calls_checked == 1 and s.calls_parsed is not None and s.exact_calls_valid is not None
    assert StrategySummary.of("splice", [short]).calls_checked is None
