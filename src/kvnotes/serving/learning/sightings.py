"""Counting sightings: which chunks a tenant's requests carry often enough to be worth compiling.

A request's chunks (:class:`~kvnotes.serving.planning.chunks.SeenChunk`) and its variant
candidates (:class:`~kvnotes.serving.planning.variant_demand.VariantCandidate`) become :class:`Job`
s, one per distinct identity per request (:func:`chunk_id`, :func:`variant_id`: the tenant and
the token ids, so tenants count apart). :class:`Sightings` counts each job through a
:class:`SightingCounter` and says when one is due: at its ``after``-th sighting, unless it is
already learned (its entry still in the learned index) or known never to match.

The counter is a small interface so that counts can be shared: :class:`LocalSightings` counts in
this process (a bounded map, least recently seen forgotten); a fleet-wide counter (one store
that every host's front counts in) implements the same calls. A request's jobs are counted
together (:meth:`Sightings.due_all`: one :meth:`SightingCounter.sight_all`), so a shared
counter is asked once per request, not once per chunk. Nothing here reads a file or the
registry: everything on a request's path is in memory.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.variant_demand import VariantCandidate


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


@dataclass(frozen=True, slots=True)
class Job:
    """A chunk to learn (``chunk``) or a variant of a skill to compile (``variant``)."""

    ident: bytes  # chunk_id or variant_id
    tenant: str | None
    chunk: SeenChunk | None
    variant: VariantCandidate | None = None

    @property
    def what(self) -> str:
        if self.variant is not None:
            return f"variant of {self.variant.name} ({len(self.variant.token_ids)} tokens)"
        assert self.chunk is not None
        return f"{self.chunk.kind} chunk of {len(self.chunk)} tokens"


class SightingCounter(Protocol):
    """Where sightings are counted (in this process, or in a store a fleet shares).

    :meth:`sight_all` (and :meth:`sight`) is called on a request's path: a shared
    implementation bounds its wait (a short timeout, then a local count or no count) rather
    than hold the request.
    """

    def sight(self, ident: bytes) -> int:
        """Count one sighting of ``ident``; return its sightings so far, this one included."""
        ...

    def sight_all(self, idents: Sequence[bytes]) -> list[int]:
        """:meth:`sight` each of ``idents`` in one call (a shared implementation: one round
        trip); their counts, in order."""
        ...

    def clear(self, ident: bytes) -> None:
        """Forget ``ident``'s sightings (it was compiled, or found never to match)."""
        ...


class LocalSightings:
    """A :class:`SightingCounter` in this process: at most ``max_tracked`` identities, the
    least recently seen forgotten beyond it; thread-safe (one short lock per call).

    Example:
        >>> counts = LocalSightings(max_tracked=2)
        >>> [counts.sight(b"a"), counts.sight(b"a"), counts.sight(b"b"), counts.sight(b"c")]
        [1, 2, 1, 1]
        >>> counts.sight(b"a")  # forgotten: the least recently seen of three
        1
    """

    def __init__(self, max_tracked: int) -> None:
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # most recently seen last

    def sight(self, ident: bytes) -> int:
        with self._lock:
            return self._sight(ident)

    def sight_all(self, idents: Sequence[bytes]) -> list[int]:
        with self._lock:
            return [self._sight(ident) for ident in idents]

    def _sight(self, ident: bytes) -> int:
        count = self._seen.pop(ident, 0) + 1
        self._seen[ident] = count
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return count

    def clear(self, ident: bytes) -> None:
        with self._lock:
            self._seen.pop(ident, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


class Sightings:
    """Which jobs are due: counted through ``counter``, due at the ``after``-th sighting.

    Args:
        after: the sighting (per identity) at which a job is due.
        min_tokens: chunks (and variants) shorter than this are never counted.
        max_tracked: identities remembered as learned or unmatchable (least recently marked
            forgotten beyond it: such a chunk is counted again, and compiled again cheaply).
        counter: where sightings are counted (default: :class:`LocalSightings`).
    """

    def __init__(self, after: int, min_tokens: int, max_tracked: int,
                 counter: SightingCounter | None = None) -> None:
        self.after, self.min_tokens, self.max_tracked = after, min_tokens, max_tracked
        self.counter: SightingCounter = LocalSightings(max_tracked) if counter is None else counter
        self._lock = threading.Lock()
        # identity -> its entry's key ("" when it is never learned: its text encodes to other
        # tokens, or it is the operator's own entry). A key counts only while the learned
        # index holds it: an entry evicted or forgotten since is counted from scratch, and
        # learned again if it keeps coming.
        self._known: OrderedDict[bytes, str] = OrderedDict()
        self._idents: dict[str, set[bytes]] = {}  # key -> the identities _known maps to it

    def chunk_jobs(self, tenant: str | None, chunks: Iterable[SeenChunk]) -> list[Job]:
        """One request's chunks long enough to learn, one job per distinct chunk."""
        jobs: dict[bytes, Job] = {}
        for chunk in chunks:
            if len(chunk.token_ids) >= self.min_tokens:
                ident = chunk_id(tenant, chunk.token_ids)
                jobs.setdefault(ident, Job(ident, tenant, chunk))
        return list(jobs.values())

    def variant_jobs(self, tenant: str | None,
                     candidates: Iterable[VariantCandidate]) -> list[Job]:
        """One request's variant candidates long enough to learn, one job per distinct one."""
        jobs: dict[bytes, Job] = {}
        for cand in candidates:
            if len(cand.token_ids) >= self.min_tokens:
                ident = variant_id(tenant, cand.after, cand.token_ids)
                jobs.setdefault(ident, Job(ident, tenant, None, cand))
        return list(jobs.values())

    def due(self, job: Job, holds: Callable[[str], bool]) -> bool:
        """Count one sighting of ``job``; True when it is due (``holds(key)``: whether the
        learned index still holds an entry). A learned or unmatchable job is not counted."""
        return self._counted(job, holds) and self.counter.sight(job.ident) >= self.after

    def due_all(self, jobs: Sequence[Job], holds: Callable[[str], bool]) -> list[bool]:
        """:meth:`due` for each of one request's ``jobs``, in order, their sightings counted
        in one call to the counter (none when none is counted)."""
        counted = [i for i, job in enumerate(jobs) if self._counted(job, holds)]
        due = [False] * len(jobs)
        if counted:
            counts = self.counter.sight_all([jobs[i].ident for i in counted])
            for i, count in zip(counted, counts, strict=True):
                due[i] = count >= self.after
        return due

    def _counted(self, job: Job, holds: Callable[[str], bool]) -> bool:
        """False when ``job`` is learned (its entry still held) or unmatchable: not counted."""
        with self._lock:
            key = self._known.get(job.ident)
        if key is not None:
            if not key or holds(key):
                return False
            with self._lock:  # gone since: counted from scratch
                if self._known.get(job.ident) == key:
                    self._unknow(job.ident)
        return True

    def learned(self, ident: bytes, key: str) -> None:
        """``ident`` was compiled to entry ``key`` ("": it is never learned)."""
        with self._lock:
            self._unknow(ident)
            self._known[ident] = key
            if key:
                self._idents.setdefault(key, set()).add(ident)
            while len(self._known) > self.max_tracked:
                self._unknow(next(iter(self._known)))
        self.counter.clear(ident)

    def gone(self, keys: Iterable[str]) -> None:
        """Entries ``keys`` were evicted or forgotten: their identities are no longer known
        (the map holds no key of an entry that is gone; one that keeps coming is counted from
        scratch)."""
        with self._lock:
            for key in keys:
                for ident in self._idents.pop(key, ()):
                    self._known.pop(ident, None)

    def _unknow(self, ident: bytes) -> None:
        """Drop ``ident`` from the map and from its key's identities (under the lock)."""
        key = self._known.pop(ident, None)
        idents = self._idents.get(key, set()) if key else set()
        idents.discard(ident)
        if key and not idents:
            self._idents.pop(key, None)

    def known(self, ident: bytes) -> str | None:
        """The entry key ``ident`` was compiled to ("": never learned; None: not known)."""
        with self._lock:
            return self._known.get(ident)
