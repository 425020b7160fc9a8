"""The one place a transformers cache is built from notebooks.

:class:`NotebookCache` is the transformers cache handed to the model for one forward into a
:class:`~kvnotes.core.storage.Claim`: each layer writes the new keys/values into the claimed
rows of the store and returns views, so a forward over L cached tokens costs attention over L,
not a copy of L. Every layer is a full (non-sliding) layer: a sliding-window layer still gets
all tokens and the model's own sliding mask hides the ones outside its window, as at prefill
(transformers' sliding cache layers would drop them).
:func:`build_cache` stacks equal-length notebooks along the batch axis (patching's hybrids);
:func:`build_padded_cache` stacks notebooks of any lengths, left-padded (batched decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvnotes.core.storage import Claim, KVStore

if TYPE_CHECKING:
    from kvnotes.core.notebook import Notebook


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
    """The cache for one forward that writes ``claim``: on top of the notes ``[start, end)``,
    each layer's update writes the new tokens at ``[end, end + q)`` and returns views of
    ``[start, end + q)``."""

    def __init__(self, claim: Claim) -> None:
        super().__init__()
        store = claim.store
        self.layers = [NotebookLayer(store, l, claim.start, claim.end)
                       for l in range(len(store.keys))]
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
