"""``kvnotes repro``: the paper's claims beside our measurements (see :mod:`kvnotes.research.repro.run`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvnotes.cli.app import app, fail, folder_option
from kvnotes.cli.options import checked, device_option, dtype_option, load_engine
from kvnotes.core.errors import KvnotesError, UnknownNameError


@app.command("repro")
def repro(
    models: str | None = typer.Option(None, "--models",
                                      help="comma-separated models (default: the two bundled ones, "
                                    "with --quick sizes)"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    quick: bool | None = typer.Option(None, "--quick/--full",
                                      help="small suite sizes (default when --models is not given)"),
    stages: str | None = typer.Option(None, "--stages",
                                      help="comma-separated subset of compose,edit,edit_cot,trace,agent"),
    out: Path = typer.Option(Path("out/repro"), "--out",
                             help="folder for report.md, repro.json, repro.png and the "
                                  "per-stage checkpoints (a rerun resumes from them)"),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads"),
    report_only: bool = typer.Option(False, "--report-only",
                                     help="run nothing: rewrite the report from the finished "
                                          "stages in --out"),
    sizes: str | None = typer.Option(None, "--sizes",
                                     help="quick, full or claims (the claims on many cases of "
                                          "a few families: recompute/overwrite/erratum only); "
                                          "overrides --quick/--full"),
    families: str | None = typer.Option(None, "--families",
                                        help="comma-separated task families of the edit, CoT "
                                             "and trace stages (default: every family)"),
    split: str = typer.Option("heldout", "--split",
                              help="seeds of the seeded families (routing): heldout or dev"),
    cases: int | None = typer.Option(None, "--cases",
                                     help="cases per family in the edit, CoT and trace stages"),
) -> None:
    """Composition, edit (with and without CoT), trace and agent per model; one report with a
    table per claim of the paper: its figure, ours, and a verdict."""
    from kvnotes.research.repro.report import write_report
    from kvnotes.research.repro.run import (
        DEFAULT_MODELS,
        SIZES,
        STAGES,
        CaseChoice,
        run_repro,
        with_cases,
    )

    if threads:
        import torch

        torch.set_num_threads(threads)
    names = [m.strip() for m in models.split(",") if m.strip()] if models else list(DEFAULT_MODELS)
    chosen = [s.strip() for s in stages.split(",") if s.strip()] if stages else list(STAGES)
    quick = (models is None) if quick is None else quick
    try:
        if sizes is not None and sizes not in SIZES:
            raise UnknownNameError("repro size", sizes, SIZES)
        chosen_sizes = SIZES[sizes] if sizes else None
        if cases is not None:
            chosen_sizes = with_cases(chosen_sizes or SIZES["quick" if quick else "full"], cases)
        choice = CaseChoice(tuple(f.strip() for f in families.split(",") if f.strip())
                            if families else None, split)
        device, dtype = checked(device, dtype)
        folder_option(out, "--out")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, transient=False) as bars:
            tasks: dict[tuple[str, str], TaskID] = {}

            def progress(model: str, stage: str, done: int, total: int) -> None:
                key = (model, stage)
                if key not in tasks:
                    tasks[key] = bars.add_task(f"{model} {stage}", total=total)
                bars.update(tasks[key], completed=done, total=total)
                if not bars.console.is_terminal:
                    typer.echo(f"{model} {stage}: {done}/{total}", err=True)

            run = run_repro(names, out, device=device, dtype=dtype, quick=quick,
                            stages=chosen, load=load_engine, progress=progress,
                            report_only=report_only, sizes=chosen_sizes, choice=choice)
        paths = write_report(out, run, command=" ".join(["kvnotes", *sys.argv[1:]]))
    except KvnotesError as err:
        fail(err)
        return
    typer.echo(f"wrote {paths['report']}, {paths['json']}, {paths['plot']}")
