"""The skill store of one machine: the serving folder the connector reads, as it always was.

``ROOT/<model fingerprint id>/<key>.safetensors`` per entry (the same files, written the same
atomic way: a hidden temporary renamed over the target) and the learned entries' rows in
``ROOT/<model>/learned/registry.sqlite3`` (:class:`~kvnotes.serving.library.registry.LearnedRegistry`).
Sightings and leases are kept in this process's memory: one host has one learner, so there is
nobody else to agree with.
"""

from __future__ import annotations

import builtins
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvnotes.core import files
from kvnotes.core.errors import KvnotesError, NotebookFileError
from kvnotes.serving.library.manifest import ENTRY_SUFFIX, entry_paths
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry, registry_path
from kvnotes.serving.store.base import Change, StoreFaults, visible
from kvnotes.serving.store.entry import (
    EntryInfo,
    StoredEntry,
    check_key,
    check_tenant,
    describe,
    verify_entry,
)

log = logging.getLogger("kvnotes.serving.store")


def write_entry_file(folder: Path, key: str, data: bytes) -> Path:
    """Write an entry's bytes to ``folder/<key>.safetensors`` atomically (the old file or the
    whole new one, whatever happens: a temporary beside it, flushed, renamed over it)."""
    path = folder / f"{check_key(key)}{ENTRY_SUFFIX}"
    folder.mkdir(parents=True, exist_ok=True)
    files.sweep(folder)
    fd, name = tempfile.mkstemp(dir=folder, prefix=files.temp_prefix(), suffix=f".{path.name}")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _head_info(path: Path, model: str) -> EntryInfo:
    """An entry file's info from its head bytes only (``sha256`` left empty: not hashed)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if n > min(size - 8, files.MAX_HEAD_BYTES):
            raise NotebookFileError(f"{path}: header of {n} bytes in a file of {size}")
        head = n.to_bytes(8, "little") + f.read(n)
    info = describe(head, path.stem, model)
    return EntryInfo(info.key, model, info.tenant, info.name, info.tokens, size, "")


class Leases:
    """Sightings and leases in this process's memory (a :class:`FolderStore`'s)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}  # name -> (count, monotonic expiry)
        self._leases: dict[str, float] = {}  # name -> monotonic expiry

    def incr(self, name: str, ttl_s: float) -> int:
        now = time.monotonic()
        with self._lock:
            count, until = self._seen.get(name, (0, now))
            count = count + 1 if until > now else 1
            self._seen[name] = (count, now + ttl_s)
            if len(self._seen) > 100_000:  # a bound on memory: expired counts go first
                self._seen = {k: v for k, v in self._seen.items() if v[1] > now}
            return count

    def clear(self, name: str) -> None:
        with self._lock:
            self._seen.pop(name, None)

    def acquire(self, name: str, ttl_s: float) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._leases.get(name, 0.0) > now:
                return False
            self._leases[name] = now + ttl_s
            return True

    def release(self, name: str) -> bool:
        with self._lock:
            return self._leases.pop(name, 0.0) > time.monotonic()


class FolderStore:
    """The skill library in a folder on this machine (see the module docstring).

    Args:
        root: the skills root given to ``kvnotes serve --skills``; each model's entries are in
            ``root/<model fingerprint id>/``.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.faults = StoreFaults()
        self._coord = Leases()
        self._lock = threading.Lock()
        self._registries: dict[str, LearnedRegistry] = {}
        self._gone: dict[str, dict[str, float]] = {}  # model -> key -> when forgotten

    def folder(self, model: str) -> Path:
        return self.root / check_key(model, "model id")

    def _registry(self, model: str, *, create: bool) -> LearnedRegistry | None:
        with self._lock:
            reg = self._registries.get(model)
            if reg is None and (create or registry_path(self.folder(model)).is_file()):
                reg = self._registries[model] = LearnedRegistry(self.folder(model))
            return reg

    def _row(self, model: str, key: str) -> LearnedEntry | None:
        reg = self._registry(model, create=False)
        return reg.get(key) if reg is not None else None

    @staticmethod
    def _merge(info: EntryInfo, row: LearnedEntry | None) -> EntryInfo:
        if row is None:
            return info
        return EntryInfo(info.key, info.model, info.tenant, row.name, info.tokens, info.bytes,
                         info.sha256, row.kind, True, row.pinned, row.hits, row.last_used,
                         row.created, row.skill, row.variant_of, row.behind, row.behind_tokens)

    # ---- entries -----------------------------------------------------------------------------
    def put(self, entry: StoredEntry) -> None:
        info = entry.info
        verify_entry(entry.data, info)
        write_entry_file(self.folder(info.model), info.key, entry.data)
        if info.learned:
            reg = self._registry(info.model, create=True)
            assert reg is not None
            reg.record(info.to_learned())

    def get(self, model: str, key: str, tenant: str | None) -> StoredEntry | None:
        check_tenant(tenant)
        path = self.folder(model) / f"{check_key(key)}{ENTRY_SUFFIX}"
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            info = self._merge(describe(data, key, model), self._row(model, key))
        except KvnotesError as err:
            self._drop(model, key, "malformed", err)
            return None
        if not visible(info, tenant):
            return None
        try:
            verify_entry(data, info)
        except NotebookFileError as err:
            self._drop(model, key, "checksum", err)
            return None
        return StoredEntry(info, data)

    def _drop(self, model: str, key: str, reason: str, err: Exception) -> None:
        self.faults.count(reason)
        log.warning("kvnotes: store %s: entry %s/%s dropped (%s): %s", self.url, model, key,
                    reason, err)
        self.delete(model, key)

    def models(self) -> builtins.list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and any(entry_paths(p)))

    def list(self, model: str | None = None, tenant: str | None = None, *,
             every: bool = False) -> builtins.list[EntryInfo]:
        check_tenant(tenant)
        out: list[EntryInfo] = []
        for m in [model] if model is not None else self.models():
            reg = self._registry(m, create=False)
            rows = {r.key: r for r in reg.entries()} if reg is not None else {}
            for path in entry_paths(self.folder(m)):
                try:
                    info = self._merge(_head_info(path, m), rows.get(path.stem))
                except (KvnotesError, OSError):
                    continue  # damaged or gone since the listing: never listed
                if every or visible(info, tenant):
                    out.append(info)
        return sorted(out, key=lambda i: (i.last_used, i.key))

    def pin(self, model: str, key: str, pinned: bool = True) -> bool:
        reg = self._registry(model, create=False)
        return reg is not None and reg.pin(check_key(key), pinned)

    def forget(self, model: str, key: str) -> bool:
        if self._row(model, check_key(key)) is None:
            return False
        self.delete(model, key)
        with self._lock:
            self._gone.setdefault(model, {})[key] = time.time()
        return True

    def delete(self, model: str, key: str) -> bool:
        path = self.folder(model) / f"{check_key(key)}{ENTRY_SUFFIX}"
        existed = path.is_file()
        path.unlink(missing_ok=True)
        reg = self._registry(model, create=False)
        if reg is not None:
            existed = reg.remove(key) or existed
        return existed

    def touch(self, model: str, hits: Mapping[str, int], when: float | None = None) -> None:
        reg = self._registry(model, create=False)
        if reg is not None:
            reg.use(hits, when)

    def forgotten(self, model: str, since: float = 0.0) -> builtins.list[str]:
        with self._lock:
            return sorted(k for k, t in self._gone.get(model, {}).items() if t >= since)

    def changes(self, model: str, after: str | None
                ) -> tuple[str, builtins.list[Change]] | None:
        return None  # one host's folder: nobody else publishes into it

    # ---- what learners agree on ---------------------------------------------------------------
    def incr_sightings(self, names: Sequence[str],
                       ttl_s: float = 86400.0) -> builtins.list[int]:
        return [self._coord.incr(name, ttl_s) for name in names]

    def clear_sighting(self, name: str) -> None:
        self._coord.clear(name)

    def epoch(self) -> str:
        return self.url  # a folder is never emptied behind its writer's back

    def acquire_lease(self, name: str, ttl_s: float) -> bool:
        return self._coord.acquire(name, ttl_s)

    def release_lease(self, name: str) -> bool:
        return self._coord.release(name)

    def acquire_leases(self, names: Sequence[str], ttl_s: float) -> builtins.list[bool]:
        return [self._coord.acquire(name, ttl_s) for name in names]

    def settle_leases(self) -> int:
        return 0  # in this process: every answer arrives

    def close(self) -> None:
        with self._lock:
            for reg in self._registries.values():
                reg.close()
            self._registries.clear()

    def __repr__(self) -> str:
        return f"FolderStore({self.url!r})"

