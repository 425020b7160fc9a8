"""What a vLLM server and its clients agree on, readable without an engine.

A serving-skills folder is one model's skill library plus a manifest::

    ROOT/<model fingerprint id>/serving.json       model shape and RoPE tables, for the connector
    ROOT/<model fingerprint id>/<key>.safetensors  one notebook file per compiled skill

This module holds the three things both sides of the server read: the splice salt (composed
from a spliced request's tenant and repair tag), the manifest schema (:class:`ServingManifest`), and the
reader of one entry's tensors (:func:`read_entry`). It is imported inside vLLM's process by the
connector, so its import closure stays free of kvnotes' engine, of ``kvnotes.ops`` and of
transformers: torch, safetensors and the engine-free core modules (errors, files, fingerprint)
only. Compiling and publishing skills, which needs the engine, is
:mod:`kvnotes.serving.skills`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvnotes.core import files
from kvnotes.core.errors import InvalidArgumentError, NotebookFileError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.splice import PieceInfo

# ---- the splice salt ---------------------------------------------------------------------------
# A spliced request carries a splice request (kvnotes.serving.protocol.SpliceRequest) and the
# cache_salt ``kvnotes-splice[:<tenant>][+<tag>]`` its tenant and tag give: the connector
# composes that salt and compares, never parses one. The tenant keeps one tenant's prefix-cache
# entries apart from another's; the tag (a repair plan's name,
# :meth:`kvnotes.core.repair.Repair.tag`) keeps blocks written under one repair plan from
# serving another. vLLM refuses salts holding '@', '/', '\\' or NUL, or longer
# than 128 characters, so the tag follows a '+'.
SPLICE_SALT_PREFIX = "kvnotes-splice"
SPLICE_SALT = SPLICE_SALT_PREFIX  # the salt of untenanted spliced requests: repeats share cache
TAG_SEPARATOR = "+"
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def splice_salt(tenant: str | None = None, tag: str | None = None) -> str:
    """The salt of a spliced request: ``kvnotes-splice``, ``kvnotes-splice:<tenant>``,
    ``kvnotes-splice+<tag>`` or ``kvnotes-splice:<tenant>+<tag>``.

    A tenant's salt keeps its requests' prefix-cache entries (and their splice plans) apart
    from other tenants'; a repair tag keeps the blocks of one repair plan apart from another's.

    Example:
        >>> splice_salt(), splice_salt("acme"), splice_salt("acme", tag="f32a16")
        ('kvnotes-splice', 'kvnotes-splice:acme', 'kvnotes-splice:acme+f32a16')
    """
    if tenant is not None and (not isinstance(tenant, str) or not _TENANT.fullmatch(tenant)):
        raise InvalidArgumentError(
            f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-' (it becomes part of "
            "the request's cache_salt)")
    if tag is not None and (not isinstance(tag, str) or not _TAG.fullmatch(tag)):
        raise InvalidArgumentError(
            f"salt tag {tag!r}: use 1-40 letters, digits, '_', '.' or '-' (a Repair.tag())")
    salt = SPLICE_SALT if tenant is None else f"{SPLICE_SALT}:{tenant}"
    return salt if tag is None else f"{salt}{TAG_SEPARATOR}{tag}"


# ---- the manifest ------------------------------------------------------------------------------
MANIFEST_NAME = "serving.json"
MANIFEST_FORMAT = "kvnotes.serving-manifest"
MANIFEST_VERSION = 1
# An entry is an ordinary notebook file; the same values as kvnotes.core.notebook's FILE_FORMAT /
# FILE_VERSION (a test holds them equal), spelled here so that reading one needs no notebook.
ENTRY_FORMAT = "kvnotes.notebook"
ENTRY_VERSION = 1
ENTRY_SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class ServingManifest:
    """What the connector checks the served model against, and the tables it rotates with."""

    fingerprint: dict[str, object]  # ModelFingerprint.to_dict()
    model: str
    scheme: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bos_id: int | None
    inv_freqs: list[list[float]]  # per layer: RoPE inverse frequencies (float64 values)
    # digests of the weights the skills were compiled with (kvnotes.serving.library.weights.WeightsDigest
    # .to_dict()); None in a manifest written before they were recorded: the connector refuses it
    weights: JsonObject | None = None
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION

    def inv_freq(self, layer: int) -> torch.Tensor:
        return torch.tensor(self.inv_freqs[layer], dtype=torch.float64)

    @property
    def fingerprint_obj(self) -> ModelFingerprint:
        return ModelFingerprint.from_dict(self.fingerprint)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``folder/serving.json`` atomically (a reader sees the old or the new one);
        an identical manifest is left as it is."""
        path = Path(folder) / MANIFEST_NAME
        text = self.to_json()
        if not path.is_file() or path.read_text("utf-8") != text:
            tmp = path.with_name(f"{files.temp_prefix()}{MANIFEST_NAME}")
            tmp.write_text(text, "utf-8")
            os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, folder: str | os.PathLike[str]) -> ServingManifest:
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file():
            raise NotebookFileError(
                f"{folder} has no {MANIFEST_NAME}: prepare the skills folder with "
                "`kvnotes skills add --model M --skills DIR ...` (or `kvnotes serve`) first")
        try:
            data = json.loads(path.read_text("utf-8"))
            if (data.get("format") != MANIFEST_FORMAT
                    or data.get("version") != MANIFEST_VERSION):
                raise NotebookFileError(
                    f"{path} is not a kvnotes serving manifest (v{MANIFEST_VERSION})")
            return cls(**data)
        except (json.JSONDecodeError, TypeError, AttributeError) as err:
            raise NotebookFileError(f"{path} is not a readable serving manifest: {err}") from err


# ---- entries -----------------------------------------------------------------------------------
def entry_paths(folder: str | os.PathLike[str]) -> list[Path]:
    """The published entries of a serving folder, sorted: hidden files (a publish still in
    progress writes ``.kvnotes-tmp.*``) are never entries."""
    return sorted(p for p in Path(folder).glob(f"*{ENTRY_SUFFIX}") if not p.name.startswith("."))


def read_entry(path: str | os.PathLike[str], fingerprint: ModelFingerprint
               ) -> tuple[PieceInfo, torch.Tensor, torch.Tensor]:
    """``(piece, keys, values)`` of one library entry, with every check of a notebook file;
    keys/values ``[layers, n, kv_heads, head_dim]`` float32 (the layout a paged cache takes)."""
    path = Path(path)
    header, tensors = files.read(path, fingerprint, file_format=ENTRY_FORMAT,
                                 version=ENTRY_VERSION, what="skill")
    try:
        ids = tuple(int(t) for t in tensors["token_ids"].tolist())
        origin = int(tensors["positions"][0]) if ids else 0
        spans = header["spans"]
        name = str(spans[0][0]) if spans else path.stem
        num_layers = header["num_layers"]
        # stored as the HF cache holds them: [1, kv_heads, n, head_dim] per layer
        keys = torch.stack([tensors[f"layers.{l}.keys"][0].transpose(0, 1)
                            for l in range(num_layers)]).float()
        values = torch.stack([tensors[f"layers.{l}.values"][0].transpose(0, 1)
                              for l in range(num_layers)]).float()
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise NotebookFileError(f"{path}: not a skill the server can splice ({err})") from err
    if not ids or keys.shape[1] != len(ids) or keys.shape != values.shape:
        raise NotebookFileError(f"{path}: keys {tuple(keys.shape)} / values "
                                f"{tuple(values.shape)} do not fit {len(ids)} tokens")
    tenant, behind = entry_owner(header)
    return PieceInfo(path.stem, name, ids, origin, tenant, behind), keys, values


def entry_owner(header: files.FileHeader) -> tuple[str | None, tuple[int, ...]]:
    """``(tenant, behind)`` of an entry from its header's ``meta``: the tenant it belongs to
    (``meta["tenant"]``; None: the operator's, shared) and the token ids it was prefilled
    behind (``meta["prefix_ids"]``; () when not recorded). A malformed value raises
    :class:`NotebookFileError` (the entry is not indexed)."""
    meta = header.get("meta") or {}
    tenant = meta.get("tenant")  # the header's types are checked (files.FileHeader)
    if tenant is not None and not _TENANT.fullmatch(tenant):
        raise NotebookFileError(f"the entry's tenant {tenant!r} is not a tenant name")
    behind = tuple(meta.get("prefix_ids") or ())
    if any(t < 0 for t in behind):
        raise NotebookFileError("the entry's prefix_ids are not token ids")
    return tenant, behind
