"""``kvnotes edit-eval``: every edit strategy on the task suite, against recompute."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kvnotes.cli.app import app, emit_json, fail
from kvnotes.cli.options import device_option, dtype_option, load_engine
from kvnotes.core.errors import InvalidArgumentError, KvnotesError

console = Console(stderr=True)


@app.command("edit-eval")
def edit_eval(
    model: str = typer.Option(..., help="model alias, HF folder or .gguf file"),
    strategies: str = typer.Option(
        None, help="comma-separated: recompute, prefix, overwrite, erratum[:template], "
                   "repair:<attention|kv_deviation>:<k> (default: all, k in 8/32/96)"),
    cot: bool = typer.Option(False, "--cot", help="decide by greedy chain of thought"),
    budget: int = typer.Option(96, help="CoT token budget"),
    batch: bool = typer.Option(True, "--batch/--no-batch",
                               help="decode each case's chains of thought (every strategy) as "
                                    "one batch; --no-batch decodes them one by one"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    families: str = typer.Option(None, help="comma-separated task families (default: all)"),
    per_family: int = typer.Option(0, help="use N cases of each family, spread over its value "
                                           "pairs (0: all); cases run round-robin across "
                                           "families, so a run stopped early covers each"),
    erratum_wordings: bool = typer.Option(False, "--erratum-wordings",
                                          help="also measure the other erratum templates"),
    out: Path = typer.Option(None, help="folder for results.json, report.md, edit.png "
                                        "(default: out/edit-eval-<model>[-cot])"),
    resume: bool = typer.Option(False, "--resume",
                                help="keep the cases already in OUT/results.json (a stopped "
                                     "run's checkpoint or a smaller run with the same "
                                     "settings) and run only the rest"),
    resume_from: list[Path] = typer.Option(
        None, "--resume-from", help="also keep the cases in this results.json (repeatable; "
                                    "same settings), e.g. to merge --shard runs"),
    shard: str = typer.Option(None, help="K/N: run only every N-th case starting at the K-th "
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
    from kvnotes.core.machine import set_threads

    if workers < 1:
        raise typer.BadParameter(f"--workers must be at least 1, got {workers}")
    set_threads(threads)
    from functools import partial

    from kvnotes.core.models import load
    from kvnotes.eval.edit_suite.cases import spread, take_shard
    from kvnotes.eval.edit_suite.checkpoint import load_results
    from kvnotes.eval.edit_suite.report import strategy_table, write_outputs
    from kvnotes.eval.edit_suite.results import SuiteResult, SuiteSettings
    from kvnotes.eval.edit_suite.strategies import DEFAULT_STRATEGIES, ERRATUM_WORDINGS
    from kvnotes.eval.edit_suite.suite import run_suite
    from kvnotes.eval.tasks import load_suite

    chosen = [s.strip() for s in strategies.split(",") if s.strip()] if strategies else list(
        DEFAULT_STRATEGIES)
    if erratum_wordings:
        chosen += [w for w in ERRATUM_WORDINGS if w not in chosen]
    folder = out or Path("out") / f"edit-eval-{Path(model).stem}{'-cot' if cot else ''}"
    try:
        settings = SuiteSettings(tuple(chosen), cot=cot, budget=budget, batch=batch)
        cases = load_suite([f.strip() for f in families.split(",")] if families else None)
        # round-robin across families either way, so a run stopped early covers every family
        cases = spread(cases, per_family or len(cases))
        if shard:
            cases = take_shard(cases, shard)
        sources = list(resume_from or [])
        for source in sources:  # before the model loads: a typo costs nothing
            if not source.is_file():
                raise InvalidArgumentError(f"--resume-from {source}: no such file")
        with console.status(f"loading {model}"):
            engine = load_engine(model, device, dtype)
        target = folder / "results.json"
        if resume:
            sources.append(target)
        done = []
        for source in sources:
            found = load_results(source, engine, settings)
            if source.resolve() == target.resolve():
                # the checkpoints overwrite that file: never lose the cases measured there
                planned = {c.case_id for c in cases}
                dropped = [r.case_id for r in found if r.case_id not in planned]
                if dropped:
                    raise InvalidArgumentError(
                        f"{target} holds {len(dropped)} cases this run does not select (e.g. "
                        f"{dropped[0]}), which rewriting it would lose; write to another --out "
                        "and pass that file with --resume-from")
            done += found
        if done:
            kept = len({d.case_id for d in done} & {c.case_id for c in cases})
            console.print(f"resuming: {kept} of {len(cases)} cases taken from earlier results")
        with console.status("evaluating") as status:
            def progress(i: int, n: int) -> None:
                status.update(f"case {i}/{n}")
                if not console.is_terminal:
                    console.print(f"case {i}/{n}")

            def checkpoint(part: SuiteResult) -> None:
                write_outputs(part, folder)

            result = run_suite(engine, cases, settings, progress=progress, done=done,
                               checkpoint=checkpoint,
                               workers=workers, threads=threads,
                               loader=partial(load, model, device=device, dtype=dtype))
    except KvnotesError as err:
        fail(err)
    paths = write_outputs(result, folder)
    if as_json:
        emit_json(result.to_dict(cases=False))
        return
    typer.echo("\n".join(strategy_table(result.per_strategy)))
    typer.echo(f"{result.n_cases} cases, {result.n_sensitive} sensitive; "
               f"wrote {paths['report']}, {paths['json']}, {paths['plot']}")
