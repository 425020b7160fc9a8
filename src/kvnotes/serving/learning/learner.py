"""The learner: sightings, compiles and bounds composed into what the front calls.

A request's chunks (each ``tools`` entry, each text part of a message) are handed to
:meth:`Learner.observe` from the request's path, and the (predecessor, skill) pairs it would
have spliced better with a variant to :meth:`Learner.observe_variants`; both only count
(:mod:`~kvnotes.serving.learning.sightings`). At the ``LearnConfig.after``-th sighting the job
is queued for the compile worker (:mod:`~kvnotes.serving.learning.compiles`), which publishes
the entry, records it in the :class:`~kvnotes.serving.library.registry.LearnedRegistry` and
enforces the bounds (:mod:`~kvnotes.serving.learning.learned_bounds`). Until then requests are planned
without it (computed exactly).

What never happens on a request's path: a compile, a file read, write or delete, a registry
read or write; :meth:`observe`, :meth:`observe_variants`, :meth:`use`, :meth:`lease` and
:meth:`release` take short in-memory locks that no compile and no delete holds.

Bounds: victims are chosen in memory under the request path's lock and their files deleted
after it is released. Each victim's registry row is read before its file is deleted (a pin set
by ``kvnotes skills pin`` since is kept). An entry evicted between a request's planning and its
lease (or leased in the moment between its choice and its delete, or planned by a client that
sends ranges itself) fails its load in the connector, and vLLM recomputes those tokens
(``kv_load_failure_policy=recompute``): slower, never wrong.

The in-memory index follows the registry lazily, never by a scan per compile: the worker's
chores (every ``flush_s``) write the hits counted, reload the index when another process wrote
the registry (``kvnotes skills pin/forget``), and check a bounded batch of entries' files
(:data:`SWEEP_BATCH`, round robin), dropping the rows of files deleted by hand; :meth:`sweep`
checks them all. A chunk whose entry is gone is counted from scratch and learned again.

Whatever removes an entry from the index (an eviction, a reload that finds it forgotten, a
sweep that finds its file gone) tells the :meth:`Learner.on_gone` listeners at once: the
sightings' map of learned chunks and the front's per-entry hit counts then hold no key of an
entry that is gone, rather than until a bound or a scrape pushes it out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, cast

from kvnotes.serving.learning.compiles import (
    Compiled,
    CompileLease,
    Compiler,
    CompileWorker,
    LocalCompileLeases,
)
from kvnotes.serving.learning.learned_bounds import Bounds, LearnedIndex, Limits
from kvnotes.serving.learning.sightings import Job, SightingCounter, Sightings
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry, forget
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.variant_demand import VariantCandidate

if TYPE_CHECKING:
    from pathlib import Path

    from kvnotes.serving.skills import ServingSkills

log = logging.getLogger("kvnotes.serving.front")

SWEEP_BATCH = 256  # entries whose files one chore checks


class ChunkCompiler(Protocol):
    """Turns a job into an entry: :class:`~kvnotes.serving.learning.compiles.Compiler` (the
    engine, in this process) or :class:`~kvnotes.serving.learning.compiles.VllmCompiler`
    (the running server's prefill, saved by its connector)."""

    def compile(self, job: Job) -> Compiled: ...


class SkillsFolder(Protocol):
    """Where entries are published (a :class:`~kvnotes.serving.skills.ServingSkills` is one)."""

    @property
    def folder(self) -> Path: ...


class LearnSettings(Protocol):
    """What the learner reads of its config (:class:`kvnotes.serving.front.config.LearnConfig`
    has these fields)."""

    @property
    def after(self) -> int: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def library_cap(self) -> int | None: ...
    @property
    def tenant_quota(self) -> int | None: ...
    @property
    def max_tracked(self) -> int: ...
    @property
    def queue_size(self) -> int: ...
    @property
    def flush_s(self) -> float: ...
    @property
    def max_variants(self) -> int: ...
    @property
    def compile_nice(self) -> int: ...


@dataclass
class LearnerStats:
    """The learner's counters (``to_dict()`` at the JSON boundary)."""

    sightings: int = 0  # chunks observed (long enough to learn)
    compiles: int = 0  # entries compiled and published
    failures: int = 0  # compiles that failed
    dropped: int = 0  # jobs dropped: the queue was full
    evictions: int = 0  # entries evicted by the bounds
    learned_bytes: int = 0  # bytes of learned entries in the folder
    learned_entries: int = 0
    variant_sightings: int = 0  # (predecessor, skill) pairs observed that want a variant
    variant_compiles: int = 0  # variants compiled and published
    learned_variants: int = 0  # learned variants in the folder
    learned_variant_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Learner:
    """Counts chunks, compiles the ones seen often enough, keeps the learned library bounded.

    Args:
        config: the thresholds and bounds (a ``LearnConfig``).
        skills: the serving folder to publish to (a ``ServingSkills``, whose engine compiles
            unless ``compiler`` is given; with ``compiler`` any object with its ``folder``).
        registry: the folder's learned-entry registry (default: opened in ``skills.folder``).
        sightings: where sightings are counted (default: in this process).
        compile_leases: who compiles a job (default: in this process).
        compiler: what compiles a job (default: ``skills``' engine, in this process; a
            ``VllmCompiler`` asks the running server, and this process holds no model).

    :meth:`start` starts the worker thread, :meth:`stop` stops it.
    """

    def __init__(self, config: LearnSettings, skills: ServingSkills | SkillsFolder,
                 registry: LearnedRegistry | None = None, *,
                 sightings: SightingCounter | None = None,
                 compile_leases: CompileLease | None = None,
                 compiler: ChunkCompiler | None = None) -> None:
        self.config = config
        self.skills = skills
        self.registry = LearnedRegistry(skills.folder) if registry is None else registry
        self.stats = LearnerStats()
        self._lock = threading.Lock()  # the counters
        self._chores = threading.RLock()  # the worker's side: compiles, evictions, sweeps
        self._seen_version = self.registry.data_version()
        self.bounds = Bounds(LearnedIndex(self.registry.entries()))
        self.sightings = Sightings(config.after, config.min_tokens, config.max_tracked,
                                   sightings)
        self._gone: list[Callable[[Sequence[str]], None]] = [self.sightings.gone]
        self.compile_leases: CompileLease = (LocalCompileLeases() if compile_leases is None
                                              else compile_leases)
        self.compiler: ChunkCompiler = (compiler if compiler is not None
                                        else Compiler(_engine_skills(skills), self.registry))
        self.worker = CompileWorker(self._do, self.upkeep, discard=self._discard,
                                    queue_size=config.queue_size, tick_s=config.flush_s,
                                    nice=config.compile_nice)

    # ---- the request path (in memory only) --------------------------------------------------
    def observe(self, tenant: str | None, chunks: Iterable[SeenChunk]) -> None:
        """Count one request's chunks; queue the ones seen ``after`` times. Never blocks."""
        jobs = self.sightings.chunk_jobs(tenant, chunks)
        self._count("sightings", len(jobs))
        self._sighted(jobs)

    def observe_variants(self, tenant: str | None,
                         candidates: Iterable[VariantCandidate]) -> None:
        """Count one request's variant candidates; queue the ones seen ``after`` times. Never
        blocks (the same counter, queue and worker as :meth:`observe`)."""
        jobs = self.sightings.variant_jobs(tenant, candidates)
        self._count("variant_sightings", len(jobs))
        self._sighted(jobs)

    def _sighted(self, jobs: list[Job]) -> None:
        """Count one request's jobs (one call to the counter) and queue the due ones whose
        compile lease this host takes (all of them in one call: a shared store's one round
        trip); a job queued or compiling already is not taken."""
        due = [job for job, is_due in zip(jobs, self.sightings.due_all(jobs, self.bounds.holds),
                                          strict=True) if is_due]
        if not due:
            return
        for job, taken in zip(due, self.compile_leases.take_all([j.ident for j in due]),
                              strict=True):
            if taken and not self.worker.submit(job):
                self.compile_leases.give_back(job.ident)
                self._count("dropped")  # counted on: the next sighting queues it again

    def use(self, keys: Iterable[str]) -> None:
        """Count a use of each entry (its hits and last use; written by the worker)."""
        self.bounds.use(keys)

    def lease(self, keys: Iterable[str], *, used: Iterable[str] | None = None,
              exact: Iterable[str] = ()) -> tuple[str, ...]:
        """Hold ``keys`` against eviction until :meth:`release`, and count a use of each of
        ``used`` (default: of ``keys``), ``exact`` of them exactly placed."""
        return self.bounds.lease(keys, used=used, exact=exact)

    def release(self, keys: Iterable[str]) -> None:
        self.bounds.release(keys)

    def leased(self, key: str) -> bool:
        return self.bounds.leased(key)

    def on_gone(self, listener: Callable[[Sequence[str]], None]) -> None:
        """Call ``listener`` with the keys of entries as they leave the learned index
        (evicted, forgotten, their files gone), from the worker's thread."""
        self._gone.append(listener)

    def _went(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        for listener in self._gone:
            try:
                listener(keys)
            except Exception:  # noqa: BLE001 -- bookkeeping; the entry is gone whatever it says
                log.exception("kvnotes learner: a listener failed on %d entries gone", len(keys))

    def counters(self) -> dict[str, int]:
        total, count, variants, variant_bytes = self.bounds.totals()
        with self._lock:
            self.stats.learned_bytes, self.stats.learned_entries = total, count
            self.stats.learned_variants = variants
            self.stats.learned_variant_bytes = variant_bytes
            return self.stats.to_dict()

    # ---- the worker --------------------------------------------------------------------------
    def start(self) -> Learner:
        self.worker.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker (after the job it is on) and write the hits counted so far."""
        self.worker.stop(timeout)
        self._flush()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every queued job is done (True) or ``timeout`` passes (False)."""
        return self.worker.wait_idle(timeout)

    def run_pending(self) -> int:
        """Do the queued jobs in this thread (no worker needed); returns how many."""
        return self.worker.run_pending()

    def _do(self, job: Job) -> None:
        try:
            with self._chores:
                self._finish(job, self.compiler.compile(job))
        except Exception as err:  # noqa: BLE001 -- a failed compile costs reuse, not serving
            self._count("failures")
            log.warning("kvnotes learner: a %s was not learned: %s: %s", job.what,
                        type(err).__name__, err)
        finally:
            self.compile_leases.give_back(job.ident)

    def _discard(self, job: Job) -> None:
        self.compile_leases.give_back(job.ident)

    def _finish(self, job: Job, done: Compiled) -> None:
        """Record a compiled entry, count it when new, and enforce the bounds."""
        if done.failed:
            self._count("failures")
        entry = done.entry
        if entry is None:
            self.sightings.learned(job.ident, done.key)
            return
        self.registry.record(entry)
        self.bounds.put(self.registry.get(entry.key) or entry)  # its hits and pin, if kept
        if done.new:
            self._count("compiles" if job.variant is None else "variant_compiles")
        self.sightings.learned(job.ident, entry.key)
        self.cap_variants(entry.skill, keep=entry.key)
        self.enforce(job.tenant)

    # ---- bounds --------------------------------------------------------------------------------
    def _limits(self) -> Limits:
        cfg = self.config
        return Limits(cfg.library_cap, cfg.tenant_quota, cfg.max_variants)

    def enforce(self, tenant: str | None = None) -> int:
        """Evict least recently used learned entries until ``tenant`` is within its quota and
        the library within its cap (pinned and leased entries are kept); returns how many."""
        with self._chores:
            self._flush()
            limits, evicted = self._limits(), 0
            quota, cap = limits.tenant_quota, limits.library_cap
            if quota is not None:
                evicted += self._evict(lambda: self.bounds.over_quota(tenant, quota))
            if cap is not None:
                evicted += self._evict(lambda: self.bounds.over_cap(cap, quota))
            return evicted

    def cap_variants(self, skill: str, keep: str | None = None) -> int:
        """Evict the least recently used learned entries of ``skill`` beyond ``max_variants``
        (never ``keep``, pinned or leased ones); returns how many."""
        with self._chores:
            self._flush()
            most = self._limits().max_variants
            return self._evict(lambda: self.bounds.over_variants(skill, most, keep))

    def evict(self, key: str) -> bool:
        """Delete learned entry ``key`` unless a request holds it; True when evicted."""
        with self._chores:
            if not self.bounds.claim(key):
                return False
            self._delete(key)
            return True

    def _evict(self, choose: Callable[[], list[LearnedEntry]]) -> int:
        """Delete the victims ``choose`` takes out of the index (under the bounds' lock), each
        after that lock is released; again while some were kept (pinned elsewhere since, or
        leased since their choice), so that others are chosen in their place."""
        evicted = 0
        while victims := choose():
            kept = 0
            for victim in victims:
                row = self.registry.get(victim.key)
                if row is not None and row.pinned:
                    self.bounds.put(row)
                    kept += 1
                elif self.bounds.reprieve(victim):
                    kept += 1
                else:
                    self._delete(victim.key)
                    evicted += 1
            if not kept:
                break
        return evicted

    def _delete(self, key: str) -> None:
        forget(self.skills.folder, key, self.registry)
        self._went([key])
        self._count("evictions")
        log.info("kvnotes learner: evicted %s", key)

    # ---- upkeep --------------------------------------------------------------------------------
    def upkeep(self) -> None:
        """The worker's chores between jobs: write the hits counted, reload the index when
        another process wrote the registry, check a batch of entries' files."""
        with self._chores:
            self._flush()
            self.reload(only_if_changed=True)
            self.sweep(SWEEP_BATCH)

    def reload(self, *, only_if_changed: bool = False) -> bool:
        """Read the index again from the registry (``only_if_changed``: only when another
        connection wrote it since the last read); True when it was read."""
        with self._chores:
            version = self.registry.data_version()
            if only_if_changed and version == self._seen_version:
                return False
            self._flush()
            self._seen_version = version
            self._went(self.bounds.reload(self.registry.entries()))
            return True

    def sweep(self, limit: int | None = None) -> int:
        """Check the files of the next ``limit`` learned entries (None: all of them); the rows
        of those that are gone (deleted by hand) are dropped: they hold no bytes. Returns how
        many were dropped."""
        with self._chores:
            gone: list[str] = []
            for entry in self.bounds.to_verify(limit):
                if not (self.skills.folder / f"{entry.key}{ENTRY_SUFFIX}").is_file():
                    self.registry.remove(entry.key)
                    self.bounds.drop(entry.key)
                    gone.append(entry.key)
            self._went(gone)
            return len(gone)

    def _flush(self) -> None:
        when = time.time()
        hits, exact = self.bounds.take_uses(when)
        if hits or exact:
            try:
                self.registry.use(hits, when, exact=exact)
            except Exception as err:  # noqa: BLE001 -- counts are advisory; serving goes on
                log.warning("kvnotes learner: hits not recorded: %s", err)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)



def _engine_skills(skills: ServingSkills | SkillsFolder) -> ServingSkills:
    """``skills`` as the engine's compiler uses it (its ``add``, ``path_for``, ``engine``)."""
    return cast("ServingSkills", skills)
