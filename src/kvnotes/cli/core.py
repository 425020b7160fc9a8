"""Foundation commands: ``demo``, ``compose`` and ``models``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvnotes.cli.app import app, emit_json, fail, folder_option, read_text_file
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import KvnotesError

if TYPE_CHECKING:
    from kvnotes.core.compose import Part
    from kvnotes.core.notebook import Notebook

console = Console(width=150)

models_app = typer.Typer(help="Bundled models: list them, or convert them ahead of first use.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


def bundled_table() -> Table:
    """The bundled aliases with their state on this machine (``models list``, ``doctor``)."""
    from kvnotes.core.models import bundled_status

    table = Table(title="bundled models")
    for col in ("alias", "installed", "converted", "model"):
        table.add_column(col, overflow="fold")
    for st in bundled_status():
        installed = "yes" if st.installed else f"no: make {st.make_target}"
        table.add_row(st.alias, installed, "yes" if st.converted else "no (on first load)",
                      st.description)
    return table


@models_app.command("list")
def models_list(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List the bundled model aliases: installed here, converted, what they are."""
    from kvnotes.core.models import bundled_status

    if as_json:
        emit_json([st.to_dict() for st in bundled_status()])
        return
    console.print(bundled_table())


@models_app.command("prepare")
def models_prepare(alias: list[str] | None = typer.Argument(
        None, help="aliases (default: every bundled model whose packages are installed)")) -> None:
    """Assemble and convert bundled models to cached safetensors copies (first load does this too)."""
    from kvnotes.core.models import BUNDLED, resolve

    names = alias or [a for a, m in BUNDLED.items() if m.installed()]
    if not names:
        fail(KvnotesError("no bundled model is installed: run `make models`"))
    try:
        for name in names:
            console.print(f"{name}: {resolve(name)}")
    except KvnotesError as err:
        fail(err)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", help="model alias, HF folder or .gguf file"),
    out: Path = typer.Option(Path("out/demo"), help="folder for report.md, results.json, PNGs"),
    max_new_tokens: int = typer.Option(24, help="greedy tokens compared per case"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    threads: int | None = typer.Option(None, "--threads",
                                       help="torch CPU threads (default: physical cores)"),
) -> None:
    """Compile skills once, splice them into several contexts, compare with full recompute."""
    from kvnotes.apps.demo import run_compose_demo, write_report
    from kvnotes.research.edit.demo import edit_section

    try:
        folder_option(out, "--out")
        with console.status(f"loading {model}"):
            engine = ModelOptions(model, device, dtype, threads or None).load()
        console.print(f"[bold]{engine}[/bold]  position scheme: {engine.adapter.describe()}")
        with console.status("compiling skills and composing contexts") as status:
            result = run_compose_demo(engine, max_new_tokens=max_new_tokens,
                                      progress=lambda n: status.update(f"done: {n}"))
    except KvnotesError as err:
        fail(err)
    table = Table(title=f"compose vs full recompute ({engine.name})")
    for col in ("case", "tokens", "reused", "computed", "TTFT full", "TTFT compose", "speedup",
                "logit cos", "KL", "top-1", "continuation"):
        table.add_column(col, justify="right" if col not in ("case",) else "left")
    for c in result.cases:
        r = c.fidelity
        table.add_row(c.case, str(r.tokens_total), str(r.tokens_reused),
                      str(r.tokens_computed), f"{r.ttft_recompute_s * 1e3:.0f} ms",
                      f"{r.ttft_compose_s * 1e3:.0f} ms", f"{r.speedup:.1f}x",
                      f"{r.logit_cosine:.4f}", f"{r.kl:.4f}",
                      "same" if r.top1_agree else "DIFF",
                      "identical" if r.continuation_identical else "differs")
    console.print(table)
    path = write_report(result, out, edit_section(engine, console))
    console.print(f"wrote {path} and {out / 'compose.png'}")


@app.command()
def compose(
    model: str = typer.Option(..., help="model alias, HF folder or .gguf file"),
    skill: list[Path] = typer.Option(..., help="skill text file(s), spliced in order"),
    context: str = typer.Option(..., help="context text, prefilled after the skills"),
    query: str = typer.Option(..., help="question fed on top of the composed notes"),
    max_new_tokens: int = typer.Option(24),
    device: str = device_option(),
    dtype: str = dtype_option(),
    library: Path | None = typer.Option(None, help="skill library folder (compile once, reuse)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    threads: int | None = typer.Option(None, "--threads",
                                       help="torch CPU threads (default: physical cores)"),
) -> None:
    """Compose one case (skills + context), answer the query, compare with full recompute."""
    import kvnotes
    from kvnotes.core.chat import chat_frame

    try:
        engine = ModelOptions(model, device, dtype, threads or None).load()
        lib = kvnotes.SkillLibrary(folder_option(library, "--library"), engine) if library else None
        compiled: list[Notebook] = []
        for f in skill:
            if not f.is_file():
                raise KvnotesError(f"no skill file at {f}")
            text = read_text_file(f, "--skill")
            compiled.append(lib.get(text, name=f.stem) if lib is not None
                            else engine.compile(text, name=f.stem))
        head, middle, tail = chat_frame(engine.tokenizer)
        parts: list[Part] = [head] if head else []
        for i, s in enumerate(compiled):
            parts.extend(["\n\n", s] if i else [s])
        parts.append(middle + context)
        report = kvnotes.fidelity(engine, parts, "\n\n" + query + tail,
                                  max_new_tokens=max_new_tokens)
    except KvnotesError as err:
        fail(err)
    if as_json:
        emit_json(report.to_dict())
        return
    for key, value in report.to_dict().items():
        console.print(f"{key:>24}: {value}")
