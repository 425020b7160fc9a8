"""The ``kvnotes`` command line: a thin layer over the API.

Each capability registers its commands from its own module (imported below), so commands stay
next to nothing but the API they call.
"""

from kvnotes.cli import agent as _agent  # noqa: F401  (registers agent-bench, agent)
from kvnotes.cli import bench as _bench  # noqa: F401  (registers bench tools)
from kvnotes.cli import bench_guard as _bench_guard  # noqa: F401  (bench guard, divergence)
from kvnotes.cli import core, doctor  # noqa: F401  (register demo, compose, models; doctor)
from kvnotes.cli import edit as _edit  # noqa: F401  (registers edit-eval)
from kvnotes.cli import repro as _repro  # noqa: F401  (registers repro)
from kvnotes.cli import serve as _serve  # noqa: F401  (registers serve)
from kvnotes.cli import serve_bench as _serve_bench  # noqa: F401  (registers serve-bench erratum)
from kvnotes.cli import serve_bench_agent as _serve_bench_agent  # noqa: F401  (agent, agent-check)
from kvnotes.cli import serve_bench_fleet as _fleet  # noqa: F401  (serve-bench fleet)
from kvnotes.cli import serve_bench_skills as _serve_bench_skills  # noqa: F401  (serve-bench skills)
from kvnotes.cli import serve_bench_soak as _serve_bench_soak  # noqa: F401  (serve-bench soak)
from kvnotes.cli import skills as _skills  # noqa: F401  (registers skills)
from kvnotes.cli import skills_store as _skills_store  # noqa: F401  (skills list/pin/forget --store)
from kvnotes.cli import trace as _trace  # noqa: F401  (registers trace)
from kvnotes.cli.app import app

__all__ = ["app"]
