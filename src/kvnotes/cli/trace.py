"""``kvnotes trace``: notes tracing over the edit suite, written up as report.md, JSON and PNGs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvnotes.cli.app import app, fail
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes.core.errors import KvnotesError
from kvnotes.ops.trace import TraceOptions
from kvnotes.research.trace.sensitivity import (
    CaseSensitivity,
    SensitivityResult,
    measure_sensitivity,
    sensitivity_markdown,
    sensitivity_table,
)
from kvnotes.research.trace.suite import CaseTrace, FamilySummary, pick_cases, summarize, trace_cases

if TYPE_CHECKING:
    from kvnotes.eval.tasks import EditCase


@app.command("trace")
def trace_command(
    model: str = typer.Option(..., "--model", "-m", help="Model alias, HF directory or GGUF file."),
    task: list[str] | None = typer.Option(None, "--task", "-t",
                                          help="Task family (repeatable); default: every family."),
    cases: int = typer.Option(4, "--cases", "-n", help="Cases per family (spread over the family)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default out/trace-MODEL)."),
    position_bins: int = typer.Option(8, help="Downstream position bins (0 = every token)."),
    grid_bins: int = typer.Option(4, help="Notes columns of the layer x position heatmap."),
    grid_layer_groups: int = typer.Option(6, help="Layer rows of the heatmap (0 = every layer)."),
    by_layer: bool = typer.Option(True, help="Per-layer field and notes effects."),
    min_denominator: float = typer.Option(1.0, help="|m_new - m_old| below this is insensitive."),
    detail_insensitive: bool = typer.Option(False, help="Full detail for insensitive cases too."),
    boot: int = typer.Option(2000, help="Bootstrap resamples for the confidence intervals."),
    batch_size: int = typer.Option(16, help="Hybrid notebooks per forward."),
    threads: int = typer.Option(0, help="torch CPU threads (0 = leave torch's default)."),
    device: str = device_option(),
    dtype: str = dtype_option(),
    sensitivity: bool = typer.Option(False, "--sensitivity",
                                     help="Only count, per family, the cases whose recompute "
                                          "decision the field changes (no patching); writes "
                                          "sensitivity.md and sensitivity.json."),
    split: str = typer.Option("heldout", "--split",
                              help="Seeds of the seeded families (routing): heldout or dev."),
) -> None:
    """Where does the decision live: the field's own KV or the notes after it? (causal patching)"""
    from kvnotes.eval.tasks import load_suite

    folder = out or Path("out") / f"trace-{model.replace('/', '_')}"
    if sensitivity:
        try:
            result = SensitivityCommand(ModelOptions(model, device, dtype, threads),
                                        tuple(load_suite(task or None, split)), cases, split,
                                        min_denominator, folder).run()
        except KvnotesError as err:
            fail(err)
        typer.echo(sensitivity_table(result))
        typer.echo(f"\nwrote {folder}/sensitivity.md", err=True)
        return
    try:
        command = TraceCommand(
            model=ModelOptions(model, device, dtype, threads),
            suite=tuple(load_suite(task or None, split)),
            per_family=cases, options=TraceOptions(
                by_layer=by_layer, position_bins=position_bins or None, grid_bins=grid_bins,
                grid_layer_groups=grid_layer_groups or None, min_denominator=min_denominator,
                detail_when_insensitive=detail_insensitive, batch_size=batch_size),
            out=folder, boot=boot)
        rows, pool = command.run()
    except KvnotesError as err:
        fail(err)
    typer.echo(summary_table(rows, pool))
    typer.echo(f"\nwrote {folder}/report.md", err=True)


@dataclass(frozen=True)
class SensitivityCommand:
    """What ``trace --sensitivity`` runs: ``per_family`` cases of each family of ``suite``
    (spread over it), each recomputed for its old and new value
    (:mod:`kvnotes.research.trace.sensitivity`)."""

    model: ModelOptions
    suite: tuple[EditCase, ...]
    per_family: int
    split: str
    min_denominator: float
    out: Path

    def run(self) -> SensitivityResult:
        from kvnotes.core.machine import load_note, machine_info
        from kvnotes.research.edit.cases import spread

        engine = self.model.load()
        cases = spread(self.suite, self.per_family)
        before = machine_info()
        t0 = time.perf_counter()

        def progress(c: CaseSensitivity) -> None:
            trace = "" if c.trace_delta is None else f" d={c.trace_delta:+.2f}"
            typer.echo(f"[{time.perf_counter() - t0:6.0f}s] {c.case_id}: {c.decision_old} -> "
                       f"{c.decision_new} delta={c.delta:+.2f}{trace}", err=True)

        result = measure_sensitivity(engine, cases, split=self.split,
                                     min_denominator=self.min_denominator, progress=progress)
        after = machine_info(before)
        machine = (f"Machine: CPU flags {' '.join(after['cpu_flags'])}; dtype "
                   f"{self.model.dtype}; {date.today().isoformat()}; load average (1 min) "
                   f"{before['load_average'][0]:.2f} before; after: {load_note(after)}.")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "sensitivity.json").write_text(json.dumps(
            {**result.to_dict(), "dtype": self.model.dtype,
             "machine": {k: after[k] for k in ("cpus", "torch_threads", "load_average", "busy",
                                               "cpu_flags")},
             "load_before": before["load_average"]}, indent=1) + "\n")
        (self.out / "sensitivity.md").write_text(sensitivity_markdown(
            result, command=" ".join(["kvnotes", *sys.argv[1:]]), machine=machine))
        return result


@dataclass(frozen=True)
class TraceCommand:
    """What ``trace`` runs: the model, the suite's cases (``per_family`` traced of each family,
    among those of equal token lengths), what is traced, the output folder, and the bootstrap
    resamples of the confidence intervals. Threads 0 leave torch's own setting."""

    model: ModelOptions
    suite: tuple[EditCase, ...]
    per_family: int
    options: TraceOptions
    out: Path
    boot: int = 2000

    def run(self) -> tuple[list[FamilySummary], dict[str, tuple[int, int]]]:
        """Trace the picked cases (each appended to ``cases.jsonl`` as it is done), write the
        report; returns the summary rows and the equal-length pool per family."""
        engine = self.model.load()
        families = list(dict.fromkeys(c.family for c in self.suite))
        picks = pick_cases(engine, self.suite, self.per_family)
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with (self.out / "cases.jsonl").open("w") as log:
            def progress(item: CaseTrace) -> None:
                log.write(json.dumps(item.to_dict()) + "\n")
                log.flush()
                r = item.result
                what = (f"d={r.denominator:+.2f} field={r.field_effect:+.3f} "
                        f"notes={r.notes_effect:+.3f}{'' if r.sensitive else ' (insensitive)'}"
                        if r else item.reason[:90])
                typer.echo(f"[{time.perf_counter() - t0:6.0f}s] {item.case_id}: {what}", err=True)

            traces = trace_cases(engine, list(picks.cases), self.options, progress=progress)
        min_denominator = self.options.min_denominator
        rows = summarize(traces, min_denominator=min_denominator, n_boot=self.boot,
                         families=families)
        write_report(self.out, engine.name, traces, rows, min_denominator, pool=picks.pool,
                     command=" ".join(["kvnotes", *sys.argv[1:]]),
                     seconds=time.perf_counter() - t0)
        return rows, picks.pool


def summary_table(rows: Sequence[FamilySummary],
                  pool: dict[str, tuple[int, int]] | None = None) -> str:
    """The markdown summary table: share of the decision carried by field KV vs notes.

    ``pool[family] = (equal-length cases, all cases)`` of the suite the traced cases came from.
    """
    pool = pool or {}
    lines = [
        "| family | equal-length pool | cases | sensitive | insensitive | skipped (length/other) | flips | "
        "median abs(d) | field KV (denoise) | notes (denoise) | field KV (noise) | "
        "notes (noise) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = pool.get(r.family)
        lines.append(
            f"| {r.family} | {f'{p[0]}/{p[1]}' if p else '-'} | {r.n_cases} | "
            f"{r.n_sensitive} | {r.n_insensitive} | "
            f"{r.n_skipped_length}/{r.n_skipped_other} | {r.n_flips} | "
            f"{r.median_abs_denominator:.2f} | {r.field} | {r.notes} | {r.noising_field} | "
            f"{r.noising_notes} |"
        )
    return "\n".join(lines)


def write_report(out: Path, model: str, traces: Sequence[CaseTrace],
                 rows: Sequence[FamilySummary], min_denominator: float, *, command: str = "",
                 seconds: float = 0.0, pool: dict[str, tuple[int, int]] | None = None) -> Path:
    """Write ``report.md``, ``summary.json``, ``cases.json`` and one heatmap PNG per family."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps([t.to_dict() for t in traces], indent=1))
    (out / "summary.json").write_text(json.dumps(
        {"model": model, "min_denominator": min_denominator, "pool": pool or {},
         "families": [r.to_dict() for r in rows]}, indent=1))
    pictures = [p for r in rows if r.family != "all" and (p := _heatmap(out, model, r))]
    md = [
        f"# Notes tracing: {model}", "",
        f"`{command}`" if command else "", f"({seconds:.0f} s)" if seconds else "", "",
        "Where does the field-conditioned decision live? m = logit(new answer's first token) - "
        "logit(old answer's first token) at the decision position (the query's last token; for "
        "chat models the assistant prefix). Effects are normalized by d = m_new - m_old: "
        "**denoise** = (m_patched - m_old)/d with the new KV patched into the old notebook at the "
        "sites (the share the sites *carry*); **noise** = (m_new - m_patched)/d with the old KV "
        "patched into the new notebook (the share *lost* when only the sites revert). "
        "Field KV = the field's own tokens, all layers (= an in-place overwrite); notes = every "
        "token after the field, all layers.", "",
        f"Means over *sensitive* cases (|d| >= {min_denominator:g} logit) with 95% percentile "
        "bootstrap CIs over cases; insensitive cases are counted but left out (their ratio is "
        "noise); skipped = old/new values of unequal token length, or answers sharing a first "
        "token. Equal-length pool = suite cases whose old and new values have the same number "
        "of tokens with this tokenizer (cases are picked, spread out, among those).", "",
        summary_table(rows, pool), "",
    ]
    if pictures:
        md += ["## Heatmaps (layer x position, mean over sensitive cases)", ""]
        md += [f"![{p.stem}]({p.name})" for p in pictures] + [""]
    md += ["## Cases", "", "| case | status | d | m_old | m_new | field | notes | top old/new |",
           "|---|---|---|---|---|---|---|---|"]
    for t in traces:
        r = t.result
        if r is None:
            md.append(f"| {t.case_id} | skipped: {t.reason[:60]} | | | | | | |")
            continue
        e = r.denoising
        md.append(f"| {t.case_id} | {'sensitive' if r.sensitive else 'insensitive'} | "
                  f"{r.denominator:+.2f} | {r.m_old:+.2f} | {r.m_new:+.2f} | "
                  f"{e.field if e else float('nan'):+.3f} | {e.notes if e else float('nan'):+.3f} "
                  f"| {r.top_old!r}/{r.top_new!r} |")
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


def _heatmap(out: Path, model: str, row: FamilySummary) -> Path | None:
    grids = [(name, g) for name, g in (("denoise", row.grid), ("noise", row.noising_grid)) if g]
    if not grids:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvnotes.ops.trace import _bins

    layers = len(row.field_by_layer)
    panels = len(grids) + bool(layers)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), squeeze=False)
    for ax, (name, g) in zip(axes[0], grids, strict=False):
        im = ax.imshow(g, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower")
        ax.set_xticks(range(len(g[0])),
                      ["field"] + [f"notes {i + 1}" for i in range(len(g[0]) - 1)],
                      rotation=45, ha="right", fontsize=7)
        if layers:
            ax.set_yticks(range(len(g)), [f"L{a}-{b - 1}" for a, b in _bins(0, layers, len(g))],
                          fontsize=7)
        ax.set_ylabel("layers")
        ax.set_title(f"{name}: {row.family} (n={row.n_sensitive})", fontsize=9)
        for (i, j), v in _cells(g):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046)
    if layers:
        ax = axes[0][-1]
        ax.plot(row.field_by_layer, marker=".", label="field KV, one layer")
        ax.plot(row.notes_by_layer, marker=".", label="notes, one layer")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel("layer")
        ax.set_ylabel("denoising effect")
        ax.set_title(f"per layer: {row.family}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{model}: normalized effect by layer x position (mean over sensitive cases)",
                 fontsize=9)
    fig.tight_layout()
    path = out / f"heatmap-{row.family}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cells(g: list[list[float]]) -> Iterator[tuple[tuple[int, int], float]]:
    for i, r in enumerate(g):
        for j, v in enumerate(r):
            if v == v:
                yield (i, j), v
