"""kvnotes: a language model's KV cache as an editable, composable notebook.

Keys are stored post-RoPE, as transformers caches hold them; every notebook operation returns a
new notebook. See the README for the tour and ``docs/guide/`` for the guide.

The public names below are imported on first use (PEP 562), so importing a part of kvnotes
(``kvnotes.serving.vllm.connector`` in vLLM's process) does not import the engine or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.15.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Document": "kvnotes.core.document",
    "Field": "kvnotes.core.document",
    "Engine": "kvnotes.core.engine",
    "Generation": "kvnotes.core.engine",
    "Notebook": "kvnotes.core.notebook",
    "Span": "kvnotes.core.notebook",
    "LayerKV": "kvnotes.core.notebook",
    "Repair": "kvnotes.core.repair",
    "NO_REPAIR": "kvnotes.core.repair",
    "SkillLibrary": "kvnotes.ops.store",
    "FidelityReport": "kvnotes.eval.fidelity",
    "fidelity": "kvnotes.eval.fidelity",
    "load": "kvnotes.core.models",
    "edit": "kvnotes.ops.edit",
    "EditReport": "kvnotes.ops.edit",
    "trace": "kvnotes.ops.trace",
    "TraceResult": "kvnotes.ops.trace",
    "KvnotesError": "kvnotes.core.errors",
    "EmptyInputError": "kvnotes.core.errors",
    "NotebookFileError": "kvnotes.core.errors",
    "NotebookMismatchError": "kvnotes.core.errors",
    "PositionError": "kvnotes.core.errors",
    "UnknownFieldError": "kvnotes.core.errors",
    "UnknownModelError": "kvnotes.core.errors",
    "UnsupportedModelError": "kvnotes.core.errors",
}

__all__ = [
    "Document", "Field", "Engine", "Generation", "Notebook", "Span", "LayerKV", "Repair",
    "NO_REPAIR", "SkillLibrary", "FidelityReport", "fidelity", "load", "edit", "EditReport",
    "trace", "TraceResult",
    "KvnotesError", "EmptyInputError", "NotebookFileError", "NotebookMismatchError",
    "PositionError", "UnknownFieldError", "UnknownModelError", "UnsupportedModelError",
]  # the same names as _EXPORTS (a literal, so linters and type checkers read it)

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports these
    from kvnotes.core.document import Document, Field
    from kvnotes.core.engine import Engine, Generation
    from kvnotes.core.errors import (
        EmptyInputError,
        KvnotesError,
        NotebookFileError,
        NotebookMismatchError,
        PositionError,
        UnknownFieldError,
        UnknownModelError,
        UnsupportedModelError,
    )
    from kvnotes.core.models import load
    from kvnotes.core.notebook import LayerKV, Notebook, Span
    from kvnotes.core.repair import NO_REPAIR, Repair
    from kvnotes.eval.fidelity import FidelityReport, fidelity
    from kvnotes.ops.edit import EditReport, edit
    from kvnotes.ops.store import SkillLibrary
    from kvnotes.ops.trace import TraceResult, trace


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept here afterwards."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvnotes' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
