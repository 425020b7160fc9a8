"""The package's import graph: one direction of dependency, no cycles, a light connector.

Layers, lowest first: core (errors <- positions/repair <- document/storage <- notebook/cache <-
runner <- batch/compose <- engine <- models) <- ops <- eval <- serving <- apps <- research <- cli.
The graph is read from the source with ``ast`` (function-level imports included, so a lazy
import cannot hide an upward dependency or a cycle). ``if TYPE_CHECKING:`` blocks never run: the
direction and whole-graph checks leave them out, the in-package circle check counts them (no
package imports itself in a circle, not even for type hints). The connector's import closure
(what vLLM's process loads) is followed through every import that runs, third-party roots
included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "kvnotes"

# rank of a module: it may import modules of the same or a lower rank only
CORE_RANKS = {
    "kvnotes.core.errors": 0,
    "kvnotes.core.sizes": 1,  # over errors
    "kvnotes.core.jsontext": 0,
    "kvnotes.core.records": 0,  # pydantic JSON records, nothing of kvnotes
    "kvnotes.core.positions": 1,
    "kvnotes.core.fingerprint": 1,
    "kvnotes.core.validate": 1,
    "kvnotes.core.metrics": 1,
    "kvnotes.core.work": 1,
    "kvnotes.core.repair": 1,
    "kvnotes.core.repair_plan": 1,
    "kvnotes.core.variants": 1,
    "kvnotes.core.model_defaults": 2,  # a table over repair's Repair
    "kvnotes.core.document": 2,
    "kvnotes.core.meta": 1,  # types over records' JSON
    "kvnotes.core.chat": 2,
    "kvnotes.core.files": 2,
    "kvnotes.core.storage": 2,
    "kvnotes.core.split_gguf": 3,  # over files
    "kvnotes.core.notebook": 3,
    "kvnotes.core.cache": 3,
    "kvnotes.core.attention": 3,
    "kvnotes.core.runner": 4,
    "kvnotes.core.batch": 5,
    "kvnotes.core.compose": 5,
    "kvnotes.core.engine": 6,
    "kvnotes.core.models": 7,
    "kvnotes.core.tiny": 7,
}
LAYER_RANKS = {"kvnotes.core": 10, "kvnotes.ops": 20, "kvnotes.eval": 30, "kvnotes.serving": 35,
               "kvnotes.apps": 40, "kvnotes.research": 42, "kvnotes.cli": 50}
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


def imports_of(path: Path, modules: set[str], *, type_checking: bool = False,
               third_party: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import that runs, at any depth: kvnotes modules, and
    with ``third_party`` the top-level name of every other import too (``transformers``);
    ``type_checking`` adds the imports of ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text("utf-8"))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def other(name: str, line: int) -> None:
        if third_party and name:
            found.append((name.split(".")[0], line))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if not alias.name.startswith("kvnotes"):
                        other(alias.name, child.lineno)
                    elif m := resolve(alias.name):
                        found.append((m, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if not base.startswith("kvnotes"):
                    other(base, child.lineno)
                    continue
                for alias in child.names:  # `from pkg import submodule` names the submodule
                    full = f"{base}.{alias.name}"
                    m = full if full in modules else resolve(base)
                    if m:
                        found.append((m, child.lineno))
            visit(child)

    visit(tree)
    return found


def graph(*, type_checking: bool = False, third_party: bool = False
          ) -> dict[str, list[tuple[str, int]]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules, type_checking=type_checking,
                                       third_party=third_party) for f in files}


def cycles_of(g: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk of ``g`` meets, as ``a -> b -> a``."""
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
    return cycles


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


def test_no_module_imports_names_from_a_package_it_is_inside():
    """``from kvnotes.cli import skills`` inside ``kvnotes.cli.skills_store`` reads the package
    while its ``__init__`` may still be running (it imports skills_store): a circle through the
    package, whichever name is taken. A module imports its siblings by their full name."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        if path.name == "__init__.py":
            continue  # a package's own __init__ imports its children to register or re-export them
        ancestors = {".".join(me.split(".")[:i]) for i in range(2, len(me.split(".")))}
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in ancestors:
                bad.append(f"{me}:{node.lineno} imports from {node.module}, a package it is in")
    assert not bad, "\n".join(bad)


def test_no_cycles_not_even_through_type_hints():
    g = {m: {d for d, _ in deps if d != m} for m, deps in graph(type_checking=True).items()}
    cycles = cycles_of(g)
    assert not cycles, "import cycles (type-only edges included):\n" + "\n".join(cycles)


def test_no_cycles():
    # a package imports its own submodules to re-export them; a cycle needs an edge back
    g = {m: {d for d, _ in deps if d != m} for m, deps in graph().items()}
    cycles = cycles_of(g)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def package_graphs(deps: dict[str, list[tuple[str, int]]]) -> dict[str, dict[str, set[str]]]:
    """For each package, the graph of its direct children (a subpackage counts as one node):
    an edge when any module inside one imports any module inside another. The package's own
    ``__init__`` is left out (it re-exports its children)."""
    packages = {m for m in deps if (PACKAGE.parent / Path(*m.split("."))).is_dir()}
    out: dict[str, dict[str, set[str]]] = {}
    for package in packages:
        prefix = package + "."

        def child(module: str, prefix: str = prefix) -> str:
            return prefix + module[len(prefix):].split(".")[0]

        g: dict[str, set[str]] = {}
        for module, imported in deps.items():
            if not module.startswith(prefix):
                continue
            node = g.setdefault(child(module), set())
            node.update(child(d) for d, _ in imported
                        if d.startswith(prefix) and child(d) != child(module))
        out[package] = g
    return out


def test_no_package_imports_itself_in_a_circle_not_even_for_type_hints():
    cycles = [f"in {package}: {c}"
              for package, g in sorted(package_graphs(graph(type_checking=True)).items())
              for c in cycles_of(g)]
    assert not cycles, "circles inside a package:\n" + "\n".join(cycles)


def test_package_graphs_see_a_type_only_circle():
    deps = {"kvnotes.core.a": [("kvnotes.core.b", 1)], "kvnotes.core.b": [("kvnotes.core.a", 3)],
            "kvnotes.core": []}
    assert cycles_of(package_graphs(deps)["kvnotes.core"]) == [
        "kvnotes.core.a -> kvnotes.core.b -> kvnotes.core.a"]


def import_closure(start: str) -> tuple[dict[str, str | None], dict[str, str]]:
    """What importing ``start`` runs: every kvnotes module reached (with the module that
    imported it first; importing a module runs its packages' ``__init__`` too) and every
    third-party root (with the kvnotes module that imports it)."""
    deps = graph(third_party=True)
    seen: dict[str, str | None] = {start: None}
    roots: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        for dep in [*parents, *(d for d, _ in deps[module])]:
            if dep in deps:
                if dep not in seen:
                    seen[dep] = module
                    queue.append(dep)
            else:
                roots.setdefault(dep, module)
    return seen, roots


def _path(seen: dict[str, str | None], module: str | None) -> str:
    chain = []
    while module is not None:
        chain.append(module)
        module = seen[module]
    return " <- ".join(chain)


CONNECTOR = "kvnotes.serving.vllm.connector"


def test_the_connector_imports_no_engine_and_no_transformers():
    seen, roots = import_closure(CONNECTOR)
    assert "kvnotes.core.engine" not in seen, (
        "the connector's imports reach the engine: " + _path(seen, "kvnotes.core.engine"))
    assert "transformers" not in roots, (
        "the connector's imports reach transformers: transformers <- "
        + _path(seen, roots["transformers"]))
    assert {"torch", "vllm"} <= set(roots)  # the reader sees third-party imports


# what the code under serving/vllm/ (vLLM's process) may import from kvnotes: the folder rule
IN_VLLM = "kvnotes.serving.vllm"
IN_VLLM_MAY_IMPORT = ("kvnotes.serving.vllm", "kvnotes.serving.library", "kvnotes.serving.planning",
                      "kvnotes.serving.protocol",  # the wire contract: pure, light
                      "kvnotes.serving.json_types",  # types only: nothing runs
                      "kvnotes.core.errors", "kvnotes.core.fingerprint", "kvnotes.core.files",
                      "kvnotes.core.positions", "kvnotes.core.document", "kvnotes.core.repair",
                      "kvnotes.core.jsontext", "kvnotes.core.variants",
                      "kvnotes.core.meta", "kvnotes.core.records")  # types, pydantic only


def test_code_that_runs_inside_vllm_imports_only_the_serving_library_and_light_core():
    deps = graph(third_party=True)
    for module in (m for m in deps if m == IN_VLLM or m.startswith(IN_VLLM + ".")):
        seen, _ = import_closure(module)
        outside = sorted(m for m in seen if m.startswith("kvnotes.") and m.count(".") >= 2
                         and not m.startswith(IN_VLLM_MAY_IMPORT))
        assert not outside, f"{module} reaches {outside[0]}: {_path(seen, outside[0])}"
    for folder in ("kvnotes.serving.library", "kvnotes.serving.planning"):
        for module in (m for m in deps if m.startswith(folder + ".")):
            assert not any(d.startswith(IN_VLLM) for d, _ in deps[module]), (
                f"{module} imports vLLM-side code: serving/vllm/ sits above library/ and planning/")


def test_the_serving_product_loads_without_the_engine_at_run_time():
    # the connector itself needs vllm; what it imports from kvnotes is these two
    code = ("import sys, kvnotes.serving.library.piece_store, kvnotes.serving.library.splice\n"
            "print(sorted(m for m in sys.modules if m == 'transformers' "
            "or m.startswith('transformers.') or m == 'kvnotes.core.engine'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=SRC.parent)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_package_root_imports_its_names_on_first_use():
    code = ("import sys, kvnotes\n"
            "print('kvnotes.core.engine' in sys.modules, 'transformers' in sys.modules)\n"
            "kvnotes.Engine\n"
            "print('kvnotes.core.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=SRC.parent)
    assert out.stdout.split() == ["False", "False", "True"]


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
