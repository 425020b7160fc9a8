"""``kvnotes repro``: the paper's claims beside our measurements, per model, in one report.

For each model, five stages run in order, each reusing a suite that already exists:

- ``compose``: composition fidelity of the demo's skills and contexts (:mod:`kvnotes.apps.demo`);
- ``edit`` and ``edit_cot``: the edit suite, every strategy, without and with chain of thought
  (:mod:`kvnotes.research.edit`);
- ``trace``: field-vs-notes causal patching with bootstrap CIs (:mod:`kvnotes.research.trace.suite`);
- ``agent``: the kvnotes agent against the recompute agent (:mod:`kvnotes.research.agent.run`).

Each stage gives a typed result; it is written to ``OUT/<model>/<stage>.json`` at once (as a
:class:`StageRecord`), so an interrupted run resumes where it stopped (a stage file written with
other settings, or unreadable, is run again). :func:`run_repro` returns the records
(:class:`ReproRun`); :mod:`kvnotes.research.repro.report` judges them against the paper's figures
(:mod:`kvnotes.research.repro.claims`) and writes the report. Timings carry the load average they ran under.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass as record

from kvnotes.apps.demo import ComposeDemoResult
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.core.machine import machine_info
from kvnotes.core.records import Json, JsonRecord
from kvnotes.research.agent.summary import BenchSummary
from kvnotes.research.edit.results import SuiteResult
from kvnotes.research.trace.suite import TraceSuiteResult

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
    trace_directions: tuple[str, ...] = ("denoising", "noising")
    trace_position_bins: int = 4


QUICK = Sizes(compose_new_tokens=8, compose_repeats=1, edit_per_family=1, edit_strategies=None,
              cot_per_family=1, cot_strategies=("recompute", "prefix", "overwrite", "erratum"),
              cot_budget=48, trace_cases=2, trace_by_layer=False, trace_boot=1000,
              agent_episodes=3, agent_turns=3)
FULL = Sizes(compose_new_tokens=24, compose_repeats=3, edit_per_family=6, edit_strategies=None,
             cot_per_family=3, cot_strategies=None, cot_budget=96, trace_cases=6,
             trace_by_layer=True, trace_boot=2000, agent_episodes=10, agent_turns=5)
# the claims on many cases of a few families on 2 CPU cores: only the strategies the claims
# read (recompute, the field-only overwrite, the erratum), per-family counts set by the caller
CLAIMS = Sizes(compose_new_tokens=8, compose_repeats=1, edit_per_family=24,
               edit_strategies=("recompute", "overwrite", "erratum"), cot_per_family=24,
               cot_strategies=("recompute", "overwrite", "erratum"), cot_budget=48,
               trace_cases=24, trace_by_layer=False, trace_boot=2000, agent_episodes=3,
               agent_turns=3, trace_directions=("denoising",), trace_position_bins=1)
SIZES: dict[str, Sizes] = {"quick": QUICK, "full": FULL, "claims": CLAIMS}


def with_cases(sizes: Sizes, per_family: int) -> Sizes:
    """``sizes`` with ``per_family`` cases of each family in the edit, CoT and trace stages."""
    if per_family < 1:
        raise InvalidArgumentError(f"cases per family must be at least 1, got {per_family}")
    return replace(sizes, edit_per_family=per_family, cot_per_family=per_family,
                   trace_cases=per_family)


@dataclass(frozen=True, slots=True)  # not validated by pydantic: its own errors stay clear
class CaseChoice:
    """Which task families the edit, CoT and trace stages take, and which seeds of the seeded
    families (:data:`kvnotes.eval.tasks.SEEDED_FAMILIES`): ``heldout`` for reported runs."""

    families: tuple[str, ...] | None = None  # None: every family
    split: str = "heldout"

    def __post_init__(self) -> None:
        from kvnotes.eval.tasks import FAMILIES, SPLITS

        for name in self.families or ():
            if name not in FAMILIES:
                raise UnknownNameError("family", name, sorted(FAMILIES))
        if self.split not in SPLITS:
            raise UnknownNameError("seed split", self.split, SPLITS)

    def cases(self) -> list[Any]:
        from kvnotes.eval.tasks import load_suite

        return load_suite(self.families, self.split)


def slug(model: str) -> str:
    """A folder name for a model alias, path or hub id."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name if os.sep in model else model)


def _every_family(choice: CaseChoice) -> bool:
    return choice == CaseChoice()


@record(frozen=True, slots=True)
class RunSettings(JsonRecord):
    """What a run measures with; a stage file made with other settings is run again.

    ``to_dict``: as a stage file records it, the case choice (key ``cases``) only when it is
    not the default (every family).
    """

    device: str
    dtype: str
    quick: bool
    sizes: Sizes
    choice: CaseChoice = Field(default=CaseChoice(), serialization_alias="cases",
                               exclude_if=_every_family)

    @property
    def size_label(self) -> str:
        return next((name for name, s in SIZES.items() if s == self.sizes), "custom")



@record(frozen=True, slots=True)
class LoadSample(JsonRecord):
    """The machine's load at one moment (timings on a busy machine are marked)."""

    load_1min: float
    cpus: int
    busy: bool
    cpu_flags: str = ""  # the SIMD flags, space-separated
    torch_threads: int | None = None


def load_now() -> LoadSample:
    """The 1-minute load average, the CPU count and flags, and torch's threads, now."""
    info = machine_info()
    return LoadSample(load_1min=info["load_average"][0], cpus=info["cpus"], busy=info["busy"],
                      cpu_flags=" ".join(info["cpu_flags"]), torch_threads=info["torch_threads"])


StageResult = ComposeDemoResult | SuiteResult | TraceSuiteResult | BenchSummary

# how each stage's result is read back from its file
READERS: dict[str, Callable[[object], StageResult]] = {
    "compose": ComposeDemoResult.from_dict, "edit": SuiteResult.from_dict,
    "edit_cot": SuiteResult.from_dict, "trace": TraceSuiteResult.from_dict,
    "agent": BenchSummary.from_dict,
}


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One finished stage: its result, how long it took and the load around it."""

    settings: RunSettings
    seconds: float
    load_before: LoadSample
    load_after: LoadSample
    result: StageResult
    finished: str = ""  # UTC date and time the stage finished ("" in older files)

    @property
    def busy(self) -> bool:
        return self.load_before.busy or self.load_after.busy

    def to_dict(self) -> Json:
        result = (self.result.to_dict(records=False) if isinstance(self.result, BenchSummary)
                  else self.result.to_dict())
        return {"settings": self.settings.to_dict(), "seconds": self.seconds,
                "finished": self.finished, "load_before": self.load_before.to_dict(),
                "load_after": self.load_after.to_dict(), "result": result}

    @classmethod
    def from_dict(cls, stage: str, data: object, settings: RunSettings) -> StageRecord:
        """A stage file (:meth:`to_dict`) made with ``settings``."""
        f = _StageFile.from_dict(data)
        return cls(settings, f.seconds, f.load_before, f.load_after, READERS[stage](f.result),
                   f.finished or "")


@record(frozen=True, slots=True)
class _StageFile(JsonRecord):
    """A stage file's fields besides the settings (the result read by the stage's reader)."""

    seconds: float
    load_before: LoadSample
    load_after: LoadSample
    result: Json
    finished: str | None = ""  # "" in older files


@dataclass(frozen=True, slots=True)
class ReproRun:
    """Every model's finished stages (a stage not run is missing)."""

    settings: RunSettings
    models: dict[str, dict[str, StageRecord]]


# ---------------------------------------------------------------------------------------------
# stages


Tick = Callable[[int, int], None]


def _stage_compose(engine: Any, sizes: Sizes, tick: Tick) -> ComposeDemoResult:
    from kvnotes.apps.demo import demo_data, run_compose_demo

    total = len(demo_data()[1])
    done = [0]

    def progress(_name: str) -> None:
        done[0] += 1
        tick(done[0], total)

    tick(0, total)
    return run_compose_demo(engine, max_new_tokens=sizes.compose_new_tokens,
                            repeats=sizes.compose_repeats, progress=progress)


def _edit(engine: Any, sizes: Sizes, tick: Tick, choice: CaseChoice, *,
          cot: bool) -> SuiteResult:
    from kvnotes.research.edit.cases import spread
    from kvnotes.research.edit.results import SuiteSettings
    from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES
    from kvnotes.research.edit.suite import run_suite

    per_family = sizes.cot_per_family if cot else sizes.edit_per_family
    chosen = (sizes.cot_strategies if cot else sizes.edit_strategies) or DEFAULT_STRATEGIES
    cases = spread(choice.cases(), per_family)
    tick(0, len(cases))
    return run_suite(engine, cases, SuiteSettings(tuple(chosen), cot=cot, budget=sizes.cot_budget),
                     progress=tick)


def _stage_trace(engine: Any, sizes: Sizes, tick: Tick, choice: CaseChoice) -> TraceSuiteResult:
    from kvnotes.ops.trace import TraceOptions
    from kvnotes.research.trace.suite import pick_cases, summarize, trace_cases

    suite = choice.cases()
    picked = pick_cases(engine, suite, sizes.trace_cases).cases
    families = list(dict.fromkeys(c.family for c in suite))
    options = TraceOptions(directions=sizes.trace_directions, by_layer=sizes.trace_by_layer,
                           position_bins=sizes.trace_position_bins, detail_when_insensitive=False)
    done = [0]

    def progress(_item: Any) -> None:
        done[0] += 1
        tick(done[0], len(picked))

    tick(0, len(picked))
    traces = trace_cases(engine, picked, options, progress=progress)
    rows = summarize(traces, n_boot=sizes.trace_boot, families=families)
    return TraceSuiteResult.of(engine.name, traces, rows)


def _stage_agent(engine: Any, sizes: Sizes, tick: Tick, *, skill_root: Path) -> BenchSummary:
    from kvnotes.research.agent.run import AgentBenchConfig, run_bench

    done = [0]

    def progress(_line: str) -> None:
        done[0] += 1
        tick(done[0], sizes.agent_episodes)

    tick(0, sizes.agent_episodes)
    config = AgentBenchConfig(n_episodes=sizes.agent_episodes, turns=sizes.agent_turns, stale=False,
                         skill_root=skill_root)
    return replace(run_bench(engine, config, progress=progress), records=())


def _run_stage(stage: str, engine: Any, settings: RunSettings, tick: Tick,
               folder: Path) -> StageResult:
    sizes = settings.sizes
    if stage == "compose":
        return _stage_compose(engine, sizes, tick)
    if stage in ("edit", "edit_cot"):
        return _edit(engine, sizes, tick, settings.choice, cot=stage == "edit_cot")
    if stage == "trace":
        return _stage_trace(engine, sizes, tick, settings.choice)
    return _stage_agent(engine, sizes, tick, skill_root=folder / "skills")


# ---------------------------------------------------------------------------------------------
# the run


def run_repro(models: Sequence[str], out: str | Path, *, device: str = "cpu",
              dtype: str = "float32", quick: bool = True, stages: Sequence[str] = STAGES,
              load: Callable[..., Any] | None = None, progress: Progress | None = None,
              report_only: bool = False, sizes: Sizes | None = None,
              choice: CaseChoice = CaseChoice()) -> ReproRun:
    """Run every stage for every model, resuming finished ones; the records of every stage.

    ``sizes`` overrides the preset ``quick`` picks (``QUICK`` or ``FULL``); ``choice`` names
    the task families and the seed split of the edit, CoT and trace stages.

    ``load(model, device=..., dtype=...)`` makes an engine (default :func:`kvnotes.load`); it
    is only called for a model with a stage left to run. ``report_only`` runs nothing: only
    the finished stages are returned. Write the report with
    :func:`kvnotes.research.repro.report.write_report`.
    """
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise UnknownNameError("repro stage", unknown[0], STAGES)
    if not models:
        raise InvalidArgumentError("give at least one model (--models A,B)")
    if load is None:
        from kvnotes.core.models import load as load_model

        load = load_model
    settings = RunSettings(device=str(device), dtype=str(dtype).removeprefix("torch."),
                           quick=quick, sizes=sizes or (QUICK if quick else FULL), choice=choice)
    out = Path(out)
    per_model: dict[str, dict[str, StageRecord]] = {}
    for model in models:
        folder = out / slug(model)
        engine = None
        per_model[model] = {}
        for stage in stages:
            path = folder / f"{stage}.json"
            saved = _read_stage(path, stage, settings)
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
            result = _run_stage(stage, engine, settings, tick, folder)
            record = StageRecord(settings, time.perf_counter() - t0, before, load_now(), result,
                                 datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
            _write_json(path, record.to_dict())
            per_model[model][stage] = record
    return ReproRun(settings, per_model)


def _read_stage(path: Path, stage: str, settings: RunSettings) -> StageRecord | None:
    """A finished stage's record, or None when missing, unreadable or made with other settings."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("settings") != settings.to_dict():
            return None
        return StageRecord.from_dict(stage, data, settings)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(staged, path)
