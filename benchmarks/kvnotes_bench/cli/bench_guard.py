"""``kvnotes-bench guard`` (the guard's calibration per model) and ``kvnotes-bench divergence``
(what limits 16-token greedy identity), on the development sets."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvnotes.cli.app import emit_json, folder_option
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes_bench.cli.app import invocation
from kvnotes_bench.cli.bench import bench_app

if TYPE_CHECKING:
    from kvnotes_bench.tools.guard_run import GuardBenchResult


def _settings(device: str, dtype: str) -> dict[str, object]:
    from kvnotes.core.machine import machine_info

    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": invocation(),
            "device": device, "dtype": dtype, "machine_at_start": machine_info()}


def _sets(text: str) -> tuple[str, ...]:
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes_bench.tools.data import check_set
    from kvnotes_bench.tools.guard_measure import GUARD_SETS

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    if not names:
        raise InvalidArgumentError(f"--set: give one or more of {', '.join(GUARD_SETS)}")
    for name in names:
        if name != "airline":
            check_set(name)  # a held-out BFCL category fails before the model loads
    return names


@bench_app.command("guard")
def guard(
    model: str = typer.Option(..., "--model", help="model alias, HF folder or .gguf file"),
    set_names: str = typer.Option("live_multiple,airline", "--set",
                                  help="development sets, comma-separated: live_multiple, "
                                       "multi_turn, airline (the front's airline prompts)"),
    cases: int = typer.Option(40, "--cases", help="requests per set (BFCL: spread over the "
                                                  "file, longer ones than --max-context left "
                                                  "out)"),
    strategy: str = typer.Option("epic:32", "--strategy",
                                 help="the composed strategy guarded (default: the default "
                                      "repair, each skill's first 32 tokens)"),
    budget: float = typer.Option(0.2, "--budget", help="the largest share of requests the "
                                                       "default may answer exactly"),
    max_context: int = typer.Option(2048, "--max-context"),
    divergence: str = typer.Option("", "--divergence", help="BFCL sets: also where 16 greedy "
                                   "tokens part from the exact prompt's, for --strategy and "
                                   "these composed strategies (comma-separated, e.g. "
                                   "pred+epic:32), with the one-skill recompute oracle"),
    part: str = typer.Option("0/1", "--part", help="I/N: every N-th request from the I-th (a "
                             "long calibration split into runs; `bench guard-report` pools "
                             "them)"),
    out: Path | None = typer.Option(None, "--out", help="folder for guard.json, guard.md, "
                                                 "guard.png (default: benchmarks/guard-<model>)"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    threads: int | None = typer.Option(None, "--threads"),
    as_json: bool = typer.Option(False, "--json", help="print the default chosen as JSON"),
) -> None:
    """The guard's calibration: per tau, fired share, identity with exact, cost; the default."""
    from kvnotes_bench.serving.prompt_sets import make_requests
    from kvnotes_bench.tools.guard_run import GuardBenchConfig, run_guard_bench

    config = GuardBenchConfig(sets=_sets(set_names), cases=cases, strategy=strategy,
                              max_context=max_context, budget=budget,
                              divergence=tuple(s.strip() for s in divergence.split(",")
                                               if s.strip()),
                              part=_part(part), settings=_settings(device, dtype))
    folder = folder_option(out or Path(f"benchmarks/guard-{Path(model).name}"), "--out")
    console = Console(stderr=True)
    engine = ModelOptions(model, device, dtype, threads or None).load()
    result = run_guard_bench(engine, config, model=model, airline=make_requests,
                             progress=lambda s: console.print(s, highlight=False))
    _write_guard(result, folder, console, as_json)


def _part(text: str) -> tuple[int, int]:
    from kvnotes.core.errors import InvalidArgumentError

    i, _, n = text.partition("/")
    try:
        return int(i), int(n)
    except ValueError as err:
        raise InvalidArgumentError(f"--part {text!r}: give I/N, e.g. 0/2") from err


def _write_guard(result: GuardBenchResult, folder: Path, console: Console, as_json: bool
                 ) -> None:
    from kvnotes_bench.tools.divergence import plot as divergence_plot
    from kvnotes_bench.tools.guard_run import markdown, plot

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "guard.json").write_text(json.dumps(result.to_dict(), indent=1, default=str)
                                       + "\n", encoding="utf-8")
    text = markdown(result)
    (folder / "guard.md").write_text(text, encoding="utf-8")
    plot(result, folder / "guard.png")
    for set_name, found in result.divergence.items():
        if found:
            divergence_plot(result.model, found, [r.strategy for r in found[0].reads],
                            folder / f"divergence-{set_name}.png")
    if as_json:
        emit_json(result.choice.to_dict())
    else:
        console.print(text, highlight=False)
        console.print(f"wrote {folder}/guard.json, guard.md, guard.png")


@bench_app.command("guard-report")
def guard_report(
    runs: list[Path] = typer.Argument(..., help="guard.json files (or their folders) of one "
                                                "model: pooled per set"),
    out: Path = typer.Option(..., "--out", help="folder for the pooled guard.json, .md, .png"),
    budget: float | None = typer.Option(None, "--budget", help="fire budget of the default "
                                                               "(default: the runs')"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Pool `bench guard` runs (parts, or sets measured apart): curves and default again."""
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes_bench.tools.guard_run import GuardBenchResult

    data = []
    for path in runs:
        file = path / "guard.json" if path.is_dir() else path
        if not file.is_file():
            raise InvalidArgumentError(f"{path}: no guard.json; give `bench guard` outputs")
        data.append(json.loads(file.read_text(encoding="utf-8")))
    result = GuardBenchResult.from_dicts(data, budget=budget)
    _write_guard(result, folder_option(out, "--out"), Console(stderr=True), as_json)


@bench_app.command("divergence")
def divergence(
    model: str = typer.Option(..., "--model", help="model alias, HF folder or .gguf file"),
    set_name: str = typer.Option("live_multiple", "--set", help="live_multiple or multi_turn"),
    cases: int = typer.Option(40, "--cases", help="cases spread over the set"),
    strategies: str = typer.Option("epic:32,pred+epic:32", "--strategies",
                                   help="composed strategies, comma-separated; the oracle "
                                        "runs on the first one"),
    no_oracle: bool = typer.Option(False, "--no-oracle", help="skip the per-skill recomputes"),
    max_context: int = typer.Option(2048, "--max-context"),
    out: Path | None = typer.Option(None, "--out", help="folder for divergence.json, .md, .png "
                                                 "(default: benchmarks/divergence-<model>)"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    threads: int | None = typer.Option(None, "--threads"),
) -> None:
    """16 greedy tokens composed vs exact: where they part, and which skill's splice did it."""
    from kvnotes_bench.tools.divergence import (
        DivergenceConfig,
        markdown,
        plot,
        run_divergence,
        summarize,
        summarize_oracle,
    )

    names = tuple(s.strip() for s in strategies.split(",") if s.strip())
    config = DivergenceConfig(set=_sets(set_name)[0], cases=cases, strategies=names,
                              oracle=not no_oracle, max_context=max_context,
                              settings=_settings(device, dtype))
    folder = folder_option(out or Path(f"benchmarks/divergence-{Path(model).name}"), "--out")
    console = Console(stderr=True)
    engine = ModelOptions(model, device, dtype, threads or None).load()
    found = run_divergence(engine, config, progress=lambda s: console.print(s, highlight=False))
    folder.mkdir(parents=True, exist_ok=True)
    data = {"model": model, "set": config.set, "strategies": list(names),
            "settings": config.settings,
            "summaries": [summarize(found, s).to_dict() for s in names],
            "oracle": summarize_oracle(found).to_dict(),
            "cases": [c.to_dict() for c in found]}
    (folder / "divergence.json").write_text(json.dumps(data, indent=1, default=str) + "\n",
                                            encoding="utf-8")
    text = markdown(model, found, names)
    (folder / "divergence.md").write_text(text, encoding="utf-8")
    plot(model, found, names, folder / "divergence.png")
    console.print(text, highlight=False)
    console.print(f"wrote {folder}/divergence.json, divergence.md, divergence.png")
