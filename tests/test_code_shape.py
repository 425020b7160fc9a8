"""The code's shape: no module over 600 lines and no function over 80 in ``serving/`` and
``cli/`` (issue 47's goal). Read with ``ast``, so the offenders are listed with their length."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvnotes"
FOLDERS = ("serving", "cli")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def module_lengths(root: Path) -> dict[str, int]:
    """Lines of each module under ``root`` (relative path: count)."""
    return {str(p.relative_to(root.parent)): len(p.read_text("utf-8").splitlines())
            for p in sorted(root.rglob("*.py"))}


def function_lengths(path: Path, root: Path) -> dict[str, int]:
    """Lines of each function or method in ``path`` (``path:line qualified.name``: count, the
    path relative to ``root``'s parent), from its ``def`` line to its last (decorators
    not counted)."""
    tree = ast.parse(path.read_text("utf-8"))
    where = path.relative_to(root.parent)
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{where}:{child.lineno} {prefix}{child.name}"] = (
                    (child.end_lineno or child.lineno) - child.lineno + 1)
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def offenders(lengths: dict[str, int], limit: int) -> list[str]:
    return [f"{name}: {n} lines" for name, n in sorted(lengths.items()) if n > limit]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_over_the_limit(folder: str) -> None:
    long = offenders(module_lengths(PACKAGE / folder), MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(long)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_function_over_the_limit(folder: str) -> None:
    lengths: dict[str, int] = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        lengths.update(function_lengths(path, PACKAGE))
    long = offenders(lengths, MAX_FUNCTION_LINES)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them):\n"
                      + "\n".join(long))


def test_the_checks_find_offenders(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "pkg" / "long.py"
    source.parent.mkdir()
    source.write_text(f"def short():\n    return 1\n\n\nclass A:\n    @staticmethod\n"
                      f"    def long():\n{body}\n", "utf-8")
    found = offenders(function_lengths(source, source.parent), MAX_FUNCTION_LINES)
    assert found == [f"pkg/long.py:7 A.long: {MAX_FUNCTION_LINES + 1} lines"]
    assert offenders(module_lengths(source.parent), 10) == [
        f"pkg/long.py: {MAX_FUNCTION_LINES + 7} lines"]
