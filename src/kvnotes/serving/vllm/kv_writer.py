"""The worker side of splicing: a load's keys and values built on the cache's device, written
through the attention backend.

Each worker process (one per tensor-parallel rank and pipeline stage) holds a share of the
paged cache: the KV heads of its rank (:func:`rank_heads`, vLLM's own partitioning) for the
layers of its stage, on its device. A piece is read from disk once per tenant, checked against
the plan, cut to that share and staged to the device (keys kept in float32, the precision the
notes were compiled in, so a re-rotation rounds once; values in the serving dtype); keys turned
to a position are kept as well, so a piece placed at the same offset again costs a copy. Both
live in one bounded LRU (:class:`PieceCache`). Rotation runs on the device.

A load whose piece cannot be read, fails its checks or no longer matches the plan is not
written at all: its blocks are returned for vLLM to recompute (``kv_load_failure_policy``
``"recompute"``), and the log names the skill. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.errors import InvalidArgumentError, NotebookFileError
from kvnotes.core.positions.rope import rotate_keys
from kvnotes.serving.library.manifest import ENTRY_SUFFIX, ServingManifest, read_entry
from kvnotes.serving.library.splice import PieceInfo, Placement
from kvnotes.serving.vllm.plans import LoadSpec

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these


def rank_heads(total: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads (of ``total``) tensor-parallel rank ``tp_rank`` of ``tp_size`` holds.

    vLLM's ``QKVParallelLinear``: with at least as many heads as ranks each rank holds
    ``total // tp_size`` consecutive heads; with fewer, each head is replicated on
    ``tp_size // total`` consecutive ranks and a rank holds one.

    Example:
        >>> rank_heads(8, 4, 1), rank_heads(3, 3, 2), rank_heads(2, 4, 3)
        (range(2, 4), range(2, 3), range(1, 2))
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    if tp_size >= total:
        if tp_size % total:
            raise InvalidArgumentError(f"{total} KV heads cannot be replicated over "
                                       f"{tp_size} tensor-parallel ranks")
        head = tp_rank // (tp_size // total)
        return range(head, head + 1)
    if total % tp_size:
        raise InvalidArgumentError(f"{total} KV heads cannot be split over {tp_size} "
                                   "tensor-parallel ranks")
    per = total // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


@dataclass(frozen=True, slots=True)
class WorkerShare:
    """What one worker writes: ``heads`` of ``layers`` (manifest indices), as ``dtype`` tensors
    on ``device`` (the dtype the model's forward hands the backend's cache write)."""

    device: torch.device
    dtype: torch.dtype
    heads: range
    layers: tuple[int, ...]


def stage(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (a host tensor) as ``dtype`` on ``device``: cast on the host, then one copy, from
    pinned memory and without blocking the host when the device is a GPU (the copy is ordered
    before any kernel that reads it on the same stream)."""
    t = t.to(dtype).contiguous()
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PieceCache:
    """A bounded LRU of device tensors: pieces ``(keys fp32, values)`` and turned keys.

    Entries are keyed by tenant first, so one tenant's requests never hit (or time) another's.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, ...]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[Any, ...]) -> tuple[torch.Tensor, ...] | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def put(self, key: tuple[Any, ...], value: tuple[torch.Tensor, ...]) -> None:
        size = _nbytes(*value)
        if size > self.max_bytes:
            return  # larger than the whole budget: used once, never kept
        self.drop(key)
        self._items[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= _nbytes(*old)

    def drop(self, key: tuple[Any, ...]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= _nbytes(*old)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


class PieceUnavailable(Exception):
    """One piece of a load could not be used (names the skill for the log)."""

    def __init__(self, piece: PieceInfo, reason: str) -> None:
        super().__init__(f"skill {piece.name!r} ({piece.key}): {reason}")
        self.piece = piece


class KvWriter:
    """Builds and writes loads for one worker's share of the cache.

    Args:
        folder: the serving folder (``ROOT/<fingerprint id>``) the scheduler planned from.
        manifest: its manifest (model shape and RoPE tables).
        share: this worker's device, dtype, KV heads and layers.
        max_bytes: bound on the device tensors kept between loads.
        max_entry_bytes: entries larger than this on disk are refused unread.
    """

    def __init__(self, folder: str | os.PathLike[str], manifest: ServingManifest,
                 share: WorkerShare, *, max_bytes: int = 2 << 30,
                 max_entry_bytes: int = 1 << 30) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.fingerprint = manifest.fingerprint_obj
        self.share = share
        self.max_entry_bytes = int(max_entry_bytes)
        self.cache = PieceCache(max_bytes)
        self._row = {layer: row for row, layer in enumerate(share.layers)}
        # layers that share a RoPE table turn in one op: [(rows on the device, inv_freq)]
        groups: dict[tuple[float, ...], list[int]] = {}
        for row, layer in enumerate(share.layers):
            groups.setdefault(tuple(manifest.inv_freqs[layer]), []).append(row)
        self._rope = [(torch.tensor(rows, device=share.device),
                       torch.tensor(freqs, dtype=torch.float64, device=share.device))
                      for freqs, rows in groups.items()]
        self._heads = torch.tensor(list(share.heads))
        self._layers = torch.tensor(list(share.layers))

    # ---- pieces on the device ----------------------------------------------------------------
    def piece(self, tenant: str | None, info: PieceInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (float32) and values (serving dtype) ``[layers, n, heads, head_dim]`` of this
        worker's share of ``info``, on the device; read from disk when not cached."""
        key = (tenant, "piece", info.key)
        hit = self.cache.get(key)
        if hit is not None:
            return hit[0], hit[1]
        path = self.folder / f"{info.key}{ENTRY_SUFFIX}"
        try:
            size = path.stat().st_size
        except OSError as err:
            raise PieceUnavailable(info, f"gone from {self.folder} ({err.strerror})") from err
        if size > self.max_entry_bytes:
            raise PieceUnavailable(info, f"{size} bytes on disk, over the entry cap of "
                                         f"{self.max_entry_bytes}")
        try:
            found, keys, values = read_entry(path, self.fingerprint)
        except (NotebookFileError, OSError, ValueError) as err:
            raise PieceUnavailable(info, str(err)) from err
        if (found.token_ids, found.origin) != (info.token_ids, info.origin):
            raise PieceUnavailable(info, "the file no longer holds the tokens it was planned "
                                         "with (replaced since)")
        if keys.shape[0] != self.manifest.num_layers or keys.shape[2] != self.manifest.num_kv_heads:
            raise PieceUnavailable(info, f"shape {tuple(keys.shape)} does not fit the manifest")
        # this worker's layers and heads only: [layers, n, heads, head_dim]
        keys = keys.index_select(0, self._layers).index_select(2, self._heads)
        values = values.index_select(0, self._layers).index_select(2, self._heads)
        out = (stage(keys, self.share.device, torch.float32),
               stage(values, self.share.device, self.share.dtype))
        self.cache.put(key, out)
        return out

    def turned(self, tenant: str | None, p: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of ``p``'s piece turned to its place (serving dtype) and its values."""
        keys, values = self.piece(tenant, p.piece)
        if not p.delta and keys.dtype == self.share.dtype:
            return keys, values  # a float32 server at the compiled position: nothing to do
        key = (tenant, "turned", p.piece.key, p.delta)
        hit = self.cache.get(key)
        if hit is not None:
            return hit[0], values
        if p.delta:
            out = torch.empty_like(keys)
            for rows, inv_freq in self._rope:
                out[rows] = rotate_keys(keys[rows], inv_freq, p.delta)
            turned = out.to(self.share.dtype)
        else:
            turned = keys.to(self.share.dtype)
        self.cache.put(key, (turned,))
        return turned, values

    # ---- loads -------------------------------------------------------------------------------
    def assemble(self, load: LoadSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[layers, end - start, heads, head_dim]`` of ``load``'s tokens, for
        this worker's layers, on the device; :class:`PieceUnavailable` before anything is
        written when a piece cannot be used."""
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for p in load.pieces():
            k, v = self.turned(load.tenant, p)
            lo, hi = max(load.start, p.start) - p.start, min(load.end, p.end) - p.start
            keys.append(k[:, lo:hi])
            values.append(v[:, lo:hi])
        n = sum(k.shape[1] for k in keys)
        if n != load.end - load.start:
            raise AssertionError(f"request {load.req_id}: the run covers {n} of the tokens "
                                 f"[{load.start}, {load.end})")
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def write(self, loads: Sequence[LoadSpec], layers: Sequence[tuple[int, Any]]) -> set[int]:
        """Write each load into every layer of ``layers`` (``(manifest index, attention layer)``:
        ``layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slots)``); returns
        the blocks of the loads that failed, for vLLM to recompute."""
        failed: set[int] = set()
        for load in loads:
            t0 = time.perf_counter()
            try:
                keys, values = self.assemble(load)
            except (PieceUnavailable, torch.OutOfMemoryError) as err:
                if isinstance(err, torch.OutOfMemoryError):  # staging a piece: drop the cache
                    self.cache = PieceCache(self.cache.max_bytes)
                log.warning("kvnotes: request %s%s: %s; its tokens [%d, %d) are recomputed",
                            load.req_id, _tenant(load), err, load.start, load.end)
                failed.update(load.written_blocks)
                continue
            slots = stage(load.slots(), self.share.device, torch.long)
            for i, layer in layers:
                row = self._row[i]
                layer.impl.do_kv_cache_update(layer, keys[row], values[row], layer.kv_cache,
                                              slots)
            log.info("kvnotes: request %s%s: spliced tokens [%d, %d) from %d pieces in %.1f ms",
                     load.req_id, _tenant(load), load.start, load.end, len(load.pieces()),
                     1000 * (time.perf_counter() - t0))
        return failed


def _tenant(load: LoadSpec) -> str:
    return f" (tenant {load.tenant})" if load.tenant else ""
