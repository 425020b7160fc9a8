"""A host's bounded local copy of a shared store: what the connector splices, in its folder.

The connector reads entries from the serving folder on the host's disk (``ROOT/<model>/``), so a
hit never waits on the network. :class:`LocalMirror` fills that folder from a shared
:class:`~kvnotes.serving.store.base.Store` in one background thread:

* :meth:`LocalMirror.want` (from a request's path: a queue put, nothing else) asks for an entry
  the host does not have; the request is planned without it, and a later one splices it.
* every ``poll_s`` seconds the store's change feed is read (what was published or forgotten
  since the last poll; the whole listing at first and every ``full_sync_s``) and the entries
  missing here are fetched while they fit in the byte bound (a host's first request with a
  chunk another host learned is then a hit);
* entries forgotten in the store (``kvnotes skills forget --store``) are deleted here too;
* :meth:`LocalMirror.used` counts this host's hits, sent to the store's LRU in the background.

Its bound, ``max_bytes``, covers the entries it copied (the host's own compiles and the
operator's registered skills are not its to evict): beyond it, the least recently used copies
are deleted. Which files it copied is kept in ``ROOT/<model>/learned/mirror.json`` (the
registry's subfolder, so writing it never makes the connector rescan).

A store that fails (down, slow, flushed, full) costs nothing but its entries: the fault is
counted in :attr:`MirrorStats.faults`, the thread waits ``retry_s`` and tries again; entries
already here are served as before (they are checked by the connector when loaded).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvnotes.core import files
from kvnotes.core.errors import InvalidArgumentError, KvnotesError, StoreUnavailableError
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.registry import REGISTRY_DIR
from kvnotes.serving.store.base import Change, Store
from kvnotes.serving.store.entry import check_key, check_tenant
from kvnotes.serving.store.folder import FolderStore, write_entry_file

log = logging.getLogger("kvnotes.serving.store")

MIRROR_INDEX = "mirror.json"
NOTIFY_S = 0.5  # within a pass, on_change is called at most this often


@dataclass(frozen=True, slots=True)
class MirrorConfig:
    """Bounds and pace of a :class:`LocalMirror`."""

    max_bytes: int  # the entries it copied, in all
    poll_s: float = 2.0  # how often the store's listing is read (0: only what is wanted)
    retry_s: float = 5.0  # after a store fault, before the next try
    queue_size: int = 256  # wanted entries waiting to be fetched (more are dropped)
    full_sync_s: float = 300.0  # between whole listings (the change feed in between)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.poll_s < 0 or self.retry_s <= 0 or self.queue_size < 1:
            raise InvalidArgumentError("MirrorConfig: max_bytes > 0, poll_s >= 0, retry_s > 0 "
                                       "and queue_size >= 1 are required")


@dataclass
class MirrorStats:
    """What a mirror did (``to_dict()`` at the JSON boundary)."""

    fetched: int = 0  # entries copied from the store
    fetched_bytes: int = 0
    fetch_s: float = 0.0  # seconds spent fetching them (for the cost per MB)
    misses: int = 0  # wanted entries the store did not have (or dropped as damaged)
    dropped: int = 0  # wants that did not fit the queue
    evicted: int = 0  # copies deleted by the byte bound
    removed: int = 0  # copies deleted because the store forgot them
    faults: int = 0  # store operations that failed
    faults_by_reason: dict[str, int] = field(default_factory=dict)
    local_entries: int = 0  # copies held now
    local_bytes: int = 0

    def to_dict(self) -> JsonObject:
        return asdict(self)


class LocalMirror:
    """Keeps ``folder`` (``ROOT/<model>``) supplied from ``store`` (see the module docstring).

    Example (``store`` a shared store, ``root`` the host's ``--skills`` folder)::

        mirror = LocalMirror(store, root / fingerprint.id, MirrorConfig(max_bytes=2 << 30))
        mirror.start()
        mirror.want(key, "acme")  # from a request that missed it: fetched in the background
    """

    def __init__(self, store: Store, folder: str | os.PathLike[str], config: MirrorConfig, *,
                 on_change: Callable[[], None] | None = None) -> None:
        self.store = store
        # called (on the mirror's thread) after it wrote or deleted files in the folder: the
        # front's catalog rescans then, so the next request plans with what just landed
        self.on_change = on_change
        self._dirty, self._notified = False, 0.0
        self.folder = Path(folder)
        self.model = check_key(self.folder.name, "model id")
        self.config = config
        self.stats = MirrorStats()
        self._local = FolderStore(self.folder.parent)
        self._lock = threading.Lock()
        self._mine: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recent first
        self._wanted: queue.Queue[tuple[str, str | None]] = queue.Queue(config.queue_size)
        self._pending: set[str] = set()
        self._hits: Counter[str] = Counter()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._forgotten_since = 0.0
        self._cursor: str | None = None  # the store's change feed, read up to here
        self._next_full = 0.0
        self._load_index()

    # ---- the request path: nothing here waits on the store ----------------------------------
    def has(self, key: str) -> bool:
        return (self.folder / f"{key}{ENTRY_SUFFIX}").is_file()

    def want(self, key: str, tenant: str | None) -> bool:
        """Ask for entry ``key`` (``tenant``'s or shared) to be fetched; False when it is here
        already, asked for already, or the queue is full (counted)."""
        check_key(key)
        check_tenant(tenant)
        with self._lock:
            if key in self._pending or self.has(key):
                return False
            try:
                self._wanted.put_nowait((key, tenant))
            except queue.Full:
                self.stats.dropped += 1
                return False
            self._pending.add(key)
        self._wake.set()
        return True

    def used(self, keys: Iterable[str]) -> None:
        """Count a hit on each of ``keys`` (entries this host spliced)."""
        with self._lock:
            for key in keys:
                self._hits[key] += 1
                if key in self._mine:
                    self._mine.move_to_end(key)

    # ---- the background thread ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvnotes-store-mirror",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            try:
                self.fetch_wanted()
                if self.config.poll_s and time.monotonic() >= next_poll:
                    self.sync_once()
                    next_poll = time.monotonic() + self.config.poll_s
                self.flush_hits()
            except StoreUnavailableError:
                self._stop.wait(self.config.retry_s)  # counted by _fault; then try again
                continue
            except Exception:  # the mirror never takes the server down with it
                log.exception("kvnotes: store mirror of %s failed; trying again", self.folder)
                self._stop.wait(self.config.retry_s)
                continue
            self._wake.wait(self.config.poll_s or 1.0)
            self._wake.clear()

    def _fault(self, err: StoreUnavailableError) -> None:
        with self._lock:
            self.stats.faults += 1
            reasons = self.stats.faults_by_reason
            reasons[err.reason] = reasons.get(err.reason, 0) + 1

    def fetch_wanted(self) -> int:
        """Fetch every wanted entry now queued; returns how many were copied."""
        try:
            return self._fetch_wanted()
        finally:
            self._notify()

    def _fetch_wanted(self) -> int:
        copied = 0
        while True:
            try:
                key, tenant = self._wanted.get_nowait()
            except queue.Empty:
                return copied
            try:
                copied += self._fetch(key, tenant, evict=True)
            except StoreUnavailableError as err:
                self._fault(err)
                with self._lock:
                    self._pending.discard(key)  # asked for again at its next miss
                raise
            with self._lock:
                self._pending.discard(key)

    def sync_once(self) -> int:
        """One pass over the store: what its change feed says since the last pass, or (at
        first, every ``full_sync_s``, or when the feed no longer reaches back) its whole
        listing: remove what it forgot, copy what is missing here while it fits the bound
        without evicting (most recently used first). Returns the copies made."""
        try:
            return self._sync_once()
        finally:
            self._notify()

    def _sync_once(self) -> int:
        try:
            if self._cursor is not None and time.monotonic() < self._next_full:
                got = self.store.changes(self.model, self._cursor)
                if got is not None:
                    self._cursor, changes = got
                    return self._apply(changes)
            return self._full_pass()
        except StoreUnavailableError as err:
            self._fault(err)
            raise

    def _apply(self, changes: list[Change]) -> int:
        copied = 0
        for change in changes:
            if change.op == "forget":
                self._forget(change.key)
            elif not self.has(change.key) and self._room(change.bytes):
                copied += self._fetch(change.key, change.tenant, evict=False)
        return copied

    def _full_pass(self) -> int:
        got = self.store.changes(self.model, None)  # the feed's position before the listing
        now = time.time()
        for key in self.store.forgotten(self.model, self._forgotten_since):
            self._forget(key)
        self._forgotten_since = now - 60.0  # overlap: a clock step loses nothing
        listed = self.store.list(self.model, every=True)
        self._cursor = got[0] if got is not None else None
        self._next_full = time.monotonic() + self.config.full_sync_s
        copied = 0
        for info in reversed(listed):
            if self._stop.is_set():
                break
            if not self.has(info.key) and self._room(info.bytes):
                copied += self._fetch(info.key, info.tenant, evict=False)
        return copied

    def _forget(self, key: str) -> None:
        if self._local.delete(self.model, key):
            self._remove(key)
            self.stats.removed += 1
            self._changed()

    def _changed(self) -> None:
        """Files changed: ``on_change`` is called at the end of this pass, and within it at
        most every :data:`NOTIFY_S` (a long pass shows its first copies early, and a pass of
        many copies costs a few rescans, not one per copy)."""
        self._dirty = True
        if time.monotonic() - self._notified >= NOTIFY_S:
            self._notify()

    def _notify(self) -> None:
        if not self._dirty:
            return
        self._dirty, self._notified = False, time.monotonic()
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # the folder is right; a catalog rescans at its own pace anyway
                log.exception("kvnotes: store mirror: the catalog did not rescan %s", self.folder)

    def disown(self, key: str) -> bool:
        """Stop counting ``key`` as a copy of this mirror's (this host's learner took it on: its
        bounds govern the file from now on); True when it was one."""
        with self._lock:
            had = self._mine.pop(key, None) is not None
        if had:
            self._save_index()
        return had

    def _room(self, nbytes: int) -> bool:
        with self._lock:
            return sum(self._mine.values()) + nbytes <= self.config.max_bytes

    def _fetch(self, key: str, tenant: str | None, *, evict: bool) -> int:
        if self.has(key):
            return 0
        start = time.perf_counter()
        entry = self.store.get(self.model, key, tenant)
        if entry is None:
            self.stats.misses += 1
            return 0
        size = len(entry.data)
        if size > self.config.max_bytes:
            return 0
        if evict:
            self._evict(self.config.max_bytes - size)
        elif not self._room(size):
            return 0
        write_entry_file(self.folder, key, entry.data)
        with self._lock:
            self._mine[key] = size
            self._mine.move_to_end(key)
            self.stats.fetched += 1
            self.stats.fetched_bytes += size
            self.stats.fetch_s += time.perf_counter() - start
        self._save_index()
        self._changed()
        return 1

    def _evict(self, room: int) -> None:
        """Delete the least recently used copies until they take at most ``room`` bytes."""
        victims = []
        with self._lock:
            total = sum(self._mine.values())
            while self._mine and total > room:
                key, size = self._mine.popitem(last=False)
                total -= size
                victims.append(key)
            self.stats.evicted += len(victims)
        for key in victims:  # files deleted outside the lock
            (self.folder / f"{key}{ENTRY_SUFFIX}").unlink(missing_ok=True)
        if victims:
            self._save_index()
            self._changed()

    def _remove(self, key: str) -> None:
        with self._lock:
            self._mine.pop(key, None)
        self._save_index()

    def flush_hits(self) -> None:
        """Send the hits counted since the last flush to the store's LRU."""
        with self._lock:
            hits, self._hits = dict(self._hits), Counter()
        if hits:
            try:
                self.store.touch(self.model, hits)
            except StoreUnavailableError as err:
                self._fault(err)
                raise

    # ---- which files are the mirror's ---------------------------------------------------------
    @property
    def _index_path(self) -> Path:
        return self.folder / REGISTRY_DIR / MIRROR_INDEX

    def _load_index(self) -> None:
        try:
            data = json.loads(self._index_path.read_text("utf-8"))
            keys = [str(k) for k in data["keys"]]
        except (OSError, ValueError, KeyError, TypeError):
            return  # none yet (or unreadable: the copies it named are the host's from now on)
        for key in keys:
            path = self.folder / f"{key}{ENTRY_SUFFIX}"
            try:
                self._mine[check_key(key)] = path.stat().st_size
            except (OSError, KvnotesError):
                continue
        self.stats.local_entries = len(self._mine)
        self.stats.local_bytes = sum(self._mine.values())

    def _save_index(self) -> None:
        with self._lock:
            keys = list(self._mine)
            self.stats.local_entries = len(self._mine)
            self.stats.local_bytes = sum(self._mine.values())
        path = self._index_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{files.temp_prefix()}{MIRROR_INDEX}")
        tmp.write_text(json.dumps({"keys": keys}), "utf-8")
        os.replace(tmp, path)

    def copies(self) -> list[str]:
        """The keys of the entries this mirror copied, least recently used first."""
        with self._lock:
            return list(self._mine)
