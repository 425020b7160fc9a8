"""``peers-servers`` without servers: the prompts, the summary figures, the JSON."""

import json

from kvnotes_bench.peers.servers import Reply, ServerRun, ServersResult, build_prompts, reordered
from kvnotes_bench.tools.data import ToolCase


def _case(i: int, n_tools: int) -> ToolCase:
    functions = [{"name": f"api{i}.fn{j}", "description": "d" * 200,
                  "parameters": {"type": "dict", "properties": {"x": {"type": "integer"}}}}
                 for j in range(n_tools)]
    return ToolCase(f"live_multiple_{i}", "live_multiple", (), f"question {i}", (f"api{i}.fn0",),
                    meta={"functions": functions})


CASES = [_case(i, 2 + i % 3) for i in range(12)]


def count(text: str) -> int:
    return len(text) // 4


def test_prompts_are_deterministic_by_seed_and_reach_the_target():
    a = build_prompts(CASES, count, n=5, seed=3, target=1500)
    assert a == build_prompts(CASES, count, n=5, seed=3, target=1500)
    assert [b["id"] for b in a] != [b["id"] for b in build_prompts(CASES, count, n=5, seed=4,
                                                                   target=1500)]
    for body in a:
        names = [t["function"]["name"] for t in body["tools"]]
        assert len(names) == len(set(names))
        case = int(body["id"].rsplit("_", 1)[1])
        assert {f"api{case}_fn0", f"api{case}_fn1"} <= set(names)  # the case's own tools kept
        assert count(json.dumps({"messages": body["messages"], "tools": body["tools"]})) >= 1500
        assert body["messages"][-1] == {"role": "user", "content": f"question {case}"}


def test_summary_percentiles_identity_and_errors():
    replies = [Reply(0.1 * (i + 1), f"t{i}") for i in range(9)] + [Reply(None, "", "boom")]
    exact = [Reply(1.0, f"t{i}" if i < 6 else "other") for i in range(10)]
    s = ServerRun.of("kvnotes", 4, replies, exact).summary()
    assert abs(s["ttft_p50_s"] - 0.5) < 1e-9 and abs(s["ttft_p90_s"] - 0.82) < 1e-9
    assert s["compared"] == 9 and abs(s["identical"] - 6 / 9) < 1e-9 and s["errors"] == 1
    assert s["no_delta"] == 0
    assert ServerRun.of("vllm", 1, [Reply(None, "")], None).summary()["no_delta"] == 1
    itself = ServerRun.of("vllm", 1, replies, None).summary()
    assert itself["identical"] is None and itself["compared"] == 0
    assert "100%" in itself["reference"]


def test_result_round_trips_through_json(tmp_path):
    run = ServerRun.of("kvboost", 1, [Reply(0.2, "a"), Reply(0.3, "b")],
                       [Reply(0.9, "a"), Reply(0.9, "c")])
    result = ServersResult({"model": "m", "concurrency": [1]}, "2026-01-01T00:00:00+00:00",
                           "kvnotes-bench peers-servers", {"cpus": 2}, ["x", "y"], [2000, 2010],
                           [run], {"kvboost": "python -m kvboost.server"})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result.to_dict()))
    back = ServersResult.from_dict(json.loads(path.read_text()))
    assert back == result
    assert back.to_dict()["summary"][0]["identical"] == 0.5
    assert "kvboost" in back.table() and "50%" in back.table()


def test_measured_prompts_are_the_warmed_tools_in_a_new_order():
    tools = [{"function": {"name": f"t{i}"}} for i in range(5)]
    bodies = [{"id": "a", "messages": [], "tools": tools},
              {"id": "b", "messages": [], "tools": tools[:1]}]
    once, again = reordered(bodies, seed=1), reordered(bodies, seed=1)
    assert once == again  # seeded
    assert once[0]["tools"][0] is not tools[0]  # the first tool moved: no whole-prompt prefix
    assert sorted(t["function"]["name"] for t in once[0]["tools"]) == [f"t{i}" for i in range(5)]
    assert once[1]["tools"] == tools[:1]  # one tool: nothing to reorder
    assert bodies[0]["tools"] == tools  # the warmed bodies are left as they were
    assert reordered(bodies, seed=4)[0]["tools"] != once[0]["tools"]
