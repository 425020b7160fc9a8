"""A fleet's compile leases in its store: short, and renewed while their holder lives.

A lease is taken when a request makes a job due and given back when the job is compiled (or
dropped), so it is held while the job waits in the learner's queue and while it compiles. It
lives ``ttl_s`` seconds in the store; a thread of the holder sets that again every ``renew_s``
seconds for every lease it holds (one script call for all of them, a compare-and-set on the
value the take set: :meth:`~kvnotes.serving.store.redis_coord.LearnerCalls.renew_leases`). A
host that dies (killed, its machine gone) stops renewing, and its leases expire within
``ttl_s``: another host then compiles those chunks. A store that cannot renew (one host's
folder) keeps each lease ``ttl_s`` from its take, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvnotes.serving.learning.store_gate import StoreGate

log = logging.getLogger("kvnotes.serving.front")


@runtime_checkable
class RenewsLeases(Protocol):
    """A store whose leases can be renewed by their holder."""

    def renew_leases(self, names: Sequence[str], ttl_s: float) -> list[bool]: ...


class StoreCompileLeases:
    """A :class:`~kvnotes.serving.learning.compiles.CompileLease` in a store: one host of the
    fleet compiles a job at a time; a lease lives ``ttl_s`` seconds and is renewed every
    ``renew_s`` (default a third of ``ttl_s``) until given back, so a host that dies holding it
    stops no one for longer than ``ttl_s``. No store, no compile: a job is compiled once for
    the fleet, or waits for the store."""

    def __init__(self, gate: StoreGate, model: str, ttl_s: float,
                 renew_s: float | None = None) -> None:
        self.gate, self.model, self.ttl_s = gate, model, ttl_s
        self.renew_s = ttl_s / 3 if renew_s is None else renew_s
        self.lost = 0  # leases found expired or taken by another host when renewed
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._renewer: threading.Thread | None = None
        self._wake = threading.Event()

    def _name(self, ident: bytes) -> str:
        return f"compile:{self.model}:{ident.hex()}"

    def take(self, ident: bytes) -> bool:
        return self.take_all([ident])[0]

    def take_all(self, idents: Sequence[bytes]) -> list[bool]:
        """Take each of ``idents``' leases in one store call (a request's due jobs: one round
        trip); an ident repeated in ``idents`` is taken once."""
        unique = list(dict.fromkeys(idents))
        names = [self._name(ident) for ident in unique]
        ok, got = self.gate.call("acquire_leases",
                                 lambda s: s.acquire_leases(names, self.ttl_s))
        if not ok or got is None or len(got) != len(unique):
            self.gate.stats.add("skipped_compiles", len(unique))
            return [False] * len(idents)
        self._hold([n for n, taken in zip(names, got, strict=True) if taken])
        taken = dict(zip(unique, got, strict=True))
        return [taken.pop(ident, False) for ident in idents]

    def give_back(self, ident: bytes) -> None:
        name = self._name(ident)
        with self._lock:
            self._held.discard(name)
        # a lease not given back (the store down meanwhile) is given back by the store's next
        # lease call, or expires on its own
        self.gate.call("release_lease", lambda s: s.release_lease(name))

    def settle(self) -> None:
        """Give back the leases whose take or give-back got no answer (a timeout)."""
        self.gate.call("settle_leases", lambda s: s.settle_leases())

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _hold(self, names: Sequence[str]) -> None:
        if not names or not isinstance(self.gate.store, RenewsLeases):
            return
        with self._lock:
            self._held.update(names)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                                 name="kvnotes-lease-renew")
                self._renewer.start()

    def renew(self) -> int:
        """Renew every lease held now (one store call); how many are still held. One that
        expired or another host holds is let go (its job still compiles here: a chunk compiled
        twice for the fleet costs a compile, not a wrong answer)."""
        with self._lock:
            names = sorted(self._held)
        store = self.gate.store
        if not names or not isinstance(store, RenewsLeases):
            return 0
        try:
            kept = store.renew_leases(names, self.ttl_s)
        except Exception as err:  # noqa: BLE001 -- the store down: the leases may expire
            log.debug("kvnotes learner: compile leases not renewed: %s", err)
            return len(names)
        gone = {n for n, k in zip(names, kept, strict=True) if not k}
        with self._lock:
            self._held -= gone
            self.lost += len(gone)
        if gone:
            log.warning("kvnotes learner: %d compile leases expired before they were renewed "
                        "(another host may compile those chunks too)", len(gone))
        return len(names) - len(gone)

    def _renew_loop(self) -> None:
        """Renew while leases are held; the thread ends when none are (the next take starts
        another)."""
        while True:
            self._wake.wait(self.renew_s)
            self.renew()
            with self._lock:
                if not self._held:
                    self._renewer = None
                    return
