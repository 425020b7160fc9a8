"""The engine-free side of serving: the splice salt, the manifest, reading entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes.core import files
from kvnotes.core.errors import InvalidArgumentError, NotebookFileError
from kvnotes.core.notebook import FILE_FORMAT, FILE_VERSION
from kvnotes.serving.compose_client import ComposeClient
from kvnotes.serving.library.manifest import (
    ENTRY_FORMAT,
    ENTRY_VERSION,
    MANIFEST_NAME,
    SPLICE_SALT,
    ServingManifest,
    entry_paths,
    read_entry,
    splice_salt,
)
from kvnotes.serving.skills import ServingSkills

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


# ---- the salt ------------------------------------------------------------------------------------
def test_tenant_salts_name_their_tenant():
    assert splice_salt() == SPLICE_SALT == "kvnotes-splice"
    assert splice_salt("acme-2.eu") == "kvnotes-splice:acme-2.eu"


def test_each_tenant_and_tag_has_its_own_salt():
    """The connector composes the salt of a request's tenant and tag and compares it with the
    request's (it never parses one), so no two (tenant, tag) pairs may share a salt."""
    tenants = [None, "a", "acme", "a.b", "a-b", "a_b", "t" * 64, "kvnotes-splice"]
    tags = [None, "f32a16", "f32a16s0.1", "a", "acme", "f" * 40]
    salts = {(t, g): splice_salt(t, tag=g) for t in tenants for g in tags}
    assert len(set(salts.values())) == len(salts)
    assert salts[(None, "f32a16")] == "kvnotes-splice+f32a16"
    assert salts[("acme", "f32a16")] == "kvnotes-splice:acme+f32a16"
    for salt in salts.values():
        # vLLM 0.32 refuses salts with '@', '/', '\\' or NUL, and over 128 characters
        assert not set(salt) & set("@/\\\x00") and len(salt) <= 128
    for tag in ("a@b", "a+b", "", "x" * 41):
        with pytest.raises(InvalidArgumentError, match="salt tag"):
            splice_salt("acme", tag=tag)


@pytest.mark.parametrize("tenant", ["", "a b", "x" * 65, "a:b", 7])
def test_bad_tenant_is_refused_naming_the_rule(tenant):
    with pytest.raises(InvalidArgumentError, match=r"1-64 letters, digits, '_', '\.' or '-'"):
        splice_salt(tenant)


def test_compose_client_sends_its_tenant_salt(tokenizer):
    assert ComposeClient("http://127.0.0.1:1", "m", tokenizer).salt == SPLICE_SALT
    client = ComposeClient("http://127.0.0.1:1", "m", tokenizer, tenant="acme")
    assert client.salt == "kvnotes-splice:acme"
    with pytest.raises(InvalidArgumentError, match="tenant 'a b'"):
        ComposeClient("http://127.0.0.1:1", "m", tokenizer, tenant="a b")


# ---- the manifest and entries --------------------------------------------------------------------
def test_entries_are_notebook_files():
    assert (ENTRY_FORMAT, ENTRY_VERSION) == (FILE_FORMAT, FILE_VERSION)


def test_manifest_write_is_atomic_and_idempotent(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    path = skills.folder / MANIFEST_NAME
    before = path.stat().st_mtime_ns
    assert skills.manifest.write(skills.folder) == path
    assert path.stat().st_mtime_ns == before  # the same manifest is not rewritten
    assert ServingManifest.read(skills.folder) == skills.manifest
    assert not [p for p in skills.folder.iterdir() if p.name.startswith(files.TMP_PREFIX)]


def test_missing_or_foreign_manifest_says_how_to_fix(tmp_path):
    with pytest.raises(NotebookFileError, match="kvnotes skills add --model M --skills DIR"):
        ServingManifest.read(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(NotebookFileError, match="not a kvnotes serving manifest"):
        ServingManifest.read(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("[1, 2")
    with pytest.raises(NotebookFileError, match="not a readable serving manifest"):
        ServingManifest.read(tmp_path)


def test_entry_paths_skip_publishes_in_progress(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    info = skills.add("Refunds: unworn items within 30 days.", name="refunds")
    published = skills.folder / f"{info.key}.safetensors"
    tmp = skills.folder / f"{files.TMP_PREFIX}123.abc.{'f' * 32}.safetensors"
    tmp.write_bytes(published.read_bytes()[:100])  # a half-written entry
    assert entry_paths(skills.folder) == [published]
    assert [e.key for e in skills.entries()] == [info.key]


def test_read_entry_gives_the_paged_layout(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    text = "Shipping: free above 50 euros."
    info = skills.add(text, name="shipping")
    piece, keys, values = read_entry(skills.folder / f"{info.key}.safetensors",
                                     engine.fingerprint)
    assert piece == info and piece.name == "shipping"
    nb = engine.compile(text, anchor="none")
    m = skills.manifest
    assert keys.shape == values.shape == (m.num_layers, len(info), m.num_kv_heads, m.head_dim)
    assert keys.dtype == torch.float32
    torch.testing.assert_close(keys[0], nb.keys(0)[0].transpose(0, 1), atol=0, rtol=0)


def test_damaged_entry_is_a_notebook_file_error(engine, tmp_path):
    skills = ServingSkills(tmp_path, engine)
    info = skills.add("Fees: none.", name="fees")
    path = skills.folder / f"{info.key}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(NotebookFileError):
        read_entry(path, engine.fingerprint)


# ---- what the connector's side imports -----------------------------------------------------------
