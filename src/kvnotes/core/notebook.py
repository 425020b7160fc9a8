"""The Notebook: the KV cache a model wrote for a token sequence, with positions and named spans.

Layout (one sequence, batch 1):

- ``layers[l].keys``   FloatTensor[1, kv_heads, n, head_dim]  post-RoPE, as transformers caches them
- ``layers[l].values`` FloatTensor[1, kv_heads, n, head_dim_v]
- ``token_ids``        LongTensor[n]
- ``positions``        LongTensor[n]  the RoPE position each key was rotated to
- ``spans``            named token ranges (text, field, skill, erratum, query)

A notebook keeps every token of every layer (sliding-window layers are never windowed here).
It is a view onto growable storage (:class:`kvnotes.core.storage.KVStore`); appending writes in
place when nothing else was appended to that storage since, and copies otherwise
(copy-on-write). :meth:`Notebook.append` is the one way new notes get into storage (forwards,
splices and concatenation all go through it); :mod:`kvnotes.core.cache` is the one place a
transformers cache is built from notebooks. Every operation returns a new notebook; none changes
its input.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from typing_extensions import Unpack

import kvnotes.core.files as files
import kvnotes.core.validate as validate
from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyInputError,
    InvalidArgumentError,
    NotebookMismatchError,
    PositionError,
    UnknownFieldError,
)
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.meta import NotebookMeta, meta_json
from kvnotes.core.positions import PositionAdapter
from kvnotes.core.records import checked
from kvnotes.core.storage import Claim, KVStore

SPAN_KINDS = ("text", "field", "skill", "erratum", "query")
FILE_FORMAT = "kvnotes.notebook"
FILE_VERSION = 1

T = TypeVar("T")


class _Keep(enum.Enum):
    """Marks an argument left out (where None is a value: no last logits)."""

    KEEP = 0


class ModelOwner(Protocol):
    """What :meth:`Notebook.load` needs of an engine: the model's fingerprint (checked against
    the file's), its position adapter and the device the notes go to."""

    @property
    def fingerprint(self) -> ModelFingerprint: ...

    @property
    def adapter(self) -> PositionAdapter: ...

    @property
    def device(self) -> torch.device: ...


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

    A notebook is an immutable view ``[start, end)`` onto a :class:`~kvnotes.core.storage.KVStore`
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
        meta: NotebookMeta | None = None,
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
              meta: NotebookMeta | None, origin: int, last_logits: torch.Tensor | None) -> None:
        self._store, self._start, self._end = store, start, end
        self.spans: tuple[Span, ...] = tuple(spans)
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.meta: NotebookMeta = meta.copy() if meta else {}
        self.origin = origin  # where the first token sits (the only position an empty one has)
        # FloatTensor[vocab]: the next-token logits after the last token, when the forward that
        # wrote it kept them (next_logits/greedy then need no forward)
        self.last_logits = last_logits
        assert 0 <= start <= end <= store.fill, "a view past the store's fill point"
        assert all(s.end <= end - start for s in self.spans), "a span runs past the notebook"

    @classmethod
    def from_storage(cls, store: KVStore, start: int, end: int, spans: Iterable[Span],
                     adapter: PositionAdapter, fingerprint: ModelFingerprint,
                     meta: NotebookMeta | None = None, origin: int = 0, *,
                     last_logits: torch.Tensor | None = None) -> Notebook:
        """The view ``[start, end)`` of ``store`` as a notebook (no copy)."""
        nb = cls.__new__(cls)
        nb._init(store, start, end, spans, adapter, fingerprint, meta, origin, last_logits)
        return nb

    @classmethod
    def empty(cls, adapter: PositionAdapter, fingerprint: ModelFingerprint, *, origin: int = 0,
              capacity: int = 0, meta: NotebookMeta | None = None) -> Notebook:
        """A notebook with no tokens whose first token will sit at ``origin``, in new storage
        with room for ``capacity`` tokens."""
        return cls.from_storage(KVStore(adapter.num_layers, capacity), 0, 0, (), adapter,
                                fingerprint, meta, origin)

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

    # ---- appending: the one way new notes get into storage ----------------------------------
    @torch.inference_mode()
    def append(self, token_ids: Sequence[int] | torch.Tensor, positions: torch.Tensor,
               write: Callable[[Claim], T], *, spans: Iterable[Span] = (), keep: bool = True
               ) -> tuple[Notebook, T]:
        """Append tokens after this notebook; ``write`` writes their notes.

        Claims room for the ``q`` new tokens after this notebook's view (in place when the view
        ends at its storage's fill point; otherwise the view is first copied into new storage,
        copy-on-write), records their ids and positions, and calls ``write(claim)``, which
        writes every layer's keys and values of the claimed rows: a forward through
        :class:`~kvnotes.core.cache.NotebookCache` ``(claim)``, or copies into
        :meth:`Claim.slots`. ``spans`` name ranges of the new tokens (relative to them).

        Returns the longer notebook (no next-token logits kept: :meth:`with_logits`) and what
        ``write`` returned. With ``keep=False`` the rows are given back once ``write`` returns
        (a probe whose notes are dropped) and this notebook comes back. When ``write`` raises,
        the rows are given back and nothing changed. This notebook is never changed.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [q]
        positions = positions.to(torch.long).reshape(-1)  # [q]
        q = ids.numel()
        assert positions.numel() == q, "positions and token ids differ in length"
        claim = self._claim(q)
        end = claim.end
        claim.store.token_ids[end:end + q] = ids
        claim.store.positions[end:end + q] = positions
        try:
            result = write(claim)
        except BaseException:
            claim.store.release(end, end + q)
            raise
        if not keep:
            claim.store.release(end, end + q)
            return self, result
        assert not q or claim.written(), "a layer wrote no keys for the appended tokens"
        moved = [*self.spans, *(s.moved(len(self)) for s in spans)]
        return Notebook.from_storage(claim.store, claim.start, end + q, moved, self.adapter,
                                     self.fingerprint, self.meta, self.origin), result

    @torch.inference_mode()
    def rewritten(self, start: int, end: int, write: Callable[[Claim], T], *,
                  in_place: bool = False) -> tuple[Notebook, T]:
        """This notebook with the notes of tokens ``[start, end)`` written again by ``write``.

        ``write(claim)`` gets the rows ``[start, end)`` to write on top of the notes before
        them (ids and positions stay), as :meth:`append` does: a recompute of those tokens in
        context. The view is copied first, so nothing anyone holds changes; ``in_place=True``
        writes into this notebook's own storage instead, for a caller that alone views it
        (compose repairing what it just spliced, a second run into a copy). The result keeps
        no next-token logits (:meth:`with_logits`).
        """
        if not 0 <= start <= end <= len(self):
            raise InvalidArgumentError(f"rewrite [{start}, {end}) is out of range for a notebook "
                                       f"of {len(self)} tokens")
        nb = self if in_place else self._copy()
        claim = Claim(nb._store, nb._start, nb._start + start, end - start)
        result = write(claim)
        return nb._with(last_logits=None), result

    def _claim(self, count: int) -> Claim:
        """Room for ``count`` tokens after this notebook's view: the same storage when the view
        ends at its fill point, else a copy of the view in new storage."""
        owner = self if self._end == self._store.fill else self._copy(len(self) + count)
        owner._store.claim(owner._end, count)
        return Claim(owner._store, owner._start, owner._end, count)

    def _copy(self, capacity: int = 0) -> Notebook:
        """The same notebook in new storage of its own (room for ``capacity`` tokens)."""
        n = len(self)
        fresh = KVStore(self.num_layers, max(capacity, n))
        for l in range(self.num_layers if n else 0):
            keys, values = self._store.view(l, self._start, self._end)
            k_out, v_out = fresh.slots(l, 0, n, keys, values)
            k_out.copy_(keys)
            v_out.copy_(values)
        fresh.token_ids[:n] = self.token_ids
        fresh.positions[:n] = self.positions
        fresh.fill = n
        return Notebook.from_storage(fresh, 0, n, self.spans, self.adapter, self.fingerprint,
                                     self.meta, self.origin, last_logits=self.last_logits)

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
        longer, _ = self.append(part.token_ids, positions, part._shift_into(delta),
                                spans=part.spans)
        return longer

    def _shift_into(self, delta: int) -> Callable[[Claim], None]:
        """A writer of this notebook's notes moved ``delta`` positions (keys re-rotated)."""
        def write(claim: Claim) -> None:
            for l in range(self.num_layers if len(self) else 0):
                keys, values = self.keys(l), self.values(l)
                k_out, v_out = claim.slots(l, keys, values)
                if delta:
                    self.adapter.shift_layer_into(l, keys, values, delta, k_out, v_out)
                else:  # already in place (and schemes that cannot move notes allow this)
                    k_out.copy_(keys)
                    v_out.copy_(values)
        return write

    # ---- new notebooks from this one ------------------------------------------------------
    def _with(self, *, spans: Iterable[Span] | None = None, meta: NotebookMeta | None = None,
              last_logits: torch.Tensor | None | _Keep = _Keep.KEEP) -> Notebook:
        """The same view with other spans, meta or last logits (no tensor is touched)."""
        return Notebook.from_storage(
            self._store, self._start, self._end, self.spans if spans is None else spans,
            self.adapter, self.fingerprint, self.meta if meta is None else meta, self.origin,
            last_logits=self.last_logits if last_logits is _Keep.KEEP else last_logits)

    def with_layers(self, layers: Sequence[LayerKV]) -> Notebook:
        """The same tokens, positions and spans with other KV (e.g. a patching hybrid)."""
        return Notebook(layers, self.token_ids, self.positions, self.spans, self.adapter,
                        self.fingerprint, self.meta, self.origin)

    def with_logits(self, logits: torch.Tensor | None) -> Notebook:
        """The same view keeping ``logits`` (FloatTensor[vocab]) as the next-token logits after
        its last token: what the forward that wrote that token computed."""
        return self._with(last_logits=logits)

    def with_spans(self, spans: Iterable[Span]) -> Notebook:
        return self._with(spans=tuple(spans))

    def with_meta(self, **meta: Unpack[NotebookMeta]) -> Notebook:
        """The same view with ``meta`` laid over its meta (keys and types: :class:`NotebookMeta`)."""
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
        empty = Notebook.empty(self.adapter, self.fingerprint, origin=self.origin + delta,
                               capacity=len(self), meta=self.meta)
        moved, _ = empty.append(self.token_ids, positions, self._shift_into(delta),
                                spans=self.spans)
        return moved

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
    def concat(parts: Sequence[Notebook], *, meta: NotebookMeta | None = None) -> Notebook:
        """Join notebooks of one model, in order; positions are kept as they are.

        The first part is extended (in place when it ends at its storage's fill point) and the
        others are copied after it.
        """
        if not parts:
            raise EmptyInputError("concat needs at least one notebook")
        first = parts[0]
        for p in parts[1:]:
            first.check_same_model(p.fingerprint, what="concatenate notebooks of")
        rest = [p for p in parts[1:] if len(p)]
        if not rest:
            return first if meta is None else first._with(meta=meta)
        spans: list[Span] = []
        at = 0
        for p in parts[1:]:
            spans.extend(s.moved(at) for s in p.spans)
            at += len(p)
        joined, _ = first.append(torch.cat([p.token_ids for p in rest]),
                                 torch.cat([p.positions for p in rest]), _copy_into(rest),
                                 spans=spans)
        return joined if meta is None else joined._with(meta=meta)

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
            "fingerprint": checked(self.fingerprint.to_dict()), "scheme": self.adapter.name,
            "length": len(self), "num_layers": len(self.layers), "origin": self.origin,
            "spans": [[s.name, s.kind, s.start, s.end] for s in self.spans],
            "meta": meta_json(self.meta),
        })

    @classmethod
    def load(cls, path: str | os.PathLike[str], engine: ModelOwner) -> Notebook:
        """Read a notebook written by :meth:`save` for this engine's model.

        Raises:
            NotebookFileError: the file is missing, truncated, tampered with or not a notebook.
            NotebookMismatchError: the notebook was written by a different model.
        """
        if not all(hasattr(engine, a) for a in ("fingerprint", "adapter", "device")):
            raise ArgumentTypeError(f"Notebook.load needs the Engine whose model wrote the file, "
                                    f"got {type(engine).__name__}")
        header, tensors = files.read(path, engine.fingerprint, file_format=FILE_FORMAT,
                                     version=FILE_VERSION, what="notebook")
        device = engine.device  # files are read on the CPU
        layers = [LayerKV(tensors[f"layers.{l}.keys"].to(device),
                          tensors[f"layers.{l}.values"].to(device))
                  for l in range(header["num_layers"])]
        return cls(
            layers=layers, token_ids=tensors["token_ids"], positions=tensors["positions"],
            spans=[Span(*s) for s in header["spans"]], adapter=engine.adapter,
            fingerprint=engine.fingerprint, meta=header.get("meta"), origin=header["origin"],
        )


def _copy_into(parts: Sequence[Notebook]) -> Callable[[Claim], None]:
    """A writer of ``parts``' notes, one after the other, as they are (positions kept)."""
    def write(claim: Claim) -> None:
        at = 0
        for p in parts:
            rows = replace(claim, end=claim.end + at, count=len(p))
            for l in range(p.num_layers):
                keys, values = p.keys(l), p.values(l)
                k_out, v_out = rows.slots(l, keys, values)
                k_out.copy_(keys)
                v_out.copy_(values)
            at += len(p)
    return write
