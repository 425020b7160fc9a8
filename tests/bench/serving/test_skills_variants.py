"""The skills workload's variants policies without vLLM: the pairs a run declares, the entries
published in their tenant, the front's plan splicing them (an exactly placed one not
repaired), ``variants-guarded``'s options and guard, the counts and the report."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_tiny_engine

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes.serving.compose_client import ComposeResult
from kvnotes.serving.planning.front_plan import plan_request
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.request import read_request
from kvnotes.serving.protocol import PlanEntry, UsageKvnotes, WirePlan
from kvnotes.serving.skills import ServingSkills
from kvnotes_bench.kit.machine import MachineRecord
from kvnotes_bench.serving.engine_check import engine_answers
from kvnotes_bench.serving.kit import PhaseSummary
from kvnotes_bench.serving.prompt_sets import BfclCase, BfclPrompts
from kvnotes_bench.serving.runs import skill_names
from kvnotes_bench.serving.skills import (
    Record,
    SkillsResult,
    declared_pairs,
    phase_prompts,
    policy_prompts,
)
from kvnotes_bench.serving.skills_clients import Clients, FrontClients
from kvnotes_bench.serving.skills_config import SkillsBenchConfig
from kvnotes_bench.serving.skills_fidelity import _fidelity, _fidelity_case
from kvnotes_bench.serving.skills_report import markdown, report
from kvnotes_bench.serving.skills_variants import (
    VARIANTS_TENANT,
    DeclaredVariants,
    declare_variants,
    variant_pairs,
    variant_use,
)

HEADER = "You are the support agent of Fjord Air. Answer in one short sentence.\n"
REFUNDS = ("\nREFUNDS: a ticket is refunded in full when it is cancelled within 24 hours of "
           "booking; after that, only taxes are refunded, and a voucher covers the fare.")
BAGGAGE = ("\nBAGGAGE: one cabin bag of 8 kg is free; a checked bag costs 30 euros, and a "
           "torn bag is repaired or paid for when it is reported within 7 days.")
MEALS = ("\nMEALS: a hot meal is served on flights longer than three hours; special meals "
         "are ordered at least two days before departure.")
USER = "\nCustomer: my bag is torn.\nAgent:"
PROMPTS = [[HEADER, REFUNDS, BAGGAGE, MEALS, USER], [HEADER, MEALS, BAGGAGE, USER]]


@pytest.fixture()
def published(tmp_path, tokenizer):
    lib = ServingSkills(tmp_path, make_tiny_engine("llama", tokenizer), max_variants=1)
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE), ("meals", MEALS)):
        lib.add(text, name=name, after=HEADER)
    return lib


def test_pairs_are_each_skill_behind_its_predecessor_once():
    pairs = variant_pairs([*PROMPTS, PROMPTS[0]])
    assert [(p.predecessor, p.skill) for p in pairs] == [(REFUNDS, BAGGAGE), (BAGGAGE, MEALS),
                                                         (MEALS, BAGGAGE)]
    assert {p.header for p in pairs} == {HEADER}
    assert variant_pairs([[HEADER, REFUNDS, USER]]) == []  # a first skill is placed already


def test_declared_variants_are_the_tenants_and_the_front_splices_them_exactly(published,
                                                                               tokenizer):
    names = {REFUNDS: "refunds", BAGGAGE: "baggage", MEALS: "meals"}
    lines: list[str] = []
    declared = declare_variants(published, variant_pairs(PROMPTS), names=names,
                                log=lines.append)
    assert (declared.pairs, declared.skills, declared.compiled) == (3, 2, 3)
    assert declared.tenant == VARIANTS_TENANT and len(set(declared.keys)) == 3
    assert declared.lead_tokens == len(published.engine.anchor_ids(
        HEADER, anchor=published.library.anchor))
    assert declared.bytes == sum(published.entry_path(k).stat().st_size for k in declared.keys)
    assert published.max_variants == 1  # the library's own cap is left as it was
    groups = {(g.name, g.tenant): g for g in published.variants()}
    assert len(groups["baggage", VARIANTS_TENANT].variants) == 2  # both predecessors kept
    assert len(groups["baggage", None].variants) == 1  # the shared, header-anchored one
    assert DeclaredVariants.from_dict(declared.to_dict()) == declared
    again = declare_variants(published, variant_pairs(PROMPTS))
    assert again.compiled == 0 and again.keys == declared.keys  # stored: not compiled twice
    assert "3 skill variants" in lines[0]

    catalog = SkillCatalog(published.folder, tokenizer, rescan_s=0.0)
    req = read_request("completion", {"model": "m", "prompt": "".join(PROMPTS[0])}, tokenizer)
    mine = plan_request(req, catalog, Repair(first=8), 1, VARIANTS_TENANT)
    shared = plan_request(req, catalog, Repair(first=8), 1, "repaired")
    got = {e["name"]: e for e in mine.wire().to_dict()["entries"]}
    # the second skill: the variant behind the header and its predecessor, exactly placed
    assert got["baggage"]["key"] == declared.keys[0] and got["baggage"]["repaired"] == 0
    # the third: the variant behind its predecessor alone, not the whole prefix: repaired
    assert got["meals"]["key"] == declared.keys[1] and got["meals"]["repaired"] == 8
    assert got["refunds"]["repaired"] == 0  # right behind the header it was compiled behind
    # another tenant never sees the declared variants: the header-anchored ones, repaired
    theirs = {e["name"]: e for e in shared.wire().to_dict()["entries"]}
    assert not {e["key"] for e in theirs.values()} & set(declared.keys)
    assert theirs["baggage"]["repaired"] == 8
    assert mine.plan.repaired_tokens < shared.plan.repaired_tokens
    assert sum(e["repaired"] for e in got.values()) == mine.plan.repaired_tokens


def test_engine_answers_compose_with_the_declared_variants(published):
    declare_variants(published, variant_pairs(PROMPTS))
    engine = published.engine
    answers = engine_answers(engine, PROMPTS, published.folder.parent, anchor=True,
                             block_size=1, repair_tokens=8, tokens=4, variants=True)
    assert set(answers) == {"exact", "compose", "repaired", "variants"}
    lib = published.library
    parts = [HEADER, lib.get(REFUNDS, after=HEADER), lib.get(BAGGAGE, after=HEADER),
             lib.get(MEALS, after=HEADER)]
    nb = engine.compose(parts, repair=Repair(first=8, align=1), library=lib, variants=True)
    assert nb.meta["compose"]["variants"] == [2, 3]  # baggage and meals swapped
    assert answers["variants"][0].text == engine.greedy(nb, USER, 4).text
    assert "variants" not in engine_answers(engine, PROMPTS[:1], published.folder.parent,
                                            anchor=True, block_size=1, repair_tokens=8,
                                            tokens=4)


def test_config_clients_and_prompts_of_the_variants_policy():
    with pytest.raises(InvalidArgumentError, match="--via front"):
        SkillsBenchConfig(policies=("variants",))
    config = SkillsBenchConfig(policies=("repaired", "variants"), via="front", requests=3,
                               concurrency=(1, 2), fidelity_samples=2)
    assert "variants" not in SkillsBenchConfig().policies  # asked for by name
    fc = FrontClients(plain=None, front=None)  # type: ignore[arg-type]
    assert fc.options("variants") == {"tenant": VARIANTS_TENANT, "repair": 32, "guard": 0}
    with pytest.raises(InvalidArgumentError, match="front"):
        Clients(plain=None).send("variants", ["q"], 1)  # type: ignore[arg-type]
    ps = BfclPrompts(cases=[BfclCase(f"c{i}", ("h", *skills, f"q{i}"), "calibrate", (), 9)
                            for i, skills in enumerate([("a", "b"), ("b", "c", "a")])],
                     header="h", skills={"fn-a": "a", "fn-b": "b", "fn-c": "c"})
    rows = phase_prompts(config, ps)
    assert [(c, p) for c, p, _ in rows] == [(1, "repaired"), (1, "variants"),
                                            (2, "repaired"), (2, "variants")]
    sent = policy_prompts(config, ps, "variants")
    assert sent == rows[1][2] + rows[3][2] + ps.requests(2, config.seed + 7777, "fidelity")
    assert skill_names(ps) == {"a": "fn-a", "b": "fn-b", "c": "fn-c"}


def _case(key: str, repaired: int) -> ComposeResult:
    entries = (PlanEntry("h", "hdr", 0, 5, 0), PlanEntry("s", key, 5, 20, repaired))
    plan = WirePlan(40, 16, Repair(first=0, align=16), "salt", (),
                    ((5, 5 + repaired),) if repaired else (), (), ("h", "s"), entries)
    return ComposeResult(ok=True, text="x", tokens=["x"], prompt_tokens=40, spliced_tokens=30,
                         usage_kvnotes=UsageKvnotes(phases=1, plan=plan), plan=plan)


def test_recompute_shares_variant_hits_and_the_report():
    ref = ComposeResult(ok=True, text="x", tokens=["x"], prompt_tokens=40)
    cases = [_fidelity_case(_case("v1", 0), ref, {}, None),
             _fidelity_case(_case("other", 10), ref, {}, None)]
    fid = _fidelity("variants", cases, 16, decisions=False)
    assert fid.repaired_share == pytest.approx(10 / 80)
    assert fid.repaired_of_pieces == pytest.approx(10 / 70)
    assert variant_use(fid.cases, ["v1", "v2"]) == {"spliced": 4, "hits": 1, "exact": 1,
                                                     "repaired": 10, "prompt": 80}
    declared = DeclaredVariants(pairs=2, skills=1, compiled=2, bytes=3 * 2**20, compile_s=1.5,
                                lead_tokens=5, keys=("v1", "v2"))
    result = SkillsResult(config=SkillsBenchConfig(policies=("variants",), via="front",
                                                   concurrency=(1,)),
                          machine=MachineRecord(2, "cpu", [], [0.1], [0.2]), server=None,
                          phases=[], requests=[], fidelity=[fid], variants=declared)
    data = result.to_dict()
    assert data["variants"]["keys"] == ["v1", "v2"]
    md = markdown(data)
    assert md == report(result)
    assert "| variants | 12.5% | 14.3% | 1/4 | 1 |" in md
    assert "2 (predecessor, skill) pairs of 1 skills" in md and "3.0 MiB" in md
    assert "amortized over the run" in md


def test_cli_refuses_the_variants_policies_without_the_front():
    from typer.testing import CliRunner

    from kvnotes_bench.cli import app

    for policies in ("repaired,variants", "variants-guarded"):
        res = CliRunner().invoke(app, ["serve", "skills", "--launch", "--policies",
                                       policies])
        assert res.exit_code == 2 and "--via front" in res.output


class _Front:
    """A stand-in for the front's client: records each body and answers as the front would
    when its guard fired."""

    model = "m"

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def send(self, body: dict) -> ComposeResult:
        self.bodies.append(body)
        return ComposeResult(ok=True, text="x", tokens=["x"],
                             usage_kvnotes=UsageKvnotes(phases=1, guard_fired=True))


def test_variants_guarded_is_variants_with_the_runs_guard():
    with pytest.raises(InvalidArgumentError, match="--via front"):
        SkillsBenchConfig(policies=("repaired", "variants-guarded"))
    with pytest.raises(InvalidArgumentError, match="calibration sample"):
        SkillsBenchConfig(policies=("variants-guarded",), via="front", calibration_samples=0)
    assert "variants-guarded" not in SkillsBenchConfig().policies  # asked for by name
    asked = SkillsBenchConfig(policies=("variants-guarded",), via="front")
    assert asked.declares_variants and asked.calibrates  # variants declared, tau calibrated
    given = SkillsBenchConfig(policies=("variants-guarded",), via="front", guard_tau=0.4)
    assert not given.calibrates
    assert not SkillsBenchConfig(policies=("repaired",)).declares_variants
    front = _Front()
    fc = FrontClients(plain=None, front=front, tau=0.7,  # type: ignore[arg-type]
                      repair=Repair(first=16))
    # the variants policy's tenant (its declared variants) and the guard's tau
    assert fc.options("variants-guarded") == {"tenant": VARIANTS_TENANT, "repair": 16,
                                              "guard": 0.7}
    assert fc.options("variants")["guard"] == 0 and fc.options("guarded")["guard"] == 0.7
    assert fc.send("variants-guarded", ["a", "b"], 1).guard_fired is True
    assert fc.send("variants", ["a", "b"], 1).guard_fired is None  # no guard: not read
    assert [b["kvnotes"]["tenant"] for b in front.bodies] == [VARIANTS_TENANT] * 2
    assert front.bodies[0]["prompt"] == "ab"
    with pytest.raises(InvalidArgumentError, match="front"):
        Clients(plain=None).send("variants-guarded", ["q"], 1)  # type: ignore[arg-type]


def test_declared_pairs_cover_both_variants_policies_prompts():
    skills = [("a", "b"), ("b", "c", "a"), ("c", "b"), ("a", "c", "b"), ("b", "a")]
    ps = BfclPrompts(cases=[BfclCase(f"c{i}", ("h", *s, f"q{i}"), "calibrate", (), 9)
                            for i, s in enumerate(skills)],
                     header="h", skills={"fn-a": "a", "fn-b": "b", "fn-c": "c"})
    both = SkillsBenchConfig(policies=("variants", "variants-guarded"), via="front",
                             requests=4, concurrency=(1,), fidelity_samples=0)
    mine = {p: variant_pairs(policy_prompts(both, ps, p)) for p in both.policies}
    # each policy's TTFT rows are its own random prompts: each has pairs the other lacks
    assert set(mine["variants"]) - set(mine["variants-guarded"])
    assert set(mine["variants-guarded"]) - set(mine["variants"])
    pairs = declared_pairs(both, ps)
    assert len(pairs) == len(set(pairs))  # each pair declared once
    assert set(pairs) == set(mine["variants"]) | set(mine["variants-guarded"])
    alone = dataclasses.replace(both, policies=("repaired", "variants-guarded"))
    assert declared_pairs(alone, ps) == variant_pairs(policy_prompts(alone, ps,
                                                                     "variants-guarded"))
    assert declared_pairs(dataclasses.replace(both, policies=("repaired",), via="vllm"),
                          ps) == []


def test_the_report_has_the_variants_guarded_rows():
    ref = ComposeResult(ok=True, text="x", tokens=["x"], prompt_tokens=40)
    fired = _case("v1", 0)
    fired.guard_fired = True
    cases = [_fidelity_case(fired, ref, {"half": "test"}, None),
             _fidelity_case(_case("other", 10), ref, {"half": "test"}, None)]
    fid = _fidelity("variants-guarded", cases, 16, decisions=False)
    assert fid.guard_fires == 1 and _fidelity("variants", cases, 16, decisions=False
                                              ).guard_fires is None
    declared = DeclaredVariants(pairs=2, skills=1, compiled=2, bytes=2**20, compile_s=1.0,
                                lead_tokens=5, keys=("v1", "v2"))
    phase = PhaseSummary(policy="variants-guarded", concurrency=1, requests=2, ok=2, failed=0,
                         skipped=0, ttft_p50_s=0.1, ttft_p90_s=0.1, ttft_p99_s=0.1,
                         ttft_mean_s=0.1, hit_rate=None, hit_rate_usage=0.5,
                         queries_tokens=None, hits_tokens=None, requests_per_s=None,
                         wall_s=1.0, mean_prompt_tokens=40.0)
    records = [Record("variants-guarded", 1, True, 0.1, 40, 20, phases=1, guard_fired=fire,
                      spliced_tokens=30) for fire in (True, False)]
    result = SkillsResult(config=SkillsBenchConfig(policies=("variants-guarded",), via="front",
                                                   concurrency=(1,)),
                          machine=MachineRecord(2, "cpu", [], [0.1], [0.2]), server=None,
                          phases=[phase], requests=records, fidelity=[fid], variants=declared,
                          guard_tau=0.7)
    assert [(r.policy, r.guard_fires) for r in result.phased_rows()] == [("variants-guarded", 1)]
    md = markdown(result.to_dict())
    assert "| variants-guarded | 1 | 1.00 | 1 | 30 |" in md  # phases, guard fires, spliced
    assert "| variants-guarded | 100.0% | 100.0% | - | 1 |" in md  # fidelity: the guard fired
    assert "| variants-guarded | test | 2 | 0 | 2 | 2 | 1 |" in md  # by half, with its fires
    assert "| variants-guarded | 12.5% | 14.3% | 1/4 | 1 |" in md  # recomputed, variant hits
