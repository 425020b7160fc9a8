"""kvnotes: a language model's KV cache as an editable, composable notebook.

Keys are stored post-RoPE, as transformers caches hold them; every notebook operation returns a
new notebook. See the README for the tour and ``docs/`` for the guide.
"""

from kvnotes.document import Document, Field
from kvnotes.engine import Engine, Generation
from kvnotes.errors import (
    EmptyInputError,
    KvnotesError,
    NotebookFileError,
    NotebookMismatchError,
    PositionError,
    UnknownFieldError,
    UnknownModelError,
    UnsupportedModelError,
)
from kvnotes.fidelity import FidelityReport, fidelity
from kvnotes.models import load
from kvnotes.notebook import LayerKV, Notebook, Span
from kvnotes.store import SkillLibrary

__version__ = "0.1.0"

__all__ = [
    "Document", "Field", "Engine", "Generation", "Notebook", "Span", "LayerKV", "SkillLibrary",
    "FidelityReport", "fidelity", "load",
    "KvnotesError", "EmptyInputError", "NotebookFileError", "NotebookMismatchError",
    "PositionError", "UnknownFieldError", "UnknownModelError", "UnsupportedModelError",
]


def __getattr__(name: str):  # later capabilities load lazily so `import kvnotes` stays light
    if name == "trace":
        from kvnotes.trace import trace

        return trace
    raise AttributeError(f"module 'kvnotes' has no attribute {name!r}")
