"""The learned entries of a serving folder: who they belong to, how big, how used, kept or not.

Entries the front learns on sight (:mod:`kvnotes.serving.learning`) are ordinary library
entries; this registry says which entries are learned (the operator's registered skills are
not in it, and are never evicted), whose they are, their size and use, and which are pinned.
It lives in ``ROOT/<fingerprint>/learned/registry.sqlite3``: a subfolder, so its writes never
touch the serving folder's modification time (which makes the connector rescan).

Why SQLite in WAL mode: the front (its learner thread) and the command line (``kvnotes skills
list/pin/forget``, another process) read and write it at the same time; WAL lets readers read
while one writer writes, each transaction is atomic, and a writer waits (``busy_timeout``) for
another rather than failing. Only the standard library's ``sqlite3``; no engine, no vLLM.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, NotebookFileError
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import ENTRY_SUFFIX

REGISTRY_DIR = "learned"
REGISTRY_NAME = "registry.sqlite3"
BUSY_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS learned (
    key TEXT PRIMARY KEY,
    tenant TEXT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    last_used REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL
)
"""
# columns added since the table's first version, in order (a registry written before them gets
# them by ALTER TABLE when opened; SELECT * reads every row in this one column order)
_ADDED = (
    ("skill", "TEXT NOT NULL DEFAULT ''"),
    ("variant_of", "TEXT"),
    ("behind", "TEXT"),
    ("behind_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("exact", "INTEGER NOT NULL DEFAULT 0"),
)


@dataclass(frozen=True, slots=True)
class LearnedEntry:
    """One learned entry's row (``to_dict()`` at the JSON boundary)."""

    key: str  # the entry's file stem (its content address)
    tenant: str | None
    name: str
    kind: str  # the chunk's kind: "tool", "content"
    tokens: int
    bytes: int
    hits: int = 0
    last_used: float = 0.0  # seconds since the epoch
    pinned: bool = False
    created: float = 0.0
    skill: str = ""  # the skill's identity (its tenant and tokens): its variants share it
    variant_of: str | None = None  # a learned variant: the skill's name (else None)
    behind: str | None = None  # a learned variant: the predecessor it was compiled behind
    behind_tokens: int = 0  # the ids it was compiled behind (BOS, lead, predecessor)
    exact: int = 0  # of its hits, those exactly placed (nothing repaired)

    def to_dict(self) -> JsonObject:
        return asdict(self)


def registry_path(folder: str | os.PathLike[str]) -> Path:
    """Where the registry of serving folder ``folder`` (``ROOT/<fingerprint>``) lives."""
    return Path(folder) / REGISTRY_DIR / REGISTRY_NAME


class LearnedRegistry:
    """The learned entries of one serving folder (see the module docstring); thread-safe.

    Example:
        >>> import tempfile
        >>> reg = LearnedRegistry(tempfile.mkdtemp())
        >>> reg.record(LearnedEntry("k1", "acme", "tool-1a2b", "tool", 40, 4096))
        >>> reg.use({"k1": 2}); reg.get("k1").hits
        2
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = registry_path(self.folder)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                                   isolation_level=None)  # transactions opened explicitly
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints; fast commits
        self._db.execute(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        with self._write() as db:
            have = {str(r[1]) for r in db.execute("PRAGMA table_info(learned)").fetchall()}
            for name, decl in _ADDED:
                if name not in have:
                    db.execute(f"ALTER TABLE learned ADD COLUMN {name} {decl}")
            db.execute("CREATE INDEX IF NOT EXISTS learned_skill ON learned (skill)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> LearnedRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # the write lock now: no upgrade deadlock
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, args: Iterable[Any] = ()) -> list[LearnedEntry]:
        with self._lock:
            rows = self._db.execute(sql, tuple(args)).fetchall()
        return [LearnedEntry(r[0], r[1], r[2], r[3], int(r[4]), int(r[5]), int(r[6]),
                             float(r[7]), bool(r[8]), float(r[9]), str(r[10]), r[11], r[12],
                             int(r[13]), int(r[14])) for r in rows]

    # ---- writing -------------------------------------------------------------------------
    def record(self, entry: LearnedEntry) -> None:
        """Add a learned entry (one already recorded keeps its hits, pin and creation time)."""
        now = time.time()
        with self._write() as db:
            db.execute(
                "INSERT INTO learned (key, tenant, name, kind, tokens, bytes, hits, last_used, "
                "pinned, created, skill, variant_of, behind, behind_tokens, exact) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO "
                "UPDATE SET bytes = excluded.bytes, last_used = excluded.last_used",
                (entry.key, entry.tenant, entry.name, entry.kind, entry.tokens, entry.bytes,
                 entry.hits, entry.last_used or now, int(entry.pinned), entry.created or now,
                 entry.skill, entry.variant_of, entry.behind, entry.behind_tokens,
                 entry.exact))

    def use(self, hits: Mapping[str, int], when: float | None = None, *,
            exact: Mapping[str, int] | None = None) -> None:
        """Count ``hits[key]`` more uses of each entry (``exact[key]`` of them exactly placed),
        last used ``when`` (default now); keys that are not learned entries are ignored."""
        when = time.time() if when is None else when
        exact = exact or {}
        if not hits and not exact:
            return
        with self._write() as db:
            db.executemany("UPDATE learned SET hits = hits + ?, exact = exact + ?, "
                           "last_used = MAX(last_used, ?) WHERE key = ?",
                           [(int(hits.get(k, 0)), int(exact.get(k, 0)), when, k)
                            for k in {**hits, **exact}])

    def pin(self, key: str, pinned: bool = True) -> bool:
        """Pin (never evicted) or unpin an entry; False when it is not a learned entry."""
        with self._write() as db:
            cur = db.execute("UPDATE learned SET pinned = ? WHERE key = ?", (int(pinned), key))
        return cur.rowcount > 0

    def remove(self, key: str) -> bool:
        """Drop an entry's row (its file is the caller's: :func:`forget`); False when absent."""
        with self._write() as db:
            cur = db.execute("DELETE FROM learned WHERE key = ?", (key,))
        return cur.rowcount > 0

    # ---- reading -------------------------------------------------------------------------
    def get(self, key: str) -> LearnedEntry | None:
        rows = self._rows("SELECT * FROM learned WHERE key = ?", (key,))
        return rows[0] if rows else None

    def entries(self) -> list[LearnedEntry]:
        """Every learned entry, least recently used first."""
        return self._rows("SELECT * FROM learned ORDER BY last_used, key")

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def data_version(self) -> int:
        """A number that changes when another connection (another process, or another
        registry object) commits a write; this one's own writes leave it as it is."""
        with self._lock:
            return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM learned").fetchone()[0])

    def total_bytes(self, tenant: str | None = None, *, every: bool = True) -> int:
        """Bytes of the learned entries: all of them, or (``every=False``) ``tenant``'s."""
        with self._lock:
            if every:
                row = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM learned").fetchone()
            else:
                row = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM learned WHERE "
                                       "tenant IS ?", (tenant,)).fetchone()
        return int(row[0])

    def of_skill(self, skill: str) -> list[LearnedEntry]:
        """The learned entries of one skill (its variants), least recently used first."""
        return self._rows("SELECT * FROM learned WHERE skill = ? ORDER BY last_used, key",
                          (skill,))

    def variant_totals(self) -> tuple[int, int]:
        """``(entries, bytes)`` of the learned variants (entries with a ``variant_of``)."""
        with self._lock:
            row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM learned "
                                   "WHERE variant_of IS NOT NULL").fetchone()
        return int(row[0]), int(row[1])

    def evictable(self, tenant: str | None = None, *, every: bool = True) -> list[LearnedEntry]:
        """Unpinned entries (all, or ``tenant``'s), least recently used first."""
        if every:
            return self._rows("SELECT * FROM learned WHERE pinned = 0 ORDER BY last_used, key")
        return self._rows("SELECT * FROM learned WHERE pinned = 0 AND tenant IS ? "
                          "ORDER BY last_used, key", (tenant,))

    def resolve(self, key: str) -> str:
        """The full key of a learned entry from its key or a unique prefix of it (at least 6
        characters); :class:`InvalidArgumentError` naming what is wrong otherwise."""
        if len(key) < 6 or not key.isalnum():
            raise InvalidArgumentError(f"{key!r} is not an entry key: give the key shown by "
                                       "`kvnotes skills list` (or its first 6+ characters)")
        with self._lock:
            rows = self._db.execute("SELECT key FROM learned WHERE key LIKE ? ORDER BY key",
                                    (f"{key}%",)).fetchall()
        if len(rows) > 1:
            raise InvalidArgumentError(f"{key!r} names {len(rows)} learned entries: give more "
                                       "of the key")
        if not rows:
            raise InvalidArgumentError(f"no learned entry {key!r} in {self.folder}")
        return str(rows[0][0])


def forget(folder: str | os.PathLike[str], key: str, registry: LearnedRegistry | None = None
           ) -> bool:
    """Delete entry ``key``'s file from serving folder ``folder`` and its registry row.

    The file is unlinked (atomic: a server that planned it fails its load and recomputes those
    tokens, vLLM's ``recompute`` policy; a load already reading it finishes from its open file);
    True when there was a file. :class:`NotebookFileError` for a key that is not a file name.
    """
    if not key or "/" in key or "\\" in key or key.startswith("."):
        raise NotebookFileError(f"{key!r} is not an entry key")
    path = Path(folder) / f"{key}{ENTRY_SUFFIX}"
    existed = path.is_file()
    path.unlink(missing_ok=True)
    if registry is not None:
        registry.remove(key)
    return existed
