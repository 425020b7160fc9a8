"""The one place a transformers cache is built from notebooks.

Every layer is a full ``DynamicLayer``: a sliding-window layer still gets all tokens and the
model's own sliding mask hides the ones outside its window, as at prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from kvnotes.core.notebook import Notebook


def build_cache(notebooks: Sequence[Notebook]) -> DynamicCache:
    """A transformers cache holding every token of every layer of ``notebooks``.

    One notebook: its tensors are handed over without a copy (a ``DynamicLayer`` update
    concatenates into a new tensor, so feeding more tokens never writes into them). Several
    notebooks of equal length are stacked along the batch axis (patching's hybrids).
    """
    cache = DynamicCache()
    first = notebooks[0]
    for l in range(len(first.layers)):
        if len(notebooks) == 1:
            keys, values = first.keys(l), first.values(l)
        else:
            keys = torch.cat([nb.keys(l) for nb in notebooks])  # [b, kv_heads, n, head_dim]
            values = torch.cat([nb.values(l) for nb in notebooks])
        hf_layer = DynamicLayer()
        hf_layer.lazy_initialization(keys, values)
        hf_layer.keys, hf_layer.values = keys, values
        cache.layers.append(hf_layer)
    return cache
