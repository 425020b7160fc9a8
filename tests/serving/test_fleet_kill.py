"""A host killed in the middle of publishing what it compiled (SIGKILL, a real process): the
store holds no part of the entry, the compile lease it held expires, and another host compiles
the chunk. A real redis-server; a tiny llama saved as a model folder, loaded by both hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _fleet_hosts as fleet
from _fleet_hosts import Host, chunk, lease_name, wait_for
from _front_fakes import HEADER

import kvnotes

redis_server = fleet.redis_server  # fixture
TOOL = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather '
        'for a city today", "parameters": {"city": "string"}}}')
LEASE_S = 3.0
HOST_A = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[5:7]
    import kvnotes
    from _fleet_hosts import Host, chunk
    from _front_fakes import HEADER
    engine = kvnotes.load(sys.argv[2])
    host = Host(__import__("pathlib").Path(sys.argv[3]), engine, sys.argv[1],
                lease_s=float(sys.argv[4]))
    host.seen(None, chunk(engine.tokenizer, sys.argv[7], after=HEADER), times=2)
""")


def test_a_host_killed_while_publishing_leaves_nothing_and_another_compiles(
        tmp_path, tiny_folder, redis_server):
    here = Path(__file__).resolve().parent
    ready = tmp_path / "ready"
    env = {**os.environ, "KVNOTES_TEST_PAUSE": "store-chunk",
           "KVNOTES_TEST_PAUSE_READY": str(ready), "PYTHONPATH": os.pathsep.join(
               [str(Path("src").resolve()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", HOST_A, redis_server.url, str(tiny_folder),
                             str(tmp_path / "a"), str(LEASE_S), str(here.parent), str(here),
                             TOOL], env=env)
    b = Host(tmp_path / "b", kvnotes.load(str(tiny_folder)), redis_server.url)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():  # A compiled, and stopped with a chunk of it staged
            assert proc.poll() is None and time.monotonic() < deadline, "host A never paused"
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        tool = chunk(b.skills.engine.tokenizer, TOOL, after=HEADER)
        assert b.store.list(b.model, every=True) == []  # nothing of A's entry is readable
        assert b.request_store.acquire_lease(lease_name(b, None, tool), 0.01) is False
        assert b.seen(None, tool, times=2) == 0  # due, but A's lease has not expired
        time.sleep(max(0.0, killed + LEASE_S + 0.2 - time.monotonic()))
        assert wait_for(lambda: b.seen(None, tool) == 1, timeout=10)  # B compiles it now
        (info,) = b.store.list(b.model, every=True)
        assert b.store.get(b.model, info.key, None) is not None  # whole, checked
        assert b.learner.counters()["compiles"] == 1
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        b.close()
