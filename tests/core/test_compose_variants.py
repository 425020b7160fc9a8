"""The variant rule (one for the engine and the server), and compose with a variants library."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine
from hypothesis import given
from hypothesis import strategies as st

from kvnotes.core.variants import exactly_placed, shared_suffix, variant_rank
from kvnotes.ops.store import SkillLibrary

HEADER = "System: you are the support agent of a small shop.\n\n"
FIRST = "Refunds are issued within five days. Final-sale items cannot be returned."
SECOND = "Shipping takes three days. Express shipping costs extra."
THIRD = "Gift cards never expire and cannot be exchanged for cash."


def _naive_suffix(behind, ids, pos):
    n = 0
    while n < min(len(behind), pos) and behind[-1 - n] == ids[pos - 1 - n]:
        n += 1
    return n


@given(st.lists(st.integers(0, 2), max_size=12), st.lists(st.integers(0, 2), max_size=12),
       st.integers(0, 14))
def test_shared_suffix_equals_a_token_by_token_count(behind, ids, pos):
    pos = min(pos, len(ids))
    assert shared_suffix(behind, ids, pos) == _naive_suffix(behind, ids, pos)


def test_rank_prefers_the_predecessor_then_the_origin_then_the_latest():
    ids = [1, 5, 6, 7, 8, 9, 9]  # BOS, header (5, 6), skill A (7, 8), then skill B at 5
    header_anchored = ((1, 5, 6), 3)
    behind_a = ((1, 5, 6, 7, 8), 5)  # exactly placed: its whole prefix is ids[:5]
    behind_c = ((1, 5, 6, 3, 3), 5)  # another predecessor, same origin
    ranks = {name: variant_rank(b, o, ids, 5) for name, (b, o) in
             {"h": header_anchored, "a": behind_a, "c": behind_c}.items()}
    assert max(ranks, key=ranks.__getitem__) == "a"
    assert ranks["c"] > ranks["h"] or ranks["c"][0] == ranks["h"][0]  # no shared suffix: ties
    assert exactly_placed(*behind_a, ids, 5) and not exactly_placed(*header_anchored, ids, 5)
    # nothing shared: the one prefilled at the position wins, then the latest
    assert variant_rank((), 5, ids, 5) > variant_rank((), 40, ids, 5)
    assert variant_rank((), 40, ids, 7) > variant_rank((), 3, ids, 7)
    assert not exactly_placed((), 0, [], 0)  # a prefix not recorded is never exact


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer)


def _library(tiny, tmp_path):
    lib = SkillLibrary(tmp_path, tiny)
    head = tiny.anchor_ids(HEADER)
    skills = [lib.get(t, name=n, after=HEADER) for n, t in
              (("first", FIRST), ("second", SECOND), ("third", THIRD))]
    # variants: each skill behind the header and its predecessor
    lib.get(SECOND, name="second", after=[*head, *tiny.encode(FIRST)])
    lib.get(THIRD, name="third", after=[*head, *tiny.encode(SECOND)])
    return lib, skills


def test_compose_with_a_library_splices_the_predecessor_variant(tiny, tmp_path):
    lib, skills = _library(tiny, tmp_path)
    parts = [HEADER, *skills, " Answer:"]
    plain = tiny.compose(parts, repair=0)
    varied = tiny.compose(parts, repair=0, library=lib)
    # the second skill's variant sits behind its whole prefix: exactly placed, a prefill's notes
    assert varied.meta["compose"]["variants"] == [2, 3] and lib.variant_hits == 2
    assert varied.meta["compose"]["exact"] == [1, 2] and plain.meta["compose"]["exact"] == [1]
    full = tiny.prefill(varied.token_ids)
    end = len(tiny.anchor_ids(HEADER)) + len(skills[0]) + len(skills[1])
    for l in range(full.num_layers):
        assert torch.allclose(varied.keys(l)[..., :end, :], full.keys(l)[..., :end, :], atol=1e-5)
    # the third skill's variant saw its predecessor alone: spliced, then repaired as usual
    repaired = tiny.compose(parts, library=lib)
    assert repaired.meta["compose"]["exact"] == [1, 2]
    assert repaired.meta["compose"]["regions"][0][0] == end
    # the switch turns it off
    off = tiny.compose(parts, repair=0, library=lib, variants=False)
    assert off.meta["compose"]["variants"] == [] and off.meta["compose"]["exact"] == [1]


def test_compose_keeps_a_skill_no_variant_outranks(tiny, tmp_path):
    lib, skills = _library(tiny, tmp_path)
    # the third skill right after the header: its header-anchored entry is exact, kept
    nb = tiny.compose([HEADER, skills[2], " Q"], repair=0, library=lib)
    assert nb.meta["compose"]["variants"] == [] and nb.meta["compose"]["exact"] == [1]


def test_an_int8_library_swaps_in_its_variants_too(tiny, tmp_path):
    lib = SkillLibrary(tmp_path, tiny, quantize="token")
    head = tiny.anchor_ids(HEADER)
    first = lib.get(FIRST, name="first", after=HEADER)
    second = lib.get(SECOND, name="second", after=HEADER)
    lib.get(SECOND, name="second", after=[*head, *tiny.encode(FIRST)])
    nb = tiny.compose([HEADER, first, second, " Q"], repair=0, library=lib)
    assert nb.meta["compose"]["variants"] == [2] and nb.span("second") is not None
    plain = SkillLibrary(tmp_path / "plain", tiny)  # another folder: nothing to swap
    assert tiny.compose([HEADER, first, second], library=plain).meta["compose"]["variants"] == []
