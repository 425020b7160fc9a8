"""Assembling a GGUF split over data packages: order, checks, clear errors, nothing half-written."""

from __future__ import annotations

import hashlib
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from kvnotes.core import split_gguf
from kvnotes.core.errors import UnknownModelError
from kvnotes.core.models import BUNDLED, bundled_status
from kvnotes.core.split_gguf import SplitGguf, SplitPart, assemble, split_specs

ROOT = Path(__file__).resolve().parents[2]


def _fake_parts(root: Path, tag: str, chunks: list[bytes]) -> SplitGguf:
    """Importable packages ``<tag>_partN`` under ``root``, each holding one slice, and their spec."""
    parts = []
    for i, chunk in enumerate(chunks, 1):
        module = f"{tag}_part{i}"
        data = root / module / "data"
        data.mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(chunk)
        parts.append(SplitPart(f"{tag}-part{i}", "1.0", module, len(chunk),
                               hashlib.sha256(chunk).hexdigest()))
    whole = b"".join(chunks)
    return SplitGguf(tag, f"{tag}.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts))


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield root
    for name in [m for m in sys.modules if m.startswith("fake")]:
        del sys.modules[name]


def test_assembles_in_part_order_and_reuses_the_result(site, tmp_path):
    chunks = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    spec = _fake_parts(site, "fakeok", chunks)
    seen: list[int] = []
    out = assemble(spec, tmp_path / "gguf", progress=seen.append)
    assert out.read_bytes() == b"".join(chunks)
    assert sum(seen) == spec.size
    mtime = out.stat().st_mtime_ns
    assert assemble(spec, tmp_path / "gguf") == out  # the stamp matches: not written again
    assert out.stat().st_mtime_ns == mtime
    assert {p.name for p in (tmp_path / "gguf").iterdir()} == {out.name, out.name + ".json"}


def test_a_missing_part_names_its_package(site, tmp_path):
    spec = _fake_parts(site, "fakemiss", [b"GGUF1", b"2", b"3"])
    missing = SplitPart("fakemiss-part9", "1.0", "fakemiss_part9", 1, "0" * 64)
    spec = SplitGguf(spec.alias, spec.file, spec.size, spec.sha256, (*spec.parts, missing))
    with pytest.raises(UnknownModelError, match=r"fakemiss-part9 \(part 4 of 4\)"):
        assemble(spec, tmp_path / "gguf")
    assert not split_gguf.installed(spec)
    assert not (tmp_path / "gguf" / spec.file).exists()


def test_a_wrong_size_names_the_package_to_reinstall(site, tmp_path):
    spec = _fake_parts(site, "fakesize", [b"GGUF1", b"22", b"333"])
    (site / "fakesize_part2" / "data" / "part02.bin").write_bytes(b"2")
    with pytest.raises(UnknownModelError, match="fakesize-part2==1.0"):
        assemble(spec, tmp_path / "gguf")
    assert not (tmp_path / "gguf" / spec.file).exists()


def test_a_wrong_hash_leaves_no_file_behind(site, tmp_path):
    spec = _fake_parts(site, "fakehash", [b"GGUF1", b"22", b"333"])
    (site / "fakehash_part3" / "data" / "part03.bin").write_bytes(b"334")  # same size
    folder = tmp_path / "gguf"
    with pytest.raises(UnknownModelError, match="fakehash-part3 is damaged"):
        assemble(spec, folder)
    assert list(folder.iterdir()) == []  # neither the file nor a temporary


def test_a_damaged_earlier_file_is_replaced(site, tmp_path):
    spec = _fake_parts(site, "fakeredo", [b"GGUF1", b"22"])
    out = assemble(spec, tmp_path / "gguf")
    out.write_bytes(b"broken")
    assert assemble(spec, tmp_path / "gguf").read_bytes() == b"GGUF122"


def test_the_package_table_matches_the_extras_and_the_issue_hashes():
    specs = split_specs()
    assert specs["qwen2.5-coder-0.5b"].sha256 == (
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert specs["qwen2.5-coder-1.5b"].size == 1_117_320_768
    for spec in specs.values():
        assert sum(p.size for p in spec.parts) == spec.size
        assert spec.alias in BUNDLED
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["qwen-small"] == list(specs["qwen2.5-coder-0.5b"].requirements)
    assert extras["qwen"] == [*specs["qwen2.5-coder-0.5b"].requirements,
                              *specs["qwen2.5-coder-1.5b"].requirements]


def test_requirements_command(capsys):
    assert split_gguf.main(["requirements", "qwen2.5-coder-0.5b"]) == 0
    assert capsys.readouterr().out.split() == list(split_specs()["qwen2.5-coder-0.5b"].requirements)
    assert split_gguf.main(["requirements", "nope"]) == 1
    assert split_gguf.main([]) == 2


def test_status_lists_every_alias():
    assert [s.alias for s in bundled_status()] == list(BUNDLED)
    assert all(isinstance(s.to_dict()["installed"], bool) for s in bundled_status())


def test_another_install_of_the_same_packages_keeps_the_file(site, tmp_path):
    """A second virtual environment holds the parts at other paths: the file is hashed, found
    right and kept (not rewritten, so the model converted from it stays valid)."""
    chunks = [b"GGUF" + b"x" * 40, b"y" * 9]
    spec = _fake_parts(site, "fakevenv", chunks)
    out = assemble(spec, tmp_path / "gguf")
    mtime = out.stat().st_mtime_ns
    other = tmp_path / "other-site"
    other.mkdir()
    for part in spec.parts:  # the same packages, installed under another root
        (site / part.module).rename(other / part.module)
    for name in [m for m in sys.modules if m.startswith("fakevenv")]:
        del sys.modules[name]
    sys.path.insert(0, str(other))
    importlib.invalidate_caches()
    try:
        assert assemble(spec, tmp_path / "gguf") == out
        assert out.stat().st_mtime_ns == mtime
        assert str(other) in (tmp_path / "gguf" / (out.name + ".json")).read_text()
        out.write_bytes(b"GGUF" + b"z" * 40 + b"y" * 9)  # same size, wrong content
        (tmp_path / "gguf" / (out.name + ".json")).write_text(
            (tmp_path / "gguf" / (out.name + ".json")).read_text().replace(str(other), "/gone"))
        assert assemble(spec, tmp_path / "gguf").read_bytes() == b"".join(chunks)
    finally:
        sys.path.remove(str(other))
