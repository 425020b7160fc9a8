"""A ``serve-bench fleet`` host in a process group of its own, so that the soak's ``sigkill``
fault can kill its front (and learner) and its vLLM server at once, as a machine that dies.

``python -m kvnotes_bench.serving.fleet_host SPEC`` runs one host (:func:`main`): the launch
config the fleet's other hosts get (:func:`~kvnotes_bench.serving.fleet.host_config`), up until
SIGTERM; once up it writes ``ready.json`` (its URL, served name, vLLM's URL) in its folder.
:class:`HostProcess` starts it (``start_new_session``: vLLM and its engine processes share its
process group), waits for it, and kills or stops it by that group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import ServingError

if TYPE_CHECKING:
    from kvnotes.serving.launch.launcher import LaunchConfig

READY = "ready.json"
HELD = "leases-held"  # how many compile leases the host's learner holds, rewritten every 0.1 s
BASE_FIELDS = ("model", "dtype", "block_size", "kv_cache_gib", "max_model_len",
               "connector_max_gib", "extra_args", "startup_timeout", "vllm_python", "tool_parser")


class HostProcess:
    """One host run by :func:`main` in its own process group."""

    def __init__(self, name: str, base: LaunchConfig, folder: Path, sightings: int,
                 timeout: float, store_url: str) -> None:
        self.name, self.folder = name, folder
        self.spec = {"base": {f: getattr(base, f) for f in BASE_FIELDS}, "folder": str(folder),
                     "sightings": sightings, "timeout": timeout, "store_url": store_url}
        self.startup_timeout = base.startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.killed = False

    @property
    def url(self) -> str:
        return str(self.ready["url"])

    @property
    def served_name(self) -> str:
        return str(self.ready["served_name"])

    def __enter__(self) -> HostProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / READY).unlink(missing_ok=True)
        spec = self.folder / "host.json"
        spec.write_text(json.dumps(self.spec))
        t0 = time.monotonic()
        with open(self.folder / "host.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(spec)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while not (self.folder / READY).is_file():
            if self.proc.poll() is not None or time.monotonic() - t0 > self.startup_timeout:
                self.__exit__()
                raise ServingError(f"host {self.name} did not start: see "
                                   f"{self.folder / 'host.log'}")
            time.sleep(0.5)
        self.ready = json.loads((self.folder / READY).read_text())
        self.ready["startup_s"] = round(time.monotonic() - t0, 1)
        return self

    def kill(self) -> None:
        """SIGKILL the host's process group: front, learner and vLLM at once."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.killed = True
            self.proc.wait(30)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the host stops vLLM on its way out
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def busy(self) -> bool:
        """Whether the host holds a compile lease (a job of its learner queued or compiling),
        as it last said (every 0.1 s)."""
        try:
            return int((self.folder / HELD).read_text() or 0) > 0
        except (OSError, ValueError):
            return False

    def record(self) -> dict[str, Any]:
        return {**self.ready, "pid": None if self.proc is None else self.proc.pid,
                "own_process_group": True, "killed": self.killed,
                "log": str(self.folder / "host.log")}


def main(spec_path: str) -> None:
    import kvnotes
    from kvnotes.serving.launch import launcher
    from kvnotes.serving.launch.launcher import LaunchConfig
    from kvnotes_bench.serving.fleet import host_config

    spec = json.loads(Path(spec_path).read_text())
    base = LaunchConfig(**{**spec["base"], "extra_args": tuple(spec["base"]["extra_args"])})
    folder = Path(spec["folder"])
    engine = kvnotes.load(base.model)
    launch = launcher.prepare(host_config(base, folder, spec["sightings"], spec["timeout"],
                                          spec["store_url"]), engine)

    def stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    with launch:
        ready = {"url": launch.url, "served_name": launch.server.served_name,
                 "vllm_url": launch.server.url, "launch": launch.record().to_dict()}
        (folder / f"{READY}.part").write_text(json.dumps(ready))
        os.replace(folder / f"{READY}.part", folder / READY)
        assert launch.front is not None  # host_config sets the front
        leases = getattr(launch.front.service.learner, "fleet_leases", None)
        while True:
            (folder / HELD).write_text(str(0 if leases is None else leases.held))
            time.sleep(0.1)


if __name__ == "__main__":
    main(*sys.argv[1:2])
