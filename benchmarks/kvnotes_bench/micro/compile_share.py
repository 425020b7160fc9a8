"""A learned chunk's compile time by the compile thread's nice value, on an idle CPU and on one
that busy processes keep saturated.

The learner (``kvnotes serve --learn``) compiles in a background thread at
``LearnConfig.compile_nice``. This measures what that value buys: each timing compiles one chunk
(a BFCL-like tool list of about ``--tokens`` tokens behind a short system prefix) through
:meth:`ServingSkills.add`, in a fresh thread lowered to the nice value (the CPU threads torch
starts from it inherit it), first with the machine idle, then beside ``--busy`` processes that
spin at nice 0 (one per CPU by default: what a vLLM server under saturating load does to the
cores). Linux's scheduler gives the compile a share of each contended core fixed by the nice
value (:func:`~kvnotes.serving.front.config.busy_core_share`); the JSON holds each time, the
share the kernel's weights predict, and the load average before the run. Medians over --reps
after one warm-up compile. Run on a quiet machine:
    .venv/bin/python -m kvnotes_bench.micro.compile_share --out docs/results/bench
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import MachineInfo, available_cpus, load_note, machine_info, set_threads
from kvnotes.core.models import load
from kvnotes.serving.front.config import busy_core_share
from kvnotes.serving.learning import lower_priority
from kvnotes_bench.kit.plots import panels

PREFIX = "You are a helpful assistant with access to the following functions.\n"
SPIN = "while True:\n    pass\n"


def tool_list(tokens: int, engine: Engine) -> str:
    """Tool descriptions (JSON lines in BFCL's shape) until they hold ``tokens`` tokens."""
    lines: list[str] = []
    i = 0
    while len(engine.tokenizer.encode("\n".join(lines))) < tokens:
        lines.append(json.dumps({"name": f"lookup_{i}", "description": f"Look up record {i} by "
                                 "its identifier and return its fields.", "parameters": {
                                     "type": "dict", "properties": {f"field_{i}": {
                                         "type": "string", "description": "the identifier"}}}}))
        i += 1
    return "\n".join(lines)


@dataclass(frozen=True)
class CompileShareConfig:
    """One run: ``model``'s compile of a ``tokens``-token chunk at each of ``nice``, medians of
    ``reps`` compiles, idle and beside ``busy`` spinning processes (None: one per CPU)."""

    model: str = "smollm2-135m"
    nice: tuple[int, ...] = (0, 10, 15, 19)
    tokens: int = 256
    reps: int = 3
    busy: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if not self.nice or any(not 0 <= n <= 19 for n in self.nice):
            raise InvalidArgumentError(f"nice values must be 0 to 19, got {self.nice}")
        if self.tokens < 1 or self.reps < 1 or (self.busy is not None and self.busy < 1):
            raise InvalidArgumentError(f"tokens, reps and busy must be at least 1, got "
                                       f"{self.tokens}, {self.reps}, {self.busy}")


@dataclass(frozen=True)
class CompileShareRow:
    """One nice value: median seconds per compile idle and busy, every time, the prediction."""

    nice: int
    predicted_share: float  # of a core shared with one busy nice-0 thread (kernel weights)
    idle_s: float
    busy_s: float
    slowdown: float  # busy_s / idle_s
    idle_raw: list[float]
    busy_raw: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompileShareRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class CompileShareResult:
    """What one run measured; :meth:`to_dict` is ``compile_share.json``'s schema."""

    model: str
    chunk_tokens: int
    busy_processes: int
    reps: int
    rows: tuple[CompileShareRow, ...]
    torch_threads: int
    machine_before: MachineInfo  # kvnotes.core.machine.machine_info, before any load
    machine_idle: MachineInfo  # the same after the idle timings
    command: str
    date: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompileShareResult:
        kw = {f.name: d[f.name] for f in fields(cls)}
        kw["rows"] = tuple(CompileShareRow.from_dict(r) for r in d["rows"])
        return cls(**kw)


def time_compiles(compile_once: Callable[[], None], nice: int, reps: int) -> list[float]:
    """``reps`` compiles timed in a fresh thread lowered to ``nice`` (the caller's priority is
    untouched, so each nice value starts from the process's own)."""
    times: list[float] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            lower_priority(nice)
            for _ in range(reps):
                t0 = time.perf_counter()
                compile_once()
                times.append(time.perf_counter() - t0)
        except BaseException as err:  # noqa: BLE001 -- re-raised in the caller's thread
            error.append(err)

    thread = threading.Thread(target=work, name=f"compile-nice-{nice}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return times


def spinners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that keep a core each busy at nice 0."""
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def run(config: CompileShareConfig, engine: Engine | None = None,
        command: str = "") -> CompileShareResult:
    """Time the compiles (``engine``: default ``config.model`` loaded)."""
    from kvnotes.serving.skills import ServingSkills

    threads = set_threads(config.threads)
    before = machine_info()
    engine = load(config.model) if engine is None else engine
    chunk = tool_list(config.tokens, engine)
    prefix = engine.tokenizer.encode(PREFIX)
    with tempfile.TemporaryDirectory() as folder:
        lib = ServingSkills(folder, engine)
        counter = itertools.count()

        def compile_once() -> None:
            # a new text each time: an entry already in the folder would not be compiled again
            lib.add(f"{chunk}\n#{next(counter)}", after=prefix, capped=False)

        compile_once()  # warm-up
        idle = {n: time_compiles(compile_once, n, config.reps) for n in config.nice}
        idle_info = machine_info(since=before)
        busy_count = config.busy or available_cpus()
        procs = spinners(busy_count)
        try:
            time.sleep(1.0)  # the spinners are running before the first timing
            busy = {n: time_compiles(compile_once, n, config.reps) for n in config.nice}
        finally:
            for p in procs:
                p.kill()
                p.wait()
    rows = []
    for n in config.nice:
        i, b = statistics.median(idle[n]), statistics.median(busy[n])
        rows.append(CompileShareRow(nice=n, predicted_share=busy_core_share(n), idle_s=i,
                                    busy_s=b, slowdown=b / i, idle_raw=idle[n],
                                    busy_raw=busy[n]))
    return CompileShareResult(
        model=config.model, chunk_tokens=len(engine.tokenizer.encode(chunk)),
        busy_processes=busy_count, reps=config.reps, rows=tuple(rows), torch_threads=threads,
        machine_before=before, machine_idle=idle_info, command=command,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))


def markdown(result: CompileShareResult) -> str:
    lines = [f"Compile of a {result.chunk_tokens}-token chunk ({result.model}, "
             f"{result.torch_threads} torch threads), median of {result.reps}, idle and beside "
             f"{result.busy_processes} busy processes; {result.date}",
             "", "| nice | predicted share of a busy core | idle | busy | slowdown |",
             "|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        lines.append(f"| {r.nice} | {r.predicted_share:.1%} | {r.idle_s:.2f} s | "
                     f"{r.busy_s:.2f} s | {r.slowdown:.0f}x |")
    lines += ["", load_note(result.machine_before)]
    return "\n".join(lines)


def plot(result: CompileShareResult, path: Path) -> None:
    with panels(path, 1, size=(6, 4)) as (ax,):
        nices = [r.nice for r in result.rows]
        ax.plot(nices, [r.idle_s for r in result.rows], "o-", color="tab:green", label="idle CPU")
        ax.plot(nices, [r.busy_s for r in result.rows], "o-", color="tab:red",
                label=f"beside {result.busy_processes} busy processes")
        ax.plot(nices, [r.idle_s / r.predicted_share for r in result.rows], ":",
                color="gray", label="idle time / predicted share")
        ax.set_yscale("log")
        ax.set_xlabel("compile thread nice value")
        ax.set_ylabel("seconds per compile (median)")
        ax.set_xticks(nices)
        ax.set_title(f"A {result.chunk_tokens}-token chunk's compile ({result.model}, "
                     f"{result.torch_threads} threads)", fontsize=9)
        ax.legend(fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nice", default="0,10,15,19", help="nice values, comma-separated")
    ap.add_argument("--tokens", type=int, default=256, help="the chunk's length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--busy", type=int, default=None,
                    help="spinning processes beside the busy timings (default: one per CPU)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    try:
        nice = tuple(int(n) for n in args.nice.split(","))
    except ValueError:
        ap.error(f"--nice {args.nice}: give integers, comma-separated")
    try:
        config = CompileShareConfig(model=args.model, nice=nice, tokens=args.tokens,
                                    reps=args.reps, busy=args.busy, threads=args.threads)
    except InvalidArgumentError as err:
        ap.error(str(err))
    result = run(config,
                 command="python -m kvnotes_bench.micro.compile_share "
                 + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_share.json").write_text(json.dumps(result.to_dict(), indent=2))
    plot(result, args.out / "compile_share.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
