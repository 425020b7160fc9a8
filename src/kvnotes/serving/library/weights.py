"""Which weights a server runs, read from the model's files: a digest that a cast keeps.

Skills hold KV that one checkpoint computed; a fine-tune of the same shape passes every shape
and RoPE check and answers wrongly with them. The connector cannot reach the served weights,
only the path vLLM's config names (``vllm_config.model_config.model``), so both sides read
files: the publisher the folder the engine was loaded from, the connector the folder vLLM
serves (``kvnotes serve`` serves a cast copy of the former, :mod:`kvnotes.serving.launch.export`).

What :func:`digest` covers, exactly: the ``*.safetensors`` files directly in the folder; of each
tensor, in name order, its name, its shape and :data:`SAMPLES` elements at the flat indices
``i * numel // SAMPLES`` (every element of a smaller tensor), each floating element cast to one
float dtype (the cast the export makes, so a float32 folder and its bfloat16 copy agree on the
``bfloat16`` digest), other elements as stored; SHA-256 over all of it. It reads every file's
JSON header and a few bytes per tensor (about 270 x 16 elements for SmolLM2), never a whole
file. Not covered: elements between the samples (a change confined to them passes; a fine-tune
or a merged adapter changes whole matrices), file names and sharding, non-tensor files
(config, tokenizer). The publisher records one digest per float dtype a server may run
(:data:`CAST_DTYPES`); the connector compares the one of the served folder's dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvnotes.core.errors import NotebookFileError
from kvnotes.serving.json_types import JsonObject

SAMPLES = 16
CAST_DTYPES = ("float32", "bfloat16", "float16")
DIGEST_VERSION = 1
# safetensors' dtype names
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True, slots=True)
class WeightsDigest:
    """Digests of one model's weights, one per float dtype a server may run them in."""

    sha256: dict[str, str]  # float dtype name -> digest
    tensors: int
    samples: int = SAMPLES
    version: int = DIGEST_VERSION

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> WeightsDigest:
        if not isinstance(data, dict):
            raise TypeError(f"a weights digest is a JSON object, not {type(data).__name__}")
        out = cls(**data)
        if not isinstance(out.sha256, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in out.sha256.items()):
            raise TypeError("sha256 must map dtype names to digests")
        return out


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    path: Path
    offset: int  # of the first byte in the file


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())


def _table(folder: Path) -> list[_Tensor]:
    paths = weight_files(folder)
    if not paths:
        raise NotebookFileError(f"{folder} holds no .safetensors weight files")
    out: dict[str, _Tensor] = {}
    for path in paths:
        try:
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                size = path.stat().st_size
                if n > size - 8:
                    raise ValueError(f"header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in out:
                    raise ValueError(f"tensor {name} is also in {out[name].path.name}")
                start, _ = (int(x) for x in info["data_offsets"])
                out[name] = _Tensor(name, str(info["dtype"]),
                                    tuple(int(d) for d in info["shape"]), path, 8 + n + start)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise NotebookFileError(f"{path}: not a readable safetensors file ({err})") from err
    return [out[name] for name in sorted(out)]


def _samples(t: _Tensor, fd: int) -> torch.Tensor:
    numel = _numel(t)
    return _elements(t, fd, sorted({i * numel // SAMPLES for i in range(SAMPLES)}) if numel
                     else [])


def _numel(t: _Tensor) -> int:
    numel = 1
    for d in t.shape:
        numel *= d
    return numel


def _elements(t: _Tensor, fd: int, flat: list[int]) -> torch.Tensor:
    """The elements at flat indices ``flat`` of tensor ``t``, as stored."""
    if t.dtype not in _DTYPES:
        raise NotebookFileError(f"{t.path}: tensor {t.name} has dtype {t.dtype}, which the "
                                "weights digest does not read")
    dtype = _DTYPES[t.dtype]
    size = torch.empty(0, dtype=dtype).element_size()
    data = b"".join(os.pread(fd, size, t.offset + i * size) for i in flat)
    if len(data) != size * len(flat):
        raise NotebookFileError(f"{t.path}: tensor {t.name} runs past the end of the file")
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _digests(folder: Path, dtypes: tuple[str, ...]) -> tuple[dict[str, str], int]:
    table = _table(folder)
    hashes = {d: hashlib.sha256() for d in dtypes}
    fds: dict[Path, int] = {}
    try:
        for t in table:
            fd = fds.get(t.path)
            if fd is None:
                fd = fds[t.path] = os.open(t.path, os.O_RDONLY)
            values = _samples(t, fd)
            for name, h in hashes.items():
                cast = values.to(getattr(torch, name)) if values.is_floating_point() else values
                h.update(f"{t.name}|{t.shape}|".encode())
                h.update(cast.view(torch.uint8).numpy().tobytes() if cast.numel() else b"")
    finally:
        for fd in fds.values():
            os.close(fd)
    return {d: h.hexdigest() for d, h in hashes.items()}, len(table)


def weights_digest(folder: str | os.PathLike[str],
                   dtypes: tuple[str, ...] = CAST_DTYPES) -> WeightsDigest:
    """The digests of the weights in ``folder`` as each of ``dtypes`` (see the module)."""
    sha, count = _digests(Path(folder), dtypes)
    return WeightsDigest(sha, count)


def served_dtype(folder: str | os.PathLike[str]) -> str:
    """The one float dtype of the tensors in ``folder`` (what a server runs them in)."""
    floats = {t.dtype for t in _table(Path(folder)) if _DTYPES.get(t.dtype, torch.int8)
              .is_floating_point}
    names = sorted(str(_DTYPES[d]).removeprefix("torch.") for d in floats)
    if len(names) != 1:
        raise NotebookFileError(f"{folder} holds float tensors of {names or 'no'} dtype; the "
                                "weights digest compares folders of one float dtype")
    return names[0]


def served_digest(folder: str | os.PathLike[str]) -> tuple[str, str]:
    """``(dtype, digest)`` of a folder a server runs: its float dtype and the digest as that."""
    dtype = served_dtype(folder)
    sha, _ = _digests(Path(folder), (dtype,))
    return dtype, sha[dtype]


def leading_values(folder: str | os.PathLike[str], names: list[str], count: int
                   ) -> dict[str, torch.Tensor]:
    """The first ``count`` elements (row-major, as stored) of each tensor of ``names`` that
    the folder's files hold: a few bytes per tensor, never a whole file."""
    table = {t.name: t for t in _table(Path(folder))}
    fds: dict[Path, int] = {}
    try:
        out = {}
        for t in (table[n] for n in names if n in table):
            fd = fds.get(t.path)
            if fd is None:
                fd = fds[t.path] = os.open(t.path, os.O_RDONLY)
            out[t.name] = _elements(t, fd, list(range(min(count, _numel(t)))))
        return out
    finally:
        for fd in fds.values():
            os.close(fd)
