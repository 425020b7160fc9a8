"""The fleet soak's check run again on a stored run (no server): ``kvnotes serve-bench
fleet-check OUT``.

A ``serve-bench fleet`` output folder with a soak holds its ``result.json``, the per-request
records (:data:`~kvnotes.bench.serving.agent_traffic_records.RECORDS_NAME`), the entries either
host held while it ran (``soak-entries``) and the hosts' libraries (``hosts/<name>/skills``,
whose manifest gives the fingerprint the entries are read with). The agent soak's check
(:func:`~kvnotes.bench.serving.agent_traffic_soak.recheck`) runs again over them, and the
bundle (records, ``result.json``, report, plot) is rewritten with the new verdicts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes.bench.serving.agent_traffic import utc_minute
from kvnotes.bench.serving.fleet import FleetResult
from kvnotes.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine


def recheck_fleet(folder: Path, engine: Engine | None = None, *,
                  say: Callable[[str], None] = print) -> FleetResult:
    """Every soak answer of the fleet run in ``folder`` checked again (``engine``: the run's
    model, None: loaded by its name); the bundle rewritten; returns the result."""
    from kvnotes.bench.serving.agent_traffic_check import CheckConfig
    from kvnotes.bench.serving.agent_traffic_records import RECORDS_NAME, write_records
    from kvnotes.bench.serving.agent_traffic_soak import recheck
    from kvnotes.bench.serving.fleet_report import write_outputs

    path = folder / "result.json"
    if not path.is_file() or not (folder / RECORDS_NAME).is_file():
        raise InvalidArgumentError(f"{folder}: no fleet soak here (it needs result.json and "
                                   f"{RECORDS_NAME})")
    result = FleetResult.from_dict(json.loads(path.read_text(encoding="utf-8")))
    if engine is None:
        from kvnotes.core.models import load

        engine = load(result.config.model)
    soak = result.config.soak
    check = CheckConfig(max_tokens=soak.max_tokens, eos=tuple(sorted(engine.eos_ids)),
                        tie_tau=soak.tie_tau, drift_tau=soak.drift_tau)
    rows, references = recheck(folder, engine, check, say=say, skills="hosts")
    result.soak["references"] = references
    verdicts = {r.index: r.verdict for r in rows}
    for rec in result.soak_records:
        rec.verdict = verdicts.get(rec.index, rec.verdict)
    write_records(rows, folder / RECORDS_NAME)
    result.notes.append(f"answers checked again {utc_minute()} UTC from the stored records and "
                        "kept entries (`kvnotes serve-bench fleet-check`)")
    write_outputs(result.to_dict(), folder)
    return result
