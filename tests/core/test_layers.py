"""The package's import graph: one direction of dependency, no cycles.

Layers, lowest first: core (errors <- positions <- document/notebook <- engine <- models) <- ops
<- eval <- apps <- cli. The graph is read from the source with ``ast`` (function-level imports
included; ``if TYPE_CHECKING:`` blocks, which never run, are left out), so a lazy import cannot
hide an upward dependency or a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "kvnotes"

# rank of a module: it may import modules of the same or a lower rank only
CORE_RANKS = {
    "kvnotes.core.errors": 0,
    "kvnotes.core.positions": 1,
    "kvnotes.core.fingerprint": 1,
    "kvnotes.core.validate": 1,
    "kvnotes.core.metrics": 1,
    "kvnotes.core.work": 1,
    "kvnotes.core.document": 2,
    "kvnotes.core.chat": 2,
    "kvnotes.core.files": 2,
    "kvnotes.core.notebook": 3,
    "kvnotes.core.cache": 3,
    "kvnotes.core.attention": 3,
    "kvnotes.core.engine": 4,
    "kvnotes.core.models": 5,
    "kvnotes.core.tiny": 5,
}
LAYER_RANKS = {"kvnotes.core": 10, "kvnotes.ops": 20, "kvnotes.eval": 30, "kvnotes.serving": 35,
               "kvnotes.apps": 40, "kvnotes.bench": 42, "kvnotes.cli": 50}
FACADE = "kvnotes"  # the package root re-exports the public API: above apps, below cli


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rank(module: str) -> int:
    if module == FACADE:
        return 46
    for prefix in sorted(CORE_RANKS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return CORE_RANKS[prefix]
    for prefix, r in LAYER_RANKS.items():
        if module == prefix or module.startswith(prefix + "."):
            return r
    raise AssertionError(f"{module} is in no layer; add it to tests/test_layers.py")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(imported kvnotes module, line) for every import that runs, at any depth."""
    tree = ast.parse(path.read_text("utf-8"))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("kvnotes") and (m := resolve(alias.name)):
                        found.append((m, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if not base.startswith("kvnotes"):
                    continue
                for alias in child.names:  # `from pkg import submodule` names the submodule
                    full = f"{base}.{alias.name}"
                    m = full if full in modules else resolve(base)
                    if m:
                        found.append((m, child.lineno))
            visit(child)

    visit(tree)
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def test_every_module_has_a_layer():
    for module in graph():
        rank(module)


def test_imports_point_down():
    bad = []
    for module, deps in graph().items():
        for dep, line in deps:
            if rank(dep) > rank(module):
                bad.append(f"{module}:{line} imports {dep} (a higher layer)")
    assert not bad, "\n".join(bad)


def test_no_module_imports_its_own_package_init():
    bad = []
    for module, deps in graph().items():
        package = module.rpartition(".")[0]
        if not package or module in (FACADE,):
            continue
        if (PACKAGE.parent / Path(*module.split("."))).is_dir():
            continue  # a package's own __init__
        for dep, line in deps:
            if dep == package and package != FACADE:
                bad.append(f"{module}:{line} imports from its own package {package}")
    assert not bad, "\n".join(bad)


def test_no_cycles():
    g = {m: {d for d, _ in deps if d != m} for m, deps in graph().items()}
    # a package imports its own submodules to re-export them; a cycle needs an edge back
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, expected", [
    ("from kvnotes.ops.edit import edit\n", "kvnotes.ops.edit"),
    ("def f():\n    from kvnotes.apps.demo import demo_data\n", "kvnotes.apps.demo"),
])
def test_reader_sees_function_level_imports(tmp_path, source, expected):
    f = tmp_path / "kvnotes" / "core" / "x.py"
    f.parent.mkdir(parents=True)
    f.write_text(source)
    global SRC
    old, SRC = SRC, tmp_path
    try:
        found = imports_of(f, {"kvnotes.core.x", expected})
    finally:
        SRC = old
    assert [m for m, _ in found] == [expected]
