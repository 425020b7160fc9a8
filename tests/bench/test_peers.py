"""The peers benchmark: workloads, the result record and the kvnotes policies (a tiny model; no kvboost)."""

from __future__ import annotations

import json

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.peers.results import CaseRow, PeersResult, answer_ok, plot, summarize
from kvnotes_bench.peers.runner import PeersConfig, rounds
from kvnotes_bench.peers.workloads import (
    DOC_COUNT,
    DOC_TOKENS,
    TASKS,
    chat_case,
    docs_case,
    split_seeds,
    tool_cases,
    words,
)


def body(doc: str) -> str:
    return doc.split("]\n", 1)[1]


@pytest.mark.parametrize("seed", [1000, 1001, 1002, 2000, 2001, 2002])
def test_docs_cases_are_deterministic_sized_and_answered_once(seed):
    case = docs_case(seed)
    assert case == docs_case(seed)
    assert case.chunks != docs_case(seed + 3).chunks
    assert DOC_COUNT[0] <= len(case.chunks) <= DOC_COUNT[1]
    assert all(DOC_TOKENS[0] <= words(body(d)) <= DOC_TOKENS[1] for d in case.chunks)
    (answer,) = case.answers
    assert sum(answer in d for d in case.chunks) == 1
    assert answer not in case.header + case.tail
    assert sorted(case.seen) == sorted(case.chunks)


def test_docs_cases_cover_every_task_and_variable_tracking_chains_to_the_value():
    tasks = {docs_case(s).id.split("-", 1)[1].rsplit("-", 1)[0] for s in range(1000, 1003)}
    assert tasks == set(TASKS)
    vt = next(docs_case(s) for s in range(1000, 1003) if "variable" in docs_case(s).id)
    asked = vt.tail.split("VAR ")[1].split(" ")[0]
    assert f"VAR {asked} = VAR " in "".join(vt.chunks)


def test_chat_cases_grow_by_turns_and_tell_the_answer_in_one_turn():
    case = chat_case(1000)
    assert case == chat_case(1000) and case != chat_case(1001)
    assert 4 <= len(case.chunks) <= 10
    (order,) = case.answers
    assert sum(order in c for c in case.chunks) == 1
    assert all(c.startswith("user: ") for c in case.chunks)
    assert case.text.endswith("Your order number is")


def test_splits_never_share_a_seed_or_a_tool_case():
    assert not set(split_seeds("dev", 50)) & set(split_seeds("report", 50))
    with pytest.raises(InvalidArgumentError):
        split_seeds("test", 3)
    dev, report = tool_cases("dev", 4, None), tool_cases("report", 4, None)
    assert not {c.id for c in dev} & {c.id for c in report}
    ordered, shuffled = dev[0], dev[1]
    assert shuffled.workload == "tools-shuffled" and shuffled.seen == ordered.chunks
    assert sorted(shuffled.chunks) == sorted(ordered.chunks)
    assert tool_cases("dev", 4, None) == dev  # the shuffle is seeded


def test_answers_are_graded_by_workload():
    assert answer_ok("tools", 'get_weather", "arguments"', ("get_weather",))
    assert not answer_ok("tools-shuffled", 'set_weather"', ("get_weather",))
    assert answer_ok("docs", " 1234567.", ("1234567",))
    assert answer_ok("chat", "anything", ()) is None


def row(method: str, first: bool, greedy: bool, ttft: float, correct: bool | None = True) -> CaseRow:
    return CaseRow("c1", "docs", method, 200, first, greedy, correct, ttft, [ttft], 150, 50)


def test_summary_the_result_json_round_trip_and_the_plot(tmp_path):
    rows = [row("recompute", True, True, 0.4), row("kvnotes", True, False, 0.1, False),
            row("kvnotes", False, False, 0.3)]
    summary = summarize(rows, {"kvnotes": 900.0})
    kv = next(s for s in summary if s.method == "kvnotes")
    assert (kv.cases, kv.first_token_identity, kv.greedy_identity, kv.accuracy) == (2, 0.5, 0, 0.5)
    assert kv.ttft_p50_s == pytest.approx(0.2) and kv.reused_share == 0.75
    assert kv.peak_rss_mb == 900.0 and summary[0].peak_rss_mb is None
    result = PeersResult("2026-12-07T00:00:00+00:00", "kvnotes-bench peers", "smollm2-135m",
                         "/m", "dev", 2, 1, 16, "anchor", 2, {"cpus": 2}, {"kvnotes": {}},
                         summary, rows, "0.9.0", ["note"])
    back = PeersResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back == result
    assert "kvnotes" in back.table().splitlines()[2]
    plot(back, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 1000


def test_config_refuses_unknown_methods_and_policies_and_rounds_rotate():
    with pytest.raises(InvalidArgumentError):
        PeersConfig(methods=("recompute", "vllm"))
    with pytest.raises(InvalidArgumentError):
        PeersConfig(methods=("kvnotes:nope",))
    with pytest.raises(InvalidArgumentError):
        PeersConfig(best="nope")
    assert rounds(["a", "b", "c"], 2) == [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]),
                                         (2, ["c", "a", "b"])]


def test_the_seen_policy_reuses_a_prompt_in_its_seen_order_exactly(tokenizer):
    from conftest import make_tiny_engine

    from kvnotes_bench.peers.runner import CaseRunner, FedCounter
    from kvnotes_bench.peers.workloads import PeerCase

    engine = make_tiny_engine("llama", tokenizer)
    chunks = (" The lamp ships in two days.", " The rug ships in nine days.",
              " The kettle is out of stock until May.")
    seen = PeerCase("c", "chat", "Support notes:", chunks, " Which ships first?")
    moved = PeerCase("c", "chat", "Support notes:", chunks[::-1], " Which ships first?", (),
                     chunks)
    for case, exact in ((seen, True), (moved, False)):
        runner = CaseRunner(engine, case, "seen", FedCounter(engine.model), None)
        ref, got = runner.run("recompute", 4), runner.run("kvnotes:seen", 4)
        spliced = sum(len(engine.encode(c)) for c in chunks)
        # in the order it was seen, every chunk is a prefill's notes: all reused, nothing fed
        assert (got.reused == spliced and got.tokens == ref.tokens) is exact
        assert runner.same_ids["kvnotes:seen"]
