"""The worker side of compiling by the server's own prefill: a request's KV read back from its
blocks after the forward and written as a library entry, whole or not at all.

The entry is the one the engine writes (:meth:`kvnotes.core.notebook.Notebook.save`'s file:
post-RoPE keys and values per layer as ``[1, kv_heads, n, head_dim]`` float32, token ids,
positions ``start..end-1``, the manifest's model fingerprint and scheme) plus, in ``meta``,
``producer: "vllm"`` and ``kv_dtype`` (the dtype the server computed the KV in), the chunk's
``prefix_ids`` (the prompt before it, its anchor) and its tenant. It is written through
:func:`kvnotes.core.files.write` (a temporary beside it, flushed, renamed): a reader sees all
of it or nothing.

Reading the paged cache needs its layout, which is the attention backend's (and, on CPUs,
its kernels' ISA: the ``vec`` kernels keep each block's keys transposed per head). Before the
first save :class:`CacheReader` learns it from the backend itself: it writes known keys and
values through the backend's own ``do_kv_cache_update`` into vLLM's null block (block 0, never
handed to a request) and looks where they landed (a cache whose first dimension is the block:
CPU), or checks that they read back through the standard GPU layouts (``[2, blocks, block,
heads, dim]``, ``[blocks, 2, block, heads, dim]``). A cache it cannot read back exactly (an fp8
or scaled cache, another layout) is refused and every save fails, logged and counted: never a
wrong entry. Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from kvnotes.core import files
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import (
    ENTRY_FORMAT,
    ENTRY_SUFFIX,
    ENTRY_VERSION,
    ServingManifest,
)
from kvnotes.serving.vllm.saves import SaveSpec

log = logging.getLogger("vllm.kvnotes")  # a child of vLLM's logger: its handler prints these

PRODUCER = "vllm"
NULL_BLOCK = 0  # vLLM's null block: a placeholder no request's tokens live in


class UnreadableCache(Exception):
    """The cache's layout is not one :class:`CacheReader` reads back exactly."""


class CacheReader:
    """Keys and values ``[n, heads, head_dim]`` of slots in one layer's paged cache.

    ``layout``: ``"blockwise"`` (a cache whose first dimension is the block, each block's
    keys and values in an order the backend picks: the CPU backend's ``[blocks, heads, block,
    2*head_dim]`` stores keys transposed per head for its vector kernels, and other ISAs pack
    differently; ``k_index``/``v_index`` ``[block_size, heads, head_dim]`` say where each
    element lies in a block, learned by :meth:`discover`), ``"kv_first"`` (``[2, blocks,
    block_size, heads, head_dim]``) or ``"kv_second"`` (``[blocks, 2, block_size, heads,
    head_dim]``).
    """

    def __init__(self, layout: str, block_size: int, k_index: torch.Tensor | None = None,
                 v_index: torch.Tensor | None = None) -> None:
        self.layout, self.block_size = layout, block_size
        self.k_index, self.v_index = k_index, v_index

    @classmethod
    def of(cls, layer: Any, block_size: int, heads: int, head_dim: int,
           dtype: torch.dtype) -> CacheReader:
        """The reader of ``layer``'s cache, checked against the backend's own write."""
        cache = layer.kv_cache
        shape = tuple(cache.shape)
        if len(shape) == 5 and shape[2:] == (block_size, heads, head_dim) and 2 in shape[:2]:
            reader = cls("kv_first" if shape[0] == 2 else "kv_second", block_size)
            probe(layer, reader, heads, head_dim, dtype)
            return reader
        if len(shape) >= 2 and cache[0].numel() == 2 * block_size * heads * head_dim:
            k_index, v_index = discover(layer, block_size, heads, head_dim, dtype)
            return cls("blockwise", block_size, k_index, v_index)
        raise UnreadableCache(f"a KV cache of shape {shape} (block size {block_size}, {heads} "
                              f"heads of {head_dim}) is not a layout kvnotes reads")

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = slots // self.block_size, slots % self.block_size
        if self.layout == "blockwise":
            assert self.k_index is not None and self.v_index is not None
            rows = cache.reshape(cache.shape[0], -1)[blocks]  # [n, block's elements]
            n = len(slots)
            k_at = self.k_index.to(cache.device)[offsets].reshape(n, -1)
            v_at = self.v_index.to(cache.device)[offsets].reshape(n, -1)
            shape = (n, *self.k_index.shape[1:])
            return rows.gather(1, k_at).reshape(shape), rows.gather(1, v_at).reshape(shape)
        if self.layout == "kv_first":
            return cache[0][blocks, offsets], cache[1][blocks, offsets]
        return cache[blocks, 0, offsets], cache[blocks, 1, offsets]


def _null_slots(block_size: int, device: torch.device) -> torch.Tensor:
    start = NULL_BLOCK * block_size
    return torch.arange(start, start + block_size, device=device, dtype=torch.long)


def discover(layer: Any, block_size: int, heads: int, head_dim: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the backend puts each key and value element of a block: ``(k_index, v_index)``
    ``[block_size, heads, head_dim]`` of flat positions in the block. Learned by writing each
    coordinate (token, head, dim; plus one, small integers exact in bf16 and fp16) through
    ``do_kv_cache_update`` into the null block, keys and values apart; :class:`UnreadableCache`
    when the writes do not give every element one place (an fp8 cache, a scaled one)."""
    cache = layer.kv_cache
    slots = _null_slots(block_size, cache.device)
    grids = torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(head_dim),
                           indexing="ij")
    found = []
    for side in (0, 1):
        coords = []
        for grid in grids:
            cache[NULL_BLOCK].zero_()
            src = (grid + 1).to(dtype=dtype, device=cache.device)
            key, value = (src, torch.zeros_like(src)) if side == 0 else (torch.zeros_like(src),
                                                                          src)
            layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
            coords.append(cache[NULL_BLOCK].reshape(-1).float().cpu() - 1)
        t, h, d = coords
        where = (t >= 0).nonzero().flatten()
        index = torch.full((block_size, heads, head_dim), -1, dtype=torch.long)
        if len(where) == index.numel():
            index[t[where].long(), h[where].long(), d[where].long()] = where
        if len(where) != index.numel() or bool((index < 0).any()):
            raise UnreadableCache(f"the backend's write into a block of {tuple(cache.shape)} "
                                  f"{cache.dtype} does not give each element one place")
        found.append(index)
    cache[NULL_BLOCK].zero_()
    return found[0], found[1]


def probe(layer: Any, reader: CacheReader, heads: int, head_dim: int,
          dtype: torch.dtype) -> None:
    """Write known keys and values into the null block through the backend and read them back
    with ``reader``; :class:`UnreadableCache` when they differ."""
    cache = layer.kv_cache
    n = reader.block_size
    device = cache.device
    grid = torch.arange(n * heads * head_dim, device=device, dtype=torch.float32)
    # small integers (exact in bf16 and fp16), a different one in each coordinate
    keys = (grid % 251 + 1).reshape(n, heads, head_dim).to(dtype)
    values = -(grid % 241 + 1).reshape(n, heads, head_dim).to(dtype)
    slots = _null_slots(n, device)
    layer.impl.do_kv_cache_update(layer, keys, values, cache, slots)
    got_k, got_v = reader.read(cache, slots)
    if not (torch.equal(got_k.to(dtype), keys) and torch.equal(got_v.to(dtype), values)):
        raise UnreadableCache(f"the {reader.layout} layout does not read back what the "
                              f"backend wrote (cache {tuple(cache.shape)} {cache.dtype})")


class KvSaver:
    """Saves :class:`~kvnotes.serving.vllm.saves.SaveSpec` s of one worker that holds every
    layer and every KV head (tensor and pipeline parallelism: see :meth:`can_save`).

    Args:
        folder: the serving folder entries are written to (``ROOT/<fingerprint id>``).
        manifest: its manifest (fingerprint, scheme, layers).
        heads: the KV heads this worker holds; head_dim, block_size, dtype: the cache's.
    """

    def __init__(self, folder: str | Path, manifest: ServingManifest, *, heads: range,
                 head_dim: int, block_size: int, dtype: torch.dtype) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.heads, self.head_dim, self.block_size = heads, head_dim, block_size
        self.dtype = dtype
        self.saved = 0
        self.failed = 0
        self._reader: CacheReader | None = None
        self._refused: str | None = None

    def can_save(self, layers: Sequence[tuple[int, Any]]) -> str | None:
        """Why this worker cannot save whole entries (None: it can)."""
        if len(self.heads) != self.manifest.num_kv_heads:
            return (f"this worker holds KV heads {self.heads.start}..{self.heads.stop - 1} of "
                    f"{self.manifest.num_kv_heads} (tensor parallelism)")
        if [i for i, _ in layers] != list(range(self.manifest.num_layers)):
            return "this worker holds some of the layers only (pipeline parallelism)"
        return None

    def reader(self, layer: Any) -> CacheReader:
        """The cache's reader, checked once against the backend's own write."""
        if self._refused is not None:
            raise UnreadableCache(self._refused)
        if self._reader is None:
            try:
                reader = CacheReader.of(layer, self.block_size, len(self.heads), self.head_dim,
                                        self.dtype)
            except UnreadableCache as err:
                self._refused = str(err)
                raise
            self._reader = reader
        return self._reader

    def save(self, specs: Sequence[SaveSpec], layers: Sequence[tuple[int, Any]]) -> int:
        """Write each spec's entry from ``layers`` (``(manifest index, attention layer)``, in
        manifest order); returns how many were written. A spec that cannot be written is
        logged and counted in :attr:`failed`, and leaves no file."""
        written = 0
        why = self.can_save(layers)
        for spec in specs:
            t0 = time.perf_counter()
            try:
                if why is not None:
                    raise UnreadableCache(why)
                path = self.write(spec, layers)
            except Exception as err:  # noqa: BLE001 -- a failed save costs an entry, never the server
                self.failed += 1
                log.warning("kvnotes: compile request %s: entry %s not saved: %s", spec.req_id,
                            spec.key, err)
                continue
            written += 1
            self.saved += 1
            log.info("kvnotes: compile request %s: saved %s (%s, %d tokens behind %d) in "
                     "%.1f ms", spec.req_id, path.name, spec.name, len(spec.token_ids),
                     spec.start, 1000 * (time.perf_counter() - t0))
        return written

    def write(self, spec: SaveSpec, layers: Sequence[tuple[int, Any]]) -> Path:
        """The entry of ``spec``, read from every layer's cache, written atomically."""
        n = len(spec.token_ids)
        tensors: dict[str, torch.Tensor] = {
            "token_ids": torch.tensor(spec.token_ids, dtype=torch.long),
            "positions": torch.arange(spec.start, spec.end, dtype=torch.long)}
        slots = spec.slots()  # the same slots in every layer: moved to a device once
        on_device: dict[torch.device, torch.Tensor] = {}
        for i, layer in layers:
            reader = self.reader(layer)
            device = layer.kv_cache.device
            if device not in on_device:
                on_device[device] = slots.to(device)
            keys, values = reader.read(layer.kv_cache, on_device[device])  # [n, heads, head_dim]
            # the HF cache's layout, as the engine saves: [1, heads, n, head_dim] float32
            tensors[f"layers.{i}.keys"] = keys.float().transpose(0, 1).unsqueeze(0).cpu()
            tensors[f"layers.{i}.values"] = values.float().transpose(0, 1).unsqueeze(0).cpu()
        path = self.folder / f"{spec.key}{ENTRY_SUFFIX}"
        return files.write(path, tensors, self.header(spec, n))

    def header(self, spec: SaveSpec, n: int) -> JsonObject:
        """The entry's header: a notebook file's, with the producer recorded."""
        bos = self.manifest.bos_id
        anchor = "bos" if bos is not None and spec.behind[:1] == (bos,) else "none"
        meta: JsonObject = {
            "kind": "skill", "name": spec.name, "anchor": anchor,
            "after_tokens": spec.start - (anchor == "bos"), "prefix_len": spec.start,
            "prefix_ids": list(spec.behind), "producer": PRODUCER,
            "kv_dtype": str(self.dtype).removeprefix("torch.")}
        if spec.tenant is not None:
            meta["tenant"] = spec.tenant
        return {"format": ENTRY_FORMAT, "version": ENTRY_VERSION,
                "fingerprint": cast(JsonObject, self.manifest.fingerprint), "scheme": self.manifest.scheme,
                "length": n, "num_layers": self.manifest.num_layers, "origin": spec.start,
                "spans": [[spec.name, "skill", 0, n]], "meta": meta}
