"""The scheduler's view of a serving-skills folder: an index of the pieces that follows the folder.

The scheduler matches prompts against this index (token ids, origins and keys only). Indexing an
entry reads its JSON header and its token ids and positions, never its keys and values: those
are read, and the whole file checksummed, by each worker when it loads
(:mod:`kvnotes.serving.vllm.kv_writer`), so an entry damaged in its tensors is indexed and then fails
its load (recomputed by vLLM). Imports
nothing from vLLM or the engine, so it is tested without either. Entries published while the
server runs are picked up at the next match (the folder is rescanned when its modification time
changes, or while it is recent enough that a listing in the same clock tick could have missed an
entry, at most every ``rescan_s`` seconds). What is never indexed: a publish still in progress
(hidden ``.kvnotes-tmp.*`` files), a damaged or foreign file (warned about once), and an entry
larger than ``max_entry_bytes`` on disk (checked before it is read).

Tenancy: :meth:`PieceStore.view` is the index a request of one tenant is matched against, the
operator's entries (tenant None) and that tenant's own, never another tenant's; the views are
kept up to date with the folder as it changes.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from kvnotes.core import files
from kvnotes.core.errors import KvnotesError, NotebookFileError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.serving.library.manifest import (
    ENTRY_FORMAT,
    ENTRY_VERSION,
    ServingManifest,
    entry_owner,
    entry_paths,
)
from kvnotes.serving.library.splice import PieceIndex, PieceInfo, visible

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these

DEFAULT_MAX_ENTRY_BYTES = 1 << 30
FLOAT_TENSORS = {"F32", "F16", "BF16", "F64"}  # safetensors' names of the dtypes entries hold
# A folder's mtime ticks coarsely (a few ms locally, seconds on some network file systems): an
# entry renamed in within the tick of a listing leaves the mtime as the listing saw it. So an
# unchanged mtime is trusted only once a listing started this long after it.
RACY_NS = 2_000_000_000
MAX_VIEWS = 256  # tenants' indexes kept at once


class PieceStore:
    """Index over one model's skill-library folder.

    Args:
        folder: ``ROOT/<fingerprint id>`` (see :mod:`kvnotes.serving.library.manifest`).
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
        # tenant -> the index of the pieces it may splice (made on first use, kept in step)
        self._views: dict[str | None, PieceIndex] = {}
        self._skipped: set[tuple[str, int]] = set()  # (name, mtime) already warned about
        self._mtime: int | None = None
        self._listed_ns = 0  # wall clock when the folder was last listed
        self._checked = 0.0
        self.generation = 0  # counts the changes to the index: a reader rebuilds only on a new one
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
        if not force and mtime == self._mtime and self._listed_ns - mtime > RACY_NS:
            return len(self.index)
        self._mtime, self._listed_ns = mtime, time.time_ns()
        present = {p.stem: p for p in entry_paths(self.folder)}
        for key in [k for k in self._paths if k not in present]:
            self.index.remove(key)
            for view in self._views.values():
                view.remove(key)
            self._paths.pop(key)
            self.generation += 1
            log.info("kvnotes: skill file %s removed; no longer spliced", key)
        for key, path in present.items():
            if key not in self._paths:
                self._add(key, path)
        return len(self.index)

    def view(self, tenant: str | None) -> PieceIndex:
        """The pieces a request of ``tenant`` may splice (the shared ones and its own), indexed;
        kept in step with :attr:`index` by :meth:`refresh`."""
        view = self._views.get(tenant)
        if view is None:
            if len(self._views) >= MAX_VIEWS:  # a bound on memory: views are rebuilt on demand
                self._views.clear()
            view = self._views[tenant] = PieceIndex()
            for piece in self.index.pieces():
                if visible(piece, tenant):
                    view.add(piece)
        return view

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
            piece, got = index_entry(path, self.fingerprint)
            m = self.manifest
            want = (m.num_layers, m.num_kv_heads, m.head_dim)
            if got != want:
                raise NotebookFileError(f"shape (layers, kv heads, head dim) {got} does not "
                                        f"match the manifest's {want}")
        except (KvnotesError, OSError) as err:
            # int8 entries, damaged, foreign or oversized files: a miss, warned about once
            self._skipped.add(stamp)
            log.warning("kvnotes: skipping skill file %s: %s", path.name, err)
            return
        self.index.add(piece)
        for tenant, view in self._views.items():
            if visible(piece, tenant):
                view.add(piece)
        self._paths[key] = path
        self.generation += 1
        log.info("kvnotes: skill %r (%d tokens, origin %d) registered", piece.name, len(piece),
                 piece.origin)


def index_entry(path: Path, fingerprint: ModelFingerprint) -> tuple[PieceInfo, tuple[int, int, int]]:
    """``(piece, (layers, kv heads, head dim))`` of one entry, from its header and token ids
    only (:func:`kvnotes.core.files.read_head`); :class:`NotebookFileError` when the header
    does not describe a skill the server can splice."""
    head = files.read_head(path, fingerprint, file_format=ENTRY_FORMAT, version=ENTRY_VERSION,
                           what="skill")
    ids = tuple(int(t) for t in head.tensors["token_ids"].tolist())
    positions = head.tensors["positions"]
    try:
        num_layers = head.header["num_layers"]
        spans = head.header["spans"]
        name = str(spans[0][0]) if spans else path.stem
        layer_tensors = [head.table[f"layers.{l}.{kind}"] for l in range(num_layers)
                         for kind in ("keys", "values")]
        shapes = {shape for _, shape in layer_tensors}
        dtypes = {dtype for dtype, _ in layer_tensors}
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise NotebookFileError(f"{path}: not a skill the server can splice ({err})") from err
    # stored as the HF cache holds them: [1, kv_heads, n, head_dim] per layer
    if not dtypes <= FLOAT_TENSORS:
        raise NotebookFileError(f"{path}: layer tensors of {sorted(dtypes)}, not floats")
    if not ids or positions.numel() != len(ids) or len(shapes) != 1:
        raise NotebookFileError(f"{path}: {len(ids)} tokens, {positions.numel()} positions and "
                                f"layer shapes {sorted(shapes)} do not describe one skill")
    (shape,) = shapes
    if len(shape) != 4 or shape[0] != 1 or shape[2] != len(ids):
        raise NotebookFileError(f"{path}: layer tensors {shape} do not fit {len(ids)} tokens")
    tenant, behind = entry_owner(head.header)
    return (PieceInfo(path.stem, name, ids, int(positions[0]), tenant, behind),
            (num_layers, shape[1], shape[3]))
