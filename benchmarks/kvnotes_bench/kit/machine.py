"""The machine a run measured and its load around the run, for a result's JSON.

(The per-timing record with torch threads and CPU use is :func:`kvnotes.core.machine.machine_info`;
this one is the run-level record the serving workloads keep, the server being on the same
machine.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvnotes.core.machine import cpu_flags, cpu_model, load_average


def load_now() -> list[float]:
    """1/5/15-minute load average, rounded for the JSON."""
    return [round(x, 2) for x in load_average()]


@dataclass
class MachineRecord:
    """The machine a run measured (the server runs on it too) and its load at start and end."""

    cpus: int | None
    cpu_model: str
    cpu_flags: list[str]
    load_average: list[float]
    load_average_end: list[float] | None = None

    @classmethod
    def now(cls) -> MachineRecord:
        return cls(cpus=os.cpu_count(), cpu_model=cpu_model(), cpu_flags=cpu_flags(),
                   load_average=load_now())

    def finish(self) -> None:
        """Record the load at the end of the run."""
        self.load_average_end = load_now()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MachineRecord:
        """Read back :meth:`to_dict` (a field a record lacks reads as unknown)."""
        return cls(cpus=d.get("cpus"), cpu_model=d.get("cpu_model", ""),
                   cpu_flags=list(d.get("cpu_flags", [])),
                   load_average=list(d.get("load_average", [])),
                   load_average_end=d.get("load_average_end"))


