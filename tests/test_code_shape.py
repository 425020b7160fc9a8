"""The code's shape: no module over 600 lines and no function over 80 anywhere in
``src/kvnotes`` (every subpackage, walked, so a new one is covered too), and no function of
``serving/`` whose signature passes JSON as an untyped dict (``dict[str, Any]``, a bare ``dict``
or ``Mapping``: :mod:`kvnotes.serving.json_types` has the JSON types). Read with ``ast``, so the
offenders are listed with their length or annotation. No two modules under ``serving/`` share a
file name, so a module's name alone says which one is meant."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvnotes"
# the subpackages the walk must reach (it covers any other too)
SUBPACKAGES = ("apps", "cli", "core", "eval", "ops", "research", "serving")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
TYPED_FOLDER = "serving"
_MAPPINGS = r"(?:dict|Dict|Mapping|MutableMapping)"
# an untyped JSON object: a mapping of str to Any, or a mapping with no type arguments
UNTYPED_DICT = re.compile(rf"\b{_MAPPINGS}\[str, *(?:typing\.)?Any\]|\b{_MAPPINGS}\b(?!\s*\[)")


def module_lengths(root: Path) -> dict[str, int]:
    """Lines of each module under ``root`` (relative path: count)."""
    return {str(p.relative_to(root.parent)): len(p.read_text("utf-8").splitlines())
            for p in sorted(root.rglob("*.py"))}


def functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method under ``tree`` with its qualified name (``A.f``, ``f.inner``)."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, Any]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    return visit(tree, "")


def function_lengths(path: Path, root: Path) -> dict[str, int]:
    """Lines of each function or method in ``path`` (``path:line qualified.name``: count, the
    path relative to ``root``'s parent), from its ``def`` line to its last (decorators
    not counted)."""
    where = path.relative_to(root.parent)
    return {f"{where}:{fn.lineno} {name}": (fn.end_lineno or fn.lineno) - fn.lineno + 1
            for name, fn in functions(ast.parse(path.read_text("utf-8")))}


def offenders(lengths: dict[str, int], limit: int) -> list[str]:
    return [f"{name}: {n} lines" for name, n in sorted(lengths.items()) if n > limit]


def test_no_module_over_the_limit() -> None:
    long = offenders(module_lengths(PACKAGE), MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them):\n" + "\n".join(long)


def test_no_function_over_the_limit() -> None:
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lengths.update(function_lengths(path, PACKAGE))
    long = offenders(lengths, MAX_FUNCTION_LINES)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them):\n"
                      + "\n".join(long))


def test_the_walk_covers_the_whole_package() -> None:
    walked = {Path(name).parts[1] for name in module_lengths(PACKAGE)}
    assert {"__init__.py", *SUBPACKAGES} <= walked, sorted(walked)


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


def untyped_dicts(path: Path, root: Path) -> list[str]:
    """Every annotation of a function's or method's parameters and return in ``path`` that
    :data:`UNTYPED_DICT` matches (``path:line qualified.name: annotation``, the path relative to
    ``root``'s parent)."""
    where = path.relative_to(root.parent)
    out: list[str] = []
    for name, fn in functions(ast.parse(path.read_text("utf-8"))):
        a = fn.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
        notes = [p.annotation for p in params if p is not None and p.annotation]
        notes += [fn.returns] if fn.returns is not None else []
        out += [f"{where}:{note.lineno} {name}: {ast.unparse(note)}" for note in notes
                if UNTYPED_DICT.search(ast.unparse(note))]
    return out


def test_no_untyped_json_in_signatures() -> None:
    found: list[str] = []
    for path in sorted((PACKAGE / TYPED_FOLDER).rglob("*.py")):
        found += untyped_dicts(path, PACKAGE)
    assert not found, ("signatures with an untyped dict (use kvnotes.serving.json_types or a "
                       "dataclass):\n" + "\n".join(found))


def test_the_untyped_dict_check_finds_offenders(tmp_path: Path) -> None:
    source = tmp_path / "pkg" / "json.py"
    source.parent.mkdir()
    source.write_text(
        "from typing import Any, Mapping\n\n"
        "def ok(a: dict[str, int], b: Mapping[str, object], c: 'JsonObject') -> list[Any]:\n"
        "    return []\n\n"
        "class A:\n"
        "    def f(self, a: dict[str, Any], *, b: Mapping | None = None) -> dict:\n"
        "        return {}\n\n"
        "async def g(**kw: 'typing.Mapping[str, typing.Any]') -> tuple[Dict[str, Any], int]:\n"
        "    return {}, 0\n", "utf-8")
    assert untyped_dicts(source, source.parent) == [
        "pkg/json.py:7 A.f: dict[str, Any]", "pkg/json.py:7 A.f: Mapping | None",
        "pkg/json.py:7 A.f: dict", "pkg/json.py:10 g: 'typing.Mapping[str, typing.Any]'",
        "pkg/json.py:10 g: tuple[Dict[str, Any], int]"]


def shared_file_names(folder: Path) -> dict[str, list[str]]:
    """The module file names (``__init__.py`` aside) found in more than one folder under
    ``folder``, each with the paths that hold it."""
    holders: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(folder.rglob("*.py")):
        if path.name != "__init__.py":
            holders[path.name].append(path.relative_to(folder).as_posix())
    return {name: paths for name, paths in holders.items() if len(paths) > 1}


def test_no_two_serving_modules_share_a_file_name() -> None:
    shared = shared_file_names(PACKAGE / TYPED_FOLDER)
    assert not shared, ("modules under serving/ with the same file name (name each for what it "
                        "holds):\n" + "\n".join(f"{n}: {p}" for n, p in shared.items()))


def test_the_shared_name_check_finds_offenders(tmp_path: Path) -> None:
    for rel in ("a/bounds.py", "b/bounds.py", "a/__init__.py", "b/__init__.py", "c.py"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("", "utf-8")
    assert shared_file_names(tmp_path) == {"bounds.py": ["a/bounds.py", "b/bounds.py"]}
