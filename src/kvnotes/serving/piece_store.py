"""The server-side view of a serving-skills folder: an index that follows the folder, and a
memory-bounded cache of the pieces' tensors.

Used by the vLLM connector in both of its roles (the scheduler matches prompts against the
index; the worker loads tensors), but imports nothing from vLLM, so it is tested without one.
New entries written while the server runs are picked up at the next match (the folder is
rescanned when its modification time changes, at most every ``rescan_s`` seconds); a damaged or
vanished entry is skipped, never an exception in the server.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

import torch

from kvnotes.core.errors import KvnotesError, NotebookFileError
from kvnotes.serving.skills import ServingManifest, read_entry
from kvnotes.serving.splice import PieceIndex

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these

# Requests carrying a cache_salt that starts with this are the ones the connector splices; any
# other request (no salt, or another salt) is served exactly as vLLM would without kvnotes.
SPLICE_SALT_PREFIX = "kvnotes-splice"


def is_splice_salt(salt: str | None) -> bool:
    return bool(salt) and str(salt).startswith(SPLICE_SALT_PREFIX)


class PieceStore:
    """Index + tensor cache over one model's skill-library folder.

    Args:
        folder: ``ROOT/<fingerprint id>`` (see :mod:`kvnotes.serving.skills`).
        max_bytes: bound on the tensors kept in memory (least recently used leave first).
        rescan_s: how often, at most, the folder's modification time is checked.
        keep_tensors: keep the tensors read while indexing (the worker loads them; the
            scheduler only matches token ids).
    """

    def __init__(self, folder: str | os.PathLike[str], *, max_bytes: int = 2 << 30,
                 rescan_s: float = 0.25, keep_tensors: bool = True) -> None:
        self.folder = Path(folder)
        self.manifest = ServingManifest.read(self.folder)
        self.fingerprint = self.manifest.fingerprint_obj
        # RoPE tables as tensors once, not per request and layer on the splice path
        self.inv_freqs = [self.manifest.inv_freq(l) for l in range(self.manifest.num_layers)]
        self.index = PieceIndex()
        self.max_bytes = int(max_bytes)
        self.rescan_s = rescan_s
        self.keep_tensors = keep_tensors
        self._paths: dict[str, Path] = {}
        self._skipped: set[tuple[str, int]] = set()  # (name, mtime) already warned about
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._cached_bytes = 0
        self._mtime: int | None = None
        self._checked = 0.0
        self.refresh(force=True)

    # ---- the index ---------------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> int:
        """Rescan the folder if it changed; returns the number of pieces now indexed."""
        now = time.monotonic()
        if not force and now - self._checked < self.rescan_s:
            return len(self.index)
        self._checked = now
        try:
            mtime = self.folder.stat().st_mtime_ns
        except OSError:
            return len(self.index)
        if not force and mtime == self._mtime:
            return len(self.index)
        self._mtime = mtime
        present = {p.stem: p for p in self.folder.glob("*.safetensors")}
        for key in [k for k in self._paths if k not in present]:
            self.index.remove(key)
            self._paths.pop(key)
            self._evict(key)
        for key, path in present.items():
            if key in self._paths:
                continue
            try:
                stamp = (path.name, path.stat().st_mtime_ns)
            except OSError:
                continue  # gone since the listing
            if stamp in self._skipped:
                continue
            try:
                piece, keys, values = read_entry(path, self.fingerprint)
                self._check_shape(keys, path)
            except (NotebookFileError, KvnotesError, OSError) as err:
                # int8 entries, damaged or foreign files: a miss, warned about once
                self._skipped.add(stamp)
                log.warning("kvnotes: skipping skill file %s: %s", path.name, err)
                continue
            self.index.add(piece)
            self._paths[key] = path
            if self.keep_tensors:
                self._remember(key, keys, values)
            log.info("kvnotes: skill %r (%d tokens, origin %d) registered", piece.name,
                     len(piece), piece.origin)
        return len(self.index)

    def _check_shape(self, keys: torch.Tensor, path: Path) -> None:
        m = self.manifest
        want = (m.num_layers, m.num_kv_heads, m.head_dim)
        got = (keys.shape[0], keys.shape[2], keys.shape[3])
        if got != want:
            raise NotebookFileError(f"{path}: shape (layers, kv heads, head dim) {got} does not "
                                    f"match the manifest's {want}")

    # ---- tensors -----------------------------------------------------------------------------
    def load(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[layers, n, kv_heads, head_dim]`` of a piece (cached)."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        path = self._paths.get(key) or self.folder / f"{key}.safetensors"
        _, keys, values = read_entry(path, self.fingerprint)
        self._remember(key, keys, values)
        return keys, values

    def _remember(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        size = _nbytes(keys, values)
        if size > self.max_bytes:
            return
        self._evict(key)
        self._cache[key] = (keys, values)
        self._cached_bytes += size
        while self._cached_bytes > self.max_bytes and self._cache:
            _, oldest = self._cache.popitem(last=False)
            self._cached_bytes -= _nbytes(*oldest)

    def _evict(self, key: str) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_bytes -= _nbytes(*old)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


def _nbytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    return keys.numel() * keys.element_size() + values.numel() * values.element_size()
