"""kvnotes files: safetensors tensors plus one JSON header, written atomically, read with checks.

Every kvnotes file (full-precision and int8 notebooks, skill-library entries) carries a header
with its ``format`` and ``version``, the writer's model fingerprint and a SHA-256 over the
header *and* every tensor. Reading refuses, with a :class:`NotebookFileError` naming the problem,
a missing, truncated or tampered file, another format, a file from before the header checksum,
and any header field of the wrong type or out of range; a file written by a different model is a
:class:`NotebookMismatchError`. Nothing is ever unpickled.

Writing never leaves a partial file or folder: data goes to a temporary beside the target
(``.kvnotes-tmp.<host>.<pid>.<random>.<name>``), is flushed to disk, and is renamed over the
target in one step. A temporary whose process died (killed mid-save) is swept at the next write
into that folder by a writer on the same host: a folder shared between machines (several servers
reading one skills library) holds other hosts' temporaries, whose pids mean nothing here, so they
are never swept from another host. See ``docs/guide/reliability.md``.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypeGuard  # pydantic reads NotRequired from Python 3.11

import torch
from pydantic import ConfigDict, ValidationError, with_config
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from kvnotes.core.errors import NotebookFileError, NotebookMismatchError, UnsafePathError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.meta import NotebookMeta
from kvnotes.core.records import Json, adapter

# Layout of the kvnotes header itself. 1 (unmarked): the checksum covered the tensors only;
# such files cannot be verified and are refused (a 0.x project breaks cleanly).
CONTAINER = 2
TMP_PREFIX = ".kvnotes-tmp."
OLD_PREFIX = ".kvnotes-old."
# A temporary older than this is swept even when its pid is alive again (pid reuse).
STALE_AGE_S = 24 * 3600


def host_tag(hostname: str) -> str:
    """``hostname`` as one dot-free field of a temporary's name (other characters become ``-``).

    Example:
        >>> host_tag("node-3.cluster.local"), host_tag("")
        ('node-3-cluster-local', 'localhost')
    """
    return re.sub(r"[^A-Za-z0-9-]", "-", hostname)[:64] or "localhost"


# This machine's field in the temporaries it writes; the sweep removes only temporaries with it.
HOST = host_tag(socket.gethostname())


def temp_prefix(kind: str = TMP_PREFIX) -> str:
    """The name start of this process's temporaries: ``<kind><host>.<pid>.``."""
    return f"{kind}{HOST}.{os.getpid()}."
# equal to kvnotes.core.notebook.SPAN_KINDS (a test checks; notebook imports this module)
SPAN_KINDS = ("text", "field", "skill", "erratum", "query")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NOTEBOOK_LAYER_TENSORS: dict[str, tuple[torch.dtype, ...]] = {
    "keys": FLOAT_DTYPES, "values": FLOAT_DTYPES}


def checksum(tensors: Mapping[str, torch.Tensor], header: Mapping[str, object] | None = None) -> str:
    """SHA-256 over the header (without its ``checksum``) and every tensor's name, dtype, shape
    and bytes, in name order."""
    h = hashlib.sha256()
    if header is not None:
        body = {k: v for k, v in header.items() if k != "checksum"}
        h.update(json.dumps(body, sort_keys=True, ensure_ascii=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())  # the header of each tensor, then its bytes
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@with_config(ConfigDict(extra="allow"))
class FileHeader(TypedDict):
    """A file's JSON header as :func:`read` and :func:`read_head` return it, every key typed (an
    unnamed one kept as it came); ``axis`` and ``dtype`` are an int8 notebook's."""

    format: str
    version: int
    container: int
    checksum: str
    fingerprint: Json
    scheme: str
    length: int
    num_layers: int
    origin: int
    spans: list[tuple[str, str, int, int]]
    meta: NotRequired[NotebookMeta]
    axis: NotRequired[str]
    dtype: NotRequired[str]


def typed_header(path: str | os.PathLike[str], header: object) -> FileHeader:
    """``header`` read as a :class:`FileHeader` (a key of the wrong type: NotebookFileError)."""
    try:
        out: FileHeader = adapter(FileHeader).validate_python(header)
    except ValidationError as err:
        raise NotebookFileError(f"{path}: malformed header: {err}") from err
    return out


# ---- writing ------------------------------------------------------------------------------
def fault_point(name: str) -> None:
    """Tests only: block here when ``$KVNOTES_TEST_PAUSE`` names this point, so a test can
    SIGKILL the process mid-write (it waits for the file ``$KVNOTES_TEST_PAUSE_READY``)."""
    if os.environ.get("KVNOTES_TEST_PAUSE") != name:
        return
    ready = os.environ.get("KVNOTES_TEST_PAUSE_READY")
    if ready:
        Path(ready).write_text(str(os.getpid()))
    time.sleep(float(os.environ.get("KVNOTES_TEST_PAUSE_S", "3600")))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some file systems cannot fsync a folder; the rename is still atomic
        pass


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    """Delete a file or folder; gone already (another process swept it) is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that dead processes of this host left in ``folder``; returns what
    was swept. Another host's temporaries are left alone: its pids cannot be checked from here.

    A folder set aside by an interrupted replacement (``.kvnotes-old.*``) is moved back when
    its target is missing, so a kill between the two renames loses nothing.
    """
    folder = Path(folder)
    swept: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return swept
    now = time.time()
    for entry in entries:
        name = entry.name
        prefix = TMP_PREFIX if name.startswith(TMP_PREFIX) else (
            OLD_PREFIX if name.startswith(OLD_PREFIX) else None)
        if prefix is None:
            continue
        host, _, tail = name[len(prefix):].partition(".")
        if host != HOST:
            continue
        pid_text, _, rest = tail.partition(".")
        try:
            pid = int(pid_text)
            age = now - entry.lstat().st_mtime
        except (ValueError, OSError):
            continue
        if _pid_alive(pid) and age < STALE_AGE_S:
            continue
        original = folder / rest.partition(".")[2]
        if prefix == OLD_PREFIX and original.name and not original.exists():
            try:
                os.replace(entry, original)  # the new one never arrived: keep the old one
                continue
            except OSError:
                pass
        _remove(entry)
        swept.append(entry)
    return swept


def as_path(path: object, what: str = "path") -> Path:
    """``path`` as a Path; anything but a non-empty str or os.PathLike is an UnsafePathError."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path) or "\x00" in os.fspath(path):
        raise UnsafePathError(f"{what} must be a non-empty file path (str or pathlib.Path) "
                              f"without NUL characters, got {path!r}")
    return Path(path)


def _check_target_file(path: Path) -> None:
    if path.is_dir():
        raise UnsafePathError(f"cannot write a file at {path}: it is a folder; give a file path "
                              f"such as {path / 'notes.safetensors'}")
    if path.parent.exists() and not path.parent.is_dir():
        raise UnsafePathError(f"cannot write into {path.parent}: it is a file, not a folder")


def write(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor],
          header: Json) -> Path:
    """Write ``tensors`` with ``header`` (plus a checksum over both), atomically.

    The target is either the old file or the complete new one, whatever happens: the data is
    written to a temporary beside it, flushed, and renamed over it.
    """
    path = as_path(path)
    _check_target_file(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header = {**header, "container": CONTAINER}
    header["checksum"] = checksum(tensors, header)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path.parent)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(),
                                suffix=f".{path.name}")
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata={"kvnotes": json.dumps(header)})
        _fsync(tmp)
        fault_point("write")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


# ---- reading ------------------------------------------------------------------------------
def read(path: str | os.PathLike[str], fingerprint: ModelFingerprint, *, file_format: str,
         version: int, what: str, wrong_format_hint: str = "",
         layer_tensors: Mapping[str, tuple[torch.dtype, ...]] = NOTEBOOK_LAYER_TENSORS,
         ) -> tuple[FileHeader, dict[str, torch.Tensor]]:
    """``(header, tensors)`` of a file written by :func:`write`, after every check.

    ``layer_tensors`` names the tensors each layer ``l`` has (``layers.{l}.<suffix>``) and the
    dtypes each may have; every other header field of a notebook is checked by
    :func:`check_header`.

    Raises:
        NotebookFileError: missing, truncated, tampered with, another format, or malformed.
        NotebookMismatchError: written by a model other than ``fingerprint``'s.
    """
    path = as_path(path)
    if not path.is_file():
        raise NotebookFileError(f"no {what} file at {path}" + (" (it is a folder)"
                                                               if path.is_dir() else ""))
    try:
        # Read the bytes once, then parse them: a memory map (safe_open) dies with SIGBUS when
        # another process truncates the file while it is being read (a damaged library entry
        # rewritten in place); a plain read sees the old or the new bytes, and the checksum
        # below catches a mix.
        data = path.read_bytes()
        raw = _safetensors_metadata(data).get("kvnotes")
        if raw is None:
            raise NotebookFileError(f"{path} is a safetensors file but not a kvnotes {what}")
        header = json.loads(raw)
        tensors = safetensors_load(data)
    except (SafetensorError, json.JSONDecodeError, RuntimeError, ValueError, OSError) as err:
        if isinstance(err, NotebookFileError):
            raise
        raise NotebookFileError(
            f"{path} is not a readable kvnotes {what} (truncated or corrupted?): {err}"
        ) from err
    _check_kind(path, header, file_format, version, what, wrong_format_hint)
    if checksum(tensors, header) != header.get("checksum"):
        raise NotebookFileError(f"{path}: checksum mismatch over the header and tensors; the "
                                "file was modified or damaged")
    _check_writer(path, check_header(path, header, tensors, layer_tensors), fingerprint)
    return typed_header(path, header), tensors


def _check_kind(path: Path, header: object, file_format: str, version: int, what: str,
                wrong_format_hint: str) -> None:
    if not isinstance(header, dict):
        raise NotebookFileError(f"{path}: the kvnotes header is not a JSON object")
    if header.get("format") != file_format or header.get("version") != version:
        raise NotebookFileError(
            f"{path}: unsupported format {header.get('format')!r} v{header.get('version')} for a "
            f"{what} ({file_format} v{version}){wrong_format_hint}"
        )
    if "container" not in header:
        raise NotebookFileError(
            f"{path} was written by an older kvnotes whose checksum did not cover the header, so "
            "it cannot be verified; prefill the notes again and save them with this version")
    if header["container"] != CONTAINER:
        raise NotebookFileError(f"{path}: unsupported kvnotes file layout "
                                f"{header['container']!r} (this version reads {CONTAINER})")


def _check_writer(path: Path, saved: ModelFingerprint, fingerprint: ModelFingerprint) -> None:
    if saved != fingerprint:
        diff = ", ".join(saved.differences(fingerprint))
        raise NotebookMismatchError(
            f"{path} was saved by a different model ({saved.architecture}, {saved.model_type}, "
            f"{saved.dtype}) than this engine's ({fingerprint.architecture}, "
            f"{fingerprint.model_type}, {fingerprint.dtype}); differing: {diff}. "
            "Load it with the model that wrote it, or prefill again."
        )


@dataclass(frozen=True, slots=True)
class FileHead:
    """A kvnotes file's header and tensor table, with only a few small tensors read.

    ``table``: every tensor's safetensors dtype (``"F32"``, ``"I64"``, ...) and shape, from the
    file's JSON header; ``tensors``: the int64 tensors asked for; ``header``: its keys typed
    (:class:`FileHeader`). Nothing here is checksummed (that needs every byte): a reader that
    uses the data goes through :func:`read`.
    """

    header: FileHeader
    table: dict[str, tuple[str, tuple[int, ...]]]
    tensors: dict[str, torch.Tensor]
    size: int  # bytes on disk


# the most a safetensors JSON header may take before the file is called damaged
MAX_HEAD_BYTES = 64 << 20


def _read_at(fd: int, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset`` of an open file (every byte the head reader takes comes here)."""
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ValueError(f"{n} bytes at offset {offset} run past the end of the file")
    return data


def read_head(path: str | os.PathLike[str], fingerprint: ModelFingerprint, *, file_format: str,
              version: int, what: str, int_tensors: tuple[str, ...] = ("token_ids", "positions"),
              ) -> FileHead:
    """The header of a file written by :func:`write` and its small ``int_tensors`` (int64, 1-D),
    without reading any other tensor's bytes: what an index needs (the tensors are checked,
    checksum included, by :func:`read` when they are used).

    One open file gives every byte, so a file replaced meanwhile is read whole from one version.

    Raises:
        NotebookFileError: missing, truncated header, another format, or a malformed table.
        NotebookMismatchError: written by a model other than ``fingerprint``'s.
    """
    path = as_path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise NotebookFileError(f"no {what} file at {path} ({err.strerror})") from err
    try:
        size = os.fstat(fd).st_size
        n = int.from_bytes(_read_at(fd, 0, 8), "little")
        if n > min(size - 8, MAX_HEAD_BYTES):
            raise ValueError(f"header of {n} bytes does not fit a file of {size}")
        table_raw = json.loads(_read_at(fd, 8, n))
        meta = table_raw.pop("__metadata__", None) if isinstance(table_raw, dict) else None
        raw = meta.get("kvnotes") if isinstance(meta, dict) else None
        if raw is None:
            raise NotebookFileError(f"{path} is a safetensors file but not a kvnotes {what}")
        header = json.loads(raw)
        table: dict[str, tuple[str, tuple[int, ...]]] = {}
        spans: dict[str, tuple[int, int]] = {}
        for name, info in table_raw.items():
            lo, hi = (int(x) for x in info["data_offsets"])
            table[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
            spans[name] = (lo, hi)
        _check_kind(path, header, file_format, version, what, "")
        tensors: dict[str, torch.Tensor] = {}
        for name in int_tensors:
            dtype, shape = table[name]
            lo, hi = spans[name]
            if dtype != "I64" or len(shape) != 1 or hi - lo != 8 * shape[0] or 8 + n + hi > size:
                raise ValueError(f"tensor {name} is {dtype} {shape} at bytes [{lo}, {hi}), not "
                                 "int64 of one dimension inside the file")
            data = _read_at(fd, 8 + n + lo, hi - lo) if hi > lo else b""
            tensors[name] = torch.frombuffer(bytearray(data), dtype=torch.int64) if data \
                else torch.zeros(0, dtype=torch.int64)
    except NotebookFileError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OSError) as err:
        raise NotebookFileError(
            f"{path} is not a readable kvnotes {what} (truncated or corrupted?): {err}") from err
    finally:
        os.close(fd)
    try:
        saved = ModelFingerprint.from_dict(header.get("fingerprint"))
    except (TypeError, ValueError) as err:
        raise NotebookFileError(f"{path}: malformed header: fingerprint: {err}") from err
    _check_writer(path, saved, fingerprint)
    return FileHead(typed_header(path, header), table, tensors, size)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes (8-byte header length, JSON header)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"header of {n} bytes does not fit a file of {len(data)}")
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def check_header(path: Path, header: Json, tensors: Mapping[str, torch.Tensor],
                 layer_tensors: Mapping[str, tuple[torch.dtype, ...]]) -> ModelFingerprint:
    """Validate every field of a notebook header against itself and the tensors.

    Returns the writer's fingerprint. A file that passes the checksum can still be malformed
    (written by a buggy or hostile writer), so nothing here trusts the header.
    """
    def bad(problem: str) -> NotebookFileError:
        return NotebookFileError(f"{path}: malformed header: {problem}")

    try:
        saved = ModelFingerprint.from_dict(header.get("fingerprint"))
    except (TypeError, ValueError) as err:
        raise bad(f"fingerprint: {err}") from err
    if not isinstance(header.get("scheme"), str):
        raise bad(f"scheme must be a string, got {header.get('scheme')!r}")
    n, num_layers, origin = header.get("length"), header.get("num_layers"), header.get("origin")
    if not _is_int(n) or n < 0:
        raise bad(f"length must be an integer >= 0, got {n!r}")
    if not _is_int(origin) or origin < 0:
        raise bad(f"origin must be an integer >= 0, got {origin!r}")
    if not _is_int(num_layers) or num_layers not in (saved.num_layers, 0) or (
            num_layers == 0 and n > 0 and saved.num_layers):
        raise bad(f"num_layers {num_layers!r} does not match the model's {saved.num_layers} "
                  "layers")
    spans = header.get("spans")
    if not isinstance(spans, list):
        raise bad(f"spans must be a list, got {type(spans).__name__}")
    for i, s in enumerate(spans):
        ok = (isinstance(s, list) and len(s) == 4 and isinstance(s[0], str) and s[1] in SPAN_KINDS
              and _is_int(s[2]) and _is_int(s[3]) and 0 <= s[2] <= s[3] <= n)
        if not ok:
            raise bad(f"span {i} {s!r} is not [name, kind in {SPAN_KINDS}, start, end] with "
                      f"0 <= start <= end <= length {n}")
    meta = header.get("meta", {})
    if not isinstance(meta, dict):
        raise bad(f"meta must be a JSON object, got {type(meta).__name__}")
    _check_document_meta(meta.get("document"), n, bad)
    expected = {"token_ids", "positions"} | {f"layers.{l}.{suffix}" for l in range(num_layers)
                                             for suffix in layer_tensors}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise bad(f"tensors do not match the header (missing {missing[:4]}, unexpected {extra[:4]})")
    for name in ("token_ids", "positions"):
        t = tensors[name]
        if t.dtype != torch.int64 or tuple(t.shape) != (n,):
            raise bad(f"{name} must be int64 of shape ({n},), got {t.dtype} {tuple(t.shape)}")
    if n and int(tensors["positions"].min()) < 0:
        raise bad("positions must be >= 0")
    for l in range(num_layers):
        for suffix, dtypes in layer_tensors.items():
            t = tensors[f"layers.{l}.{suffix}"]
            along = (n, 1) if suffix.endswith("scale") else (n,)
            if t.dtype not in dtypes or t.dim() != 4 or t.shape[0] != 1 or t.shape[-2] not in along:
                raise bad(f"layers.{l}.{suffix} must be {[str(d) for d in dtypes]} of shape "
                          f"[1, heads, {n}, dim], got {t.dtype} {tuple(t.shape)}")
    return saved


def _check_document_meta(doc: object, n: int, bad: Callable[[str], NotebookFileError]) -> None:
    if doc is None:
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("parts"), list):
        raise bad("meta.document must be an object with a parts list")
    offset = doc.get("offset")
    if not _is_int(offset) or not 0 <= offset <= n:
        raise bad(f"meta.document.offset must be an integer in [0, {n}], got {offset!r}")
    for p in doc["parts"]:
        ok = isinstance(p, list) and (
            (len(p) == 2 and p[0] == "text" and isinstance(p[1], str))
            or (len(p) == 3 and p[0] == "field" and isinstance(p[1], str) and p[1]
                and isinstance(p[2], str)))
        if not ok:
            raise bad(f"meta.document part {p!r} is not ['text', str] or ['field', name, value]")


# ---- folders ------------------------------------------------------------------------------
def check_plain_child(target: str | os.PathLike[str]) -> Path:
    """``target`` if it names a plain child of its parent folder, else :class:`UnsafePathError`.

    A name such as ``..`` or ``.`` would make a folder replacement swap out the parent itself.
    """
    raw = os.fspath(target)  # before Path() folds "models/." into "models"
    target = Path(target)
    last = raw.rstrip("/" + (os.altsep or "")).rpartition("/")[2]
    if last in ("", ".", "..") or target.name in ("", ".", ".."):
        raise UnsafePathError(f"refusing to replace {os.fspath(target)!r}: not a plain child of a "
                              "folder (a name like '.' or '..' would replace the parent)")
    if target.is_symlink():
        raise UnsafePathError(f"refusing to replace {target}: it is a symbolic link")
    if target.exists() and not target.is_dir():
        raise UnsafePathError(f"refusing to replace {target} with a folder: it is a file")
    if target.parent.exists() and not target.parent.is_dir():
        raise UnsafePathError(f"cannot create {target}: {target.parent} is a file, not a folder")
    return target


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_tree(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            p = Path(root) / name
            if p.is_file() and not p.is_symlink():
                _fsync(p)
    _fsync_dir(folder)


@contextmanager
def staged_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder beside ``target`` that replaces it when the block succeeds.

    Readers see either the old folder or the complete new one: the new folder is flushed, then
    swapped in with one atomic exchange (or, where the file system cannot exchange, the old one
    is renamed aside, the new one moved in, and only then the old one deleted; an interrupted
    swap is undone by the next :func:`sweep`). On an error the temporary folder is removed and
    ``target`` is left as it was. ``target`` must be a plain child of its folder.
    """
    target = check_plain_child(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target.parent)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(),
                                suffix=f".{target.name}"))
    try:
        yield tmp
        _fsync_tree(tmp)
        fault_point("staged_dir")
        if not target.exists():
            os.replace(tmp, target)
        elif _exchange(tmp, target):
            shutil.rmtree(tmp, ignore_errors=True)  # now holds the old folder
        else:
            aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(OLD_PREFIX),
                                          suffix=f".{target.name}"))
            os.replace(target, aside)  # onto the empty folder just made
            fault_point("staged_dir_aside")
            os.replace(tmp, target)
            shutil.rmtree(aside, ignore_errors=True)
        _fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
