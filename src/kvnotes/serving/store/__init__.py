"""Where a skill library lives: a folder on one host, or one Redis server for a fleet.

:class:`Store` is the contract; :class:`FolderStore` and
:class:`~kvnotes.serving.store.redis_store.RedisStore` implement it (the latter imported on
use: it needs the ``redis`` package, in the ``serving`` extra); :func:`store_from_url` makes one
from ``--store``; :class:`LocalMirror` keeps a host's folder supplied from a shared store.
"""

from kvnotes.core.errors import StoreUnavailableError
from kvnotes.serving.store.base import FAULT_REASONS, Store, StoreFaults, visible
from kvnotes.serving.store.entry import EntryInfo, StoredEntry, describe, verify_entry
from kvnotes.serving.store.folder import FolderStore
from kvnotes.serving.store.mirror import LocalMirror, MirrorConfig, MirrorStats
from kvnotes.serving.store.url import StoreUrl, parse_store_url, store_from_url

__all__ = [
    "FAULT_REASONS", "EntryInfo", "FolderStore", "LocalMirror", "MirrorConfig", "MirrorStats",
    "Store", "StoreFaults", "StoreUnavailableError", "StoreUrl", "StoredEntry", "describe",
    "parse_store_url", "store_from_url", "verify_entry", "visible",
]
