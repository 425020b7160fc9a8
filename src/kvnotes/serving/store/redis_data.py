"""What a :class:`~kvnotes.serving.store.redis_store.RedisStore` reads back, checked as data
from outside: any host, an operator's slip or an attacker may have written it.

A manifest is validated by a pydantic model (strict types: ``hits`` must be an integer, not a
string), then by :meth:`EntryInfo.from_dict` (keys, model id and tenant spelled as they must be),
and its chunk count is bounded before any chunk key is made: at most ``max_chunks``, and no more
than its declared size can fill (every chunk holds at least :data:`MIN_CHUNK_BYTES`). A manifest
that fails is a miss (counted ``malformed`` and dropped by the caller), never an exception.
"""

from __future__ import annotations

import json
import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvnotes.core.errors import KvnotesError
from kvnotes.serving.store.entry import EntryInfo

MANIFEST_VERSION = 1
MIN_CHUNK_BYTES = 1024  # RedisSettings.chunk_bytes' least value
MAX_MANIFEST_BYTES = 64 << 10  # a manifest is a few hundred bytes; larger is not one


class _Info(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    key: str
    model: str
    tenant: str | None
    name: str
    tokens: int = Field(ge=0)
    bytes: int = Field(ge=0)
    sha256: str
    kind: str = "skill"
    learned: bool = False
    pinned: bool = False
    hits: int = Field(0, ge=0)
    last_used: float = Field(0.0, allow_inf_nan=False)
    created: float = Field(0.0, allow_inf_nan=False)
    skill: str = ""
    variant_of: str | None = None
    behind: str | None = None
    behind_tokens: int = Field(0, ge=0)


class _Manifest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    v: Literal[1]
    info: _Info
    gen: str = Field(pattern=r"^[A-Za-z0-9]{1,64}$")
    chunks: int = Field(ge=0)


class Manifest(NamedTuple):
    """A manifest that passed its checks."""

    info: EntryInfo
    gen: str  # the generation its chunks were written under
    chunks: int


def parse_manifest(raw: bytes | None, max_chunks: int) -> Manifest | None:
    """The manifest in ``raw``; None for anything that is not a valid one (see the module
    docstring), with at most ``max_chunks`` chunks.

    Example:
        >>> parse_manifest(b'{"v": 1, "gen": "g1", "chunks": 9000, "info": {}}', 1024) is None
        True
    """
    if raw is None or len(raw) > MAX_MANIFEST_BYTES:
        return None
    try:
        data = _Manifest.model_validate(json.loads(raw))
        info = EntryInfo.from_dict(data.info.model_dump())
    except (ValueError, ValidationError, KvnotesError):
        return None
    if data.chunks > min(max_chunks, math.ceil(info.bytes / MIN_CHUNK_BYTES)) \
            or (data.chunks == 0) != (info.bytes == 0):
        return None
    return Manifest(info, data.gen, data.chunks)


def manifest_bytes(info: EntryInfo, gen: str, chunks: int) -> bytes:
    return json.dumps({"v": MANIFEST_VERSION, "info": info.to_dict(), "gen": gen,
                       "chunks": chunks}).encode()


def text(value: object) -> str:
    """A name redis-py returned (bytes: this client does not decode)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def number(value: object) -> float | None:
    """A finite number read from a hash or sorted set; None for anything else."""
    try:
        out = float(text(value))
    except ValueError:
        return None
    return out if math.isfinite(out) else None


def stream_id(value: str) -> tuple[int, int]:
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)
