"""Hosts of a fleet in one test process: each its own serving folder, learner, mirror and two
clients of one real ``redis-server`` (the store tests' :class:`RedisServer`, started on a
loopback port and stopped by its process id). The engine is a tiny random llama shared by every
host, so every host has the same model fingerprint, as hosts serving one model do."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import make_tiny_engine

from kvnotes.core.document import encode
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning.fleet import FleetLearner, FleetSettings, request_path_settings
from kvnotes.serving.learning.sightings import chunk_id
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.store.metrics import StoreCollector
from kvnotes.serving.store.mirror import LocalMirror, MirrorConfig
from kvnotes.serving.store.redis_store import RedisStore


def store_helpers() -> ModuleType:
    """tests/store/_store_helpers (its RedisServer), loaded once whichever folder runs first."""
    name = "_store_helpers"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "store" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class Host:
    """One kvnotes host of the fleet (no vLLM: the tests give its front a fake one)."""

    def __init__(self, root: Path, engine: Any, url: str, *, after: int = 2,
                 lease_s: float = 600.0, retry_s: float = 0.2, **learn: Any) -> None:
        self.skills = ServingSkills(root, engine)
        self.store = RedisStore.connect(url)
        self.request_store = RedisStore.connect(url, settings=request_path_settings())
        self.catalog = SkillCatalog(self.skills.folder, engine.tokenizer, rescan_s=60.0)
        self.mirror = LocalMirror(self.store, self.skills.folder,
                                  MirrorConfig(max_bytes=1 << 30, poll_s=0.05, retry_s=0.1),
                                  on_change=lambda: self.catalog.refresh(force=True))
        self.learner = FleetLearner(
            LearnConfig(after=after, min_tokens=4, **learn), self.skills, store=self.store,
            request_store=self.request_store, mirror=self.mirror,
            settings=FleetSettings(lease_s=lease_s, retry_s=retry_s))

    @property
    def model(self) -> str:
        return self.skills.folder.name

    def collector(self) -> StoreCollector:
        return StoreCollector(self.learner.store_faults, self.learner.fleet_counters,
                              self.mirror.stats.to_dict)

    def seen(self, tenant: str | None, *chunks: SeenChunk, times: int = 1) -> int:
        """Observe the chunks ``times`` times, then run the jobs that came due here."""
        for _ in range(times):
            self.learner.observe(tenant, chunks)
        return self.learner.run_pending()

    def has(self, key: str) -> bool:
        return (self.skills.folder / f"{key}.safetensors").is_file()

    def close(self) -> None:
        self.mirror.stop()
        self.learner.stop()
        self.store.close()
        self.request_store.close()


def chunk(tokenizer: Any, text: str, after: str, kind: str = "tool") -> SeenChunk:
    return SeenChunk(kind, text, tuple(encode(tokenizer, text)), tuple(encode(tokenizer, after)))


def lease_name(host: Host, tenant: str | None, seen: SeenChunk) -> str:
    """The store's name of ``seen``'s compile lease (as :class:`StoreCompileLeases` takes it)."""
    return f"compile:{host.model}:{chunk_id(tenant, seen.token_ids).hex()}"


def wait_for(what: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- fixtures (a test module binds them: ``engine, redis_server, hosts = fleet.engine, ...``)
@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Any:
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    """A redis-server of this test's own (it may be killed, restarted, flushed)."""
    helpers = store_helpers()
    if helpers.REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (`make redis` installs Debian's package)")
    server = helpers.RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def hosts(tmp_path: Path, engine: Any, redis_server: Any) -> Any:
    """``hosts(name, **Host options) -> Host``, closed at the test's end."""
    made: list[Host] = []

    def make(name: str, **kw: Any) -> Host:
        made.append(Host(tmp_path / name, engine, redis_server.url, **kw))
        return made[-1]

    yield make
    for host in made:
        host.close()
