"""FolderStore: the serving folder behind the Store contract, its files unchanged."""

from __future__ import annotations

from _store_helpers import MODEL

from kvnotes.serving.library.manifest import read_entry
from kvnotes.serving.library.registry import LearnedRegistry
from kvnotes.serving.store import FolderStore, Store
from kvnotes.serving.store.folder import write_entry_file


def test_it_is_a_store_and_writes_the_file_the_connector_reads(tmp_path, make_entry):
    store = FolderStore(tmp_path)
    assert isinstance(store, Store)
    entry = make_entry("k1", "acme")
    store.put(entry)
    path = tmp_path / MODEL / "k1.safetensors"
    assert path.read_bytes() == entry.data  # the same bytes: format and checksums unchanged
    from _store_helpers import FINGERPRINT

    from kvnotes.core.fingerprint import ModelFingerprint
    piece, keys, _ = read_entry(path, ModelFingerprint.from_dict(FINGERPRINT))
    assert piece.tenant == "acme" and keys.shape[1] == entry.info.tokens
    with LearnedRegistry(tmp_path / MODEL) as reg:
        assert reg.get("k1").tenant == "acme"  # a learned entry has its registry row
    got = store.get(MODEL, "k1", "acme")
    assert got is not None and got.data == entry.data and got.info.learned


def test_tenants_list_and_get_only_their_own_and_the_shared(tmp_path, make_entry):
    store = FolderStore(tmp_path)
    store.put(make_entry("shared1", None, learned=False))
    store.put(make_entry("acme1", "acme", seed=1))
    store.put(make_entry("globex1", "globex", seed=2))
    assert {i.key for i in store.list(MODEL, "acme")} == {"shared1", "acme1"}
    assert {i.key for i in store.list(None, every=True)} == {"shared1", "acme1", "globex1"}
    assert store.get(MODEL, "globex1", "acme") is None
    assert store.get(MODEL, "shared1", "globex") is not None


def test_a_damaged_file_is_dropped_and_read_as_a_miss(tmp_path, make_entry):
    store = FolderStore(tmp_path)
    entry = make_entry("k1")
    data = bytearray(entry.data)
    data[-5] ^= 0xFF
    write_entry_file(tmp_path / MODEL, "k1", bytes(data))
    assert store.get(MODEL, "k1", None) is None
    assert store.faults.to_dict()["checksum"] == 1 and not (tmp_path / MODEL / "k1.safetensors").exists()


def test_pins_and_forgets_learned_entries_only(tmp_path, make_entry):
    store = FolderStore(tmp_path)
    store.put(make_entry("reg1", None, learned=False))
    store.put(make_entry("learn1", "acme", seed=1))
    assert not store.pin(MODEL, "reg1") and not store.forget(MODEL, "reg1")
    assert store.pin(MODEL, "learn1")
    store.touch(MODEL, {"learn1": 2})
    (info,) = [i for i in store.list(MODEL, "acme") if i.key == "learn1"]
    assert info.pinned and info.hits == 2
    assert store.forget(MODEL, "learn1") and store.forgotten(MODEL) == ["learn1"]
    assert [i.key for i in store.list(MODEL, every=True)] == ["reg1"]


def test_sightings_and_leases_in_one_process(tmp_path):
    store = FolderStore(tmp_path)
    assert [store.incr_sightings(["c"])[0], store.incr_sightings(["c"])[0]] == [1, 2]
    assert store.incr_sightings(["d", "c", "d"]) == [1, 3, 2] and store.incr_sightings([]) == []
    assert store.acquire_lease("l", 60) and not store.acquire_lease("l", 60)
    assert store.release_lease("l") and store.acquire_lease("l", 60)
