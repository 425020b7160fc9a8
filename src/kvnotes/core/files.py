"""kvnotes files: safetensors tensors plus one JSON header, written atomically, read with checks.

Every kvnotes file (full-precision and int8 notebooks, skill-library entries) carries a header
with its ``format`` and ``version``, the writer's model fingerprint and a SHA-256 over every
tensor. Reading refuses, with a clear error, a missing, truncated or tampered file, another
format, and a file written by a different model. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvnotes.core.errors import NotebookFileError, NotebookMismatchError
from kvnotes.core.fingerprint import ModelFingerprint


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor],
          header: dict[str, Any]) -> Path:
    """Write ``tensors`` with ``header`` (plus their checksum); a crash leaves no partial file."""
    path = Path(path)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    header = {**header, "checksum": checksum(tensors)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"kvnotes": json.dumps(header)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read(path: str | os.PathLike[str], fingerprint: ModelFingerprint, *, file_format: str,
         version: int, what: str, wrong_format_hint: str = ""
         ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(header, tensors)`` of a file written by :func:`write`, after every check.

    Raises:
        NotebookFileError: missing, truncated, tampered with, or another format.
        NotebookMismatchError: written by a model other than ``fingerprint``'s.
    """
    path = Path(path)
    if not path.is_file():
        raise NotebookFileError(f"no {what} file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("kvnotes")
            if raw is None:
                raise NotebookFileError(f"{path} is a safetensors file but not a kvnotes {what}")
            header = json.loads(raw)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, json.JSONDecodeError, RuntimeError, ValueError) as err:
        raise NotebookFileError(
            f"{path} is not a readable kvnotes {what} (truncated or corrupted?): {err}"
        ) from err
    if header.get("format") != file_format or header.get("version") != version:
        raise NotebookFileError(
            f"{path}: unsupported format {header.get('format')!r} v{header.get('version')} for a "
            f"{what} ({file_format} v{version}){wrong_format_hint}"
        )
    if checksum(tensors) != header.get("checksum"):
        raise NotebookFileError(f"{path}: tensor checksum mismatch; the file was modified")
    saved = ModelFingerprint.from_dict(header["fingerprint"])
    if saved != fingerprint:
        diff = ", ".join(saved.differences(fingerprint))
        raise NotebookMismatchError(
            f"{path} was saved by a different model ({saved.architecture}, {saved.model_type}, "
            f"{saved.dtype}) than this engine's ({fingerprint.architecture}, "
            f"{fingerprint.model_type}, {fingerprint.dtype}); differing: {diff}. "
            "Load it with the model that wrote it, or prefill again."
        )
    return header, tensors


@contextmanager
def staged_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder beside ``target`` that replaces it when the block succeeds.

    Readers never see a half-written folder: on an error the temporary one is removed and
    ``target`` is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
