"""``kvnotes repro``: the paper's claims beside our measurements, per model, in one report.

For each model, five stages run in order, each reusing a suite that already exists:

- ``compose``: composition fidelity of the demo's skills and contexts (:mod:`kvnotes.apps.demo`);
- ``edit`` and ``edit_cot``: the edit suite, every strategy, without and with chain of thought
  (:mod:`kvnotes.eval.edit_suite`);
- ``trace``: field-vs-notes causal patching with bootstrap CIs (:mod:`kvnotes.eval.trace_suite`);
- ``agent``: the kvnotes agent against the recompute agent (:mod:`kvnotes.apps.agent.bench`).

Each finished stage is written to ``OUT/<model>/<stage>.json`` at once, so an interrupted run
resumes where it stopped (a stage file written with other settings is run again). The paper's
figures come from ``apps/data/paper_claims.json`` (each with its source);
:func:`kvnotes.apps.claims.judge` turns a claim and our numbers into a verdict and
:mod:`kvnotes.apps.repro_report` writes the report. Timings carry the load average they ran under.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvnotes.apps.repro_report import write_report
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.machine import machine_info

STAGES: tuple[str, ...] = ("compose", "edit", "edit_cot", "trace", "agent")
DEFAULT_MODELS: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")

Progress = Callable[[str, str, int, int], None]  # (model, stage, done, total)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How much of each suite a run measures (``QUICK`` fits 2 CPU cores; ``FULL`` is for GPUs)."""

    compose_new_tokens: int
    compose_repeats: int
    edit_per_family: int
    edit_strategies: tuple[str, ...] | None  # None: every strategy of the edit suite
    cot_per_family: int
    cot_strategies: tuple[str, ...] | None
    cot_budget: int
    trace_cases: int  # per family, among equal-length cases
    trace_by_layer: bool
    trace_boot: int
    agent_episodes: int
    agent_turns: int


QUICK = Sizes(compose_new_tokens=8, compose_repeats=1, edit_per_family=1, edit_strategies=None,
              cot_per_family=1, cot_strategies=("recompute", "prefix", "overwrite", "erratum"),
              cot_budget=48, trace_cases=2, trace_by_layer=False, trace_boot=1000,
              agent_episodes=3, agent_turns=3)
FULL = Sizes(compose_new_tokens=24, compose_repeats=3, edit_per_family=6, edit_strategies=None,
             cot_per_family=3, cot_strategies=None, cot_budget=96, trace_cases=6,
             trace_by_layer=True, trace_boot=2000, agent_episodes=10, agent_turns=5)


# ---------------------------------------------------------------------------------------------
# stages


def slug(model: str) -> str:
    """A folder name for a model alias, path or hub id."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name if os.sep in model else model)


def load_now() -> dict[str, Any]:
    """The 1-minute load average and the CPU count (timings on a busy machine are marked)."""
    info = machine_info()
    return {"load_1min": info["load_average"][0], "cpus": info["cpus"], "busy": info["busy"],
            "cpu_flags": " ".join(info["cpu_flags"]), "torch_threads": info["torch_threads"]}


def _stage_compose(engine: Any, sizes: Sizes, tick: Callable[[int, int], None]) -> dict[str, Any]:
    from kvnotes.apps.demo import demo_data, run_compose_demo

    total = len(demo_data()[1])
    done = [0]

    def progress(_name: str) -> None:
        done[0] += 1
        tick(done[0], total)

    tick(0, total)
    return run_compose_demo(engine, max_new_tokens=sizes.compose_new_tokens,
                            repeats=sizes.compose_repeats, progress=progress)


def _edit(engine: Any, sizes: Sizes, tick: Callable[[int, int], None], *, cot: bool,
          ) -> dict[str, Any]:
    from kvnotes.eval.edit_suite import DEFAULT_STRATEGIES, run_suite, spread
    from kvnotes.eval.tasks import load_suite

    per_family = sizes.cot_per_family if cot else sizes.edit_per_family
    chosen = (sizes.cot_strategies if cot else sizes.edit_strategies) or DEFAULT_STRATEGIES
    cases = spread(load_suite(), per_family)
    tick(0, len(cases))
    return run_suite(engine, cases, list(chosen), cot=cot, budget=sizes.cot_budget,
                     progress=tick)


def trace_picks(engine: Any, cases: Sequence[Any], per_family: int) -> list[Any]:
    """Up to ``per_family`` cases of each family, spread out, among those whose old and new
    values have equal token lengths (patching needs them)."""
    picked = []
    for fam in dict.fromkeys(c.family for c in cases):
        equal = [c for c in cases if c.family == fam
                 and len(engine.encode(c.old_value)) == len(engine.encode(c.new_value))]
        k = min(per_family, len(equal))
        picked += [equal[i * len(equal) // k] for i in range(k)] if k else []
    return picked


def _stage_trace(engine: Any, sizes: Sizes, tick: Callable[[int, int], None]) -> dict[str, Any]:
    from kvnotes.eval.tasks import load_suite
    from kvnotes.eval.trace_suite import summarize, trace_cases
    from kvnotes.ops.trace import TraceOptions

    suite = load_suite()
    picked = trace_picks(engine, suite, sizes.trace_cases)
    families = list(dict.fromkeys(c.family for c in suite))
    options = TraceOptions(by_layer=sizes.trace_by_layer, position_bins=4,
                           detail_when_insensitive=False)
    done = [0]

    def progress(_item: Any) -> None:
        done[0] += 1
        tick(done[0], len(picked))

    tick(0, len(picked))
    traces = trace_cases(engine, picked, options, progress=progress)
    rows = summarize(traces, n_boot=sizes.trace_boot, families=families)
    return {"model": engine.name, "families": [r.to_dict() for r in rows],
            "cases": [{"case_id": t.case_id, "family": t.family, "status": t.status,
                       "reason": t.reason[:120],
                       **({"denominator": t.result.denominator, "sensitive": t.result.sensitive,
                           "field": t.result.field_effect, "notes": t.result.notes_effect}
                          if t.result is not None else {})} for t in traces]}


def _stage_agent(engine: Any, sizes: Sizes, tick: Callable[[int, int], None], *,
                 skill_root: Path) -> dict[str, Any]:
    from kvnotes.apps.agent.bench import run_bench

    done = [0]

    def progress(_line: str) -> None:
        done[0] += 1
        tick(done[0], sizes.agent_episodes)

    tick(0, sizes.agent_episodes)
    result = run_bench(engine, n_episodes=sizes.agent_episodes, turns=sizes.agent_turns,
                       stale=False, skill_root=skill_root, progress=progress)
    return {k: v for k, v in result.items() if k != "records"}


def _run_stage(stage: str, engine: Any, sizes: Sizes, tick: Callable[[int, int], None],
               folder: Path) -> dict[str, Any]:
    if stage == "compose":
        return _stage_compose(engine, sizes, tick)
    if stage in ("edit", "edit_cot"):
        return _edit(engine, sizes, tick, cot=stage == "edit_cot")
    if stage == "trace":
        return _stage_trace(engine, sizes, tick)
    return _stage_agent(engine, sizes, tick, skill_root=folder / "skills")


# ---------------------------------------------------------------------------------------------
# the run


def run_repro(models: Sequence[str], out: str | Path, *, device: str = "cpu",
              dtype: str = "float32", quick: bool = True, stages: Sequence[str] = STAGES,
              load: Callable[..., Any] | None = None, progress: Progress | None = None,
              command: str = "", report_only: bool = False) -> dict[str, Path]:
    """Run every stage for every model (resuming finished ones) and write the report.

    ``load(model, device=..., dtype=...)`` makes an engine (default :func:`kvnotes.load`); it
    is only called for a model with a stage left to run. ``report_only`` runs nothing: the
    report is written from the finished stages (the others read ``not run``). Returns the
    written paths.
    """
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise UnknownNameError("repro stage", unknown[0], STAGES)
    if not models:
        raise InvalidArgumentError("give at least one model (--models A,B)")
    if load is None:
        from kvnotes.core.models import load
    sizes = QUICK if quick else FULL
    settings = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
                "quick": quick, "sizes": asdict(sizes)}
    settings = json.loads(json.dumps(settings))  # as a checkpoint reads it back (lists, not tuples)
    out = Path(out)
    per_model: dict[str, dict[str, Any]] = {}
    for model in models:
        folder = out / slug(model)
        engine = None
        per_model[model] = {}
        for stage in stages:
            path = folder / f"{stage}.json"
            saved = _read_stage(path, settings)
            if saved is not None:
                per_model[model][stage] = saved
                if progress:
                    progress(model, stage, 1, 1)
                continue
            if report_only:
                continue
            if engine is None:
                engine = load(model, device=device, dtype=dtype)

            def tick(done: int, total: int, m: str = model, s: str = stage) -> None:
                if progress:
                    progress(m, s, done, total)

            before, t0 = load_now(), time.perf_counter()
            result = _run_stage(stage, engine, sizes, tick, folder)
            record = {"settings": settings, "seconds": time.perf_counter() - t0,
                      "load_before": before, "load_after": load_now(), "result": result}
            _write_json(path, record)
            per_model[model][stage] = record
    return write_report(out, per_model, settings, command=command)


def _read_stage(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """A finished stage's record, or None when missing, unreadable or made with other settings."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if record.get("settings") == settings else None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(staged, path)
