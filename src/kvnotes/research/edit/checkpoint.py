"""Resuming: the case results of an earlier ``results.json`` (a finished run or a checkpoint).

Checkpoints are written by :func:`~kvnotes.research.edit.report.write_outputs` after every
case (one atomic bundle); this module reads them back, refusing results measured differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.research.edit.results import CaseResult, SuiteResult, SuiteSettings

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine


def load_results(path: str | Path, engine: Engine, settings: SuiteSettings) -> list[CaseResult]:
    """The case results in ``path``, for :func:`~kvnotes.research.edit.suite.run_suite`'s
    ``done``. A missing file gives nothing to resume; a file that cannot be read or was written
    with other settings (model, CoT, budget, strategies) raises, so results measured
    differently are never mixed into one table."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        earlier = SuiteResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidArgumentError(
            f"cannot resume from {path}: not a readable edit-eval results.json ({err}); "
            "move it away or choose another --out") from None
    there = {"model": earlier.model, "cot": earlier.cot, "budget": earlier.budget,
             "strategies": list(earlier.strategies)}
    wanted = {"model": engine.name, "cot": settings.cot, "budget": settings.recorded_budget,
              "strategies": list(settings.strategies)}
    differ = [k for k in wanted if there[k] != wanted[k]]
    if differ:
        raise InvalidArgumentError(
            f"cannot resume from {path}: it was run with other settings ("
            + ", ".join(f"{k}: {there[k]!r} there, {wanted[k]!r} now" for k in differ)
            + "); choose another --out or the same settings")
    return list(earlier.cases)
