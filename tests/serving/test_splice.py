"""Splicing for a serving engine, without a server: matching, slots, KV assembly, the store.

The vLLM connector is a thin shell over these pieces (tests/serving/test_vllm_server.py runs it
on a real server; tests/serving/test_connector_*.py its contract with fakes); here the
splice itself is checked on tiny random models against kvnotes' own notebooks.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core.errors import UnsupportedModelError
from kvnotes.core.tiny import ByteTokenizer, tiny_model
from kvnotes.serving.library.manifest import ServingManifest, read_entry
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.splice import (
    KEY_TOKENS,
    PieceIndex,
    PieceInfo,
    Placement,
    external_tokens,
    leading_run,
    slot_mapping,
)
from kvnotes.serving.skills import ServingSkills, check_servable
from kvnotes.serving.vllm.kv_writer import KvWriter, WorkerShare
from kvnotes.serving.vllm.plans import LoadSpec


def piece(key: str, ids, origin: int = 0) -> PieceInfo:
    return PieceInfo(key, key, tuple(ids), origin)


def cpu_writer(folder, manifest: ServingManifest) -> KvWriter:
    """A worker's writer for the whole cache (every layer and head) on the CPU, in float32."""
    share = WorkerShare(torch.device("cpu"), torch.float32, range(manifest.num_kv_heads),
                        tuple(range(manifest.num_layers)))
    return KvWriter(folder, manifest, share)


def assembled(writer: KvWriter, run, start: int, end: int):
    """Keys and values ``[layers, end - start, heads, head_dim]`` the writer builds."""
    block_size = 16
    load = LoadSpec("r", None, tuple(run), start, end, tuple(range(-(-end // block_size))),
                    block_size)
    return writer.assemble(load)


# ---- matching ------------------------------------------------------------------------------------
def test_leading_run_any_order_subset_and_repeats():
    idx = PieceIndex()
    a, b, c = piece("a", range(100, 120)), piece("b", range(200, 230)), piece("c", range(300, 305))
    for p in (a, b, c):
        idx.add(p)
    prompt = [*b.token_ids, *a.token_ids, *b.token_ids, *c.token_ids, 7, 8, *a.token_ids]
    run = leading_run(prompt, idx)
    assert [p.piece.key for p in run] == ["b", "a", "b", "c"]
    assert [p.start for p in run] == [0, 30, 50, 80]
    assert run[-1].end == 85  # the run stops at unseen text: the later `a` is not spliced


def test_no_leading_piece_no_external_tokens():
    idx = PieceIndex()
    idx.add(piece("a", range(100, 120)))
    prompt = [1, 2, *range(100, 120), 3]
    assert leading_run(prompt, idx) == []
    assert external_tokens([], len(prompt), 0) == 0


def test_longest_piece_wins_and_short_pieces_match():
    idx = PieceIndex()
    short = piece("short", (5, 6, 7))
    assert len(short) < KEY_TOKENS
    long_ = piece("long", range(100, 140))
    prefix = piece("prefix", range(100, 120))  # a piece that another extends
    for p in (short, prefix, long_):
        idx.add(p)
    run = leading_run([5, 6, 7, *range(100, 140), 9], idx)
    assert [p.piece.key for p in run] == ["short", "long"]
    run = leading_run([*range(100, 120), 9], idx)
    assert [p.piece.key for p in run] == ["prefix"]


def test_a_near_miss_does_not_match():
    idx = PieceIndex()
    idx.add(piece("a", range(100, 120)))
    prompt = [*range(100, 119), 999]  # last token differs
    assert leading_run(prompt, idx) == []


def test_remove_and_re_add():
    idx = PieceIndex()
    idx.add(piece("a", range(10)))
    idx.remove("a")
    assert len(idx) == 0 and leading_run(list(range(10)), idx) == []
    idx.add(piece("a", range(10)))
    assert len(leading_run(list(range(10)), idx)) == 1


def test_matching_cost_does_not_scan_all_pieces():
    # 5000 pieces: a lookup touches one bucket, so a prompt of 64 pieces matches quickly
    idx = PieceIndex()
    pieces = [piece(f"p{i}", range(i * 50, i * 50 + 50)) for i in range(5000)]
    for p in pieces:
        idx.add(p)
    prompt = [t for p in pieces[::78] for t in p.token_ids]
    run = leading_run(prompt, idx)
    assert len(run) == len(pieces[::78]) and run[-1].end == len(prompt)
    # each trie node holds the few pieces ending under it, never a list of all pieces
    assert max(len(t) for t in idx._groups._tails.values()) == 1


def test_external_tokens_leave_one_prompt_token_and_skip_the_local_hit():
    run = [Placement(piece("a", range(100)), 0), Placement(piece("b", range(200, 300)), 100)]
    assert external_tokens(run, 250, 0) == 200
    assert external_tokens(run, 250, 128) == 72  # vLLM's local hit comes first
    assert external_tokens(run, 200, 0) == 199  # whole prompt known: leave the last token
    assert external_tokens(run, 250, 256) == 0


def test_slot_mapping():
    slots = slot_mapping([7, 3, 9], 4, 2, 10)
    assert slots.tolist() == [30, 31, 12, 13, 14, 15, 36, 37]
    with pytest.raises(ValueError, match="need 4 blocks"):
        slot_mapping([7, 3, 9], 4, 0, 13)


# ---- skills and the store on a tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


def test_spliced_layer_equals_notebook_shifted(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    text = "Refunds: unworn items within 30 days get a full refund."
    info = skills.add(text, name="refunds")
    _, keys, values = read_entry(skills.folder / f"{info.key}.safetensors",
                                 engine.fingerprint)
    skill = engine.compile(text, anchor="none")
    start = 37
    moved = skill.shifted(start - int(skill.positions[0]))
    run = [Placement(info, start)]
    writer = cpu_writer(skills.folder, skills.manifest)
    k, v = assembled(writer, run, start, start + len(info))
    torch.testing.assert_close(values, v)  # values never move
    for layer in range(skill.num_layers):
        torch.testing.assert_close(k[layer], moved.keys(layer)[0].transpose(0, 1), atol=1e-5,
                                   rtol=0)
        torch.testing.assert_close(v[layer], moved.values(layer)[0].transpose(0, 1), atol=0,
                                   rtol=0)
    # a window inside the run (vLLM's local hit covers the first tokens)
    k, _ = assembled(writer, run, start + 5, start + 9)
    torch.testing.assert_close(k[0], moved.keys(0)[0, :, 5:9].transpose(0, 1), atol=1e-5,
                               rtol=0)


def test_spliced_prompt_matches_engine_compose(engine, tmp_path):
    """Placing pieces by the leading run reproduces engine.compose's notes token for token."""
    skills = ServingSkills(tmp_path, engine)
    header, a, b = "System: be brief.\n", "Policy A: refunds in 30 days.\n", "Policy B: no fees.\n"
    infos = [skills.add(t, name=n) for t, n in ((header, "h"), (a, "a"), (b, "b"))]
    store = PieceStore(skills.folder)
    user = "Customer: can I get a refund?"
    ids = [t for i in (infos[0], infos[2], infos[1]) for t in i.token_ids] + engine.encode(user)
    run = leading_run(ids, store.index)
    assert [p.piece.name for p in run] == ["h", "b", "a"]
    composed = engine.compose([engine.compile(t, anchor="none") for t in (header, b, a)] + [user],
                              repair=0)  # the bare splice: no token recomputed
    assert composed.token_ids.tolist() == ids
    end = run[-1].end
    k, v = assembled(cpu_writer(skills.folder, store.manifest), run, 0, end)
    for layer in range(composed.num_layers):
        torch.testing.assert_close(k[layer], composed.keys(layer)[0, :, :end].transpose(0, 1),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(v[layer], composed.values(layer)[0, :, :end].transpose(0, 1),
                                   atol=0, rtol=0)


def test_store_picks_up_new_skills_and_skips_damaged_ones(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    skills.add("first skill text", name="one")
    store = PieceStore(skills.folder, rescan_s=0.0)
    assert len(store.index) == 1
    info = skills.add("a second skill, registered while the server runs", name="two")
    os.utime(skills.folder, ns=(0, store._mtime + 1))  # make sure the folder looks changed
    assert store.refresh() == 2 and info.key in store.index
    bad = skills.folder / ("0" * 32 + ".safetensors")
    bad.write_bytes(b"not a safetensors file")
    os.utime(skills.folder, ns=(0, store._mtime + 2))
    assert store.refresh() == 2  # damaged entry: a miss, not an exception
    path = skills.folder / f"{info.key}.safetensors"
    path.unlink()
    os.utime(skills.folder, ns=(0, store._mtime + 3))
    assert store.refresh() == 1 and info.key not in store.index


def test_manifest_round_trip(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    m = ServingManifest.read(skills.folder)
    assert m == skills.manifest and m.num_layers == engine.adapter.num_layers
    torch.testing.assert_close(m.inv_freq(0), engine.adapter.inv_freqs[0])


def test_bos_models_get_a_bos_piece_and_anchored_skills(tmp_path):
    class BosTokenizer(ByteTokenizer):
        bos_token_id = 257

        def __call__(self, text, add_special_tokens=True):
            ids = [b for b in text.encode()]
            return {"input_ids": ([257] if add_special_tokens else []) + ids}

    import kvnotes

    eng = kvnotes.Engine.from_model(tiny_model("llama", 300), BosTokenizer(300))
    assert eng.bos_id == 257
    skills = ServingSkills(tmp_path, eng)
    info = skills.add("hello there", name="greet")
    assert info.origin == 1  # prefilled behind a BOS, which was dropped
    store = PieceStore(skills.folder)
    run = leading_run([257, *info.token_ids, 5], store.index)
    assert [(p.piece.name, p.start, p.delta) for p in run] == [("bos", 0, 0), ("greet", 1, 0)]


def test_unservable_scheme_is_refused():
    import kvnotes

    eng = kvnotes.Engine.from_model(tiny_model("bloom", 300), ByteTokenizer(300))
    with pytest.raises(UnsupportedModelError, match="half-split RoPE"):
        check_servable(eng)


def test_same_tokens_prefer_the_piece_prefilled_at_that_position():
    idx = PieceIndex()
    alone = PieceInfo("alone", "s", tuple(range(100, 120)), 0)
    behind_header = PieceInfo("anchored", "s", tuple(range(100, 120)), 5)
    idx.add(alone)
    idx.add(behind_header)
    header = PieceInfo("h", "h", (1, 2, 3, 4, 5), 0)
    idx.add(header)
    run = leading_run([1, 2, 3, 4, 5, *range(100, 120), *range(100, 120), 9], idx)
    assert [(p.piece.key, p.start, p.delta) for p in run] == [
        ("h", 0, 0), ("anchored", 5, 0), ("anchored", 25, 20)]


def test_skill_compiled_after_the_header(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    header, text = "System: you are a support agent.\n", "Policy: refunds within 30 days."
    h = skills.add(header, name="header")
    plain = skills.add(text, name="policy")
    anchored = skills.add(text, name="policy", after=header)
    assert anchored.key != plain.key and anchored.origin == len(h) and plain.origin == 0
    store = PieceStore(skills.folder)
    ids = [*h.token_ids, *anchored.token_ids, 7]
    run = leading_run(ids, store.index)
    assert [p.piece.key for p in run] == [h.key, anchored.key] and run[1].delta == 0
    # placed right after its header, the anchored skill is exactly the prefill of header+skill
    full = engine.prefill(ids[:-1], bos=False)
    k, _ = assembled(cpu_writer(skills.folder, store.manifest), run, 0, run[-1].end)
    for layer in range(full.num_layers):
        torch.testing.assert_close(k[layer], full.keys(layer)[0].transpose(0, 1), atol=1e-5,
                                   rtol=0)
