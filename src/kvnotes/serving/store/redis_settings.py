"""How a :class:`~kvnotes.serving.store.redis_store.RedisStore` talks to its server, what its
faults are called, and which servers it refuses.

A server whose ``maxmemory-policy`` is one of the ``allkeys-*`` policies is refused: such a
server evicts any key when full, the store's own bookkeeping included: the epoch (every host then
publishes its whole library again into a full server), a held compile lease (two hosts compile
the same chunk), the index sets (readable entries vanish from listings and from the cap). The
``volatile-*`` policies evict only keys with an expiry: staged chunks (a publish then fails,
counted ``partial``), a replaced entry's previous chunks, sighting counters and leases (a chunk
may then be compiled twice); never a published entry or the bookkeeping. ``noeviction`` evicts
nothing: a full server refuses writes (counted ``full``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import redis

from kvnotes.core.errors import InvalidArgumentError


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
    max_chunks: int = 1024  # per entry: a manifest naming more is malformed
    staging_ttl_s: float = 600.0  # a dead writer's chunks expire after this
    old_generation_ttl_s: float = 60.0  # a replaced entry's chunks stay this long for readers
    max_entry_bytes: int = 1 << 30  # larger entries are neither published nor fetched
    prefix: str = "kvn"
    feed_len: int = 100_000  # publishes and forgets the change feed keeps (about)

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1024 or self.socket_timeout_s <= 0 or self.retries < 0 \
                or self.max_chunks < 1:
            raise InvalidArgumentError("RedisSettings: chunk_bytes >= 1024, socket_timeout_s > 0, "
                                       "retries >= 0 and max_chunks >= 1 are required")


def _tls_failure(err: BaseException) -> bool:
    """Whether ``err`` or an error it was raised from is a TLS one (a handshake that failed or
    timed out: ``rediss://`` to a server without TLS reads as a slow server otherwise)."""
    seen: BaseException | None = err
    for _ in range(8):  # a chain of causes is short; a bound all the same
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) or "handshake" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def fault_reason(err: BaseException) -> str:
    """The fault counter's reason for a redis-py error.

    Example:
        >>> import redis.exceptions as e
        >>> fault_reason(e.TimeoutError()), fault_reason(e.ResponseError("OOM command not allowed"))
        ('timeout', 'full')
    """
    e = redis.exceptions
    if isinstance(err, (e.ConnectionError, e.TimeoutError)) and _tls_failure(err):
        return "tls"
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


HINTS = {
    "full": "the server reached maxmemory: raise it, or lower the library cap",
    "auth": "check the password (--store-password-file) and user",
    "down": "is the server running and reachable?",
    "timeout": "the server answered slower than the socket timeout",
    "tls": "the TLS handshake failed: rediss:// needs a server with TLS on that port (its "
           "certificate valid for the host name); redis:// is a server without TLS",
}


def eviction_policy(client: redis.Redis) -> str | None:
    """The server's ``maxmemory-policy`` (None when it says neither through ``CONFIG GET`` nor
    ``INFO``: a managed server may refuse both)."""
    try:
        got = client.config_get("maxmemory-policy")
        value = got.get("maxmemory-policy") or got.get(b"maxmemory-policy")  # type: ignore[call-overload]
    except redis.exceptions.ResponseError:  # CONFIG renamed or not allowed
        value = None
    if value is None:
        try:
            value = client.info("memory").get("maxmemory_policy")
        except redis.exceptions.ResponseError:
            return None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return str(value) if value is not None else None


def refused_policy(policy: str | None) -> str | None:
    """Why the store refuses a server with ``policy`` (None: it does not).

    Example:
        >>> refused_policy("noeviction") is None, refused_policy("volatile-lru") is None
        (True, True)
        >>> refused_policy("allkeys-lru").split(":")[0]
        'maxmemory-policy allkeys-lru evicts any key when the server is full'
    """
    if policy is None or not policy.startswith("allkeys-"):
        return None
    return (f"maxmemory-policy {policy} evicts any key when the server is full: the store's "
            "epoch, compile leases and indexes too; set noeviction (a full server refuses "
            "writes) or volatile-lru (it evicts only keys with an expiry) "
            "(CONFIG SET maxmemory-policy noeviction)")
