"""The scheduler's view of a serving-skills folder: an index of the pieces that follows the folder.

The scheduler matches prompts against this index (token ids, origins and keys only; the
tensors are read by each worker when it loads, :mod:`kvnotes.serving.kv_writer`). Imports
nothing from vLLM or the engine, so it is tested without either. Entries published while the
server runs are picked up at the next match (the folder is rescanned when its modification time
changes, at most every ``rescan_s`` seconds). What is never indexed: a publish still in progress
(hidden ``.kvnotes-tmp.*`` files), a damaged or foreign file (warned about once), and an entry
larger than ``max_entry_bytes`` on disk (checked before it is read).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from kvnotes.core.errors import KvnotesError, NotebookFileError
from kvnotes.serving.manifest import ServingManifest, entry_paths, read_entry
from kvnotes.serving.splice import PieceIndex

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these

DEFAULT_MAX_ENTRY_BYTES = 1 << 30


class PieceStore:
    """Index over one model's skill-library folder.

    Args:
        folder: ``ROOT/<fingerprint id>`` (see :mod:`kvnotes.serving.manifest`).
        rescan_s: how often, at most, the folder's modification time is checked.
        max_entry_bytes: entries larger than this on disk are skipped unread.
    """

    def __init__(self, folder: str | os.PathLike[str], *, rescan_s: float = 0.25,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> None:
        self.folder = Path(folder)
        self.manifest = ServingManifest.read(self.folder)
        self.fingerprint = self.manifest.fingerprint_obj
        self.index = PieceIndex()
        self.rescan_s = rescan_s
        self.max_entry_bytes = int(max_entry_bytes)
        self._paths: dict[str, Path] = {}
        self._skipped: set[tuple[str, int]] = set()  # (name, mtime) already warned about
        self._mtime: int | None = None
        self._checked = 0.0
        self.refresh(force=True)

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
        present = {p.stem: p for p in entry_paths(self.folder)}
        for key in [k for k in self._paths if k not in present]:
            self.index.remove(key)
            self._paths.pop(key)
            log.info("kvnotes: skill file %s removed; no longer spliced", key)
        for key, path in present.items():
            if key not in self._paths:
                self._add(key, path)
        return len(self.index)

    def _add(self, key: str, path: Path) -> None:
        try:
            st = path.stat()
        except OSError:
            return  # gone since the listing
        stamp = (path.name, st.st_mtime_ns)
        if stamp in self._skipped:
            return
        try:
            if st.st_size > self.max_entry_bytes:
                raise NotebookFileError(f"{st.st_size} bytes, over the entry cap of "
                                        f"{self.max_entry_bytes} (kv_connector_extra_config "
                                        "max_entry_mib)")
            piece, keys, _ = read_entry(path, self.fingerprint)
            m = self.manifest
            want = (m.num_layers, m.num_kv_heads, m.head_dim)
            got = (keys.shape[0], keys.shape[2], keys.shape[3])
            if got != want:
                raise NotebookFileError(f"shape (layers, kv heads, head dim) {got} does not "
                                        f"match the manifest's {want}")
        except (KvnotesError, OSError) as err:
            # int8 entries, damaged, foreign or oversized files: a miss, warned about once
            self._skipped.add(stamp)
            log.warning("kvnotes: skipping skill file %s: %s", path.name, err)
            return
        self.index.add(piece)
        self._paths[key] = path
        log.info("kvnotes: skill %r (%d tokens, origin %d) registered", piece.name, len(piece),
                 piece.origin)
