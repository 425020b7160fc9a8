"""Notebook storage and the one place a transformers cache is built from notebooks.

:class:`KVStore` holds per-layer buffers with spare capacity, ``[1, kv_heads, capacity, d]``
each, plus the token ids and positions, and a fill point: tokens ``[0, fill)`` are written and
never change again. A :class:`~kvnotes.core.notebook.Notebook` is an immutable view
``[start, end)`` onto a store. Appending after a view that ends at the fill point writes in
place (nothing earlier is copied); appending after any other view first copies that view into a
new store (copy-on-write), so no notebook ever sees another one's tokens change. Buffers grow by
doubling, so a run of appends copies each token O(1) times on average.

:class:`NotebookCache` is the transformers cache handed to the model for one forward: each
layer writes the new keys/values into the store and returns views, so a forward over L cached
tokens costs attention over L, not a copy of L. Every layer is a full (non-sliding) layer: a
sliding-window layer still gets all tokens and the model's own sliding mask hides the ones
outside its window, as at prefill (transformers' sliding cache layers would drop them).
:func:`build_cache` stacks equal-length notebooks along the batch axis (patching's hybrids);
:func:`build_padded_cache` stacks notebooks of any lengths, left-padded (batched decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from kvnotes.core.notebook import Notebook


class KVStore:
    """Growable per-layer KV buffers shared by the notebooks that view them.

    ``keys[l]`` / ``values[l]`` are ``[1, kv_heads, capacity, head_dim]`` (``None`` until the
    first write tells the shape); ``token_ids`` and ``positions`` are LongTensor[capacity].
    ``fill`` counts the tokens written; they never change afterwards.
    """

    __slots__ = ("keys", "values", "token_ids", "positions", "fill", "capacity")

    def __init__(self, num_layers: int, capacity: int = 0) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.token_ids = torch.zeros(capacity, dtype=torch.long)
        self.positions = torch.zeros(capacity, dtype=torch.long)
        self.fill = 0
        self.capacity = capacity

    @classmethod
    def wrap(cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
             token_ids: torch.Tensor, positions: torch.Tensor, num_layers: int) -> KVStore:
        """A full store around existing tensors, without copying them (capacity = length).

        Nothing is ever written into wrapped tensors: the first append finds no room and moves
        the store to new, larger buffers.
        """
        n = token_ids.numel()
        store = cls(num_layers, 0)
        if keys:
            store.keys, store.values = list(keys), list(values)
        store.token_ids, store.positions = token_ids, positions
        store.fill = store.capacity = n
        return store

    @property
    def nbytes(self) -> int:
        """Bytes held by the KV buffers (capacity included)."""
        return sum(t.nbytes for t in (*self.keys, *self.values) if t is not None)

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` tokens (grows to at least double; copies ``[0, fill)``)."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)
        for side in (self.keys, self.values):
            for l, old in enumerate(side):
                if old is None:
                    continue
                new = old.new_empty(*old.shape[:-2], capacity, old.shape[-1])
                new[..., :self.fill, :].copy_(old[..., :self.fill, :])
                side[l] = new
        for name in ("token_ids", "positions"):
            old = getattr(self, name)
            new = torch.zeros(capacity, dtype=torch.long)
            new[:self.fill] = old[:self.fill]
            setattr(self, name, new)
        self.capacity = capacity

    def claim(self, start: int, count: int, *, capacity: int = 0) -> None:
        """Take ``[start, start + count)`` for writing; ``start`` must be the fill point.

        ``capacity`` asks for room for that many tokens in all (compose knows its total).
        """
        assert start == self.fill, "only the fill point can be appended to"
        self.reserve(max(start + count, capacity))
        self.fill = start + count

    def release(self, start: int, end: int) -> None:
        """Give back a claim ``[start, end)`` nothing refers to (a forward that stopped early)."""
        if self.fill == end:
            self.fill = start

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``keys``/``values`` ``[1, kv_heads, q, d]`` into ``[start, start + q)``."""
        k_out, v_out = self.slots(layer, start, keys.shape[-2], keys, values)
        k_out.copy_(keys)
        v_out.copy_(values)

    def slots(self, layer: int, start: int, count: int, keys_like: torch.Tensor,
              values_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views ``[start, start + count)`` of one layer (allocating it if needed)."""
        if self.keys[layer] is None:
            self.keys[layer] = keys_like.new_empty(
                *keys_like.shape[:-2], self.capacity, keys_like.shape[-1])
            self.values[layer] = values_like.new_empty(
                *values_like.shape[:-2], self.capacity, values_like.shape[-1])
        k, v = self.keys[layer], self.values[layer]
        assert k is not None and v is not None
        return k[..., start:start + count, :], v[..., start:start + count, :]

    def view(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        assert k is not None and v is not None, "reading a layer that was never written"
        return k[..., start:end, :], v[..., start:end, :]


class NotebookLayer(DynamicLayer):
    """One layer of :class:`NotebookCache`: new tokens go into the store, views come out."""

    is_sliding = False  # the model's own mask does the windowing (see the module docstring)

    def __init__(self, store: KVStore, layer: int, start: int, end: int) -> None:
        super().__init__()
        self.store, self.layer, self.start, self.end = store, layer, start, end
        if end > start and store.keys[layer] is not None:
            self.keys, self.values = store.view(layer, start, end)
            self.device = self.keys.device
            self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store.write(self.layer, self.end, key_states, value_states)
        self.end += key_states.shape[-2]
        self.keys, self.values = self.store.view(self.layer, self.start, self.end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start


class NotebookCache(DynamicCache):
    """The cache for one forward on top of the view ``[start, end)`` of ``store``.

    The caller has claimed ``[end, end + q)`` in the store (:meth:`KVStore.claim`); each layer's
    update writes the new tokens there and returns views of ``[start, end + q)``.
    """

    def __init__(self, store: KVStore, start: int, end: int) -> None:
        super().__init__()
        self.layers = [NotebookLayer(store, l, start, end) for l in range(len(store.keys))]
        self.layer_class_to_replicate = None


def build_cache(notebooks: Sequence[Notebook]) -> DynamicCache:
    """A plain transformers cache of equal-length notebooks stacked along the batch axis.

    For forwards whose new tokens are not kept (patching's hybrids); the tensors are copied
    once into the batch (a ``DynamicLayer`` update concatenates into new tensors, so the
    notebooks are never written).
    """
    first = notebooks[0]
    if not len(first):
        return DynamicCache()
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    for l in range(first.num_layers):
        keys = torch.cat([nb.keys(l) for nb in notebooks])  # [b, kv_heads, n, head_dim]
        values = torch.cat([nb.values(l) for nb in notebooks])
        hf_layer = DynamicLayer()
        hf_layer.lazy_initialization(keys, values)
        hf_layer.keys, hf_layer.values = keys, values
        cache.layers.append(hf_layer)
    return cache


def build_padded_cache(notebooks: Sequence[Notebook]) -> tuple[DynamicCache, list[int]]:
    """Notebooks of any lengths stacked along the batch axis, each left-padded with zeros to
    the longest; returns the cache and each row's number of pad slots.

    The caller masks the pads out (a 2-D attention mask with zeros there). Padding on the left
    keeps the distance, in cache slots, from every new token to each real note the same as in
    the notebook alone, so a sliding window (which counts slots) covers the same notes. The
    tensors are copied once into the batch; the notebooks are never written.
    """
    width = max(len(nb) for nb in notebooks)
    pads = [width - len(nb) for nb in notebooks]
    if not width:
        return DynamicCache(), pads
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    for l in range(notebooks[0].num_layers):
        keys = torch.cat([_left_pad(nb.keys(l), p) for nb, p in zip(notebooks, pads, strict=True)])
        values = torch.cat([_left_pad(nb.values(l), p)
                            for nb, p in zip(notebooks, pads, strict=True)])
        hf_layer = DynamicLayer()  # [b, kv_heads, width, d]
        hf_layer.lazy_initialization(keys, values)
        hf_layer.keys, hf_layer.values = keys, values
        cache.layers.append(hf_layer)
    return cache, pads


def _left_pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` ([1, heads, n, d]) with ``pad`` zero slots before its tokens."""
    if not pad:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], pad, t.shape[-1]), t], dim=2)
