"""The agent soak's engine references on a tiny random model: the composition rebuilt from a
plan the front's own planner made (its ranges, repair tag and block size, as ``usage.kvnotes``
reports them) is the one ``Engine.compose`` makes of the same parts."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine

from kvnotes.bench.serving.agent_traffic_check import (
    AgentOracle,
    KeptEntries,
    Reference,
    cached_prefixes,
    served_strings,
    verdict,
)
from kvnotes.bench.serving.agent_traffic_client import Answer
from kvnotes.core.repair import Repair
from kvnotes.serving.planning.front_plan import plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.request import read_request
from kvnotes.serving.skills import ServingSkills

HEADER = "You are the airline's support agent. Follow the policies.\n"
BAGGAGE = "Baggage: one checked bag of 23 kg is included on every international fare.\n"
REFUNDS = "Refunds: a ticket cancelled within 24 hours of booking is refunded in full.\n"
USER = "Customer: can I get my money back?\nAgent:"
BLOCK = 4


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    lib = ServingSkills(tmp_path_factory.mktemp("agent-skills"),
                        make_tiny_engine("llama", tokenizer))
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE)):
        lib.add(text, name=name, after=HEADER)
    return lib


@pytest.mark.parametrize("first", [0, 8])
def test_the_composition_rebuilt_from_a_front_plan_is_engine_compose(published, tokenizer,
                                                                     first):
    texts = [HEADER, BAGGAGE, REFUNDS, USER]  # the skills in another order than compiled
    req = read_request("completion", {"model": "m", "prompt": "".join(texts)}, tokenizer)
    fp = plan_request(req, SkillCatalog(published.folder, tokenizer),
                      Repair(first=first, align=BLOCK), BLOCK, None)
    plan = fp.to_dict()  # what usage.kvnotes.plan carries
    assert plan["ranges"] and plan["spliced_tokens"] > 0
    engine, lib = published.engine, published.library
    oracle = AgentOracle(engine, KeptEntries(published.folder,
                                             published.manifest.fingerprint_obj))
    nb = oracle.composed(fp.ids, plan)
    assert nb is not None and nb.token_ids.tolist() == fp.ids
    parts = [lib.get(HEADER, name="header"), lib.get(BAGGAGE, name="baggage", after=HEADER),
             lib.get(REFUNDS, name="refunds", after=HEADER), USER]
    want = engine.compose(parts, repair=Repair(first=first, align=BLOCK))
    assert want.token_ids.tolist() == fp.ids
    got = {r.label: r.ids for r in oracle.candidates(fp.ids, plan, 5)}
    assert got["compose"] == engine.greedy(want, None, 5).token_ids
    assert got["exact"] == engine.greedy(engine.prefill(fp.ids), None, 5).token_ids
    partial = [k for k in got if k.startswith("partial@")]
    assert partial == [f"partial@{c}" for c in range(BLOCK, len(fp.ids), BLOCK)]
    before = oracle.computed
    list(oracle.candidates(fp.ids, plan, 5))
    assert oracle.computed == before  # each reference computed once
    if first:  # a plan whose repair regions are not the composition's is not rebuilt
        other = {**plan, "regions": [[r[0], r[1] + BLOCK] for r in plan["regions"]]}
        assert plan["regions"] and oracle.composed(fp.ids, other) is None


def test_a_plan_whose_entry_is_missing_gives_only_the_exact_reference(published, tokenizer,
                                                                      tmp_path):
    texts = [HEADER, REFUNDS, USER]
    req = read_request("completion", {"model": "m", "prompt": "".join(texts)}, tokenizer)
    fp = plan_request(req, SkillCatalog(published.folder, tokenizer), Repair(first=0), BLOCK,
                      None)
    oracle = AgentOracle(published.engine, KeptEntries(tmp_path, None))  # nothing kept
    assert oracle.composed(fp.ids, fp.to_dict()) is None
    assert oracle.why_not(fp.ids, fp.to_dict()).startswith("no kept entry holds")
    assert [r.label for r in oracle.candidates(fp.ids, fp.to_dict(), 3)] == ["exact"]


def test_a_korean_answer_is_compared_as_vllm_spells_its_byte_tokens(tokenizer):
    # recorded: SmolLM2 soak request 15 (2026-12-03), flagged wrong at its first token because
    # each engine id was decoded alone ("\ufffd") while vLLM spells an unfinished UTF-8
    # character "" and the whole character on the token that completes it
    ids = [183, 228, 114, 184, 223, 230, 46258, 184, 219, 122, 25947, 117, 230, 182, 237, 114]
    server = ["", "", "스", "", "", "테", "이", "", "", "크", "", "", " 만", "", "", "들"]
    assert served_strings(tokenizer, ids) == server
    assert [tokenizer.decode([t]) for t in ids] != server
    answer = Answer(ok=True, text="스테이크 만들", tokens=server, margins=[1.0] * 16,
                    finish_reason="length")
    v = verdict(answer, [Reference("exact", ids)], tokenizer, eos=[], tie_tau=0.05)
    assert v.status == "ok" and v.matched == "exact"
    other = [*ids[:6], 46258, 184, 219, 123, *ids[10:]]  # another third character
    v = verdict(answer, [Reference("exact", other)], tokenizer, eos=[], tie_tau=0.05)
    assert v.status == "wrong" and v.diverged_at == 9


def test_the_references_stop_where_the_server_stops(published, tmp_path):
    # the front sends a base model's chat with stop "\n\nUser:": vLLM ends the answer at the
    # token that completes it, and so must the reference (else it is longer than the answer)
    engine = published.engine
    ids = engine.tokens_of(HEADER + USER)[0]
    oracle = AgentOracle(engine, KeptEntries(tmp_path, None))
    whole = oracle.exact(ids, 8)
    assert len(whole.ids) == len(whole.margins) and all(m >= 0 for m in whole.margins)
    assert whole.ids == engine.greedy(engine.prefill(ids), None, 8).token_ids
    stop = engine.decode(whole.ids[:3])[-2:]
    cut = oracle.exact(ids, 8, (stop,))
    assert stop in engine.decode(cut.ids) and stop not in engine.decode(cut.ids[:-1])
    assert cut.ids == whole.ids[:len(cut.ids)] and len(cut.ids) <= 3
    assert cut.margins == whole.margins[:len(cut.ids)]


@pytest.mark.parametrize("first", [0, 8])
def test_a_cached_prefix_of_the_same_composition_gives_the_composition(published, tokenizer,
                                                                      first):
    # vLLM's prefix cache may hold an earlier request's notes of the prompt's first blocks;
    # when that request composed them as this one does, the answer built on the cached prefix
    # (the plan's loaded tokens from there on, the rest computed) is the composition's
    texts = [HEADER, BAGGAGE, REFUNDS, USER]
    req = read_request("completion", {"model": "m", "prompt": "".join(texts)}, tokenizer)
    fp = plan_request(req, SkillCatalog(published.folder, tokenizer),
                      Repair(first=first, align=BLOCK), BLOCK, None)
    plan = {**fp.to_dict(), "salt": "s"}
    oracle = AgentOracle(published.engine, KeptEntries(published.folder,
                                                       published.manifest.fingerprint_obj))
    ids = fp.ids
    loaded = min(r[1] for r in plan["ranges"] if r[2] - r[0] > 1)
    cut = len(ids) - 8  # an earlier request shared all but the last tokens
    other = [*ids[:cut], *(t + 1 for t in ids[cut:])]
    cached = cached_prefixes(ids, plan, [(7, ids, plan), (8, other, {**plan, "salt": "x"})])
    assert [c.label for c in cached] == [f"cached@{(len(ids) - 1) // BLOCK * BLOCK}:7"]
    assert cached[0].tokens > loaded and cached[0].plan is not None
    refs = {r.label: r.ids for r in oracle.candidates(ids, plan, 5, (), cached)}
    assert refs[cached[0].label] == refs["compose"]
    exact = cached_prefixes(ids, plan, [(9, other, {**plan, "ranges": [[cut, cut, cut + 2]]})])
    assert exact and exact[0].plan is None  # its ranges start past the shared blocks: exact


def test_a_stored_run_is_checked_again_from_its_records_and_kept_entries(tokenizer, tmp_path):
    import json
    import shutil

    from kvnotes.bench.kit.machine import MachineRecord
    from kvnotes.bench.serving.agent_traffic import AgentBenchConfig, AgentResult
    from kvnotes.bench.serving.agent_traffic_recheck import recheck_bundle
    from kvnotes.bench.serving.agent_traffic_records import (
        RECORDS_NAME,
        SoakRequestRecord,
        read_records,
        write_records,
    )
    from kvnotes.bench.serving.agent_traffic_soak import SoakRecord

    engine = make_tiny_engine("llama", tokenizer)
    lib = ServingSkills(tmp_path / "soak-skills", engine)
    lib.add(HEADER, name="header")
    lib.add(BAGGAGE, name="baggage", after=HEADER)
    lib.add(REFUNDS, name="refunds", after=HEADER)
    (tmp_path / "soak-entries").mkdir()
    for path in (tmp_path / "soak-skills").rglob("*.safetensors"):
        shutil.copy(path, tmp_path / "soak-entries" / path.name)
    req = read_request("completion", {"model": "m",
                                      "prompt": HEADER + BAGGAGE + REFUNDS + USER}, tokenizer)
    fp = plan_request(req, SkillCatalog(lib.folder, tokenizer), Repair(first=4, align=BLOCK),
                      BLOCK, None)
    want = engine.compose([lib.library.get(HEADER, name="header"),
                           lib.library.get(BAGGAGE, name="baggage", after=HEADER),
                           lib.library.get(REFUNDS, name="refunds", after=HEADER), USER],
                          repair=Repair(first=4, align=BLOCK))
    n = AgentBenchConfig().soak.max_tokens  # the run's answers' length
    spliced = engine.greedy(want, None, n).token_ids
    exact = engine.greedy(engine.prefill(fp.ids), None, n).token_ids

    def row(i: int, ids: list[int], splice: bool) -> SoakRequestRecord:
        return SoakRequestRecord(
            index=i, client=0, sent_s=float(i), tenant=None, splice=splice, eligible=splice,
            tools=["t"], question=0, ok=True, prompt_ids=fp.ids, prompt_source="front",
            prompt_tokens=len(fp.ids), plan=fp.to_dict() if splice else None,
            spliced_tokens=fp.plan.spliced_tokens if splice else 0,
            tokens=served_strings(tokenizer, ids), margins=[1.0] * len(ids),
            verdict={"status": "unchecked"})

    rows = [row(0, spliced, True), row(1, exact, False), row(2, [*exact[:2], 7, 7], False)]
    assert spliced != exact  # the composition is told apart from the exact answer
    write_records(rows, tmp_path / RECORDS_NAME)
    result = AgentResult(config=AgentBenchConfig(parts=("soak",)), machine=MachineRecord.now(),
                         soak_records=[SoakRecord(r.index, 0, r.sent_s, ["t"], 0, r.splice,
                                                  r.eligible, r.answer(), r.verdict)
                                       for r in rows])
    (tmp_path / "result.json").write_text(json.dumps(result.to_dict()))
    got = recheck_bundle(tmp_path, engine, say=lambda s: None)
    status = [(r.verdict or {}).get("status") for r in got.soak_records]
    assert status == ["ok", "ok", "wrong"]
    assert [(r.verdict or {}).get("matched") for r in got.soak_records][:2] == ["compose",
                                                                                 "exact"]
    assert got.soak_records[2].verdict["diverged_at"] == 2
    again = read_records(tmp_path / RECORDS_NAME)
    assert [r.verdict for r in again] == [r.verdict for r in got.soak_records]
    stored = json.loads((tmp_path / "result.json").read_text())
    assert stored["soak"]["summary"]["wrong"] == 1 and "checked again" in stored["notes"][-1]
    assert (tmp_path / "report.md").is_file()


def refunds_behind_two_prefixes(tokenizer, tmp_path):
    """REFUNDS compiled behind the header and behind the header and BAGGAGE: the engine, the
    kept entries and the chunk's ids."""
    engine = make_tiny_engine("llama", tokenizer)
    lib = ServingSkills(tmp_path / "lib", engine)
    lib.add(REFUNDS, name="refunds", after=HEADER)
    lib.add(REFUNDS, name="refunds", after=HEADER + BAGGAGE)
    kept = KeptEntries(lib.folder, lib.manifest.fingerprint_obj)
    return engine, kept, engine.tokens_of(REFUNDS, bos=False)[0]


def test_kept_entries_are_taken_in_the_order_the_server_prefers_them(tokenizer, tmp_path):
    # one chunk compiled behind two prefixes: the entry whose compile prefix the prompt ends
    # with is the one the front and the connector place (splice.preferred), the other next
    engine, kept, ids = refunds_behind_two_prefixes(tokenizer, tmp_path)
    assert len(kept) == 2
    behind_baggage = engine.tokens_of(HEADER + BAGGAGE)[0]
    behind_header = engine.tokens_of(HEADER)[0]
    first = kept.matches(ids, behind_baggage)
    other = kept.matches(ids, behind_header)
    assert len(first) == 2 and set(first) == set(other) and first != other
    info = {p: kept.by_ids[tuple(ids)][i][0] for i, (_, p) in enumerate(kept.by_ids[tuple(ids)])}
    assert list(info[first[0]].behind) == behind_baggage[-len(info[first[0]].behind):]
    assert kept.variants([*behind_header, *ids], {"ranges": [[len(behind_header), 0,
                                                              len(behind_header) + len(ids)]]}) \
        == {len(behind_header): 2}


def test_the_entry_a_plan_names_is_taken_first(tokenizer, tmp_path):
    # the front sends each range's entry key and the connector loads that very entry: the
    # check rebuilds the composition from it, even where the preference rule would pick another
    engine, kept, ids = refunds_behind_two_prefixes(tokenizer, tmp_path)
    behind_baggage = engine.tokens_of(HEADER + BAGGAGE)[0]
    preferred_first = kept.matches(ids, behind_baggage)
    other = preferred_first[1]
    named = kept.matches(ids, behind_baggage, key=other.stem)
    assert named == [other, preferred_first[0]]
    assert kept.matches(ids, behind_baggage, key="not-kept") == preferred_first
