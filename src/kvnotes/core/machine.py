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
from pathlib import Path
from typing import Any

import torch

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


def cpu_counters() -> dict[str, float | None]:
    """CPU seconds so far: the machine's busy and steal time over all CPUs (``/proc/stat``;
    None where there is none), this process's own (all its threads and waited-for children),
    and a wall clock, for :func:`cpu_use`."""
    own = os.times()
    out: dict[str, float | None] = {
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


def cpu_use(before: dict[str, float | None], after: dict[str, float | None], cpus: int
            ) -> dict[str, float] | None:
    """What the CPUs did between two :func:`cpu_counters`: this process's seconds, other work's
    (the machine's busy time minus this process's) and steal, and their shares of the
    ``cpus`` x wall seconds available. None without ``/proc/stat``."""
    if before.get("busy_s") is None or after.get("busy_s") is None:
        return None

    def delta(key: str) -> float:
        start, end = before.get(key), after.get(key)
        return 0.0 if start is None or end is None else end - start

    wall = max(delta("wall_s"), 1e-9)
    own = delta("own_s")
    other = max(0.0, delta("busy_s") - own)
    steal = delta("steal_s")
    return {"wall_s": round(wall, 3), "own_cpu_s": round(own, 3), "other_cpu_s": round(other, 3),
            "steal_s": round(steal, 3), "other_share": round(other / (wall * cpus), 4),
            "steal_share": round(steal / (wall * cpus), 4)}


def machine_info(since: dict[str, Any] | None = None) -> dict[str, Any]:
    """Threads, cores, load average, busy flag and CPU flags, for a benchmark's JSON.

    ``since``: an earlier ``machine_info()`` of this process (the run's "before"). The result
    then also says what the CPUs did in between (``cpu_use``, see :func:`cpu_use`), and
    ``busy`` means other work or steal took more than :data:`BUSY_SHARE` of the CPUs over the
    run. Without ``since`` (or without ``/proc/stat``), ``busy`` means more runnable work than
    CPUs over the last minute, which counts this process's own threads too.
    """
    load = load_average()
    cpus = available_cpus()
    counters = cpu_counters()
    use = cpu_use(since["cpu_counters"], counters, cpus) if since and "cpu_counters" in since \
        else None
    busy = (use["other_share"] > BUSY_SHARE or use["steal_share"] > BUSY_SHARE) if use \
        else load[0] > cpus
    info = {
        "torch_threads": torch.get_num_threads(), "physical_cores": physical_cores(),
        "cpus": cpus, "load_average": [round(x, 2) for x in load],
        "busy": bool(busy), "cpu_flags": cpu_flags(),
        "machine": f"{platform.machine()} / {platform.processor() or 'cpu'}",
        "cpu_counters": counters,
    }
    if use is not None:
        info["cpu_use"] = use
    return info


def load_note(info: dict[str, Any]) -> str:
    """One line for a report: the load beside the CPU count, and a warning when busy."""
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
