"""The plan-time benchmark, run tiny: its JSON's shape and its plot (no timing is asserted)."""

from __future__ import annotations

import json
import random

import pytest

from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.planning.front_plan import catalog_view
from kvnotes.serving.planning.request import read_request
from kvnotes_bench.micro import plan_time


def test_a_tiny_run_writes_its_json_and_plot(tmp_path):
    plan_time.main(["--sizes", "4,8", "--in-prompt", "2", "--prompt-tokens", "160",
                    "--repeats", "3", "--question-words", "8", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "plan-time.json").read_text())
    assert (tmp_path / "plan-time.png").stat().st_size > 0
    assert {"config", "prompt_tokens", "rows", "machine_before", "machine_after", "load",
            "command", "date", "tokenize_p50_ms", "question_tokens"} <= set(data)
    assert data["config"]["sizes"] == [4, 8] and "plan_time" in data["command"]
    assert data["config"]["question_words"] == 8 and 8 <= data["question_tokens"] <= 16
    assert 100 < data["prompt_tokens"] < 220
    assert [(r["path"], r["catalog_size"]) for r in data["rows"]] == [
        (path, size) for size in (4, 8) for path in ("text_warm", "text_cold", "ids")]
    for row in data["rows"]:
        assert row["repeats"] == 3 and row["skills_found"] == 2  # the prompt's entries
        assert 0 < row["p50_ms"] <= row["p90_ms"]
    assert "torch_threads" in data["machine_after"]
    assert 0 < data["tokenize_p50_ms"]
    result = plan_time.read_result(data)
    assert result.to_dict() == data


def test_each_request_asks_a_new_question_after_the_last_entry(tokenizer):
    """The warm case's cache holds the context's parts, never a whole request: every request
    ends with a question no case asked before, a part of its own after the last entry."""
    config = plan_time.PlanTimeConfig(sizes=(3,), in_prompt=2, prompt_tokens=200, repeats=4,
                                      question_words=6)
    rng = random.Random(0)
    texts = plan_time.entry_texts(tokenizer, 3, rng)
    context = plan_time.prompt_text(tokenizer, texts[:2], 194, rng)
    assert context.endswith(texts[1]) and context.count(texts[0]) == 1
    asked = plan_time.questions(tokenizer, 4 * 5, 6, rng)
    assert len(set(asked)) == len(asked) and all(q.startswith("\n\n") for q in asked)
    catalogs = {3: plan_time.catalog_of(tokenizer, texts)}
    find = catalog_view(catalogs[3], None).find
    context_ids = read_request("completion", {"model": "m", "prompt": context}, tokenizer,
                               find=find).prompt_ids
    cases = plan_time.cases(tokenizer, config, context, context_ids, catalogs, asked)
    assert [(c.path, c.catalog_size) for c in cases] == [
        ("text_warm", 3), ("text_cold", 3), ("ids", 3), ("tokenize", 0)]
    prompts = [[c.prompt(i) for i in range(5)] for c in cases]
    texts_sent = [p for c, ps in zip(cases, prompts, strict=True) if c.path != "ids" for p in ps]
    assert len(set(texts_sent)) == len(texts_sent)  # no question twice, across cases
    for case in cases[:3]:
        assert [case.call(i)[1] for i in range(5)] == [2] * 5  # both entries, every request
    last = read_request("completion", {"model": "m", "prompt": prompts[0][4]}, tokenizer,
                        find=find).parts[-1]
    assert last.kind == "text" and last.text == asked[4]  # the question, a part alone
    assert prompts[2][4] == context_ids + encode(tokenizer, asked[2 * 5 + 4])


def test_a_catalog_smaller_than_the_prompts_entries_is_refused():
    with pytest.raises(InvalidArgumentError, match="every catalog size"):
        plan_time.PlanTimeConfig(sizes=(2, 10), in_prompt=4)
    with pytest.raises(InvalidArgumentError, match="question_words"):
        plan_time.PlanTimeConfig(question_words=0)
