"""``kvnotes-bench tools|tools-report``: tool-choice fidelity on BFCL (public data)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvnotes.cli.app import emit_json, folder_option
from kvnotes.cli.options import ModelOptions, device_option, dtype_option
from kvnotes_bench.cli.app import app, invocation

if TYPE_CHECKING:  # the CLI starts fast: the benchmark is imported when a command runs
    from kvnotes.research.tool_runs import BenchResult, CaseResult
    from kvnotes_bench.tools import ToolsBenchConfig

bench_app = app  # the public-data benchmarks are the entry point's own commands


@bench_app.command("tools")
def tools(
    model: str = typer.Option(..., "--model", help="model alias, HF folder or .gguf file"),
    set_name: str = typer.Option("live_multiple", "--set",
                                 help="development set: live_multiple or multi_turn"),
    cases: int = typer.Option(40, "--cases", help="cases spread over the set (0: all)"),
    strategies: str | None = typer.Option(
        None, "--strategies", help="comma-separated: exact, default, library, splice, first:F, kvdev:F, "
                                   "epic:K, anchor, anchor+first:F, anchor+epic:K, pred, "
                                   "pred+epic:K, ape:T, ape:T+epic:K, "
                                   "guard:BASE[@TAU] (default: "
                                   "kvnotes_bench.tools.DEFAULT_STRATEGIES)"),
    greedy: int = typer.Option(0, "--greedy", help="also compare N greedy tokens after the "
                                                   "call opening (16 in the issue; costs a "
                                                   "decode per strategy and case)"),
    call_tokens: int = typer.Option(0, "--call-tokens", help="decode N greedy tokens (at "
                                    "least --greedy) and run BFCL's AST checker on the call "
                                    "each answer writes, where it parses (live_multiple)"),
    max_context: int | None = typer.Option(None, "--max-context",
                                           help="skip (and count) cases longer than this many tokens "
                                         "(default: the model's maximum positions)"),
    guard_target: float = typer.Option(1.0, "--guard-target",
                                       help="calibrated guards match exact on this share of "
                                            "the calibration half"),
    skill_opening: str = typer.Option(
        "", "--skill-opening", help="fixed text every skill starts with after its newline, in "
                                    "the exact and the composed prompt alike, e.g. "
                                    "'Function:\\n' (\\n and \\t are read as a newline and a "
                                    "tab; default: none)"),
    out: Path | None = typer.Option(None, "--out", help="folder for results.json, report.md, "
                                                 "identity.png (default: out/bench-tools-"
                                                 "<model>-<set>)"),
    data: Path | None = typer.Option(None, "--data", help="a folder in BFCL's data layout (default: "
                                                   "the installed bfcl-eval package's data)"),
    device: str = device_option(),
    dtype: str = dtype_option(),
    threads: int | None = typer.Option(None, "--threads", help="torch CPU threads (default: "
                                       "physical cores; 1 is faster on a crowded machine)"),
    as_json: bool = typer.Option(False, "--json", help="print the summaries as JSON"),
) -> None:
    """Tool choice after ``{"name": "`` with composed tool skills vs the exact prompt."""
    from kvnotes_bench.tools import DEFAULT_STRATEGIES, ToolsBenchConfig
    from kvnotes_bench.tools.data import check_set
    from kvnotes_bench.tools.report import render
    from kvnotes_bench.tools.strategies import parse_strategies

    chosen = tuple(s.strip() for s in strategies.split(",")) if strategies else DEFAULT_STRATEGIES
    check_set(set_name)  # a held-out or unknown set fails before the model loads
    parse_strategies(list(chosen))
    folder = folder_option(out or Path(f"out/bench-tools-{Path(model).name}-{set_name}"),
                           "--out")
    line = invocation()
    opening = skill_opening.replace("\\n", "\n").replace("\\t", "\t")
    config = ToolsBenchConfig(set=set_name, cases=cases, strategies=chosen, greedy_tokens=greedy,
                         call_tokens=call_tokens, max_context=max_context, guard_target=guard_target,
                         skill_opening=opening, data_root=data,
                         settings={"date": datetime.datetime.now(datetime.UTC).strftime(
                             "%Y-%m-%d %H:%M UTC"), "command": line, "device": device,
                             "dtype": dtype})
    console = Console(stderr=True)
    command = ToolsCommand(bench=config, model=ModelOptions(model, device, dtype, threads or None),
                           folder=folder, command=line)
    result, paths = command.run(console)
    if as_json:
        emit_json([s.to_dict() for s in result.summaries])
    else:
        console.print(render(result, line).split("## Flipped")[0])
        console.print(f"wrote {paths['report']}, {paths['json']}, {paths['plot']}")


@dataclass(frozen=True)
class ToolsCommand:
    """What ``bench tools`` runs: the benchmark's config, the model, the output folder and the
    command line the report quotes."""

    bench: ToolsBenchConfig
    model: ModelOptions
    folder: Path
    command: str

    def run(self, console: Console) -> tuple[BenchResult, dict[str, Path]]:
        """Run it with a progress bar on ``console``; every measured case is appended to
        ``cases.jsonl`` at once (``bench tools-report`` rebuilds a stopped run from it)."""
        from kvnotes_bench.tools import run_bench
        from kvnotes_bench.tools.report import write_outputs

        engine = self.model.load()
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / "cases.jsonl"  # a stopped run keeps what it measured
        partial.write_text("", encoding="utf-8")
        self._write_run_record(engine.adapter.max_positions)

        def keep(case: CaseResult) -> None:
            with partial.open("a", encoding="utf-8") as f:
                f.write(json.dumps(case.to_dict(), default=str) + "\n")

        set_name = self.bench.set
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as bars:
            task = bars.add_task(f"{set_name} cases", total=None)

            def progress(done: int, total: int, case_id: str) -> None:
                bars.update(task, completed=done, total=total,
                            description=f"{set_name} {case_id}".strip())

            result = run_bench(engine, self.bench, model=self.model.model, progress=progress,
                               on_case=keep)
        return result, write_outputs(result, self.folder, self.command)

    def _write_run_record(self, max_positions: int | None) -> None:
        """``run.json``: what ``bench tools-report`` needs besides the cases."""
        from kvnotes.core.machine import machine_info

        config = self.bench
        record = {"model": self.model.model, "set": config.set,
                  "strategies": list(config.strategies),
                  "settings": {**config.settings, "cases_asked": config.cases,
                               "greedy_tokens": config.greedy_tokens,
                               "call_tokens": config.call_tokens,
                               "guard_target": config.guard_target,
                               "skill_opening": config.skill_opening,
                               "context_limit": config.max_context or max_positions},
                  "machine_at_start": machine_info()}
        (self.folder / "run.json").write_text(json.dumps(record, indent=1, default=str) + "\n",
                                              encoding="utf-8")


@bench_app.command("tools-report")
def tools_report(
    folder: Path = typer.Argument(..., help="a `bench tools` output folder (run.json and "
                                            "cases.jsonl), e.g. of a stopped run"),
) -> None:
    """Rebuild report.md, results.json and identity.png from the cases a run measured."""
    from kvnotes.core.errors import InvalidArgumentError
    from kvnotes.research.tool_runs import CaseResult
    from kvnotes_bench.tools.report import write_outputs
    from kvnotes_bench.tools.runner import assemble, calibrate_tau
    from kvnotes_bench.tools.strategies import parse_strategies

    run_file, cases_file = folder / "run.json", folder / "cases.jsonl"
    if not run_file.is_file() or not cases_file.is_file():
        raise InvalidArgumentError(f"{folder} has no run.json and cases.jsonl; give the --out "
                                   "folder of a `kvnotes-bench tools` run")
    run = json.loads(run_file.read_text(encoding="utf-8"))
    results = [CaseResult.from_dict(json.loads(line))
               for line in cases_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    strategies = parse_strategies(run["strategies"])
    calibrated = [r for r in results if r.half == "calibrate"]
    target = float(run["settings"].get("guard_target", 1.0))
    taus = {s.name: calibrate_tau(calibrated, s.base, target)
            for s in strategies if s.kind == "guard" and s.tau is None}
    measured = sum(r.half == "evaluate" for r in results)
    settings = {**run["settings"], "rebuilt_from_cases": len(results),
                "evaluation_cases": measured}
    machine = dict(run["machine_at_start"])
    samples = folder / "load.jsonl"  # the load sampled while the run went, when it was
    if samples.is_file():
        machine["load_samples"] = [json.loads(line) for line in
                                   samples.read_text(encoding="utf-8").splitlines()
                                   if line.strip()]
    result = assemble(results, strategies, model=run["model"], set_name=run["set"], taus=taus,
                      machine=machine, settings=settings)
    paths = write_outputs(result, folder, str(run["settings"].get("command", "")))
    typer.echo(f"rebuilt from {len(results)} cases: {paths['report']}")
