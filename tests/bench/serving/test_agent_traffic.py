"""``serve-bench agent`` without a real server: BFCL functions as OpenAI tools, the chunk
orders, the requests, reading answers, the case protocol and the timings against a fake
client, the soak's bookkeeping and verdicts, the result's JSON, report and plot, the CLI's
refusals; the SDK client against the fake vLLM."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from typer.testing import CliRunner

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes.serving.launch.launcher import LaunchConfig
from kvnotes.serving.library.splice import SpliceRange
from kvnotes.serving.protocol import (
    LoadedRange,
    SpliceReport,
    UsageKvnotes,
    WirePlan,
)
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving.agent_traffic import (
    AgentBenchConfig,
    AgentResult,
    learning_launch,
)
from kvnotes_bench.serving.agent_traffic_check import (
    CheckConfig,
    KeptEntries,
    Reference,
    verdict,
)
from kvnotes_bench.serving.agent_traffic_client import (
    Answer,
    OpenAISender,
    answer_of,
    extra_body,
    tool_choice,
)
from kvnotes_bench.serving.agent_traffic_overhead import compile_overhead, miss_overhead
from kvnotes_bench.serving.agent_traffic_protocol import (
    CaseRecord,
    ProtocolConfig,
    run_case,
    run_cases,
    summarize,
)
from kvnotes_bench.serving.agent_traffic_records import RECORDS_NAME, SoakRequestRecord, write_records
from kvnotes_bench.serving.agent_traffic_render import Rendered
from kvnotes_bench.serving.agent_traffic_report import markdown, write_outputs
from kvnotes_bench.serving.agent_traffic_requests import (
    AgentRequest,
    document_requests,
    json_schema,
    openai_tool,
    permutation,
    subset_request,
    tool_pool,
    tool_requests,
)
from kvnotes_bench.serving.agent_traffic_soak import (
    AgentSoakConfig,
    EntryKeeper,
    SoakRecord,
    check_records,
    evictions,
    soak_clients,
)
from kvnotes_bench.serving.agent_traffic_soak import summarize as soak_summarize
from kvnotes_bench.tools.data import SkillDoc, ToolCase

FN = {"name": "shop.order", "description": "Order food.", "parameters": {
    "type": "dict", "required": ["item"], "properties": {
        "item": {"type": "string", "description": "what"},
        "size": {"type": "float", "default": 1.0},
        "extras": {"type": "array", "items": {"type": "dict", "properties": {
            "n": {"type": "integer"}}}},
        "where": {"type": "tuple", "items": {"type": "any"}}}}}


def case(cid: str, names: list[str], answer: str) -> ToolCase:
    functions = [{**FN, "name": n} for n in names]
    return ToolCase(cid, "live_multiple", tuple(SkillDoc(n, json.dumps(f), (n,))
                                                for n, f in zip(names, functions, strict=True)),
                    f"question of {cid}", (answer,), "", meta={"functions": functions})


def tools_request(n: int = 3, rid: str = "c1") -> AgentRequest:
    return tool_requests([case(rid, [f"f{i}" for i in range(n)], "f1")])[0]


# ---- the requests ---------------------------------------------------------------------------
def test_bfcl_schema_types_become_json_schema_types_recursively() -> None:
    tool = openai_tool(FN)
    assert tool["type"] == "function"
    fn = tool["function"]
    assert fn["name"] == "shop_order" and fn["description"] == "Order food."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["item"]
    props = params["properties"]
    assert props["size"] == {"type": "number", "default": 1.0}
    assert props["extras"]["items"]["type"] == "object"
    assert props["extras"]["items"]["properties"]["n"]["type"] == "integer"
    assert props["where"] == {"type": "array", "items": {"type": "string"}}
    assert FN["parameters"]["type"] == "dict"  # the case's own document is not changed
    assert json_schema("dict") == "dict"  # only a schema's "type" values are renamed


def test_a_function_without_parameters_gets_an_empty_object_schema() -> None:
    fn = openai_tool({"name": "ping"})["function"]
    assert fn["parameters"] == {"type": "object", "properties": {}}
    with pytest.raises(InvalidArgumentError):
        openai_tool({"description": "no name"})


@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_permutation_is_fixed_and_never_the_identity(n: int) -> None:
    for seed in range(20):
        p = permutation(n, seed)
        assert sorted(p) == list(range(n)) and p != list(range(n))
        assert permutation(n, seed) == p
    assert len({tuple(permutation(n, s)) for s in range(20)}) > 1 or n == 2
    assert permutation(1, 0) == [0] and permutation(0, 0) == []


def test_tool_requests_carry_system_user_and_tools_and_skip_single_function_cases() -> None:
    reqs = tool_requests([case("a", ["f0", "f1", "f2"], "f2"), case("b", ["only"], "only")])
    assert [r.id for r in reqs] == ["a"]
    r = reqs[0]
    body = r.body()
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["messages"][1]["content"] == "question of a"
    assert [t["function"]["name"] for t in body["tools"]] == ["f0", "f1", "f2"]
    assert r.candidates == ("f0", "f1", "f2") and r.answers == ("f2",)


def test_reordered_request_has_the_same_chunks_in_another_order() -> None:
    r = tools_request(4)
    m = r.reordered(7)
    assert m.meta["order"] == permutation(4, "7:c1")
    assert [t["function"]["name"] for t in m.chunks] == [f"f{i}" for i in m.meta["order"]]
    assert m.candidates != r.candidates and sorted(m.candidates) == sorted(r.candidates)
    assert m.question == r.question and m.system == r.system
    assert r.reordered(7) == m


def test_document_requests_are_content_parts_with_the_question_last() -> None:
    docs = {f"d{i}": f"document {i} text" for i in range(5)}
    reqs = document_requests(docs, 3, 2, seed=1, question=lambda rng: f"q{rng.randint(0, 9)}")
    assert reqs == document_requests(docs, 3, 2, seed=1,
                                     question=lambda rng: f"q{rng.randint(0, 9)}")
    r = reqs[0]
    assert r.tools() is None and "tools" not in r.body()
    content = r.messages()[1]["content"]
    assert [p["type"] for p in content] == ["text"] * 3
    assert [p["text"] for p in content[:2]] == list(r.chunks)
    assert content[2]["text"] == r.question and r.question.startswith("q")
    assert [docs[n] for n in r.meta["documents"]] == list(r.chunks)
    m = r.reordered(0)
    assert [p["text"] for p in m.messages()[1]["content"][:2]] == list(reversed(r.chunks))
    with pytest.raises(InvalidArgumentError):
        document_requests(docs, 1, 6, seed=0)


def test_variants_change_every_chunk_and_only_the_chunks() -> None:
    r = tools_request(3)
    v = r.variant("x1")
    assert all(t["function"]["description"].startswith("[x1] ") for t in v.chunks)
    assert v.candidates == r.candidates and v.question == r.question and v.id != r.id
    d = document_requests({"a": "A", "b": "B"}, 1, 2, seed=0, question=lambda rng: "q")[0]
    assert all(c.startswith("[t]\n") for c in d.variant("t").chunks)


def test_soak_requests_draw_tool_subsets_from_the_pool() -> None:
    import random

    reqs = [tools_request(3, "a"), tools_request(4, "b")]
    pool = tool_pool(reqs)
    assert [t["function"]["name"] for t in pool] == ["f0", "f1", "f2", "f3"]
    rng = random.Random(0)
    for i in range(20):
        r = subset_request(pool, ["q1", "q2"], rng, k=(2, 3), index=i)
        assert 2 <= len(r.chunks) <= 3 and len(set(r.candidates)) == len(r.chunks)
        assert r.question in ("q1", "q2")
    with pytest.raises(InvalidArgumentError):
        subset_request(pool, ["q"], rng, k=(2, 9), index=0)


# ---- reading answers --------------------------------------------------------------------------
def test_tool_choice_reads_json_python_and_named_calls() -> None:
    assert tool_choice('<tool_call>\n{"name": "f1", "arguments": {}}') == "f1"
    assert tool_choice("f2(x=1)") == "f2"
    assert tool_choice("Sure, calling f3 now, not f1", ["f1", "f3"]) == "f3"
    assert tool_choice("no idea", ["f1"]) is None


def chat_body(*, content: str | None = "hi", calls: list[str] | None = None,
              tokens: list[tuple[str, float, float]] | None = None, spliced: int | None = 12
              ) -> dict:
    usage: dict = {"prompt_tokens": 40, "completion_tokens": 3}
    if spliced is not None:
        usage["kvnotes"] = {"spliced_tokens": spliced, "plan": {"ranges": [[4, 4, 16]]}}
    logprobs = None if tokens is None else {"content": [
        {"token": t, "logprob": a, "top_logprobs": [{"token": t, "logprob": a},
                                                     {"token": "?", "logprob": b}]}
        for t, a, b in tokens]}
    return {"choices": [{"message": {"content": content, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for n in calls or []]}, "logprobs": logprobs, "finish_reason": "length"}],
        "usage": usage}


def test_answer_of_reads_tool_calls_tokens_margins_and_spliced_tokens() -> None:
    a = answer_of(chat_body(content=None, calls=["f2", "f1"],
                            tokens=[("<", -0.1, -2.1), ("x", -0.5, -0.6)]))
    assert a.ok and a.tool == "f2" and a.tool_calls == 2
    assert a.tokens == ["<", "x"] and a.first_token == "<"
    assert a.margins == pytest.approx([2.0, 0.1])
    assert a.prompt_tokens == 40 and a.spliced_tokens == 12
    assert a.kvnotes is not None and a.kvnotes["plan"]["ranges"] == [[4, 4, 16]]
    assert json.loads(a.text) == [{"name": "f2", "arguments": "{}"},
                                  {"name": "f1", "arguments": "{}"}]
    b = answer_of(chat_body(content='{"name": "f0"}', spliced=None), ["f0"])
    assert b.tool == "f0" and b.spliced_tokens == 0 and b.kvnotes is None and b.tokens == []
    assert not answer_of({"choices": []}).ok
    assert Answer.from_dict(a.to_dict()) == a


def test_extra_body_is_empty_for_a_plain_spliced_request() -> None:
    assert extra_body(True, None) is None
    assert extra_body(False, None) == {"kvnotes": {"splice": False}}
    assert extra_body(True, "acme") == {"kvnotes": {"tenant": "acme"}}


# ---- the protocol against a fake client ----------------------------------------------------
class FakeSender:
    """A server that compiles a request's chunks once they were seen ``after`` times (``lag``
    learner polls later; its ``compiles`` counter grows by the request's chunks), splices
    ``share`` of the prompt from then on, and answers by a rule. ``learns=False``: its learner
    compiles nothing; ``learner=False``: it has no learner (no counters)."""

    def __init__(self, *, after: int = 2, lag: int = 1, share: float = 0.6,
                 learns: bool = True, flip: set[str] | None = None, learner: bool = True) -> None:
        self.after, self.lag, self.share, self.learns = after, lag, share, learns
        self.flip = flip or set()  # case ids whose spliced answer differs
        self.seen: dict[frozenset, int] = {}
        self.sent: list[tuple[str, bool, int]] = []
        self.repairs: list[int | None] = []
        self.has_learner = learner
        self.pending: dict[frozenset, int] = {}  # polls left before the compile
        self.compiled: set[frozenset] = set()
        self.compiles = 0

    def _answer(self, request: AgentRequest, splice: bool, max_tokens: int,
                repair: int | None = None) -> Answer:
        key = frozenset(json.dumps(c, sort_keys=True) for c in request.chunks)
        self.sent.append((request.id, splice, max_tokens))
        self.repairs.append(repair)
        if splice:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.learns and self.seen[key] == self.after and key not in self.compiled:
                self.pending[key] = self.lag
        learned = key in self.compiled or (self.learns and self.seen.get(key, 0)
                                           > self.after + self.lag)
        spliced = int(100 * self.share) if splice and learned else 0
        if repair is not None and spliced:
            spliced -= repair  # a smaller repair splices more
        tokens = [f"t{i}" for i in range(max_tokens)]
        tool = min(request.candidates) if request.candidates else None
        if splice and spliced and request.id.split("~")[0] in self.flip:
            tokens[-1] = "other"
            tool = "other"
        return Answer(ok=True, text="".join(tokens), tokens=tokens, tool=tool,
                      prompt_tokens=100, spliced_tokens=spliced, ttft_s=0.1 if splice else 0.2)

    async def send(self, request: AgentRequest, *, splice: bool, max_tokens: int,
                   repair: int | None = None) -> Answer:
        await asyncio.sleep(0)  # other clients run meanwhile, as over a network
        return self._answer(request, splice, max_tokens, repair)

    async def stream(self, request: AgentRequest, *, splice: bool, max_tokens: int) -> Answer:
        return self._answer(request, splice, max_tokens)

    async def learner(self) -> dict[str, int] | None:
        if not self.has_learner:
            return None
        for key in list(self.pending):
            self.pending[key] -= 1
            if self.pending[key] <= 0:
                del self.pending[key]
                self.compiled.add(key)
                self.compiles += len(key)
        return {"sightings": 0, "compiles": self.compiles, "failures": 0}


FAST = ProtocolConfig(sightings=2, max_tokens=16, learn_timeout_s=5.0, poll_s=0.0, seed=3)


def test_a_case_is_learned_then_measured_reordered_against_its_exact_twin() -> None:
    sender = FakeSender()
    r = tools_request(3)
    rec = asyncio.run(run_case(sender, r, FAST))
    # the fake's learner compiles the three chunks one poll after the second sighting
    assert rec.learned and rec.polls == 1
    assert rec.learn == {"expected": 3, "compiles": 3, "failures": 0}
    assert rec.order == permutation(3, "3:c1")
    assert [s[1:] for s in sender.sent[:2]] == [(True, 1), (True, 1)]  # the two sightings
    assert sender.sent[-2:] == [("c1", True, 16), ("c1", False, 16)]
    assert rec.share == pytest.approx(0.6)
    assert rec.choice_identical and rec.first_token_identical and rec.answer_identical
    back = CaseRecord.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert back == rec


def test_a_case_that_is_never_learned_is_measured_and_recorded_as_not_learned() -> None:
    rec = asyncio.run(run_case(FakeSender(learns=False), tools_request(2),
                               dataclasses.replace(FAST, learn_timeout_s=0.0)))
    assert not rec.learned and rec.polls == 1 and rec.share == 0.0
    assert rec.answer_identical
    # a front without a learner: nothing to wait for
    rec = asyncio.run(run_case(FakeSender(learner=False), tools_request(2), FAST))
    assert not rec.learned and rec.polls == 0


def test_learning_is_read_from_the_learner_even_when_the_probe_would_splice_nothing() -> None:
    # the learner compiles after 3 polls; a probe of the original order would splice nothing
    # (the fake splices a key only once compiled): the case waits for the counters
    sender = FakeSender(lag=3)
    rec = asyncio.run(run_case(sender, tools_request(3), FAST))
    assert rec.learned and rec.polls == 3 and rec.share == pytest.approx(0.6)
    assert [s for s in sender.sent if s[2] == 1] == [("c1", True, 1)] * 2  # no probe sent


def test_chunks_learned_by_an_earlier_case_are_not_waited_for_again() -> None:
    # learnable: each chunk's "token ids"; the short one (under min_tokens) is never expected
    def learnable(req: AgentRequest) -> list[tuple[int, ...]]:
        return [tuple(range(40 + i)) for i in range(len(req.chunks))] + [(1, 2)]

    sender = FakeSender()
    known: set[tuple[int, ...]] = set()
    first = asyncio.run(run_case(sender, tools_request(3, "a"), FAST, learnable, known))
    assert first.learned and first.learn["expected"] == 3 and len(known) == 3
    second = asyncio.run(run_case(sender, tools_request(2, "b"), FAST, learnable, known))
    assert second.learned and second.learn["expected"] == 0 and second.polls == 1


def test_repair_variants_are_measured_and_summarized_apart() -> None:
    sender = FakeSender()
    cfg = dataclasses.replace(FAST, repairs=(16, 8))
    recs = asyncio.run(run_cases(sender, [tools_request(3, "a"), tools_request(3, "b")], cfg))
    assert [v.repair for v in recs[0].variants] == [16, 8]
    assert sender.repairs[-4:] == [None, 16, 8, None]  # spliced, the variants, then exact
    front, k16, k8 = (summarize("tools", recs, k) for k in (None, 16, 8))
    assert front.repair == "front" and k8.repair == "8"
    assert front.share_mean == pytest.approx(0.6) and k8.share_mean == pytest.approx(0.52)
    assert k16.share_mean == pytest.approx(0.44) and k16.cases == 2
    back = CaseRecord.from_dict(json.loads(json.dumps(recs[0].to_dict())))
    assert back == recs[0]


def test_summary_counts_shares_choices_and_goals() -> None:
    reqs = [tools_request(3, f"c{i}") for i in range(4)]
    recs = asyncio.run(run_cases(FakeSender(flip={"c0"}), reqs, FAST))
    s = summarize("tools", recs)
    assert (s.cases, s.measured, s.learned) == (4, 4, 4)
    assert s.share_mean == pytest.approx(0.6) and s.share_pooled == pytest.approx(0.6)
    assert s.share_at_goal == 1.0 and s.share_goal_met
    assert s.choice_identical == pytest.approx(0.75) and s.choice_goal_met is False
    assert s.first_token_identical == 1.0 and s.answer_identical == pytest.approx(0.75)
    assert s.choice_correct_exact == 0.0  # the fake always calls f0; the truth is f1
    docs = summarize("documents", [])
    assert docs.measured == 0 and docs.choice_identical is None and docs.share_goal_met is None


def test_failed_answers_are_not_measured() -> None:
    rec = CaseRecord("x", "tools", 2, [1, 0], True, 0.0, 1, Answer(ok=False, error="boom"),
                     Answer(ok=True, tokens=["a"]), [])
    assert not rec.measured and rec.share is None and rec.choice_identical is None
    assert summarize("tools", [rec]).measured == 0


def test_timings_alternate_arms_and_compare_medians() -> None:
    sender = FakeSender()
    bases = [tools_request(2, "a"), tools_request(2, "b")]
    miss = asyncio.run(miss_overhead(sender, bases, 4))
    assert len(miss.measured) == len(miss.reference) == 4 and miss.failed == 0
    assert miss.overhead == pytest.approx(0.1 / 0.2 - 1)
    assert len(miss.load_before) == 3
    # every request of the miss timing was new: nothing seen twice
    assert all(n == 1 for n in sender.seen.values())
    sender = FakeSender()
    comp = asyncio.run(compile_overhead(sender, bases, 2, sightings=2))
    assert len(comp.measured) == len(comp.reference) == 2
    # per pair: the compiling arm's trigger seen twice; the other arm's two requests and both
    # probes once
    assert sorted(sender.seen.values()) == [1] * 8 + [2] * 2
    assert comp.to_dict()["goal_met"] is True


# ---- the soak --------------------------------------------------------------------------------
def test_soak_clients_send_every_request_once_and_mark_eligible_ones() -> None:
    pool = tool_pool([tools_request(3, "a"), tools_request(5, "b")])
    config = AgentSoakConfig(clients=3, requests=30, tools_min=2, tools_max=3,
                             exact_fraction=0.3, max_tokens=4, seed=1)
    records, wall = asyncio.run(soak_clients(FakeSender(after=0, lag=0), pool, ["q"], config))
    assert sorted(r.index for r, _ in records) == list(range(30)) and wall >= 0
    assert {r.client for r, _ in records} == {0, 1, 2}
    assert any(not r.splice for r, _ in records) and any(r.splice for r, _ in records)
    assert not any(r.eligible for r, _ in records if not r.splice)
    first = min(records, key=lambda rq: rq[0].index)[0]
    assert not first.eligible  # nothing was seen before the first request
    for rec, req in records:
        assert rec.tools == list(req.candidates)
    assert SoakRecord.from_dict(json.loads(json.dumps(records[0][0].to_dict()))) == records[0][0]


def rec(i: int, *, splice: bool = True, eligible: bool = True, spliced: int = 50,
        status: str | None = "ok", matched: str = "compose", ok: bool = True) -> SoakRecord:
    answer = Answer(ok=ok, error=None if ok else "APIError: x", prompt_tokens=100,
                    spliced_tokens=spliced)
    v = None if status is None else {"status": status, "matched": matched}
    return SoakRecord(i, 0, 0.0, ["f0"], 0, splice, eligible, answer, v)


def test_soak_summary_counts_wrong_unchecked_failed_and_the_hit_rate() -> None:
    s = soak_summarize([rec(0), rec(1, spliced=0, matched="exact"),
                        rec(2, status="wrong"), rec(3, status=None),
                        rec(4, matched="partial@64"), rec(5, ok=False),
                        rec(6, splice=False, eligible=False, spliced=0, matched="exact")])
    assert (s.requests, s.served, s.failed) == (7, 6, 1)
    assert (s.checked, s.wrong, s.near_tie, s.unchecked) == (5, 1, 0, 1)
    assert s.matched == {"compose": 1, "exact": 2, "partial": 1}
    assert (s.eligible, s.spliced) == (5, 4) and s.hit_rate == pytest.approx(0.8)
    assert s.share_pooled == pytest.approx(200 / 500)
    assert s.errors == {"APIError": 1}


def test_entry_keeper_keeps_published_files_after_they_are_deleted(tmp_path) -> None:
    lib = tmp_path / "lib" / "fp"
    lib.mkdir(parents=True)
    (lib / "a.safetensors").write_bytes(b"x" * 10)
    (lib / ".kvnotes-tmp.b.safetensors").write_bytes(b"y")
    keeper = EntryKeeper(tmp_path / "lib", tmp_path / "keep")
    assert keeper.sweep() == 1 and keeper.sweep() == 0
    (lib / "a.safetensors").unlink()
    assert (tmp_path / "keep" / "a.safetensors").read_bytes() == b"x" * 10
    assert keeper.bytes_kept() == 10
    assert len(KeptEntries(tmp_path / "keep", None)) == 0  # not an entry: skipped
    assert KeptEntries(tmp_path / "keep", None).skipped == 1


def test_evictions_sum_every_evict_counter_or_say_none() -> None:
    text = ("# TYPE kvnotes_library_evictions counter\nkvnotes_library_evictions_total 3\n"
            "# TYPE other counter\nother_total 9\n")
    assert evictions([text, "# TYPE x_evicted counter\nx_evicted_total 2\n"]) == 5
    assert evictions(["# TYPE other counter\nother_total 9\n"]) is None


class Tok:
    """Token i decodes as "<i>"."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_verdict_takes_the_first_equal_reference_else_wrong_or_near_tie() -> None:
    got = Answer(ok=True, tokens=["<1>", "<2>", "<3>"], margins=[2.0, 0.01, 1.0])
    refs = [Reference("compose", [1, 5, 3]), Reference("exact", [1, 2, 3, 0])]
    v = verdict(got, iter(refs), Tok(), eos=[0], tie_tau=0.05)
    assert v.status == "ok" and v.matched == "exact" and not v.cut
    v = verdict(got, iter(refs[:1]), Tok(), eos=[0], tie_tau=0.05)
    assert v.status == "near_tie" and v.diverged_at == 1 and v.expected == [1, 5, 3]
    v = verdict(got, iter([Reference("exact", [4, 2, 3], [0.5, 1.0, 1.0])]), Tok(), eos=[0],
                tie_tau=0.05)
    assert v.status == "wrong" and v.diverged_at == 0 and v.margin == 2.0
    assert v.ref_margin == 0.5
    text_only = Answer(ok=True, text="<7><8>")
    assert verdict(text_only, iter([Reference("exact", [7, 8])]), Tok(), eos=[],
                   tie_tau=0.05).status == "ok"


def test_the_drift_rule_compares_paths_up_to_a_near_tie_on_either_side() -> None:
    got = Answer(ok=True, tokens=["<1>", "<2>", "<3>"], margins=[2.0, 1.5, 1.0])
    ref = Reference("exact", [1, 2, 9], [2.0, 0.02, 1.0])  # the engine's step 1 is a near tie
    assert verdict(got, [ref], Tok(), eos=[], tie_tau=0.05).status == "wrong"
    v = verdict(got, [ref], Tok(), eos=[], tie_tau=0.05, drift_tau=0.1)
    assert v.status == "ok" and v.cut and v.compared == 1
    assert v.margin_gap == 0.0  # over the compared step only
    same = verdict(got, [Reference("exact", [1, 2, 3], [2.0, 1.4, 1.0])], Tok(), eos=[],
                   tie_tau=0.05)
    assert same.status == "ok" and same.margin_gap == pytest.approx(0.1)
    early = Reference("exact", [4, 2, 3], [2.0, 0.02, 1.0])  # differs before the near tie
    assert verdict(got, [early], Tok(), eos=[], tie_tau=0.05, drift_tau=0.1).status == "wrong"


def plan_report(ranges, regions=(), first=32, align=64, share=0.0) -> WirePlan:
    """A plan as ``usage.kvnotes.plan`` carries it."""
    return WirePlan(200, align, Repair(first=first, align=align, share=share), "s",
                    tuple(SpliceRange(*r) for r in ranges), tuple(map(tuple, regions)), ())


# ---- the result, its report and the command -------------------------------------------------
def test_result_round_trips_and_is_reported_and_plotted(tmp_path) -> None:
    sender = FakeSender(flip={"c1"})
    reqs = [tools_request(3, f"c{i}") for i in range(3)]
    docs = document_requests({"a": "A", "b": "B", "c": "C"}, 2, 2, seed=0,
                             question=lambda rng: "q")
    result = AgentResult(config=AgentBenchConfig(), machine=MachineRecord.now(),
                         started="2026-12-03 04:00", command="kvnotes-bench serve agent",
                         threads={"torch": 2, "python": 1})
    result.cases["tools"] = asyncio.run(run_cases(sender, reqs, FAST))
    result.cases["documents"] = asyncio.run(run_cases(sender, docs, FAST))
    from kvnotes_bench.serving.agent_traffic_share import breakdown

    result.cases["tools"][0].breakdown = breakdown(
        plan_report([[10, 64, 100]]), 120, [(10, 100)], 100)
    result.timings.append(asyncio.run(miss_overhead(sender, reqs, 2)))
    result.soak_records = [rec(0), rec(1, status="wrong")]
    result.soak = {"evictions": 4.0, "pool_tools": 3, "library_cap_bytes": 1 << 20}
    result.notes.append("a note")
    data = json.loads(json.dumps(result.to_dict()))
    assert data["workload"] == "agent"
    assert [s["kind"] for s in data["summaries"]] == ["tools", "documents"]
    assert data["soak"]["summary"]["wrong"] == 1 and data["soak"]["evictions"] == 4.0
    back = AgentResult.from_dict(data)
    assert json.loads(json.dumps(back.to_dict())) == data
    text = markdown(data)
    assert "BFCL live_multiple" in text and "airline documents" in text
    assert "first sight vs splice:false" in text and "a note" in text
    assert "| 2 | 0 | 2 | 1 |" in text  # served, failed, checked, wrong
    # the breakdown table: 36 spliced, 32 repaired, 22 aligned, 30 text (10 header) of 120
    assert "| 30.0% | 26.7% | 18.3% | 0.0% | 25.0% (8.3%) | 1.0 / 1.0 / 1.0 |" in text
    paths = write_outputs(data, tmp_path)
    assert json.loads(paths["json"].read_text()) == data
    assert paths["plot"].stat().st_size > 1000 and paths["report"].read_text() == text


def test_breakdown_puts_every_prompt_token_in_one_bucket() -> None:
    from kvnotes_bench.serving.agent_traffic_share import BUCKETS, answer_breakdown, breakdown

    # BOS spliced; chunk [10, 100) repaired to 32, aligned to 64; chunk [101, 140) wholly
    # recomputed (its region reaches its end); chunk [141, 190) unmatched
    plan = plan_report([[0, 0, 1], [10, 64, 100]], [[10, 64], [101, 140]], share=0.1)
    b = breakdown(plan, 200, [(10, 100), (101, 140), (141, 190)], 200)
    assert b.repair == {"first": 32, "align": 64, "share": 0.1, "skip_exact": True}
    assert (b.spliced, b.repaired, b.aligned, b.unmatched) == (37, 32 + 32, 22 + 7, 49)
    assert b.text == 200 - 178 - 1 and b.text_head == 9  # the header less the spliced BOS
    assert sum(getattr(b, k) for k in BUCKETS) == b.prompt and b.layout_ok
    assert (b.chunks, b.matched, b.spliced_chunks) == (3, 2, 1)
    assert breakdown(plan, 200, [(10, 100)], 199).layout_ok is False
    none = answer_breakdown(Answer(ok=True, prompt_tokens=50), (50, [(5, 45)]))
    assert none is not None and (none.spliced, none.unmatched, none.text) == (0, 40, 10)
    assert answer_breakdown(Answer(ok=False), (50, [])) is None


def test_config_refuses_unknown_parts_and_sizes() -> None:
    with pytest.raises(InvalidArgumentError):
        AgentBenchConfig(parts=("tools", "nope"))
    with pytest.raises(InvalidArgumentError):
        AgentSoakConfig(tools_min=3, tools_max=2)
    with pytest.raises(InvalidArgumentError, match="pool-tools"):
        AgentSoakConfig(pool=3, tools_max=4)
    cfg = AgentBenchConfig(parts=("soak",), soak=AgentSoakConfig(clients=2))
    assert AgentBenchConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_learning_launch_turns_the_front_on_over_the_skill_folder(tmp_path) -> None:

    base = LaunchConfig(model="smollm2-135m")
    plain = learning_launch(base, tmp_path / "skills", learn=False, timeout=30.0)
    assert plain.skills == tmp_path / "skills" and plain.front is not None
    assert plain.front.timeout == 30.0
    assert plain.front.learn is None
    on = learning_launch(base, tmp_path / "skills", cap_bytes=1 << 20, after=3)
    assert on.front is not None and on.front.learn is not None
    assert (on.front.learn.after, on.front.learn.library_cap) == (3, 1 << 20)
    assert on.front.repair == Repair(first=32, share=0.1)  # the front's default
    k = learning_launch(base, tmp_path / "skills", repair="16@0.05")
    assert k.front is not None and k.front.repair == Repair(first=16, share=0.05)
    with pytest.raises(InvalidArgumentError):
        AgentBenchConfig(repair="16~0.2")


def test_the_command_refuses_bad_options_before_loading_a_model() -> None:
    from kvnotes_bench.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["serve", "agent", "--parts", "tools,bogus",
                                 "--model", "no-such-model"])
    assert result.exit_code == 2 and "bogus" in result.output
    result = runner.invoke(app, ["serve", "agent", "--library-cap", "lots"])
    assert result.exit_code == 2 and "lots" in result.output
    result = runner.invoke(app, ["serve", "agent", "--repair-variants", "16,x"])
    assert result.exit_code == 2 and "16,x" in result.output
    result = runner.invoke(app, ["serve", "agent", "--drift-tau", "-1"])
    assert result.exit_code == 2 and "drift" in result.output


# ---- the SDK client against the fake vLLM ---------------------------------------------------
def test_the_sdk_client_streams_tools_requests_and_their_exact_twin(fake_server) -> None:
    url, state = fake_server
    sender = OpenAISender(url, "smollm2-135m", timeout=30.0)
    r = tools_request(2)

    async def go() -> tuple[Answer, Answer]:
        try:
            return (await sender.stream(r, splice=True, max_tokens=4),
                    await sender.stream(r, splice=False, max_tokens=4))
        finally:
            await sender.close()

    spliced, exact = asyncio.run(go())
    for a in (spliced, exact):
        assert a.ok, a.error
        assert a.ttft_s is not None and a.total_s is not None and a.total_s >= a.ttft_s > 0
        assert a.text in ("Yes.", "No.") and a.prompt_tokens and a.spliced_tokens == 0
    assert state.requests == 2


@pytest.fixture()
def stats_server():
    """A front's ``/kvnotes/stats`` (its learner counters) in a thread; ``state["stats"]`` is
    what it answers (None: 404, as a front without the route)."""
    import http.server
    import threading

    state: dict = {"stats": {"requests": 3, "learner": {"sightings": 4, "compiles": 2,
                                                        "failures": 0, "learned_entries": 2}},
                   "key": None}  # a key: the route answers 401 without it, as a front's

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
            if state["key"] is not None and \
                    self.headers.get("Authorization") != f"Bearer {state['key']}":
                self.send_error(401)
                return
            if self.path != "/kvnotes/stats" or state["stats"] is None:
                self.send_error(404)
                return
            body = json.dumps(state["stats"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def test_the_sdk_client_reads_the_front_learner_counters(stats_server, fake_server) -> None:
    url, state = stats_server

    async def read(at: str) -> dict | None:
        sender = OpenAISender(at, "smollm2-135m", timeout=10.0)
        try:
            return await sender.learner()
        finally:
            await sender.close()

    got = asyncio.run(read(url))
    assert got is not None and got["compiles"] == 2 and got["learned_entries"] == 2
    state["stats"] = {"requests": 1}  # a front without a learner
    assert asyncio.run(read(url)) is None
    state["stats"] = None
    assert asyncio.run(read(url)) is None
    assert asyncio.run(read(fake_server[0])) is None  # vLLM itself: no such route


def test_the_sdk_client_reads_the_counters_with_its_api_key(stats_server) -> None:
    url, state = stats_server
    state["key"] = "sekret"

    async def read(key: str) -> dict | None:
        sender = OpenAISender(url, "smollm2-135m", timeout=10.0, api_key=key)
        try:
            return await sender.learner()
        finally:
            await sender.close()

    got = asyncio.run(read("sekret"))
    assert got is not None and got["compiles"] == 2
    assert asyncio.run(read("wrong")) is None  # refused: no counters


def test_the_sdk_client_reports_a_refused_request_as_failed(fake_server) -> None:
    url, _ = fake_server
    sender = OpenAISender(url, "not-served", timeout=30.0)

    async def go() -> Answer:
        try:
            return await sender.send(tools_request(2), splice=True, max_tokens=4)
        finally:
            await sender.close()

    a = asyncio.run(go())
    # classified as every workload's failures are (kit.failures), no longer the SDK's class name
    assert not a.ok and a.error_kind == "http_4xx" and "HTTP 404" in (a.error or "")


class FakeEntries:
    def texts(self, usage, tokenizer):
        return []


class FakeOracle:
    """Exact answers [1, 2]; the reported reference [1, 9]; one reference per call, counted."""

    def __init__(self) -> None:
        self.computed = 0
        self.entries = FakeEntries()
        self.donor_index = None  # no earlier request's layout taken

    def reference(self, ids, usage, n, stop=()):
        if usage is None or not usage.spliced_tokens:
            self.computed += 1
            return Reference("exact", [1, 2]), 0
        if usage.report is None:
            return "the connector's reports are missing", 0
        self.computed += 1
        return Reference("reported", [1, 9]), 3 if usage.report.local_hit == 3 else 0


def test_check_records_computes_one_reference_per_answer_from_its_report(tmp_path) -> None:
    def answer(tokens, spliced=0, report=None, prompt=3, plan=True):
        usage = UsageKvnotes(spliced, 0, False, plan_report([[0, 0, 2]]) if plan else None,
                             None, (), report) if spliced else None
        return Answer(ok=True, tokens=tokens, margins=[1.0] * len(tokens), prompt_tokens=prompt,
                      spliced_tokens=spliced,
                      kvnotes=None if usage is None else json.loads(json.dumps(
                          usage.to_dict())))

    loaded = SpliceReport(3, 0, (LoadedRange(0, 0, 2, "k"),))
    r = tools_request(2)
    records = [(rec(i), r) for i in range(7)]
    records[0][0].answer = answer(["<1>", "<2>"])  # exact: ok
    records[1][0].answer = answer(["<1>", "<9>"], 5, loaded)  # the reported one: ok
    records[2][0].answer = answer(["<1>", "<7>"])  # nothing spliced, not exact: wrong
    records[3][0].answer = answer(["<1>", "<7>"], 5, None)  # no report: unchecked
    records[4][0].answer = answer(["<1>", "<2>"], prompt=4)  # another prompt: wrong
    records[5][0].answer = answer(["<1>", "<7>"], 5, loaded)  # differs from the report's: wrong
    records[6][0].answer = answer(["<1>", "<7>"], 5, SpliceReport(3, 3))  # on a foreign prefix
    oracle = FakeOracle()
    rows = check_records(records, oracle, Tok(), CheckConfig(max_tokens=2), tenant="t",
                         render=lambda tok, req, cuts: Rendered([5, 6, 7], ("\n",)))
    got = [(x.verdict or {}).get("status") for x, _ in records]
    assert got == ["ok", "ok", "wrong", "unchecked", "wrong", "wrong", "unchecked"]
    assert oracle.computed == 5  # one per answer with a reference, none for the others
    assert records[1][0].verdict["matched"] == "reported"
    assert "the server counted 4" in records[4][0].verdict["why"]
    assert "reports are missing" in records[3][0].verdict["why"]
    assert "3 tokens another request made" in records[6][0].verdict["why"]
    # one record per request, with what it takes to check it again
    assert [x.index for x in rows] == [x.index for x, _ in records]
    assert rows[1].prompt_ids == [5, 6, 7] and rows[1].stop == ["\n"] and rows[1].tenant == "t"
    assert UsageKvnotes.from_dict(rows[1].usage).report == loaded and rows[0].usage is None
    assert [x.verdict for x in rows] == [x.verdict for x, _ in records]
    lines = write_records(rows, tmp_path / RECORDS_NAME).read_text().splitlines()
    back = [SoakRequestRecord.from_dict(json.loads(line)) for line in lines]
    assert back == rows and back[5].answer().tokens == ["<1>", "<7>"]


def test_a_usage_of_another_version_is_unchecked(tmp_path) -> None:
    a = Answer(ok=True, tokens=["<1>"], margins=[1.0], prompt_tokens=3, spliced_tokens=5,
               kvnotes={"spliced_tokens": 5, "plan": {"repair": "f32a16"}})
    records = [(rec(0), tools_request(2))]
    records[0][0].answer = a
    check_records(records, FakeOracle(), Tok(), CheckConfig(max_tokens=1),
                  render=lambda tok, req, cuts: Rendered([5, 6, 7]))
    v = records[0][0].verdict
    assert v["status"] == "unchecked"
    assert v["why"] == "usage.kvnotes not read: usage.kvnotes: missing field 'v'"
