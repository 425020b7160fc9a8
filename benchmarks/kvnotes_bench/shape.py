"""The product's shape against the lean-product goals: lines in the wheel and in the bench
package, commands, ``serve``'s options, hand-written validators and untyped JSON in signatures.

Static: read from the source tree (``ast``) and from the typer apps, nothing runs a model.
``kvnotes-bench shape`` prints the table; ``tests/test_product_shape.py`` holds the goals that
are met and keeps the others from growing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import typer
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parents[2]
WHEEL = ROOT / "src" / "kvnotes"
BENCH = ROOT / "benchmarks" / "kvnotes_bench"
# a hand-written scalar reader (``_int(what, value)``): pydantic models read JSON instead
VALIDATOR = re.compile(r"^_(?:int|float|str|bool|list|ints|floats)$")
_MAPPINGS = r"(?:dict|Dict|Mapping|MutableMapping)"
UNTYPED_DICT = re.compile(rf"\b{_MAPPINGS}\[str, *(?:typing\.)?Any\]")


class Goal(BaseModel):
    """One measured figure beside its goal (``value <= limit`` meets it)."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: int
    limit: int

    @property
    def met(self) -> bool:
        return self.value <= self.limit


class Shape(BaseModel):
    """Every goal of the lean product, measured."""

    model_config = ConfigDict(frozen=True)

    goals: tuple[Goal, ...]
    untyped_signatures: tuple[str, ...]

    def goal(self, name: str) -> Goal:
        return next(g for g in self.goals if g.name == name)

    def table(self) -> str:
        rows = ["| figure | measured | goal | met |", "|---|---:|---:|---|"]
        rows += [f"| {g.name} | {g.value:,} | <= {g.limit:,} | {'yes' if g.met else 'no'} |"
                 for g in self.goals]
        return "\n".join(rows)


def python_lines(root: Path) -> int:
    """Lines of every ``.py`` file under ``root``."""
    return sum(len(p.read_text("utf-8").splitlines()) for p in root.rglob("*.py"))


def _functions(root: Path) -> list[tuple[Path, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((path, node))
    return found


def hand_written_validators(root: Path) -> list[str]:
    """``path:line name`` of each module-level scalar reader such as ``_int(what, value)``."""
    return [f"{p.relative_to(root.parent)}:{fn.lineno} {fn.name}" for p, fn in _functions(root)
            if VALIDATOR.match(fn.name) and fn.col_offset == 0]


def untyped_signatures(root: Path) -> list[str]:
    """``path:line name`` of each function taking or returning ``dict[str, Any]``."""
    out = []
    for path, fn in _functions(root):
        text = ast.unparse(fn.args) + " " + (ast.unparse(fn.returns) if fn.returns else "")
        if UNTYPED_DICT.search(text):
            out.append(f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name}")
    return out


def command_count(app: typer.Typer) -> int:
    """Top-level commands and command groups of a typer app."""
    group = typer.main.get_command(app)
    return len(getattr(group, "commands", {}))


def option_count(app: typer.Typer, name: str) -> int:
    """Options of one top-level command, ``--help`` and positional arguments left out."""
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return sum(1 for p in command.params if p.param_type_name == "option" and p.name != "help")


def measure() -> Shape:
    from kvnotes.cli import app

    untyped = untyped_signatures(WHEEL)
    goals = (
        Goal(name="lines in src/kvnotes", value=python_lines(WHEEL), limit=25_000),
        Goal(name="lines in the bench package", value=python_lines(BENCH), limit=6_000),
        Goal(name="kvnotes commands", value=command_count(app), limit=10),
        Goal(name="kvnotes serve options", value=option_count(app, "serve"), limit=15),
        Goal(name="hand-written validators", value=len(hand_written_validators(WHEEL)), limit=0),
        Goal(name="dict[str, Any] in src signatures", value=len(untyped), limit=0),
    )
    return Shape(goals=goals, untyped_signatures=tuple(untyped))


