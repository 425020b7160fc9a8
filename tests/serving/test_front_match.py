"""The front's skill matching without a server: texts found in a prompt, per-part token ids,
entries read from a serving folder, and the Gemma "\\n" + "\\n" merge per-part ids avoid."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import make_tiny_engine
from transformers import AutoTokenizer

from kvnotes.core.document import encode
from kvnotes.core.errors import NotebookFileError, NotebookMismatchError
from kvnotes.core.models import BUNDLED, kvnotes_home
from kvnotes.serving.library.manifest import entry_paths
from kvnotes.serving.library.piece_store import index_entry
from kvnotes.serving.library.splice import PieceIndex, PieceInfo
from kvnotes.serving.planning.front_plan import split_ids, strip_bos_text
from kvnotes.serving.planning.layout import part_ids, prompt_ids
from kvnotes.serving.planning.match import (
    Skill,
    SkillCatalog,
    find_skills,
    lay_out,
    skill_texts,
)
from kvnotes.serving.planning.phases import part_spans, sent_spans
from kvnotes.serving.skills import ServingSkills

HEADER = "You are the support agent of Fjord Air. Answer in one short sentence.\n"
REFUNDS = ("\nREFUNDS: a ticket is refunded in full when it is cancelled within 24 hours of "
           "booking; after that, only taxes are refunded, and a voucher covers the fare.")
BAGGAGE = ("\nBAGGAGE: one cabin bag of 8 kg is free; a checked bag costs 30 euros, and a "
           "torn bag is repaired or paid for when it is reported within 7 days.")


def _skill(tokenizer, text: str, name: str, origin: int = 0) -> Skill:
    ids = tuple(encode(tokenizer, text))
    return Skill(text, ids, (PieceInfo(name, name, ids, origin),))


def test_find_skills_splits_at_each_registered_text(tokenizer):
    skills = sorted([_skill(tokenizer, t, n) for t, n in
                     ((HEADER, "header"), (REFUNDS, "refunds"), (BAGGAGE, "baggage"))],
                    key=lambda s: -len(s.text))
    text = HEADER + BAGGAGE + "\n\nCustomer: hi" + REFUNDS + "\nAgent:"
    parts = find_skills(text, skills)
    assert "".join(p.text for p in parts) == text
    assert [p.skill.name if p.skill else p.text for p in parts] == [
        "header", "baggage", "\n\nCustomer: hi", "refunds", "\nAgent:"]


def test_find_skills_prefers_leftmost_then_longest():
    short = Skill("AB", (1,), (PieceInfo("s", "short", (1,), 0),))
    long = Skill("ABCD", (2,), (PieceInfo("l", "long", (2,), 0),))
    mid = Skill("BCDE", (3,), (PieceInfo("m", "mid", (3,), 0),))
    parts = find_skills("xABCDEy", [mid, long, short])
    assert [(p.text, p.skill.name if p.skill else None) for p in parts] == [
        ("x", None), ("ABCD", "long"), ("Ey", None)]
    assert [p.text for p in find_skills("nothing here", [long])] == ["nothing here"]


def test_part_ids_are_compose_layout(tokenizer):
    texts = [HEADER, REFUNDS, "\n\nCustomer: hi\nAgent:"]
    parts = part_ids(tokenizer, texts)
    assert [t for p in parts for t in p] == prompt_ids(tokenizer, texts)
    assert parts[1] == encode(tokenizer, REFUNDS)  # each part alone


def test_lay_out_carries_the_pieces_part_spans_would_find(tokenizer):
    n = len(encode(tokenizer, HEADER))
    pieces = [PieceInfo("h", "header", tuple(encode(tokenizer, HEADER)), 0),
              PieceInfo("r0", "refunds", tuple(encode(tokenizer, REFUNDS)), 0),
              PieceInfo("rn", "refunds", tuple(encode(tokenizer, REFUNDS)), n)]
    idx = PieceIndex()
    for p in pieces:
        idx.add(p)
    skills, _ = skill_texts(tokenizer, pieces)
    for text in (HEADER + REFUNDS + "\nAgent:", "Hi" + REFUNDS + HEADER + REFUNDS):
        sent = lay_out(tokenizer, find_skills(text, skills), (), idx)
        assert sent_spans(sent) == part_spans([list(p.token_ids) for p in sent], idx)
    sent = lay_out(tokenizer, find_skills(HEADER + REFUNDS, skills), (), idx)
    assert [p.piece.key for p in sent] == ["h", "rn"]  # the one compiled behind the header
    idx.remove("rn")  # no longer registered: the other anchoring, then none
    assert [p.piece.key for p in lay_out(tokenizer, find_skills(HEADER + REFUNDS, skills),
                                         (), idx)] == ["h", "r0"]
    idx.remove("r0")
    sent = lay_out(tokenizer, find_skills(HEADER + REFUNDS, skills), (), idx)
    assert sent[1].piece is None and sent_spans(sent)[1].origin is None


def test_split_ids_finds_pieces_anywhere(tokenizer):
    idx = PieceIndex()
    for name, text in (("refunds", REFUNDS), ("baggage", BAGGAGE)):
        idx.add(PieceInfo(name, name, tuple(encode(tokenizer, text)), 0))
    user = encode(tokenizer, "Customer: hi")
    ids = user + encode(tokenizer, BAGGAGE) + user + encode(tokenizer, REFUNDS)
    parts = split_ids(ids, idx)
    assert parts == [user, encode(tokenizer, BAGGAGE), user, encode(tokenizer, REFUNDS)]


# ---- the serving folder ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    lib = ServingSkills(tmp_path_factory.mktemp("front-skills"), engine)
    lib.add(HEADER, name="header")
    lib.add(REFUNDS, name="refunds", after=HEADER)
    lib.add(REFUNDS, name="refunds")
    return lib


def test_the_schedulers_reader_matches_the_published_entry(published, tokenizer):
    entries = {info.key: info for info in published.entries()}
    for path in entry_paths(published.folder):
        light, _ = index_entry(path, published.manifest.fingerprint_obj)  # header and ids only
        assert light == entries[path.stem]
    anchored = [p for p in entries.values() if p.name == "refunds" and p.origin > 0]
    assert anchored and anchored[0].origin == len(encode(tokenizer, HEADER))


def test_the_schedulers_reader_refuses_other_files(published, tmp_path):
    path = entry_paths(published.folder)[0]
    other = replace(published.manifest.fingerprint_obj, tokenizer_sha="0" * 16)
    with pytest.raises(NotebookMismatchError):
        index_entry(path, other)
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x01\x00")
    with pytest.raises(NotebookFileError):
        index_entry(bad, published.manifest.fingerprint_obj)


def test_catalog_groups_anchorings_and_follows_the_folder(published, tokenizer):
    catalog = SkillCatalog(published.folder, tokenizer, rescan_s=0.0)
    by_name = {s.name: s for s in catalog.skills()}
    assert set(by_name) == {"header", "refunds"}
    assert len(by_name["refunds"].pieces) == 2  # one entry per anchoring, one text
    assert by_name["refunds"].text == REFUNDS
    published.add(BAGGAGE, name="baggage")
    assert "baggage" in {s.name for s in catalog.skills()}  # registered while running
    parts = catalog.find(HEADER + REFUNDS + "\nAgent:")
    assert [p.skill.name if p.skill else None for p in parts] == ["header", "refunds", None]
    # the index places the anchored entry right after the header (its own origin)
    ids = [t for p in part_ids(tokenizer, [p.text for p in parts]) for t in p]
    n = len(encode(tokenizer, HEADER))
    assert catalog.index().match_at(ids, n).origin == n
    before = len(catalog.pieces())
    baggage = next(p for p in catalog.pieces() if p.name == "baggage")
    (published.folder / f"{baggage.key}.safetensors").unlink()
    assert len(catalog.pieces()) == before - 1  # a removal is followed too
    assert "baggage" not in {s.name for s in catalog.skills()}


def test_skill_texts_leaves_out_what_cannot_round_trip(tokenizer):
    ok = PieceInfo("a", "ok", tuple(encode(tokenizer, REFUNDS)), 0)
    # two tokens whose decoded text encodes to other tokens
    merged = encode(tokenizer, "ab")
    split = tuple(encode(tokenizer, "a") + encode(tokenizer, "b"))
    assert list(split) != merged
    odd = PieceInfo("b", "odd", split, 0)
    skills, left_out = skill_texts(tokenizer, [ok, odd])
    assert [s.name for s in skills] == ["ok"] and left_out == ["odd"]


# ---- Gemma: a header ending in "\n" and a skill opening with "\n" -------------------------------
@pytest.fixture(scope="module")
def gemma_tokenizer():
    converted = kvnotes_home() / "models" / "gemma3-270m"
    if (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    try:
        gguf = BUNDLED["gemma3-270m"].locate_gguf()
    except Exception as err:  # noqa: BLE001 -- the model package is not installed here
        pytest.skip(f"Gemma's tokenizer is not available: {err}")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_gemma_newlines_across_a_boundary_stay_per_part(gemma_tokenizer):
    tok = gemma_tokenizer
    whole = encode(tok, HEADER + REFUNDS)
    apart = encode(tok, HEADER) + encode(tok, REFUNDS)
    assert whole != apart  # the whole text merges the two "\n" into one token
    assert len(whole) == len(apart) - 1
    pieces = [PieceInfo("h", "header", tuple(encode(tok, HEADER)), 1),
              PieceInfo("r", "refunds", tuple(encode(tok, REFUNDS)), 1),
              PieceInfo("b", "bos", (tok.bos_token_id,), 0)]
    skills, left_out = skill_texts(tok, pieces)
    assert left_out == ["bos"]  # placed by the BOS rule, not by its text
    text = HEADER + REFUNDS + "\nAgent:"
    parts = part_ids(tok, [p.text for p in find_skills(text, skills)])
    assert parts[0] == [tok.bos_token_id]
    assert parts[1] == encode(tok, HEADER) and parts[2] == encode(tok, REFUNDS)
    assert [t for p in parts for t in p] == prompt_ids(tok, [HEADER, REFUNDS, "\nAgent:"])
    idx = PieceIndex()
    for p in pieces:
        idx.add(p)
    sent = lay_out(tok, find_skills(text, skills), [pieces[2]], idx)
    assert [p.piece.name if p.piece else None for p in sent] == ["bos", "header", "refunds", None]
    assert sent_spans(sent) == part_spans(parts, idx)
    # a chat template's leading BOS text is the layout's BOS part, not text
    assert strip_bos_text(tok, tok.bos_token + text) == text
