"""The connector's worker side without vLLM: what reaches the backend's cache write (device,
dtype, the rank's heads), what a failed load reports, and what the tensor cache keeps.

The attention layers are fakes with vLLM's interface (``impl.do_kv_cache_update(layer, key,
value, kv_cache, slot_mapping)``, ``num_kv_heads``, ``head_size``); :class:`PagedImpl` writes
like vLLM's CPU backend into a ``[blocks, kv_heads, block_size, 2 * head_dim]`` cache.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_engine

import kvnotes.serving.library.piece_store as piece_store
import kvnotes.serving.vllm.kv_writer as kv_writer
from kvnotes.core import files
from kvnotes.serving.library.piece_store import PieceStore
from kvnotes.serving.library.splice import PieceInfo, Placement, leading_run
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.vllm.kv_writer import (
    KvWriter,
    PieceCache,
    PieceUnavailable,
    WorkerShare,
    rank_heads,
)
from kvnotes.serving.vllm.plans import LoadSpec

BLOCK = 16
HEADER = "System: be brief and exact.\n"
SKILL_A = "Policy A: refunds within 30 days of delivery.\n"
SKILL_B = "Policy B: no fees on changes made a week ahead.\n"


class PagedImpl:
    """A cache write like vLLM's CPU backend's, with what it received recorded."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.calls.append(dict(key=(key.device, key.dtype, tuple(key.shape)),
                               value=(value.device, value.dtype, tuple(value.shape)),
                               slots=(slot_mapping.device, slot_mapping.dtype),
                               cache=kv_cache.device))
        assert key.device == value.device == slot_mapping.device == kv_cache.device
        assert key.shape[1] == kv_cache.shape[1], "more heads than the cache holds"
        if kv_cache.device.type == "meta":
            return
        d = key.shape[-1]
        blocks, offsets = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]
        kv_cache[blocks, :, offsets, :d] = key.to(kv_cache.dtype)
        kv_cache[blocks, :, offsets, d:] = value.to(kv_cache.dtype)


def fake_layer(heads: int, head_dim: int, *, device="cpu", dtype=torch.float32, blocks=8):
    cache = torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=dtype, device=device)
    return SimpleNamespace(impl=PagedImpl(), kv_cache=cache, num_kv_heads=heads,
                           head_size=head_dim, kv_cache_dtype="auto")


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer, num_key_value_heads=4)


@pytest.fixture
def library(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    infos = {name: skills.add(text, name=name) for name, text in
             (("header", HEADER), ("a", SKILL_A), ("b", SKILL_B))}
    return skills, infos


def load_for(store: PieceStore, ids, *, start=0, tenant=None, req="r1",
             block_ids=(5, 2, 7, 1, 6)) -> LoadSpec:
    run = tuple(leading_run(ids, store.index))
    return LoadSpec(req, tenant, run, start, run[-1].end, tuple(block_ids), BLOCK)


def share(manifest, *, heads=None, dtype=torch.float32, device="cpu") -> WorkerShare:
    return WorkerShare(torch.device(device), dtype,
                       heads if heads is not None else range(manifest.num_kv_heads),
                       tuple(range(manifest.num_layers)))


def prompt(infos, *names):
    return [t for n in names for t in infos[n].token_ids] + [9, 9]


def test_rank_heads_follow_vllm_partitioning():
    assert [rank_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [rank_heads(3, 3, r) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    # fewer KV heads than ranks: each head replicated on consecutive ranks
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ValueError, match="cannot be split over 3"):
        rank_heads(8, 3, 0)


def test_writes_reach_the_cache_device_in_the_cache_dtype(library):
    """A cache on another device (``meta``): keys, values and slots arrive there, bf16."""
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    writer = KvWriter(skills.folder, m, share(m, dtype=torch.bfloat16, device="meta"))
    layers = [(i, fake_layer(m.num_kv_heads, m.head_dim, device="meta", dtype=torch.bfloat16))
              for i in range(m.num_layers)]
    load = load_for(store, prompt(infos, "header", "b", "a"))
    assert writer.write([load], layers) == set()
    n = load.end - load.start
    meta = torch.device("meta")
    for _, layer in layers:
        (call,) = layer.impl.calls
        assert call == dict(key=(meta, torch.bfloat16, (n, m.num_kv_heads, m.head_dim)),
                            value=(meta, torch.bfloat16, (n, m.num_kv_heads, m.head_dim)),
                            slots=(meta, torch.long), cache=meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU here")
def test_a_cuda_cache_holds_what_a_cpu_cache_holds(library):
    """The device path on a real GPU: staged, re-rotated there, written in the cache's dtype;
    the cache then holds what the same load writes into a CPU cache."""
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    load = load_for(store, prompt(infos, "header", "b", "a"))
    caches = {}
    for device in ("cpu", "cuda"):
        writer = KvWriter(skills.folder, m, share(m, dtype=torch.bfloat16, device=device))
        layers = [(i, fake_layer(m.num_kv_heads, m.head_dim, device=device,
                                 dtype=torch.bfloat16)) for i in range(m.num_layers)]
        assert writer.write([load], layers) == set()
        caches[device] = [layer.kv_cache.cpu() for _, layer in layers]
    for cpu, cuda in zip(caches["cpu"], caches["cuda"], strict=True):
        assert cuda.abs().sum() > 0
        torch.testing.assert_close(cuda, cpu, atol=1e-2, rtol=1e-2)  # one bf16 rounding apart


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_tensor_parallel_rank_writes_exactly_its_heads(library, tp):
    """Ranks write their share (a replica when KV heads < ranks); together, the full write."""
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    load = load_for(store, prompt(infos, "header", "a", "b"))
    full = KvWriter(skills.folder, m, share(m))
    want_k, want_v = full.assemble(load)  # [layers, n, all heads, d]
    slots = load.slots()
    for rank in range(tp):
        heads = rank_heads(m.num_kv_heads, tp, rank)
        layers = [(i, fake_layer(len(heads), m.head_dim)) for i in range(m.num_layers)]
        KvWriter(skills.folder, m, share(m, heads=heads)).write([load], layers)
        for i, layer in layers:
            cache = layer.kv_cache
            got = cache[slots // BLOCK, :, slots % BLOCK]  # [n, rank heads, 2d]
            torch.testing.assert_close(got[..., :m.head_dim], want_k[i][:, heads.start:heads.stop])
            torch.testing.assert_close(got[..., m.head_dim:], want_v[i][:, heads.start:heads.stop])
            # nothing outside the load's slots was touched
            mask = torch.ones(cache.shape[0] * BLOCK, dtype=torch.bool)
            mask[slots] = False
            assert not cache.permute(0, 2, 1, 3).reshape(-1, len(heads), 2 * m.head_dim)[mask].any()


def test_a_window_inside_the_run_is_written_at_its_slots(library):
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    whole = load_for(store, prompt(infos, "header", "a", "b"))
    part = LoadSpec("r", None, whole.run, BLOCK, whole.end, whole.block_ids, BLOCK)
    assert part.written_blocks == whole.block_ids[1:-(-whole.end // BLOCK)]
    writer = KvWriter(skills.folder, m, share(m))
    k_all, _ = writer.assemble(whole)
    k_part, _ = writer.assemble(part)
    torch.testing.assert_close(k_part, k_all[:, BLOCK:])


@pytest.mark.parametrize("damage", ["deleted", "corrupted", "replaced", "oversized"])
def test_a_failed_load_writes_nothing_and_reports_its_blocks(library, damage, caplog):
    """A skill gone, damaged or replaced between planning and loading: its request's blocks are
    reported for recompute; the co-batched request is written as planned."""
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    bad = load_for(store, prompt(infos, "header", "a"), req="bad", block_ids=(3, 4, 0))
    # the header's entry is smaller than a's, so a cap between them refuses a alone
    good_names = ("header",) if damage == "oversized" else ("header", "b")
    good = load_for(store, prompt(infos, *good_names), req="good", block_ids=(6, 7, 1))
    path = skills.folder / f"{infos['a'].key}.safetensors"
    max_entry = 1 << 30
    if damage == "deleted":
        path.unlink()
    elif damage == "corrupted":
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF  # one byte of the tensors
        path.write_bytes(bytes(data))
    elif damage == "replaced":  # the scheduler planned with other tokens under this key
        old = bad.run[1]
        fake = PieceInfo(old.piece.key, "a", old.piece.token_ids[:-1] + (7,), old.piece.origin)
        bad = LoadSpec("bad", None, (bad.run[0], Placement(fake, old.start)), bad.start,
                       bad.end, bad.block_ids, BLOCK)
    else:
        max_entry = path.stat().st_size - 1
    writer = KvWriter(skills.folder, m, share(m), max_entry_bytes=max_entry)
    layers = [(i, fake_layer(m.num_kv_heads, m.head_dim)) for i in range(m.num_layers)]
    with caplog.at_level(logging.WARNING, logger="vllm.kvnotes"):
        failed = writer.write([bad, good], layers)
    assert failed and failed == set(bad.written_blocks)
    assert all(len(layer.impl.calls) == 1 for _, layer in layers)  # only the good load
    assert [c["key"][2][0] for c in layers[0][1].impl.calls] == [good.end - good.start]
    assert "request bad" in caplog.text and "skill 'a'" in caplog.text
    assert "recomputed" in caplog.text


def test_tensors_are_cached_per_tenant_and_rotated_once(library, monkeypatch):
    skills, infos = library
    store = PieceStore(skills.folder)
    m = store.manifest
    reads, turns = [], []
    real_read, real_rotate = kv_writer.read_entry, kv_writer.rotate_keys
    monkeypatch.setattr(kv_writer, "read_entry",
                        lambda path, fp: reads.append(path.stem) or real_read(path, fp))
    monkeypatch.setattr(kv_writer, "rotate_keys",
                        lambda *a, **k: turns.append(1) or real_rotate(*a, **k))
    writer = KvWriter(skills.folder, m, share(m))
    ids = prompt(infos, "header", "b", "a")  # b and a are not at their compiled positions
    caches = []
    for tenant in ("acme", "acme", "globex"):
        layers = [(i, fake_layer(m.num_kv_heads, m.head_dim)) for i in range(m.num_layers)]
        writer.write([load_for(store, ids, tenant=tenant)], layers)
        caches.append(torch.stack([layer.kv_cache for _, layer in layers]))
    assert sorted(reads) == sorted([infos[n].key for n in ("header", "b", "a")] * 2)
    assert len(turns) == 2 * 2  # (b, a) turned once per tenant: one RoPE table, one op each
    # namespaces change what is cached, never what is written
    assert caches[0].any() and all(torch.equal(caches[0], c) for c in caches[1:])


def test_piece_cache_is_bounded():
    cache = PieceCache(max_bytes=1000)
    for i in range(10):
        cache.put(("t", i), (torch.zeros(50),))  # 200 bytes each
    assert cache.nbytes <= 1000 and len(cache) == 5
    assert cache.get(("t", 0)) is None and cache.get(("t", 9)) is not None
    cache.put(("t", "huge"), (torch.zeros(1000),))  # over the whole budget: not kept
    assert cache.get(("t", "huge")) is None and len(cache) == 5


def test_indexing_reads_headers_and_token_ids_not_tensors(library, monkeypatch):
    """The scheduler's index reads each entry's JSON header and its two int64 rows; the keys
    and values are read (and the whole file checksummed) only by a worker's load."""
    skills, infos = library
    read: list[int] = []
    real_read_at = files._read_at
    monkeypatch.setattr(files, "_read_at", lambda fd, off, n: read.append(n) or
                        real_read_at(fd, off, n))

    def no_tensors(*a, **k):
        raise AssertionError("the index parsed an entry's tensors")

    monkeypatch.setattr(files, "safetensors_load", no_tensors)
    monkeypatch.setattr(files, "checksum", no_tensors)
    store = PieceStore(skills.folder)
    assert {store.index.get(i.key) for i in infos.values()} == set(infos.values())
    want = 0
    for info in infos.values():
        data = (skills.folder / f"{info.key}.safetensors").read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        want += 8 + header_len + 2 * 8 * len(info)  # length, JSON, token ids and positions
    assert sum(read) == want
    assert sum(read) < sum((skills.folder / f"{i.key}.safetensors").stat().st_size
                           for i in infos.values()) / 4


def test_an_entry_damaged_in_its_tensors_is_indexed_and_fails_its_load(library):
    skills, infos = library
    path = skills.folder / f"{infos['a'].key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one byte of the last tensor: the header still reads
    path.write_bytes(bytes(data))
    store = PieceStore(skills.folder)
    assert store.index.get(infos["a"].key) == infos["a"]
    writer = KvWriter(skills.folder, store.manifest, share(store.manifest))
    with pytest.raises(PieceUnavailable, match="checksum mismatch"):
        writer.piece(None, infos["a"])


def test_an_entry_published_within_the_listings_clock_tick_is_found(library, monkeypatch):
    """A folder's mtime ticks coarsely: an entry renamed in right after a listing can leave it
    unchanged. A recent mtime is not trusted; an old unchanged one is (no listing)."""
    skills, infos = library
    store = PieceStore(skills.folder, rescan_s=0.0)
    before = skills.folder.stat().st_mtime_ns
    info = skills.add("Policy C: exchanges within 14 days.\n", name="c")
    os.utime(skills.folder, ns=(before, before))  # the publish landed in the same tick
    assert store.refresh() == len(infos) + 1 and store.index.get(info.key) == info
    listings: list[int] = []
    real = piece_store.entry_paths
    monkeypatch.setattr(piece_store, "entry_paths", lambda f: listings.append(1) or real(f))
    old = time.time_ns() - 2 * piece_store.RACY_NS
    os.utime(skills.folder, ns=(old, old))
    store.refresh()  # changed: listed, at a time well past the mtime
    store.refresh()
    store.refresh()
    assert listings == [1]
