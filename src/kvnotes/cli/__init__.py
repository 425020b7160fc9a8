"""The ``kvnotes`` command line: a thin layer over the API.

Each capability registers its commands from its own module (imported below), so commands stay
next to nothing but the API they call. The measurement commands are the benchmark package's own
entry point, ``kvnotes-bench``.
"""

from kvnotes.cli import agent as _agent  # noqa: F401  (registers agent)
from kvnotes.cli import core, doctor  # noqa: F401  (register demo, compose, models; doctor)
from kvnotes.cli import edit as _edit  # noqa: F401  (registers edit)
from kvnotes.cli import repro as _repro  # noqa: F401  (registers repro)
from kvnotes.cli import serve as _serve  # noqa: F401  (registers serve)
from kvnotes.cli import skills as _skills  # noqa: F401  (registers skills)
from kvnotes.cli import skills_store as _skills_store  # noqa: F401  (skills list/pin/forget --store)
from kvnotes.cli import trace as _trace  # noqa: F401  (registers trace)
from kvnotes.cli.app import app

__all__ = ["app"]
