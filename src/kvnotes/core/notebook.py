"""The Notebook: the KV cache a model wrote for a token sequence, with positions and named spans.

Layout (one sequence, batch 1):

- ``layers[l].keys``   FloatTensor[1, kv_heads, n, head_dim]  post-RoPE, as transformers caches them
- ``layers[l].values`` FloatTensor[1, kv_heads, n, head_dim_v]
- ``token_ids``        LongTensor[n]
- ``positions``        LongTensor[n]  the RoPE position each key was rotated to
- ``spans``            named token ranges (text, field, skill, erratum, query)

A notebook keeps every token of every layer (sliding-window layers are never windowed here);
:func:`kvnotes.core.cache.build_cache` is the one place a transformers cache is built from it. Every
operation returns a new notebook; none mutates its input.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvnotes.core import files, validate
from kvnotes.core.errors import (
    EmptyInputError,
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


def _concat_layers(parts: Sequence[Sequence[LayerKV]]) -> tuple[LayerKV, ...]:
    parts = [p for p in parts if len(p)]
    if not parts:
        return ()
    return tuple(
        LayerKV(torch.cat([p[l].keys for p in parts], dim=-2),
                torch.cat([p[l].values for p in parts], dim=-2))
        for l in range(len(parts[0]))
    )


class Notebook:
    """The notes a model wrote at prefill: per-layer KV, positions, token ids and named spans.

    Example:
        >>> nb = engine.prefill("Order status: pending")          # doctest: +SKIP
        >>> later = nb.shifted(100)                              # doctest: +SKIP
        >>> bool((later.positions == nb.positions + 100).all())  # doctest: +SKIP
        True
    """

    __slots__ = ("layers", "token_ids", "positions", "spans", "adapter", "fingerprint", "meta",
                 "origin")

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
    ) -> None:
        self.layers: tuple[LayerKV, ...] = tuple(layers)
        self.token_ids = token_ids.to(torch.long).reshape(-1)
        self.positions = positions.to(torch.long).reshape(-1)
        self.spans: tuple[Span, ...] = tuple(spans)
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.meta: dict[str, Any] = dict(meta or {})
        self.origin = origin  # where the first token sits (the only position an empty one has)
        n = self.token_ids.numel()
        assert self.positions.numel() == n, "positions and token ids differ in length"
        assert all(len(layer) == n for layer in self.layers), "a layer's length differs from n"
        assert n == 0 or len(self.layers) == adapter.num_layers, "layer count differs from model"
        assert all(s.end <= n for s in self.spans), "a span runs past the notebook"

    # ---- reading --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.token_ids.numel()

    def __repr__(self) -> str:
        spans = ", ".join(f"{s.kind}:{s.name}[{s.start}:{s.end}]" for s in self.spans)
        first = int(self.positions[0]) if len(self) else self.origin
        return f"Notebook(n={len(self)}, positions={first}..{self.next_position - 1}, spans=[{spans}])"

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def next_position(self) -> int:
        """The position the next appended token takes."""
        return int(self.positions[-1]) + 1 if len(self) else self.origin

    @property
    def start_position(self) -> int:
        return int(self.positions[0]) if len(self) else self.origin

    @property
    def nbytes(self) -> int:
        return sum(l.keys.nbytes + l.values.nbytes for l in self.layers)

    def keys(self, layer: int) -> torch.Tensor:
        """Post-RoPE keys of one layer, ``[1, kv_heads, n, head_dim]`` (never windowed)."""
        return self.layers[layer].keys

    def values(self, layer: int) -> torch.Tensor:
        """Values of one layer, ``[1, kv_heads, n, head_dim_v]`` (never windowed)."""
        return self.layers[layer].values

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

    # ---- new notebooks from this one ------------------------------------------------------
    def _with(self, **changes: Any) -> Notebook:
        args = dict(layers=self.layers, token_ids=self.token_ids, positions=self.positions,
                    spans=self.spans, adapter=self.adapter, fingerprint=self.fingerprint,
                    meta=self.meta, origin=self.origin)
        args.update(changes)
        return Notebook(**args)

    def with_layers(self, layers: Sequence[LayerKV]) -> Notebook:
        """The same tokens, positions and spans with other KV (e.g. a patching hybrid)."""
        return self._with(layers=tuple(layers))

    def with_spans(self, spans: Iterable[Span]) -> Notebook:
        return self._with(spans=tuple(spans))

    def with_meta(self, **meta: Any) -> Notebook:
        return self._with(meta={**self.meta, **meta})

    def shifted(self, delta: int, *, allow_approximate: bool = False) -> Notebook:
        """The same notes with every token moved ``delta`` positions later (keys re-rotated).

        Exact up to float error where the adapter says ``exact_shift``; refused with a
        :class:`PositionError` where it is only approximate unless ``allow_approximate``.
        """
        validate.shift(delta)
        delta = int(delta)
        if delta == 0:
            return self
        if not self.adapter.exact_shift:
            if not (self.adapter.approximate and allow_approximate):
                reason = self.adapter.approximate_reason or "the scheme cannot be re-rotated"
                raise PositionError(
                    f"shifting notes is not exact for this model ({reason}); pass "
                    "allow_approximate=True to accept an approximate shift"
                    if self.adapter.approximate else f"cannot shift notes for this model: {reason}"
                )
        positions = self.positions + delta
        self.adapter.check_positions(positions)
        layers = tuple(
            LayerKV(*self.adapter.shift_layer(l, layer.keys, layer.values, delta))
            for l, layer in enumerate(self.layers)
        )
        return self._with(layers=layers, positions=positions, origin=self.origin + delta)

    def moved_to(self, start: int, **kw: Any) -> Notebook:
        """The same notes shifted so the first token sits at ``start``."""
        return self.shifted(start - self.start_position, **kw)

    def slice(self, start: int, end: int | None = None) -> Notebook:
        """Tokens ``[start, end)`` with their positions; spans are clipped to the range."""
        end = len(self) if end is None else end
        if not 0 <= start <= end <= len(self):
            raise IndexError(f"slice [{start}, {end}) out of range for a notebook of {len(self)}")
        spans = [Span(s.name, s.kind, max(s.start, start) - start, min(s.end, end) - start)
                 for s in self.spans if s.end > start and s.start < end]
        origin = int(self.positions[start]) if start < len(self) else self.next_position
        return self._with(
            layers=tuple(layer.slice(start, end) for layer in self.layers) if end > start else (),
            token_ids=self.token_ids[start:end], positions=self.positions[start:end],
            spans=spans, origin=origin,
        )

    @staticmethod
    def concat(parts: Sequence[Notebook], *, meta: dict[str, Any] | None = None) -> Notebook:
        """Join notebooks of one model, in order; positions are kept as they are."""
        if not parts:
            raise EmptyInputError("concat needs at least one notebook")
        first = parts[0]
        for p in parts[1:]:
            first.check_same_model(p.fingerprint, what="concatenate notebooks of")
        spans: list[Span] = []
        offset = 0
        for p in parts:
            spans.extend(s.moved(offset) for s in p.spans)
            offset += len(p)
        return Notebook(
            layers=_concat_layers([p.layers for p in parts]),
            token_ids=torch.cat([p.token_ids for p in parts]),
            positions=torch.cat([p.positions for p in parts]),
            spans=spans, adapter=first.adapter, fingerprint=first.fingerprint,
            meta=meta if meta is not None else first.meta, origin=first.origin,
        )

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
        header, tensors = files.read(path, engine.fingerprint, file_format=FILE_FORMAT,
                                     version=FILE_VERSION, what="notebook")
        layers = [LayerKV(tensors[f"layers.{l}.keys"], tensors[f"layers.{l}.values"])
                  for l in range(header["num_layers"])]
        return cls(
            layers=layers, token_ids=tensors["token_ids"], positions=tensors["positions"],
            spans=[Span(*s) for s in header["spans"]], adapter=engine.adapter,
            fingerprint=engine.fingerprint, meta=header.get("meta"), origin=header["origin"],
        )
