"""The machine a timing ran on: torch threads (default: physical cores), load, CPU flags, and
how much CPU time other work took while it ran.

Timings on a shared CPU mean little without the load beside them: every command that times
things sets its threads with :func:`set_threads` and records :func:`machine_info` before and
after (``machine_info(since=before)``). The load average alone cannot tell a run's own threads
from other work (a 2-thread run on 2 CPUs ends at a load of about 2 however quiet the machine
was), so the "after" record also counts CPU seconds over the run: the machine's busy time from
``/proc/stat`` minus this process's own, and the hypervisor's steal time.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NotRequired  # pydantic reads it from Python 3.11

import torch
from typing_extensions import TypedDict

from kvnotes.core.records import adapter

SIMD_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma",
              "neon", "asimd")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def available_cpus() -> int:
    """Logical CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores (hyper-threads counted once), at most :func:`available_cpus`."""
    cores: set[tuple[str, str]] = set()
    physical = core = ""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            physical = value
        elif key == "core id":
            core = value
        elif not key and core:
            cores.add((physical, core))
            physical = core = ""
    if core:
        cores.add((physical, core))
    return max(1, min(len(cores) or available_cpus(), available_cpus()))


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (``None``: physical cores; more only adds contention)."""
    n = threads or physical_cores()
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(n)
    return n


def load_average() -> tuple[float, float, float]:
    """1, 5 and 15-minute load averages (NaN where the platform has none)."""
    if not hasattr(os, "getloadavg"):
        return (float("nan"),) * 3
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def cpu_flags() -> list[str]:
    """The SIMD flags that decide CPU speed (machines here differ: record them with timings)."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            present = set(line.partition(":")[2].split())
            return [f for f in SIMD_FLAGS if f in present]
    return []


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 natively (avx512_bf16 or amx_bf16)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


def preferred_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively, else float32: bfloat16 emulated on an
    AVX2-only CPU runs several times slower than float32 (on vLLM's CPU build and in torch)."""
    return torch.bfloat16 if native_bf16() else torch.float32


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return ""


BUSY_SHARE = 0.10  # other work (or steal) above this share of the CPUs contaminates a timing


class CpuCounters(TypedDict):
    """CPU seconds so far (:func:`cpu_counters`); None where ``/proc/stat`` has none."""

    wall_s: float
    own_s: float
    busy_s: float | None
    steal_s: float | None


class CpuUse(TypedDict):
    """What the CPUs did between two :func:`cpu_counters` (:func:`cpu_use`)."""

    wall_s: float
    own_cpu_s: float
    other_cpu_s: float
    steal_s: float
    other_share: float
    steal_share: float


class MachineInfo(TypedDict):
    """The record :func:`machine_info` writes (``cpu_use`` only after a ``since``)."""

    torch_threads: int
    cpus: int
    load_average: list[float]
    busy: bool
    physical_cores: NotRequired[int]
    cpu_flags: NotRequired[list[str]]
    machine: NotRequired[str]
    cpu_counters: NotRequired[CpuCounters]
    cpu_use: NotRequired[CpuUse]


def read_machine(record: object) -> MachineInfo:
    """A :func:`machine_info` record (as stored in a result's JSON) read back, checked;
    ``ValueError`` for one that is not."""
    out: MachineInfo = adapter(MachineInfo).validate_python(record)
    return out


def cpu_counters() -> CpuCounters:
    """CPU seconds so far: the machine's busy and steal time over all CPUs (``/proc/stat``;
    None where there is none), this process's own (all its threads and waited-for children),
    and a wall clock, for :func:`cpu_use`."""
    own = os.times()
    out: CpuCounters = {
        "wall_s": time.monotonic(),
        "own_s": own.user + own.system + own.children_user + own.children_system,
        "busy_s": None, "steal_s": None}
    try:
        line = Path("/proc/stat").read_text().splitlines()[0].split()
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return out
    if line[0] != "cpu" or len(line) < 9:
        return out
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in line[1:9])
    out["busy_s"] = (user + nice + system + irq + softirq) / hz  # guest time is inside user
    out["steal_s"] = steal / hz
    return out


def cpu_use(before: CpuCounters, after: CpuCounters, cpus: int) -> CpuUse | None:
    """What the CPUs did between two :func:`cpu_counters`: this process's seconds, other work's
    (the machine's busy time minus this process's) and steal, and their shares of the
    ``cpus`` x wall seconds available. None without ``/proc/stat``."""
    busy_before, busy_after = before["busy_s"], after["busy_s"]
    if busy_before is None or busy_after is None:
        return None
    steal_before, steal_after = before["steal_s"], after["steal_s"]
    wall = max(after["wall_s"] - before["wall_s"], 1e-9)
    own = after["own_s"] - before["own_s"]
    other = max(0.0, busy_after - busy_before - own)
    steal = 0.0 if steal_before is None or steal_after is None else steal_after - steal_before
    return {"wall_s": round(wall, 3), "own_cpu_s": round(own, 3), "other_cpu_s": round(other, 3),
            "steal_s": round(steal, 3), "other_share": round(other / (wall * cpus), 4),
            "steal_share": round(steal / (wall * cpus), 4)}


def machine_info(since: MachineInfo | None = None) -> MachineInfo:
    """Threads, cores, load average, busy flag and CPU flags, for a benchmark's JSON (a
    :class:`MachineInfo`; :func:`read_machine` reads a stored one back).

    ``since``: an earlier ``machine_info()`` of this process (the run's "before"). The result
    then also says what the CPUs did in between (``cpu_use``, see :func:`cpu_use`), and
    ``busy`` means other work or steal took more than :data:`BUSY_SHARE` of the CPUs over the
    run. Without ``since`` (or without ``/proc/stat``), ``busy`` means more runnable work than
    CPUs over the last minute, which counts this process's own threads too.
    """
    load = load_average()
    cpus = available_cpus()
    counters = cpu_counters()
    before = read_machine(since) if since else None
    use = cpu_use(before["cpu_counters"], counters, cpus) if before and "cpu_counters" in before \
        else None
    busy = (use["other_share"] > BUSY_SHARE or use["steal_share"] > BUSY_SHARE) if use \
        else load[0] > cpus
    info: MachineInfo = {
        "torch_threads": torch.get_num_threads(), "physical_cores": physical_cores(),
        "cpus": cpus, "load_average": [round(x, 2) for x in load],
        "busy": bool(busy), "cpu_flags": cpu_flags(),
        "machine": f"{platform.machine()} / {platform.processor() or 'cpu'}",
        "cpu_counters": counters,
    }
    if use is not None:
        info["cpu_use"] = use
    return info


def load_note(record: Mapping[str, object]) -> str:
    """One line for a report: the load beside the CPU count, and a warning when busy
    (``record``: a :func:`machine_info`)."""
    info = read_machine(record)
    load = info["load_average"][0]
    line = (f"load average {load:.2f} on {info['cpus']} CPUs, {info['torch_threads']} torch "
            f"threads")
    use = info.get("cpu_use")
    if use:
        line += (f"; other work took {100 * use['other_share']:.1f}% of the CPUs during the run"
                 f" (steal {100 * use['steal_share']:.1f}%)")
    if info["busy"]:
        line += " -- the machine was busy: timings are slower and noisier than on a quiet one"
    return line
