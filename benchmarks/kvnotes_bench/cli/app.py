"""The ``kvnotes-bench`` entry point: the measurement commands, apart from the product's CLI."""

from __future__ import annotations

from kvnotes.cli.app import command_app

app = command_app("kvnotes-bench", "kvnotes' benchmarks: tool choice on BFCL, the guard's "
                  "calibration, the serving workloads on a real vLLM server, the agent bench.")


def invocation() -> str:
    """The command line that ran this process, as a result records it (``kvnotes-bench ...``)."""
    import shlex
    import sys

    return "kvnotes-bench " + shlex.join(sys.argv[1:])
