"""Learning for a fleet: sightings counted, compiles leased and entries published in one store.

Every host of a fleet runs a :class:`FleetLearner` over the same shared
:class:`~kvnotes.serving.store.base.Store` (Redis): a chunk's sightings are counted across hosts
(:class:`StoreSightings`), one host compiles it (:class:`StoreCompileLeases`: a lease with a
short time to live that its holder renews, so a host that dies mid-compile leaves the lease to
expire within ``FleetSettings.lease_s`` and no entry behind:
an entry is written locally and published atomically only once whole), and the compiled entry is
published to the store (:class:`Publisher`) as well as written to the host's folder. The other
hosts' :class:`~kvnotes.serving.store.mirror.LocalMirror` fetch it in the background into their
folders, where the connector and the front's catalog find it; a host whose sightings make a job
due that another host compiled takes the store's copy instead of compiling it again
(:meth:`Publisher.adopt`).

The request path reaches the store through a :class:`StoreGate` in two calls at most: a
request's sightings (one MULTI/EXEC) and, when some of its jobs came due, all their compile leases
(one script, :meth:`StoreCompileLeases.take_all`). Each call is bounded by the store's socket
timeout (a store made with :func:`request_path_settings`: tens of milliseconds, no retries); a
lease whose take timed out is given back by the store's next lease call or the learner's chores
(it may have been applied: nobody would compile that chunk until it expired), and after a fault
the store is
left alone for ``retry_s`` seconds: sightings are counted in this process meanwhile and nothing
is compiled (a compile needs the fleet's lease). Requests never wait for the store beyond one
timeout and are planned with the entries already local, which were checked when written.
Publishing, adopting and the fleet's bounds (:func:`kvnotes.serving.store.bounds.evict`: the
library cap and tenant quotas over the whole store, pins kept) run on the learner's thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core.errors import KvnotesError, StoreUnavailableError
from kvnotes.serving.learning.compiles import (
    Compiled,
    Compiler,
    VllmCompiler,
)
from kvnotes.serving.learning.fleet_leases import StoreCompileLeases
from kvnotes.serving.learning.learner import Learner, LearnSettings
from kvnotes.serving.learning.sightings import Job, LocalSightings, skill_id
from kvnotes.serving.learning.store_gate import FleetStats, StoreGate
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry
from kvnotes.serving.server_prefill import EntryAddress, PrefillClient
from kvnotes.serving.store import bounds as store_bounds
from kvnotes.serving.store.base import Store
from kvnotes.serving.store.entry import EntryInfo, StoredEntry, sha256
from kvnotes.serving.store.folder import write_entry_file

if TYPE_CHECKING:
    from kvnotes.serving.skills import ServingSkills
    from kvnotes.serving.store.mirror import LocalMirror
    from kvnotes.serving.store.redis_store import RedisSettings

log = logging.getLogger("kvnotes.serving.front")


def request_path_settings() -> RedisSettings:
    """Redis settings for the store a request's path calls (sightings, leases): a socket
    timeout of a few round trips on a LAN (set below) and no retries, so a request never waits
    for a slow server or for reconnects."""
    from kvnotes.serving.store.redis_store import RedisSettings

    # connecting (a TLS handshake with rediss://) takes a few round trips more than a command
    return RedisSettings(socket_timeout_s=0.05, connect_timeout_s=0.2, retries=0)


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How a :class:`FleetLearner` uses its store."""

    # a compile lease's time to live, renewed every third of it by its holder: a dead
    # holder's expires within this
    lease_s: float = 30.0
    sighting_ttl_s: float = 86400.0  # a chunk not seen for this long is counted from zero
    retry_s: float = 2.0  # after a store fault, the request path leaves the store alone
    evict_s: float = 30.0  # the fleet's bounds are enforced at most this often
    unpublished: int = 1024  # compiled entries whose publish failed, kept to try again


class StoreSightings:
    """A :class:`~kvnotes.serving.learning.sightings.SightingCounter` in a store: every host's
    sightings of a chunk add up. A request's sightings are one store call
    (:meth:`sight_all`); when the store does not answer (or failed moments ago) all of them are
    counted in ``fallback``, this process's counter (each one a ``local_sightings``)."""

    def __init__(self, gate: StoreGate, model: str, fallback: LocalSightings,
                 ttl_s: float) -> None:
        self.gate, self.model, self.fallback, self.ttl_s = gate, model, fallback, ttl_s

    def _name(self, ident: bytes) -> str:
        return f"{self.model}:{ident.hex()}"

    def sight(self, ident: bytes) -> int:
        return self.sight_all([ident])[0]

    def sight_all(self, idents: Sequence[bytes]) -> list[int]:
        if not idents:
            return []
        names = [self._name(ident) for ident in idents]
        ok, counts = self.gate.call("incr_sightings",
                                    lambda s: s.incr_sightings(names, self.ttl_s))
        if ok and counts is not None and len(counts) == len(idents):
            return counts
        self.gate.stats.add("local_sightings", len(idents))
        return self.fallback.sight_all(idents)

    def clear(self, ident: bytes) -> None:
        self.fallback.clear(ident)
        name = self._name(ident)
        self.gate.call("clear_sighting", lambda s: s.clear_sighting(name))


class Publisher:
    """Publishes this host's compiled entries to ``store`` and takes other hosts' from it, for
    the serving folder ``folder`` (``ROOT/<model>``) and its ``registry``. Worker thread only."""

    def __init__(self, store: Store, folder: Path, registry: LearnedRegistry,
                 stats: FleetStats, *, mirror: LocalMirror | None = None,
                 unpublished: int = 1024) -> None:
        self.store, self.folder, self.registry, self.stats = store, folder, registry, stats
        self.model = folder.name
        self.mirror = mirror
        self.max_unpublished = unpublished
        self._unpublished: OrderedDict[str, LearnedEntry] = OrderedDict()

    def publish(self, entry: LearnedEntry) -> bool:
        """Publish learned ``entry`` (its file in the folder); True when the store has it. One
        the store could not take is kept (a bounded number) and tried again by :meth:`retry`."""
        try:
            data = (self.folder / f"{entry.key}{ENTRY_SUFFIX}").read_bytes()
        except OSError:
            self._unpublished.pop(entry.key, None)
            return False  # evicted since: nothing to publish
        info = EntryInfo(entry.key, self.model, entry.tenant, entry.name, entry.tokens,
                         len(data), sha256(data), kind=entry.kind, learned=True,
                         pinned=entry.pinned, last_used=entry.last_used or time.time(),
                         created=entry.created or time.time(), skill=entry.skill,
                         variant_of=entry.variant_of, behind=entry.behind,
                         behind_tokens=entry.behind_tokens)
        try:
            self.store.put(StoredEntry(info, data))
        except StoreUnavailableError:  # counted and logged by the store
            self.stats.add("publish_failures")
            self.keep(entry)
            return False
        except KvnotesError as err:  # a file that fails its own checks is never published
            self._unpublished.pop(entry.key, None)
            self.stats.add("publish_failures")
            log.warning("kvnotes learner: entry %s not published to %s: %s", entry.key,
                        self.store.url, err)
            return False
        self._unpublished.pop(entry.key, None)
        self.stats.add("published")
        return True

    def keep(self, entry: LearnedEntry) -> None:
        """Keep ``entry`` to be published by the next :meth:`retry` (the oldest kept are
        dropped beyond the bound: the store then misses them until they are compiled again)."""
        self._unpublished.pop(entry.key, None)
        self._unpublished[entry.key] = entry
        while len(self._unpublished) > self.max_unpublished:
            self._unpublished.popitem(last=False)

    def retry(self) -> int:
        """Publish again the entries whose publish failed (while the store takes them);
        returns how many it took."""
        done = 0
        for key, entry in list(self._unpublished.items()):
            if key not in self._unpublished:
                continue
            if self.publish(entry):
                done += 1
            elif key in self._unpublished:
                break  # the store refused it: the rest wait for the next try
        return done

    @property
    def unpublished(self) -> int:
        return len(self._unpublished)

    def adopt(self, key: str, tenant: str | None) -> bool:
        """Take learned entry ``key`` of ``tenant`` from the store when another host compiled
        it: its file written here (unless the mirror already did) and its row recorded, so that
        this host's learner keeps it like its own. False when the store does not have it (or
        does not answer): the caller compiles it."""
        try:
            got = self.store.get(self.model, key, tenant)
        except StoreUnavailableError:
            return False
        if got is None or not got.info.learned or got.info.tenant != tenant:
            return False
        if not (self.folder / f"{key}{ENTRY_SUFFIX}").is_file():
            write_entry_file(self.folder, key, got.data)  # checked by the store's get
        i = got.info
        self.registry.record(LearnedEntry(
            key, tenant, i.name, i.kind, i.tokens, i.bytes, created=i.created or time.time(),
            last_used=time.time(), skill=i.skill, variant_of=i.variant_of, behind=i.behind,
            behind_tokens=i.behind_tokens))
        if self.mirror is not None:
            self.mirror.disown(key)  # the learner's bounds govern it now
        self.stats.add("adopted")
        log.info("kvnotes learner: took %s (%s) from store %s: compiled by another host",
                 key, i.name, self.store.url)
        return True

    def adopt_skill(self, skill: str, tenant: str | None) -> LearnedEntry | None:
        """Take the learned entry of chunk ``skill`` (its tokens and tenant:
        :func:`~kvnotes.serving.learning.sightings.skill_id`) that another host compiled,
        whatever prefix it was compiled behind (:meth:`adopt`); its registry row, or None when
        the store holds none (or does not answer): the caller compiles it."""
        try:
            listed = self.store.list(self.model, tenant)
        except StoreUnavailableError:
            return None
        found = [i for i in listed if i.learned and i.skill == skill and i.tenant == tenant
                 and i.variant_of is None]
        # the most recently used first (a listing is least recently used first)
        for info in reversed(found):
            if self.adopt(info.key, tenant):
                return self.registry.get(info.key)
        return None


class FleetCompiler:
    """Compiles a job with ``inner`` (the server's own prefill, :class:`VllmCompiler`, or an
    engine's :class:`Compiler`) unless another host compiled it: the store's entry is taken
    instead; the entries it compiles are published (a job's key before it is compiled: the
    inner compiler's ``key_for``)."""

    def __init__(self, inner: Compiler | VllmCompiler, registry: LearnedRegistry,
                 publisher: Publisher) -> None:
        self.inner, self.registry, self.publisher = inner, registry, publisher

    def compile(self, job: Job) -> Compiled:
        if job.chunk is not None and job.variant is None:
            # learned by another host, behind whatever prefix: taken, not compiled again (a
            # chunk is compiled once for the fleet, as once on one host; a variant behind
            # this host's prefix is learned on its own when a request would splice better)
            taken = self.publisher.adopt_skill(skill_id(job.tenant, job.chunk.token_ids),
                                               job.tenant)
            if taken is not None:
                return Compiled(taken.key, taken)
        key = self.inner.key_for(job)
        if key not in self.registry:  # compiled by another host behind this very prefix
            self.publisher.adopt(key, job.tenant)
        done = self.inner.compile(job)
        if done.entry is not None and done.new:
            self.publisher.publish(done.entry)
        return done


class FleetLearner(Learner):
    """A :class:`Learner` whose sightings, compiles and library are the fleet's (see the module
    docstring).

    Args:
        config, skills, registry: as :class:`Learner`'s.
        store: the shared store (publishing, adopting, the fleet's bounds: the worker's side).
        request_store: the same store through a client with short timeouts, for the request
            path (default: ``store``).
        mirror: this host's mirror of the store (its hits go to the store's LRU; entries the
            learner adopts leave the mirror's bound).
        settings: leases, retries, bounds' pace.
    """

    def __init__(self, config: LearnSettings, skills: ServingSkills,
                 registry: LearnedRegistry | None = None, *, store: Store,
                 request_store: Store | None = None, mirror: LocalMirror | None = None,
                 settings: FleetSettings | None = None, prefill: PrefillClient | None = None,
                 kv_dtype: str = "float32") -> None:
        s = self.fleet_settings = settings or FleetSettings()
        model = skills.folder.name
        self.fleet_stats = FleetStats()
        self.gate = StoreGate(store if request_store is None else request_store, s.retry_s,
                              self.fleet_stats)
        self.fleet_leases = StoreCompileLeases(self.gate, model, s.lease_s)
        super().__init__(config, skills, registry,
                         sightings=StoreSightings(self.gate, model,
                                                  LocalSightings(config.max_tracked),
                                                  s.sighting_ttl_s),
                         compile_leases=self.fleet_leases)
        self.store, self.mirror, self.model = store, mirror, model
        self.publisher = Publisher(store, skills.folder, self.registry, self.fleet_stats,
                                   mirror=mirror, unpublished=s.unpublished)
        # the server's own prefill compiles (no model in this process), else skills' engine
        inner: Compiler | VllmCompiler = Compiler(skills, self.registry) if prefill is None \
            else VllmCompiler(skills.folder, self.registry,
                              EntryAddress.of(skills.manifest, kv_dtype), prefill)
        self.compiler = FleetCompiler(inner, self.registry, self.publisher)
        self._evicted_at = 0.0
        self._epoch: str | None = None

    def lease(self, keys: Iterable[str], *, used: Iterable[str] | None = None,
              exact: Iterable[str] = ()) -> tuple[str, ...]:
        held = super().lease(keys, used=used, exact=exact)
        if self.mirror is not None:  # the fleet's LRU: sent by the mirror's thread
            self.mirror.used(held if used is None else used)
        return held

    def upkeep(self) -> None:
        """:meth:`Learner.upkeep`, then publish again what the store missed, and enforce the
        fleet's bounds (at most every ``evict_s``)."""
        super().upkeep()
        with self._chores:
            self.fleet_leases.settle()
            self.check_epoch()
            self.publisher.retry()
            if time.monotonic() - self._evicted_at >= self.fleet_settings.evict_s:
                self.enforce_fleet()

    def check_epoch(self) -> int:
        """When the store was emptied since the last look (restarted, flushed), queue this
        host's learned entries to be published again; returns how many were queued."""
        try:
            epoch = self.store.epoch()
        except StoreUnavailableError:
            return 0
        was, self._epoch = self._epoch, epoch
        if was is None or was == epoch:
            return 0
        entries = self.registry.entries()
        for entry in entries:
            self.publisher.keep(entry)
        log.warning("kvnotes learner: store %s was emptied (restarted or flushed): publishing "
                    "this host's %d learned entries again", self.store.url, len(entries))
        return len(entries)

    def enforce_fleet(self) -> list[str] | None:
        """The library cap and tenant quotas over the whole store (the fleet's LRU; pinned and
        registered entries kept): the keys forgotten (every host's mirror drops them), or None
        when another host is doing it, no bound is set, or the store does not answer."""
        self._evicted_at = time.monotonic()
        cap, quota = self.config.library_cap, self.config.tenant_quota
        if cap is None and quota is None:
            return None
        try:
            gone = store_bounds.evict(self.store, self.model, cap=cap, quota=quota,
                                      lease_s=self.fleet_settings.evict_s, hold=True)
        except StoreUnavailableError:
            return None  # counted and logged by the store; tried again at the next chore
        if gone:
            self.fleet_stats.add("fleet_evictions", len(gone))
            log.info("kvnotes learner: the fleet's bounds forgot %d entries in %s", len(gone),
                     self.store.url)
        return gone

    def fleet_counters(self) -> dict[str, int]:
        return self.fleet_stats.to_dict()

    def store_faults(self) -> dict[str, int]:
        """Store faults by reason, the request path's and the worker's and mirror's together."""
        out = self.store.faults.to_dict()
        if self.gate.store is not self.store:
            for reason, n in self.gate.store.faults.to_dict().items():
                out[reason] = out.get(reason, 0) + n
        return out
