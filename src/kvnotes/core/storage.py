"""Notebook storage: growable per-layer KV buffers and the claims that write into them.

:class:`KVStore` holds per-layer buffers with spare capacity, ``[1, kv_heads, capacity, d]``
each, plus the token ids and positions, and a fill point: tokens ``[0, fill)`` are written and
never change again (a repair that recomputes notes in place does so only in storage nobody else
views). A :class:`~kvnotes.core.notebook.Notebook` is an immutable view ``[start, end)`` onto a
store. Appending after a view that ends at the fill point writes in place (nothing earlier is
copied); appending after any other view first copies that view into a new store
(copy-on-write), so no notebook ever sees another one's tokens change. Buffers grow by doubling,
so a run of appends copies each token O(1) times on average.

A :class:`Claim` names the rows one write fills; the notebook hands it out
(:meth:`~kvnotes.core.notebook.Notebook.append`) and whoever writes the notes (a model forward
through :class:`~kvnotes.core.cache.NotebookCache`, a splice's re-rotation) writes into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KVStore:
    """Growable per-layer KV buffers shared by the notebooks that view them.

    ``keys[l]`` / ``values[l]`` are ``[1, kv_heads, capacity, head_dim]`` (``None`` until the
    first write tells the shape); ``token_ids`` and ``positions`` are LongTensor[capacity].
    ``fill`` counts the tokens written; they never change afterwards, except that an in-place
    repair (:meth:`~kvnotes.core.notebook.Notebook.rewritten`) rewrites rows of a store its
    caller alone views.
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

    def claim(self, start: int, count: int) -> None:
        """Take ``[start, start + count)`` for writing; ``start`` must be the fill point."""
        assert start == self.fill, "only the fill point can be appended to"
        self.reserve(start + count)
        self.fill = start + count

    def release(self, start: int, end: int) -> None:
        """Give back a claim ``[start, end)`` nothing refers to (a probe, a failed write)."""
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


@dataclass(frozen=True, slots=True)
class Claim:
    """Rows ``[end, end + count)`` of ``store`` to write, after the notes at ``[start, end)``.

    A forward writes the new tokens' notes there attending to ``[start, end)``; a splice or a
    copy writes them directly (:meth:`slots`). Every layer of the claimed rows must be written.
    """

    store: KVStore
    start: int
    end: int
    count: int

    def slots(self, layer: int, keys_like: torch.Tensor, values_like: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of the claimed rows of one layer (allocated like ``keys_like``)."""
        return self.store.slots(layer, self.end, self.count, keys_like, values_like)

    def written(self) -> bool:
        """Whether every layer has buffers (a claim nobody wrote leaves some unallocated)."""
        return all(k is not None for k in self.store.keys)
