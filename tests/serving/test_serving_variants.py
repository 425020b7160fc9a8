"""Skill variants in the server: one ranking rule for the front's plan and the connector, an
exactly placed variant not repaired, candidates for learned variants, hits, the cap, the CLI."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.core.document import encode
from kvnotes.core.errors import UnknownNameError
from kvnotes.core.repair import Repair, repaired_end
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.skill_variants import skill_variants
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, check_ranges, preferred
from kvnotes.serving.planning.front_plan import split_pieces
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.phases import PartSpan, plan_phases, sent_spans
from kvnotes.serving.planning.variant_demand import VariantHits, variant_candidates
from kvnotes.serving.skills import ServingSkills

HEADER = "You are the support agent of Fjord Air. Answer in one short sentence.\n"
REFUNDS = ("\nREFUNDS: a ticket is refunded in full when it is cancelled within 24 hours of "
           "booking; after that, only taxes are refunded, and a voucher covers the fare.")
BAGGAGE = ("\nBAGGAGE: one cabin bag of 8 kg is free; a checked bag costs 30 euros, and a "
           "torn bag is repaired or paid for when it is reported within 7 days.")
MEALS = ("\nMEALS: a hot meal is served on flights longer than three hours; special meals "
         "are ordered at least two days before departure.")
SKILL = tuple(range(20, 30))


def _variants() -> dict[str, PieceInfo]:
    return {"header": PieceInfo("h", "b", SKILL, 3, behind=(1, 2, 3)),
            "after_a": PieceInfo("a", "b", SKILL, 6, behind=(1, 2, 3, 10, 11, 12)),
            "after_c": PieceInfo("c", "b", SKILL, 5, behind=(1, 2, 3, 13, 14))}


@pytest.mark.parametrize(("before", "want"), [
    ((1, 2, 3, 10, 11, 12), "a"),  # its predecessor: the variant behind it (exactly placed)
    ((1, 2, 3, 13, 14), "c"),
    ((1, 2, 3), "h"),  # right after the header: the header-anchored one
    ((1, 2, 3, 7, 7, 10, 11, 12), "a"),  # the predecessor further in: still the longest suffix
    ((1, 2, 3, 15), "a"),  # nothing shared: none at the position, the latest origin
])
def test_every_lookup_ranks_variants_by_the_prompt_before_them(before, want):
    idx = PieceIndex()
    for p in _variants().values():
        idx.add(p)
    ids = [*before, *SKILL, 9]
    pos = len(before)
    assert idx.match_at(ids, pos).key == want
    assert idx.match_exact(ids, pos, pos + len(SKILL)).key == want
    assert preferred(_variants().values(), pos, ids).key == want
    assert [p.piece.key for p in split_pieces(ids, idx) if p.piece] == [want]


@pytest.fixture()
def folder(tmp_path, tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    lib = ServingSkills(tmp_path, engine, max_variants=3)
    lib.add(HEADER, name="header")
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE), ("meals", MEALS)):
        lib.add(text, name=name, after=HEADER)
    return lib


def _plan(lib: ServingSkills, tokenizer, text: str):
    catalog = SkillCatalog(lib.folder, tokenizer, rescan_s=0.0)
    parts = catalog.lay_out(catalog.find(text))
    ids = [t for p in parts for t in p.token_ids]
    return parts, ids


def test_the_front_and_the_connector_pick_the_same_variant(folder, tokenizer):
    variant = folder.add(BAGGAGE, name="baggage", after=folder.after_skill("refunds",
                                                                           header=HEADER))
    text = HEADER + REFUNDS + BAGGAGE + "\nAgent:"
    parts, ids = _plan(folder, tokenizer, text)
    chosen = {p.piece.name: p.piece.key for p in parts if p.piece is not None}
    assert chosen["baggage"] == variant.key
    spans = sent_spans(parts)
    plan = plan_phases(spans, Repair(first=32), 16)
    checked = check_ranges(ids, PieceStore(folder.folder).index, [r.to_list() for r in plan.ranges])
    assert checked.reason is None
    by_start = {s.start: s.name for s in spans if s.is_piece}
    assert {by_start[r.piece_start]: p.key for r, p in zip(checked.ranges, checked.pieces,
                                                             strict=True)} == chosen
    # the variant sits behind its whole prefix: exactly placed, nothing repaired in the server
    assert plan.regions == () and plan.repaired_tokens == 0


def test_a_predecessor_matched_variant_is_repaired(folder, tokenizer):
    folder.add(MEALS, name="meals", after=folder.after_skill("baggage", header=HEADER))
    # meals after refunds and baggage: its variant saw the header and baggage, not refunds
    parts, ids = _plan(folder, tokenizer, HEADER + REFUNDS + BAGGAGE + MEALS + "\nAgent:")
    spans = sent_spans(parts)
    meals = next(p.piece for p in parts if p.piece is not None and p.piece.name == "meals")
    start = next(s.start for s in spans if s.name == "meals")
    baggage_ids = tuple(encode(tokenizer, BAGGAGE))
    assert meals.behind[-len(baggage_ids):] == baggage_ids and len(meals.behind) < start
    plan = plan_phases(spans, Repair(first=32), 16)
    baggage = next(s.start for s in spans if s.name == "baggage")
    # both are recomputed in context: meals' first tokens, and the header-anchored baggage's
    assert any(a <= start < b for a, b in plan.regions)
    assert any(a <= baggage < b for a, b in plan.regions)


def test_candidates_name_the_missing_predecessor_variants(folder, tokenizer):
    parts, ids = _plan(folder, tokenizer, HEADER + REFUNDS + MEALS + BAGGAGE + "\nAgent:")
    found = variant_candidates(sent_spans(parts), ids)
    head = list(encode(tokenizer, HEADER))
    assert [c.name for c in found] == ["meals", "baggage"]
    assert list(found[0].after) == folder.after_skill("refunds", header=HEADER)
    assert list(found[1].after) == [*head, *encode(tokenizer, MEALS)]
    assert found[0].to_dict()["tokens"] == len(encode(tokenizer, MEALS))
    # compiled, the candidate is exactly placed and no longer a candidate
    folder.add(MEALS, name="meals", after=list(found[0].after))
    parts, ids = _plan(folder, tokenizer, HEADER + REFUNDS + MEALS + BAGGAGE + "\nAgent:")
    assert [c.name for c in variant_candidates(sent_spans(parts), ids)] == ["baggage"]
    hits = VariantHits()
    hits.record(parts)
    meals = next(p.piece for p in parts if p.piece is not None and p.piece.name == "meals")
    assert hits.to_dict()[meals.key] == {"used": 1, "exact": 1} and hits.rate(meals.key) == 1.0


def test_variants_are_grouped_with_their_bytes_and_capped(folder, tokenizer):
    keys = [folder.add(MEALS, name="meals", after=folder.after_skill(pred, header=HEADER)).key
            for pred in ("refunds", "baggage", "header")]
    groups = {g.name: g for g in folder.variants()}
    meals = groups["meals"]
    assert [v.piece.key for v in meals.variants] == keys  # the header-anchored one was dropped
    assert meals.bytes == sum(v.bytes for v in meals.variants) > 0
    assert len(groups["refunds"].variants) == 1
    assert groups == {g.name: g for g in skill_variants(folder.folder,
                                                         folder.manifest.fingerprint_obj)}
    with pytest.raises(UnknownNameError):
        folder.after_skill("nope")


def test_cli_adds_a_variant_after_a_named_skill(tiny_folder, tmp_path):
    runner = CliRunner()
    files = {}
    for name, text in (("header", HEADER), ("refunds", REFUNDS), ("baggage", BAGGAGE)):
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text(text)
    skills = tmp_path / "skills"
    base = ["skills", "add", "--model", str(tiny_folder), "--skills", str(skills)]
    for args in ([str(files["refunds"]), str(files["baggage"]), "--header", str(files["header"])],
                 [str(files["baggage"]), "--header", str(files["header"]), "--after", "refunds"]):
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 0, result.output
    assert "after refunds" in result.output
    listed = runner.invoke(app, ["skills", "list", "--model", str(tiny_folder), "--skills",
                                 str(skills)])
    assert listed.exit_code == 0, listed.output
    line = next(s for s in listed.output.splitlines() if s.startswith("baggage"))
    assert "2 variant(s)" in line and "bytes" in line
    bad = runner.invoke(app, [*base, str(files["baggage"]), "--after", "nope"])
    assert bad.exit_code != 0 and "nope" in bad.output


def test_phases_skip_only_a_variant_behind_its_whole_prefix():
    head, a, b = (1, 2, 3), tuple(range(10, 47)), tuple(range(50, 90))
    at_a, at_b = len(head), len(head) + len(a)

    def spans(b_behind):
        return [PartSpan(0, at_a, 0, "h", head, ()),
                PartSpan(at_a, at_b, at_a, "a", a, head),
                PartSpan(at_b, at_b + len(b), at_b, "b", b, b_behind),
                PartSpan(at_b + len(b), at_b + len(b) + 2, None, "", (7, 7))]

    exact = plan_phases(spans((*head, *a)), Repair(first=32), 16)
    assert exact.regions == () and exact.spliced_tokens == at_b + len(b)
    # the same origin behind another predecessor of the same length: repaired as usual
    other = plan_phases(spans((*head, *range(100, 137))), Repair(first=32), 16)
    assert other.regions == ((at_b, repaired_end(at_b, at_b + len(b), 32, 16)),)
    # an entry that records no prefix keeps the trusted chain from token 0
    assert plan_phases(spans(()), Repair(first=32), 16).regions == ()


@pytest.mark.real
def test_cli_variant_on_smollm2_costs_as_much_as_its_skill(smollm2, tmp_path, monkeypatch):
    import kvnotes

    monkeypatch.setattr(kvnotes, "load", lambda *a, **k: smollm2)  # the session's copy
    runner = CliRunner()
    for name, text in (("header", HEADER), ("refunds", REFUNDS), ("baggage", BAGGAGE)):
        (tmp_path / f"{name}.txt").write_text(text)
    base = ["skills", "add", "--model", "smollm2-135m", "--skills", str(tmp_path / "skills"),
            "--header", str(tmp_path / "header.txt")]
    for args in ([str(tmp_path / "refunds.txt"), str(tmp_path / "baggage.txt")],
                 [str(tmp_path / "baggage.txt"), "--after", "refunds"]):
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 0, result.output
    groups = {g.name: g for g in ServingSkills(tmp_path / "skills", smollm2).variants()}
    anchored, variant = groups["baggage"].variants
    n_header, n_refunds = len(smollm2.encode(HEADER)), len(smollm2.encode(REFUNDS))
    assert (len(anchored.piece.behind), len(variant.piece.behind)) == (
        n_header, n_header + n_refunds)
    # the prefix is not stored, only its ids in the header
    assert 0 < variant.bytes - anchored.bytes < 16 * n_refunds
