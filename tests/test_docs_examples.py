"""The examples a user reads run: every ```python block of README.md and docs/**/*.md (the
guides, the benchmark pages, the results), and the ``>>>`` examples in kvnotes' docstrings.

A block that needs something a test machine does not have says so in the line before it,
``<!-- needs: server -->`` (a running vLLM server); it is still compiled, and skipped with that
reason. The blocks of one file share a namespace and run in order, as a reader would paste them.
``kvnotes.load`` of a bundled alias hands back the session's engine (conftest), so each real model
loads once per test session.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvnotes

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NEEDS = {"server": "needs a running vLLM server (kvnotes serve)"}
BLOCK = re.compile(r"(?:<!--\s*needs:\s*(?P<needs>[\w-]+)\s*-->\s*\n)?```python\n(?P<code>.*?)```",
                   re.S)
ALIASES = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    code: str
    needs: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, text.count("\n", 0, m.start("code")) + 1, m.group("code"), m.group("needs"))
            for m in BLOCK.finditer(text)]


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
DOCS_WITH_CODE = [doc for doc in DOCS if blocks(doc)]


def test_the_readme_and_docs_have_python_examples():
    assert len(ALL_BLOCKS) >= 8
    assert any(b.doc.name == "README.md" for b in ALL_BLOCKS)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.name)
def test_every_block_compiles_and_names_a_known_need(block: Block):
    compile(block.code, block.name, "exec")
    assert block.needs is None or block.needs in NEEDS, (
        f"{block.name}: unknown <!-- needs: {block.needs} -->; known: {', '.join(NEEDS)}")


def test_no_example_calls_the_removed_engine_edit():
    offenders = [b.name for b in ALL_BLOCKS if "engine.edit(" in b.code]
    assert offenders == []


@pytest.mark.real
@pytest.mark.parametrize("doc", DOCS_WITH_CODE, ids=lambda d: str(d.relative_to(ROOT)))
def test_doc_examples_run(doc: Path, request, tmp_path, monkeypatch):
    text = doc.read_text()
    engines = {alias: request.getfixturevalue(fixture) for alias, fixture in ALIASES.items()
               if f'kvnotes.load("{alias}")' in text}
    real_load = kvnotes.load

    def load(model, *args, **kwargs):
        if model in engines and not args and not kwargs:
            return engines[model]
        return real_load(model, *args, **kwargs)

    monkeypatch.setattr(kvnotes, "load", load)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    skipped = []
    for block in blocks(doc):
        if block.needs:
            skipped.append(f"{block.name}: {NEEDS[block.needs]}")
            continue
        code = block.code.replace("/tmp/", f"{tmp_path}/")
        exec(compile(code, block.name, "exec"), namespace)
    if skipped:
        pytest.skip("ran every other block; " + "; ".join(skipped))


# ---- docstring examples ------------------------------------------------------------------------

def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(kvnotes.__path__, "kvnotes."))


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as err:  # only the connector's modules import vLLM
        if "vllm" in str(err):
            pytest.skip(f"{name} needs vLLM, which lives in .venv-vllm")
        raise


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str, tiny_llama):
    module = _import(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {**vars(module), "engine": tiny_llama, "kvnotes": kvnotes}
    for test in finder.find(module, name, globs=globs):
        runner.run(test, clear_globs=False)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} docstring examples in {name} failed")
