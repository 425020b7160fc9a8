"""A skill library: compiled skills stored by content, so each is compiled once per model.

The content address is a pure function of (model fingerprint, position scheme, anchor, token
ids); the fingerprint id is also the folder, a namespace no other model can hit.

Safe under concurrent processes (kvnotes and the vLLM connector share a library): an entry is
published atomically (written to a temporary, flushed, renamed into place), so a reader sees a
whole entry or none; a damaged, tampered or foreign entry is a cache miss, never an exception,
and is removed only if it is still the file that failed (a peer may have republished it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core import files, validate
from kvnotes.core.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    KvnotesError,
    NotebookFileError,
    NotebookMismatchError,
    UnsafePathError,
)
from kvnotes.core.notebook import FILE_FORMAT as NOTEBOOK_FORMAT
from kvnotes.core.notebook import FILE_VERSION as NOTEBOOK_VERSION
from kvnotes.core.notebook import Notebook, Span
from kvnotes.core.variants import variant_rank
from kvnotes.ops.quant import FILE_FORMAT as QUANT_FORMAT
from kvnotes.ops.quant import FILE_VERSION as QUANT_VERSION

if TYPE_CHECKING:  # keys (skill_key) are read where no engine is loaded: a server's front
    from kvnotes.core.engine import Engine
    from kvnotes.ops.quant import QuantizedNotebook

# a folder listing within this many ns of the folder's mtime may have missed an entry
RACY_NS = 2_000_000_000


def skill_key(fingerprint_id: str, scheme: str, anchor: str, token_ids: list[int],
              quantize: str | None = None, after: Sequence[int] = (),
              tenant: str | None = None) -> str:
    """Content address of a compiled skill (int8 entries get their own addresses; a skill
    compiled ``after=`` a prefix is addressed by the prefix's token ids too, and a tenant's
    entry by its tenant: two tenants never share one)."""
    parts: list[object] = [fingerprint_id, scheme, anchor, token_ids]
    if after:
        parts.append({"after": [int(i) for i in after]})
    if tenant is not None:
        parts.append({"tenant": tenant})
    payload = json.dumps(parts + [f"int8-{quantize}"] if quantize else parts).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


class SkillLibrary:
    """Compiled skills on disk, keyed by content; ``get`` compiles on a miss.

    Example:
        >>> import tempfile
        >>> lib = SkillLibrary(tempfile.mkdtemp(), engine)
        >>> skill = lib.get("Refund policy: ...", name="refunds")  # compiled once, then loaded
        >>> lib.get("Refund policy: ...", name="refunds").token_ids.tolist() == skill.token_ids.tolist()
        True
    """

    def __init__(self, root: str | os.PathLike[str], engine: Engine, *, anchor: str = "auto",
                 quantize: str | None = None) -> None:
        """``quantize="token"`` or ``"channel"`` stores skills as int8 (see :mod:`kvnotes.ops.quant`):
        about a quarter of the disk, and ``get`` always returns the dequantized skill."""
        if quantize not in (None, "token", "channel"):
            raise InvalidArgumentError(
                f"quantize must be None, 'token' or 'channel', got {quantize!r}")
        validate.choice(anchor, "anchor", ("auto", "bos", "none"))
        from kvnotes.core.engine import Engine

        if not isinstance(engine, Engine):
            raise ArgumentTypeError(f"engine must be a kvnotes.Engine, got {type(engine).__name__}")
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise InvalidArgumentError(f"root must be a folder path, got {root!r}")
        if Path(root).exists() and not Path(root).is_dir():
            raise UnsafePathError(f"skill library {root} is a file, not a folder; give a folder "
                                  "path (it is created when missing)")
        self.quantize = quantize
        self.engine = engine
        self.anchor = ("bos" if engine.adds_bos else "none") if anchor == "auto" else anchor
        self.root = Path(root) / engine.fingerprint.id
        self.hits = 0
        self.misses = 0
        self.variant_hits = 0  # skills ``Engine.compose`` swapped for a stored variant
        # the stored entries by tokens: (path, behind, origin), read by header, rebuilt when the
        # folder changes (a peer process may publish)
        self._variants: dict[tuple[int, ...], list[tuple[Path, tuple[int, ...], int]]] = {}
        self._variants_mtime: int | None = None

    def _after_ids(self, after: str | Sequence[int] | None) -> list[int]:
        """The prefix a skill is compiled behind, as token ids (BOS included per the anchor)."""
        if after is None:
            return []
        return self.engine.anchor_ids(after, anchor=self.anchor if isinstance(after, str)
                                      else "auto")

    def path_for(self, text: str, *, after: str | Sequence[int] | None = None,
                 tenant: str | None = None) -> Path:
        validate.text(text, "text", allow_empty=False)
        ids = self.engine.encode(text)
        key = skill_key(self.engine.fingerprint.id, self.engine.adapter.name, self.anchor, ids,
                        self.quantize, after=self._after_ids(after), tenant=tenant)
        return self.root / f"{key}.safetensors"

    def __contains__(self, text: str) -> bool:
        return self.path_for(text).is_file()

    def get(self, text: str, *, name: str = "skill",
            after: str | Sequence[int] | None = None, tenant: str | None = None) -> Notebook:
        """The compiled skill for ``text``: loaded when stored, else compiled and stored.

        ``after``: compile it behind this prefix (see :meth:`Engine.compile`); the prefix is
        part of the entry's address, so each anchoring has its own entry. ``tenant``: whose
        entry it is (``meta["tenant"]``, and part of the address; None: shared).
        """
        validate.text(name, "name", allow_empty=False)
        path = self.path_for(text, after=after, tenant=tenant)
        skill = self._lookup(path)
        if skill is not None:
            self.hits += 1
            return skill.with_spans([Span(name, "skill", 0, len(skill))]).with_meta(name=name)
        self.misses += 1
        skill = (self.engine.compile(text, name=name, anchor=self.anchor) if after is None else
                 self.engine.compile(text, name=name, after=self._after_ids(after)))
        if tenant is not None:
            skill = skill.with_meta(tenant=tenant)
        if self.quantize:
            from kvnotes.ops.quant import quantize

            stored = quantize(skill, self.quantize)
            self._publish(stored, path)
            return stored.dequantize()  # a hit and a miss give the same notes
        self._publish(skill, path)
        return skill

    def variant(self, skill: Notebook, ids: Sequence[int], position: int) -> Notebook | None:
        """The stored variant of ``skill`` (an entry with its tokens) that ranks above ``skill``
        itself at absolute ``position`` behind ``ids`` (:func:`kvnotes.core.variants.variant_rank`:
        the one compiled behind the longest suffix of ``ids``, then at ``position``, then the
        latest); None when ``skill`` ranks first. What ``Engine.compose(..., library=self)``
        asks for each skill; variants are stored by ``get(text, after=...)``."""
        tokens = tuple(int(t) for t in skill.token_ids.tolist())
        raw = skill.meta.get("prefix_ids")
        own = tuple(int(t) for t in raw) if isinstance(raw, list) else ()
        best: tuple[int, bool, int] = variant_rank(own, skill.start_position, ids, len(ids),
                                                    position)
        found: Path | None = None
        for path, behind, origin in self._stored_variants().get(tokens, ()):
            rank = variant_rank(behind, origin, ids, len(ids), position)
            if rank > best:
                best, found = rank, path
        if found is None:
            return None
        stored = self._lookup(found)
        if stored is None:
            return None
        self.variant_hits += 1
        name = skill.meta.get("name")
        return stored if not isinstance(name, str) else stored.with_spans(
            [Span(name, "skill", 0, len(stored))]).with_meta(name=name)

    def _stored_variants(self) -> dict[tuple[int, ...], list[tuple[Path, tuple[int, ...], int]]]:
        try:
            mtime = self.root.stat().st_mtime_ns
        except OSError:
            return {}
        if mtime == self._variants_mtime:
            return self._variants
        fmt, version = ((QUANT_FORMAT, QUANT_VERSION) if self.quantize
                        else (NOTEBOOK_FORMAT, NOTEBOOK_VERSION))
        index: dict[tuple[int, ...], list[tuple[Path, tuple[int, ...], int]]] = {}
        for path in sorted(self.root.glob("*.safetensors")):
            if path.name.startswith("."):
                continue
            try:
                head = files.read_head(path, self.engine.fingerprint, file_format=fmt,
                                       version=version, what="skill")
                behind = tuple((head.header.get("meta") or {}).get("prefix_ids") or ())
                tokens = tuple(int(t) for t in head.tensors["token_ids"].tolist())
                origin = int(head.tensors["positions"][0]) if tokens else 0
            except (KvnotesError, OSError, KeyError, TypeError, ValueError, IndexError):
                continue  # foreign, damaged or half-written: never a variant
            index.setdefault(tokens, []).append((path, behind, origin))
        # a folder's mtime ticks coarsely: an entry renamed in within the tick of this listing
        # would leave it unchanged, so a listing that close to the mtime is not kept
        recent = time.time_ns() - mtime < RACY_NS
        self._variants, self._variants_mtime = index, None if recent else mtime
        return index

    def _lookup(self, path: Path) -> Notebook | None:
        """The stored skill at ``path``, or None: missing, damaged, tampered and foreign entries
        are all misses (a peer process may delete or replace the file at any moment)."""
        try:
            before = path.stat()
        except OSError:
            return None
        try:
            return self._load_int8(path) if self.quantize else Notebook.load(path, self.engine)
        except (NotebookFileError, NotebookMismatchError):
            _discard(path, before)
            return None

    def _publish(self, stored: Notebook | QuantizedNotebook, path: Path) -> None:
        """Store an entry atomically; a library that cannot be written costs reuse, not the call."""
        self._variants_mtime = None  # list the folder again at the next variant lookup
        try:
            stored.save(path)  # files.write: temp, fsync, rename
        except OSError as err:
            warnings.warn(f"skill library {self.root} is not writable ({err.strerror or err}); "
                          "the skill was compiled but not stored", RuntimeWarning, stacklevel=3)

    def _load_int8(self, path: Path) -> Notebook:
        from kvnotes.ops.quant import QuantizedNotebook

        return QuantizedNotebook.load(path, self.engine).dequantize()

    def __len__(self) -> int:
        return len(list(self.root.glob("*.safetensors"))) if self.root.is_dir() else 0


def _discard(path: Path, seen: os.stat_result) -> None:
    """Delete a bad entry, unless a peer has meanwhile replaced it (or deleted it already)."""
    try:
        now = path.stat()
        if (now.st_ino, now.st_mtime_ns, now.st_size) == (seen.st_ino, seen.st_mtime_ns,
                                                          seen.st_size):
            path.unlink(missing_ok=True)
    except OSError:
        pass
