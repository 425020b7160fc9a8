"""A whole run of the suite: every case (serially or in worker processes), resumed from earlier
results, checkpointed after every case, aggregated into a :class:`SuiteResult`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import physical_cores
from kvnotes.research.edit.evaluate import evaluate_case
from kvnotes.research.edit.pool import Loader, WorkerSettings, evaluate_in_workers
from kvnotes.research.edit.results import CaseResult, SuiteResult, SuiteSettings
from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.eval.tasks.base import EditCase


DEFAULT_SETTINGS = SuiteSettings(DEFAULT_STRATEGIES)


def run_suite(engine: Engine, cases: Iterable[EditCase],
              settings: SuiteSettings = DEFAULT_SETTINGS, *,
              progress: Callable[[int, int], None] | None = None,
              checkpoint: Callable[[SuiteResult], None] | None = None,
              done: Iterable[CaseResult] = (), workers: int = 1,
              loader: Loader | None = None, threads: int | None = None) -> SuiteResult:
    """Evaluate every case with ``settings`` and aggregate per strategy and per family.

    ``checkpoint`` is called with the result so far after every case but the last (to write
    partial results during long runs). ``done``: results of an earlier run with the same
    settings (:func:`~kvnotes.research.edit.checkpoint.load_results`); cases found there are
    taken as they are instead of run again (``seconds`` is then this run's wall time only, and
    ``n_resumed`` counts the cases taken).

    ``workers=N`` (N > 1) evaluates the cases in N worker processes (:mod:`.pool`), each
    loading its own engine with ``loader`` (picklable: a module-level function or a
    ``functools.partial`` of one; it must load the model ``engine`` is) and running ``threads``
    torch threads (default: the physical cores shared out). Results come back in case order
    whatever order they finish in. The workers share the machine, so the timing columns are not
    quiet figures (``workers`` is recorded). A case that raises, or a worker that dies, stops
    the run with :class:`WorkerError`; the checkpoints written until then keep every finished
    case.
    """
    cases = list(cases)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers must be a number of processes >= 1, got {workers!r}")
    if workers > 1 and loader is None:
        raise InvalidArgumentError("workers > 1 needs a loader: each worker process loads its "
                                   "own engine")
    earlier = {r.case_id: r for r in done}
    todo = [c for c in cases if c.case_id not in earlier]
    finished = {c.case_id: earlier[c.case_id] for c in cases if c.case_id in earlier}
    resumed = len(finished)
    n_workers = min(workers, len(todo)) if workers > 1 else 1
    t0 = time.perf_counter()

    def summary() -> SuiteResult:
        results = [finished[c.case_id] for c in cases if c.case_id in finished]
        return SuiteResult.of(engine.name, settings, results, planned=len(cases),
                              resumed=resumed, seconds=time.perf_counter() - t0,
                              workers=n_workers)

    if progress and resumed:
        progress(resumed, len(cases))
    if n_workers > 1:
        assert loader is not None
        pool = WorkerSettings(settings, threads=threads or max(1, physical_cores() // n_workers),
                              model=engine.name)
        evaluated: Iterable[CaseResult] = evaluate_in_workers(loader, todo, pool, n_workers)
    else:
        evaluated = (evaluate_case(engine, case, settings) for case in todo)
    for result in evaluated:
        finished[result.case_id] = result
        if progress:
            progress(len(finished), len(cases))
        if checkpoint and len(finished) < len(cases):
            checkpoint(summary())
    return summary()
