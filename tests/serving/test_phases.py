"""Phased prefill plans without a server: the repair rule, block alignment, salts, the request
bodies, the guard, and that the connector's rule reaches every range the plan sends."""

from __future__ import annotations

import pytest
from conftest import make_tiny_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import NO_REPAIR, Repair, repaired_end
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.library.splice import (
    PieceIndex,
    PieceInfo,
    SpliceRange,
    check_ranges,
    range_run,
)
from kvnotes.serving.planning.phases import (
    PartSpan,
    completion_body,
    guard_fires,
    margin,
    part_spans,
    plan_phases,
    server_repair,
)
from kvnotes.serving.protocol import SpliceRequest


def ranges_of(body: dict) -> list[list[int]]:
    """The splice ranges a request body asks for, read as the connector reads them."""
    req = SpliceRequest.from_params(body["kv_transfer_params"])
    assert req is not None
    return [r.to_list() for r in req.ranges]

def skills_layout(header: int = 40, skills: tuple[int, ...] = (100, 100), user: int = 20
                  ) -> list[PartSpan]:
    """[header at 0][skills compiled behind the header][user text]."""
    spans, pos = [PartSpan(0, header, 0, "header")], header
    for i, n in enumerate(skills):
        spans.append(PartSpan(pos, pos + n, header, f"s{i}"))
        pos += n
    return [*spans, PartSpan(pos, pos + user)]


# ---- the repair rule ----------------------------------------------------------------------------
def test_the_exact_chain_is_spliced_whole_and_later_skills_are_repaired_to_a_block():
    plan = plan_phases(skills_layout(), Repair(first=32), 16)
    # header at its origin, the first skill at its origin right behind it: not repaired
    assert [r.to_list() for r in plan.ranges] == [[0, 0, 40], [40, 40, 140], [140, 176, 240]]
    assert plan.regions == ((140, 176),) and plan.repaired_tokens == 36
    assert plan.phase_ends == (176,)  # the third range starts after a recomputed region
    assert plan.spliced_tokens == 40 + 100 + 64 and plan.prompt_len == 260


def test_regions_end_where_repaired_end_says_with_the_block_size():
    spans = skills_layout(header=33, skills=(90, 70, 200))
    for block in (16, 32, 64, 128):
        plan = plan_phases(spans, Repair(first=32), block)
        repaired = [s for s in spans[2:-1]]  # the first skill is in the exact chain
        ends = [repaired_end(s.start, s.end, 32, block) for s in repaired]
        assert [b for _, b in plan.regions] == [e for e in _merged(repaired, ends)]
        assert all(r.start % block == 0 for r in plan.ranges if r.offset)


def _merged(spans: list[PartSpan], ends: list[int]) -> list[int]:
    """Region ends after adjacent regions merge (a skill recomputed to its end touches the
    next skill's region)."""
    out: list[int] = []
    for s, e in zip(spans, ends, strict=True):
        if out and out[-1] == s.start:
            out[-1] = e
        else:
            out.append(e)
    return out


def test_a_skill_shorter_than_its_region_is_computed_whole_and_its_region_merges():
    # the middle skill (10 tokens) is recomputed whole; its region joins the next one's
    spans = skills_layout(header=40, skills=(50, 10, 100))
    plan = plan_phases(spans, Repair(first=32), 16)
    assert plan.regions == ((90, 144),)  # [90, 100) whole, then [100, 144): 144 = 9 blocks
    assert [r.to_list() for r in plan.ranges] == [[0, 0, 40], [40, 40, 90], [100, 144, 200]]
    assert plan.phase_ends == (144,)


def test_skip_exact_false_repairs_the_header_too():
    plan = plan_phases(skills_layout(), Repair(first=32, skip_exact=False), 16)
    assert plan.regions[0] == (0, 32) and plan.ranges[0].to_list() == [0, 32, 40]
    assert plan.phase_ends[0] == 32


def test_a_skill_after_text_is_repaired_and_with_no_repair_it_is_computed():
    spans = [PartSpan(0, 30), PartSpan(30, 130, 0, "s")]
    plan = plan_phases(spans, Repair(first=32), 16)
    assert plan.regions == ((30, 64),) and plan.phase_ends == (64,)
    # nothing recomputed: the range starts at 30, off a block, so no local hit can reach it
    bare = plan_phases(spans, NO_REPAIR, 16)
    assert bare.ranges == () and bare.phase_ends == () and bare.regions == ()


def test_a_piece_away_from_its_origin_breaks_the_chain():
    # header compiled at 0 but placed after one token of text: everything after is repaired
    spans = [PartSpan(0, 1), PartSpan(1, 41, 0), PartSpan(41, 141, 41)]
    plan = plan_phases(spans, Repair(first=16), 16)
    assert plan.regions == ((1, 32), (41, 64))
    assert [r.to_list() for r in plan.ranges] == [[1, 32, 41], [41, 64, 141]]
    assert plan.phase_ends == (32, 64)


def test_server_repair_aligns_to_the_block_and_refuses_what_a_server_cannot_do():
    assert server_repair(Repair(first=32), 128).align == 128
    assert server_repair(Repair(first=32, align=256), 128).align == 256
    with pytest.raises(InvalidArgumentError, match="multiple of the server's block size"):
        server_repair(Repair(first=32, align=48), 32)
    with pytest.raises(InvalidArgumentError, match="shared budget"):
        server_repair(Repair(first=0, budget=0.1), 16)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        server_repair(Repair(), 0)


def test_spans_must_tile_the_prompt():
    with pytest.raises(InvalidArgumentError, match="tile the prompt"):
        plan_phases([PartSpan(0, 10), PartSpan(12, 20)], Repair(), 16)
    with pytest.raises(InvalidArgumentError, match="tile the prompt"):
        plan_phases([PartSpan(0, 0)], Repair(), 16)


# ---- salts ----------------------------------------------------------------------------------------
def test_the_salt_names_the_tenant_and_the_aligned_repair():
    plan = plan_phases(skills_layout(), Repair(first=32), 128, tenant="acme")
    assert plan.salt == "kvnotes-splice:acme+f32a128"
    assert plan.salt == splice_salt("acme", tag="f32a128")
    # the connector composes the salt from the splice request's fields and compares
    message = plan.splice_request()
    assert (message.tenant, message.tag) == ("acme", "f32a128")
    assert splice_salt(message.tenant, message.tag) == plan.salt
    other = plan_phases(skills_layout(), Repair(first=16), 128, tenant="acme")
    assert other.salt != plan.salt  # blocks of one plan never serve another
    # vLLM refuses '@', '/', '\\' and NUL in a cache_salt, and salts over 128 characters
    assert not set(plan.salt) & set("@/\\\x00") and len(plan.salt) <= 128


# ---- bodies ---------------------------------------------------------------------------------------
def test_phase_bodies_cut_the_prompt_and_carry_only_the_ranges_before_the_cut():
    spans = skills_layout(skills=(100, 100, 100))
    plan = plan_phases(spans, Repair(first=32), 16)
    ids = list(range(1000, 1000 + plan.prompt_len))
    bodies = plan.phase_bodies(ids, "m")
    assert list(plan.phase_ends) == [176, 272]
    for body, end in zip(bodies, plan.phase_ends, strict=True):
        # one token past the region: a repeat's local hit (one token short) covers it whole
        assert body["prompt"] == ids[:end + 1] and body["max_tokens"] == 1
        assert body["temperature"] == 0.0 and body["cache_salt"] == plan.salt
        ranges = ranges_of(body)
        assert ranges and all(e <= end for _, _, e in ranges)
    assert ranges_of(bodies[0]) == [[0, 0, 40], [40, 40, 140]]
    real = plan.real_body(ids, "m", max_tokens=8)
    assert real["prompt"] == ids and real["max_tokens"] == 8 and "logprobs" not in real
    assert ranges_of(real) == [r.to_list() for r in plan.ranges]
    guarded = plan.real_body(ids, "m", guard=0.5, stream=True)
    assert guarded["logprobs"] == 2 and guarded["stream"] is True
    assert guarded["stream_options"] == {"include_usage": True}
    assert plan.real_body(ids, "m", guard=0.5, logprobs=5)["logprobs"] == 5
    with pytest.raises(InvalidArgumentError, match="prompt of 360 tokens"):
        plan.real_body(ids[:-1], "m")
    with pytest.raises(InvalidArgumentError, match="inside the splice range"):
        plan.ranges_before(100)


def test_the_exact_body_has_no_salt_and_no_ranges():
    body = completion_body([1, 2, 3], "m", max_tokens=4, logprobs=2)
    assert body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0,
                    "logprobs": 2}
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        completion_body([1], "m", max_tokens=0)


def test_part_spans_find_the_registered_pieces_and_their_origins():
    idx = PieceIndex()
    idx.add(PieceInfo("b", "bos", (1,), 0))
    idx.add(PieceInfo("h", "header", tuple(range(10, 20)), 1))
    idx.add(PieceInfo("s", "skill", tuple(range(30, 50)), 11))
    idx.add(PieceInfo("s0", "skill", tuple(range(30, 50)), 1))  # the same skill compiled alone
    parts = [[1], list(range(10, 20)), list(range(30, 50)), [7, 8], list(range(30, 50))]
    spans = part_spans(parts, idx)
    assert [(s.start, s.end, s.origin, s.name) for s in spans] == [
        (0, 1, 0, "bos"), (1, 11, 1, "header"), (11, 31, 11, "skill"), (31, 33, None, ""),
        (33, 53, 11, "skill")]
    # a part that only starts like a piece is text
    assert part_spans([list(range(10, 19))], idx)[0].origin is None


# ---- the guard ------------------------------------------------------------------------------------
def test_the_guard_fires_on_a_close_first_token():
    assert not guard_fires({"Yes": -0.1, "No": -2.5}, 0.5)
    assert guard_fires({"Yes": -0.6, "No": -0.8}, 0.5)
    assert guard_fires({"Yes": -0.1}, 0.5) and guard_fires(None, 0.5)  # margin unknown
    assert not guard_fires({"Yes": -0.6, "No": -0.8}, 0.0)  # tau 0: never
    assert margin({"a": -1.0, "b": -0.25, "c": -3.0}) == pytest.approx(0.75)
    with pytest.raises(InvalidArgumentError, match="margin >= 0"):
        guard_fires({"a": 0.0, "b": -1.0}, -0.1)


# ---- the plan against the connector's rule ------------------------------------------------------
@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[PartSpan], PieceIndex, list[int]]:
    """A prompt of text and pieces (some at their origin), its index and token ids."""
    idx, spans, ids, pos, nxt = PieceIndex(), [], [], 0, 1000
    for kind in draw(st.lists(st.sampled_from(["text", "piece", "exact"]), min_size=1,
                              max_size=6)):
        n = draw(st.integers(1, 150))
        toks = list(range(nxt, nxt + n))
        nxt += n
        if kind == "text":
            spans.append(PartSpan(pos, pos + n))
        else:
            origin = pos if kind == "exact" else draw(st.integers(0, 300))
            idx.add(PieceInfo(f"k{nxt}", f"p{nxt}", tuple(toks), origin))
            spans.append(PartSpan(pos, pos + n, origin))
        ids += toks
        pos += n
    return spans, idx, ids


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 64), st.sampled_from([16, 32, 64, 128]))
def test_every_range_is_reached_by_its_phase_and_validated_by_the_connector(layout, first,
                                                                             block):
    spans, idx, ids = layout
    plan = plan_phases(spans, Repair(first=first), block)
    # recomputed regions and ranges cover the pieces exactly, never the text
    covered = sorted([*plan.regions, *((r.start, r.end) for r in plan.ranges)])
    piece_tokens = sum(len(s) for s in spans if s.is_piece)
    assert sum(b - a for a, b in covered) <= piece_tokens
    assert all(b <= c for (_, b), (c, _) in zip(covered, covered[1:], strict=False))
    checked = check_ranges(ids, idx, [r.to_list() for r in plan.splice_request().ranges])
    assert checked.reason is None and checked.ranges == plan.ranges
    # each phase (and the real request) finds, at the hit the phase before it left, the
    # ranges it was planned for: the hit is block-aligned and inside a range
    hits = [0, *plan.phase_ends]
    bodies = [*plan.phase_bodies(ids, "m"), plan.real_body(ids, "m")]
    supplied: set[int] = set()
    for i, (hit, body) in enumerate(zip(hits, bodies, strict=True)):
        assert hit % block == 0
        prompt = body["prompt"]
        assert hit < len(prompt)  # the hit a phase leaves is reachable: one token to compute
        value = ranges_of(body)
        checked = check_ranges(prompt, idx, value)
        assert checked.reason is None
        run, stop = range_run(checked, hit)
        if i:
            assert run, f"phase {i} finds no range at its hit {hit}"
        supplied |= set(range(hit, stop))
    assert supplied == {t for r in plan.ranges for t in range(r.start, r.end)}


def test_range_json_form_round_trips():
    r = SpliceRange(40, 64, 300)
    assert SpliceRange.from_value(r.to_list()) == r and r.offset == 24 and len(r) == 236


# ---- the server's plan is the engine's: one repair plan, executed twice --------------------------
AGREE_HEADER = "System: you are the support agent of a small shop. Follow the policies below.\n"
AGREE_SKILLS = (
    "Refunds are issued within five days of the return reaching the warehouse.",
    "Shipping takes three days inside the country, ten days abroad; express costs extra.",
    "Gift cards are never refunded in cash.",
)
AGREE_TEXTS = (" Then: ", "\nCustomer: where is my parcel? It has been a week now.\nAgent:", "x")


@pytest.fixture(scope="module")
def agree_pool(tokenizer):
    """A tiny engine and compiled pieces: the header alone, each skill alone (at 0) and behind
    the header. No piece is as long as the header, so a chain of pieces at their origins is
    what each was compiled behind (the server's rule and the engine's digests agree)."""
    engine = make_tiny_engine("llama", tokenizer)
    assert engine.bos_id is None
    header = engine.compile(AGREE_HEADER, name="header")
    pieces = [header]
    for i, text in enumerate(AGREE_SKILLS):
        pieces += [engine.compile(text, name=f"s{i}"),
                   engine.compile(text, name=f"s{i}@h", after=AGREE_HEADER)]
    assert all(len(p) != len(header) for p in pieces[1:])
    return engine, pieces


def _merged_regions(regions):
    out: list[tuple[int, int]] = []
    for a, b in regions:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


@settings(max_examples=40, deadline=None)
@given(choice=st.lists(st.integers(0, len(AGREE_SKILLS) * 2 + len(AGREE_TEXTS)), min_size=1,
                       max_size=5),
       lead=st.booleans(), first=st.sampled_from([0, 1, 5, 16, 32]),
       block=st.sampled_from([1, 4, 16]))
def test_the_phase_plan_recomputes_what_engine_compose_recomputes(agree_pool, choice, lead, first,
                                                                  block):
    engine, pieces = agree_pool
    parts = ([pieces[0]] if lead else []) + [
        pieces[c] if c < len(pieces) else AGREE_TEXTS[c - len(pieces)] for c in choice]
    nb = engine.compose(parts, repair=Repair(first=first, align=block))
    stats = nb.meta["compose"]
    spans, pos = [], 0
    for part in parts:
        n = len(part) if not isinstance(part, str) else len(engine.encode(part))
        origin = None if isinstance(part, str) else part.start_position
        spans.append(PartSpan(pos, pos + n, origin))
        pos += n
    plan = plan_phases(spans, Repair(first=first), block)
    assert plan.regions == _merged_regions(tuple(r) for r in stats["regions"])
    if first:  # a piece spliced whole by the server is an exact placement of the engine's
        whole = [i for i, s in enumerate(spans) if s.is_piece
                 and not any(a <= s.start < b for a, b in plan.regions)]
        assert whole == stats["exact"]


def test_an_exactly_placed_piece_after_text_off_a_block_is_spliced_from_the_next_boundary():
    # a variant compiled behind the very 51 tokens before it (a tool list seen before): its
    # notes are a prefill's, but vLLM takes external tokens only from a block-aligned local hit
    behind = tuple(range(100, 151))
    spans = [PartSpan(0, 51, ids=behind), PartSpan(51, 259, 51, "tool", ids=tuple(range(208)), behind=behind,
                                       key="k1"),
             PartSpan(259, 300)]
    plan = plan_phases(spans, Repair(first=32), 32)
    assert [r.to_list() for r in plan.ranges] == [[51, 64, 259]]
    assert plan.regions == ((51, 64),) and plan.phase_ends == (64,)
    assert plan.keys == ("k1",) and plan.repaired_tokens == 13
