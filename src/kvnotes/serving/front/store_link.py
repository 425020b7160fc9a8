"""A front's link to a fleet's shared store (``kvnotes serve --store redis://...``).

:class:`StoreLink` holds what one host needs of the store: two clients of it (the request
path's, with short timeouts and no retries, and the background's), the
:class:`~kvnotes.serving.store.mirror.LocalMirror` that keeps the host's serving folder supplied
(the connector and the front's catalog read that folder; the catalog rescans as soon as the
mirror writes or deletes an entry, so the next request plans with it), and, when the host
learns, its :class:`~kvnotes.serving.learning.fleet.FleetLearner`. Its series in ``/metrics``
(:class:`~kvnotes.serving.store.metrics.StoreCollector`): the store's faults by reason, the
fleet learner's counters, the mirror's.

A store that is down when the host starts is not an error: the host serves from its folder and
picks the store up when it answers (a malformed URL or an unreadable password file is).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.config import DEFAULT_MIRROR_BYTES, FrontConfig
from kvnotes.serving.json_types import JsonObject
from kvnotes.serving.learning.fleet import FleetLearner, request_path_settings
from kvnotes.serving.server_prefill import PrefillClient, VllmPrefill
from kvnotes.serving.store.base import Store
from kvnotes.serving.store.mirror import LocalMirror, MirrorConfig
from kvnotes.serving.store.url import parse_store_url, store_from_url

if TYPE_CHECKING:
    from kvnotes.serving.learning.fleet import FleetSettings
    from kvnotes.serving.learning.learner import Learner, LearnSettings
    from kvnotes.serving.skills import ServingSkills

log = logging.getLogger("kvnotes.serving.front")


@dataclass
class StoreLink:
    """One host's use of a shared store (see the module docstring); :meth:`open` makes one."""

    store: Store  # the background's client: mirror, publishing, the fleet's bounds
    request_store: Store  # the request path's: sightings and compile leases
    mirror: LocalMirror
    learner: FleetLearner | None = None
    catalog: Any = field(default=None, repr=False)  # rescanned when the mirror changes files

    @classmethod
    def open(cls, url: str, password_file: str | os.PathLike[str] | None, folder: Path, *,
             mirror_bytes: int = DEFAULT_MIRROR_BYTES, poll_s: float = 2.0) -> StoreLink:
        """Clients of the Redis store ``url`` (nothing sent yet) and a mirror (not started) of
        it into ``folder`` (``ROOT/<model fingerprint id>``, the serving folder).

        Raises:
            InvalidArgumentError: a malformed URL, a folder instead of a Redis URL, or a bad
                password file.
        """
        if not parse_store_url(url).is_redis:
            raise InvalidArgumentError("kvnotes serve --store takes a redis:// or rediss:// URL "
                                       "(the host's own folder is --skills)")
        store = store_from_url(url, password_file)
        request_store = store_from_url(url, password_file, settings=request_path_settings())
        link = cls(store, request_store, LocalMirror(
            store, folder, MirrorConfig(max_bytes=mirror_bytes, poll_s=poll_s)))
        link.mirror.on_change = link._rescan
        return link

    @classmethod
    def of_learner(cls, learner: FleetLearner) -> StoreLink:
        """The link a fleet learner was made over (:func:`fleet_learner`)."""
        if learner.mirror is None:
            raise InvalidArgumentError("a FleetLearner serving a front needs its host's mirror")
        link = cls(learner.store, learner.gate.store, learner.mirror, learner)
        learner.mirror.on_change = link._rescan
        return link

    def fleet_learner(self, config: LearnSettings, skills: ServingSkills, *,
                      settings: FleetSettings | None = None,
                      prefill: PrefillClient | None = None,
                      kv_dtype: str = "float32") -> FleetLearner:
        """This host's learner over the store (kept as :attr:`learner`); ``prefill``: the
        server that compiles (its entries in ``kv_dtype``'s numerics), else skills' engine."""
        self.learner = FleetLearner(config, skills, store=self.store,
                                    request_store=self.request_store, mirror=self.mirror,
                                    settings=settings, prefill=prefill, kv_dtype=kv_dtype)
        return self.learner

    def collector(self) -> Any:
        """The store's ``/metrics`` series (a Prometheus collector)."""
        from kvnotes.serving.store.metrics import StoreCollector

        return StoreCollector(self.faults, None if self.learner is None
                              else self.learner.fleet_counters, self.mirror.stats.to_dict)

    def watch(self, registry: Any) -> None:
        """Register the store's series on a Prometheus ``registry``."""
        registry.register(self.collector())

    def stats(self) -> JsonObject:
        """The store's counters for ``/kvnotes/stats``: where it is (no password), its faults,
        the mirror's and the fleet learner's counters."""
        out: JsonObject = {"url": self.store.url, "faults": dict(self.faults()),
                           "mirror": self.mirror.stats.to_dict()}
        if self.learner is not None:
            out["fleet"] = dict(self.learner.fleet_counters())
        return out

    def faults(self) -> dict[str, int]:
        """The store's faults by reason, every client's together."""
        if self.learner is not None:
            return self.learner.store_faults()
        out = self.store.faults.to_dict()
        for reason, n in self.request_store.faults.to_dict().items():
            out[reason] = out.get(reason, 0) + n
        return out

    def start(self) -> None:
        self.mirror.start()
        log.info("kvnotes: shared store %s: mirroring into %s", self.store.url,
                 self.mirror.folder)

    def stop(self) -> None:
        self.mirror.stop()
        self.store.close()
        self.request_store.close()

    def _rescan(self) -> None:
        if self.catalog is not None:
            self.catalog.refresh(force=True)


def fleet_learner(config: FrontConfig, skills: ServingSkills,
                  kv_dtype: str = "float32") -> FleetLearner:
    """The learner of a front whose ``config`` has both ``learn`` and ``store``: learning over
    the shared store, with its clients and this host's mirror into ``skills.folder`` (the
    front's :class:`~kvnotes.serving.front.service.FrontService` starts and stops them).
    With ``config.upstream`` set, the server there compiles (``kv_dtype``: its dtype)."""
    if config.learn is None or config.store is None:
        raise InvalidArgumentError("fleet_learner: FrontConfig.learn and FrontConfig.store "
                                   "are both needed")
    link = StoreLink.open(config.store, config.store_password_file, skills.folder,
                          mirror_bytes=config.mirror_bytes)
    prefill = None
    if config.upstream is not None and config.model is not None:
        prefill = VllmPrefill(config.upstream, config.model, api_key=config.upstream_api_key)
    return link.fleet_learner(config.learn, skills, prefill=prefill, kv_dtype=kv_dtype)


def link_for(config: FrontConfig, catalog: Any, learner: Learner | None) -> StoreLink | None:
    """A front's store link: a fleet learner's own, or (``config.store`` set, a learner that
    is this host's alone or none) a mirror of the store into the catalog's folder; None
    without a store. The catalog rescans whenever the mirror changes its folder."""
    if isinstance(learner, FleetLearner):
        link = StoreLink.of_learner(learner)
    elif config.store is None:
        return None
    else:
        if learner is not None:
            log.warning("kvnotes: FrontConfig.store with a learner of this host's own: entries "
                        "are mirrored, but learning stays this host's (use fleet_learner)")
        link = StoreLink.open(config.store, config.store_password_file, Path(catalog.folder),
                              mirror_bytes=config.mirror_bytes)
    link.catalog = catalog
    return link
