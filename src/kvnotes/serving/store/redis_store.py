"""One skill library for many hosts: the store in a Redis (or Valkey) server, through redis-py.

Layout (``P`` the key prefix, default ``kvn``; ``T`` the tenant, ``~`` for the shared entries)::

    P:e:{MODEL/T/KEY}:m          the entry's manifest: JSON {info, gen, chunks}
    P:e:{MODEL/T/KEY}:c:GEN:I    its bytes, chunk I of publish GEN (a few MB each)
    P:idx:MODEL:T                set of T's keys          P:tenants:MODEL   set of tenants
    P:models                     set of model ids         P:pins:MODEL      set of pinned keys
    P:lru:MODEL                  zset key -> last used    P:hits:MODEL      hash key -> uses
    P:gone:MODEL                 zset key -> forgotten at (hosts drop their local copies)
    P:seen:NAME                  sighting counter (expires)
    P:lease:NAME                 a lease's holder token (expires)

The braces are Redis Cluster hash tags: an entry's manifest and chunks share one slot, so the
publish script's keys are in one slot. KEY is the entry's content address (its file stem in the
folder: a hash over model fingerprint, dtype, position scheme, token ids, what it was compiled
behind and tenant), so a tenant's namespace is in the key and in the hash both.

Publishing is atomic: chunks are written under a fresh generation with an expiry (a writer
that dies between chunks leaves keys that expire, and no manifest); one Lua script then checks
that every chunk is there, removes their expiry, sets the manifest and gives the previous
generation's chunks (named by the manifest the writer read first) a short expiry, so a reader
that read the old manifest still finds them. The script is safe to run twice (redis-py sends it
again when its reply is lost): a run that finds its own manifest set does nothing
(:mod:`~kvnotes.serving.store.redis_scripts` says which calls may be retried, and why).

Reading checks everything (:func:`~kvnotes.serving.store.entry.verify_entry`): a manifest that
is not one (:mod:`~kvnotes.serving.store.redis_data`), a value whose checksum fails, whose
chunks are gone or larger than declared, or whose manifest names another tenant than its key is
deleted with its index members, counted and read as a miss; a listing skips it and goes on. A
server whose ``maxmemory-policy`` may evict the bookkeeping is refused at the first call
(:mod:`~kvnotes.serving.store.redis_settings`). Redis errors become
:class:`~kvnotes.core.errors.StoreUnavailableError` with a reason (``down``, ``timeout``,
``full``, ...); the client reconnects on its own (redis-py's retry with backoff and health
checks), so the store is used again as soon as the server answers.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

import kvnotes.serving.store.redis_scripts as scripts
from kvnotes.core import files
from kvnotes.core.errors import InvalidArgumentError, KvnotesError, StoreUnavailableError
from kvnotes.serving.store.base import Change, StoreFaults, visible
from kvnotes.serving.store.entry import (
    EntryInfo,
    StoredEntry,
    check_key,
    check_tenant,
    verify_entry,
)
from kvnotes.serving.store.redis_coord import LearnerCalls
from kvnotes.serving.store.redis_data import (
    Manifest,
    manifest_bytes,
    number,
    parse_manifest,
    stream_id,
    text,
)
from kvnotes.serving.store.redis_settings import (
    HINTS,
    RedisSettings,
    eviction_policy,
    fault_reason,
    refused_policy,
)

__all__ = ["SHARED", "RedisSettings", "RedisStore", "fault_reason"]

log = logging.getLogger("kvnotes.serving.store")

SHARED = "~"  # the tenant field of the operator's shared entries (no tenant name has a '~')
FORGOTTEN_KEPT_S = 7 * 86400  # how long a forgotten key is remembered for hosts to drop it
TRIES = 3  # a publish or forget whose manifest changed under it is read again this often


class RedisStore(LearnerCalls):
    """The skill store in one Redis server (see the module docstring). Thread-safe.

    Args:
        client: a ``redis.Redis`` (bytes responses); :meth:`connect` makes one from a URL.
        url: where it is, for logs and errors (without a password).
    """

    def __init__(self, client: redis.Redis, *, url: str,
                 settings: RedisSettings | None = None) -> None:
        self.client = client
        self.url = url
        self.settings = settings or RedisSettings()
        self.faults = StoreFaults()
        self._token = secrets.token_hex(16)  # this object's identity as a lease holder
        self._state_lock = threading.Lock()
        self._down: str | None = None  # the reason of the last fault, until an answer comes
        self._policy_ok = False  # the server's maxmemory-policy was read and accepted
        self._uncertain: dict[str, str] = {}  # lease key -> the value a timed-out take set
        p = self.settings.prefix
        self._publish = client.register_script(scripts.PUBLISH)
        self._drop_script = client.register_script(scripts.DROP)
        self._unlist = client.register_script(scripts.UNLIST)
        self._forget = client.register_script(scripts.FORGET)
        self._leases = client.register_script(scripts.LEASES)
        self._release = client.register_script(scripts.RELEASE)
        self._models_key = f"{p}:models"

    @classmethod
    def connect(cls, url: str, *, password: str | None = None, display: str | None = None,
                settings: RedisSettings | None = None) -> RedisStore:
        """A store over a new client for ``redis://`` / ``rediss://`` ``url``; nothing is sent
        to the server until the first operation (which reads its ``maxmemory-policy``)."""
        s = settings or RedisSettings()
        retry = Retry(ExponentialBackoff(cap=s.backoff_cap_s, base=s.backoff_base_s), s.retries)
        kwargs: dict[str, str] = {}
        if password is not None:
            kwargs["password"] = password
        client = redis.Redis.from_url(
            url, socket_timeout=s.socket_timeout_s, socket_connect_timeout=s.connect_timeout_s,
            retry=retry, retry_on_error=[redis.exceptions.ConnectionError,
                                         redis.exceptions.TimeoutError],
            health_check_interval=s.health_check_interval_s, decode_responses=False, **kwargs)
        return cls(client, url=display or url, settings=s)

    # ---- keys --------------------------------------------------------------------------------
    def _owner(self, tenant: str | None) -> str:
        return SHARED if tenant is None else tenant

    def _manifest_key(self, model: str, owner: str, key: str) -> str:
        return f"{self.settings.prefix}:e:{{{model}/{owner}/{key}}}:m"

    def _chunk_keys(self, model: str, owner: str, key: str, gen: str, n: int) -> list[str]:
        base = f"{self.settings.prefix}:e:{{{model}/{owner}/{key}}}:c:{gen}"
        return [f"{base}:{i}" for i in range(n)]

    def _k(self, what: str, model: str) -> str:
        return f"{self.settings.prefix}:{what}:{model}"

    def _idx(self, model: str, owner: str) -> str:
        return f"{self._k('idx', model)}:{owner}"

    def _parse(self, raw: bytes | None) -> Manifest | None:
        return parse_manifest(raw, self.settings.max_chunks)

    # ---- faults ------------------------------------------------------------------------------
    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            self._check_policy(op)
            yield
        except redis.exceptions.RedisError as err:
            reason = fault_reason(err)
            if reason in ("down", "timeout", "tls"):  # it may come back as another server
                self._policy_ok = False
            self._fault(reason, op, str(err))
            hint = HINTS.get(reason, "see the server's log")
            raise StoreUnavailableError(reason, f"store {self.url}: {op} failed ({reason}: "
                                                f"{err}); {hint}") from err
        with self._state_lock:
            was, self._down = self._down, None
        if was is not None:
            log.warning("kvnotes: store %s answers again (it was unavailable: %s)", self.url, was)

    def _fault(self, reason: str, op: str, detail: str) -> None:
        """Count a fault; log it when it is the first since the store last answered."""
        self.faults.count(reason)
        with self._state_lock:
            first, self._down = self._down is None, reason
        if first:
            log.warning("kvnotes: store %s unavailable (%s) during %s: %s; serving without "
                        "it until it answers", self.url, reason, op, detail)

    def _check_policy(self, op: str) -> None:
        """Refuse a server that may evict the store's bookkeeping (read once per connection
        to it; see :mod:`~kvnotes.serving.store.redis_settings`)."""
        if self._policy_ok:
            return
        why = refused_policy(eviction_policy(self.client))
        if why is None:
            self._policy_ok = True
            return
        self._fault("policy", op, why)
        raise StoreUnavailableError("policy", f"store {self.url}: refused: {why}")

    @property
    def available(self) -> bool:
        """False from a fault until the next operation that the server answers."""
        with self._state_lock:
            return self._down is None

    def ping(self) -> bool:
        """True when the server answers and is usable (counts and logs a fault otherwise)."""
        try:
            with self._guard("ping"):
                return bool(self.client.ping())
        except StoreUnavailableError:
            return False

    # ---- entries -----------------------------------------------------------------------------
    def put(self, entry: StoredEntry) -> None:
        info, data = entry.info, entry.data
        check_key(info.model, "model id")
        cb, s = self.settings.chunk_bytes, self.settings
        if info.bytes > s.max_entry_bytes or -(-len(data) // cb) > s.max_chunks:
            raise InvalidArgumentError(f"entry {info.key}: {info.bytes} bytes, over the store's "
                                       f"max_entry_bytes of {s.max_entry_bytes} or its "
                                       f"{s.max_chunks} chunks of {cb} bytes")
        verify_entry(data, info)  # a store never publishes bytes that would fail their read
        owner = self._owner(info.tenant)
        chunks = [data[i:i + cb] for i in range(0, len(data), cb)]
        gen = secrets.token_hex(8)
        keys = self._chunk_keys(info.model, owner, info.key, gen, len(chunks))
        staging_ms = int(s.staging_ttl_s * 1000)
        with self._guard("put"):
            self._index(info, owner)  # listed before published: a listing skips it till then
            for key, chunk in zip(keys, chunks, strict=True):
                self.client.set(key, chunk, px=staging_ms)
                files.fault_point("store-chunk")
            self._publish_entry(info, owner, keys, manifest_bytes(info, gen, len(chunks)))
            self._after_publish(info, owner)

    def _index(self, info: EntryInfo, owner: str, pipe: Any = None) -> None:
        mine = pipe is None
        pipe = self.client.pipeline(transaction=False) if mine else pipe
        pipe.sadd(self._models_key, info.model)
        pipe.sadd(self._k("tenants", info.model), owner)
        pipe.sadd(self._idx(info.model, owner), info.key)
        if mine:
            pipe.execute()

    def _publish_entry(self, info: EntryInfo, owner: str, chunk_keys: list[str],
                       manifest: bytes) -> None:
        """Run :data:`~kvnotes.serving.store.redis_scripts.PUBLISH` with the previous
        generation's chunks, read just before (again when another host published between)."""
        mkey = self._manifest_key(info.model, owner, info.key)
        ttl_ms = int(self.settings.old_generation_ttl_s * 1000)
        for _ in range(TRIES):
            got = self.client.get(mkey)
            raw = got if isinstance(got, bytes) else None
            prev = self._parse(raw)
            old = self._chunk_keys(info.model, owner, info.key, prev.gen, prev.chunks) \
                if prev is not None else []
            result = self._publish(keys=[mkey, *chunk_keys, *old],
                                   args=[manifest, raw or b"", len(chunk_keys), ttl_ms])
            if result == 1:
                return
            if result == 0:
                self.faults.count("partial")
                raise StoreUnavailableError("partial", f"store {self.url}: a staged chunk "
                                            "expired or was evicted before the entry was "
                                            "published; nothing was published (is the server "
                                            "evicting keys?)")
        self.faults.count("error")
        raise StoreUnavailableError("error", f"store {self.url}: entry {info.key} was replaced "
                                    f"{TRIES} times while it was published; nothing was "
                                    "published (tried again later)")

    def _after_publish(self, info: EntryInfo, owner: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        self._index(info, owner, pipe)  # again: a listing between the two may have unlisted it
        pipe.zadd(self._k("lru", info.model), {info.key: info.last_used or time.time()}, gt=True)
        if info.pinned:
            pipe.sadd(self._k("pins", info.model), info.key)
        pipe.zrem(self._k("gone", info.model), info.key)
        self._feed(pipe, info.model, "put", info.key, info.tenant, info.bytes)
        pipe.execute()

    def _feed(self, pipe: Any, model: str, op: str, key: str, tenant: str | None,
              nbytes: int = 0) -> None:
        pipe.xadd(self._k("feed", model), {"op": op, "key": key, "tenant": self._owner(tenant),
                                           "bytes": nbytes},
                  maxlen=self.settings.feed_len, approximate=True)

    def _manifests(self, model: str, owners: list[str], keys: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for owner, key in zip(owners, keys, strict=True):
            pipe.get(self._manifest_key(model, owner, key))
        return list(pipe.execute())

    def get(self, model: str, key: str, tenant: str | None) -> StoredEntry | None:
        check_key(model, "model id")
        check_key(key)
        check_tenant(tenant)
        owners = [SHARED] if tenant is None else [tenant, SHARED]
        with self._guard("get"):
            raws = self._manifests(model, owners, [key] * len(owners))
            found = next(((o, r) for o, r in zip(owners, raws, strict=True) if r is not None),
                         None)
            if found is None:
                return None
            owner, raw = found
            m = self._parse(raw)
            if m is None or not self._is_entry(m, model, owner, key) or not visible(m.info,
                                                                                   tenant):
                self._drop(model, owner, key, raw, m, "malformed", "its manifest is not one of "
                           "this entry")
                return None
            if m.info.bytes > self.settings.max_entry_bytes:
                return None
            data = self._read_chunks(model, owner, key, raw, m)
            if data is None:
                return None
            try:
                verify_entry(data, m.info)
            except KvnotesError as err:
                self._drop(model, owner, key, raw, m, "checksum", str(err))
                return None
        return StoredEntry(m.info, data)

    def _is_entry(self, m: Manifest, model: str, owner: str, key: str) -> bool:
        return m.info.model == model and m.info.key == key and self._owner(m.info.tenant) == owner

    def _read_chunks(self, model: str, owner: str, key: str, raw: bytes,
                     m: Manifest) -> bytes | None:
        """The entry's bytes; None (dropped, counted) when a chunk is gone or the chunks hold
        more or less than declared: their sizes are read first, so a read never fetches more
        than the manifest says."""
        keys = self._chunk_keys(model, owner, key, m.gen, m.chunks)
        if not keys:
            return b""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        sizes = [int(n) for n in pipe.execute()]
        if 0 in sizes:  # STRLEN of a missing key (a chunk is never empty)
            self._drop(model, owner, key, raw, m, "partial", "a chunk is gone")
            return None
        if sum(sizes) != m.info.bytes:
            self._drop(model, owner, key, raw, m, "malformed", f"its chunks hold {sum(sizes)} "
                       f"bytes, its manifest declares {m.info.bytes}")
            return None
        chunks = [c for c in self.client.mget(keys) if isinstance(c, bytes)]
        if len(chunks) != len(keys):
            self._drop(model, owner, key, raw, m, "partial", "a chunk is gone")
            return None
        return b"".join(chunks)

    def _drop(self, model: str, owner: str, key: str, raw: bytes, m: Manifest | None,
              reason: str, why: str) -> None:
        """Delete an entry that failed its checks, with its index member (unless republished
        meanwhile): a miss. A forged copy of another entry's manifest leaves that entry's LRU,
        hits and pin alone."""
        self.faults.count(reason)
        log.warning("kvnotes: store %s: entry %s/%s dropped (%s): %s", self.url, model, key,
                    reason, why)
        own = m is None or (m.info.key == key and self._owner(m.info.tenant) == owner)
        chunk_keys = self._chunk_keys(model, owner, key, m.gen, m.chunks) if m else []
        self._drop_script(keys=[self._manifest_key(model, owner, key), self._idx(model, owner),
                                self._k("lru", model), self._k("hits", model),
                                self._k("pins", model), *chunk_keys],
                          args=[raw, key, "1" if own else "0"])

    def models(self) -> builtins.list[str]:
        with self._guard("models"):
            return sorted(text(m) for m in self.client.smembers(self._models_key))

    def list(self, model: str | None = None, tenant: str | None = None, *,
             every: bool = False) -> builtins.list[EntryInfo]:
        check_tenant(tenant)
        out: list[EntryInfo] = []
        for m in [check_key(model, "model id")] if model is not None else self.models():
            with self._guard("list"):
                out.extend(self._list_model(m, tenant, every))
        return sorted(out, key=lambda i: (i.last_used, i.key))

    def _list_model(self, model: str, tenant: str | None, every: bool) -> builtins.list[EntryInfo]:
        if every:
            owners = sorted(text(o) for o in self.client.smembers(self._k("tenants", model)))
        else:
            owners = [SHARED] if tenant is None else [SHARED, tenant]
        pipe = self.client.pipeline(transaction=False)
        for owner in owners:
            pipe.smembers(self._idx(model, owner))
        pipe.smembers(self._k("pins", model))
        pipe.zrange(self._k("lru", model), 0, -1, withscores=True)
        pipe.hgetall(self._k("hits", model))
        *members, pins_raw, lru_raw, hits_raw = pipe.execute()
        pairs = [(o, text(k)) for o, keys in zip(owners, members, strict=True) for k in keys]
        raws = self._manifests(model, [o for o, _ in pairs], [k for _, k in pairs])
        pins = {text(p) for p in pins_raw}
        lru = {text(k): n for k, v in lru_raw if (n := number(v)) is not None}
        hits = {text(k): int(n) for k, v in hits_raw.items()
                if (n := number(v)) is not None and 0 <= n < 1 << 53}
        out, gone = [], []
        for (owner, key), raw in zip(pairs, raws, strict=True):
            if raw is None:
                gone.append((owner, key))
                continue
            m = self._parse(raw)
            if m is None or not self._is_entry(m, model, owner, key):
                self._drop(model, owner, key, raw, m, "malformed", "its manifest is not one "
                           "of this entry")
                continue
            i = m.info
            out.append(EntryInfo(i.key, model, i.tenant, i.name, i.tokens, i.bytes, i.sha256,
                                 i.kind, i.learned, key in pins, i.hits + hits.get(key, 0),
                                 lru.get(key, i.last_used), i.created, i.skill, i.variant_of,
                                 i.behind, i.behind_tokens))
        self._unlist_gone(model, gone)
        return out

    def _unlist_gone(self, model: str, gone: builtins.list[tuple[str, str]]) -> None:
        """Remove index members whose manifest is gone (dropped, evicted, flushed), in one
        round trip; each is checked again in the script, and a publish in flight adds its
        member again once published."""
        if not gone:
            return
        pipe = self.client.pipeline(transaction=False)
        for owner, key in gone:
            self._unlist(keys=[self._manifest_key(model, owner, key), self._idx(model, owner),
                               self._k("lru", model), self._k("hits", model)],
                         args=[key], client=pipe)
        pipe.execute()

    def _locate(self, model: str, key: str) -> tuple[str, bytes] | None:
        """``(owner, manifest)`` of entry ``key`` of ``model``, whichever tenant owns it."""
        owners = sorted(text(o) for o in self.client.smembers(self._k("tenants", model)))
        raws = self._manifests(model, owners, [key] * len(owners))
        return next(((o, r) for o, r in zip(owners, raws, strict=True) if r is not None), None)

    def pin(self, model: str, key: str, pinned: bool = True) -> bool:
        check_key(model, "model id")
        with self._guard("pin"):
            found = self._locate(model, check_key(key))
            m = self._parse(found[1]) if found else None
            if m is None or not m.info.learned:
                return False
            if pinned:
                self.client.sadd(self._k("pins", model), key)
            else:
                self.client.srem(self._k("pins", model), key)
        return True

    def forget(self, model: str, key: str) -> bool:
        """Drop a learned entry: its keys, index members, LRU, hits and pin, and the forgotten
        set's and change feed's rows, in one script (all or nothing; safe to retry)."""
        check_key(model, "model id")
        check_key(key)
        with self._guard("forget"):
            for _ in range(TRIES):
                found = self._locate(model, key)
                m = self._parse(found[1]) if found else None
                if found is None or m is None or not m.info.learned:
                    return False
                owner, raw = found
                now = time.time()
                done = self._forget(
                    keys=[self._manifest_key(model, owner, key), self._idx(model, owner),
                          *(self._k(w, model) for w in ("lru", "hits", "pins", "gone", "feed")),
                          *self._chunk_keys(model, owner, key, m.gen, m.chunks)],
                    args=[raw, key, repr(now), now - FORGOTTEN_KEPT_S, self.settings.feed_len,
                          owner])
                if done != 2:
                    return done == 1
        return False  # republished each time it was read: it stays

    def delete(self, model: str, key: str) -> bool:
        check_key(model, "model id")
        with self._guard("delete"):
            found = self._locate(model, check_key(key))
            self._delete(model, key, found)
        return found is not None

    def _delete(self, model: str, key: str, found: tuple[str, bytes] | None) -> None:
        pipe = self.client.pipeline(transaction=False)
        if found is not None:
            owner, raw = found
            m = self._parse(raw)
            chunks = self._chunk_keys(model, owner, key, m.gen, m.chunks) if m else []
            for i in range(0, len(chunks), scripts.UNPACK_BATCH):
                pipe.delete(*chunks[i:i + scripts.UNPACK_BATCH])
            pipe.delete(self._manifest_key(model, owner, key))
            pipe.srem(self._idx(model, owner), key)
        pipe.srem(self._k("pins", model), key)
        pipe.zrem(self._k("lru", model), key)
        pipe.hdel(self._k("hits", model), key)
        pipe.execute()

    def touch(self, model: str, hits: Mapping[str, int], when: float | None = None) -> None:
        if not hits:
            return
        when = time.time() if when is None else when
        with self._guard("touch"):
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self._k("lru", model), {check_key(k): when for k in hits}, gt=True)
            for key, n in hits.items():
                if n:
                    pipe.hincrby(self._k("hits", model), key, int(n))
            pipe.execute()

    def forgotten(self, model: str, since: float = 0.0) -> builtins.list[str]:
        with self._guard("forgotten"):
            keys = self.client.zrangebyscore(self._k("gone", check_key(model, "model id")),
                                             since, "+inf")
        return sorted(text(k) for k in keys)

    def changes(self, model: str, after: str | None
                ) -> tuple[str, builtins.list[Change]] | None:
        feed = self._k("feed", check_key(model, "model id"))
        with self._guard("changes"):
            if not self.client.exists(feed):  # never written, or flushed: nothing since
                return after or "0-0", []
            info = self.client.xinfo_stream(feed)
            last = text(info.get("last-generated-id", b"0-0"))
            if after is None:
                return last, []
            if self._trimmed(feed, info, after, last):
                return None
            rows = self.client.xrange(feed, min=f"({after}", max="+",
                                      count=self.settings.feed_len) or []
        out = []
        for id_, fields in rows:
            f = {text(k): text(v) for k, v in (fields or {}).items()}
            tenant = None if f.get("tenant") == SHARED else f.get("tenant")
            if f.get("op") in ("put", "forget") and f.get("key"):
                size = f.get("bytes", "0")
                out.append(Change(f["op"], f["key"], tenant, int(size) if size.isdigit() else 0))
            last = text(id_)
        return (last if rows else after), out

    def _trimmed(self, feed: str, info: Any, after: str, last: str) -> bool:
        # info: redis-py's XINFO STREAM reply (untyped)
        """Whether the feed may have lost entries after ``after`` (trimming drops the oldest:
        while the entry at ``after`` is still there, nothing after it was dropped)."""
        if after == "0-0":  # read while the feed was empty: lost if any entry is gone
            added, length = info.get("entries-added"), info.get("length", 0)
            return added is None or int(added) > int(length)
        if self.client.xrange(feed, min=after, max=after, count=1):
            return False
        return stream_id(last) > stream_id(after)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"

