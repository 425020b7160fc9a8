"""The agent soak's check run again on a stored run (no server): ``kvnotes-bench serve
agent-check OUT``.

A soak run's output folder holds its ``result.json``, the per-request records
(:data:`~kvnotes_bench.serving.agent_traffic_records.RECORDS_NAME`) and the entries the library
published while it ran (``soak-entries``, read with the fingerprint of ``soak-skills``). The
check (:mod:`~kvnotes_bench.serving.agent_traffic_check`) is run again over them, as the
records say the server answered, and the bundle (records, ``result.json``, report, plot) is
rewritten with the new verdicts: a change to the check is applied to a measured run without
serving it again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.serving.agent_traffic import AgentResult, utc_minute

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.serving.json_types import JsonObject
    from kvnotes_bench.serving.agent_traffic_check import CheckConfig
    from kvnotes_bench.serving.agent_traffic_records import SoakRequestRecord
    from kvnotes_bench.serving.agent_traffic_soak import AgentSoakConfig, SoakRecord


def read_bundle(folder: Path, what: str) -> JsonObject:
    """The ``result.json`` of a stored run in ``folder``; :class:`InvalidArgumentError` naming
    ``what`` it should hold when it or the per-request records are missing."""
    from kvnotes_bench.serving.agent_traffic_records import RECORDS_NAME

    path = folder / "result.json"
    if not path.is_file() or not (folder / RECORDS_NAME).is_file():
        raise InvalidArgumentError(f"{folder}: no {what} here (it needs result.json and "
                                   f"{RECORDS_NAME})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise InvalidArgumentError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{path}: not a JSON object")
    return data


def load_engine(model: str) -> Engine:
    """The engine of a stored run's model (by its alias or folder)."""
    from kvnotes.core.models import load

    return load(model)


def check_config(soak: AgentSoakConfig, engine: Engine) -> CheckConfig:
    """How a soak's answers are checked: its greedy length and thresholds, ``engine``'s EOS."""
    from kvnotes_bench.serving.agent_traffic_check import CheckConfig

    return CheckConfig(max_tokens=soak.max_tokens, eos=tuple(sorted(engine.eos_ids)),
                       tie_tau=soak.tie_tau, drift_tau=soak.drift_tau)


def store_verdicts(folder: Path, soak: dict[str, Any], records: Sequence[SoakRecord],
                   rows: Sequence[SoakRequestRecord], references: int) -> None:
    """A recheck's outcome kept in a run's bundle: each record's new verdict (by index), the
    references it computed in ``soak``, and the checked rows written to ``folder``'s records."""
    from kvnotes_bench.serving.agent_traffic_records import RECORDS_NAME, write_records

    soak["references"] = references
    verdicts = {r.index: r.verdict for r in rows}
    for rec in records:
        rec.verdict = verdicts.get(rec.index, rec.verdict)
    write_records(rows, folder / RECORDS_NAME)


def recheck_bundle(folder: Path, engine: Engine | None = None, *,
                   drift_tau: float | None = None,
                   say: Callable[[str], None] = print) -> AgentResult:
    """Every answer of the soak run in ``folder`` checked again (``engine``: the run's model,
    None: loaded by its name; ``drift_tau``: the drift rule's threshold, None: the run's own);
    the bundle rewritten; returns the result."""
    from kvnotes_bench.serving.agent_traffic_report import write_outputs
    from kvnotes_bench.serving.agent_traffic_soak import recheck

    result = AgentResult.from_dict(read_bundle(folder, "soak run"))
    engine = engine if engine is not None else load_engine(result.config.model)
    soak = result.config.soak
    if drift_tau is not None:
        soak = dataclasses.replace(soak, drift_tau=drift_tau)
        result.config = dataclasses.replace(result.config, soak=soak)
    check = check_config(soak, engine)
    rows, references = recheck(folder, engine, check, say=say)
    store_verdicts(folder, result.soak, result.soak_records, rows, references)
    result.notes.append(f"answers checked again {utc_minute()} UTC from the stored records and "
                        "kept entries (`kvnotes-bench serve agent-check`)"
                        + ("" if drift_tau is None else f", drift rule at {drift_tau:g}"))
    write_outputs(result.to_dict(), folder)
    return result
