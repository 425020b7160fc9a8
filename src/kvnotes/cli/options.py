"""Options every model-loading command shares: ``--device`` and ``--dtype``, the one loader,
and :class:`ModelOptions`, the model a command loads, gathered once.

Examples::

    kvnotes demo --device cuda --dtype bfloat16
    kvnotes trace -m smollm2-135m --device cpu --dtype float32

Both are checked before any weights are read (:func:`kvnotes.core.validate.model_device` and
``model_dtype``): ``--device cuda`` on a machine without CUDA fails in one line, at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

DEVICE_HELP = "torch device for the model: cpu, cuda, cuda:1, mps (checked before loading)"
DTYPE_HELP = "model dtype: float32, bfloat16, float16 or float64"


def default_of(config: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``config``: a command's option defaults are
    the library configs', read from them, never written again.

    Example:
        >>> from kvnotes.serving.front.config import LearnConfig
        >>> default_of(LearnConfig, "after")
        2
    """
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise AssertionError(f"{config.__name__}.{name} has no default")
    raise AssertionError(f"{config.__name__} has no field {name!r}")


def device_option(default: str = "cpu") -> Any:
    """The ``--device`` option (a fresh typer option per command)."""
    return typer.Option(default, "--device", help=DEVICE_HELP)


def dtype_option(default: str = "float32") -> Any:
    """The ``--dtype`` option (a fresh typer option per command)."""
    return typer.Option(default, "--dtype", help=DTYPE_HELP)


def checked(device: str, dtype: str) -> tuple[str, str]:
    """``(device, dtype)`` validated (a clear ``InvalidArgumentError`` otherwise), as names."""
    from kvnotes.core import validate

    dev = validate.model_device(device)
    dt = validate.model_dtype(dtype)
    return str(dev), str(dt).removeprefix("torch.")


def load_engine(model: str, device: str = "cpu", dtype: str = "float32") -> Engine:
    """``kvnotes.load(model, device=..., dtype=...)``: every command loads through here."""
    from kvnotes.core.models import load

    return load(model, device=device, dtype=dtype)


@dataclass(frozen=True)
class ModelOptions:
    """The model a command loads and how: ``--model``, ``--device``, ``--dtype``, ``--threads``.

    ``threads``: torch's CPU threads; None sets the physical cores (more only adds contention),
    0 leaves torch's own setting (``kvnotes trace --threads 0``; the other commands' ``--threads
    0`` means the physical cores, so they pass ``threads or None``).
    """

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None

    def load(self) -> Engine:
        """Set the threads, then load the engine through :func:`load_engine`."""
        if self.threads != 0:
            from kvnotes.core.machine import set_threads

            set_threads(self.threads)
        return load_engine(self.model, self.device, self.dtype)
