"""The ``kvnotes`` command line: a thin layer over the API.

Each capability registers its commands from its own module (imported below), so commands stay
next to nothing but the API they call.
"""

from kvnotes.cli.app import app
from kvnotes.cli import core  # noqa: F401,E402  (registers demo, compose, models)

__all__ = ["app"]
