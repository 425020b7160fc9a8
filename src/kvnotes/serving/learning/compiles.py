"""Compiling what was seen often enough, on one background thread.

:class:`Compiler` turns a :class:`~kvnotes.serving.learning.sightings.Job` into a published
entry: a chunk is compiled behind the prefix it was seen after (``ServingSkills.add(text,
after=ids, tenant=tenant)``), a variant behind its predecessor (its text decoded from its ids and
checked to encode back to them), and written to the serving folder atomically (the connector and
the front pick it up at their next rescan). :class:`CompileWorker` runs the jobs: a bounded
queue (a job that does not fit is refused, and queued again at a later sighting) drained by one
thread at a low priority (:func:`lower_priority`), which also runs the learner's periodic
chores between jobs.

A :class:`CompileLease` says who compiles a job: the one that takes its lease, once at a time.
:class:`LocalCompileLeases` holds them in this process; a store a fleet shares implements the
same calls, so that one host compiles a chunk that every host sees.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvnotes.serving.learning.sightings import Job, skill_id
from kvnotes.serving.library.manifest import ENTRY_SUFFIX
from kvnotes.serving.library.registry import LearnedEntry, LearnedRegistry
from kvnotes.serving.server_prefill import (
    EntryAddress,
    PrefillClient,
    save_by_server,
)

if TYPE_CHECKING:
    from kvnotes.serving.library.splice import PieceInfo
    from kvnotes.serving.skills import ServingSkills

log = logging.getLogger("kvnotes.serving.front")


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


class CompileLease(Protocol):
    """Who compiles a job: taken before it is queued, given back when it is done.

    :meth:`take` is called on a request's path (a shared implementation bounds its wait, and
    expires a lease whose holder died, so that another host compiles the job).
    """

    def take(self, ident: bytes) -> bool:
        """Hold ``ident``'s compile; False when it is held already (queued or compiling)."""
        ...

    def take_all(self, idents: Sequence[bytes]) -> list[bool]:
        """:meth:`take` for each of a request's due jobs at once (a shared implementation: one
        round trip); an ident repeated in ``idents`` is taken once, at its first place."""
        ...

    def give_back(self, ident: bytes) -> None:
        """Let ``ident`` be compiled again (done, failed, or never queued)."""
        ...


class LocalCompileLeases:
    """:class:`CompileLease` s in this process (a set under a short lock).

    Example:
        >>> leases = LocalCompileLeases()
        >>> leases.take(b"a"), leases.take(b"a"), len(leases)
        (True, False, 1)
        >>> leases.give_back(b"a"); leases.take(b"a")
        True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[bytes] = set()

    def take(self, ident: bytes) -> bool:
        with self._lock:
            if ident in self._held:
                return False
            self._held.add(ident)
            return True

    def take_all(self, idents: Sequence[bytes]) -> list[bool]:
        return [self.take(ident) for ident in idents]

    def give_back(self, ident: bytes) -> None:
        with self._lock:
            self._held.discard(ident)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


@dataclass(frozen=True, slots=True)
class Compiled:
    """What a job came to: ``key`` its entry's key ("" when it is never learned: it is the
    operator's own entry, or it can never match), ``entry`` its registry row when learned,
    ``new`` when its file was written now, ``failed`` when its text encodes to other tokens."""

    key: str
    entry: LearnedEntry | None = None
    new: bool = False
    failed: bool = False


class Compiler:
    """Compiles jobs into the serving folder ``skills`` (it holds the engine); ``registry``
    tells the operator's entries (not in it) from learned ones."""

    def __init__(self, skills: ServingSkills, registry: LearnedRegistry) -> None:
        self.skills, self.registry = skills, registry

    def compile(self, job: Job) -> Compiled:
        if job.variant is not None:
            return self._variant(job)
        return self._chunk(job)

    def key_for(self, job: Job) -> str:
        """The key of ``job``'s entry before it is compiled (the one :meth:`compile` writes)."""
        text, after = self._source(job)
        return self.skills.path_for(text, after=after, tenant=job.tenant).stem

    def _source(self, job: Job) -> tuple[str, list[int] | None]:
        """``(text, after)`` ``job`` compiles: a chunk's text behind its prefix (None: none);
        a variant's ids decoded (they must encode back to them, or the entry would never
        match), behind its predecessor's."""
        if job.variant is not None:
            return self.skills.tokenizer.decode(list(job.variant.token_ids)), list(job.variant.after)
        assert job.chunk is not None
        return job.chunk.text, list(job.chunk.after_ids) or None

    def _chunk(self, job: Job) -> Compiled:
        chunk, tenant = job.chunk, job.tenant
        assert chunk is not None
        text, after = self._source(job)
        name = f"{chunk.kind}-{job.ident.hex()[:8]}"
        done = self._publish(job, text, name, after, chunk.token_ids,
                             f"a {chunk.kind} chunk encodes alone to other tokens than in its "
                             "request; not learned")
        if not isinstance(done, tuple):
            return done
        info, size, new = done
        log.info("kvnotes learner: learned %s (%d tokens%s)", name, len(info),
                 f", tenant {tenant}" if tenant else "")
        return Compiled(info.key, LearnedEntry(
            info.key, tenant, name, chunk.kind, len(info), size,
            skill=skill_id(tenant, info.token_ids), behind_tokens=chunk.after_len), new)

    def _variant(self, job: Job) -> Compiled:
        """Compile skill ``cand`` behind ``cand.after`` (:meth:`_source`)."""
        cand, tenant = job.variant, job.tenant
        assert cand is not None
        text, after = self._source(job)
        done = self._publish(job, text, cand.name, after, cand.token_ids,
                             f"skill {cand.name} decodes to a text that encodes to other "
                             "tokens; its variant is not learned")
        if not isinstance(done, tuple):
            return done
        info, size, new = done
        log.info("kvnotes learner: learned a variant of %s behind %s (%d tokens%s)", cand.name,
                 cand.predecessor or "?", len(cand.after), f", tenant {tenant}" if tenant else "")
        return Compiled(info.key, LearnedEntry(
            info.key, tenant, cand.name, "variant", len(info), size,
            skill=skill_id(tenant, info.token_ids), variant_of=cand.name,
            behind=cand.predecessor or None, behind_tokens=len(cand.after)), new)

    def _publish(self, job: Job, text: str, name: str, after: list[int] | None,
                 token_ids: Sequence[int], mismatch: str
                 ) -> tuple[PieceInfo, int, bool] | Compiled:
        """Compile ``text`` behind ``after`` and publish it: ``(info, bytes, new)``; a
        :class:`Compiled` without an entry when it is not learned (already the operator's
        entry; or its text encodes to other tokens than ``token_ids``: ``mismatch`` logged)."""
        path = self.skills.path_for(text, after=after, tenant=job.tenant)
        existed = path.is_file()
        if existed and path.stem not in self.registry:
            # the operator registered this very entry: it is theirs, never learned or evicted
            return Compiled("")
        info = self.skills.add(text, name=name, after=after, tenant=job.tenant, capped=False)
        if info.token_ids != tuple(token_ids):
            if not existed:
                path.unlink(missing_ok=True)
            log.warning("kvnotes learner: %s", mismatch)
            return Compiled("", failed=True)
        return info, path.stat().st_size, not existed


class VllmCompiler:
    """Compiles jobs by the running server's own prefill (:class:`PrefillClient`): the chunk's
    ids behind its anchor, saved by kvnotes' connector into ``folder`` as the entry
    :class:`EntryAddress` names. Holds no model: a variant's and a chunk's ids are sent as
    they are, so no text is encoded again. The same :class:`Compiled` as :class:`Compiler`."""

    def __init__(self, folder: Path, registry: LearnedRegistry, address: EntryAddress,
                 client: PrefillClient) -> None:
        self.folder, self.registry = Path(folder), registry
        self.address, self.client = address, client

    def key_for(self, job: Job) -> str:
        """The key of ``job``'s entry before it is compiled (the one :meth:`compile` writes)."""
        ids, after, _ = job_tokens(job)
        return self.address.key(ids, after, job.tenant)

    def compile(self, job: Job) -> Compiled:
        tenant = job.tenant
        ids, after, name = job_tokens(job)
        key = self.address.key(ids, after, tenant)
        path = self.folder / f"{key}{ENTRY_SUFFIX}"
        existed = path.is_file()
        if existed and key not in self.registry:
            return Compiled("")  # the operator registered this very entry: theirs
        save_by_server(self.folder, self.client, key, self.address.lead(after), ids, name,
                       tenant)
        log.info("kvnotes learner: learned %s by vLLM's prefill (%d tokens behind %d%s)", name,
                 len(ids), len(after), f", tenant {tenant}" if tenant else "")
        return Compiled(key, learned_entry(job, key, name, len(after), path.stat().st_size),
                        not existed)


def job_tokens(job: Job) -> tuple[Sequence[int], Sequence[int], str]:
    """``(ids, after, name)`` of a job: what is compiled, the ids it is compiled behind (its
    anchor when empty) and its entry's name."""
    if job.variant is not None:
        return job.variant.token_ids, job.variant.after, job.variant.name
    assert job.chunk is not None
    chunk = job.chunk
    return chunk.token_ids, chunk.after_ids, f"{chunk.kind}-{job.ident.hex()[:8]}"


def learned_entry(job: Job, key: str, name: str, behind: int, size: int) -> LearnedEntry:
    """The registry row of ``job``'s entry ``key`` (``size`` bytes, compiled behind ``behind``
    ids)."""
    tenant = job.tenant
    if job.variant is not None:
        cand = job.variant
        return LearnedEntry(key, tenant, name, "variant", len(cand.token_ids), size,
                            skill=skill_id(tenant, cand.token_ids), variant_of=name,
                            behind=cand.predecessor or None, behind_tokens=behind)
    assert job.chunk is not None
    ids = job.chunk.token_ids
    return LearnedEntry(key, tenant, name, job.chunk.kind, len(ids), size,
                        skill=skill_id(tenant, ids), behind_tokens=behind)


class CompileWorker:
    """Runs jobs on one background thread (or the caller's: :meth:`run_pending`).

    Args:
        do: runs one job (its errors are the caller's to count; any that escape are logged).
        chores: run between jobs, every ``tick_s`` seconds at most (and at :meth:`stop`'s end
            by the caller).
        discard: a queued job that will never run (the worker stopped before it).
        queue_size: jobs waiting at most; nice: the thread's nice value.
    """

    def __init__(self, do: Callable[[Job], None], chores: Callable[[], None], *,
                 discard: Callable[[Job], None], queue_size: int, tick_s: float,
                 nice: int) -> None:
        self._do, self._chores, self._discard = do, chores, discard
        self.tick_s, self.nice = tick_s, nice
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self._lock = threading.Lock()
        self._pending = 0  # queued or running
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticked = time.monotonic()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and not queued) when the queue is full. Never blocks."""
        with self._lock:
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._done()
            return False
        return True

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._pending

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kvnotes-learner",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after the job it is on; the jobs still queued are discarded."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wakes it at once
        except queue.Full:
            pass
        thread.join(timeout)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._drop(job)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every queued job is done (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def run_pending(self) -> int:
        """Run the queued jobs in this thread (no worker needed); returns how many."""
        done = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return done
            if job is not None:
                self._one(job)
                done += 1

    def _run(self) -> None:
        lower_priority(self.nice)
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=self.tick_s)
            except queue.Empty:
                job = None
            if job is not None and not self._stop.is_set():
                self._one(job)
            elif job is not None:
                self._drop(job)
            if time.monotonic() - self._ticked >= self.tick_s and not self._stop.is_set():
                self._ticked = time.monotonic()
                try:
                    self._chores()
                except Exception:  # noqa: BLE001 -- chores are upkeep; the worker goes on
                    log.exception("kvnotes learner: upkeep failed")

    def _one(self, job: Job) -> None:
        try:
            self._do(job)
        except Exception:  # noqa: BLE001 -- a failed compile costs reuse, not serving
            log.exception("kvnotes learner: a %s was not learned", job.what)
        finally:
            self._done()

    def _drop(self, job: Job) -> None:
        try:
            self._discard(job)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
