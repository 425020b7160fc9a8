"""The fleet soak's check run again on a stored run (no server): ``kvnotes-bench serve
fleet-check OUT``.

A ``serve-bench fleet`` output folder with a soak holds its ``result.json``, the per-request
records (:data:`~kvnotes_bench.serving.agent_traffic_records.RECORDS_NAME`), the entries either
host held while it ran (``soak-entries``) and the hosts' libraries (``hosts/<name>/skills``,
whose manifest gives the fingerprint the entries are read with). The agent soak's check
(:func:`~kvnotes_bench.serving.agent_traffic_soak.recheck`) runs again over them, and the
bundle (records, ``result.json``, report, plot) is rewritten with the new verdicts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvnotes_bench.serving.agent_traffic import utc_minute
from kvnotes_bench.serving.fleet import FleetResult

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine


def recheck_fleet(folder: Path, engine: Engine | None = None, *,
                  say: Callable[[str], None] = print) -> FleetResult:
    """Every soak answer of the fleet run in ``folder`` checked again (``engine``: the run's
    model, None: loaded by its name); the bundle rewritten; returns the result."""
    from kvnotes_bench.serving.agent_traffic_recheck import (
        check_config,
        load_engine,
        read_bundle,
        store_verdicts,
    )
    from kvnotes_bench.serving.agent_traffic_soak import recheck
    from kvnotes_bench.serving.fleet_report import write_outputs

    result = FleetResult.from_dict(read_bundle(folder, "fleet soak"))
    engine = engine if engine is not None else load_engine(result.config.model)
    check = check_config(result.config.soak, engine)
    rows, references = recheck(folder, engine, check, say=say, skills="hosts")
    store_verdicts(folder, result.soak, result.soak_records, rows, references)
    result.notes.append(f"answers checked again {utc_minute()} UTC from the stored records and "
                        "kept entries (`kvnotes-bench serve fleet-check`)")
    write_outputs(result.to_dict(), folder)
    return result
