"""Quantized notebooks: keys and values stored as int8 with per-token or per-channel scales.

Symmetric absmax quantization, one fp32 scale per group:

- ``axis="token"``:   one scale per (layer, head, token) over the head's dims: ``[1, h, n, 1]``;
- ``axis="channel"``: one scale per (layer, head, dim) over the tokens: ``[1, h, 1, d]``.

``q = round(x / s)`` with ``s = absmax / 127``, so every element comes back within half a step:

    |x - dequantize(quantize(x))| <= 0.5 * s          (``ROUND_TRIP_STEPS``)

Keys are stored post-RoPE, so moving quantized notes dequantizes, rotates (exactly, through
the position adapter) and quantizes again. A rotation mixes each pair of dims, so the first
rounding error grows by at most sqrt(2) and the second adds half a new step:

    |R(d) x - shifted(quantize(x))| <= (sqrt(2) * s_old + s_new) / 2  (``SHIFT_STEPS`` * max s)

The int8 files are about a quarter of the fp32 ones. The fidelity cost for composition is
measured by a driver kept in git (``bench/micro/quant_fidelity.py`` at commit f2531be).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "skill.q8.safetensors")
    >>> qnb = quantize(engine.compile("Refund policy: ..."), axis="token")
    >>> _ = qnb.save(path)
    >>> skill = QuantizedNotebook.load(path, engine)
    >>> len(skill) == len(qnb), skill.axis
    (True, 'token')
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvnotes.core import files
from kvnotes.core.errors import NotebookFileError, UnknownNameError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.meta import NotebookMeta, meta_json
from kvnotes.core.notebook import LayerKV, Notebook, Span
from kvnotes.core.positions import PositionAdapter
from kvnotes.core.records import checked

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

AXES = ("token", "channel")
QMAX = 127
ROUND_TRIP_STEPS = 0.5  # round trip error bound, in quantization steps (scales)
SHIFT_STEPS = (math.sqrt(2) + 1) / 2  # bound after one shift, in steps of the larger scale
FILE_FORMAT = "kvnotes.qnotebook"
FILE_VERSION = 1
# what a file may say it was quantized from (the header names it; nothing else is accepted)
_DTYPES = {str(d).removeprefix("torch."): d for d in files.FLOAT_DTYPES}
_LAYER_TENSORS = {"keys.q": (torch.int8,), "keys.scale": (torch.float32,),
                  "values.q": (torch.int8,), "values.scale": (torch.float32,)}


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """int8 values and the fp32 scales that bring them back: ``x ≈ q * scale``."""

    q: torch.Tensor  # int8 [1, h, n, d]
    scale: torch.Tensor  # float32 [1, h, n, 1] (per token) or [1, h, 1, d] (per channel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def quantize_tensor(x: torch.Tensor, axis: str = "token") -> QuantizedTensor:
    """Symmetric absmax int8 of a ``[1, h, n, d]`` tensor, one scale per token or per channel."""
    if axis not in AXES:
        raise UnknownNameError("axis", axis, AXES)
    xf = x.detach().to(torch.float32)
    reduce = -1 if axis == "token" else -2
    absmax = xf.abs().amax(dim=reduce, keepdim=True)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return QuantizedTensor(q, scale)


class QuantizedNotebook:
    """A notebook whose per-layer keys and values are int8 (see the module docstring).

    It keeps everything else a :class:`~kvnotes.core.notebook.Notebook` has (token ids, positions,
    spans, meta, the adapter and fingerprint of the model that wrote it); :meth:`dequantize`
    gives back a notebook every engine verb takes.
    """

    __slots__ = ("layers", "token_ids", "positions", "spans", "adapter", "fingerprint", "meta",
                 "origin", "axis", "dtype")

    def __init__(self, layers: Sequence[tuple[QuantizedTensor, QuantizedTensor]],
                 token_ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                 adapter: PositionAdapter, fingerprint: ModelFingerprint, *, axis: str,
                 dtype: torch.dtype = torch.float32, meta: NotebookMeta | None = None,
                 origin: int = 0) -> None:
        if axis not in AXES:
            raise UnknownNameError("axis", axis, AXES)
        self.layers = tuple(layers)
        self.token_ids = token_ids.to(torch.long).reshape(-1)
        self.positions = positions.to(torch.long).reshape(-1)
        self.spans = tuple(spans)
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.meta: NotebookMeta = meta.copy() if meta else {}
        self.origin = origin
        self.axis = axis
        self.dtype = dtype

    def __len__(self) -> int:
        return self.token_ids.numel()

    def __repr__(self) -> str:
        return (f"QuantizedNotebook(n={len(self)}, axis={self.axis!r}, "
                f"{self.nbytes / 1024:.1f} KiB int8+scales)")

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    # ---- to and from full precision -------------------------------------------------------
    @classmethod
    def from_notebook(cls, nb: Notebook, axis: str = "token") -> QuantizedNotebook:
        """Quantize every layer's keys and values of ``nb``."""
        dtype = nb.layers[0].keys.dtype if nb.layers else torch.float32
        layers = [(quantize_tensor(layer.keys, axis), quantize_tensor(layer.values, axis))
                  for layer in nb.layers]
        return cls(layers, nb.token_ids, nb.positions, nb.spans, nb.adapter, nb.fingerprint,
                   axis=axis, dtype=dtype, meta=nb.meta, origin=nb.origin)

    def dequantize(self) -> Notebook:
        """A full-precision notebook (in the dtype it was quantized from)."""
        layers = [LayerKV(k.dequantize(self.dtype), v.dequantize(self.dtype))
                  for k, v in self.layers]
        return Notebook(layers, self.token_ids, self.positions, self.spans, self.adapter,
                        self.fingerprint, meta={**self.meta, "quantized": self.axis},
                        origin=self.origin)

    def shifted(self, delta: int, *, allow_approximate: bool = False) -> QuantizedNotebook:
        """Dequantize, move every token ``delta`` positions (exact rotation), quantize again."""
        moved = self.dequantize().shifted(delta, allow_approximate=allow_approximate)
        out = QuantizedNotebook.from_notebook(moved, self.axis)
        out.meta = self.meta.copy()
        return out

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write int8 tensors and scales as safetensors with a JSON header (atomically)."""
        tensors = {"token_ids": self.token_ids, "positions": self.positions}
        for i, (k, v) in enumerate(self.layers):
            tensors[f"layers.{i}.keys.q"] = k.q
            tensors[f"layers.{i}.keys.scale"] = k.scale
            tensors[f"layers.{i}.values.q"] = v.q
            tensors[f"layers.{i}.values.scale"] = v.scale
        return files.write(path, tensors, {
            "format": FILE_FORMAT, "version": FILE_VERSION, "axis": self.axis,
            "dtype": str(self.dtype).removeprefix("torch."),
            "fingerprint": checked(self.fingerprint.to_dict()), "scheme": self.adapter.name,
            "length": len(self), "num_layers": len(self.layers), "origin": self.origin,
            "spans": [[s.name, s.kind, s.start, s.end] for s in self.spans],
            "meta": meta_json(self.meta),
        })

    @classmethod
    def load(cls, path: str | os.PathLike[str], engine: Engine) -> QuantizedNotebook:
        """Read a file written by :meth:`save` for this engine's model.

        Raises:
            NotebookFileError: missing, truncated, tampered with or not a quantized notebook.
            NotebookMismatchError: written by a different model.
        """
        header, tensors = files.read(
            path, engine.fingerprint, file_format=FILE_FORMAT, version=FILE_VERSION,
            what="quantized notebook", wrong_format_hint="; use Notebook.load for full-precision files",
            layer_tensors=_LAYER_TENSORS)
        axis, dtype = header.get("axis"), header.get("dtype")
        if not isinstance(axis, str) or axis not in AXES:
            raise NotebookFileError(f"{path}: malformed header: axis must be one of {AXES}, got "
                                    f"{axis!r}")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise NotebookFileError(f"{path}: malformed header: dtype must be one of "
                                    f"{sorted(_DTYPES)}, got {dtype!r}")
        layers = [
            (QuantizedTensor(tensors[f"layers.{i}.keys.q"], tensors[f"layers.{i}.keys.scale"]),
             QuantizedTensor(tensors[f"layers.{i}.values.q"], tensors[f"layers.{i}.values.scale"]))
            for i in range(header["num_layers"])
        ]
        return cls(layers, tensors["token_ids"], tensors["positions"],
                   [Span(*s) for s in header["spans"]], engine.adapter, engine.fingerprint,
                   axis=axis, dtype=_DTYPES[dtype], meta=header.get("meta"), origin=header["origin"])


def quantize(nb: Notebook, axis: str = "token") -> QuantizedNotebook:
    """Shorthand for :meth:`QuantizedNotebook.from_notebook`."""
    return QuantizedNotebook.from_notebook(nb, axis)

