"""Learning on sight: chunks requests carry, compiled in the background once seen often enough.

A request's chunks (:class:`~kvnotes.serving.planning.chunks.SeenChunk`: each ``tools`` entry,
each text part of a message) are handed to :meth:`Learner.observe` from the request's path,
which only counts: the sightings of each (tenant, chunk token ids) in a bounded in-memory map.
At the ``LearnConfig.after``-th sighting a compile job is queued (a bounded queue: a job that
does not fit is dropped, counted, and queued again at a later sighting) for the learner's one
worker thread, which compiles the chunk behind the prefix it was seen after
(``ServingSkills.add(text, after=ids, tenant=tenant)``), publishes it to the serving folder
(atomically; the connector and the front pick it up at their next rescan), records it in the
:class:`~kvnotes.serving.library.registry.LearnedRegistry` and enforces the bounds. Until then
requests are planned without it (computed exactly).

Variants are learned the same way: after planning, the front hands the (predecessor, skill)
pairs its request would have spliced better with a variant
(:func:`~kvnotes.serving.planning.variants.variant_candidates`) to :meth:`Learner.observe_variants`;
the sightings of each (tenant, ids behind, skill ids) are counted in the same map, and at the
``after``-th the skill is compiled behind its predecessor (``ServingSkills.add(text,
after=candidate.after, tenant=tenant)``, the text decoded from its ids and checked to encode
back to them). A learned variant is a learned entry like any other (registry, leases, pins,
quota and cap); beyond ``max_variants`` learned entries of one skill, the least recently used
are evicted.

What never happens on a request's path: a compile, a file write or delete, a registry write;
:meth:`observe`, :meth:`observe_variants`, :meth:`use`, :meth:`lease` and :meth:`release` take
one short in-memory lock.

Bounds (learned entries only: the operator's registered skills are not in the registry and are
never evicted): ``max_variants`` learned entries per skill, ``tenant_quota`` bytes per
tenant, then ``library_cap`` bytes in all, each enforced by evicting the least recently used
entries (last spliced), except pinned ones and those under lease.
The front leases the entries a request was planned with for the request's duration
(:meth:`lease` after planning, :meth:`release` when it ends). An entry evicted between a
request's planning and its lease (or planned by a client that sends ranges itself) fails its
load in the connector, and vLLM recomputes those tokens (``kv_load_failure_policy=recompute``):
slower, never wrong.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.library.eviction import cap_order
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry, forget
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.variants import VariantCandidate

if TYPE_CHECKING:
    from kvnotes.serving.library.splice import PieceInfo
    from kvnotes.serving.skills import ServingSkills

log = logging.getLogger("kvnotes.serving.front")


@dataclass(frozen=True, slots=True)
class _Job:
    """A chunk to learn (``chunk``) or a variant of a skill to compile (``variant``)."""

    chunk_id: bytes
    tenant: str | None
    chunk: SeenChunk | None
    variant: VariantCandidate | None = None

    @property
    def what(self) -> str:
        if self.variant is not None:
            return f"variant of {self.variant.name} ({len(self.variant.token_ids)} tokens)"
        assert self.chunk is not None
        return f"{self.chunk.kind} chunk of {len(self.chunk)} tokens"


@dataclass
class LearnerStats:
    """The learner's counters (``to_dict()`` at the JSON boundary)."""

    sightings: int = 0  # chunks observed (long enough to learn)
    compiles: int = 0  # entries compiled and published
    failures: int = 0  # compiles that failed
    dropped: int = 0  # jobs dropped: the queue was full
    evictions: int = 0  # entries evicted by the bounds
    learned_bytes: int = 0  # bytes of learned entries in the folder (as last enforced)
    learned_entries: int = 0
    variant_sightings: int = 0  # (predecessor, skill) pairs observed that want a variant
    variant_compiles: int = 0  # variants compiled and published
    learned_variants: int = 0  # learned variants in the folder (as last enforced)
    learned_variant_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def lower_priority(nice: int) -> bool:
    """Give the calling thread (and the threads it starts, e.g. torch's CPU pool for its own
    parallel regions) the nice value ``nice``; False where the platform cannot (only Linux
    sets it per thread) or a value not above the current one is asked for."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        return False
    return True


def chunk_id(tenant: str | None, token_ids: Sequence[int]) -> bytes:
    """The identity of a chunk for counting: its tenant and its token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update((tenant or "").encode() + b"\0" + (b"t" if tenant is not None else b"s"))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def variant_id(tenant: str | None, after: Sequence[int], token_ids: Sequence[int]) -> bytes:
    """The identity of a variant for counting: its tenant, the ids behind it, its token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"variant\0" + (tenant or "").encode() + b"\0"
             + (b"t" if tenant is not None else b"s"))
    h.update(len(after).to_bytes(8, "little") + array("q", after).tobytes())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def skill_id(tenant: str | None, token_ids: Sequence[int]) -> str:
    """The registry's identity of a skill (its learned entries, all its variants, share it)."""
    return chunk_id(tenant, token_ids).hex()


class Learner:
    """Counts chunks, compiles the ones seen often enough, keeps the learned library bounded.

    Args:
        config: the thresholds and bounds.
        skills: the serving folder to publish to (it holds the engine that compiles).
        registry: the folder's learned-entry registry (default: opened in ``skills.folder``).

    :meth:`start` starts the worker thread, :meth:`stop` stops it.
    """

    def __init__(self, config: LearnConfig, skills: ServingSkills,
                 registry: LearnedRegistry | None = None) -> None:
        self.config = config
        self.skills = skills
        self.registry = LearnedRegistry(skills.folder) if registry is None else registry
        self.stats = LearnerStats()
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # chunk -> sightings, LRU order
        self._busy: set[bytes] = set()  # queued or compiling
        # chunk -> its entry's key ("" when unmatchable: those are forgotten, oldest first,
        # beyond max_tracked; the learned ones are as many as the registry's rows)
        self._known: OrderedDict[bytes, str] = OrderedDict()
        self._chunk_of: dict[str, bytes] = {}
        self._hits: Counter[str] = Counter()  # uses not yet written to the registry
        self._exact: Counter[str] = Counter()  # of those, the exactly placed ones
        self._leases: Counter[str] = Counter()
        self._queue: queue.Queue[_Job | None] = queue.Queue(config.queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flushed = time.monotonic()
        self._refresh_totals()

    # ---- the request path (in memory only) --------------------------------------------------
    def observe(self, tenant: str | None, chunks: Iterable[SeenChunk]) -> None:
        """Count one request's chunks; queue the ones seen ``after`` times. Never blocks."""
        cfg = self.config
        seen_now: set[bytes] = set()
        for chunk in chunks:
            if len(chunk.token_ids) < cfg.min_tokens:
                continue
            cid = chunk_id(tenant, chunk.token_ids)
            if cid in seen_now:
                continue  # one request, one sighting
            seen_now.add(cid)
            with self._lock:
                self.stats.sightings += 1
                self._sighted(cid, _Job(cid, tenant, chunk))

    def observe_variants(self, tenant: str | None,
                         candidates: Iterable[VariantCandidate]) -> None:
        """Count one request's variant candidates; queue the ones seen ``after`` times. Never
        blocks (the same map, queue and worker as :meth:`observe`)."""
        cfg = self.config
        seen_now: set[bytes] = set()
        for cand in candidates:
            if len(cand.token_ids) < cfg.min_tokens:
                continue
            vid = variant_id(tenant, cand.after, cand.token_ids)
            if vid in seen_now:
                continue
            seen_now.add(vid)
            with self._lock:
                self.stats.variant_sightings += 1
                self._sighted(vid, _Job(vid, tenant, None, cand))

    def _sighted(self, cid: bytes, job: _Job) -> None:
        """One sighting of ``cid`` (under the lock): counted, and queued at the ``after``-th."""
        cfg = self.config
        if cid in self._busy or (cid in self._known and self._still_learned(cid)):
            return
        count = self._seen.pop(cid, 0) + 1
        self._seen[cid] = count  # most recently seen last
        while len(self._seen) > cfg.max_tracked:
            self._seen.popitem(last=False)
        if count < cfg.after:
            return
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.stats.dropped += 1  # counted on: the next sighting queues it again
            return
        self._busy.add(cid)

    def _still_learned(self, cid: bytes) -> bool:
        """Whether known chunk ``cid`` needs no compile (under the lock): unmatchable, or its
        entry's file is there. One forgotten behind the learner's back (``kvnotes skills
        forget``, a file deleted by hand) is counted from scratch, and learned again."""
        key = self._known[cid]
        if not key or (self.skills.folder / f"{key}{ENTRY_SUFFIX}").is_file():
            return True
        del self._known[cid]
        self._chunk_of.pop(key, None)
        return False

    def use(self, keys: Iterable[str]) -> None:
        """Count a use of each entry (its hits and last use; written by the worker)."""
        with self._lock:
            self._hits.update(keys)

    def lease(self, keys: Iterable[str], *, used: Iterable[str] | None = None,
              exact: Iterable[str] = ()) -> tuple[str, ...]:
        """Hold ``keys`` against eviction until :meth:`release`, and count a use of each of
        ``used`` (default: of ``keys``), ``exact`` of them exactly placed."""
        held = tuple(dict.fromkeys(keys))
        with self._lock:
            self._leases.update(held)
            self._hits.update(held if used is None else used)
            self._exact.update(exact)
        return held

    def release(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._leases.subtract(keys)
            self._leases = +self._leases  # drop the zeros

    def leased(self, key: str) -> bool:
        with self._lock:
            return self._leases[key] > 0

    # ---- the worker --------------------------------------------------------------------------
    def start(self) -> Learner:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvnotes-learner",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker (after the job it is on) and write the hits counted so far."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wakes it at once
        except queue.Full:
            pass
        thread.join(timeout)
        self._flush()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every queued job is done (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._busy:
                    return True
            time.sleep(0.01)
        return False

    def run_pending(self) -> int:
        """Do the queued jobs in this thread (no worker needed); returns how many."""
        done = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return done
            if job is not None:
                self._do(job)
                done += 1

    def _run(self) -> None:
        lower_priority(self.config.compile_nice)
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=self.config.flush_s)
            except queue.Empty:
                job = None
            if job is not None and not self._stop.is_set():
                self._do(job)
            elif job is not None:
                with self._lock:
                    self._busy.discard(job.chunk_id)
            if time.monotonic() - self._flushed >= self.config.flush_s:
                self._flush()

    def _do(self, job: _Job) -> None:
        try:
            if job.variant is not None:
                self._compile_variant(job, job.variant)
            else:
                self._compile(job)
        except Exception as err:  # noqa: BLE001 -- a failed compile costs reuse, not serving
            self._count("failures")
            log.warning("kvnotes learner: a %s was not learned: %s: %s", job.what,
                        type(err).__name__, err)
        finally:
            with self._lock:
                self._busy.discard(job.chunk_id)

    def _compile(self, job: _Job) -> None:
        chunk, tenant = job.chunk, job.tenant
        assert chunk is not None
        after = list(chunk.after_ids) or None
        name = f"{chunk.kind}-{job.chunk_id.hex()[:8]}"
        published = self._publish(job, chunk.text, name, after, chunk.token_ids,
                                  f"a {chunk.kind} chunk encodes alone to other tokens than in "
                                  "its request; not learned")
        if published is None:
            return
        info, size, existed = published
        self._finish(job, info, existed, "compiles", LearnedEntry(
            info.key, tenant, name, chunk.kind, len(info), size,
            skill=skill_id(tenant, info.token_ids), behind_tokens=chunk.after_len))
        log.info("kvnotes learner: learned %s (%d tokens%s)", name, len(info),
                 f", tenant {tenant}" if tenant else "")

    def _compile_variant(self, job: _Job, cand: VariantCandidate) -> None:
        """Compile skill ``cand`` behind ``cand.after`` (its text: its ids decoded, which must
        encode back to them, or the entry would never match)."""
        tenant, after = job.tenant, list(cand.after)
        text = self.skills.engine.tokenizer.decode(list(cand.token_ids))
        published = self._publish(job, text, cand.name, after, cand.token_ids,
                                  f"skill {cand.name} decodes to a text that encodes to other "
                                  "tokens; its variant is not learned")
        if published is None:
            return
        info, size, existed = published
        self._finish(job, info, existed, "variant_compiles", LearnedEntry(
            info.key, tenant, cand.name, "variant", len(info), size,
            skill=skill_id(tenant, info.token_ids), variant_of=cand.name,
            behind=cand.predecessor or None, behind_tokens=len(after)))
        log.info("kvnotes learner: learned a variant of %s behind %s (%d tokens%s)", cand.name,
                 cand.predecessor or "?", len(after), f", tenant {tenant}" if tenant else "")

    def _publish(self, job: _Job, text: str, name: str, after: list[int] | None,
                 token_ids: Sequence[int], mismatch: str) -> tuple[PieceInfo, int, bool] | None:
        """Compile ``text`` behind ``after`` and publish it: ``(info, bytes, existed)``; None
        when it was not learned (already the operator's entry: recorded as such; or its text
        encodes to other tokens than ``token_ids``: counted as a failure, never matched, and
        ``mismatch`` logged)."""
        tenant = job.tenant
        path = self.skills.path_for(text, after=after, tenant=tenant)
        if path.is_file() and path.stem not in self.registry:
            # the operator registered this very entry: it is theirs, never learned or evicted
            self._learned(job, path.stem)
            return None
        existed = path.is_file()
        info = self.skills.add(text, name=name, after=after, tenant=tenant, capped=False)
        if info.token_ids != tuple(token_ids):
            if not existed:
                path.unlink(missing_ok=True)
            self._count("failures")
            self._learned(job, "")
            log.warning("kvnotes learner: %s", mismatch)
            return None
        return info, path.stat().st_size, existed

    def _finish(self, job: _Job, info: PieceInfo, existed: bool, counter: str,
                entry: LearnedEntry) -> None:
        """Record a published entry, count it when new, and enforce the bounds."""
        self.registry.record(entry)
        if not existed:
            self._count(counter)
        self._learned(job, info.key)
        self.cap_variants(entry.skill, keep=info.key)
        self.enforce(job.tenant)

    def cap_variants(self, skill: str, keep: str | None = None) -> int:
        """Evict the least recently used learned entries of ``skill`` beyond ``max_variants``
        (never ``keep``, pinned or leased ones); returns how many."""
        self._flush()
        entries = self.registry.of_skill(skill)
        over = len(entries) - self.config.max_variants
        evicted = 0
        for entry in entries:
            if over <= 0:
                break
            if entry.key == keep or entry.pinned:
                continue
            if self.evict(entry.key):
                over -= 1
                evicted += 1
        return evicted

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _learned(self, job: _Job, key: str) -> None:
        with self._lock:
            self._known[job.chunk_id] = key
            if not key and len(self._known) > self.config.max_tracked:
                stale = next((c for c, k in self._known.items() if not k), None)
                if stale is not None:
                    self._known.pop(stale)
            self._seen.pop(job.chunk_id, None)
            if key:
                self._chunk_of[key] = job.chunk_id

    # ---- bounds --------------------------------------------------------------------------------
    def enforce(self, tenant: str | None = None) -> int:
        """Evict least recently used learned entries until ``tenant`` is within its quota and
        the library within its cap (pinned and leased entries are kept); returns how many."""
        self._flush()
        self._prune()
        cfg = self.config
        evicted = 0
        if cfg.tenant_quota is not None:
            evicted += self._shrink(self.registry.evictable(tenant, every=False),
                                    self.registry.total_bytes(tenant, every=False),
                                    cfg.tenant_quota)
        if cfg.library_cap is not None:  # tenants over their share first (quotas hold)
            candidates = self.registry.evictable()
            held = {t: self.registry.total_bytes(t, every=False)
                    for t in {e.tenant for e in candidates}}
            evicted += self._shrink(cap_order(candidates, cfg.library_cap, cfg.tenant_quota,
                                              held), self.registry.total_bytes(),
                                    cfg.library_cap)
        self._refresh_totals()
        return evicted

    def _shrink(self, candidates: Sequence[LearnedEntry], total: int, bound: int) -> int:
        evicted = 0
        for entry in candidates:
            if total <= bound:
                break
            if self.evict(entry.key):
                total -= entry.bytes
                evicted += 1
        return evicted

    def evict(self, key: str) -> bool:
        """Delete learned entry ``key`` unless a request holds it; True when evicted."""
        with self._lock:
            if self._leases[key] > 0:
                return False
            # unlinked under the lock: a lease taken from now on is on a missing file, whose
            # load fails and is recomputed (a lease never sees a half-deleted entry)
            (self.skills.folder / f"{key}.safetensors").unlink(missing_ok=True)
            cid = self._chunk_of.pop(key, None)
            if cid is not None:
                self._known.pop(cid, None)  # learned again if it keeps coming
            self.stats.evictions += 1
        forget(self.skills.folder, key, self.registry)
        log.info("kvnotes learner: evicted %s", key)
        return True

    def _prune(self) -> None:
        """Drop the rows of entries whose files are gone (deleted by hand, or forgotten by a
        process that could not reach the registry): they hold no bytes."""
        for entry in self.registry.entries():
            if not (self.skills.folder / f"{entry.key}.safetensors").is_file():
                self.registry.remove(entry.key)
                with self._lock:
                    cid = self._chunk_of.pop(entry.key, None)
                    if cid is not None:
                        self._known.pop(cid, None)

    def _flush(self) -> None:
        with self._lock:
            hits, self._hits = self._hits, Counter()
            exact, self._exact = self._exact, Counter()
            self._flushed = time.monotonic()
        if hits or exact:
            try:
                self.registry.use(hits, exact=exact)
            except Exception as err:  # noqa: BLE001 -- counts are advisory; serving goes on
                log.warning("kvnotes learner: hits not recorded: %s", err)

    def _refresh_totals(self) -> None:
        total, count = self.registry.total_bytes(), len(self.registry)
        variants, variant_bytes = self.registry.variant_totals()
        with self._lock:
            self.stats.learned_bytes, self.stats.learned_entries = total, count
            self.stats.learned_variants = variants
            self.stats.learned_variant_bytes = variant_bytes

    def counters(self) -> dict[str, int]:
        with self._lock:
            return self.stats.to_dict()

