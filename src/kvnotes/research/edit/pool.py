"""The suite's cases in worker processes: one engine per process, one shared queue of cases.

Each worker takes the next case as soon as it is free, so slow cases do not hold the others
back. A case that raises, or a worker that dies, stops the run with :class:`WorkerError`.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import InvalidArgumentError, WorkerError
from kvnotes.core.records import Json
from kvnotes.research.edit.evaluate import evaluate_case
from kvnotes.research.edit.results import CaseResult, SuiteSettings

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.eval.tasks.base import EditCase

Loader = Callable[[], "Engine"]


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What every worker process is started with (picklable: it crosses the process boundary).

    ``model`` is the name of the parent's engine: a worker whose ``loader`` loads another
    model refuses to run, so one table never mixes two models.
    """

    suite: SuiteSettings
    threads: int  # torch threads per worker
    model: str


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One message from a worker: a finished case, or an error (``case_id`` None: loading)."""

    case_id: str | None
    result: Json | None = None  # CaseResult.to_dict(): plain data crosses processes
    error: str = ""


def evaluate_in_workers(loader: Loader, cases: Sequence[EditCase], settings: WorkerSettings,
                        workers: int) -> Iterator[CaseResult]:
    """:func:`evaluate_case` of every case in ``workers`` spawned processes, yielded as they
    finish (not in case order)."""
    ctx = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
    jobs: Any = ctx.Queue()
    results: Any = ctx.Queue()
    for case in cases:
        jobs.put(case)
    for _ in range(workers):
        jobs.put(None)  # one stop sign per worker
    procs = [ctx.Process(target=_worker, args=(loader, settings, jobs, results), daemon=True,
                         name=f"edit-eval-worker-{i + 1}") for i in range(workers)]
    for p in procs:
        p.start()
    try:
        left = len(cases)
        while left:
            try:
                outcome: _Outcome = results.get(timeout=2.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(
                        f"{dead[0].name} died (exit code {dead[0].exitcode}; out of memory?) "
                        f"with {left} cases unfinished; the cases done so far are in the "
                        "checkpoint: rerun with --resume") from None
                continue
            if outcome.result is None:
                where = f" on case {outcome.case_id}" if outcome.case_id else ""
                raise WorkerError(f"an edit-eval worker failed{where}: {outcome.error}")
            left -= 1
            yield CaseResult.from_dict(outcome.result)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)


def _worker(loader: Loader, settings: WorkerSettings, jobs: Any, results: Any) -> None:
    """One worker process: load the engine, then evaluate cases from ``jobs`` until a stop
    sign; every outcome (a result or an error) goes to ``results``."""
    import torch

    torch.set_num_threads(settings.threads)
    try:
        engine = loader()
        if engine.name != settings.model:
            raise InvalidArgumentError(f"the worker loaded {engine.name!r}, not "
                                       f"{settings.model!r}")
    except Exception as err:  # reported to the parent, which stops the run
        results.put(_Outcome(None, error=f"loading the model: {type(err).__name__}: {err}"))
        return
    while (case := jobs.get()) is not None:
        try:
            result = evaluate_case(engine, case, settings.suite)
        except Exception as err:
            results.put(_Outcome(case.case_id, error=f"{type(err).__name__}: {err}"))
            return
        results.put(_Outcome(case.case_id, result=result.to_dict()))
