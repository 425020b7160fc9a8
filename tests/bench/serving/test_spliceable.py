"""``kvnotes-bench serve spliceable`` against a fake learning front: what it times and counts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kvnotes_bench.serving.agent_traffic_client import Answer
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest, tool_requests
from kvnotes_bench.serving.spliceable import (
    SpliceableConfig,
    SpliceableResult,
    measure_case,
    new_chunks,
    report,
    run_round,
    write_outputs,
)
from kvnotes_bench.tools.data import SkillDoc, ToolCase

FN = {"name": "f", "description": "Look the thing up in the big book of things " * 6,
      "parameters": {"type": "dict", "properties": {"q": {"type": "string"}}}}


def request(cid: str = "c1", n: int = 4) -> AgentRequest:
    functions = [{**FN, "name": f"{cid}_f{i}"} for i in range(n)]
    case = ToolCase(cid, "live_multiple", tuple(SkillDoc(f["name"], json.dumps(f), (f["name"],))
                                                for f in functions),
                    f"question of {cid}", (functions[0]["name"],), "",
                    meta={"functions": functions})
    return tool_requests([case])[0]


class FakeFront:
    """Learns a request's chunks at its second sighting, ``compile_s`` after that sighting
    arrives (its learner counts one compile per chunk); a request splices 600 of its 1000
    tokens once learned."""

    def __init__(self, tokenizer, compile_s: float, exact_s: float = 0.05) -> None:
        self.tokenizer, self.compile_s, self.exact_s = tokenizer, compile_s, exact_s
        self.seen: dict[str, int] = {}
        self.ready: dict[str, tuple[float, int]] = {}
        self.sent: list[tuple[str, bool]] = []

    def _learned(self, rid: str) -> bool:
        return self.ready.get(rid, (float("inf"), 0))[0] <= time.monotonic()

    async def send(self, req: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        self.sent.append((req.id, splice))
        self.seen[req.id] = self.seen.get(req.id, 0) + 1
        if self.seen[req.id] == 2:
            chunks = len(new_chunks(self.tokenizer, req, 32, set()))
            self.ready[req.id] = (time.monotonic() + self.compile_s, chunks)
        await asyncio.sleep(self.exact_s / 5 if self._learned(req.id) else self.exact_s)
        return Answer(ok=True, prompt_tokens=1000,
                      spliced_tokens=600 if splice and self._learned(req.id) else 0,
                      total_s=self.exact_s)

    async def learner(self) -> dict[str, int]:
        return {"compiles": sum(n for r, (_, n) in self.ready.items() if self._learned(r)),
                "failures": 0}


def test_a_compile_faster_than_a_request_is_spliced_on_the_third_request(tokenizer) -> None:
    config = SpliceableConfig(poll_s=0.005, learn_timeout_s=5.0, engine=False)
    front = FakeFront(tokenizer, compile_s=0.02, exact_s=0.05)
    known: set[tuple[int, ...]] = set()
    case = asyncio.run(measure_case(front, request(), "t", config, tokenizer, known, None))
    assert case.new_chunks == len(new_chunks(tokenizer, request().variant("t"), 32, set())) > 0
    assert case.third_share == 0.6 and case.ready_share == 0.6
    assert case.spliceable_s is not None and case.spliceable_s < case.exact_s
    # the exact twin went with splice false under its own tag; the list itself three times and
    # once ready
    assert front.sent[0] == ("c1~tx", False)
    assert [s for r, s in front.sent[1:]] == [True] * 4
    assert known and not new_chunks(tokenizer, request().variant("t"), 32, known)


def test_a_slow_compile_misses_the_third_request_and_a_lost_one_times_out(tokenizer) -> None:
    config = SpliceableConfig(poll_s=0.005, learn_timeout_s=0.3, engine=False)
    slow = asyncio.run(measure_case(FakeFront(tokenizer, compile_s=0.15), request(), "t", config,
                                    tokenizer, set(), None))
    assert slow.third_share == 0.0 and slow.ready_share == 0.6
    assert slow.spliceable_s is not None and slow.spliceable_s > slow.exact_s
    lost = asyncio.run(measure_case(FakeFront(tokenizer, compile_s=99.0), request(), "t", config,
                                    tokenizer, set(), None))
    assert lost.spliceable_s is None and lost.ready_share == 0.0


def test_a_round_beside_background_clients_and_its_bundle(tokenizer, tiny_llama,
                                                          tmp_path) -> None:
    config = SpliceableConfig(cases=2, background=(0, 2), poll_s=0.005, learn_timeout_s=2.0)
    front = FakeFront(tokenizer, compile_s=0.005, exact_s=0.05)
    known: set[tuple[int, ...]] = set()

    async def rounds():
        return [await run_round(front, [request("a"), request("b")], [request("z", 2)], k,
                                config, tokenizer, known, tiny_llama, lambda s: None)
                for k in config.background]

    result = SpliceableResult(config=config, rounds=asyncio.run(rounds()))
    alone, beside = result.rounds
    assert alone.background_requests == 0 and beside.background_requests > 0
    assert beside.background_errors == 0
    assert all(c.engine_s is not None and c.engine_s > 0 for r in result.rounds
               for c in r.cases)  # the engine compiled the same chunks (tiny model)
    s = alone.summary()
    assert s["cases"] == 2 and s["third_at_goal"] == 1.0 and s["vllm_within_exact"] == 1.0
    paths = write_outputs(result, tmp_path)
    assert paths["plot"].is_file() and "| c1 beside c2 |" in paths["report"].read_text()
    back = SpliceableResult.model_validate_json(paths["json"].read_text())
    assert back == result


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="after"):
        SpliceableConfig(after=1)
    with pytest.raises(ValueError, match="cases"):
        SpliceableConfig(cases=0)
    with pytest.raises(ValueError, match="background"):
        SpliceableConfig(background=(0, -1))


BUNDLES = sorted((Path(__file__).resolve().parents[3] / "docs" / "results" / "spliceable")
                 .glob("*/result.json"))


def test_the_committed_bundles_read_back_and_render_as_committed() -> None:
    assert BUNDLES
    for path in BUNDLES:
        result = SpliceableResult.model_validate_json(path.read_text())
        assert result.rounds and all(r.cases for r in result.rounds)
        assert report(result) == (path.parent / "report.md").read_text()
