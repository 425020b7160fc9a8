"""The BFCL harness driver's parts that need no server: category checks, reading BFCL's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.harness_bfcl import (
    HarnessConfig,
    ServerRun,
    differing,
    first_ids,
    prompt_tool_texts,
    read_answers,
    read_scores,
    tool_texts,
)

PROMPT = ("<|im_start|>system\n# Tools\n\nYou are provided with function signatures within "
          "<tools></tools> XML tags:\n<tools>\n{\"name\": \"a\"}\n{\"name\": \"b\"}\n</tools>\n\n"
          "For each function call ...<|im_end|>\n")


def _lines(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")


def test_the_held_out_category_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="held out"):
        HarnessConfig(categories=("live_simple", "multiple"))
    with pytest.raises(InvalidArgumentError, match="held out"):
        first_ids(tmp_path / "missing", "multiple", 3)  # refused, not a missing file
    with pytest.raises(InvalidArgumentError, match="use one of"):
        HarnessConfig(categories=("irrelevance",))


def test_first_ids_keeps_the_first_n_in_file_order(tmp_path: Path) -> None:
    _lines(tmp_path / "BFCL_v4_live_simple.json", [{"id": f"live_simple_{i}"} for i in range(5)])
    assert first_ids(tmp_path, "live_simple", 3) == ["live_simple_0", "live_simple_1",
                                                     "live_simple_2"]


def test_tool_lines_come_from_the_tools_block_not_the_sentence_naming_it(tmp_path: Path) -> None:
    log = [{"role": "inference_input", "content": {"formatted_prompt": PROMPT}}]
    _lines(tmp_path / "result" / "m" / "live" / "BFCL_v4_live_simple_result.json",
           [{"id": "x", "result": "r", "inference_log": log},
            {"id": "y", "result": "r", "inference_log": log}])
    assert tool_texts(tmp_path) == ['{"name": "a"}', '{"name": "b"}']  # once each, in order


def test_tool_texts_of_the_prompting_handlers_are_each_functions_object_in_the_listed_json(
) -> None:
    functions = [{"name": "a", "parameters": {"type": "dict"}}, {"name": "b"}]
    listed = json.dumps(functions, indent=4)  # how BFCL's system prompt lists them
    prompt = ("<|im_start|>system\nYou are an expert ... format of [func_name1(params)].\n\n"
              f"Here is a list of functions in json format that you can invoke.\n{listed}\n\n"
              "extra system text [x]<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")
    texts = prompt_tool_texts(prompt)
    assert [json.loads(t) for t in texts] == functions
    assert all(t in prompt and t.startswith("    {") and t.endswith("    }") for t in texts)
    assert prompt_tool_texts("no functions listed here") == []
    assert prompt_tool_texts(PROMPT) == ['{"name": "a"}', '{"name": "b"}']  # the FC format


def test_scores_answers_and_differing_cases_are_read_from_bfcls_files(tmp_path: Path) -> None:
    _lines(tmp_path / "score" / "m" / "live" / "BFCL_v4_live_simple_score.json",
           [{"accuracy": 0.5, "correct_count": 1, "total_count": 2}, {"id": "y", "valid": False}])
    _lines(tmp_path / "result" / "m" / "live" / "BFCL_v4_live_simple_result.json",
           [{"id": "x", "result": "A"}, {"id": "y", "result": "B"}])
    (score,) = read_scores(tmp_path)
    assert (score.category, score.correct, score.total, score.failed_ids) == (
        "live_simple", 1, 2, ["y"])
    answers = dict(read_answers(tmp_path))
    a = ServerRun("vllm", 1.0, [score], answers)
    b = ServerRun("kvnotes", 1.0, [score], {**answers, "y": json.dumps("C")})
    assert differing(a, b) == ["y"]
    assert differing(a, a) == []
