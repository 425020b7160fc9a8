"""What a skill store holds: one library entry's bytes and the facts about it, checked on read.

An entry is stored exactly as the serving folder holds it: the bytes of one kvnotes notebook
file (safetensors plus the kvnotes header, whose SHA-256 covers the header and every tensor;
:mod:`kvnotes.core.files`). A store adds :class:`EntryInfo` (who owns it, how big, how used)
and a SHA-256 over the whole file's bytes, which a reader checks before anything else (cheap,
and it catches a value damaged or mixed from two publishes in transit); :func:`verify_entry`
then checks the kvnotes header's own checksum, so a value that passes is the file a compile
wrote. The model's fingerprint is checked by the connector when it loads the local copy.

The address of an entry is its key, the stem its file has in the folder
(:func:`kvnotes.ops.store.skill_key`: a hash over the model fingerprint, which includes the
dtype, the position scheme, the token ids, the ids it was compiled behind and the tenant);
a store namespaces it further by model and tenant.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields

from kvnotes.core import files
from kvnotes.core.errors import InvalidArgumentError, NotebookFileError
from kvnotes.serving.json_types import JsonObject, JsonValue
from kvnotes.serving.library.manifest import ENTRY_FORMAT, ENTRY_VERSION, entry_owner
from kvnotes.serving.library.registry import LearnedEntry

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # as a splice salt's tenant (library.manifest)


def check_key(key: str, what: str = "entry key") -> str:
    """``key`` when it is a usable entry key or model id; :class:`InvalidArgumentError` else.

    Example:
        >>> check_key("3f2a9c")
        '3f2a9c'
    """
    pattern = _MODEL if what == "model id" else _KEY
    if not isinstance(key, str) or not pattern.fullmatch(key):
        raise InvalidArgumentError(f"{what} {key!r}: use letters, digits, '_' or '-' (an entry's "
                                   "file stem, or a model fingerprint id)")
    return key


def check_tenant(tenant: str | None) -> str | None:
    if tenant is not None and (not isinstance(tenant, str) or not _TENANT.fullmatch(tenant)):
        raise InvalidArgumentError(f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return tenant


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """The facts a store keeps beside one entry's bytes (``to_dict()`` at the JSON boundary)."""

    key: str  # the entry's file stem (its content address)
    model: str  # the model fingerprint id: the library folder's name
    tenant: str | None  # None: the operator's, shared by every tenant
    name: str
    tokens: int
    bytes: int
    sha256: str  # of the entry file's bytes
    kind: str = "skill"  # "skill" (registered by the operator), or a learned chunk's: "tool", ...
    learned: bool = False  # learned on sight (evictable unless pinned); registered ones never are
    pinned: bool = False
    hits: int = 0
    last_used: float = 0.0  # seconds since the epoch
    created: float = 0.0
    skill: str = ""  # a learned entry's skill identity (its variants share it)
    variant_of: str | None = None
    behind: str | None = None
    behind_tokens: int = 0

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> EntryInfo:
        """An info read back from a store; :class:`NotebookFileError` for a malformed one
        (stores are shared, so nothing in them is trusted)."""
        if not isinstance(data, dict):
            raise NotebookFileError(f"an entry's info is a JSON object, not {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        try:
            info = cls(**{k: v for k, v in data.items() if k in names})
            check_key(info.key)
            check_key(info.model, "model id")
            check_tenant(info.tenant)
            if not (isinstance(info.tokens, int) and isinstance(info.bytes, int)
                    and isinstance(info.sha256, str) and info.bytes >= 0):
                raise TypeError("tokens, bytes or sha256 of the wrong type")
        except (TypeError, InvalidArgumentError) as err:
            raise NotebookFileError(f"an entry's info is malformed: {err}") from err
        return info

    def to_learned(self) -> LearnedEntry:
        """The registry row of a learned entry (:class:`LearnedRegistry`'s)."""
        return LearnedEntry(self.key, self.tenant, self.name, self.kind, self.tokens, self.bytes,
                            self.hits, self.last_used, self.pinned, self.created, self.skill,
                            self.variant_of, self.behind, self.behind_tokens)


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """One entry: its info and the bytes of its notebook file."""

    info: EntryInfo
    data: bytes = field(repr=False)


def _safetensors_header(data: bytes) -> JsonObject:
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, files.MAX_HEAD_BYTES):
        raise ValueError(f"header of {n} bytes does not fit {len(data)} bytes")
    table = json.loads(data[8:8 + n])
    if not isinstance(table, dict):
        raise ValueError("the safetensors header is not an object")
    return table


def kvnotes_header(data: bytes) -> tuple[files.FileHeader, JsonObject]:
    """``(kvnotes header, safetensors table)`` of an entry file's bytes, parsed without reading
    a tensor; :class:`NotebookFileError` when they are not a kvnotes skill entry."""
    try:
        table = _safetensors_header(data)
        meta = table.pop("__metadata__", None)
        raw = meta.get("kvnotes") if isinstance(meta, dict) else None
        header = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, TypeError) as err:
        raise NotebookFileError(f"not a readable kvnotes entry (truncated?): {err}") from err
    if not isinstance(header, dict) or header.get("format") != ENTRY_FORMAT \
            or header.get("version") != ENTRY_VERSION or header.get("container") != files.CONTAINER:
        raise NotebookFileError(f"not a kvnotes skill entry ({ENTRY_FORMAT} v{ENTRY_VERSION})")
    return files.typed_header("a kvnotes entry", header), table


def _item(value: JsonValue, key: str | int) -> JsonValue:
    """``value[key]`` of a JSON object or array; KeyError, IndexError or TypeError (a value
    with no such item) as indexing raises them."""
    if isinstance(value, dict) and isinstance(key, str):
        return value[key]
    if isinstance(value, list) and isinstance(key, int):
        return value[key]
    raise TypeError(f"{type(value).__name__} has no item {key!r}")


def describe(data: bytes, key: str, model: str) -> EntryInfo:
    """The info of a registered (operator's) entry read from its bytes: tenant, name, tokens.

    Raises :class:`NotebookFileError` for bytes that are not a kvnotes skill entry."""
    header, table = kvnotes_header(data)
    tenant, _ = entry_owner(header)
    try:
        shape = _item(_item(_item(table, "token_ids"), "shape"), 0)
        if not isinstance(shape, (int, float, str)):
            raise TypeError(f"a shape of {type(shape).__name__}")
        tokens = int(shape)
        spans = header["spans"]
        name = str(spans[0][0]) if spans else key
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise NotebookFileError(f"entry {key}: no token ids in its table ({err})") from err
    return EntryInfo(key, model, tenant, name, tokens, len(data), sha256(data))


def verify_entry(data: bytes, info: EntryInfo) -> None:
    """Check an entry's bytes against its info: the file's SHA-256, the kvnotes header's own
    checksum over header and tensors, and the tenant the header names. Raises
    :class:`NotebookFileError` naming the first failure."""
    if len(data) != info.bytes or sha256(data) != info.sha256:
        raise NotebookFileError(f"entry {info.key}: {len(data)} bytes whose SHA-256 is not the "
                                "one published with it (damaged in the store)")
    header, _ = kvnotes_header(data)
    from safetensors import SafetensorError
    from safetensors.torch import load as safetensors_load

    try:
        tensors = safetensors_load(data)
    except (SafetensorError, RuntimeError, ValueError) as err:
        raise NotebookFileError(f"entry {info.key}: unreadable tensors ({err})") from err
    if files.checksum(tensors, header) != header.get("checksum"):
        raise NotebookFileError(f"entry {info.key}: checksum mismatch over its header and tensors")
    tenant, _ = entry_owner(header)
    if tenant != info.tenant:
        raise NotebookFileError(f"entry {info.key}: its file belongs to tenant {tenant!r}, its "
                                f"info to {info.tenant!r}")
