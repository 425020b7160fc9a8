"""The agent soak's engine references on a tiny random model: the composition rebuilt from a
plan the front's own planner made (its ranges, repair tag and block size, as ``usage.kvnotes``
reports them) is the one ``Engine.compose`` makes of the same parts."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine

from kvnotes.bench.serving.agent_traffic_check import AgentOracle, KeptEntries
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
    got = dict(oracle.candidates(fp.ids, plan, 5))
    assert got["compose"] == engine.greedy(want, None, 5).token_ids
    assert got["exact"] == engine.greedy(engine.prefill(fp.ids), None, 5).token_ids
    partial = [k for k in got if k.startswith("partial@")]
    assert partial == [f"partial@{c}" for c in range(BLOCK, len(fp.ids), BLOCK)]
    before = oracle.computed
    dict(oracle.candidates(fp.ids, plan, 5))
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
    assert [k for k, _ in oracle.candidates(fp.ids, fp.to_dict(), 3)] == ["exact"]
