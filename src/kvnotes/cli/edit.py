"""``kvnotes edit``: every edit strategy on the task suite, against recompute."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvnotes.cli.app import app, emit_json, fail, folder_option
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import InvalidArgumentError, KvnotesError

if TYPE_CHECKING:  # the CLI starts fast: the suite is imported when a command runs
    from kvnotes.core.engine import Engine
    from kvnotes.eval.tasks import EditCase
    from kvnotes.research.edit.results import CaseResult, SuiteResult, SuiteSettings

console = Console(stderr=True)


@app.command("edit")
def edit_eval(
    model: str = typer.Option(..., help="model alias, HF folder or .gguf file"),
    strategies: str | None = typer.Option(
        None, help="comma-separated: recompute, prefix, overwrite, erratum[:template], "
                   "repair:<attention|kv_deviation>:<k> (default: all, k in 8/32/96)"),
    cot: bool = typer.Option(False, "--cot", help="decide by greedy chain of thought"),
    budget: int = typer.Option(96, help="CoT token budget"),
    batch: bool = typer.Option(True, "--batch/--no-batch",
                               help="decode each case's chains of thought (every strategy) as "
                                    "one batch; --no-batch decodes them one by one"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    families: str | None = typer.Option(None, help="comma-separated task families (default: all)"),
    per_family: int = typer.Option(0, help="use N cases of each family, spread over its value "
                                           "pairs (0: all); cases run round-robin across "
                                           "families, so a run stopped early covers each"),
    erratum_wordings: bool = typer.Option(False, "--erratum-wordings",
                                          help="also measure the other erratum templates"),
    out: Path | None = typer.Option(None, help="folder for results.json, report.md, edit.png "
                                        "(default: out/edit-<model>[-cot])"),
    resume: bool = typer.Option(False, "--resume",
                                help="keep the cases already in OUT/results.json (a stopped "
                                     "run's checkpoint or a smaller run with the same "
                                     "settings) and run only the rest"),
    resume_from: list[Path] | None = typer.Option(
        None, "--resume-from", help="also keep the cases in this results.json (repeatable; "
                                    "same settings), e.g. to merge --shard runs"),
    shard: str | None = typer.Option(None, help="K/N: run only every N-th case starting at the K-th "
                                         "(1-based), to split a run over processes; merge "
                                         "the parts with --resume-from"),
    workers: int = typer.Option(1, "--workers", help="evaluate in N worker processes, each "
                                "with its own copy of the model and cores/N torch threads (unless "
                                "--threads), taking cases from one queue; timings are then not "
                                "quiet figures"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    threads: int | None = typer.Option(None, "--threads",
                                       help="torch CPU threads (default: physical cores)"),
) -> None:
    """Run the edit task suite: decision identity, flips, logit cosine/KL, compute, TTFT."""
    if workers < 1:
        raise typer.BadParameter(f"--workers must be at least 1, got {workers}")
    from kvnotes.research.edit.report import strategy_table
    from kvnotes.research.edit.results import SuiteSettings
    from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES, ERRATUM_WORDINGS

    chosen = [s.strip() for s in strategies.split(",") if s.strip()] if strategies else list(
        DEFAULT_STRATEGIES)
    if erratum_wordings:
        chosen += [w for w in ERRATUM_WORDINGS if w not in chosen]
    try:
        command = EditEvalCommand(
            settings=SuiteSettings(tuple(chosen), cot=cot, budget=budget, batch=batch),
            cases=_pick_cases(families, per_family, shard),
            model=ModelOptions(model, device, dtype, threads or None),
            folder=folder_option(out or Path("out") / f"edit-{Path(model).stem}{'-cot' if cot else ''}",
                                 "--out"),
            resume=resume, resume_from=tuple(resume_from or ()), workers=workers)
        result, paths = command.run()
    except KvnotesError as err:
        fail(err)
    if as_json:
        emit_json(result.to_dict(cases=False))
        return
    typer.echo("\n".join(strategy_table(result.per_strategy)))
    typer.echo(f"{result.n_cases} cases, {result.n_sensitive} sensitive; "
               f"wrote {paths['report']}, {paths['json']}, {paths['plot']}")


def _pick_cases(families: str | None, per_family: int, shard: str | None) -> tuple[EditCase, ...]:
    """The suite's cases of ``--families``, ``--per-family`` of each, of ``--shard``."""
    from kvnotes.eval.tasks import load_suite
    from kvnotes.research.edit.cases import spread, take_shard

    cases = load_suite([f.strip() for f in families.split(",")] if families else None)
    # round-robin across families either way, so a run stopped early covers every family
    cases = spread(cases, per_family or len(cases))
    return tuple(take_shard(cases, shard) if shard else cases)


@dataclass(frozen=True)
class EditEvalCommand:
    """What ``kvnotes edit`` runs: the suite's settings and cases, the model, the output folder,
    the earlier results kept (``resume``: the folder's own ``results.json`` too) and the worker
    processes."""

    settings: SuiteSettings
    cases: tuple[EditCase, ...]
    model: ModelOptions
    folder: Path
    resume: bool = False
    resume_from: tuple[Path, ...] = ()
    workers: int = 1

    def __post_init__(self) -> None:
        for source in self.resume_from:  # before the model loads: a typo costs nothing
            if not source.is_file():
                raise InvalidArgumentError(f"--resume-from {source}: no such file")

    @property
    def target(self) -> Path:
        """The results file the checkpoints rewrite."""
        return self.folder / "results.json"

    def run(self) -> tuple[SuiteResult, dict[str, Path]]:
        """Load the model, evaluate the cases not done yet, and write the bundle."""
        from kvnotes.core.models import load
        from kvnotes.research.edit.report import write_outputs
        from kvnotes.research.edit.suite import run_suite

        with console.status(f"loading {self.model.model}"):
            engine = self.model.load()
        done = self._earlier(engine)
        if done:
            kept = len({d.case_id for d in done} & {c.case_id for c in self.cases})
            console.print(f"resuming: {kept} of {len(self.cases)} cases taken from earlier "
                          "results")
        with console.status("evaluating") as status:
            def progress(i: int, n: int) -> None:
                status.update(f"case {i}/{n}")
                if not console.is_terminal:
                    console.print(f"case {i}/{n}")

            def checkpoint(part: SuiteResult) -> None:
                write_outputs(part, self.folder)

            m = self.model
            result = run_suite(engine, self.cases, self.settings, progress=progress, done=done,
                               checkpoint=checkpoint, workers=self.workers, threads=m.threads,
                               loader=partial(load, m.model, device=m.device, dtype=m.dtype))
        return result, write_outputs(result, self.folder)

    def _earlier(self, engine: Engine) -> list[CaseResult]:
        """The case results kept from ``resume_from`` (and the target, with ``resume``)."""
        from kvnotes.research.edit.checkpoint import load_results

        sources = [*self.resume_from, *([self.target] if self.resume else [])]
        done: list[CaseResult] = []
        for source in sources:
            found = load_results(source, engine, self.settings)
            if source.resolve() == self.target.resolve():
                # the checkpoints overwrite that file: never lose the cases measured there
                planned = {c.case_id for c in self.cases}
                dropped = [r.case_id for r in found if r.case_id not in planned]
                if dropped:
                    raise InvalidArgumentError(
                        f"{self.target} holds {len(dropped)} cases this run does not select "
                        f"(e.g. {dropped[0]}), which rewriting it would lose; write to another "
                        "--out and pass that file with --resume-from")
            done += found
        return done
