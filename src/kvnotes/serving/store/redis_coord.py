"""What a fleet's learners agree on in a Redis store: sighting counts, the epoch, compile leases
(a part of :class:`~kvnotes.serving.store.redis_store.RedisStore`).

A lease holds ``TOKEN:NONCE``: the holder's token and a nonce fresh per call. A call whose reply
was lost (a timeout: the server may have applied it) leaves its leases *uncertain*: this store
gives them back (only if they still hold that call's value) first thing in its next lease call
or :meth:`LearnerCalls.settle_leases`, so that no chunk waits out a lease that nobody believes
it holds. A request's due chunks' leases are one call (:meth:`LearnerCalls.acquire_leases`).
The values this store's takes set are remembered until given back, so that the holder renews
exactly its own leases (:meth:`LearnerCalls.renew_leases`: a compare-and-set on that value).
"""

from __future__ import annotations

import builtins
import secrets
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import redis

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.store.redis_data import text
from kvnotes.serving.store.redis_scripts import RENEW
from kvnotes.serving.store.redis_settings import RedisSettings

UNCERTAIN_KEPT = 10_000  # uncertain leases remembered to be given back (the oldest go first)
# a lease call that failed for one of these may have been applied by the server
UNCERTAIN_REASONS = ("timeout", "down")


class LearnerCalls:
    """Sightings, the epoch and leases of a :class:`RedisStore` (its base class)."""

    client: redis.Redis
    settings: RedisSettings
    _token: str
    _state_lock: threading.Lock
    _uncertain: dict[str, str]
    _leases: Any  # redis-py Script objects (untyped)
    _release: Any

    def _guard(self, op: str) -> AbstractContextManager[None]:
        raise NotImplementedError

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
        return text(value) if value is not None else ""

    def clear_sighting(self, name: str) -> None:
        with self._guard("clear_sighting"):
            self.client.delete(f"{self.settings.prefix}:seen:{name}")

    def _lease_key(self, name: str) -> str:
        return f"{self.settings.prefix}:lease:{name}"

    def acquire_lease(self, name: str, ttl_s: float) -> bool:
        return self.acquire_leases([name], ttl_s)[0]

    def acquire_leases(self, names: Sequence[str], ttl_s: float) -> builtins.list[bool]:
        """Take each of ``names`` for ``ttl_s`` seconds, in one script call, after giving back
        the uncertain leases (see the module docstring); per name, whether it was taken."""
        if not names:
            return []
        keys = [self._lease_key(n) for n in names]
        value = f"{self._token}:{secrets.token_hex(8)}"
        got = self._lease_call("acquire_leases", keys, value, max(1, int(ttl_s * 1000)))
        with self._state_lock:
            self._held_values().update((k, value) for k, x in zip(keys, got, strict=True) if x)
        return [bool(x) for x in got]

    def _held_values(self) -> dict[str, str]:
        """Lease key -> the value this store's take set, for the leases it holds (under
        ``_state_lock``; made on first use: the store's constructor does not know it)."""
        held: dict[str, str] | None = self.__dict__.get("_held")
        if held is None:
            held = self.__dict__["_held"] = {}
        return held

    def renew_leases(self, names: Sequence[str], ttl_s: float) -> builtins.list[bool]:
        """Set the time to live of each of ``names`` to ``ttl_s`` seconds again, where it still
        holds the value this store's take set (one script call); per name, whether it is still
        held (False: it expired, was given back, or is another holder's now)."""
        keys = [self._lease_key(n) for n in names]
        with self._state_lock:
            held = self._held_values()
            ours = [k for k in keys if k in held]
            values = [held[k] for k in ours]
        if not ours:
            return [False] * len(names)
        with self._guard("renew_leases"):
            got = self.client.register_script(RENEW)(
                keys=ours, args=[max(1, int(ttl_s * 1000)), *values])
        kept = {k for k, x in zip(ours, got, strict=True) if int(x)}
        with self._state_lock:
            held = self._held_values()
            for k in set(ours) - kept:
                held.pop(k, None)
        return [k in kept for k in keys]

    def settle_leases(self) -> int:
        """Give back the uncertain leases now (a learner's chores call it); how many were
        pending."""
        with self._state_lock:
            pending = len(self._uncertain)
        if pending:
            self._lease_call("settle_leases", [], "", 1)
        return pending

    def _lease_call(self, op: str, keys: list[str], value: str,
                    ttl_ms: int) -> builtins.list[int]:
        with self._state_lock:  # claimed by this call: another call does not settle them too
            settle, self._uncertain = self._uncertain, {}
        try:
            with self._guard(op):
                got = self._leases(keys=[*keys, *settle],
                                   args=[value, ttl_ms, len(keys), *settle.values()])
        except StoreUnavailableError as err:
            self._remember(settle, newer=False)
            if err.reason in UNCERTAIN_REASONS:
                self._remember(dict.fromkeys(keys, value))
            raise
        return [int(x) for x in got]

    def _remember(self, values: dict[str, str], *, newer: bool = True) -> None:
        """Add uncertain leases (``newer=False``: put back ones a failed call claimed, unless
        a later call made them uncertain again)."""
        with self._state_lock:
            for key, value in values.items():
                if not newer and key in self._uncertain:
                    continue
                self._uncertain.pop(key, None)
                self._uncertain[key] = value
            while len(self._uncertain) > UNCERTAIN_KEPT:
                del self._uncertain[next(iter(self._uncertain))]

    def release_lease(self, name: str) -> bool:
        key = self._lease_key(name)
        with self._state_lock:
            self._held_values().pop(key, None)
        try:
            with self._guard("release_lease"):
                n = self._release(keys=[key], args=[self._token])
        except StoreUnavailableError as err:
            if err.reason in UNCERTAIN_REASONS:  # given back by the next lease call
                self._remember({key: f"{self._token}:"})
            raise
        return bool(n)
