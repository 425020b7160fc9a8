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
that every chunk is there, removes their expiry and sets the manifest. A reader reads the
manifest, then the chunks it names: it sees a whole entry or none. The previous generation's
chunks are given a short expiry, so a reader that read the old manifest still finds them.

Reading checks everything (:func:`~kvnotes.serving.store.entry.verify_entry`): a value whose
checksum fails, whose chunks are gone (evicted by ``maxmemory``), or whose manifest names
another tenant than its key is deleted, counted and read as a miss. Redis errors become
:class:`~kvnotes.core.errors.StoreUnavailableError` with a reason (``down``, ``timeout``,
``full``, ...); the client reconnects on its own (redis-py's retry with backoff and health
checks), so the store is used again as soon as the server answers.
"""

from __future__ import annotations

import builtins
import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

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

log = logging.getLogger("kvnotes.serving.store")

SHARED = "~"  # the tenant field of the operator's shared entries (no tenant name has a '~')
MANIFEST_VERSION = 1
FORGOTTEN_KEPT_S = 7 * 86400  # how long a forgotten key is remembered for hosts to drop it

# KEYS[1] manifest, KEYS[2..] the staged chunks; ARGV[1] the new manifest. 0: a chunk is
# missing (expired or evicted: nothing published); 1: published; else the old manifest.
_PUBLISH = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return 0 end
end
for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
if old then return old end
return 1
"""
# KEYS[1] manifest, KEYS[2..] its chunks: deleted only while the manifest is still ARGV[1]
# (a newer publish meanwhile is left alone)
_DROP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', unpack(KEYS))
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """How a :class:`RedisStore` talks to its server. Timeouts are small: nothing waits for the
    store on a request's path, and a store that answers slowly is treated as down."""

    socket_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    retries: int = 2  # after the first try, on connection errors and timeouts
    backoff_base_s: float = 0.05
    backoff_cap_s: float = 0.5
    health_check_interval_s: int = 5  # a connection idle this long is PINGed before use
    chunk_bytes: int = 4 << 20
    staging_ttl_s: float = 600.0  # a dead writer's chunks expire after this
    old_generation_ttl_s: float = 60.0  # a replaced entry's chunks stay this long for readers
    max_entry_bytes: int = 1 << 30  # larger entries are neither published nor fetched
    prefix: str = "kvn"
    feed_len: int = 100_000  # publishes and forgets the change feed keeps (about)

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1024 or self.socket_timeout_s <= 0 or self.retries < 0:
            raise InvalidArgumentError("RedisSettings: chunk_bytes >= 1024, socket_timeout_s > 0 "
                                       "and retries >= 0 are required")


def fault_reason(err: BaseException) -> str:
    """The fault counter's reason for a redis-py error.

    Example:
        >>> import redis.exceptions as e
        >>> fault_reason(e.TimeoutError()), fault_reason(e.ResponseError("OOM command not allowed"))
        ('timeout', 'full')
    """
    e = redis.exceptions
    if isinstance(err, e.TimeoutError):
        return "timeout"
    if isinstance(err, (e.AuthenticationError, e.AuthorizationError, e.NoPermissionError)):
        return "auth"
    if isinstance(err, e.BusyLoadingError):
        return "loading"
    if isinstance(err, e.ConnectionError):
        return "down"
    if isinstance(err, e.OutOfMemoryError):
        return "full"
    if isinstance(err, e.ReadOnlyError):
        return "readonly"
    text = str(err)
    for code, reason in (("OOM", "full"), ("LOADING", "loading"), ("READONLY", "readonly"),
                         ("NOAUTH", "auth"), ("WRONGPASS", "auth")):
        if text.startswith(code):
            return reason
    return "error"


_HINTS = {
    "full": "the server reached maxmemory: raise it, or lower the library cap",
    "auth": "check the password (--store-password-file) and user",
    "down": "is the server running and reachable?",
    "timeout": "the server answered slower than the socket timeout",
}


class RedisStore:
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
        p = self.settings.prefix
        self._publish = client.register_script(_PUBLISH)
        self._drop_script = client.register_script(_DROP)
        self._release = client.register_script(_RELEASE)
        self._models_key = f"{p}:models"

    @classmethod
    def connect(cls, url: str, *, password: str | None = None, display: str | None = None,
                settings: RedisSettings | None = None) -> RedisStore:
        """A store over a new client for ``redis://`` / ``rediss://`` ``url``; nothing is sent
        to the server until the first operation."""
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

    # ---- faults ------------------------------------------------------------------------------
    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.RedisError as err:
            reason = fault_reason(err)
            self.faults.count(reason)
            with self._state_lock:
                first, self._down = self._down is None, reason
            if first:
                log.warning("kvnotes: store %s unavailable (%s) during %s: %s; serving without "
                            "it until it answers", self.url, reason, op, err)
            hint = _HINTS.get(reason, "see the server's log")
            raise StoreUnavailableError(reason, f"store {self.url}: {op} failed ({reason}: "
                                                f"{err}); {hint}") from err
        with self._state_lock:
            was, self._down = self._down, None
        if was is not None:
            log.warning("kvnotes: store %s answers again (it was unavailable: %s)", self.url, was)

    @property
    def available(self) -> bool:
        """False from a fault until the next operation that the server answers."""
        with self._state_lock:
            return self._down is None

    def ping(self) -> bool:
        """True when the server answers (counts and logs a fault otherwise)."""
        try:
            with self._guard("ping"):
                return bool(self.client.ping())
        except StoreUnavailableError:
            return False

    # ---- entries -----------------------------------------------------------------------------
    def put(self, entry: StoredEntry) -> None:
        info, data = entry.info, entry.data
        check_key(info.model, "model id")
        if info.bytes > self.settings.max_entry_bytes:
            raise InvalidArgumentError(f"entry {info.key}: {info.bytes} bytes, over the store's "
                                       f"max_entry_bytes of {self.settings.max_entry_bytes}")
        verify_entry(data, info)  # a store never publishes bytes that would fail their read
        owner, cb = self._owner(info.tenant), self.settings.chunk_bytes
        chunks = [data[i:i + cb] for i in range(0, len(data), cb)]
        gen = secrets.token_hex(8)
        keys = self._chunk_keys(info.model, owner, info.key, gen, len(chunks))
        manifest = json.dumps({"v": MANIFEST_VERSION, "info": info.to_dict(), "gen": gen,
                               "chunks": len(chunks)}).encode()
        staging_ms = int(self.settings.staging_ttl_s * 1000)
        with self._guard("put"):
            # listed before published: a listing skips a key whose manifest is not there yet
            pipe = self.client.pipeline(transaction=False)
            pipe.sadd(self._models_key, info.model)
            pipe.sadd(self._k("tenants", info.model), owner)
            pipe.sadd(f"{self._k('idx', info.model)}:{owner}", info.key)
            pipe.execute()
            for key, chunk in zip(keys, chunks, strict=True):
                self.client.set(key, chunk, px=staging_ms)
                files.fault_point("store-chunk")
            old = self._publish_entry(self._manifest_key(info.model, owner, info.key), keys,
                                      manifest)
            self._after_publish(info, old)

    def _publish_entry(self, manifest_key: str, chunk_keys: list[str], manifest: bytes) -> object:
        result = self._publish(keys=[manifest_key, *chunk_keys], args=[manifest])
        if result == 0:
            self.faults.count("partial")
            raise StoreUnavailableError("partial", f"store {self.url}: a staged chunk expired "
                                        "or was evicted before the entry was published; nothing "
                                        "was published (is the server evicting keys?)")
        return result

    def _after_publish(self, info: EntryInfo, old: object) -> None:
        pipe = self.client.pipeline(transaction=False)
        if isinstance(old, bytes):  # the chunks of the entry it replaced: expire them
            prev = _parse_manifest(old)
            if prev is not None:
                keys = self._chunk_keys(info.model, self._owner(info.tenant), info.key,
                                        prev[1], prev[2])
                for key in keys:
                    pipe.pexpire(key, int(self.settings.old_generation_ttl_s * 1000))
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
            parsed = _parse_manifest(raw)
            if parsed is None or parsed[0].model != model or parsed[0].key != key \
                    or self._owner(parsed[0].tenant) != owner or not visible(parsed[0], tenant):
                self._drop(model, owner, key, raw, "malformed", "its manifest is not one of "
                           "this entry")
                return None
            info, gen, n = parsed
            if info.bytes > self.settings.max_entry_bytes:
                return None
            chunks = self.client.mget(self._chunk_keys(model, owner, key, gen, n)) if n else []
            if any(c is None for c in chunks):
                self._drop(model, owner, key, raw, "partial", "a chunk is gone")
                return None
            data = b"".join(c for c in chunks if isinstance(c, bytes))
            try:
                verify_entry(data, info)
            except KvnotesError as err:
                self._drop(model, owner, key, raw, "checksum", str(err))
                return None
        return StoredEntry(info, data)

    def _drop(self, model: str, owner: str, key: str, raw: bytes, reason: str,
              why: str) -> None:
        """Delete an entry that failed its checks (unless republished meanwhile): a miss."""
        self.faults.count(reason)
        log.warning("kvnotes: store %s: entry %s/%s dropped (%s): %s", self.url, model, key,
                    reason, why)
        parsed = _parse_manifest(raw)
        chunk_keys = self._chunk_keys(model, owner, key, parsed[1], parsed[2]) if parsed else []
        self._drop_script(keys=[self._manifest_key(model, owner, key), *chunk_keys], args=[raw])

    def models(self) -> builtins.list[str]:
        with self._guard("models"):
            return sorted(_text(m) for m in self.client.smembers(self._models_key))

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
            owners = sorted(_text(o) for o in self.client.smembers(self._k("tenants", model)))
        else:
            owners = [SHARED] if tenant is None else [SHARED, tenant]
        pipe = self.client.pipeline(transaction=False)
        for owner in owners:
            pipe.smembers(f"{self._k('idx', model)}:{owner}")
        pipe.smembers(self._k("pins", model))
        pipe.zrange(self._k("lru", model), 0, -1, withscores=True)
        pipe.hgetall(self._k("hits", model))
        *members, pins_raw, lru_raw, hits_raw = pipe.execute()
        pairs = [(o, _text(k)) for o, keys in zip(owners, members, strict=True) for k in keys]
        raws = self._manifests(model, [o for o, _ in pairs], [k for _, k in pairs])
        pins = {_text(p) for p in pins_raw}
        lru = {_text(k): float(v) for k, v in lru_raw}
        hits = {_text(k): int(v) for k, v in hits_raw.items()}
        out = []
        for (owner, key), raw in zip(pairs, raws, strict=True):
            parsed = _parse_manifest(raw) if raw is not None else None
            if parsed is None or parsed[0].key != key or self._owner(parsed[0].tenant) != owner:
                continue  # not published yet, or not this key's: never listed
            i = parsed[0]
            out.append(EntryInfo(i.key, model, i.tenant, i.name, i.tokens, i.bytes, i.sha256,
                                 i.kind, i.learned, key in pins, i.hits + hits.get(key, 0),
                                 lru.get(key, i.last_used), i.created, i.skill, i.variant_of,
                                 i.behind, i.behind_tokens))
        return out

    def _locate(self, model: str, key: str) -> tuple[str, bytes] | None:
        """``(owner, manifest)`` of entry ``key`` of ``model``, whichever tenant owns it."""
        owners = sorted(_text(o) for o in self.client.smembers(self._k("tenants", model)))
        raws = self._manifests(model, owners, [key] * len(owners))
        return next(((o, r) for o, r in zip(owners, raws, strict=True) if r is not None), None)

    def pin(self, model: str, key: str, pinned: bool = True) -> bool:
        check_key(model, "model id")
        with self._guard("pin"):
            found = self._locate(model, check_key(key))
            parsed = _parse_manifest(found[1]) if found else None
            if parsed is None or not parsed[0].learned:
                return False
            if pinned:
                self.client.sadd(self._k("pins", model), key)
            else:
                self.client.srem(self._k("pins", model), key)
        return True

    def forget(self, model: str, key: str) -> bool:
        check_key(model, "model id")
        with self._guard("forget"):
            found = self._locate(model, check_key(key))
            parsed = _parse_manifest(found[1]) if found else None
            if parsed is None or not parsed[0].learned:
                return False
            now = time.time()
            self._delete(model, key, found)
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self._k("gone", model), {key: now})
            pipe.zremrangebyscore(self._k("gone", model), 0, now - FORGOTTEN_KEPT_S)
            self._feed(pipe, model, "forget", key, parsed[0].tenant)
            pipe.execute()
        return True

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
            parsed = _parse_manifest(raw)
            chunks = self._chunk_keys(model, owner, key, parsed[1], parsed[2]) if parsed else []
            pipe.delete(self._manifest_key(model, owner, key), *chunks)
            pipe.srem(f"{self._k('idx', model)}:{owner}", key)
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
        return sorted(_text(k) for k in keys)

    def changes(self, model: str, after: str | None
                ) -> tuple[str, builtins.list[Change]] | None:
        feed = self._k("feed", check_key(model, "model id"))
        with self._guard("changes"):
            if not self.client.exists(feed):  # never written, or flushed: nothing since
                return after or "0-0", []
            info = self.client.xinfo_stream(feed)
            last = _text(info.get("last-generated-id", b"0-0"))
            if after is None:
                return last, []
            if self._trimmed(feed, info, after, last):
                return None
            rows = self.client.xrange(feed, min=f"({after}", max="+",
                                      count=self.settings.feed_len) or []
        out = []
        for id_, fields in rows:
            f = {_text(k): _text(v) for k, v in (fields or {}).items()}
            tenant = None if f.get("tenant") == SHARED else f.get("tenant")
            if f.get("op") in ("put", "forget") and f.get("key"):
                size = f.get("bytes", "0")
                out.append(Change(f["op"], f["key"], tenant, int(size) if size.isdigit() else 0))
            last = _text(id_)
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
        return _stream_id(last) > _stream_id(after)

    # ---- what learners agree on ---------------------------------------------------------------
    def incr_sighting(self, name: str, ttl_s: float = 86400.0) -> int:
        return self._incr_seen([name], ttl_s, "incr_sighting")[0]

    def incr_sightings(self, names: Sequence[str],
                       ttl_s: float = 86400.0) -> builtins.list[int]:
        return self._incr_seen(names, ttl_s, "incr_sightings")

    def _incr_seen(self, names: Sequence[str], ttl_s: float, op: str) -> builtins.list[int]:
        """An INCR and a PEXPIRE per name, sent together (one round trip). In MULTI/EXEC: the
        server runs them only at EXEC, so a client cut off mid-send leaves no counter without
        its expiry."""
        if not names:
            return []
        with self._guard(op):
            pipe = self.client.pipeline(transaction=True)
            for name in names:
                key = f"{self.settings.prefix}:seen:{name}"
                pipe.incr(key)
                pipe.pexpire(key, int(ttl_s * 1000))
            replies = pipe.execute()
        return [int(count) for count in replies[::2]]

    def epoch(self) -> str:
        key = f"{self.settings.prefix}:epoch"
        with self._guard("epoch"):
            self.client.set(key, secrets.token_hex(8), nx=True)
            value = self.client.get(key)
        return _text(value) if value is not None else ""

    def clear_sighting(self, name: str) -> None:
        with self._guard("clear_sighting"):
            self.client.delete(f"{self.settings.prefix}:seen:{name}")

    def acquire_lease(self, name: str, ttl_s: float) -> bool:
        with self._guard("acquire_lease"):
            got = self.client.set(f"{self.settings.prefix}:lease:{name}", self._token,
                                  nx=True, px=max(1, int(ttl_s * 1000)))
        return bool(got)

    def release_lease(self, name: str) -> bool:
        with self._guard("release_lease"):
            n = self._release(keys=[f"{self.settings.prefix}:lease:{name}"], args=[self._token])
        return bool(n)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r})"


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _text(value: object) -> str:
    """A name redis-py returned (bytes: this client does not decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_manifest(raw: bytes | None) -> tuple[EntryInfo, str, int] | None:
    """``(info, generation, chunks)`` of a manifest's bytes; None for anything else."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("v") != MANIFEST_VERSION:
            return None
        gen, n = data["gen"], data["chunks"]
        if not isinstance(gen, str) or not gen.isalnum() or not isinstance(n, int) or n < 0:
            return None
        return EntryInfo.from_dict(data["info"]), gen, n
    except (ValueError, KeyError, KvnotesError):
        return None
