"""The soak's volatile skills over time: published, damaged (one byte of the file flipped, or the
file deleted) and retired at their scheduled times while the clients run, each event recorded
as it happened."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes_bench.serving.soak_check import DAMAGES, SkillEvent
from kvnotes_bench.serving.soak_workload import volatile_name, volatile_text

if TYPE_CHECKING:
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.skills import ServingSkills


@dataclass(frozen=True)
class EventRecord:
    """One skill event as it happened (seconds into the run)."""

    kind: str
    skill: int
    planned_s: float
    started_s: float
    done_s: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EventRecord:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclass
class EventLog:
    """The skill events as they happened: planned and actual times, the skill's file."""

    events: list[EventRecord] = field(default_factory=list)
    live: int | None = None
    notebooks: dict[str, Notebook] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def damage_file(path: Path, kind: str) -> None:
    """``corrupt``: one byte of the file's tensor data flipped, in place (the index keeps the
    entry; its checksum fails when read); ``delete``: the file removed."""
    if kind == "delete":
        path.unlink()
        return
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)  # inside the last tensor's bytes
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


async def run_events(schedule: Sequence[SkillEvent], skills: ServingSkills, header: str,
                     log: EventLog, t0: float, say: Callable[[str], None],
                     keep: Path | None = None) -> None:
    """Publish, damage and retire the volatile skills at their times (compiling in a thread);
    each published file is copied to ``keep`` first (the references need it after its
    damage)."""
    import shutil

    paths: dict[int, Path] = {}
    for ev in schedule:
        await asyncio.sleep(max(0.0, t0 + ev.t_s - time.monotonic()))
        name = volatile_name(ev.skill)
        started = time.monotonic() - t0
        if ev.kind == "publish":
            text = volatile_text(ev.skill)
            await asyncio.to_thread(skills.add, text, name=name, after=header)
            log.notebooks[name] = skills.library.get(text, name=name, after=header)
            log.texts[name] = text
            paths[ev.skill] = skills.library.path_for(text, after=header)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(paths[ev.skill], keep / f"{name}.safetensors")
            log.live = ev.skill
        elif ev.kind == "retire":
            log.live = None
        else:
            await asyncio.to_thread(damage_file, paths[ev.skill], ev.kind)
        done = time.monotonic() - t0
        log.events.append(EventRecord(kind=ev.kind, skill=ev.skill, planned_s=ev.t_s,
                                      started_s=round(started, 3), done_s=round(done, 3)))
        say(f"[{done:6.1f} s] {ev.kind} {name}")


def damage_times(events: Sequence[EventRecord]) -> dict[int, tuple[str, float]]:
    """Each damaged volatile skill's damage kind and the time it was done."""
    return {e.skill: (e.kind, e.done_s) for e in events if e.kind in DAMAGES}
