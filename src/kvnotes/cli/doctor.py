"""``kvnotes doctor``: a model's position scheme and which notebook operations are exact.

Examples::

    kvnotes doctor                                 # the bundled models here, the CPU's dtype
    kvnotes doctor --model smollm2-135m            # a bundled alias, HF folder or .gguf file
    kvnotes doctor --tiny deepseek_v2 --check      # a tiny random model of an architecture
    kvnotes doctor --tiny gpt2 --json
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from kvnotes.cli.app import app, emit_json, fail
from kvnotes.cli.options import device_option, dtype_option, load_engine
from kvnotes.core.errors import KvnotesError
from kvnotes.core.positions.capabilities import Operation, ShiftCheck

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

console = Console()

_STYLE = {"exact": "green", "approximate": "yellow", "unsupported": "red"}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The doctor's findings for an engine: scheme, adapter summary, operations, live check."""

    model: str
    model_type: str | None
    scheme: str
    adapter: dict[str, object]  # the adapter's own describe(), as it reports itself
    layers: int
    max_positions: int | None
    operations: tuple[Operation, ...]
    check: ShiftCheck | None = None

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "model": self.model, "model_type": self.model_type, "scheme": self.scheme,
            "adapter": self.adapter, "layers": self.layers, "max_positions": self.max_positions,
            "operations": [op.to_dict() for op in self.operations]}
        if self.check is not None:
            d["check"] = self.check.to_dict()
        return d


def diagnose(engine: Engine, *, check: bool = False) -> Diagnosis:
    """What ``kvnotes doctor`` reports; ``check`` also prefills, shifts and measures the error."""
    from kvnotes.core.positions.capabilities import capabilities, check_shift

    adapter = engine.adapter
    shift = None
    if check:
        vocab = int(getattr(adapter.config, "vocab_size", 256) or 256)
        ids = [(17 * i + 3) % min(vocab, 256) for i in range(24)]
        shift = check_shift(engine, ids)
    return Diagnosis(
        model=engine.name, model_type=getattr(engine.model.config, "model_type", None),
        scheme=adapter.name, adapter=adapter.describe(), layers=adapter.num_layers,
        max_positions=adapter.max_positions, operations=tuple(capabilities(adapter)),
        check=shift)


def _tiny_engine(arch: str, device: str = "cpu", dtype: str = "float32") -> Engine:
    import torch

    import kvnotes
    from kvnotes.cli.options import checked
    from kvnotes.core.tiny import ByteTokenizer, tiny_model

    device, dtype = checked(device, dtype)
    model = tiny_model(arch, 256).to(device=device, dtype=getattr(torch, dtype))
    return kvnotes.Engine.from_model(model, ByteTokenizer(256), name=f"tiny-{arch}")


def _machine_report(as_json: bool) -> None:
    """The bundled models' state and the dtype this CPU runs best (``doctor`` alone)."""
    from kvnotes.cli.core import bundled_table
    from kvnotes.core.machine import cpu_flags, cpu_model, preferred_dtype
    from kvnotes.core.models import bundled_status, kvnotes_home

    dtype = str(preferred_dtype()).removeprefix("torch.")
    if as_json:
        emit_json({"cpu": cpu_model(), "cpu_flags": cpu_flags(), "preferred_dtype": dtype,
                   "home": str(kvnotes_home()), "models": [s.to_dict() for s in bundled_status()]})
        return
    console.print(f"CPU: {cpu_model() or 'unknown'}  flags: {' '.join(cpu_flags()) or '-'}")
    console.print(f"preferred dtype here: [bold]{dtype}[/bold]  models cached under {kvnotes_home()}")
    console.print(bundled_table())
    console.print("`kvnotes doctor --model M` prints a model's position scheme and exact operations.")


@app.command()
def doctor(
    model: str | None = typer.Option(None, help="model alias, local HF folder, .gguf file or hub id"),
    tiny: str | None = typer.Option(None, help="instead: a tiny random model of this architecture "
                                        "(model_type, e.g. llama, deepseek_v2, qwen2_vl, gpt2)"),
    check: bool = typer.Option(False, help="also prefill, shift by 37 and measure the error"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    device: str = device_option(),
    dtype: str = dtype_option(),
) -> None:
    """Print a model's position scheme and which operations are exact, approximate, unsupported."""

    if model is not None and tiny is not None:
        raise typer.BadParameter("pass at most one of --model or --tiny")
    if model is None and tiny is None:
        _machine_report(as_json)
        return
    try:
        if tiny is not None:
            try:
                engine = _tiny_engine(tiny, device, dtype)
            except ValueError as err:  # no tiny recipe for that name: the message lists them
                raise typer.BadParameter(str(err)) from err
        else:
            assert model is not None  # at most one of --model and --tiny, and not neither, checked above
            with console.status(f"loading {model}"):
                engine = load_engine(model, device, dtype)
        report = diagnose(engine, check=check)
    except KvnotesError as err:
        fail(err)
        return
    if as_json:
        emit_json(report.to_dict())
        return
    console.print(f"[bold]{report.model}[/bold]  model_type={report.model_type}  "
                  f"layers={report.layers}  max positions={report.max_positions}")
    console.print(f"position scheme: [bold]{report.scheme}[/bold]  "
                  + "  ".join(f"{k}={v}" for k, v in report.adapter.items()
                              if k not in ("scheme", "reason") and v is not None))
    table = Table(show_lines=False)
    table.add_column("operation")
    table.add_column("status")
    table.add_column("why", overflow="fold")
    for op in report.operations:
        style = _STYLE[op.status]
        table.add_row(op.name, f"[{style}]{op.status}[/{style}]", op.reason)
    console.print(table)
    c = report.check
    if c is None:
        return
    if c.error:
        console.print(f"check (shift by {c.delta}): raised {c.error}")
    else:
        console.print(f"check (shift by {c.delta}): max |KV error| {c.max_kv_error:.2e}, "
                      f"max |logit error| {c.max_logit_error:.2e}")
