"""The one writer of a report bundle: a JSON result, ``report.md`` and a PNG chart in one folder.

Every benchmark (edit evaluation, agent bench, serving bench) builds its own markdown and its
own chart; how they land on disk is decided here, once. Each file is written to a temporary
name and renamed into place, so a run that checkpoints after every case and is then killed
never leaves a truncated JSON behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_bundle(out: str | Path, result: Any, *, report: str, json_name: str,
                 plot_name: str, plot: Callable[[Path], object] | None = None) -> dict[str, Path]:
    """Write ``result`` as JSON, ``report`` as ``report.md`` and the chart ``plot`` draws.

    Args:
        out: the folder (created when missing).
        result: a JSON-able value; dataclasses should already be converted with ``to_dict()``.
        report: the markdown text of ``report.md``.
        json_name, plot_name: file names of the JSON result and of the PNG chart.
        plot: draws the chart into the path it is given (skipped when None).

    Returns:
        The written paths, keyed ``json``, ``report`` and ``plot``.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / json_name, "report": folder / "report.md",
             "plot": folder / plot_name}
    _write_text(paths["json"], json.dumps(result, indent=1, default=str) + "\n")
    if plot is not None:
        staged = paths["plot"].with_name(f".{plot_name}.tmp.png")  # matplotlib picks the format
        plot(staged)  # by the suffix, so the staged name keeps it
        os.replace(staged, paths["plot"])
    _write_text(paths["report"], report)
    return paths


def _write_text(path: Path, text: str) -> None:
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, path)
