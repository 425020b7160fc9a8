"""The Notebook: the KV cache a model wrote for a token sequence, with positions and named spans.

Layout (one sequence, batch 1):

- ``layers[l].keys``   FloatTensor[1, kv_heads, n, head_dim]  post-RoPE, as transformers caches them
- ``layers[l].values`` FloatTensor[1, kv_heads, n, head_dim_v]
- ``token_ids``        LongTensor[n]
- ``positions``        LongTensor[n]  the RoPE position each key was rotated to
- ``spans``            named token ranges (text, field, skill, erratum, query)

A notebook keeps every token of every layer (sliding-window layers are never windowed here).
It is a view onto growable storage (:class:`kvnotes.core.cache.KVStore`); appending writes in
place when nothing else was appended to that storage since, and copies otherwise
(copy-on-write). :mod:`kvnotes.core.cache` is the one place a transformers cache is built from
notebooks. Every operation returns a new notebook; none changes its input.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvnotes.core import files, validate
from kvnotes.core.cache import KVStore
from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyInputError,
    InvalidArgumentError,
    NotebookMismatchError,
    PositionError,
    UnknownFieldError,
)
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.positions import PositionAdapter

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

SPAN_KINDS = ("text", "field", "skill", "erratum", "query")
FILE_FORMAT = "kvnotes.notebook"
FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Span:
    """A named token range ``[start, end)`` of a notebook (token indices, not positions)."""

    name: str
    kind: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.kind not in SPAN_KINDS:
            raise ValueError(f"span kind {self.kind!r} is not one of {SPAN_KINDS}")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"span {self.name!r} has bad bounds [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def moved(self, offset: int) -> Span:
        return replace(self, start=self.start + offset, end=self.end + offset)


@dataclass(frozen=True, slots=True)
class LayerKV:
    """One layer's cached keys and values for a sequence."""

    keys: torch.Tensor  # [1, kv_heads, n, head_dim], post-RoPE
    values: torch.Tensor  # [1, kv_heads, n, head_dim_v]

    def __len__(self) -> int:
        return self.keys.shape[-2]

    def slice(self, start: int, end: int) -> LayerKV:
        return LayerKV(self.keys[..., start:end, :], self.values[..., start:end, :])


class Notebook:
    """The notes a model wrote at prefill: per-layer KV, positions, token ids and named spans.

    A notebook is an immutable view ``[start, end)`` onto a :class:`~kvnotes.core.cache.KVStore`
    (growable per-layer buffers). Feeding tokens after a notebook whose view ends at its store's
    fill point writes them in place; after any other notebook the view is copied first
    (copy-on-write), so an operation never changes a notebook anyone holds.

    Example:
        >>> nb = engine.prefill("Order status: pending")          # doctest: +SKIP
        >>> later = nb.shifted(100)                              # doctest: +SKIP
        >>> bool((later.positions == nb.positions + 100).all())  # doctest: +SKIP
        True
    """

    __slots__ = ("_store", "_start", "_end", "spans", "adapter", "fingerprint", "meta", "origin",
                 "last_logits")

    def __init__(
        self,
        layers: Sequence[LayerKV],
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spans: Iterable[Span],
        adapter: PositionAdapter,
        fingerprint: ModelFingerprint,
        meta: dict[str, Any] | None = None,
        origin: int = 0,
        *,
        last_logits: torch.Tensor | None = None,
    ) -> None:
        layers = tuple(layers)
        token_ids = token_ids.to(torch.long).reshape(-1)
        positions = positions.to(torch.long).reshape(-1)
        n = token_ids.numel()
        assert positions.numel() == n, "positions and token ids differ in length"
        assert all(len(layer) == n for layer in layers), "a layer's length differs from n"
        assert n == 0 or len(layers) == adapter.num_layers, "layer count differs from model"
        store = KVStore.wrap([l.keys for l in layers] if n else [],
                             [l.values for l in layers] if n else [],
                             token_ids, positions, adapter.num_layers)
        self._init(store, 0, n, spans, adapter, fingerprint, meta, origin, last_logits)

    def _init(self, store: KVStore, start: int, end: int, spans: Iterable[Span],
              adapter: PositionAdapter, fingerprint: ModelFingerprint,
              meta: dict[str, Any] | None, origin: int, last_logits: torch.Tensor | None) -> None:
        self._store, self._start, self._end = store, start, end
        self.spans: tuple[Span, ...] = tuple(spans)
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.meta: dict[str, Any] = dict(meta or {})
        self.origin = origin  # where the first token sits (the only position an empty one has)
        # FloatTensor[vocab]: the next-token logits after the last token, when the forward that
        # wrote it kept them (next_logits/greedy then need no forward)
        self.last_logits = last_logits
        assert 0 <= start <= end <= store.fill, "a view past the store's fill point"
        assert all(s.end <= end - start for s in self.spans), "a span runs past the notebook"

    @classmethod
    def from_storage(cls, store: KVStore, start: int, end: int, spans: Iterable[Span],
                     adapter: PositionAdapter, fingerprint: ModelFingerprint,
                     meta: dict[str, Any] | None = None, origin: int = 0, *,
                     last_logits: torch.Tensor | None = None) -> Notebook:
        """The view ``[start, end)`` of ``store`` as a notebook (no copy)."""
        nb = cls.__new__(cls)
        nb._init(store, start, end, spans, adapter, fingerprint, meta, origin, last_logits)
        return nb

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._end - self._start

    def __repr__(self) -> str:
        spans = ", ".join(f"{s.kind}:{s.name}[{s.start}:{s.end}]" for s in self.spans)
        first = int(self.positions[0]) if len(self) else self.origin
        return f"Notebook(n={len(self)}, positions={first}..{self.next_position - 1}, spans=[{spans}])"

    @property
    def token_ids(self) -> torch.Tensor:
        """LongTensor[n]: the token ids (a read-only view; do not write into it)."""
        return self._store.token_ids[self._start:self._end]

    @property
    def positions(self) -> torch.Tensor:
        """LongTensor[n]: the RoPE position each key was rotated to (a view; do not write)."""
        return self._store.positions[self._start:self._end]

    @property
    def layers(self) -> tuple[LayerKV, ...]:
        """Every layer's keys and values (views; empty for an empty notebook)."""
        if not len(self):
            return ()
        return tuple(LayerKV(*self._store.view(l, self._start, self._end))
                     for l in range(self.num_layers))

    @property
    def storage(self) -> KVStore:
        """The buffers this notebook views (shared with the notebooks it was extended from)."""
        return self._store

    @property
    def storage_range(self) -> tuple[int, int]:
        """``[start, end)``: where this notebook's tokens sit in :attr:`storage`."""
        return self._start, self._end

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def next_position(self) -> int:
        """The position the next appended token takes."""
        return int(self._store.positions[self._end - 1]) + 1 if len(self) else self.origin

    @property
    def start_position(self) -> int:
        return int(self._store.positions[self._start]) if len(self) else self.origin

    @property
    def nbytes(self) -> int:
        """Bytes of this notebook's keys and values (its own tokens, not the spare capacity)."""
        return sum(l.keys.nbytes + l.values.nbytes for l in self.layers)

    def keys(self, layer: int) -> torch.Tensor:
        """Post-RoPE keys of one layer, ``[1, kv_heads, n, head_dim]`` (never windowed)."""
        layer = validate.layer_index(layer, self.num_layers)  # -1 is refused, not wrapped
        return self._store.view(layer, self._start, self._end)[0]

    def values(self, layer: int) -> torch.Tensor:
        """Values of one layer, ``[1, kv_heads, n, head_dim_v]`` (never windowed)."""
        layer = validate.layer_index(layer, self.num_layers)
        return self._store.view(layer, self._start, self._end)[1]

    def span(self, name: str) -> Span:
        """The span called ``name``; the error lists the names there are."""
        for s in self.spans:
            if s.name == name:
                return s
        raise UnknownFieldError(
            f"no span named {name!r} in this notebook; spans: {[s.name for s in self.spans]}"
        )

    @property
    def fields(self) -> list[str]:
        return [s.name for s in self.spans if s.kind == "field"]

    # ---- appending (the engine's and splices' way in) ---------------------------------------
    @torch.inference_mode()
    def claim(self, count: int, *, capacity: int = 0) -> tuple[KVStore, int, int]:
        """Storage to append ``count`` tokens after this notebook: ``(store, start, end)``.

        This notebook's tokens sit at ``[start, end)`` of ``store`` and ``[end, end + count)``
        is claimed for writing. When the view ends at the store's fill point that is the same
        store (in place, nothing copied); otherwise the view is first copied into a new store
        (copy-on-write). ``capacity`` asks for room for that many tokens in all. Whoever
        claims must write every layer, token id and position of the claimed range, or give it
        back with :meth:`KVStore.release`.
        """
        store, start, end = self._store, self._start, self._end
        if end != store.fill:
            n = end - start
            fresh = KVStore(self.num_layers, max(capacity - start, n + count))
            if n:
                for l in range(self.num_layers):
                    keys, values = store.view(l, start, end)
                    k_out, v_out = fresh.slots(l, 0, n, keys, values)
                    k_out.copy_(keys)
                    v_out.copy_(values)
                fresh.token_ids[:n] = store.token_ids[start:end]
                fresh.positions[:n] = store.positions[start:end]
            fresh.fill = n
            store, start, end = fresh, 0, n
        store.claim(end, count, capacity=start + capacity)
        return store, start, end

    @torch.inference_mode()
    def splice(self, part: Notebook, *, allow_approximate: bool = False) -> Notebook:
        """``part``'s notes moved to follow this notebook and appended (keys re-rotated).

        The re-rotated keys are written straight into this notebook's storage (in place when
        it ends at the fill point). Spans of ``part`` follow it; ``part`` is never changed.
        """
        part.check_same_model(self.fingerprint, what="splice a notebook into")
        if not len(part):
            return self
        delta = self.next_position - part.start_position
        self._check_shift(delta, allow_approximate)
        positions = part.positions + delta
        self.adapter.check_positions(positions)
        m = len(part)
        store, start, end = self.claim(m)
        for l in range(self.num_layers):
            keys, values = part.keys(l), part.values(l)
            k_out, v_out = store.slots(l, end, m, keys, values)
            if delta:
                self.adapter.shift_layer_into(l, keys, values, delta, k_out, v_out)
            else:  # already in place (and schemes that cannot move notes allow this)
                k_out.copy_(keys)
                v_out.copy_(values)
        store.token_ids[end:end + m] = part.token_ids
        store.positions[end:end + m] = positions
        spans = [*self.spans, *(s.moved(len(self)) for s in part.spans)]
        return Notebook.from_storage(store, start, end + m, spans, self.adapter,
                                     self.fingerprint, self.meta, self.origin)

    # ---- new notebooks from this one ------------------------------------------------------
    def _with(self, **changes: Any) -> Notebook:
        """The same view with other spans/meta/origin/last_logits (no tensor is touched)."""
        args = dict(spans=self.spans, meta=self.meta, origin=self.origin,
                    last_logits=self.last_logits)
        args.update(changes)
        return Notebook.from_storage(self._store, self._start, self._end, args["spans"],
                                     self.adapter, self.fingerprint, args["meta"],
                                     args["origin"], last_logits=args["last_logits"])

    def with_layers(self, layers: Sequence[LayerKV]) -> Notebook:
        """The same tokens, positions and spans with other KV (e.g. a patching hybrid)."""
        return Notebook(layers, self.token_ids, self.positions, self.spans, self.adapter,
                        self.fingerprint, self.meta, self.origin)

    def with_spans(self, spans: Iterable[Span]) -> Notebook:
        return self._with(spans=tuple(spans))

    def with_meta(self, **meta: Any) -> Notebook:
        return self._with(meta={**self.meta, **meta})

    def _check_shift(self, delta: int, allow_approximate: bool) -> None:
        if delta == 0 or self.adapter.exact_shift:
            return
        if not (self.adapter.approximate and allow_approximate):
            reason = self.adapter.approximate_reason or "the scheme cannot be re-rotated"
            raise PositionError(
                f"shifting notes is not exact for this model ({reason}); pass "
                "allow_approximate=True to accept an approximate shift"
                if self.adapter.approximate else f"cannot shift notes for this model: {reason}"
            )

    @torch.inference_mode()
    def shifted(self, delta: int, *, allow_approximate: bool = False) -> Notebook:
        """The same notes with every token moved ``delta`` positions later (keys re-rotated).

        Exact up to float error where the adapter says ``exact_shift``; refused with a
        :class:`PositionError` where it is only approximate unless ``allow_approximate``.
        """
        validate.shift(delta)
        validate.flag(allow_approximate, "allow_approximate")
        delta = int(delta)
        if delta == 0:
            return self
        self._check_shift(delta, allow_approximate)
        positions = self.positions + delta
        self.adapter.check_positions(positions)
        n = len(self)
        store = KVStore(self.num_layers, n)
        for l in range(self.num_layers if n else 0):
            keys, values = self.keys(l), self.values(l)
            k_out, v_out = store.slots(l, 0, n, keys, values)
            self.adapter.shift_layer_into(l, keys, values, delta, k_out, v_out)
        store.token_ids[:n] = self.token_ids
        store.positions[:n] = positions
        store.fill = n
        return Notebook.from_storage(store, 0, n, self.spans, self.adapter, self.fingerprint,
                                     self.meta, self.origin + delta)

    def moved_to(self, start: int, **kw: Any) -> Notebook:
        """The same notes shifted so the first token sits at ``start``."""
        return self.shifted(start - self.start_position, **kw)

    def slice(self, start: int, end: int | None = None) -> Notebook:
        """Tokens ``[start, end)`` with their positions; spans are clipped to the range.

        A view onto the same storage (nothing is copied).
        """
        start = validate.integer(start, "start")
        end = len(self) if end is None else validate.integer(end, "end")
        if not 0 <= start <= end <= len(self):
            raise InvalidArgumentError(f"slice [{start}, {end}) is out of range for a notebook "
                                       f"of {len(self)} tokens; use 0 <= start <= end <= "
                                       f"{len(self)}")
        spans = [Span(s.name, s.kind, max(s.start, start) - start, min(s.end, end) - start)
                 for s in self.spans if s.end > start and s.start < end]
        origin = int(self.positions[start]) if start < len(self) else self.next_position
        last = self.last_logits if end == len(self) else None
        return Notebook.from_storage(self._store, self._start + start, self._start + end, spans,
                                     self.adapter, self.fingerprint, self.meta, origin,
                                     last_logits=last)

    @staticmethod
    @torch.inference_mode()
    def concat(parts: Sequence[Notebook], *, meta: dict[str, Any] | None = None) -> Notebook:
        """Join notebooks of one model, in order; positions are kept as they are.

        The first part is extended (in place when it ends at its storage's fill point) and the
        others are copied after it.
        """
        if not parts:
            raise EmptyInputError("concat needs at least one notebook")
        first = parts[0]
        for p in parts[1:]:
            first.check_same_model(p.fingerprint, what="concatenate notebooks of")
        rest = sum(len(p) for p in parts[1:])
        if not rest:
            return first if meta is None else first._with(meta=meta)
        store, start, end = first.claim(rest)
        spans = list(first.spans)
        at = end
        for p in parts[1:]:
            m = len(p)
            for l in range(first.num_layers if m else 0):
                keys, values = p.keys(l), p.values(l)
                k_out, v_out = store.slots(l, at, m, keys, values)
                k_out.copy_(keys)
                v_out.copy_(values)
            store.token_ids[at:at + m] = p.token_ids
            store.positions[at:at + m] = p.positions
            spans.extend(s.moved(at - start) for s in p.spans)
            at += m
        return Notebook.from_storage(store, start, at, spans, first.adapter, first.fingerprint,
                                     meta if meta is not None else first.meta, first.origin)

    def check_same_model(self, fingerprint: ModelFingerprint, what: str = "use") -> None:
        if fingerprint != self.fingerprint:
            diff = ", ".join(self.fingerprint.differences(fingerprint))
            raise NotebookMismatchError(
                f"cannot {what} a different model: the notebook was written by "
                f"{self.fingerprint.architecture} ({self.fingerprint.model_type}) and this is "
                f"{fingerprint.architecture} ({fingerprint.model_type}); differing: {diff}. "
                "Prefill the notes again with this model."
            )

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the notebook as safetensors with a JSON header (written atomically)."""
        tensors = {"token_ids": self.token_ids, "positions": self.positions}
        for l, layer in enumerate(self.layers):
            tensors[f"layers.{l}.keys"] = layer.keys
            tensors[f"layers.{l}.values"] = layer.values
        return files.write(path, tensors, {
            "format": FILE_FORMAT, "version": FILE_VERSION,
            "fingerprint": self.fingerprint.to_dict(), "scheme": self.adapter.name,
            "length": len(self), "num_layers": len(self.layers), "origin": self.origin,
            "spans": [[s.name, s.kind, s.start, s.end] for s in self.spans], "meta": self.meta,
        })

    @classmethod
    def load(cls, path: str | os.PathLike[str], engine: Engine) -> Notebook:
        """Read a notebook written by :meth:`save` for this engine's model.

        Raises:
            NotebookFileError: the file is missing, truncated, tampered with or not a notebook.
            NotebookMismatchError: the notebook was written by a different model.
        """
        if not hasattr(engine, "fingerprint") or not hasattr(engine, "adapter"):
            raise ArgumentTypeError(f"Notebook.load needs the Engine whose model wrote the file, "
                                    f"got {type(engine).__name__}")
        header, tensors = files.read(path, engine.fingerprint, file_format=FILE_FORMAT,
                                     version=FILE_VERSION, what="notebook")
        device = getattr(engine, "device", "cpu")  # files are read on the CPU
        layers = [LayerKV(tensors[f"layers.{l}.keys"].to(device),
                          tensors[f"layers.{l}.values"].to(device))
                  for l in range(header["num_layers"])]
        return cls(
            layers=layers, token_ids=tensors["token_ids"], positions=tensors["positions"],
            spans=[Span(*s) for s in header["spans"]], adapter=engine.adapter,
            fingerprint=engine.fingerprint, meta=header.get("meta"), origin=header["origin"],
        )
