"""The public names in ``kvnotes`` stay what they are, whatever gets imported later."""

from __future__ import annotations

import importlib

from conftest import make_tiny_engine

import kvnotes
from kvnotes.core.document import Document, Field


def test_trace_is_callable_repeatedly_and_after_importing_suite_and_cli(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    doc = Document(["Colour: ", Field("colour", "red"), ". The parcel left on Tuesday.\n"])
    options = kvnotes.ops.trace.TraceOptions(by_layer=False, position_bins=1)

    def run() -> kvnotes.TraceResult:
        return kvnotes.trace(engine, doc, field="colour", new_value="blue",
                             query=" Which colour? Answer:", answers=(" blue", " red"),
                             options=options)

    first = run()
    assert run() == first  # a second call: the function, not a module, and deterministic
    for module in ("kvnotes.eval.trace_suite", "kvnotes.cli", "kvnotes.cli.trace"):
        importlib.import_module(module)
        assert callable(kvnotes.trace), f"importing {module} replaced kvnotes.trace"
        assert run() == first
