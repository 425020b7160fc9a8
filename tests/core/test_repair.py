"""Boundary repair of spliced skills: the Repair rule and Engine.compose's default (tiny models)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine, make_tiny_model

import kvnotes
from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyInputError,
    InvalidArgumentError,
    UnknownNameError,
)
from kvnotes.core.repair import (
    DEFAULT_FIRST,
    DEFAULT_REPAIR,
    DEFAULT_SHARE,
    NO_REPAIR,
    PrefixHasher,
    Repair,
    as_repair,
    prefix_digest,
    repaired_end,
    split_budget,
)

HEADER = "System: you are the support agent of a small shop. Follow the policies below.\n\n"
# long enough that the default first 32 tokens are a part of each skill, not all of it
REFUNDS = ("Refunds are issued within five days of the return reaching the warehouse. "
           "Final-sale items cannot be returned. Gift cards are never refunded in cash, and "
           "opened hygiene products stay with the customer.")
SHIPPING = ("Shipping takes three days inside the country and ten days abroad. Express "
            "shipping costs extra and is not refunded when the parcel is late by one day only. "
            "Parcels lost in transit are replaced once, free of charge, after a carrier claim.")


def _close(a, b, atol=1e-5):
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.positions, b.positions)
    for l in range(a.num_layers):
        assert torch.allclose(a.keys(l), b.keys(l), atol=atol), l
        assert torch.allclose(a.values(l), b.values(l), atol=atol), l


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer)


# ---- the rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,message", [
    ({"first": -1}, InvalidArgumentError, r"Repair\(first=-1\): give a token count >= 0"),
    ({"first": 1.5}, ArgumentTypeError, r"Repair\(first=1\.5\): give an int token count"),
    ({"first": True}, ArgumentTypeError, r"Repair\(first=True\)"),
    ({"align": 0}, InvalidArgumentError, r"Repair\(align=0\): give a positive token count"),
    ({"align": "16"}, ArgumentTypeError, r"Repair\(align='16'\)"),
    ({"skip_exact": 1}, ArgumentTypeError, r"Repair\(skip_exact=1\): give True or False"),
    ({"budget": "0.1"}, ArgumentTypeError, r"Repair\(budget='0\.1'\): give a fraction"),
    ({"budget": None}, ArgumentTypeError, r"Repair\(budget=None\)"),
    ({"select": None}, ArgumentTypeError, r"Repair\(select=None\): give a selector name"),
    ({"budget": -2}, InvalidArgumentError, r"Repair\(budget=-2\) is a negative token count"),
    ({"budget": 1.5}, InvalidArgumentError, r"Repair\(budget=1\.5\) is not a fraction in \(0, 1\]"),
    ({"budget": float("nan")}, InvalidArgumentError, r"Repair\(budget=nan\) is not a fraction"),
    ({"select": "attention"}, UnknownNameError, r"'attention'; .*\(attention applies to edit only\)"),
    ({"select": "random"}, UnknownNameError, r"unknown repair selector 'random'"),
])
def test_repair_refuses_bad_fields(kwargs, error, message):
    with pytest.raises(error, match=message):
        Repair(**kwargs)


def test_as_repair_and_tags():
    assert as_repair(DEFAULT_REPAIR) is DEFAULT_REPAIR and DEFAULT_REPAIR.first == DEFAULT_FIRST
    assert as_repair(0) == NO_REPAIR and as_repair(0.0).is_noop and not DEFAULT_REPAIR.is_noop
    # an int is each skill's first tokens, a float a shared fraction; a count budget is spelled out
    assert as_repair(0.25) == Repair(first=0, budget=0.25) and as_repair(8) == Repair(first=8)
    assert as_repair(16).budget == 0 and as_repair(1.0) == Repair(first=0, budget=1.0)
    # the default names its share floor, so a server's salts tell it from a fixed count
    assert DEFAULT_REPAIR.tag() == f"f{DEFAULT_FIRST}a1s{DEFAULT_SHARE:g}"
    assert NO_REPAIR.tag() == "f0a1" and Repair(first=32).tag() == "f32a1"
    assert Repair(first=16, align=16, skip_exact=False).tag() == "f16a16e"
    assert Repair(first=0, budget=0.1, select="kv_deviation").tag() == "f0a1b0.1kv_deviation"
    for bad in ("0.1", True, None):
        with pytest.raises(ArgumentTypeError, match="repair must be a Repair"):
            as_repair(bad)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(InvalidArgumentError, match="is not a fraction in"):
            as_repair(bad)
    with pytest.raises(InvalidArgumentError, match=r"Repair\(first=-1\)"):
        as_repair(-1)


def test_prefix_hasher_matches_prefix_digest_part_by_part():
    ids = [5, 17, 3, 900, 2]
    for cut in range(len(ids) + 1):
        h = PrefixHasher()
        h.update(ids[:cut])
        assert h.digest() == prefix_digest(ids[:cut])
        h.update([])
        h.update(ids[cut:])
        assert h.digest() == prefix_digest(ids)


def test_repaired_end_rounds_up_to_align_and_caps_at_the_skill():
    assert repaired_end(40, 300, 32) == 72
    assert repaired_end(40, 300, 32, align=16) == 80  # 72 rounded up to the next block end
    assert repaired_end(48, 300, 32, align=16) == 80  # already on a multiple: not pushed on
    assert repaired_end(40, 60, 32) == 60 and repaired_end(40, 60, 32, align=64) == 60
    assert repaired_end(40, 300, 0, align=16) == 40  # first=0: nothing, even unaligned
    assert repaired_end(5, 5, 32) == 5
    with pytest.raises(InvalidArgumentError, match=r"0 <= start <= end, got \[9, 3\)"):
        repaired_end(9, 3, 32)


def test_compile_records_the_prefix_digest(tiny):
    prefix = tiny.anchor_ids(HEADER)
    skill = tiny.compile(REFUNDS, after=HEADER)
    assert skill.meta["prefix_len"] == len(prefix) == skill.start_position
    assert skill.meta["prefix_digest"] == prefix_digest(prefix) != prefix_digest(prefix[1:])
    alone = tiny.compile(REFUNDS)
    assert (alone.meta["prefix_len"], alone.meta["prefix_digest"]) == (0, prefix_digest([]))



def test_compile_skills_keeps_the_notes_of_the_prompt_that_showed_them(tiny):
    refunds, shipping = tiny.compile_skills([REFUNDS, SHIPPING], names=["r", "s"], after=HEADER)
    # each is the skill compiled behind everything before it in that prompt
    _close(refunds, tiny.compile(REFUNDS, after=HEADER))
    behind = [*tiny.anchor_ids(HEADER), *tiny.encode(REFUNDS)]
    _close(shipping, tiny.compile(SHIPPING, after=behind))
    assert (shipping.meta["prefix_len"], shipping.meta["name"]) == (len(behind), "s")
    # in the order they were shown every note is a prefill's: nothing is recomputed
    nb = tiny.compose([HEADER, refunds, shipping, " Answer:"])
    stats = nb.meta["compose"]
    assert stats["exact"] == [1, 2] and stats["repaired"] == 0
    _close(nb, tiny.prefill(nb.token_ids))
    # in another order both are repaired like any splice
    swapped = tiny.compose([HEADER, shipping, refunds, " Answer:"]).meta["compose"]
    assert swapped["exact"] == [] and len(swapped["regions"]) == 2
    with pytest.raises(InvalidArgumentError, match="2 texts but 1 names"):
        tiny.compile_skills([REFUNDS, SHIPPING], names=["r"])
    with pytest.raises(ArgumentTypeError, match="not a bare string"):
        tiny.compile_skills(REFUNDS)
    with pytest.raises(EmptyInputError, match="at least one text"):
        tiny.compile_skills([])

# ---- compose's default ------------------------------------------------------------------------
def test_default_repairs_the_first_tokens_of_each_skill_not_exactly_placed(tiny):
    header, refunds = tiny.compile(HEADER), tiny.compile(REFUNDS, after=HEADER)
    shipping = tiny.compile(SHIPPING, after=HEADER)  # compiled behind the header, placed later
    assert len(shipping) > DEFAULT_FIRST
    parts = [header, refunds, " Then: ", shipping, " Answer:"]
    nb = tiny.compose(parts)
    stats = nb.meta["compose"]
    at = len(header) + len(refunds) + len(tiny.encode(" Then: "))
    assert stats["exact"] == [0, 1]  # the header at 0, refunds right behind it
    assert stats["regions"] == [[at, at + DEFAULT_FIRST]] and stats["repaired"] == DEFAULT_FIRST
    assert stats["reused"] == len(header) + len(refunds) + len(shipping) - DEFAULT_FIRST
    assert stats["repair"] == DEFAULT_REPAIR.tag() and stats["select"] == "first"
    # the same by hand: splice, recompute the region in place, then the text that follows it
    by_hand = tiny.compose(parts[:4], repair=0)
    by_hand = tiny.extend(tiny.recompute(by_hand, range(at, at + DEFAULT_FIRST)), " Answer:")
    _close(nb, by_hand)
    # ... and it is closer to a prefill than the bare splice
    full = tiny.prefill(nb.token_ids)
    bare = tiny.compose(parts, repair=0)
    err = [max(float((x.keys(l) - full.keys(l)).abs().max()) for l in range(full.num_layers))
           for x in (nb, bare)]
    assert err[0] < err[1], err


def test_a_skill_behind_other_tokens_or_moved_is_repaired(tiny):
    header, refunds = tiny.compile(HEADER), tiny.compile(REFUNDS, after=HEADER)
    moved = tiny.compose([header, " Note. ", refunds]).meta["compose"]
    assert moved["exact"] == [0] and moved["regions"][0][0] == len(header) + len(
        tiny.encode(" Note. "))
    # the right tokens, but shifted: positions differ from the compile
    shifted = tiny.compose([header, refunds], start=3).meta["compose"]
    assert shifted["exact"] == [] and len(shifted["regions"]) == 2
    # skip_exact=False repairs exact placements too
    every = tiny.compose([header, refunds], repair=Repair(skip_exact=False)).meta["compose"]
    assert every["exact"] == [] and every["regions"] == [
        [0, min(len(header), DEFAULT_FIRST)],
        [len(header), len(header) + min(len(refunds), DEFAULT_FIRST)]]


def test_an_exact_placement_after_a_repaired_skill_is_repaired(tiny):
    # shipping was compiled behind the very tokens before it, but refunds (compiled alone and
    # placed after the header) holds approximate notes past its first tokens: no exact chain
    header, refunds = tiny.compile(HEADER), tiny.compile(REFUNDS)
    behind = [*tiny.encode(HEADER), *tiny.encode(REFUNDS)]
    shipping = tiny.compile(SHIPPING, after=behind)
    assert len(refunds) > DEFAULT_FIRST
    stats = tiny.compose([header, refunds, shipping]).meta["compose"]
    assert stats["exact"] == [0] and [r[0] for r in stats["regions"]] == [
        len(header), len(behind)]
    # with refunds repaired all the way, the chain holds and shipping is spliced as it is
    whole = tiny.compose([header, refunds, shipping], repair=Repair(first=len(refunds)))
    assert whole.meta["compose"]["exact"] == [0, 2]
    _close(whole, tiny.prefill(whole.token_ids))


def test_align_ends_regions_on_multiples(tiny):
    parts = ["Q. ", tiny.compile(REFUNDS), " and ", tiny.compile(SHIPPING), " A:"]
    for start in (0, 3):
        nb = tiny.compose(parts, start=start, repair=Repair(first=5, align=8))
        regions = nb.meta["compose"]["regions"]
        assert len(regions) == 2
        for a, r in regions:
            assert (r + start) % 8 == 0 and 5 <= r - a < 13, (start, regions)
        assert nb.meta["compose"]["repaired"] == sum(r - a for a, r in regions)


def test_first_tokens_then_a_budget_on_the_rest(tiny):
    a, b = tiny.compile(REFUNDS), tiny.compile(SHIPPING)
    parts = ["Q. ", a, b]
    nb = tiny.compose(parts, repair=Repair(first=4, budget=6))
    stats = nb.meta["compose"]
    assert stats["repaired"] == 4 + 4 + 6 and stats["reused"] == len(a) + len(b) - 14
    # the budget is shared by what the regions leave; select="first" takes the tokens right
    # after each region, each skill repaired before the next is spliced
    k_a, k_b = split_budget(6, [len(a) - 4, len(b) - 4])
    at_a = len(tiny.encode("Q. "))
    at_b = at_a + len(a)
    assert stats["regions"] == [[at_a, at_a + 4], [at_b, at_b + 4]]
    by_hand = tiny.recompute(tiny.compose(parts[:2], repair=0), range(at_a, at_a + 4 + k_a))
    by_hand = tiny.recompute(by_hand.splice(b), range(at_b, at_b + 4 + k_b))
    _close(nb, by_hand)
    dev = tiny.compose(parts, repair=Repair(first=4, budget=6, select="kv_deviation"))
    d = dev.meta["compose"]
    assert d["repaired"] == 14 and d["select"] == "kv_deviation"
    layers = tiny.adapter.num_layers
    assert d["select_tokens"] == pytest.approx((len(a) + len(b) - 8) * 2 / layers)
    assert d["compute_fraction"] == pytest.approx(
        (d["computed"] + d["repaired"] + d["select_tokens"]) / len(dev))


@pytest.mark.parametrize("repair", [1.0, Repair(first=10_000), Repair(first=8, budget=1.0),
                                    Repair(first=8, budget=1.0, select="kv_deviation")])
def test_every_spliced_token_repaired_equals_a_prefill_in_float64(tokenizer, repair):
    engine = kvnotes.Engine.from_model(make_tiny_model("llama", tokenizer).double(), tokenizer)
    parts = ["Customer asks. ", engine.compile(REFUNDS), " Then: ", engine.compile(SHIPPING),
             " Answer:"]
    nb = engine.compose(parts, repair=repair)
    assert nb.keys(0).dtype == torch.float64
    _close(nb, engine.prefill(nb.token_ids), atol=1e-10)
    assert nb.meta["compose"]["reused"] == 0
    ref = engine.next_logits(engine.prefill(nb.token_ids), " yes")
    assert torch.allclose(engine.next_logits(nb, " yes"), ref, atol=1e-10)


def test_compose_meta_keys(tiny):
    stats = tiny.compose(["Q. ", tiny.compile(REFUNDS), " A:"]).meta["compose"]
    assert set(stats) == {"reused", "computed", "repaired", "select", "select_tokens",
                          "compute_fraction", "regions", "exact", "repair"}
    assert stats["compute_fraction"] == pytest.approx(
        (stats["computed"] + stats["repaired"]) / (stats["computed"] + stats["repaired"]
                                                   + stats["reused"]))


def test_fidelity_defaults_to_the_repaired_compose(tiny):
    skill = tiny.compile(REFUNDS)
    parts = ["Customer asks. ", skill]
    repaired = kvnotes.fidelity(tiny, parts, " Answer:", max_new_tokens=1)
    bare = kvnotes.fidelity(tiny, parts, " Answer:", max_new_tokens=1, repair=0)
    assert repaired.tokens_repaired == DEFAULT_FIRST and bare.tokens_repaired == 0
    assert repaired.tokens_reused == len(skill) - DEFAULT_FIRST
    assert repaired.kl < bare.kl, (repaired.kl, bare.kl)


# ---- the plan, without a model ------------------------------------------------------------------
def test_plan_repair_exact_chain_regions_budgets_and_costs():
    from kvnotes.core.repair_plan import Piece, Text, plan_repair

    head = (1, 2, 3, 4)
    header = Piece(4, origin=0, ids=head, prefix_len=0, prefix_digest=prefix_digest([]))
    behind = Piece(10, origin=4, ids=tuple(range(10)), prefix_len=4,
                   prefix_digest=prefix_digest(head))
    moved = Piece(20, origin=4, prefix_len=4, prefix_digest=prefix_digest(head))
    parts = [header, behind, Text(2, (9, 9)), moved, Text(3)]
    plan = plan_repair(parts, Repair(first=8, budget=0.5))
    assert plan.exact == (0, 1) and plan.regions == [(16, 24)] and plan.length == 39
    assert [p.budget for p in plan.pieces] == [6]  # half of the 12 tokens after the region
    assert plan.repaired == 14 and plan.select_tokens(num_layers=4) == 0.0
    assert plan.exact_prefix(parts) == 30  # the region and the budget's first tokens after it
    deviation = plan_repair(parts, Repair(first=8, budget=0.5, select="kv_deviation"))
    assert deviation.select_tokens(num_layers=4, layer=1) == 12 * 2 / 4
    assert deviation.exact_prefix(parts) == 24  # chosen tokens need not follow the region
    # the same layout without the text's ids: no later digest can match, the chain still holds
    blind = plan_repair([Text(1), header], Repair())
    assert blind.exact == () and blind.regions == [(1, 5)]
    assert plan_repair(parts, Repair(skip_exact=False)).exact == ()


def test_plan_repair_trusts_a_server_chain_and_splices_opaque_pieces_as_they_are():
    from kvnotes.core.repair_plan import Piece, Text, plan_repair

    served = [Piece(1, 0, trust_chain=True), Piece(40, 1, trust_chain=True),
              Piece(60, 1, trust_chain=True), Piece(30, 101, trust_chain=True)]
    plan = plan_repair(served, Repair(first=16, align=16))
    # the last piece sits at its origin, but behind a piece that was moved: not trusted
    assert plan.exact == (0, 1) and plan.regions == [(41, 64), (101, 128)]
    assert plan_repair([Text(1), *served[1:]], Repair()).exact == ()
    image = Piece(8, 0, consecutive=False)
    opaque = plan_repair([Text(2), image, Text(1)], Repair())
    assert opaque.opaque == (1,) and opaque.pieces == () and opaque.exact_prefix(
        [Text(2), image, Text(1)]) == 2
    with pytest.raises(InvalidArgumentError, match="layout part 0 is empty"):
        plan_repair([Text(0)], Repair())
