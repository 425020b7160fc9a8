"""The ``kvnotes-bench`` command line: each module registers its commands on
:data:`kvnotes_bench.cli.app.app`."""

from kvnotes_bench.cli import agent_bench as _agent_bench  # noqa: F401  (agent)
from kvnotes_bench.cli import bench as _bench  # noqa: F401  (tools, tools-report)
from kvnotes_bench.cli import bench_guard as _bench_guard  # noqa: F401  (guard, guard-report, divergence)
from kvnotes_bench.cli import bfcl_harness as _bfcl_harness  # noqa: F401  (bfcl-harness)
from kvnotes_bench.cli import peers as _peers  # noqa: F401  (peers)
from kvnotes_bench.cli import peers_servers as _peers_servers  # noqa: F401  (peers-servers)
from kvnotes_bench.cli import serve_bench as _serve_bench  # noqa: F401  (serve erratum)
from kvnotes_bench.cli import serve_bench_agent as _serve_bench_agent  # noqa: F401  (serve agent, spliceable)
from kvnotes_bench.cli import serve_bench_fleet as _fleet  # noqa: F401  (serve fleet, fleet-check)
from kvnotes_bench.cli import serve_bench_skills as _serve_bench_skills  # noqa: F401  (serve skills)
from kvnotes_bench.cli import serve_bench_soak as _serve_bench_soak  # noqa: F401  (serve soak)
from kvnotes_bench.cli import shape as _shape  # noqa: F401  (shape)
from kvnotes_bench.cli.app import app

__all__ = ["app"]
