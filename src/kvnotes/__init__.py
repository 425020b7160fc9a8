"""kvnotes: a language model's KV cache as an editable, composable notebook.

Keys are stored post-RoPE, as transformers caches hold them; every notebook operation returns a
new notebook. See the README for the tour and ``docs/`` for the guide.
"""

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
from kvnotes.eval.fidelity import FidelityReport, fidelity
from kvnotes.ops.edit import EditReport, edit
from kvnotes.ops.store import SkillLibrary
from kvnotes.ops.trace import TraceResult, trace

__version__ = "0.1.0"

__all__ = [
    "Document", "Field", "Engine", "Generation", "Notebook", "Span", "LayerKV", "SkillLibrary",
    "FidelityReport", "fidelity", "load", "edit", "EditReport", "trace", "TraceResult",
    "KvnotesError", "EmptyInputError", "NotebookFileError", "NotebookMismatchError",
    "PositionError", "UnknownFieldError", "UnknownModelError", "UnsupportedModelError",
]
