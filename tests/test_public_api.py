"""The public names in ``kvnotes``: imported on first use, the same whatever gets imported
later, the version written once."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest
from conftest import make_tiny_engine

import kvnotes
from kvnotes.core.document import Document, Field
from kvnotes.ops.trace import TraceOptions

ROOT = Path(__file__).resolve().parents[1]


def test_trace_is_callable_repeatedly_and_after_importing_suite_and_cli(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    doc = Document(["Colour: ", Field("colour", "red"), ". The parcel left on Tuesday.\n"])
    options = TraceOptions(by_layer=False, position_bins=1)

    def run() -> kvnotes.TraceResult:
        return kvnotes.trace(engine, doc, field="colour", new_value="blue",
                             query=" Which colour? Answer:", answers=(" blue", " red"),
                             options=options)

    first = run()
    assert run() == first  # a second call: the function, not a module, and deterministic
    for module in ("kvnotes.research.trace.suite", "kvnotes.cli", "kvnotes.cli.trace"):
        importlib.import_module(module)
        assert callable(kvnotes.trace), f"importing {module} replaced kvnotes.trace"
        assert run() == first


def test_every_public_name_resolves_from_its_module():
    assert sorted(kvnotes.__all__) == sorted(kvnotes._EXPORTS)
    for name, module in kvnotes._EXPORTS.items():
        assert getattr(kvnotes, name) is getattr(importlib.import_module(module), name), name
    assert set(kvnotes.__all__) <= set(dir(kvnotes))
    with pytest.raises(AttributeError, match="module 'kvnotes' has no attribute 'Engin'"):
        kvnotes.Engin  # noqa: B018


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvnotes.__version__"}
    # the changelog's newest entry is this version
    changelog = (ROOT / "CHANGELOG.md").read_text("utf-8")
    newest = next(line for line in changelog.splitlines() if line.startswith("## "))
    assert newest == f"## {kvnotes.__version__}"
