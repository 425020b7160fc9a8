"""The prefix index (many keys found at a cost independent of their number) against the plain
scans it replaced: the same matches, the same tie-breaking, on random catalogs built to share
prefixes and overlap."""

from __future__ import annotations

import random

import pytest

from kvnotes.serving.library.prefix_index import PrefixIndex, codes, head_hash, window_hashes
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, leading_run, preferred
from kvnotes.serving.planning.front_plan import split_pieces
from kvnotes.serving.planning.match import Part, Skill, find_skills, skill_index
from kvnotes.serving.planning.spans import sweep


def scan_find(text: str, skills: list[Skill]) -> list[Part]:
    """The matcher find_skills replaced: text.find per skill, sorted, one sweep."""
    found = []
    for skill in skills:
        at = text.find(skill.text)
        while at >= 0:
            found.append((at, -len(skill.text), skill))
            at = text.find(skill.text, at + 1)
    found.sort(key=lambda f: (f[0], f[1]))
    spans = [(a, a - n, s) for a, n, s in found]
    return [Part(text[a:b], s) for a, b, s in sweep(len(text), spans)] or [Part(text)]


def scan_match_at(tokens: tuple[int, ...], pos: int, pieces: list[PieceInfo]):
    """The longest piece at ``pos`` by a scan of every piece; variants by ``preferred``."""
    fits = [p for p in pieces if tokens[pos:pos + len(p)] == p.token_ids]
    if not fits:
        return None
    n = max(len(p) for p in fits)
    return preferred([p for p in fits if len(p) == n], pos, tokens)


def random_skills(rng: random.Random, n: int) -> list[Skill]:
    stems = ["", "You are ", '{"type": "function", "function": {"name": "', "ab"]
    texts = set()
    while len(texts) < n:
        body = "".join(rng.choice("abc xyz\n") for _ in range(rng.randint(1, 40)))
        texts.add(rng.choice(stems) + body)
    return [Skill(t, (i,), (PieceInfo(f"k{i}", f"s{i}", (i,), 0),))
            for i, t in enumerate(sorted(texts))]


@pytest.mark.parametrize("seed", range(6))
def test_find_skills_matches_the_scan_it_replaced(seed):
    rng = random.Random(seed)
    skills = random_skills(rng, 60)
    chosen = [s.text for s in rng.sample(skills, 12)]
    text = "".join(rng.choice(chosen) + "".join(rng.choice("abc xyz\n")
                                                for _ in range(rng.randint(0, 6)))
                   for _ in range(30))
    assert find_skills(text, skill_index(skills)) == scan_find(text, skills)
    assert find_skills(text, skills) == scan_find(text, skills)


def test_find_skills_of_no_text_and_no_skill():
    assert find_skills("", []) == [Part("")]
    assert find_skills("plain", []) == [Part("plain")]


@pytest.mark.parametrize("seed", range(6))
def test_piece_index_matches_the_scan_it_replaced(seed):
    rng = random.Random(seed)
    shared = tuple(range(100, 112))  # longer than a block: a tool chunk's JSON opening
    pieces = []
    for i in range(80):
        head = shared if i % 2 else ()
        ids = head + tuple(rng.randint(0, 5) for _ in range(rng.randint(1, 20)))
        behind = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 3)))
        pieces.append(PieceInfo(f"p{i}", f"s{i}", ids, rng.randint(0, 9), behind=behind))
    pieces += [PieceInfo(f"v{i}", "variant", p.token_ids, i, behind=(i,))  # variants
               for i, p in enumerate(pieces[:10])]
    idx = PieceIndex()
    for p in pieces:
        idx.add(p)
    removed = rng.sample(pieces, 15)
    for p in removed:
        idx.remove(p.key)
    kept = [p for p in pieces if p not in removed]
    tokens = tuple(t for _ in range(40) for t in (rng.choice(kept).token_ids
                                                  + (rng.randint(0, 5),)))
    starts = set(idx.starts(tokens))
    for pos in range(len(tokens)):
        want = scan_match_at(tokens, pos, kept)
        assert idx.match_at(tokens, pos) == want
        assert want is None or pos in starts
    for a, b in [(0, 5), (3, 30), (10, 11)]:
        same = [p for p in kept if p.token_ids == tokens[a:b]]
        assert idx.match_exact(list(tokens), a, b) == preferred(same, a, tokens)
    parts = split_pieces(list(tokens), idx)
    assert [t for p in parts for t in p.token_ids] == list(tokens)
    assert leading_run(list(tokens), idx)[0].piece == scan_match_at(tokens, 0, kept)


def test_every_piece_removed_leaves_an_empty_trie():
    idx = PieceIndex()
    pieces = [PieceInfo(f"p{i}", "s", tuple(range(i, i + 3 * i + 1)), 0) for i in range(20)]
    for p in pieces:
        idx.add(p)
    for p in pieces:
        idx.remove(p.key)
    assert len(idx) == 0 and not idx._groups._children and not idx._groups._tails
    assert idx.starts(list(range(100))) == []


def test_window_hashes_are_the_heads_hashes():
    text = "héllo wörld"
    for n, hashes in window_hashes(codes(text), [1, 3, 5, 7, 8, 11, 12]):
        assert hashes.tolist() == [head_hash(text[i:i + n]) for i in range(len(text) - n + 1)]
    ids = (5, 2**31, 7, 0)
    for _, hashes in window_hashes(codes(ids), [2]):
        assert hashes.tolist() == [head_hash(ids[i:i + 2]) for i in range(3)]


def test_a_key_shorter_than_a_block_and_one_sharing_many_blocks():
    idx: PrefixIndex[str] = PrefixIndex(block=4)
    for key in ("ab", "abcdabcdab", "abcdabcdabcdX", "abcdabcd"):
        idx.add(key, key)
    text = "zabcdabcdabcdY abcdabcdabcdX"
    hits = [(at, idx.longest_at(text, at)) for at in idx.starts(text)]
    assert [(at, h[0]) for at, h in hits if h] == [
        (1, "abcdabcdab"), (5, "abcdabcd"), (9, "ab"), (15, "abcdabcdabcdX"),
        (19, "abcdabcd"), (23, "ab")]
    with pytest.raises(ValueError):
        idx.add("", "empty")


@pytest.mark.parametrize("seed", range(4))
def test_longest_at_through_one_key_nodes_after_removals(seed):
    """Long keys diverge early, so most of the walk is through nodes one key runs through
    (compared whole); removals leave nodes whose maker is gone (walked): every position
    against a scan."""
    rng = random.Random(seed)
    keys = {rng.choice(["", "abcd", "abcdabcd"]) + "".join(rng.choice("ab")
                                                           for _ in range(rng.randint(1, 30)))
            for _ in range(120)}
    idx: PrefixIndex[str] = PrefixIndex(block=4)
    for key in sorted(keys):
        idx.add(key, key)
    for key in rng.sample(sorted(keys), 40):
        idx.remove(key)
        keys.discard(key)
    for key in rng.sample(sorted(keys), 10):  # re-added under a node another key made
        idx.remove(key)
        idx.add(key, key)
    text = "".join(rng.choice(sorted(keys)) + rng.choice(["", "a", "b"]) for _ in range(60))
    for pos in range(len(text)):
        fits = [k for k in keys if text.startswith(k, pos)]
        want = max(fits, key=len) if fits else None
        hit = idx.longest_at(text, pos)
        assert (hit and hit[0]) == want, pos
