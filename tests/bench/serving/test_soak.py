"""The soak's logic without a real server: its skill events, what each answer may equal and
the verdicts, the configuration it refuses, its requests, the streamed client's failure kinds
(against the fake vLLM), the co-running gaps, and the references on a tiny random model."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.protocol import SpliceRequest
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving.client import open_client
from kvnotes_bench.serving.corun import CorunConfig, inter_token_gaps
from kvnotes_bench.serving.soak_check import (
    SHARED_TENANTS,
    EngineOracle,
    Prompt,
    Verdict,
    allowed,
    check,
    divergence,
    event_schedule,
    trimmed,
)
from kvnotes_bench.serving.soak_client import Answer, stream_completion, token_id
from kvnotes_bench.serving.soak_events import EventRecord, damage_file, damage_times
from kvnotes_bench.serving.soak_report import markdown, report
from kvnotes_bench.serving.soak_result import SoakRecord, SoakResult, summarize
from kvnotes_bench.serving.soak_workload import SoakConfig, next_spec, splice_of, volatile_name

PROMPT = Prompt(("refunds", "volatile-0"), "\n\nCustomer: hi\nAgent:", 4, volatile_at=1)


class FakeOracle:
    """References by candidate kind: a list of (label, ids); records what was asked."""

    def __init__(self, refs: dict[str, list[tuple[str, list[int]]]]) -> None:
        self.refs, self.asked = refs, []

    def candidates(self, prompt, which):
        self.asked.append(which)
        yield from self.refs.get(which, [])


REFS = {"compose": [("compose", [1, 2, 3, 4])], "cut": [("cut", [1, 2, 9, 9])],
        "exact": [("exact", [1, 5, 5, 5])],
        "partial": [("partial@32", [1, 2, 3, 7]), ("partial@64", [1, 2, 3, 8])]}


# ---- skill events ----------------------------------------------------------------------------
def test_event_schedule_alternates_damage_and_keeps_cycles_inside_the_run():
    events = event_schedule(65, interval_s=20, damage_after_s=8, retire_after_s=16, first_s=5)
    assert [(e.t_s, e.kind, e.skill) for e in events] == [
        (5, "publish", 0), (13, "corrupt", 0), (21, "retire", 0),
        (25, "publish", 1), (33, "delete", 1), (41, "retire", 1),
        (45, "publish", 2), (53, "corrupt", 2), (61, "retire", 2)]


@pytest.mark.parametrize("damage, retire, interval", [(0, 5, 10), (6, 5, 10), (4, 12, 10)])
def test_event_schedule_refuses_overlapping_timings(damage, retire, interval):
    with pytest.raises(InvalidArgumentError, match="one volatile skill at a time"):
        event_schedule(60, interval_s=interval, damage_after_s=damage, retire_after_s=retire,
                       first_s=1)


def test_damage_times_read_the_done_time_of_each_damage():
    events = [EventRecord("publish", 0, 5.0, 5.0, 5.2), EventRecord("corrupt", 0, 13.0, 13.0, 13.1),
              EventRecord("delete", 1, 33.0, 33.0, 33.4), EventRecord("retire", 0, 21.0, 21.0, 21.0)]
    assert damage_times(events) == {0: ("corrupt", 13.1), 1: ("delete", 33.4)}


def test_damage_file_flips_one_byte_or_deletes(tmp_path):
    path = tmp_path / "entry.safetensors"
    data = bytes(range(64))
    path.write_bytes(data)
    damage_file(path, "corrupt")
    after = path.read_bytes()
    assert len(after) == len(data)
    assert [i for i in range(len(data)) if after[i] != data[i]] == [len(data) - 10]
    damage_file(path, "delete")
    assert not path.exists()


# ---- what an answer may equal ----------------------------------------------------------------
def test_allowed_candidates_follow_what_the_connector_can_do():
    assert allowed("spliced") == ("compose",)
    assert allowed("exact") == ("exact",)
    assert allowed("volatile") == ("compose", "cut", "exact", "partial")
    # after its damage a volatile skill is never spliced whole (its tenant is its own)
    assert "compose" not in allowed("volatile", damage="corrupt", after_damage=True)
    assert allowed("volatile", damage="delete", after_damage=True)[0] == "cut"
    assert allowed("volatile", damage="corrupt", after_damage=True)[0] == "exact"
    with pytest.raises(InvalidArgumentError, match="request kind 'bogus'"):
        allowed("bogus")
    with pytest.raises(InvalidArgumentError, match="needs the damage kind"):
        allowed("volatile", after_damage=True)


def test_check_names_the_candidate_matched():
    oracle = FakeOracle(REFS)
    v = check([1, 5, 5, 5], [], PROMPT, allowed("volatile", damage="corrupt", after_damage=True),
              oracle)
    assert v == Verdict("ok", matched="exact")
    assert oracle.asked == ["exact"]  # later candidates are not computed once one matched
    v = check([1, 2, 3, 8], [], PROMPT, allowed("volatile"), FakeOracle(REFS))
    assert (v.status, v.matched) == ("ok", "partial@64")


def test_a_spliced_answer_after_the_damage_is_wrong():
    # the whole composition after a corruption: the damaged tensors (or a stale copy) served
    v = check([1, 2, 3, 4], [{2: -0.1, 6: -3.0}] * 4, PROMPT,
              allowed("volatile", damage="corrupt", after_damage=True), FakeOracle(REFS))
    assert v.status == "wrong"
    assert v.expected == [1, 5, 5, 5] and v.diverged_at == 1


def test_a_wrong_spliced_answer_is_detected_with_its_step_and_margin():
    top = [{1: -0.1, 7: -2.5}, {2: -0.2, 8: -1.9}, {6: -0.3, 3: -1.4}, {4: -0.1, 0: -3.0}]
    v = check([1, 2, 6, 4], top, PROMPT, ("compose",), FakeOracle(REFS))
    assert (v.status, v.diverged_at, v.expected) == ("wrong", 2, [1, 2, 3, 4])
    assert v.margin == pytest.approx(1.1)


def test_a_divergence_inside_the_server_top_two_within_tau_is_a_near_tie():
    top = [{1: -0.1}, {2: -0.2}, {6: -0.69, 3: -0.70}, {4: -0.1}]
    v = check([1, 2, 6, 4], top, PROMPT, ("compose",), FakeOracle(REFS), tie_tau=0.05)
    assert (v.status, v.diverged_at) == ("near_tie", 2)
    assert v.margin == pytest.approx(0.01)
    # the same gap above tau, or the reference's token outside the server's top two: wrong
    assert check([1, 2, 6, 4], top, PROMPT, ("compose",), FakeOracle(REFS),
                 tie_tau=0.001).status == "wrong"
    far = [{1: -0.1}, {2: -0.2}, {6: -0.69, 5: -0.70}, {4: -0.1}]
    assert check([1, 2, 6, 4], far, PROMPT, ("compose",), FakeOracle(REFS)).status == "wrong"


def test_end_of_sequence_is_trimmed_on_both_sides():
    assert trimmed([3, 4, 0, 0], eos=[0]) == [3, 4]
    refs = {"compose": [("compose", [1, 2, 0])]}
    assert check([1, 2], [], PROMPT, ("compose",), FakeOracle(refs), eos=[0]).status == "ok"
    assert divergence([1, 2], [1, 2, 3]) == 2
    assert divergence([1, 2], [1, 2]) is None


def test_check_needs_a_candidate():
    with pytest.raises(InvalidArgumentError, match="at least one kind"):
        check([1], [], PROMPT, (), FakeOracle(REFS))


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"duration_s": 0}, "--duration must be positive"),
    ({"clients": 0}, "--clients must be at least 1"),
    ({"max_tokens": 0}, "--max-tokens must be 1-256"),
    ({"k_min": 2, "k_max": 1}, "skills per request"),
    ({"k_max": 5}, r"k_max \(5\) <= 4"),
    ({"exact_fraction": 1.5}, r"exact_fraction must lie in \[0, 1\]"),
    ({"exact_fraction": 0.6, "volatile_fraction": 0.6}, "at most 1"),
    ({"block_size": 48}, "multiple of 32"),
    ({"kv_blocks": 10}, "vLLM refuses to start"),
    ({"users": 0}, "users must be"),
    ({"duration_s": 60, "damage_after_s": 30}, "one volatile skill at a time"),
])
def test_soak_config_refuses(kw, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SoakConfig(**kw)


def test_soak_config_refuses_a_skill_outside_the_library():
    with pytest.raises(UnknownNameError, match="nonsense"):
        SoakConfig(skills=("refunds", "nonsense"))


def test_soak_config_launches_a_small_cache(tmp_path):
    from kvnotes.serving.launch.launcher import LaunchConfig

    cfg = SoakConfig(kv_blocks=80, block_size=32, max_model_len=2048)
    launch = cfg.launch(LaunchConfig(model="smollm2-135m", extra_args=("--x",)), tmp_path)
    assert launch.extra_args == ("--x", "--num-gpu-blocks-override", "80")
    assert (launch.block_size, launch.max_model_len, launch.skills) == (32, 2048, tmp_path)


def test_corun_config_refuses():
    with pytest.raises(UnknownNameError, match="warp"):
        CorunConfig(modes=("idle", "warp"))
    with pytest.raises(InvalidArgumentError, match="probe tokens"):
        CorunConfig(probe_tokens=1)


# ---- requests --------------------------------------------------------------------------------
def test_requests_by_kind():
    cfg = SoakConfig(exact_fraction=0.3, volatile_fraction=0.4, disconnect_fraction=0.5)
    rng = random.Random(3)
    specs = [next_spec(rng, cfg, live=2) for _ in range(300)]
    kinds = {s.kind for s in specs}
    assert kinds == {"spliced", "exact", "volatile"}
    for s in specs:
        assert set(s.prompt.skills) - {volatile_name(2)} <= set(cfg.skills)
        if s.kind == "volatile":  # after one library skill, last, in a tenant of its own
            assert s.prompt.skills[-1] == volatile_name(2) and s.prompt.volatile_at == 1
            assert s.tenant.startswith("soak-v2-") and s.volatile == 2
            assert splice_of(s) == SpliceRequest.leading(s.tenant)
        elif s.kind == "exact":
            assert s.tenant is None and splice_of(s) is None
        else:
            assert s.tenant in SHARED_TENANTS and s.prompt.volatile_at is None
            assert cfg.k_min <= len(s.prompt.skills) <= cfg.k_max
        if s.kind != "spliced":
            assert len([n for n in s.prompt.skills if n in cfg.skills]) == 1
    assert len({s.tenant for s in specs if s.kind == "volatile"}) == sum(
        s.kind == "volatile" for s in specs)
    assert any(s.close_after for s in specs) and any(s.close_after is None for s in specs)
    # no volatile skill live: none is sent
    assert {next_spec(rng, cfg, live=None).kind for _ in range(100)} <= {"spliced", "exact"}


def test_a_record_survives_its_json_form():
    spec = next_spec(random.Random(0), SoakConfig(volatile_fraction=1.0, exact_fraction=0.0),
                     live=0)
    ans = Answer(ok=True, token_ids=[5, 6], top=[{5: -0.1, 7: -2.0}, {6: -0.3}],
                 finish_reason="length", prompt_tokens=500, cached_tokens=480, ttft_s=0.5,
                 total_s=0.9, chunk_s=[0.5, 0.9], chunk_tokens=[1, 1])
    rec = SoakRecord(3, 1, spec, 12.5, ans)
    rec.verdict, rec.after_damage = Verdict("wrong", diverged_at=1, expected=[7], margin=0.2), True
    typed = SoakRecord.from_dict(rec.to_dict())
    assert (typed.verdict, typed.after_damage) == (rec.verdict, True) and typed.spec == spec


def test_summary_counts_outcomes():
    spec = next_spec(random.Random(0), SoakConfig(exact_fraction=1.0, volatile_fraction=0.0), live=None)
    recs = [SoakRecord(0, 0, spec, 1.0, Answer(ok=True, token_ids=[1], total_s=1.0, ttft_s=0.5)),
            SoakRecord(1, 0, spec, 2.0, Answer(ok=True, token_ids=[1], total_s=3.0, ttft_s=1.0)),
            SoakRecord(2, 1, spec, 2.0, Answer(disconnected=True, token_ids=[1])),
            SoakRecord(3, 1, spec, 3.0, Answer(error="boom", error_kind="http_5xx"))]
    recs[0].verdict = Verdict("ok", matched="exact")
    recs[1].verdict = Verdict("wrong", diverged_at=0, expected=[2])
    s = summarize(recs, 10.0, 4.0, 9.0)
    assert (s.requests, s.completed, s.failed, s.disconnects) == (4, 2, 1, 1)
    assert (s.wrong, s.near_ties, s.preemptions) == (1, 0, 5.0)
    assert s.errors == {"http_5xx": 1}
    assert s.matched == {"exact": {"exact": 1, "wrong": 1}}
    assert s.latency_p50_s == pytest.approx(2.0)


def test_report_lists_the_figures_and_the_wrong_answers():
    spec = next_spec(random.Random(0), SoakConfig(exact_fraction=1.0, volatile_fraction=0.0), live=None)
    rec = SoakRecord(0, 0, spec, 1.0, Answer(ok=True, token_ids=[1], total_s=1.0, ttft_s=0.5))
    rec.verdict = Verdict("wrong", diverged_at=0, expected=[2], margin=1.5)
    result = SoakResult(config=SoakConfig(), machine=MachineRecord(2, "cpu", [], [1, 2, 3]),
                        records=[rec], events=[EventRecord("publish", 0, 5.0, 5.1, 5.3)],
                        wall_s=10.0, preemptions_before=0.0, preemptions_after=2.0,
                        server_log={"spliced": 3}, references=1, threads=2,
                        how="kvnotes-bench serve soak", started="2026-01-01T00:00:00Z")
    text = markdown(result.to_dict())
    assert text == report(result) == report(SoakResult.from_dict(result.to_dict()))
    assert "| wrong answers | 1 |" in text
    assert "| preemptions (vLLM counter, delta) | 2 |" in text
    assert "request 0 (exact" in text and "expected [2]" in text
    assert "| 0 | publish | 5.0 | 5.3 |" in text


# ---- the streamed client ---------------------------------------------------------------------
def test_token_ids_come_back_as_spelled_by_vllm():
    assert token_id("token_id:123") == 123
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        token_id("hello")


# a cut stream is a connection failure, as the erratum and kit.failures count it (the soak's
# own client called it a stream failure before the workloads shared one client)
@pytest.mark.parametrize("fault, kind", [("http_500", "http_5xx"), ("http_400", "http_4xx"),
                                         ("drop", "connection"), ("cut", "connection"),
                                         ("stream_error", "stream")])
def test_failed_streams_are_classified(fake_server, fault, kind):
    url, state = fake_server
    state.fail(fault)

    async def go():
        client = open_client(url, timeout=10)
        try:
            return await stream_completion(client, "smollm2-135m", [1, 2, 3], max_tokens=4)
        finally:
            await client.close()

    ans = asyncio.run(go())
    assert not ans.ok and ans.error_kind == kind, ans.error


def test_inter_token_gaps_skip_the_first_token_and_split_multi_token_chunks():
    ans = Answer(ok=True, chunk_s=[1.0, 1.1, 1.4], chunk_tokens=[1, 1, 2])
    assert inter_token_gaps(ans) == pytest.approx([0.1, 0.15, 0.15])


# ---- the references on a tiny random model ---------------------------------------------------
def test_engine_references_are_the_compositions_they_name(tiny_llama):
    e = tiny_llama
    header, texts = "System rules.\n", {"a": "Alpha policy text here.", "b": "Beta rule words."}
    nbs = {k: e.compile(t, after=header) for k, t in texts.items()}
    oracle = EngineOracle(e, (header, e.compile(header, anchor="none")), nbs, texts,
                          block_size=4)
    p = Prompt(("a", "b"), " user asks", 5, volatile_at=1)
    ids = oracle.ids(p)
    (_, exact), = oracle.candidates(p, "exact")
    assert exact == e.greedy(e.prefill(ids), None, 5).token_ids  # prefix-shared prefill
    (_, compose), = oracle.candidates(p, "compose")
    parts = [oracle.header, nbs["a"], nbs["b"], " user asks"]
    assert compose == e.greedy(e.compose(parts, repair=0), None, 5).token_ids
    (_, cut), = oracle.candidates(p, "cut")
    assert cut == e.greedy(e.compose([oracle.header, nbs["a"], texts["b"], " user asks"],
                                     repair=0), None, 5).token_ids
    partial = list(oracle.candidates(p, "partial"))
    assert [lab for lab, _ in partial] == [f"partial@{c}" for c in range(4, len(ids), 4)]
    head = e.compose(parts, repair=0).slice(0, 4)
    assert partial[0][1] == e.greedy(head, ids[4:], 5).token_ids
    before = oracle.computed
    list(oracle.candidates(p, "exact"))
    assert oracle.computed == before  # cached


def test_batched_references_equal_one_at_a_time(tiny_llama):
    e = tiny_llama
    header, texts = "System rules.\n", {"a": "Alpha policy text here.", "b": "Beta rule words."}
    nbs = {k: e.compile(t, after=header) for k, t in texts.items()}
    hdr = (header, e.compile(header, anchor="none"))
    prompts = [Prompt(("a", "b"), " user asks", 5, volatile_at=1),
               Prompt(("b",), " another question here", 5), Prompt(("a",), " hi", 3)]
    wanted = [(p, w) for p in prompts for w in ("compose", "exact", "cut")]
    batched = EngineOracle(e, hdr, nbs, texts, block_size=4)
    batched.warm(wanted, batch=4)
    assert batched.computed == len(wanted)
    single = EngineOracle(e, hdr, nbs, texts, block_size=4)
    for p, w in wanted:
        assert next(batched.candidates(p, w)) == next(single.candidates(p, w)), (p, w)
    assert batched.computed == len(wanted)  # nothing computed again
