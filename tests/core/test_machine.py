"""The machine record that goes beside every timing: CPU time taken by other work."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvnotes.core import machine
from kvnotes.core.machine import cpu_use, load_note, machine_info

HAS_PROC_STAT = Path("/proc/stat").is_file()


def _counters(wall, own, busy, steal=0.0):
    return {"wall_s": wall, "own_s": own, "busy_s": busy, "steal_s": steal}


def test_cpu_use_separates_the_run_from_other_work():
    # 10 s on 2 CPUs: the machine was busy 19 s, 18 of them this process's own
    use = cpu_use(_counters(0.0, 5.0, 100.0, 1.0), _counters(10.0, 23.0, 119.0, 3.0), 2)
    assert use["own_cpu_s"] == pytest.approx(18.0)
    assert use["other_cpu_s"] == pytest.approx(1.0)
    assert use["other_share"] == pytest.approx(0.05)
    assert use["steal_share"] == pytest.approx(0.1)
    # own time counted past the machine's (clock granularity) is never negative other work
    assert cpu_use(_counters(0, 0, 0), _counters(1, 2.0, 1.99), 2)["other_cpu_s"] == 0.0
    assert cpu_use(_counters(0, 0, None), _counters(1, 1, None), 2) is None


def test_a_run_busy_with_its_own_threads_is_not_flagged(monkeypatch):
    """The load average after a 2-thread run on 2 CPUs is about 2 whatever else ran; the busy
    flag of the "after" record looks at other work's CPU time instead."""
    ticks = iter([_counters(0.0, 0.0, 0.0), _counters(10.0, 19.8, 20.0),   # quiet run
                  _counters(0.0, 0.0, 0.0), _counters(10.0, 12.0, 20.0)])  # 8 s of others
    monkeypatch.setattr(machine, "cpu_counters", lambda: next(ticks))
    monkeypatch.setattr(machine, "load_average", lambda: (2.6, 2.0, 1.5))
    monkeypatch.setattr(machine, "available_cpus", lambda: 2)
    before = machine_info()
    assert before["busy"]  # no interval yet: the load rule (2.6 runnable on 2 CPUs)
    after = machine_info(since=before)
    assert not after["busy"] and after["cpu_use"]["other_share"] == pytest.approx(0.01)
    assert "other work took 1.0% of the CPUs" in load_note(after)
    after = machine_info(since=machine_info())
    assert after["busy"] and after["cpu_use"]["other_share"] == pytest.approx(0.4)
    assert "the machine was busy" in load_note(after)


@pytest.mark.skipif(not HAS_PROC_STAT, reason="no /proc/stat on this platform")
def test_own_work_is_counted_as_own():
    before = machine_info()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU
        pass
    use = machine_info(since=before)["cpu_use"]
    assert use["own_cpu_s"] >= 0.25
    assert use["wall_s"] >= 0.25
