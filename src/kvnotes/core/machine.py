"""The machine a timing ran on: torch threads (default: physical cores), load, CPU flags.

Timings on a shared CPU mean little without the load beside them: every command that times
things sets its threads with :func:`set_threads` and records :func:`machine_info`.
"""

from __future__ import annotations

import os
import platform
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


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return ""


def machine_info() -> dict[str, Any]:
    """Threads, cores, load average, busy flag and CPU flags, for a benchmark's JSON."""
    load = load_average()
    cpus = available_cpus()
    flags = cpu_flags()
    return {
        "torch_threads": torch.get_num_threads(), "physical_cores": physical_cores(),
        "cpus": cpus, "load_average": [round(x, 2) for x in load],
        # busy: more runnable work than CPUs over the last minute (timings then run slow)
        "busy": bool(load[0] > cpus), "cpu_flags": flags,
        "machine": f"{platform.machine()} / {platform.processor() or 'cpu'}",
    }


def load_note(info: dict[str, Any]) -> str:
    """One line for a report: the load beside the CPU count, and a warning when busy."""
    load = info["load_average"][0]
    line = (f"load average {load:.2f} on {info['cpus']} CPUs, {info['torch_threads']} torch "
            f"threads")
    if info["busy"]:
        line += " -- the machine was busy: timings are slower and noisier than on a quiet one"
    return line
